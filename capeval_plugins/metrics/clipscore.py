"""CLIPScore and RefCLIPScore (Hessel et al., EMNLP 2021).

CLIP-S(c, v) = w * max(cos(E_img(v), E_txt(prefix + c)), 0), w = 2.5, prefix "A photo depicts ".
RefCLIP-S(c, R, v) = H-Mean(CLIP-S(c, v), max(max_{r in R} cos(E_txt(c), E_txt(r)), 0)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from capeval_plugins.contract import Batch, MetricInfo, ModelConfig, PointwiseMetric, bounded
from capeval_plugins.core.clip_score import best_reference_similarity, clip_s, cosine, harmonic_mean
from capeval_plugins.core.encoders import ClipEncoder, EncoderSpec
from capeval_plugins.core.encoders.clip import dual_encoder_problem

CITATION = """@inproceedings{hessel2021clipscore,
  title     = {{CLIPScore}: A Reference-free Evaluation Metric for Image Captioning},
  author    = {Hessel, Jack and Holtzman, Ari and Forbes, Maxwell and Le Bras, Ronan and Choi, Yejin},
  booktitle = {Proceedings of EMNLP},
  year      = {2021}
}"""


@dataclass
class CLIPScoreConfig(ModelConfig):
    model: str = "openai/clip-vit-base-patch32"
    w: float = bounded(2.5, gt=0)
    prefix: str = "A photo depicts"
    # The paper does not say whether references get the prefix; the official code prefixes every text.
    prefix_references: bool = True
    # The paper clamps the reference similarity at 0; the official code does not.
    clamp_reference: bool = True


def with_prefix(prefix: str, text: str) -> str:
    # The official code adds a space after the prefix when it has none.
    if not prefix:
        return text
    return prefix + text if prefix.endswith(" ") else f"{prefix} {text}"


class CLIPScore(PointwiseMetric):
    info = MetricInfo(
        name="clipscore",
        display_name="CLIPScore",
        description=(
            "Reference-free image-caption compatibility: w * max(cos(CLIP image, CLIP text), 0) with the text "
            "prefixed by 'A photo depicts'. With references, RefCLIPScore comes as an extra."
        ),
        citation=CITATION,
        references="optional",
        images="always",
        score_range=(0.0, 2.5),
        paper="https://arxiv.org/abs/2104.08718",
        paper_config={"model": "openai/clip-vit-base-patch32", "w": 2.5, "prefix": "A photo depicts"},
        codebase_urls=("https://github.com/jmhessel/clipscore",),
    )
    Config = CLIPScoreConfig
    model_kind_problem = staticmethod(dual_encoder_problem)  # a --model shared by several metrics, checked unloaded
    extra_names: ClassVar[tuple[str, ...]] = ("cosine", "reference_similarity", "refclipscore")
    optional_extras: ClassVar[tuple[str, ...]] = ("reference_similarity", "refclipscore")
    mean_extras: ClassVar[tuple[str, ...]] = ("refclipscore",)

    @property
    def encoder(self) -> ClipEncoder:
        return ClipEncoder.shared(EncoderSpec.from_config(self.config))

    def score(self, batch: Batch) -> dict[str, Tensor]:
        cfg, enc = self.config, self.encoder
        image_feats = enc.encode_images(batch.images)[batch.image_index.to(enc.device)]
        texts = [with_prefix(cfg.prefix, c) for c in batch.candidates]
        n = len(texts)
        flat_refs, owner = [], []
        for i, refs in enumerate(batch.references or ()):
            flat_refs += [with_prefix(cfg.prefix, r) if cfg.prefix_references else r for r in refs]
            owner += [i] * len(refs)
        # Candidates and every reference of the batch in one pass through the text encoder.
        text_feats = enc.encode_texts(texts + flat_refs)
        cand = text_feats[:n]
        cos = cosine(image_feats, cand)
        score = clip_s(cos, cfg.w)
        ref_sim = torch.full_like(score, float("nan"))
        refclip = torch.full_like(score, float("nan"))
        if flat_refs:
            owner_t = torch.tensor(owner, device=cand.device)
            ref_sim = best_reference_similarity(cand, text_feats[n:], owner_t, cfg.clamp_reference)
            refclip = harmonic_mean(score, ref_sim)
        return self.arrange(score, cos, ref_sim, refclip)

    def arrange(self, clip_s: Tensor, cosine: Tensor, ref_sim: Tensor, refclip: Tensor) -> dict[str, Tensor]:
        return {"score": clip_s, "cosine": cosine, "reference_similarity": ref_sim, "refclipscore": refclip}


class RefCLIPScore(CLIPScore):
    info = MetricInfo(
        name="refclipscore",
        display_name="RefCLIPScore",
        description=(
            "Harmonic mean of CLIPScore and the (clamped) best cosine between the candidate and a reference "
            "in CLIP text space."
        ),
        citation=CITATION,
        references="always",
        images="always",
        score_range=(0.0, 2.5 * 1.0 * 2 / 3.5),
        paper="https://arxiv.org/abs/2104.08718",
        paper_config={"model": "openai/clip-vit-base-patch32", "w": 2.5, "prefix": "A photo depicts"},
        codebase_urls=("https://github.com/jmhessel/clipscore",),
    )
    extra_names: ClassVar[tuple[str, ...]] = ("clipscore", "cosine", "reference_similarity")
    optional_extras: ClassVar[tuple[str, ...]] = ()
    mean_extras: ClassVar[tuple[str, ...]] = ("clipscore",)

    def arrange(self, clip_s: Tensor, cosine: Tensor, ref_sim: Tensor, refclip: Tensor) -> dict[str, Tensor]:
        return {"score": refclip, "clipscore": clip_s, "cosine": cosine, "reference_similarity": ref_sim}


METRICS = [CLIPScore, RefCLIPScore]
