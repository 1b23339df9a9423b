"""Redemption Score (Dahal et al., 2025): a calibrated fusion of MID, DINO similarity of cycle-generated
images and BERTScore.

    RS = alpha * MID' + beta * DINO_sim + gamma * BERTScore,   alpha + beta + gamma = 1, all >= 0,

per sample, with MID' the sample's PMI mapped onto (0, 1) by Eq. 9, DINO_sim = (s1 + s2) / 2 and BERTScore
the best F1 over the references (Eq. 8); (alpha, beta, gamma) = (0.84, 0.08, 0.08) from a Kendall tau-c grid
search on Flickr8k-Expert (``capeval_plugins.core.fusion.calibrate`` / ``capeval calibrate`` redo it).

The three parts are the registered metrics ``mid``, ``dino_cycle`` and ``bertscore``, composed through the
registry; each keeps its own state (MID's fit stays a sum, so RS is DDP-safe like its parts).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch
from torch import Tensor

from capeval_plugins import registry
from capeval_plugins.composite import Part, derive_config, part_options
from capeval_plugins.contract import (
    INDEX,
    CompositeMetric,
    Metric,
    MetricConfig,
    MetricInfo,
    MetricResult,
    bounded,
    nanmean,
)
from capeval_plugins.core.gaussian import normalize_pmi
from capeval_plugins.models.generation import SD3_MODEL
from capeval_plugins.metrics.bertscore import BERTScoreConfig
from capeval_plugins.metrics.dino_cycle import CITATION, DinoCycleConfig
from capeval_plugins.metrics.mid import MIDConfig

FUSIONS: tuple[str, ...] = ("additive", "multiplicative")
PAPER_WEIGHTS = (0.84, 0.08, 0.08)
# The paper's ablation rows (Flickr8k-Expert grid searches): weights (MID, DINO, BERTScore) and fusion.
# Table 5: MID^a DINO^b BERTScore^c (Eq. 11); Table 6: the three pairs of components, additive.
ABLATIONS: dict[str, tuple[tuple[float, float, float], str]] = {
    "multiplicative": ((0.12, 0.64, 0.24), "multiplicative"),
    "mid_bertscore": ((0.92, 0.0, 0.08), "additive"),
    "mid_dino": ((0.90, 0.10, 0.0), "additive"),
    "dino_bertscore": ((0.0, 0.62, 0.38), "additive"),
}

NORMALIZATIONS: dict[str, tuple[str, ...]] = {
    "mid": ("eq9", "none"),
    "dino": ("none", "unit"),
    "bertscore": ("none", "unit"),
}


@dataclass
class RedemptionOptions(MetricConfig):
    """Redemption Score's own options (the fusion); :data:`RedemptionConfig` adds every option of its parts."""

    # Fusion (paper Eq. 10); a component with weight 0 is not computed at all.
    mid_weight: float = bounded(0.84, ge=0, le=1)
    dino_weight: float = bounded(0.08, ge=0, le=1)
    bertscore_weight: float = bounded(0.08, ge=0, le=1)
    # "additive": Eq. 10, sum w_k s_k; "multiplicative": Eq. 11, prod max(s_k, 0)^w_k (Table 5's ablation).
    fusion: str = "additive"
    # A row of the paper's ablation tables by name (ABLATIONS): sets the weights and the fusion.
    ablation: str = "none"
    # How each component enters the sum: "eq9" = (p / (1 + |p|) + 1) / 2, "unit" = (s + 1) / 2, "none" = as is.
    mid_normalization: str = "eq9"
    dino_normalization: str = "none"
    bertscore_normalization: str = "none"

    def __post_init__(self) -> None:
        if self.ablation != "none":
            if self.ablation not in ABLATIONS:
                raise ValueError(f"ablation must be 'none' or one of {sorted(ABLATIONS)}, got {self.ablation!r}")
            given = (self.mid_weight, self.dino_weight, self.bertscore_weight)
            if given != PAPER_WEIGHTS or self.fusion != "additive":
                raise ValueError("ablation sets the weights and the fusion; do not pass them as well")
            (self.mid_weight, self.dino_weight, self.bertscore_weight), self.fusion = ABLATIONS[self.ablation]
        if self.fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {FUSIONS}, got {self.fusion!r}")
        weights = (self.mid_weight, self.dino_weight, self.bertscore_weight)  # each one's type and range: bounded()
        numbers_ = all(isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w) for w in weights)
        if numbers_ and not math.isclose(sum(weights), 1.0, abs_tol=1e-6):
            raise ValueError("mid_weight, dino_weight and bertscore_weight must sum to 1 (paper Eq. 10), got "
                             f"{weights}")
        for part, allowed in NORMALIZATIONS.items():
            value = getattr(self, f"{part}_normalization")
            if value not in allowed:
                raise ValueError(f"{part}_normalization must be one of {allowed}, got {value!r}")
        for part in PART_CONFIGS.values():  # each part's own checks (choices), now rather than when it is first built
            part.config(**part_options(self, part, SHARED))


# Component name (prefix of its extras) -> how its options appear here. Names kept from earlier releases are
# listed in ``names``; an option added to a part later appears as <prefix><option>.
PART_CONFIGS: dict[str, Part] = {
    "mid": Part(MIDConfig, "mid_",
                names={"model": "clip_model", "covariance_eps": "covariance_eps",
                       "reference_gaussian": "reference_gaussian", "fit_pairs": "fit_pairs"},
                # Redemption Score's code adds 5e-4 to the covariance's diagonal (scripts/get_gaussian.py,
                # GaussianEstimator(reg=5e-4)); the official MID adds nothing. Its code feeds CLIP through
                # transformers' CLIPProcessor, where the official MID feeds it as OpenAI's clip package does.
                defaults={"covariance_eps": 5e-4, "preprocessing": "transformers"},
                fixed={"per_sample": True}),  # RS fuses the per-sample PMI
    "dino": Part(DinoCycleConfig, "dino_",
                 names={o: o for o in ("generator", "generated_images", "cache", "cache_dir", "steps", "image_size",
                                       "guidance_scale", "seed", "seed_per_caption", "generator_batch_size",
                                       "generator_dtype", "generator_revision", "reference_choice")}),
    # bert_score's table puts deberta-v3-large at layer 12; no rescaling baseline ships for it. Eq. 8: the best
    # F1 over the references.
    "bertscore": Part(BERTScoreConfig, "bertscore_",
                      defaults={"model": "microsoft/deberta-v3-large", "num_layers": 12},
                      fixed={"multi_reference": "max"}),
}
# Given once, to every part.
SHARED: tuple[str, ...] = ("batch_size", "device", "dtype", "local_files_only", "device_map", "max_memory",
                           "offload_folder")
RedemptionConfig = derive_config("RedemptionConfig", RedemptionOptions, PART_CONFIGS, SHARED, __name__)


def normalized(how: str, values: Tensor) -> Tensor:
    if how == "eq9":
        return normalize_pmi(values)
    if how == "unit":
        return (values + 1.0) / 2.0
    return values


class RedemptionScore(CompositeMetric):
    info = MetricInfo(
        name="redemption_score",
        display_name="Redemption Score",
        description=(
            "Calibrated fusion (0.84 / 0.08 / 0.08) of MID mapped onto (0, 1), DINO similarity of Stable "
            "Diffusion 3 regenerations and BERTScore (DeBERTa-v3-large, best F1 over references)."
        ),
        citation=CITATION,
        references="always",
        images="always",
        score_range=None,
        paper="https://arxiv.org/abs/2505.16180",
        paper_config={"mid_weight": 0.84, "dino_weight": 0.08, "bertscore_weight": 0.08,
                      "clip_model": "openai/clip-vit-large-patch14", "dino_model": "facebook/dino-vitb8",
                      "generator": SD3_MODEL, "steps": 40, "bertscore_model": "microsoft/deberta-v3-large",
                      "bertscore_num_layers": 12, "covariance_eps": "5e-4 (the authors' code)"},
    )
    Config = RedemptionConfig
    # Component name (prefix of its options and extras) -> registered metric.
    PARTS: ClassVar[dict[str, str]] = {"mid": "mid", "dino": "dino_cycle", "bertscore": "bertscore"}
    # Component extras that repeat the raw or normalised score, besides each component's score_aliases.
    REPEATED: ClassVar[dict[str, tuple[str, ...]]] = {"mid": ("pmi_normalized",)}

    def __init__(self, **config) -> None:
        super().__init__(**config)
        self._components: dict[str, Metric] | None = None

    def components(self) -> Mapping[str, Metric]:
        if self._components is None:
            cfg = self.config
            self._components = {name: registry.load(metric, **part_options(cfg, PART_CONFIGS[name], SHARED))
                                for name, metric in self.PARTS.items() if getattr(cfg, f"{name}_weight") > 0}
        return self._components

    def combine(self, results: Mapping[str, MetricResult], state: Mapping[str, Tensor]) -> MetricResult:
        cfg = self.config
        index = state[INDEX]
        multiplicative = cfg.fusion == "multiplicative"
        # The product in log space: sum w_k log max(s_k, 0) (a component at or below 0 makes the product 0).
        total = torch.zeros(len(index), dtype=torch.float64)
        extras: dict[str, Tensor] = {}
        corpus: dict[str, float] = {}
        for name, result in results.items():
            raw = result.scores.to(torch.float64).cpu()
            norm = normalized(getattr(cfg, f"{name}_normalization"), raw)
            weight = getattr(cfg, f"{name}_weight")
            total += weight * (torch.log(norm.clamp_min(0.0)) if multiplicative else norm)
            extras[f"{name}_raw"], extras[f"{name}_normalized"] = raw, norm
            repeated = (*self.REPEATED.get(name, ()), *self.components()[name].score_aliases)
            for key, value in result.extras.items():
                if key not in repeated:
                    extras.setdefault(f"{name}_{key}", value.cpu())
            corpus[f"mean_{name}_raw"] = nanmean(raw)
            corpus[f"mean_{name}_normalized"] = nanmean(norm)
        if multiplicative:
            total = torch.exp(total)
        if "mid" in results:
            corpus["mid"] = results["mid"].score
            corpus["mid_mutual_information"] = results["mid"].corpus_extras["mutual_information"]
        return MetricResult(self.info.name, nanmean(total), total, index, extras=extras, corpus_extras=corpus)


METRICS = [RedemptionScore]
