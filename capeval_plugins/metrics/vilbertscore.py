"""ViLBERTScore (Lee et al., Eval4NLP 2020): BERTScore on image-conditioned token embeddings.

The candidate and each reference are encoded together with the image; their text tokens are matched greedily
by cosine:

    P = 1/|x^| sum_{x^_i} max_{x_j} cos(x^_i, x_j)    R = 1/|x| sum_{x_j} max_{x^_i} cos(x_j, x^_i)    F = 2PR/(P+R)

and P, R, F are averaged over the references (official code). No idf.

Backbones:

- ``vilbert``, the paper's: ViLBERT or its 12-in-1 multi-task version, converted from the released checkpoint with
  ``capeval convert vilbert``, on precomputed detector regions read from a ``features`` folder (images are given
  as ids or paths; each one's ``<stem>.npy|.npz`` is looked up there). Tokens are read from the text stream after
  co-attention layer ``layer`` (default the 6th, the last); the matched tokens are the caption's word pieces and,
  with the multi-task model, the task token (as the official script matches them).
- ``vilt`` (the default model) and ``blip``: image-conditioned encoders from transformers that take pixels (see
  the metric card for how they differ).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from capeval_plugins.contract import Batch, MetricInfo, ModelConfig, PointwiseMetric, bounded
from capeval_plugins.core.bounds import MAX_SEED
from capeval_plugins.core import jsonio
from capeval_plugins.models.encoders.common import EncoderSpec
from capeval_plugins.models.encoders.conditioned import FAMILIES, ConditionedEncoder, model_family
from capeval_plugins.core.matching import greedy_prf, reduce_references, to_grid
from capeval_plugins.resources.regions import (DETECTOR_FEATURE_DIM, RegionFeatures, RegionFileError, check_region_file,
                                               find_region_file, read_region_file)
from capeval_plugins.inputs import ImageReader, ImageSource, InputError

CITATION = """@inproceedings{lee2020vilbertscore,
  title     = {{ViLBERTScore}: Evaluating Image Caption Using Vision-and-Language {BERT}},
  author    = {Lee, Hwanhee and Yoon, Seunghyun and Dernoncourt, Franck and Kim, Doo Soon and Bui, Trung and
               Jung, Kyomin},
  booktitle = {Proceedings of the First Workshop on Evaluation and Comparison of NLP Systems (Eval4NLP)},
  pages     = {34--39},
  year      = {2020},
  doi       = {10.18653/v1/2020.eval4nlp-1.4}
}"""


@dataclass
class ViLBERTScoreConfig(ModelConfig):
    # A ViLBERT folder written by `capeval convert vilbert` (the paper's backbone), or a ViLT / BLIP-ITM checkpoint.
    model: str = "dandelin/vilt-b32-mlm"
    # "vilbert", "vilt" or "blip"; None: the model's own (a features folder means ViLBERT).
    backbone: str | None = None
    # ViLBERT: folder of per-image region-feature files (<stem>.npy dicts or .npz), matched to images by stem.
    features: str | None = None
    # Text-token layer. ViLBERT: after co-attention layer k (1..6; -1 the last, the paper's 6th; 0 before the
    # first). ViLT/BLIP: hidden_states index (0 embeddings, -1 the last block).
    layer: int = -1
    # ViLBERT: read the text stream after the text layer that follows the chosen co-attention layer instead
    # (with layer=-1 the model's final text output, T11).
    after_text_layer: bool = False
    # ViLBERT 12-in-1 task token: None as the official script (7, COCO retrieval, when the model has task
    # tokens), -1 none, else that token.
    task_id: int | None = bounded(None, ge=-1)
    # Text limit in tokens with [CLS] and [SEP] (None: 37 for ViLBERT as the official script, else the model's).
    max_text_tokens: int | None = bounded(None, ge=1)
    # ViLT is pre-LayerNorm: apply its final LayerNorm to the chosen layer (the last layer then equals the
    # model's output).
    final_norm: bool = True
    # "mean" over references (official code); "max": P, R and F each the best over references.
    multi_reference: str = "mean"
    # ViLT's patch sampling: seed of each image's draw, and how many patches (None: the checkpoint's
    # max_image_length; -1 all patches, in a random order that does not change the result).
    seed: int = bounded(0, ge=0, le=MAX_SEED)
    max_image_patches: int | None = bounded(None, ge=-1)

    # Options that name local files or folders (checked before scoring by a runner that reads this).
    input_paths: ClassVar[tuple[str, ...]] = ("model", "features")


# Options that only one backbone reads: setting them away from their default for another is an error.
BACKBONE_OPTIONS = {"features": "vilbert", "after_text_layer": "vilbert", "task_id": "vilbert",
                    "final_norm": "vilt", "seed": "vilt", "max_image_patches": "vilt"}


def image_name(image: Any, index: int) -> str:
    """The file name (or id) of an image given as an id, a path or a ``{"path": ...}`` dict."""
    if isinstance(image, dict):
        if image.get("path"):
            image = image["path"]
        else:
            raise InputError(f"sample {index}: got image {'bytes' if image.get('bytes') else 'dict'} without a path; "
                             "with region features an image is given by its id or path, to find its feature file")
    if isinstance(image, (int, np.integer)) and not isinstance(image, bool):
        return str(int(image))
    if isinstance(image, (str, os.PathLike)) and os.path.basename(os.fspath(image)):
        return os.path.basename(os.fspath(image))
    raise InputError(f"sample {index}: with region features an image is given by its id or path (its feature file "
                     f"is found by name), got {type(image).__name__} {image!r:.60}")


class RegionFeatureReader(ImageReader):
    """Images as ids or paths whose region features are in ``folder``: each is mapped to its ``<stem>.npy`` or
    ``<stem>.npz`` and the file checked up front (once per file), so a bad one is reported, naming the sample and
    image, before any model loads."""

    def __init__(self, folder: str | os.PathLike, feature_dim: int = DETECTOR_FEATURE_DIM):
        if not os.path.isdir(folder):
            raise InputError(f"vilbertscore: features folder not found: {folder}")
        self.folder = os.fspath(folder)
        self.feature_dim = feature_dim
        self._checked: dict[str, tuple[int, int]] = {}

    def source(self, image: Any, index: int) -> ImageSource:
        name = image_name(image, index)
        path, tried = find_region_file(self.folder, name)
        if path is None:
            raise InputError(f"sample {index}: no region features for image {name!r} in {self.folder} (looked for "
                             f"{', '.join(p.name for p in tried)})")
        key = os.path.realpath(path)
        stat = os.stat(key)
        if self._checked.get(key) != (stat.st_mtime_ns, stat.st_size):
            try:
                check_region_file(path, self.feature_dim)
            except RegionFileError as err:
                raise InputError(f"sample {index}: image {name!r}: {err}") from None
            self._checked[key] = (stat.st_mtime_ns, stat.st_size)
        return ImageSource("regions", key, ("regions", key), index, reader=self)

    def load(self, source: ImageSource) -> RegionFeatures:
        try:
            return read_region_file(source.value, self.feature_dim)
        except RegionFileError as err:
            raise InputError(f"sample {source.index}: {err}") from None


def _local_model_type(model: str) -> str | None:
    config = os.path.join(model, "config.json")
    if not os.path.isfile(config):
        return None
    with open(config, encoding="utf-8") as f:
        return jsonio.load(f).get("model_type")


class ViLBERTScore(PointwiseMetric):
    info = MetricInfo(
        name="vilbertscore",
        display_name="ViLBERTScore",
        description=(
            "BERTScore on image-conditioned token embeddings: candidate and references are each encoded with "
            "the image (ViLBERT on region features, as the paper, or ViLT / BLIP on pixels), and their tokens "
            "matched greedily by cosine; F is the score, P and R extras, averaged over references."
        ),
        citation=CITATION,
        references="always",
        images="always",
        score_range=None,
        paper="https://aclanthology.org/2020.eval4nlp-1.4/",
        paper_config={"backbone": "vilbert (12-in-1 multi_task_model.bin for ViLBERTScore*, a pretrained ViLBERT "
                                  "for the plain rows)",
                      "regions": "100 Faster R-CNN ResNeXt-152 (Visual Genome) boxes plus the global region",
                      "layer": "text stream after the 6th (last) co-attention layer", "task_id": 7,
                      "multi_reference": "mean", "idf": False},
        codebase_urls=("https://github.com/hwanheelee1993/ViLBERTScore",),
    )
    Config = ViLBERTScoreConfig
    extra_names: ClassVar[tuple[str, ...]] = ("precision", "recall", "f1")
    score_aliases = ("f1",)
    mean_extras: ClassVar[tuple[str, ...]] = ("precision", "recall")

    def __init__(self, **config) -> None:
        super().__init__(**config)
        cfg = self.config
        if cfg.multi_reference not in ("mean", "max"):
            raise ValueError(f"vilbertscore: multi_reference must be 'mean' or 'max', got {cfg.multi_reference!r}")
        if cfg.backbone not in (None, *FAMILIES):
            raise ValueError(f"vilbertscore: backbone must be one of {FAMILIES} (or None), got {cfg.backbone!r}")
        if cfg.max_image_patches == 0:
            raise ValueError("vilbertscore: option max_image_patches must be -1 (all), None or >= 1, got 0")
        if cfg.backbone is not None:
            self._check_options(cfg.backbone)
        self._reader: RegionFeatureReader | None = None
        self._family: str | None = None

    def _check_options(self, family: str) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self.Config)}
        for name, owner in BACKBONE_OPTIONS.items():
            if owner != family and getattr(self.config, name) != defaults[name]:
                raise ValueError(f"vilbertscore: option {name} applies to the {owner} backbone only, not {family}")

    def reads_regions(self) -> bool:
        """Whether images are region-feature ids (the ViLBERT backbone), decided without loading anything."""
        cfg = self.config
        if cfg.backbone is not None:
            return cfg.backbone == "vilbert"
        return cfg.features is not None or _local_model_type(cfg.model) == "vilbert"

    def image_reader(self) -> RegionFeatureReader | None:
        if not self.reads_regions():
            return None
        if self.config.features is None:
            raise InputError("vilbertscore: the ViLBERT backbone reads precomputed region features: pass "
                             "features=FOLDER (one <image stem>.npy or .npz per image; see the metric card)")
        if self._reader is None:
            self._reader = RegionFeatureReader(self.config.features)
        return self._reader

    @property
    def encoder(self) -> ConditionedEncoder:
        cfg = self.config
        spec = EncoderSpec.from_config(cfg)
        if self._family is None:
            family = model_family(spec)
            wanted = cfg.backbone or ("vilbert" if cfg.features is not None else family)
            if wanted != family:
                hint = (" (convert a released checkpoint with `capeval convert vilbert SRC DST` and pass model=DST)"
                        if wanted == "vilbert" else "")
                raise ValueError(f"vilbertscore: the {wanted} backbone needs a {wanted} checkpoint, but {cfg.model} "
                                 f"is {family}{hint}")
            self._check_options(family)
            self._family = family
        options: dict[str, Any] = {"layer": cfg.layer, "max_tokens": cfg.max_text_tokens}
        if self._family == "vilt":
            options.update(final_norm=cfg.final_norm, seed=cfg.seed, max_image_patches=cfg.max_image_patches)
        elif self._family == "vilbert":
            options.update(task_id=cfg.task_id, after_text_layer=cfg.after_text_layer)
        return ConditionedEncoder.shared(spec, self._family, **options)

    def score(self, batch: Batch) -> dict[str, Tensor]:
        enc, n = self.encoder, len(batch)
        context = enc.encode_images(batch.images)  # each distinct image once
        owner, slot, refs = [], [], []
        for i, sample_refs in enumerate(batch.references):
            owner += [i] * len(sample_refs)
            slot += list(range(len(sample_refs)))
            refs += sample_refs
        image_of = batch.image_index.tolist()
        # Each distinct (image, text) once: candidates and every reference of the batch in one pass.
        keys = [(image_of[i], t) for i, t in enumerate(batch.candidates)]
        keys += [(image_of[o], t) for o, t in zip(owner, refs)]
        unique = list(dict.fromkeys(keys))
        row = {k: i for i, k in enumerate(unique)}
        emb = enc.embed([t for _, t in unique], torch.tensor([img for img, _ in unique]), context,
                        batch_size=self.config.batch_size)
        cand = emb.rows(torch.tensor([row[k] for k in keys[:n]])).rows(torch.tensor(owner))
        ref = emb.rows(torch.tensor([row[k] for k in keys[n:]]))
        p, r, f = greedy_prf(cand.embeddings, cand.attention_mask & ~cand.special,
                             ref.embeddings, ref.attention_mask & ~ref.special)
        owner_t, slot_t = torch.tensor(owner, device=p.device), torch.tensor(slot, device=p.device)
        how = self.config.multi_reference
        out = {}
        for name, values in (("precision", p), ("recall", r), ("f1", f)):
            grid, valid = to_grid(values, owner_t, slot_t, n)
            out[name] = reduce_references(grid, valid, how).cpu()
        return {"score": out["f1"].clone(), **out}


METRICS = [ViLBERTScore]
