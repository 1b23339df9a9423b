"""MSD-Score and Soft-MSD: multi-scale distributional scoring for reference-free caption evaluation.

For an image (patch embeddings x_1..x_N) and a caption (token embeddings y_1..y_L) in a CLIP-like joint space:

    p = vMF mixture fitted to the patches (K_img components), q = vMF mixture fitted to the tokens (K_txt)
    KL_img->txt = mean_n [log p(x_n) - log q(x_n)]        (coverage: visual content the caption misses)
    KL_txt->img = mean_m [log q(y_m) - log p(y_m)]        (support: caption content the image lacks)
    beta = sigmoid(-(L - L0) / tau_L),  D = beta KL_img->txt + (1 - beta) KL_txt->img
    MSD = g - lambda D,   g = cos(pooled image, pooled text)

Soft-MSD over the M candidates of one image: p = softmax(g / tau), u = clamp(M/(M-1) (1 - max p), 0, 1)
(u = 1 when M = 1), score = g - lambda u D. Mixture fitting is :mod:`capeval_plugins.core.vmf`.

Features: by default a stock CLIP-like model's patch and token embeddings in its joint space and its pooled
embeddings for g; with ``aligner=DIR`` the paper's trained local aligner
(:mod:`capeval_plugins.training.msd_aligner`): projected CLIP patches and the language model's token embeddings,
g from their mean-pooled directions. The result's corpus extra ``features`` says which ("stock" or "aligner").
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from capeval_plugins.contract import (GROUP, INDEX, Batch, Metric, MetricInfo, MetricResult, ModelConfig,
                                     Requirement, StateSpec, bounded, nanmean)
from capeval_plugins.core.bounds import MAX_SEED
from capeval_plugins.models.encoders import ClipEncoder, EncoderSpec, mean_pooled
from capeval_plugins.core.vmf import PRECISIONS, BiKL, Points, bi_kl, content_seeds, fit_mixture, points
from capeval_plugins.models.msd_aligner.model import LocalAligner, read_settings as read_aligner_settings

CITATION = """@misc{kan2026msdscore,
  title         = {{MSD-Score}: Multi-Scale Distributional Scoring for Reference-Free Image Caption Evaluation},
  author        = {Kan, Shichao and Zhang, Xuyang and Zhang, Haojie and Zhu, Zhe and Cen, Yigang and Liang, Yixiong
                   and Shan, Lianlei and Zhang, Linna and Qu, Zhe and Xia, Jiazhi},
  year          = {2026},
  eprint        = {2605.06080},
  archivePrefix = {arXiv},
  primaryClass  = {cs.CV}
}"""

# Mixture sizes (K_img, K_txt) of the paper's two caption-length regimes.
SETTINGS = {"short": (3, 2), "long": (5, 3)}

# Option sets of the official evaluation scripts, by name (``preset=``); an option given explicitly wins.
# "sugarcrepe": the SugarCrepe scripts (SteinsGateSg/MSDScore, metrics/vMF_MSD_Score/sugarcrepe_*.py) call the
# bi-KL with its defaults, 4 image and 2 text components, not the README's 3 / 2; the rest as the paper.
# "coco-cf": coco_eval_cf.py, 3 image and 2 text components, its own EM (no re-initialisation, weights
# (N_k + 1e-8) / N, log(w + 1e-9) in every log-density: core.vmf, update="coco-cf") and its starting draws
# (draws="coco-cf", with its default --seed 42).
PRESETS: dict[str, dict[str, object]] = {
    "paper": {},
    "sugarcrepe": {"k_image": 4, "k_text": 2},
    "coco-cf": {"k_image": 3, "k_text": 2, "em_update": "coco-cf", "draws": "coco-cf", "seed": 42},
}
# Options of a preset applied through the config (the mixture sizes are resolved with the setting).
_PRESET_FIELDS = ("em_update", "draws", "seed")
# Values of the ablation options (the paper's Table II, X, XI; see the card).
MIXTURES = ("vmf", "gaussian")
KAPPA_MODES = ("fixed", "adaptive")
EM_UPDATES = ("restart", "coco-cf")
# Where the EM's random draws come from: "content", a hash of the sample (its pixels, its token ids) and the
# seed; "coco-cf", coco_eval_cf.py's torch.randperm seeded with seed + 7 i (the image's mixture) and
# seed + 3 i + 123 (the caption's), i the pair's index (see official_initial_positions).
DRAWS = ("content", "coco-cf")
KL_DIRECTIONS = ("length", "image_to_text", "text_to_image")
SCORE_TERMS = ("both", "global", "local")


@dataclass
class MSDConfig(ModelConfig):
    model: str = "openai/clip-vit-large-patch14"
    # A trained local aligner (``capeval train msd-aligner``): its own vision backbone is then the default
    # model (give ``model`` for a local copy of it).
    aligner: str | None = None
    input_paths: ClassVar[tuple[str, ...]] = ("model", "aligner")
    setting: str = "short"
    # A named option set of the official scripts (PRESETS): "sugarcrepe" = 4 image, 2 text components.
    preset: str = "paper"
    k_image: int | None = bounded(None, ge=1, le=1024)
    k_text: int | None = bounded(None, ge=1, le=1024)
    # The vMF concentration (paper: 20). At 1e6 a component's angular spread sqrt(D / kappa) is 0.03 rad for D = 768
    # and every E-step assignment is already hard; the float32 logits kappa * cos lose unit resolution near 2**24,
    # and larger values only overflow (1e308 gave meaningless scores). The same bound caps the Gaussian ablation's
    # 1 / sigma**2 (gaussian_sigma >= 1e-3) and the divergence weight lam (lam * D stays finite).
    kappa: float = bounded(20.0, gt=0, le=1e6)
    em_iterations: int = bounded(20, ge=0, le=10_000)
    # Reference code: a component is re-initialised when N_k < reinit_threshold * N.
    reinit_threshold: float = bounded(1e-6, ge=0, le=1)  # a fraction of N
    # How the EM updates the weights and handles collapsed components: "restart" (the paper, the reference code)
    # or "coco-cf" (coco_eval_cf.py: no re-initialisation, weights (N_k + 1e-8) / N); the "coco-cf" preset sets it.
    em_update: str = "restart"
    # Ablations of the paper's Table II: "gaussian" = isotropic Gaussians of standard deviation gaussian_sigma
    # instead of vMFs; kappa_mode="adaptive" = each component's kappa re-estimated by the paper's Eq. 12.
    mixture: str = "vmf"
    gaussian_sigma: float = bounded(0.1, ge=1e-3)
    kappa_mode: str = "fixed"
    # Ablations of Tables X / XI: D from one KL direction only, and scores from one term only (g or -D).
    kl_direction: str = "length"
    score_terms: str = "both"
    lam: float = bounded(0.1, ge=0, le=1e6)
    length_l0: float = bounded(20.0, ge=0)
    length_tau: float = bounded(3.0, ge=1e-6)
    # "model": the model's own pooled embeddings (methods notes, reference code); "mean": the normalised mean
    # of the patch / content-token embeddings (the paper's wording for its aligner).
    global_pooling: str = "model"
    # Patch tokens straight through the visual projection (reference code) or after the vision tower's
    # final layer norm, as the pooled class token gets it (CLIP only).
    patch_layernorm: bool = False
    # SigLIP patches and tokens: the raw last hidden state of each tower (the official SigLIP script) or
    # "head", each mapped by its tower's attention-pooling / text head.
    siglip_features: str = "hidden"
    long_captions: str = "truncate"
    seed: int = bounded(0, ge=0, le=MAX_SEED)
    # "content" (a hash of each sample and the seed: a score depends on nothing else) or "coco-cf" (the COCO-CF
    # script's starting draws, which depend on the pair's index there: the group id, else the sample's id);
    # the "coco-cf" preset sets it.
    draws: str = "content"
    # Precision of the EM and KL (core.vmf.PRECISIONS). "mixed": the products of the image patches with the
    # means in float32, everything else (log-weights, normalisers, masses, the tokens' products, KL) in float64:
    # faster than the official float32 code and closer to a float64 computation than it (benchmarks/msd_em.py).
    # "float64" throughout, or "float32" throughout as the official code runs.
    em_dtype: str = "mixed"
    diagnostics: bool = False


@dataclass
class SoftMSDConfig(MSDConfig):
    tau: float = bounded(0.2, ge=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Functional core: tensors in, tensors out.


def length_weight(n_tokens: Tensor, l0: float = 20.0, tau_l: float = 3.0) -> Tensor:
    """beta = sigmoid(-(L - L0) / tau_L): near 1 for short captions (weigh coverage), near 0 for long ones."""
    return torch.sigmoid(-(n_tokens - l0) / tau_l)


def tokens_on_patches(token_contributions: Tensor, tokens: Tensor, token_mask: Tensor, patches: Tensor,
                      patch_mask: Tensor, kappa: float) -> Tensor:
    """Spread each token's KL_txt->img contribution over the patches in proportion to
    softmax_n(kappa <y_m, x_n>), so the token side can be drawn over the image; a row sums to KL_txt->img."""
    logits = kappa * torch.einsum("bmd,bnd->bmn", F.normalize(tokens, dim=-1), F.normalize(patches, dim=-1))
    logits = logits.masked_fill(~patch_mask.bool()[:, None, :], float("-inf"))
    share = torch.softmax(logits, dim=-1) * token_mask.bool()[..., None]
    return torch.einsum("bm,bmn->bn", token_contributions, share)


@dataclass
class Divergence:
    """The local term of MSD for B pairs: ``bi_kl`` = D = beta KL_img->txt + (1 - beta) KL_txt->img, its parts
    (``kl``, with per-point contributions), ``beta`` and ``n_tokens``, and the normalised points it used."""

    bi_kl: Tensor
    kl: BiKL
    beta: Tensor
    n_tokens: Tensor
    patches: Points
    tokens: Points


def length_weighted_divergence(
    patches: Tensor,
    patch_mask: Tensor | None,
    tokens: Tensor,
    token_mask: Tensor | None,
    image_index: Tensor | None = None,
    *,
    image_seeds: Tensor | None = None,
    text_seeds: Tensor | None = None,
    image_initial: Tensor | None = None,
    text_initial: Tensor | None = None,
    k_image: int = 3,
    k_text: int = 2,
    kappa: float = 20.0,
    iterations: int = 20,
    reinit_threshold: float = 1e-6,
    length_l0: float = 20.0,
    length_tau: float = 3.0,
    dtype: torch.dtype = torch.float64,
    product_dtype: torch.dtype | None = None,
    em_update: str = "restart",
    mixture: str = "vmf",
    gaussian_sigma: float = 0.1,
    kappa_mode: str = "fixed",
    kl_direction: str = "length",
) -> Divergence:
    """vMF mixtures fitted to each image's patches (I, N, D) and each caption's tokens (B, T, D), the Monte
    Carlo KL both ways, and D weighted by caption length. Pair b uses image ``image_index[b]`` (default b);
    seeds default to the points' own bits (see :func:`~capeval_plugins.core.vmf.fit_mixture`); ``image_initial``
    and ``text_initial`` (positions of the initial means) replace the seeds' draw of the start. ``dtype`` is
    the precision of the fits and the KL, ``product_dtype`` (default ``dtype``) the one the patches are kept and
    multiplied in; the tokens are multiplied in ``dtype`` (:data:`~capeval_plugins.core.vmf.PRECISIONS`).
    ``em_update``, ``mixture`` ("gaussian": standard deviation ``gaussian_sigma``) and ``kappa_mode`` select the
    EM and the model (:mod:`capeval_plugins.core.vmf`); ``kl_direction`` other than "length" fixes beta at 1
    ("image_to_text") or 0 ("text_to_image")."""
    patch_points = points(patches, patch_mask, dtype, product_dtype)
    token_points = points(tokens, token_mask, dtype)
    fit = dict(kappa=kappa, iterations=iterations, reinit_threshold=reinit_threshold, dtype=dtype, update=em_update,
               family=mixture, sigma=gaussian_sigma, adaptive_kappa=kappa_mode == "adaptive")
    image_mixture = fit_mixture(patch_points, n_components=k_image, seeds=image_seeds, initial=image_initial, **fit)
    text_mixture = fit_mixture(token_points, n_components=k_text, seeds=text_seeds, initial=text_initial, **fit)
    kl = bi_kl(patch_points, None, image_mixture, token_points, None, text_mixture, image_index)
    n_tokens = token_points.counts.to(dtype)
    if kl_direction == "length":
        beta = length_weight(n_tokens, length_l0, length_tau)
    else:
        beta = torch.full_like(n_tokens, 1.0 if kl_direction == "image_to_text" else 0.0)
    divergence = beta * kl.image_to_text + (1 - beta) * kl.text_to_image
    return Divergence(divergence, kl, beta, n_tokens, patch_points, token_points)


def msd_components(
    image_global: Tensor,
    patches: Tensor,
    patch_mask: Tensor,
    text_global: Tensor,
    tokens: Tensor,
    token_mask: Tensor,
    image_index: Tensor,
    *,
    image_seeds: Tensor,
    text_seeds: Tensor,
    lam: float = 0.1,
    dtype: torch.dtype = torch.float64,
    product_dtype: torch.dtype | None = None,
    diagnostics: bool = False,
    **local,
) -> dict[str, Tensor]:
    """MSD and its parts for B pairs. Images come once each (``image_global`` (I, D), ``patches``
    (I, N, D)); pair b uses image ``image_index[b]``, so each image's mixture is fitted once for all of its
    captions. ``local``: the options of :func:`length_weighted_divergence` (mixture sizes, kappa, ...). Returns
    per-pair ``cosine``, ``kl_image_text``, ``kl_text_image``, ``beta``, ``bi_kl`` (D), ``n_tokens``, ``msd`` and,
    with ``diagnostics``, ``patch_contributions`` (B, N), ``token_contributions`` (B, T, on the token axis of
    ``tokens``) and ``token_contributions_on_patches``."""
    divergence = length_weighted_divergence(
        patches, patch_mask, tokens, token_mask, image_index, image_seeds=image_seeds, text_seeds=text_seeds,
        dtype=dtype, product_dtype=product_dtype, **local)
    kl = divergence.kl
    cosine = (image_global.to(dtype)[image_index] * text_global.to(dtype)).sum(-1)
    out = {
        "cosine": cosine,
        "kl_image_text": kl.image_to_text,
        "kl_text_image": kl.text_to_image,
        "beta": divergence.beta,
        "bi_kl": divergence.bi_kl,
        "n_tokens": divergence.n_tokens,
        "msd": cosine - lam * divergence.bi_kl,
    }
    if diagnostics:
        out["patch_contributions"] = kl.patch_contributions
        out["token_contributions"] = kl.token_contributions
        pairs = divergence.patches[image_index]
        out["token_contributions_on_patches"] = tokens_on_patches(
            kl.token_contributions, divergence.tokens.unit(), divergence.tokens.mask, pairs.unit(), pairs.mask,
            local.get("kappa", 20.0))
    return out


def soft_msd_gate(cosine: Tensor, groups: Tensor, tau: float = 0.2) -> tuple[Tensor, Tensor]:
    """Per-sample uncertainty u of its group and the group size M. Within a group, p = softmax(g / tau) and
    u = clamp(M/(M-1) (1 - max p), 0, 1); u = 1 when M = 1. A negative group id means a group of its own."""
    n = len(cosine)
    own = -1 - torch.arange(n, device=groups.device)
    groups = torch.where(groups < 0, own, groups)
    _, inverse = torch.unique(groups, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if n else 0
    z = cosine / tau
    top = torch.full((n_groups,), float("-inf"), dtype=z.dtype, device=z.device)
    top = top.scatter_reduce(0, inverse, z, reduce="amax")
    # max p = exp(z_max - z_max) / sum exp(z - z_max) = 1 / denominator
    denominator = torch.zeros(n_groups, dtype=z.dtype, device=z.device)
    denominator = denominator.index_add(0, inverse, torch.exp(z - top[inverse]))
    size = torch.bincount(inverse, minlength=n_groups).to(z.dtype)
    spread = size / (size - 1).clamp_min(1) * (1 - 1 / denominator)
    u = torch.where(size > 1, spread.clamp(0, 1), torch.ones_like(spread))
    return u[inverse], size[inverse]


def soft_msd_scores(cosine: Tensor, divergence: Tensor, groups: Tensor, lam: float = 0.1, tau: float = 0.2) -> Tensor:
    """Soft-MSD = g - lambda u D."""
    u, _ = soft_msd_gate(cosine, groups, tau)
    return cosine - lam * u * divergence


# ---------------------------------------------------------------------------------------------------------
# Metrics


_ROWS = ("cosine", "bi_kl", "kl_image_text", "kl_text_image", "beta", "n_tokens")
_MAPS = ("patch_contributions", "token_contributions", "token_contributions_on_patches")


class MSDScore(Metric):
    info = MetricInfo(
        name="msd_score",
        display_name="MSD-Score",
        description=(
            "Reference-free: global image-text cosine minus lambda times a length-weighted bi-directional KL "
            "between vMF mixtures fitted to the image's patch embeddings and the caption's token embeddings "
            "(omissions and hallucinations)."
        ),
        citation=CITATION,
        references="never",
        images="always",
        paper_config={"model": "openai/clip-vit-large-patch14", "kappa": 20.0, "em_iterations": 20,
                      "setting": "short", "k_image": 3, "k_text": 2, "long": {"k_image": 5, "k_text": 3},
                      "lam": 0.1, "length_l0": 20.0, "length_tau": 3.0},
    )
    Config = MSDConfig

    def __init__(self, **config) -> None:
        super().__init__(**config)
        cfg = self.config
        if cfg.preset in PRESETS:
            for name in _PRESET_FIELDS:  # the preset's options, where not given
                if name in PRESETS[cfg.preset] and name not in config:
                    setattr(cfg, name, PRESETS[cfg.preset][name])
        check_config(cfg)
        if cfg.aligner and "model" not in config and os.path.isdir(cfg.aligner):
            # The aligner's own vision backbone (and its revision), unless a model (e.g. a local copy) is given.
            settings = read_aligner_settings(cfg.aligner)
            cfg.model = settings.vision_model
            if "revision" not in config:
                cfg.revision = settings.vision_revision

    def seeded_by_ids(self) -> str | None:
        if self.config.draws == "coco-cf":
            return ("draws='coco-cf' seeds each fit by its pair's index, as coco_eval_cf.py's loop does: the group "
                    "id where it is an integer, else the sample's id")
        return None

    def requirements(self) -> list[Requirement]:
        """CLIP (the aligner's backbone with an aligner), and the aligner's language model where it reads text
        features from the model rather than from its saved embedding table."""
        needs = super().requirements()
        cfg = self.config
        if cfg.aligner and os.path.isdir(cfg.aligner):
            settings = read_aligner_settings(cfg.aligner)
            if settings.text_features != "input_embeddings":
                needs.append(Requirement("model", settings.llm, f"the language model of aligner {cfg.aligner}",
                                         revision=settings.llm_revision, local_files_only=cfg.local_files_only))
        return needs

    @property
    def encoder(self) -> ClipEncoder | LocalAligner:
        spec = EncoderSpec.from_config(self.config)
        if self.config.aligner:
            return LocalAligner.shared(self.config.aligner, spec)
        return ClipEncoder.shared(spec)

    @property
    def mixture_sizes(self) -> tuple[int, int]:
        cfg = self.config
        k_image, k_text = SETTINGS[cfg.setting]
        preset = PRESETS[cfg.preset]
        k_image, k_text = preset.get("k_image", k_image), preset.get("k_text", k_text)
        return cfg.k_image or k_image, cfg.k_text or k_text

    def states(self) -> dict[str, StateSpec]:
        spec = {name: StateSpec("cat", torch.float64) for name in _ROWS}
        if self.config.diagnostics:
            spec.update({name: StateSpec("cat", torch.float64, (-1,)) for name in _MAPS})
        return spec

    def map(self, batch: Batch) -> dict[str, Tensor]:
        # Inference mode: the EM's ~600 small tensor operations a pair cost about a tenth less than under no_grad
        # (and less than with autograd's bookkeeping on); the rows leave it as ordinary tensors.
        with torch.inference_mode():
            out = self._map(batch)
        return {name: value.to("cpu", copy=True) for name, value in out.items()}

    def _map(self, batch: Batch) -> dict[str, Tensor]:
        cfg, enc = self.config, self.encoder
        if cfg.long_captions == "error":
            refuse_long_captions(enc, batch)
        pixels = enc.pixel_values(batch.images)
        if cfg.aligner:
            image = enc.encode_image_patches(pixels, post_layernorm=cfg.patch_layernorm)
            text = enc.encode_text_tokens(batch.candidates)
        else:
            image = enc.encode_image_patches(pixels, post_layernorm=cfg.patch_layernorm,
                                             siglip_features=cfg.siglip_features)
            text = enc.encode_text_tokens(batch.candidates, siglip_features=cfg.siglip_features)
        token_mask = content_or_boundary(enc, batch.candidates, text.mask)
        if image.local.shape[-1] != text.local.shape[-1]:
            raise ValueError(f"MSD-Score: {cfg.model}'s patch ({image.local.shape[-1]}) and token "
                             f"({text.local.shape[-1]}) features differ in size; for SigLIP use "
                             "siglip_features='head'")
        device = image.local.device
        image_global, text_global = image.pooled, text.pooled
        pooled_from_tokens = cfg.aligner and enc.settings.text_pooling == "content"
        if cfg.global_pooling == "mean" or (pooled_from_tokens and token_mask is not text.mask):
            text_global = mean_pooled(text.local, token_mask)  # an aligner pools the tokens it keeps
        if cfg.global_pooling == "mean":
            image_global = mean_pooled(image.local, image.mask)
        dtype, product_dtype = PRECISIONS[cfg.em_dtype]
        image_index = batch.image_index.to(device)
        image_seeds = pixel_seeds(pixels, seed=cfg.seed).to(device)
        text_seeds = content_seeds(text.ids, token_mask, seed=cfg.seed)
        starts = {}
        if cfg.draws == "coco-cf":
            pairs = pair_indices(batch)
            # the script fits an image once per pair: one fit per (image, pair), not one per image
            fits, image_index = torch.unique(torch.stack([image_index, pairs.to(device)], 1), dim=0,
                                             return_inverse=True)
            image_global, image.local, image.mask = (t[fits[:, 0]] for t in (image_global, image.local, image.mask))
            image_seeds = image_seeds[fits[:, 0]]
            k_image, k_text = self.mixture_sizes
            starts = {"image_initial": official_initial_positions(image.mask, k_image, cfg.seed + 7 * fits[:, 1]),
                      "text_initial": official_initial_positions(token_mask, k_text, cfg.seed + 3 * pairs + 123)}
        out = msd_components(
            image_global, image.local, image.mask, text_global, text.local, token_mask, image_index,
            image_seeds=image_seeds, text_seeds=text_seeds, lam=cfg.lam, dtype=dtype, product_dtype=product_dtype,
            diagnostics=cfg.diagnostics, **starts, **self.local_options,
        )
        if cfg.diagnostics:
            out["token_contributions"] = content_first(out["token_contributions"], token_mask)
        return {name: out[name] for name in self.states()}

    @property
    def local_options(self) -> dict[str, object]:
        """The options of :func:`length_weighted_divergence` this configuration gives."""
        cfg = self.config
        k_image, k_text = self.mixture_sizes
        return dict(k_image=k_image, k_text=k_text, kappa=cfg.kappa, iterations=cfg.em_iterations,
                    reinit_threshold=cfg.reinit_threshold, length_l0=cfg.length_l0, length_tau=cfg.length_tau,
                    em_update=cfg.em_update, mixture=cfg.mixture, gaussian_sigma=cfg.gaussian_sigma,
                    kappa_mode=cfg.kappa_mode, kl_direction=cfg.kl_direction)

    def scores(self, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-sample scores and the extras that belong to them (after :meth:`finalize` ordered the rows)."""
        return fused(state["cosine"], state["bi_kl"], self.config.lam, self.config.score_terms), {}

    def finalize(self, state: dict[str, Tensor]) -> MetricResult:
        scores, own = self.scores(state)
        extras = {name: state[name] for name in _ROWS}
        extras.update(own)
        if self.config.diagnostics:
            extras.update({name: state[name] for name in _MAPS})
            extras["token_contributions"] = pad_beyond(state["token_contributions"], state["n_tokens"])
        corpus = {"mean_cosine": nanmean(state["cosine"]), "mean_bi_kl": nanmean(state["bi_kl"]),
                  "features": "aligner" if self.config.aligner else "stock"}
        return MetricResult(self.info.name, nanmean(scores), scores, state[INDEX], extras, corpus)


class SoftMSD(MSDScore):
    info = MetricInfo(
        name="soft_msd",
        display_name="Soft-MSD",
        description=(
            "MSD-Score whose local (KL) term is weighted by how ambiguous the global scores of an image's "
            "candidates are: u = clamp(M/(M-1) (1 - max softmax(g / tau)), 0, 1). Candidates are grouped by "
            "group_ids, else by image. With one candidate it equals MSD-Score."
        ),
        citation=CITATION,
        references="never",
        images="always",
        groups=True,
        paper_config={**MSDScore.info.paper_config, "tau": 0.2},
    )
    Config = SoftMSDConfig

    def scores(self, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        cfg = self.config
        u, size = soft_msd_gate(state["cosine"], state[GROUP], cfg.tau)
        msd = fused(state["cosine"], state["bi_kl"], cfg.lam, cfg.score_terms)
        # one term alone (g, or -D: the paper's "Bi-KL" column) is the same for both metrics: u gates their mix
        soft = fused(state["cosine"], u * state["bi_kl"], cfg.lam) if cfg.score_terms == "both" else msd
        return soft, {"msd": msd, "uncertainty": u, "group_size": size}


# ---------------------------------------------------------------------------------------------------------
# Helpers


def check_config(cfg: MSDConfig) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(f"MSD-Score: {message}")

    need(cfg.setting in SETTINGS, f"setting must be one of {sorted(SETTINGS)}, got {cfg.setting!r}")
    need(cfg.preset in PRESETS, f"preset must be one of {sorted(PRESETS)}, got {cfg.preset!r}")
    fixed = PRESETS[cfg.preset]
    # a setting only chooses the mixture sizes: under a preset that fixes them it would change nothing
    need(cfg.setting == "short" or "k_image" not in fixed,
         f"setting={cfg.setting!r} chooses the mixture sizes, which preset={cfg.preset!r} fixes (k_image="
         f"{fixed.get('k_image')}, k_text={fixed.get('k_text')}); give k_image / k_text to change them")
    need(cfg.siglip_features in ("hidden", "head"), f"siglip_features must be 'hidden' or 'head', got {cfg.siglip_features!r}")
    need(cfg.global_pooling in ("model", "mean"), "global_pooling must be 'model' or 'mean'")
    need(cfg.long_captions in ("truncate", "error"), "long_captions must be 'truncate' or 'error'")
    need(cfg.em_dtype in PRECISIONS, f"em_dtype must be one of {sorted(PRECISIONS)}")
    need(cfg.draws in DRAWS, f"draws must be one of {list(DRAWS)}, got {cfg.draws!r}")
    for name, allowed in (("em_update", EM_UPDATES), ("mixture", MIXTURES), ("kappa_mode", KAPPA_MODES),
                          ("kl_direction", KL_DIRECTIONS), ("score_terms", SCORE_TERMS)):
        need(getattr(cfg, name) in allowed, f"{name} must be one of {list(allowed)}, got {getattr(cfg, name)!r}")
    need(not (cfg.mixture == "gaussian" and cfg.kappa_mode == "adaptive"), "kappa_mode='adaptive' applies to vMFs")
    need(not (cfg.aligner and cfg.patch_layernorm),
         "patch_layernorm applies to stock CLIP patches; an aligner takes its own CLIP layer")


def pair_indices(batch: Batch) -> Tensor:
    """(B,) the index i of each sample's pair in the COCO-CF script's loop: its group id (a pair's two captions
    form one group), else its own id (``ids``). A group id below 0 means no group, and one that names a group
    (a name given, or an image's group when none is given: ``inputs.is_name_group``) is no index: the sample's own
    id is i then too."""
    from capeval_plugins.inputs import NAMED_GROUPS

    ids = batch.indices.to(torch.int64)
    if batch.group_ids is None:
        return ids
    groups = batch.group_ids.to(torch.int64)
    return torch.where((groups >= 0) & (groups < NAMED_GROUPS), groups, ids)


def official_initial_positions(mask: Tensor, k: int, seeds: Tensor) -> Tensor:
    """(B, k) positions of the initial means as coco_eval_cf.py draws them for each row: its valid points (N of
    them, in order) permuted by ``torch.randperm(N)`` from a generator on the row's device seeded with the row's
    seed, the first min(k, N) taken (further components are inactive: position 0). One generator per row, as the
    script makes one per fit. Seeds are taken mod 2**64 (a generator's range)."""
    out = torch.zeros((len(mask), k), dtype=torch.int64, device=mask.device)
    for row, (valid, seed) in enumerate(zip(mask, seeds.tolist())):
        positions = valid.nonzero().flatten()
        generator = torch.Generator(device=mask.device)
        generator.manual_seed(int(seed) % 2 ** 64)
        draw = torch.randperm(len(positions), generator=generator, device=mask.device)[:k]
        out[row, :len(draw)] = positions[draw]
    return out


def pixel_seeds(pixels: Tensor, seed: int = 0, stride: int = 61) -> Tensor:
    """Per-image EM seeds from the preprocessed pixels. A seed only has to be a deterministic function of the
    image (two images sharing one would merely start from the same random pattern), so every ``stride``-th
    value is hashed: exact, and about ``stride`` times cheaper than hashing them all."""
    return content_seeds(pixels.reshape(len(pixels), -1)[:, ::stride], seed=seed)


def refuse_long_captions(enc: ClipEncoder | LocalAligner, batch: Batch) -> None:
    from capeval_plugins.inputs import InputError

    source = "the aligner" if isinstance(enc, LocalAligner) else f"the text encoder of {enc.spec.model}"
    for i, count in enumerate(enc.count_tokens(batch.candidates)):
        if count > enc.max_tokens:
            raise InputError(
                f"sample {int(batch.indices[i])}: caption has {count} tokens, more than the {enc.max_tokens} "
                f"{source} takes (long_captions='truncate' truncates it with a warning)"
            )


def content_or_boundary(enc: ClipEncoder | LocalAligner, texts, mask: Tensor) -> Tensor:
    """The content-token mask, except that a caption without content tokens (an empty caption) keeps its
    boundary tokens, the non-padding positions of its tokenisation, as the official scripts fall back to (CLIP:
    BOS and EOS; an aligner's LLM: BOS). A tokenizer without an attention mask (SigLIP's pads to 64): the first
    position. The tokenisation is the encoder's own (same call, same padding), redone only when needed."""
    empty = mask.sum(1) == 0
    if not bool(empty.any()):
        return mask
    attention = enc.tokenize(list(texts)).get("attention_mask")
    if attention is None:
        attention = torch.zeros(mask.shape, dtype=torch.bool)
        attention[:, 0] = True
    return torch.where(empty[:, None], attention.bool().to(mask.device), mask)


def fused(cosine: Tensor, divergence: Tensor, lam: float, terms: str = "both") -> Tensor:
    """g - lambda D ("both"), g alone ("global") or -D alone ("local"), the ablation rows of Tables VI and X."""
    if terms == "global":
        return cosine.clone()
    if terms == "local":
        return -divergence
    return cosine - lam * divergence


def content_first(values: Tensor, mask: Tensor) -> Tensor:
    """Each row's values at its valid positions, moved to the front in order (zeros after)."""
    order = torch.sort((~mask.bool()).to(torch.int8), dim=1, stable=True).indices
    width = int(mask.sum(1).max()) if len(mask) else 0
    moved = torch.gather(values, 1, order)[:, :width]
    return torch.where(torch.gather(mask.bool(), 1, order)[:, :width], moved, torch.zeros_like(moved))


def pad_beyond(values: Tensor, lengths: Tensor) -> Tensor:
    """NaN after each row's length (the padding of ragged rows)."""
    positions = torch.arange(values.shape[1], device=values.device)[None, :]
    return values.masked_fill(positions >= lengths.to(values.device)[:, None], float("nan"))


METRICS = [MSDScore, SoftMSD]
