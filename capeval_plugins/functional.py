"""Feature-level functions, torchmetrics style: pure functions on tensors, no models loaded.

Each is the computation of one metric after its encoder, a thin wrapper over :mod:`capeval_plugins.core`, and
gives that metric's numbers when fed the features the metric computes itself (the tests check each one against
its metric class). Use them on features you already have: a cached CLIP run, your own encoder, an LVLM's
logits.

=================================  ==============================================================================
function                           metric
=================================  ==============================================================================
:func:`clip_score`                 ``clipscore`` (CLIP-S)
:func:`ref_clip_score`             ``refclipscore`` (RefCLIP-S)
:func:`mid`                        ``mid`` (per-sample PMI, corpus MID)
:func:`bert_score_match`           ``bertscore`` (P, R, F of one candidate/reference pair); :func:`bert_score_idf`
:func:`fleur_smooth`               ``fleur``
:func:`discode_head`               ``discode`` (closed-form ATT head)
:func:`vmf_mixture`                the vMF mixtures of ``msd_score``
:func:`msd_divergence`             ``msd_score``'s local term; :func:`msd_score`, :func:`soft_msd`
:func:`kendall_tau`                correlation with human judgments (tau-b, tau-c)
:func:`pairwise_accuracy`          accuracy on caption pairs (e.g. Pascal-50S)
=================================  ==============================================================================

Shapes: N samples, D feature size, L tokens, K labels. Scores come back in float64.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from capeval_plugins.core import correlation, gaussian, heads, matching, vmf
from capeval_plugins.core.arrays import host
from capeval_plugins.core import clip_score as _clip

__all__ = [
    "clip_score", "ref_clip_score", "mid", "bert_score_match", "bert_score_idf", "fleur_smooth", "discode_head",
    "vmf_mixture", "msd_divergence", "msd_score", "soft_msd", "kendall_tau", "pairwise_accuracy",
]


# --- CLIPScore -------------------------------------------------------------------------------------------------


def clip_score(image_features: Tensor, text_features: Tensor, w: float = 2.5) -> Tensor:
    """CLIP-S = w * max(cos(image, text), 0) (Hessel et al., 2021).

    ``image_features`` (N, D) and ``text_features`` (N, D): CLIP embeddings of each image and its candidate (the
    metric embeds the candidate as "A photo depicts <caption>"); they are L2-normalised here. Returns (N,)."""
    return _clip.clip_s(_clip.cosine(image_features, text_features), w)


def ref_clip_score(image_features: Tensor, text_features: Tensor, reference_features: Tensor,
                   reference_mask: Tensor | None = None, w: float = 2.5, clamp_reference: bool = True) -> Tensor:
    """RefCLIP-S = H-Mean(CLIP-S, max(max_r cos(text, reference_r), 0)).

    ``image_features``, ``text_features`` (N, D); ``reference_features`` (N, R, D), R references per sample,
    ``reference_mask`` (N, R) marking the real ones (default: all). ``clamp_reference=False`` is the official
    code (no clamp on the reference similarity). Returns (N,)."""
    n, r = reference_features.shape[:2]
    mask = torch.ones((n, r), dtype=torch.bool) if reference_mask is None else reference_mask.bool().cpu()
    owner = torch.arange(n)[:, None].expand(n, r)[mask]
    refs = reference_features[mask.to(reference_features.device)]
    similarity = _clip.best_reference_similarity(text_features, refs, owner, clamp_reference)
    return _clip.harmonic_mean(clip_score(image_features, text_features, w), similarity)


# --- MID -------------------------------------------------------------------------------------------------------


def mid(image_features: Tensor, reference_features: Tensor, candidate_features: Tensor, eps: float = 0.0,
        reduction: str = "trace", reference_mask: Tensor | None = None) -> Tensor:
    """MID (Kim et al., 2022): a joint Gaussian fitted to the (image, reference) pairs, the (image, candidate)
    pairs scored under it.

    ``image_features`` (N, D), ``candidate_features`` (N, D): the scored pairs. ``reference_features`` (N, D),
    one reference per image, or (N, R, D) with ``reference_mask`` (N, R) (default: all), every (image,
    reference) pair entering the fit (the metric's ``fit_pairs="all_references"``). Features as the metric uses
    them: L2-normalised CLIP embeddings. ``eps`` is added to the fitted covariance's diagonal
    (``covariance_eps``). The fit needs more pairs than 2D unless eps > 0.

    ``reduction``: ``"trace"`` (the official code's corpus MID, the metric's default), ``"mean"`` (the mean PMI)
    -> a 0-dim tensor; ``"none"`` -> the per-sample PMI (N,)."""
    if reduction not in (*gaussian.REDUCTIONS, "none"):
        raise ValueError(f"reduction must be 'trace', 'mean' or 'none', got {reduction!r}")
    images = image_features.double()
    refs = reference_features.double()
    if refs.dim() == 3:
        mask = torch.ones(refs.shape[:2], dtype=torch.bool) if reference_mask is None else reference_mask.bool()
        mask = mask.to(refs.device)
        fit_images = images[:, None, :].expand_as(refs)[mask]
        refs = refs[mask]
    else:
        fit_images = images
    fit = gaussian.JointGaussian.from_sums(gaussian.joint_sums(fit_images, refs), images.shape[-1], eps)
    candidates = candidate_features.double()
    if reduction == "none":
        return fit.pmi(images, candidates)
    return torch.tensor(gaussian.mid(fit, images, candidates, reduction), dtype=torch.float64)


# --- BERTScore -------------------------------------------------------------------------------------------------


def bert_score_match(
    candidate_embeddings: Tensor,
    reference_embeddings: Tensor,
    candidate_mask: Tensor | None = None,
    reference_mask: Tensor | None = None,
    candidate_weights: Tensor | None = None,
    reference_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """BERTScore's greedy matching of N candidate/reference pairs (Zhang et al., 2020): returns (P, R, F), each
    (N,).

    ``candidate_embeddings`` (N, Lc, D), ``reference_embeddings`` (N, Lr, D): token embeddings of one layer.
    Masks (N, Lc), (N, Lr): the tokens that exist and may be matched (default: all). Weights: how much each
    token counts (default: the masks). bert_score matches against every token including [CLS]/[SEP] (<s>/</s>)
    but gives those weight 0: pass ``mask & ~special`` as weights, or idf weights (:func:`bert_score_idf`).
    With several references per candidate, bert_score keeps the best P, R and F over them (``max`` each)."""
    cand_mask = _all_tokens(candidate_embeddings) if candidate_mask is None else candidate_mask
    ref_mask = _all_tokens(reference_embeddings) if reference_mask is None else reference_mask
    return matching.greedy_prf(candidate_embeddings, cand_mask, reference_embeddings, ref_mask, candidate_weights,
                               reference_weights)


def bert_score_idf(token_ids: Tensor, token_mask: Tensor, reference_ids: Tensor, reference_mask: Tensor) -> Tensor:
    """bert_score's idf weights (same shape as ``token_ids``) of tokens, counted over the references: each row of
    ``reference_ids`` (M, L) is one document (its ``reference_mask`` marks real tokens), idf(t) =
    log((M + 1) / (df(t) + 1)); 0 where ``token_mask`` is False. Special tokens occur in every reference, so
    their idf is 0, as bert_score has it."""
    documents = torch.where(reference_mask.bool(), reference_ids.long(), torch.full_like(reference_ids.long(), -1))
    table, n_documents = matching.idf_table(documents, pad_id=-1)
    return matching.token_idf(token_ids.long(), token_mask, table, n_documents)


def _all_tokens(embeddings: Tensor) -> Tensor:
    return torch.ones(embeddings.shape[:2], dtype=torch.bool, device=embeddings.device)


# --- LVLM score heads -----------------------------------------------------------------------------------------


def fleur_smooth(digit_logprobs: Tensor, second_digit_logprobs: Tensor | None = None,
                 integer_logprobs: Tensor | None = None, is_one: Tensor | None = None) -> Tensor:
    """FLEUR's score smoothing (Lee et al., 2024) of N answers "0.x[y]" or "1.0".

    ``digit_logprobs`` (N, 10): log-probabilities of the digits 0..9 at the first decimal, from a softmax over
    the model's *full* vocabulary (not renormalised over the digits). ``second_digit_logprobs`` (N, 10): the
    same at the second decimal, NaN rows (or None) where none was written. ``integer_logprobs`` (N, 10) and
    ``is_one`` (N,) bool: for answers "1.0", the digits at the integer position. Returns (N,):
    0.1 E_1[d] (+ 0.01 E_2[d]), or 0.9 P('0') + P('1') at the integer digit for "1.0"."""
    n = len(digit_logprobs)
    nan = torch.full_like(digit_logprobs, float("nan"))
    second = nan if second_digit_logprobs is None else second_digit_logprobs
    integer = nan if integer_logprobs is None else integer_logprobs
    one = torch.zeros(n, dtype=torch.bool, device=digit_logprobs.device) if is_one is None else is_one.bool()
    has_second = ~torch.isnan(second).any(-1)
    return heads.fleur_smooth(digit_logprobs, second, integer, has_second, one)


class DiscodeHead(NamedTuple):
    """``expected`` (N,) E_psi[x] on the label values (DISCODE's score of a "0.x" answer is 0.1 * expected on the
    0.0-1.0 scale), ``distribution`` psi (N, K), ``alpha`` (N,)."""

    expected: Tensor
    distribution: Tensor
    alpha: Tensor


def discode_head(digit_logits: Tensor, raw_digit: Tensor | None = None, sigma2: float = 0.1,
                 alpha_scale: str = "unit", values: Sequence[float] | Tensor | None = None,
                 divergence: str = "weighted_kl", alpha_clip: bool = True, alpha_form: str = "density") -> DiscodeHead:
    """DISCODE's ATT head in closed form (Inoue et al., 2026, Eq. 6): psi = softmax((z + (1 - alpha) log q) /
    alpha), q a unit-variance Gaussian around the raw score, alpha = N(s_raw; mu, sigma2) (Eq. 4).

    ``digit_logits`` (N, K): the label logits z at the target position (any per-row shift, e.g. full-vocabulary
    log-probabilities). ``raw_digit`` (N,) label indices: the raw score (default: argmax z, the paper's).
    ``values`` (K,): the labels' values (default 0..K-1). ``alpha_scale``: ``"unit"`` (label k of K read as k / K,
    DISCODE's default) or ``"label"`` (Eq. 4 on the values, the literal reading). ``alpha_clip`` caps alpha at 1
    (default, the paper's alpha in [0, 1]); ``alpha_form="kernel"`` drops Eq. 4's normalising constant.
    ``divergence``: ``"weighted_kl"``, or ``"kl"`` (alpha fixed at 0.5). float64; alpha -> 0 is taken as its
    limit."""
    if divergence not in heads.CLOSED_FORM:
        raise ValueError(f"divergence must be one of {heads.CLOSED_FORM} (the others have no closed form)")
    z = digit_logits.double()
    k = z.shape[-1]
    label_values = torch.arange(k, dtype=torch.float64) if values is None else torch.as_tensor(values, dtype=torch.float64)
    label_values = label_values.to(z.device)
    raw = z.argmax(-1) if raw_digit is None else raw_digit.long().to(z.device)
    log_q, alpha = heads.att_prior(raw, label_values, sigma2, alpha_scale, divergence, clip=alpha_clip, form=alpha_form)
    psi = heads.att_closed_form(z, log_q, alpha)
    return DiscodeHead(heads.expected_value(psi, label_values), psi, alpha)


# --- MSD-Score ---------------------------------------------------------------------------------------------------


def vmf_mixture(x: Tensor, mask: Tensor | None = None, k: int = 3, kappa: float = 20.0, iterations: int = 20,
                seeds: Tensor | None = None, reinit_threshold: float = 1e-6,
                dtype: torch.dtype = torch.float64,
                product_dtype: torch.dtype | None = None) -> vmf.VMFMixture:
    """A fixed-kappa von Mises-Fisher mixture of k components fitted by EM to every row of ``x`` (B, N, D) at once
    (``mask`` (B, N): the real points; default all), as MSD-Score fits its image patches (k = 3) and caption
    tokens (k = 2). Points are L2-normalised; k is capped at each row's number of points. ``seeds`` (B,) drive
    the initial means and re-initialisations (default: from the points' bits). The products of the points with
    the means run in ``product_dtype`` (default ``dtype``; MSD-Score's default multiplies its patches in
    ``torch.float32``), the rest in ``dtype``. Returns a
    :class:`~capeval_plugins.core.vmf.VMFMixture` (means (B, k, D), log_weights (B, k), ``log_density``)."""
    return vmf.fit_vmf_mixture(x, mask, n_components=k, kappa=kappa, iterations=iterations, seeds=seeds,
                               reinit_threshold=reinit_threshold, dtype=dtype, product_dtype=product_dtype)


class MSDDivergence(NamedTuple):
    """``divergence`` D = beta KL_img->txt + (1 - beta) KL_txt->img, ``kl_image_text``, ``kl_text_image``,
    ``beta`` = sigmoid(-(L - L0) / tau_L), ``n_tokens`` L; each (B,)."""

    divergence: Tensor
    kl_image_text: Tensor
    kl_text_image: Tensor
    beta: Tensor
    n_tokens: Tensor


def msd_divergence(image_patches: Tensor, text_tokens: Tensor, patch_mask: Tensor | None = None,
                   token_mask: Tensor | None = None, image_index: Tensor | None = None, *, k_image: int = 3,
                   k_text: int = 2, kappa: float = 20.0, iterations: int = 20, length_l0: float = 20.0,
                   length_tau: float = 3.0, image_seeds: Tensor | None = None, text_seeds: Tensor | None = None,
                   reinit_threshold: float = 1e-6, dtype: torch.dtype = torch.float64,
                   product_dtype: torch.dtype = torch.float32) -> MSDDivergence:
    """MSD-Score's local term: vMF mixtures on an image's patch embeddings and a caption's token embeddings,
    Monte Carlo KL both ways, weighted by caption length.

    ``image_patches`` (I, N, D): patch embeddings of I images in the joint space (the metric: CLIP patch tokens
    through the visual projection); ``text_tokens`` (B, T, D): token embeddings of B captions (BOS/EOS dropped);
    masks (I, N) and (B, T) mark real points (default all); ``image_index`` (B,): the image of each caption
    (default: caption b with image b). Defaults are the paper's short-caption setting. To reproduce the metric
    exactly, pass its seeds (``pixel_seeds`` of the pixels, ``content_seeds`` of the token ids,
    :mod:`capeval_plugins.metrics.msd`); by default they come from the embeddings' bits. ``dtype``: the
    precision of the fits and the KL; ``product_dtype``: the one the patches are multiplied with the means in
    (the defaults are the metric's ``em_dtype="mixed"``; ``product_dtype=torch.float64`` for float64
    throughout)."""
    from capeval_plugins.metrics.msd import length_weighted_divergence

    local = length_weighted_divergence(
        image_patches, patch_mask, text_tokens, token_mask, image_index, image_seeds=image_seeds,
        text_seeds=text_seeds, k_image=k_image, k_text=k_text, kappa=kappa, iterations=iterations,
        reinit_threshold=reinit_threshold, length_l0=length_l0, length_tau=length_tau, dtype=dtype,
        product_dtype=product_dtype)
    return MSDDivergence(local.bi_kl, local.kl.image_to_text, local.kl.text_to_image, local.beta, local.n_tokens)


def msd_score(cosine: Tensor, divergence: Tensor, lam: float = 0.1) -> Tensor:
    """MSD = g - lambda D: ``cosine`` (B,) the global image-text cosine g, ``divergence`` (B,) D from
    :func:`msd_divergence`."""
    return cosine.double() - lam * divergence.double()


def soft_msd(cosine: Tensor, divergence: Tensor, group_ids: Tensor, lam: float = 0.1, tau: float = 0.2) -> Tensor:
    """Soft-MSD = g - lambda u D over the candidates of each group (e.g. of one image): p = softmax(g / tau),
    u = clamp(M/(M-1) (1 - max p), 0, 1), u = 1 for a group of one. ``group_ids`` (B,) int (a negative id: a
    group of its own). Returns (B,)."""
    from capeval_plugins.metrics.msd import soft_msd_scores

    return soft_msd_scores(cosine.double(), divergence.double(), group_ids.long(), lam, tau)


# --- correlation with human judgments ----------------------------------------------------------------------------


def kendall_tau(x: Tensor | Sequence[float], y: Tensor | Sequence[float], variant: str = "b") -> float:
    """Kendall's tau-b or tau-c (Stuart's) of two equally long score vectors, as ``scipy.stats.kendalltau(x, y,
    variant=...)``; NaN when undefined (fewer than two samples or a constant input). NaN inputs are an error."""
    return correlation.kendall_tau(_numpy(x), _numpy(y), variant)


def pairwise_accuracy(score_a: Tensor | Sequence[float], score_b: Tensor | Sequence[float],
                      preferred: Tensor | Sequence[int], ties: str = "half") -> float:
    """Share of caption pairs where the metric prefers the caption humans preferred (``preferred`` = 0 for A,
    1 for B); a tie counts 0.5 (``ties="half"``) or 0 (``"wrong"``)."""
    return correlation.pairwise_accuracy(_numpy(score_a), _numpy(score_b), _numpy(preferred), ties)


def _numpy(values) -> np.ndarray:
    return host(values)
