"""ViLBERTScore (Lee et al., Eval4NLP 2020): BERTScore on image-conditioned token embeddings.

The candidate and each reference are encoded together with the image; their text tokens ([CLS], [SEP]
excluded) are matched greedily by cosine:

    P = 1/|x^| sum_{x^_i} max_{x_j} cos(x^_i, x_j)    R = 1/|x| sum_{x_j} max_{x^_i} cos(x_j, x^_i)    F = 2PR/(P+R)

and P, R, F are averaged over the references (official code). The 2020 backbone (ViLBERT 12-in-1 on
Detectron region features) is not in transformers; this port runs ViLT (default) or BLIP's image-grounded
text encoder (see the metric card for how that differs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from capeval_plugins.contract import Batch, MetricInfo, ModelConfig, PointwiseMetric
from capeval_plugins.core.encoders.common import EncoderSpec
from capeval_plugins.core.encoders.conditioned import ConditionedEncoder
from capeval_plugins.core.matching import greedy_prf, reduce_references, to_grid

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
    # ViLT, the nearest single-stream image-conditioned BERT in transformers; BLIP ITM checkpoints also load.
    model: str = "dandelin/vilt-b32-mlm"
    # hidden_states index: -1 the last block (the paper's main results use ViLBERT's final text layer).
    layer: int = -1
    # ViLT is pre-LayerNorm: apply its final LayerNorm to the chosen layer (the last layer then equals the
    # model's output). No effect for BLIP.
    final_norm: bool = True
    # "mean" over references (official code); "max": P, R and F each the best over references.
    multi_reference: str = "mean"
    # ViLT's patch sampling: seed of each image's draw, and how many patches (None: the checkpoint's
    # max_image_length; -1 all patches, in a random order that does not change the result).
    seed: int = 0
    max_image_patches: int | None = None


class ViLBERTScore(PointwiseMetric):
    info = MetricInfo(
        name="vilbertscore",
        display_name="ViLBERTScore",
        description=(
            "BERTScore on image-conditioned token embeddings: candidate and references are each encoded with "
            "the image (ViLT by default), and their tokens matched greedily by cosine; F is the score, P and R "
            "extras, averaged over references."
        ),
        citation=CITATION,
        references="always",
        images="always",
        score_range=None,
        paper="https://aclanthology.org/2020.eval4nlp-1.4/",
        paper_config={"backbone": "ViLBERT 12-in-1 (not in transformers)", "layer": "last text layer",
                      "multi_reference": "mean", "idf": False},
        codebase_urls=("https://github.com/hwanheelee1993/ViLBERTScore",),
    )
    Config = ViLBERTScoreConfig
    extra_names: ClassVar[tuple[str, ...]] = ("precision", "recall", "f1")
    mean_extras: ClassVar[tuple[str, ...]] = ("precision", "recall")

    def __init__(self, **config) -> None:
        super().__init__(**config)
        how = self.config.multi_reference
        if how not in ("mean", "max"):
            raise ValueError(f"vilbertscore: multi_reference must be 'mean' or 'max', got {how!r}")

    @property
    def encoder(self) -> ConditionedEncoder:
        cfg = self.config
        return ConditionedEncoder.shared(EncoderSpec.from_config(cfg), cfg.layer, cfg.final_norm, cfg.seed,
                                         cfg.max_image_patches)

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
