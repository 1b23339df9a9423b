"""Batched mixtures on the unit sphere fitted by EM (MSD-Score's fixed-kappa von Mises-Fisher mixtures, and the
ablations of its Table II), and Monte Carlo KL between them.

Used by MSD-Score (Sec. 3.3-3.6). Every function works on a whole batch at once: points are ``(B, N, D)``
with a boolean ``(B, N)`` mask (True = a real point), so rows of different lengths share one tensor and no
per-sample Python loop runs. Points are L2-normalised.

- A component's log-density is ``scale_k <x, mu_k> + offset_k`` up to a constant shared by every component of
  both mixtures, ``log p(x) = logsumexp_k(log w_k + scale_k <x, mu_k> + offset_k)``:

  * ``family="vmf"`` (the paper): ``scale_k = kappa``, ``offset_k = 0``. The normalising constant C_D(kappa) is
    dropped: with one fixed kappa for every component of both mixtures it cancels in the E-step and in every KL
    between them.
  * ``adaptive_kappa=True`` (Table II's "vMF (adaptive kappa)"): ``scale_k = kappa_k`` re-estimated at every
    M-step from the mean resultant length R_k = |sum_n r_nk x_n| / N_k by the paper's Eq. 12,
    ``kappa_k = R_k (D - R_k^2) / (1 - R_k^2)`` (Banerjee et al., 2005), starting from ``kappa``; the normaliser no
    longer cancels: ``offset_k = log C_D(kappa_k)`` (:func:`log_vmf_normaliser`).
  * ``family="gaussian"`` (Table II's "GMM (Euclidean)"): isotropic Gaussians with one fixed standard deviation
    sigma, ``-|x - mu_k|^2 / (2 sigma^2) = 2 g <x, mu_k> - g |mu_k|^2 - g`` with g = 1 / (2 sigma^2) and |x| = 1:
    ``scale_k = 2 g``, ``offset_k = -g |mu_k|^2``; the means are the weighted means of the points (not unit).

- EM (Algorithm 1): E-step ``r_nk = softmax_k(log w_k + scale_k <x_n, mu_k> + offset_k)`` in log space; M-step
  ``N_k = sum_n r_nk``, the means from ``sum_n r_nk x_n`` (normalised for a vMF), the weights below. K is capped at
  the number of valid points of each row. ``update`` is how the weights are updated and collapses handled:

  * ``"restart"`` (the paper's Sec. 3.4, the reference code): ``w_k = N_k / N``; a component whose ``N_k`` falls
    below ``reinit_threshold * N`` is re-initialised at a random point of its row with weight ``1 / N`` (and, with
    an adaptive kappa, the starting kappa); the weights are renormalised.
  * ``"coco-cf"`` (the official COCO-CF script, ``coco_eval_cf.py``): no re-initialisation, weights
    ``w_k = (N_k + 1e-8) / N`` (not renormalised) that enter every log-density as ``log(w_k + 1e-9)``.

- Randomness (the initial means, re-initialisation points) comes from :mod:`capeval_plugins.core.draws`, a
  counter-based integer hash keyed by a per-row seed and the point's rank among the row's valid points, so a row's
  fit depends only on the row itself: not on the batch it sits in, its position there, or where its padding is.
- Speed (``benchmarks/msd_em.py``): the random draws of every step are made before the EM loop, which is then
  a fixed sequence of tensor operations per step with no host synchronisation: two matrix products, one softmax
  and a dozen small operations on ``(B, K)`` or ``(B, K, N)`` tensors (the points are normalised once per fit;
  the components are laid out ``(B, K, N)``, the fast layout for both the products and the softmax over K;
  casts between precisions ride on the operations that need them). Rows are fitted in chunks
  whose points stay in cache across the 2 x iterations passes over them (:data:`CHUNK_BYTES`); the KL takes both
  mixtures' densities at the patches from one pass. ``product_dtype=torch.float32`` runs the two products in
  float32, half the bytes, while the rest stays in ``dtype`` (:data:`PRECISIONS`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from capeval_plugins.core.draws import (  # noqa: F401 (re-exported: the draws of these fits)
    INIT_STREAM, content_seeds, initial_positions, mix32, random_draws, random_keys, random_positions, reinit_stream,
    restart_positions)


FAMILIES = ("vmf", "gaussian")
UPDATES = ("restart", "coco-cf")
# coco_eval_cf.py: N_k + 1e-8 before the weights, log(w + 1e-9) in every log-density.
COCO_CF_MASS_EPS, COCO_CF_WEIGHT_EPS = 1e-8, 1e-9
# An adaptive kappa is infinite for a component on one point (R = 1): R is kept at most this.
MAX_RESULTANT = 1.0 - 1e-6


# ---------------------------------------------------------------------------------------------------------
# The vMF normaliser (adaptive kappa only)

# Debye's polynomials u_1..u_4 of the uniform asymptotic expansion of I_v(v z) (DLMF 10.41.10): coefficients of
# t^0, t^1, ... over a common denominator.
_DEBYE = (
    ((0, 3, 0, -5), 24),
    ((0, 0, 81, 0, -462, 0, 385), 1152),
    ((0, 0, 0, 30375, 0, -369603, 0, 765765, 0, -425425), 414720),
    ((0, 0, 0, 0, 4465125, 0, -94121676, 0, 349922430, 0, -446185740, 0, 185910725), 39813120),
)


def log_vmf_normaliser(kappa: Tensor, dim: int) -> Tensor:
    """``log C_D(kappa)`` of the vMF density ``C_D(kappa) exp(kappa <mu, x>)`` on the sphere in R^D,
    ``C_D(kappa) = kappa^v / ((2 pi)^(D/2) I_v(kappa))``, v = D/2 - 1, for every ``kappa >= 0`` (0 gives the uniform
    density). The Bessel function comes from its uniform asymptotic (Debye) expansion in v with four terms, written
    so that ``v log kappa`` cancels analytically (finite at 0, no overflow for huge kappa): within 4e-8 relative
    of the exact value for D = 16, 4e-12 for D = 64, 3e-16 for D = 768 (checked against mpmath)."""
    if dim < 3:
        raise ValueError(f"the vMF normaliser needs D >= 3, got {dim}")
    v = dim / 2 - 1
    s = torch.sqrt(1 + (kappa / v) ** 2)
    t = 1 / s
    series = torch.ones_like(t)
    for order, (coefficients, denominator) in enumerate(_DEBYE, start=1):
        polynomial = torch.zeros_like(t)
        for power in range(len(coefficients) - 1, -1, -1):  # Horner
            polynomial = polynomial * t + coefficients[power]
        series = series + polynomial / (denominator * v ** order)
    return (-(dim / 2) * math.log(2 * math.pi) + v * math.log(v) + 0.5 * math.log(2 * math.pi * v)
            - v * s + v * torch.log1p(s) + 0.5 * torch.log(s) - torch.log(series))


def adaptive_kappa(resultant: Tensor, dim: int) -> Tensor:
    """The paper's Eq. 12 (Banerjee et al., 2005): ``kappa = R (D - R^2) / (1 - R^2)`` of the mean resultant length
    R, kept at most :data:`MAX_RESULTANT` (a component on one point would get an infinite kappa)."""
    r = resultant.clamp(0.0, MAX_RESULTANT)
    return r * (dim - r * r) / (1 - r * r)


# ---------------------------------------------------------------------------------------------------------
# Mixtures and points


def component_terms(family: str, kappa: float, sigma: float | None, means: Tensor, kappas: Tensor | None,
                    keepdim: bool = False) -> tuple[float | Tensor, Tensor | None]:
    """(scale, offset) of every component's log-density ``log w_k + scale_k <x, mu_k> + offset_k`` (see the
    module's docstring): a number or per component, and per component or None (0). Per-component values are
    (B, K), or (B, K, 1) with ``keepdim`` (``kappas`` then (B, K, 1) too)."""
    if family == "gaussian":
        g = 0.5 / sigma ** 2
        return 2 * g, -g * (means * means).sum(-1, keepdim=keepdim)
    if kappas is not None:
        return kappas, log_vmf_normaliser(kappas, means.shape[-1])
    return kappa, None


@dataclass
class VMFMixture:
    """Fitted mixtures, one per row: ``means`` (B, K, D) (unit vectors for a vMF) and ``log_weights`` (B, K),
    ``-inf`` for components beyond ``n_components`` (= min(K, valid points)). ``family`` is "vmf" or "gaussian";
    ``kappa`` the fixed (or starting) concentration, ``kappas`` (B, K) each component's with an adaptive kappa,
    ``sigma`` the Gaussians' standard deviation. A component's log-density is ``scales_k <x, mu_k> + offsets_k``
    (see the module's docstring). With ``track=True``: ``log_likelihood`` (B, iterations) is the mean log-density
    (constant dropped) at each E-step and ``reinitialised`` (B, iterations) counts components re-initialised
    after each M-step (None otherwise)."""

    means: Tensor
    log_weights: Tensor
    kappa: float
    n_components: Tensor
    family: str = "vmf"
    kappas: Tensor | None = None
    sigma: float | None = None
    log_likelihood: Tensor | None = None
    reinitialised: Tensor | None = None

    def __len__(self) -> int:
        return len(self.means)

    def __getitem__(self, rows: Tensor) -> "VMFMixture":
        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[rows]

        return VMFMixture(self.means[rows], self.log_weights[rows], self.kappa, self.n_components[rows],
                          self.family, pick(self.kappas), self.sigma, pick(self.log_likelihood),
                          pick(self.reinitialised))

    def _terms(self) -> tuple[float | Tensor, Tensor | None]:
        return component_terms(self.family, self.kappa, self.sigma, self.means, self.kappas)

    @property
    def scales(self) -> Tensor:
        """(B, K): each component's factor of ``<x, mu_k>`` (its kappa, for a vMF)."""
        scale = self._terms()[0]
        return scale if isinstance(scale, Tensor) else torch.full_like(self.log_weights, scale)

    @property
    def offsets(self) -> Tensor:
        """(B, K): the rest of each component's log-density besides ``log w_k`` (0 for a fixed-kappa vMF)."""
        offset = self._terms()[1]
        return torch.zeros_like(self.log_weights) if offset is None else offset

    def log_density(self, x: Tensor, mask: Tensor | None = None, rows: Tensor | None = None) -> Tensor:
        """``log p(x)`` (constant dropped) of every point of ``x`` as given, ``(B', N)``; 0 where ``mask`` is False.
        Row ``b`` of ``x`` is scored by mixture ``rows[b]`` (default: mixture ``b``)."""
        mixture = self if rows is None else self[rows]
        dots = torch.bmm(x.to(mixture.means.dtype), mixture.means.transpose(1, 2))
        out = mixture._log_sum(dots)
        return out if mask is None else torch.where(mask.bool(), out, torch.zeros_like(out))

    def _log_sum(self, dots: Tensor) -> Tensor:
        """``logsumexp_k`` of the components' log-densities from the points' dot products with the means (B, N, K)."""
        scale, offset = self._terms()
        bias = self.log_weights if offset is None else self.log_weights + offset
        scaled = dots * (scale if isinstance(scale, float) else scale[:, None, :])
        return torch.logsumexp(scaled.add_(bias[:, None, :]), dim=-1)


@dataclass
class Points:
    """Rows of points ready for fitting and scoring: ``x`` (B, N, D) as given, zero at padding, in the dtype the
    products with the means run in; ``scale`` (B, N) the reciprocal of each point's norm in the fit's dtype, 0 at
    padding; ``mask`` (B, N); ``counts`` (B,) valid points per row. The (large) patch tensor is neither copied nor
    rewritten when it comes in the product dtype: the KL scales its products afterwards, and the EM forms the unit
    vectors of one chunk of rows at a time (in the fit's dtype, then rounded once to the product dtype). Made once
    by :func:`points`, shared by the fit and the KL."""

    x: Tensor
    mask: Tensor
    counts: Tensor
    scale: Tensor
    full: bool = False  # no padding: every point of every row is valid

    def __getitem__(self, rows: Tensor) -> "Points":
        return Points(self.x[rows], self.mask[rows], self.counts[rows], self.scale[rows], self.full)

    def unit(self) -> Tensor:
        """The unit vectors, in the fit's dtype (a copy), zero at padding."""
        return self.x.to(self.scale.dtype) * self.scale[..., None]


def points(x: Tensor | Points, mask: Tensor | None = None, dtype: torch.dtype = torch.float64,
           product_dtype: torch.dtype | None = None) -> Points:
    """Validate ``x`` (B, N, D), keep it in ``product_dtype`` (default ``dtype``) and take each point's reciprocal
    norm in ``dtype``; padding (``mask`` False) never reaches the arithmetic, even if it holds NaN. A
    :class:`Points` is returned as it is if its norms are in ``dtype`` and its points in ``product_dtype`` (or
    any dtype, when that is None)."""
    if isinstance(x, Points):
        kept = x.scale.dtype == dtype and product_dtype in (None, x.x.dtype)
        return x if kept else points(x.x, x.mask, dtype, product_dtype)
    store = product_dtype or dtype
    if x.ndim != 3:
        raise ValueError(f"points must be (B, N, D), got shape {tuple(x.shape)}")
    mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else mask.bool()
    if mask.shape != x.shape[:2]:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match points {tuple(x.shape[:2])}")
    values = x.to(store)  # no copy when x already comes in the product dtype (the patches, mostly)
    full = bool(mask.all())
    if not full:
        values = values.masked_fill(~mask[..., None], 0.0)  # NaN at padding would reach every product
    norm = _norm(values).to(dtype).clamp_min_(1e-12)
    scale = norm.reciprocal_() if full else torch.where(mask, 1.0 / norm, 0.0)
    return Points(values, mask, mask.sum(1), scale, full)


def _norm(x: Tensor) -> Tensor:
    """Norms of the last axis. A float32 norm over 768 values is off by up to ~2e-7 (relative); taken over groups
    of 32 values in float32 and across the groups in float64 it is within ~3e-8, at no extra cost. float64 (or a
    width with no such grouping) is taken as it is."""
    width = x.shape[-1]
    if x.dtype == torch.float64 or width % 32:
        return torch.linalg.vector_norm(x, dim=-1)
    parts = torch.linalg.vector_norm(x.reshape(*x.shape[:-1], width // 32, 32), dim=-1)
    return torch.linalg.vector_norm(parts.double(), dim=-1)


# The points of the rows fitted together in one chunk: small enough that the unit points stay in the core's cache
# (L2) over the 2 x iterations passes the EM makes over them, large enough to spread the fixed cost of each
# tensor operation over several rows where rows are small (caption tokens). 2 MiB is 2 rows of 256 ViT-L/14
# patches in float32, 1 in float64. On the 2-core development machine (2 MiB of L2 per core), at batch 64: 1-2
# MiB 2.84-2.86 ms per pair, 3 MiB 3.33, 6 MiB 3.25 (benchmarks/msd_em.py --chunk-mib; interleaved, best of 7).
CHUNK_BYTES = 2 << 20

# MSD-Score's precisions of the fits and the KL: (dtype of the means, weights, responsibilities, log-densities and
# KL; dtype the image patches are kept in and multiplied with the means in). The caption tokens are multiplied in
# the first: they are few, and padded to a width that depends on the batch, which float32 sums over them would
# round differently from batch to batch. "mixed" does the two large products of each EM step, the patches'
# (most of the time, bound by reading the patches), in float32, half the bytes, and the rest, where the
# cancellation and the small probabilities are, in float64.
PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "float64": (torch.float64, torch.float64),
    "float32": (torch.float32, torch.float32),
    "mixed": (torch.float64, torch.float32),
}


def _chunk_size(x: Tensor, chunk_bytes: int | None) -> int:
    """Rows per chunk; by default all of them off the CPU (a GPU pays per kernel launch, not for cache misses)."""
    if chunk_bytes is None and x.device.type != "cpu":
        return len(x)
    budget = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    per_row = max(1, x[0].numel() * x.element_size()) if len(x) else 1
    return len(x) if budget <= 0 else max(1, min(len(x), budget // per_row))


# ---------------------------------------------------------------------------------------------------------
# EM


@dataclass(frozen=True)
class _Model:
    """What a fit models and how it updates (see the module's docstring)."""

    family: str
    kappa: float
    adaptive: bool
    sigma: float
    update: str
    dim: int

    def terms(self, means: Tensor, kappas: Tensor | None) -> tuple[float | Tensor, Tensor | None]:
        """:func:`component_terms` on (B, K, 1)."""
        return component_terms(self.family, self.kappa, self.sigma, means, kappas, keepdim=True)

    def m_step(self, sums: Tensor, mass: Tensor, kappas: Tensor | None, dead: Tensor | None
               ) -> tuple[Tensor, Tensor | None]:
        """New means (and adaptive kappas, (B, K, 1)) from the resultants ``sums`` (B, K, D) and the masses
        (B, K, 1), in the masses' dtype."""
        if self.family == "gaussian":
            return sums / mass.clamp_min(1e-300), None
        norm = torch.linalg.vector_norm(sums, dim=-1, keepdim=True, dtype=mass.dtype).clamp_min_(1e-12)
        means = sums / norm
        if not self.adaptive:
            return means, None
        kappas = adaptive_kappa(norm / mass.clamp_min(1e-300), self.dim)
        return means, kappas if dead is None else torch.where(dead, self.kappa, kappas)


def _em(at: Points, means: Tensor, log_w: Tensor, kappas: Tensor | None, floor: Tensor, restart_at: Tensor | None,
        model: _Model, iterations: int, track: bool):
    """``iterations`` EM steps on one chunk of rows. ``log_w``, ``kappas`` (adaptive) and ``floor`` are (B, K, 1):
    ``floor`` is the mass below which a component collapses (-inf for inactive components; "restart" only),
    ``restart_at`` (B, iterations, K) where it then restarts. Returns the means, log-weights and kappas (B, K, 1)
    and, with ``track``, ``log p(x_n)`` at every E-step (iterations, B, N) and the collapse flags
    (iterations, B, K, 1).

    A step is a fixed sequence of tensor operations with no host synchronisation and no data-dependent branch.
    The E-step is one product ``(scale * means) @ unit points^T`` (B, K, N), the biases (log-weights) added in the
    means' dtype, and one softmax over K; padding (zero vectors) is kept out of the masses by the mask (skipped
    when no row is padded); a collapsed component's responsibilities are replaced, with ``where`` whether or not
    anything collapsed, by the indicator of its restart point (all made before the loop); the M-step is one
    product of the responsibilities with the points. Both products run in the points' dtype, everything else in
    the means' dtype. Per-component values keep a trailing axis of 1 so that no step reshapes anything."""
    dtype, product = means.dtype, at.x.dtype
    unit = at.x * at.scale.to(product)[..., None]  # in one precision: 10x faster than float32 x float64
    columns = unit.transpose(1, 2)
    # A fixed kappa multiplies the E-step's products as the biases are added, so the means enter as they are.
    fixed = model.family == "vmf" and not model.adaptive
    alpha = model.kappa if fixed else 1.0
    valid = None if at.full else at.mask.to(dtype)[:, None, :]
    cast = product != dtype
    if restart_at is not None:
        positions = torch.arange(unit.shape[1], device=unit.device)
        restarts = (positions == restart_at[..., None]).to(dtype).unbind(1)  # per step (B, K, N)
    else:
        n = at.counts.to(dtype)[:, None, None]
        closed = torch.where(torch.isfinite(log_w), 0.0, -math.inf).to(dtype)  # inactive components stay out
    log_norms = means.new_empty(iterations, *at.mask.shape) if track else None
    collapsed = torch.zeros(iterations, *log_w.shape, dtype=torch.bool, device=unit.device) if track else None
    scaled = means.to(product, copy=True)
    scale, offset = model.terms(means, kappas)
    for step in range(iterations):
        if not fixed:  # scale * means in dtype, rounded once into the product dtype
            torch.mul(means, scale, out=scaled)
        # the biases added in dtype
        logits = torch.add(log_w if offset is None else log_w + offset, torch.bmm(scaled, columns), alpha=alpha)
        if track:
            log_norms[step] = torch.logsumexp(logits, 1)
        resp = torch.softmax(logits, 1)
        if valid is not None:
            resp = resp.mul_(valid)
        mass = resp.sum(2, keepdim=True)
        dead = None
        if restart_at is not None:
            dead = mass < floor
            if track:
                collapsed[step] = dead
            # A collapsed component restarts at a random valid point of its row, with weight 1/N (mass 1): as the
            # point's indicator, the M-step's product below makes that point its mean.
            resp = torch.where(dead, restarts[step], resp)
            mass = torch.where(dead, 1.0, mass)
            # The E-step's softmax over K ignores a constant added to every log-weight of a row, so the weights
            # are normalised only where they are read: the log-likelihood and the returned mixture.
            log_w = torch.log(mass / mass.sum(1, keepdim=True)) if track else torch.log(mass)
        else:
            log_w = torch.log((mass + COCO_CF_MASS_EPS) / n + COCO_CF_WEIGHT_EPS) + closed
        sums = torch.bmm(resp.to(product) if cast else resp, unit)
        if fixed:  # the unit means, rounded once into the product dtype; in dtype after the last step
            norm = torch.linalg.vector_norm(sums, dim=-1, keepdim=True, dtype=dtype).clamp_min_(1e-12)
            torch.div(sums, norm, out=scaled)
        else:
            means, kappas = model.m_step(sums, mass, kappas, dead)
            scale, offset = model.terms(means, kappas)
    if iterations and restart_at is not None and not track:
        log_w = torch.log(mass / mass.sum(1, keepdim=True))
    if fixed and iterations:
        means = sums / norm
    return means, log_w, kappas, log_norms, collapsed


def fit_mixture(
    x: Tensor | Points,
    mask: Tensor | None = None,
    *,
    n_components: int,
    kappa: float = 20.0,
    iterations: int = 20,
    seeds: Tensor | None = None,
    initial: Tensor | None = None,
    reinit_threshold: float = 1e-6,
    dtype: torch.dtype = torch.float64,
    product_dtype: torch.dtype | None = None,
    chunk_bytes: int | None = None,
    family: str = "vmf",
    adaptive_kappa: bool = False,
    sigma: float = 0.1,
    update: str = "restart",
    track: bool = False,
) -> VMFMixture:
    """Fit a mixture to every row of ``x`` (B, N, D, or :class:`Points`) at once: by default MSD-Score's
    fixed-``kappa`` vMF mixture; ``family``, ``adaptive_kappa``, ``sigma`` and ``update`` select the models and
    updates of the module's docstring.

    ``seeds`` (B,) drive the random choices; by default they come from the row's own points
    (:func:`point_seeds`: a strided sample of their bits), which is exact only when those bits do not depend on
    the batch: pass seeds derived from discrete content (token ids, pixels) when features may carry float noise.
    ``initial`` (B, K) gives the positions of the initial means instead of their draw (another generator's
    draws, e.g. the official COCO-CF script's); re-initialisations are still drawn from ``seeds``.
    Rows are fitted in chunks of about ``chunk_bytes`` of points (default :data:`CHUNK_BYTES` on a CPU, all rows at
    once elsewhere; 0: all at once), which changes the speed, not the result. ``track`` records the log-likelihood and the collapses of every step.

    ``dtype`` is the precision of the fit (means, weights, responsibilities, log-likelihoods); ``product_dtype``
    the one the points are kept in and multiplied with the means in (default ``dtype``, or for :class:`Points`
    the dtype they hold; see :data:`PRECISIONS`). An adaptive kappa can grow large, so its products run in
    ``dtype``.
    """
    if n_components < 1 or iterations < 0:
        raise ValueError("n_components must be >= 1 and iterations >= 0")
    if family not in FAMILIES or update not in UPDATES:
        raise ValueError(f"family must be one of {FAMILIES} and update one of {UPDATES}")
    if adaptive_kappa and family != "vmf":
        raise ValueError("adaptive_kappa applies to the vMF family")
    if not sigma > 0:
        raise ValueError("sigma must be > 0")
    prepared = points(x, mask, dtype, dtype if adaptive_kappa else product_dtype)
    x, mask, counts = prepared.x, prepared.mask, prepared.counts
    empty = list(range(len(x))) if x.shape[1] == 0 else [] if prepared.full else (counts == 0).nonzero().flatten()
    if len(empty):
        raise ValueError(f"rows {list(map(int, empty))} have no valid points to fit a mixture to")
    B, K, device = len(x), n_components, x.device
    model = _Model(family, float(kappa), adaptive_kappa, float(sigma), update, x.shape[-1])
    if seeds is None:
        seeds = point_seeds(x, mask)
    seeds = seeds.to(device=device, dtype=torch.int64)
    first, restart_at = random_positions(seeds, mask, K, iterations if update == "restart" else None, counts)
    if initial is not None:
        if tuple(initial.shape) != (B, K):
            raise ValueError(f"initial must hold ({B}, {K}) positions, got {tuple(initial.shape)}")
        first = initial.to(device=device, dtype=torch.int64)
    row = torch.arange(B, device=device)[:, None]
    means = x[row, first].to(dtype) * prepared.scale[row, first][..., None]
    k_eff, log_w, floor = _start(prepared, K, update, reinit_threshold, dtype)
    kappas = torch.full((B, K, 1), float(kappa), dtype=dtype, device=device) if adaptive_kappa else None

    def part(rows: slice | None):
        if rows is None:  # one chunk: no slicing
            return _em(prepared, means, log_w, kappas, floor, restart_at, model, iterations, track)
        return _em(prepared[rows], means[rows], log_w[rows], None if kappas is None else kappas[rows], floor[rows],
                   None if restart_at is None else restart_at[rows], model, iterations, track)

    size = _chunk_size(x, chunk_bytes)
    parts = [part(None)] if size >= B else [part(rows) for rows in _row_chunks(B, size)]

    def joined(i: int, dim: int = 0) -> Tensor:
        return parts[0][i] if len(parts) == 1 else torch.cat([p[i] for p in parts], dim=dim)

    means, log_w = joined(0), joined(1)
    kappas = joined(2) if adaptive_kappa else None
    trace = reinitialised = None
    if track:
        trace = ((joined(3, 1) * mask).sum(-1) / counts.to(dtype)).T
        reinitialised = joined(4, 1).sum((-2, -1)).T
    return VMFMixture(means, log_w[..., 0], float(kappa), k_eff, family, None if kappas is None else kappas[..., 0],
                      float(sigma) if family == "gaussian" else None, trace, reinitialised)


fit_vmf_mixture = fit_mixture

POINT_STRIDE = 61  # every 61st coordinate of each point goes into its row's default seed


def point_seeds(x: Tensor, mask: Tensor) -> Tensor:
    """Default seeds (B,) of :func:`fit_mixture`: :func:`content_seeds` of every :data:`POINT_STRIDE`-th
    coordinate of each valid point (a seed only has to be a deterministic function of the row's points; hashing
    all of a ViT-L/14 image's 196,608 values cost more than its EM at one pair a call). Valid points count by
    their rank, so padding does not move a seed."""
    sample = x[..., ::POINT_STRIDE]
    return content_seeds(sample, mask[..., None].expand_as(sample))


def _start(at: Points, k: int, update: str, threshold: float, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Components per row (B,), the initial log-weights and the collapse floors (B, K, 1): uniform weights over
    min(K, valid points) components, -inf for the others."""
    B, N = at.mask.shape
    start = -math.log(min(k, N)) if update == "restart" else math.log(1 / min(k, N) + COCO_CF_WEIGHT_EPS)
    if at.full:  # every row has N points: the same K' = min(K, N) active components everywhere
        log_w = torch.full((B, k, 1), -math.inf, dtype=dtype, device=at.x.device)
        log_w[:, :N] = start
        floor = torch.where(torch.isfinite(log_w), threshold * N, -math.inf)
        return torch.full((B,), min(k, N), device=at.x.device), log_w, floor
    k_eff = at.counts.clamp(max=k)
    active = (torch.arange(k, device=at.x.device)[None, :] < k_eff[:, None])[..., None]
    k_float = k_eff.to(dtype)[:, None, None]
    start = -torch.log(k_float) if update == "restart" else torch.log(1 / k_float + COCO_CF_WEIGHT_EPS)
    minus_inf = torch.tensor(-math.inf, dtype=dtype, device=at.x.device)
    floor = torch.where(active, threshold * at.counts.to(dtype)[:, None, None], minus_inf)
    return k_eff, torch.where(active, start, minus_inf), floor


def _row_chunks(n: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


# ---------------------------------------------------------------------------------------------------------
# KL


def monte_carlo_kl(log_p: Tensor, log_q: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """KL(p || q) estimated on points drawn from p: the mean over valid points (``mask``; None: all) of
    ``log p - log q``.

    Returns ``(kl (B,), contributions (B, N))``; a point's contribution is its log-ratio divided by the
    row's number of valid points (0 at padding), so the contributions of a row sum to its KL."""
    if mask is None:  # every point valid
        contributions = (log_p - log_q).div_(log_p.shape[1])
        return contributions.sum(1), contributions
    mask = mask.bool()
    count = mask.sum(1, keepdim=True).to(log_p.dtype)
    contributions = torch.where(mask, (log_p - log_q) / count, torch.zeros_like(log_p))
    return contributions.sum(1), contributions


def _log_densities(at: Points, first: VMFMixture, second: VMFMixture) -> tuple[Tensor, Tensor]:
    """``log p(x)`` of every point under two mixtures (row ``b`` of each for row ``b`` of the points), from one
    pass over the points: the two sets of means are stacked into one matrix product."""
    k = first.means.shape[1]
    means = torch.cat([first.means, second.means], 1)
    dots = torch.bmm(at.x, means.to(at.x.dtype).transpose(1, 2)).to(means.dtype).mul_(at.scale[..., None])
    out = []
    for mixture, part in ((first, dots[..., :k]), (second, dots[..., k:])):
        density = mixture._log_sum(part)
        out.append(density if at.full else torch.where(at.mask, density, torch.zeros_like(density)))
    return out[0], out[1]


@dataclass
class BiKL:
    """Both KL directions between an image mixture p and a text mixture q, per pair, with per-point terms:
    ``image_to_text`` = KL(p || q) on the patches (coverage), ``text_to_image`` = KL(q || p) on the tokens
    (support)."""

    image_to_text: Tensor
    text_to_image: Tensor
    patch_contributions: Tensor
    token_contributions: Tensor


def bi_kl(
    patches: Tensor | Points,
    patch_mask: Tensor | None,
    image_mixture: VMFMixture,
    tokens: Tensor | Points,
    token_mask: Tensor | None,
    text_mixture: VMFMixture,
    image_index: Tensor | None = None,
) -> BiKL:
    """Monte Carlo bi-directional KL for B pairs. ``patches`` and ``image_mixture`` have one row per distinct
    image; pair ``b`` uses image ``image_index[b]`` (default: ``b``), so an image's own log-density is computed
    once for all of its captions. Masks are ignored for :class:`Points`, which are multiplied with the means in
    the dtype they hold; tensors in the mixtures' dtype, which the log-densities and the KL are in."""
    dtype = image_mixture.means.dtype
    patches, tokens = points(patches, patch_mask, dtype), points(tokens, token_mask, dtype)
    if image_index is None:
        image_index = torch.arange(len(tokens.x), device=tokens.x.device)
    identity = torch.arange(len(image_index), device=image_index.device)
    one_each = len(image_index) == len(patches.x) and bool((image_index == identity).all())
    pairs = patches if one_each else patches[image_index]  # the gather copies the patches: skip it if we can
    image = image_mixture if one_each else image_mixture[image_index]
    log_p_patches, log_q_patches = _log_densities(pairs, image, text_mixture)
    log_q_tokens, log_p_tokens = _log_densities(tokens, text_mixture, image)
    kl_it, patch_terms = monte_carlo_kl(log_p_patches, log_q_patches, None if pairs.full else pairs.mask)
    kl_ti, token_terms = monte_carlo_kl(log_q_tokens, log_p_tokens, None if tokens.full else tokens.mask)
    return BiKL(kl_it, kl_ti, patch_terms, token_terms)
