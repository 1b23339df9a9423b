"""Polos (Wada et al., CVPR 2024): a metric learned from human judgments (Polaris) on SimCSE-RoBERTa sentence
embeddings of the candidate and each reference and CLIP ViT-B/32 embeddings of the image and texts; the score is
the highest regressor output over the references (see :mod:`capeval_plugins.models.encoders.polos`).

The weights are the released checkpoint (``reprod.ckpt``) converted by ``capeval convert polos``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from capeval_plugins.contract import Batch, MetricInfo, ModelConfig, PointwiseMetric, Requirement, bounded
from capeval_plugins.resources import loading
from capeval_plugins.models.encoders import EncoderSpec
from capeval_plugins.models.encoders.openai_clip import OfficialClip, converted_model_dir
from capeval_plugins.core.messages import install_extra, warn_once
from capeval_plugins.resources.releases import RELEASES

if TYPE_CHECKING:  # the model imports transformers' model classes: only when one is loaded (``capeval list`` is fast)
    from capeval_plugins.models.encoders.polos import PolosModel

CITATION = """@inproceedings{wada2024polos,
  title     = {{Polos: Multimodal Metric Learning from Human Feedback for Image Captioning}},
  author    = {Wada, Yuiga and Kaneda, Kanta and Saito, Daichi and Sugiura, Komei},
  booktitle = {Proceedings of CVPR},
  year      = {2024}
}"""
RELEASE = RELEASES["polos"].url  # reprod.zip, as the keio-smilab24/Polos README links it


@dataclass
class PolosConfig(ModelConfig):
    batch_size: int = 32
    # "" = the folder `capeval convert polos` writes; or any converted Polos folder.
    model: str = ""
    # None: the official scores with batch_size=1 (each sample alone). N: the official predict(batch_size=N) (the
    # README's example uses 8): samples in input order in batches of N share the text encoder's layer-norm
    # statistics (candidates together, each reference slot together) and use as many references as the sample
    # of their batch with the fewest. Needs the whole corpus in one call.
    official_batch_size: int | None = bounded(None, ge=1)


class Polos(PointwiseMetric):
    info = MetricInfo(
        name="polos",
        display_name="Polos",
        description=(
            "A learned metric (trained on Polaris human judgments): SimCSE-RoBERTa embeddings of the candidate and "
            "each reference and CLIP embeddings of the image and texts feed a regressor; the best reference's "
            "output in [0, 1]. Needs references and the released checkpoint."
        ),
        citation=CITATION,
        references="always",
        images="always",
        score_range=(0.0, 1.0),
        paper="https://arxiv.org/abs/2402.18091",
        paper_config={"checkpoint": "reprod.ckpt", "text encoder": "princeton-nlp/sup-simcse-roberta-base",
                      "clip": "ViT-B/32", "regressor": "6144-2304-1152-1, Tanh, sigmoid"},
        codebase_urls=("https://github.com/keio-smilab24/Polos",),
    )
    Config = PolosConfig
    extra_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **config) -> None:
        super().__init__(**config)
        # official_batch_size: per sample index, the (mean, variance) rows of its candidate and of each reference
        # it keeps, (K,) each; filled by prepare_corpus
        self._pooled: dict[int, tuple[tuple[Tensor, Tensor], list[tuple[Tensor, Tensor]]]] | None = None

    def checkpoint(self) -> str:
        return self.config.model or str(converted_model_dir("polos"))

    def requirements(self) -> list[Requirement]:
        needs = super().requirements()
        if not self.config.model:
            needs.append(Requirement("model", self.checkpoint(), "the Polos weights",
                                     remedy=f"run `capeval fetch-weights polos` (downloads reprod.zip from {RELEASE}, "
                                            "checks and converts it), or unzip a copy and run `capeval convert polos "
                                            "reprod/reprod.ckpt`, or pass model=FOLDER"))
        needs.append(Requirement("module", "ftfy", "polos's CLIP text cleaning (as clip.tokenize)",
                                 install_extra("pacs")))
        return needs

    def spec(self, folder: str) -> EncoderSpec:
        return EncoderSpec.from_config(self.config, model=folder)

    @property
    def model(self) -> PolosModel:
        from capeval_plugins.models.encoders.polos import PolosModel

        return loading.load_spec(PolosModel, self.spec(self.checkpoint()))

    @property
    def clip(self) -> OfficialClip:
        return OfficialClip.shared(self.spec(str(Path(self.checkpoint()) / "clip")))

    @property
    def tokenizer(self):
        # RoBERTa's, named directly: AutoTokenizer would read the folder's config.json (a Polos one, unknown to
        # AutoConfig) and log a warning about model types on every load.
        from transformers import RobertaTokenizer

        cfg = self.config
        return loading.load_processor(RobertaTokenizer, self.checkpoint(), revision=cfg.revision,
                                      local_files_only=cfg.local_files_only)

    def tokens(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        model, tokenizer = self.model, self.tokenizer
        limit = model.text_encoder.config.max_position_embeddings - 2  # RoBERTa's positions start after padding
        tokens = tokenizer(texts, padding=True, truncation=True, max_length=limit, return_tensors="pt")
        if tokens["attention_mask"].sum(-1).max() >= limit and any(
                len(ids) > limit for ids in tokenizer(texts, truncation=False)["input_ids"]):
            warn_once(("truncate", self.checkpoint()), f"polos: caption(s) longer than {limit} tokens are truncated "
                      "(the official code fails on them); reported once")
        device = loading.input_device(model, self.config.device)
        return tokens["input_ids"].to(device), tokens["attention_mask"].to(device)

    @torch.inference_mode()
    def sentence_embeddings(self, texts: list[str], statistics: tuple[Tensor, Tensor] | None = None) -> Tensor:
        return self.model.sentence_embeddings(*self.tokens(texts), statistics=statistics)

    # --- the official batched reading (official_batch_size) ------------------------------------------------------
    def whole_corpus_only(self) -> str | None:
        if self.config.official_batch_size is None:
            return None
        return ("polos: official_batch_size pools statistics over batches of the whole corpus: score the corpus in "
                "one call (capeval score, metric(...), evaluate's compute), not in streamed batches")

    def prepare_corpus(self, corpus: Batch) -> None:
        """With ``official_batch_size`` N: the layer-norm statistics of every official batch (input positions
        [kN, kN + N)), its candidates together and each reference slot together, from per-text sums."""
        size = self.config.official_batch_size
        if size is None:
            return
        if torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1:
            raise ValueError("polos: official_batch_size pools statistics over batches of the whole corpus; score it "
                             "in one process (not sharded over ranks)")
        from capeval_plugins.models.encoders.polos import pooled_statistics

        indices = corpus.indices.tolist()
        references = corpus.references or [[] for _ in indices]
        batch_of = [i // size for i in indices]
        slots: dict[int, int] = {}
        for b, refs in zip(batch_of, references):
            slots[b] = min(slots.get(b, len(refs)), len(refs))
        texts, groups = list(corpus.candidates), [(b, -1) for b in batch_of]
        for b, refs in zip(batch_of, references):
            texts += refs[: slots[b]]
            groups += [(b, j) for j in range(slots[b])]
        sums = self.text_sums(texts)
        group_id = {g: k for k, g in enumerate(dict.fromkeys(groups))}
        mean, variance = pooled_statistics(*sums, groups=torch.tensor([group_id[g] for g in groups]))
        pooled, row = {}, len(indices)
        for k, (index, b) in enumerate(zip(indices, batch_of)):
            pooled[index] = ((mean[k], variance[k]), [(mean[row + j], variance[row + j]) for j in range(slots[b])])
            row += slots[b]
        self._pooled = pooled

    def release_corpus(self) -> None:
        self._pooled = None

    def text_sums(self, texts: list[str]) -> tuple[Tensor, Tensor, Tensor]:
        """:func:`~capeval_plugins.models.encoders.polos.layer_sums` of each text (each distinct text run once, in
        chunks of ``batch_size``)."""
        distinct = list(dict.fromkeys(texts))
        parts = [self.model.text_statistics(*self.tokens(distinct[start:start + self.config.batch_size]))
                 for start in range(0, len(distinct), self.config.batch_size)]
        row = {t: k for k, t in enumerate(distinct)}
        pick = torch.tensor([row[t] for t in texts], dtype=torch.long)
        return tuple(torch.cat([p[i] for p in parts]).cpu()[pick] for i in range(3))

    def pooled_inputs(self, batch: Batch) -> tuple[list[list[str]], tuple[Tensor, Tensor]]:
        """The references the official batched reading keeps, and the statistics of every text of the batch
        (candidates, then the kept references flattened)."""
        if self._pooled is None or any(i not in self._pooled for i in batch.indices.tolist()):
            raise ValueError("polos: official_batch_size pools statistics over batches of the whole corpus: score the "
                             "corpus in one call (capeval score, metric(...), evaluate's compute), not in streamed "
                             "batches")
        rows = [self._pooled[i] for i in batch.indices.tolist()]
        references = [list(refs[: len(kept)]) for refs, (_, kept) in zip(batch.references, rows)]
        stats = [cand for cand, _ in rows] + [ref for _, kept in rows for ref in kept]
        return references, (torch.stack([m for m, _ in stats]), torch.stack([v for _, v in stats]))

    def score(self, batch: Batch) -> dict[str, Tensor]:
        from capeval_plugins.models.encoders.polos import flatten_references

        model, clip = self.model, self.clip
        prefix = model.config.prefix
        references, statistics = batch.references, None
        if self.config.official_batch_size is not None:
            references, statistics = self.pooled_inputs(batch)
        flat, owner = flatten_references(references)
        # Every text of the batch through each encoder once; each image once for all of its candidates.
        sentences = self.sentence_embeddings(list(batch.candidates) + flat, statistics)
        with torch.inference_mode():
            clip_texts = clip.text_features([prefix + t for t in list(batch.candidates) + flat])
            image = clip.image_features(batch.images)[batch.image_index.to(clip.device)]
            n = len(batch.candidates)
            device = sentences.device
            scores = model.score(sentences[:n], sentences[n:], owner.to(device), image.to(device),
                                 clip_texts[:n].to(device), clip_texts[n:].to(device))
        return {"score": scores.double().cpu()}


METRICS = [Polos]
