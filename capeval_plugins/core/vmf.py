"""Batched fixed-kappa von Mises-Fisher mixtures on the unit sphere, and Monte Carlo KL between them.

Used by MSD-Score (Sec. 3.3-3.6). Every function works on a whole batch at once: points are ``(B, N, D)``
with a boolean ``(B, N)`` mask (True = a real point), so rows of different lengths share one tensor and no
per-sample Python loop runs.

- Densities drop the normalising constant C_D(kappa): with one fixed kappa for every component of both
  mixtures it cancels in the E-step and in every KL between them, and it is hard to evaluate for large D.
  ``log p(x) = logsumexp_k(log w_k + kappa <x, mu_k>)``.
- EM (Algorithm 1): E-step ``r_nk = softmax_k(kappa <x_n, mu_k> + log w_k)`` in log space; M-step
  ``N_k = sum_n r_nk``, ``w_k = N_k / N``, ``mu_k = normalise(sum_n r_nk x_n)``. K is capped at the number of
  valid points of each row. A component whose ``N_k`` falls below ``reinit_threshold * N`` is re-initialised
  at a random point of its row with weight ``1 / N`` (weights renormalised), as the reference code does.
- Randomness (the initial means, re-initialisation points) comes from a counter-based integer hash keyed by
  a per-row seed and the point's rank among the row's valid points, so a row's fit depends only on the row
  itself: not on the batch it sits in, its position there, or where its padding is.
  :func:`content_seeds` derives such a seed from a row's discrete content (token ids, pixel bits).
- Speed (``benchmarks/msd_em.py``): the random draws of every step are made before the EM loop, which is then
  a fixed sequence of tensor operations per step with no host synchronisation; rows are fitted in chunks whose
  points stay in cache across the 2 x iterations passes over them (:data:`CHUNK_BYTES`); the KL takes both
  mixtures' densities at the patches from one pass. The E- and M-steps are products of the points with 2-5
  vectors, bound by reading the points: ``product_dtype=torch.float32`` halves the bytes while the rest stays in
  ``dtype`` (:data:`PRECISIONS`), and the points are never normalised in place (:class:`Points`), so they are
  not copied either when they come in that dtype.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: a 32-bit value times this stays far below 2**63, so int64 never overflows
_RANK_BITS = 20  # keys carry the point's rank in their low bits: unique per row for rows up to 2**20 points
_NO_KEY = torch.iinfo(torch.int64).max
INIT_STREAM = 0


def mix32(x: Tensor) -> Tensor:
    """A 32-bit integer mixing hash on int64 tensors (values taken mod 2**32), identical on CPU and GPU."""
    x = x & _MASK32
    x = (((x >> 16) ^ x) * _MUL) & _MASK32
    x = (((x >> 16) ^ x) * _MUL) & _MASK32
    return (x >> 16) ^ x


def reinit_stream(iteration: int | Tensor, component: int | Tensor) -> int | Tensor:
    """The random stream of the re-initialisation of ``component`` after EM step ``iteration``."""
    return 1 + iteration * 65536 + component


def _stream_hash(seeds: Tensor, stream: int | Tensor) -> Tensor:
    stream = torch.as_tensor(stream, dtype=torch.int64, device=seeds.device)
    return mix32(seeds.to(torch.int64) ^ mix32(stream + 0x9E3779B9))


def random_keys(seeds: Tensor, stream: int | Tensor, ranks: Tensor) -> Tensor:
    """Distinct pseudo-random int64 keys, one per (seed, stream, rank); sorting a row's keys gives a random
    permutation of its points. Shapes broadcast (``seeds`` and ``stream`` against the leading dims of
    ``ranks``)."""
    h = _stream_hash(seeds.to(ranks.device), stream)
    return (mix32(h ^ mix32(ranks + 0x7F4A7C15)) << _RANK_BITS) + ranks


def random_draws(seeds: Tensor, stream: int | Tensor) -> Tensor:
    """One pseudo-random 32-bit integer per (seed, stream); ``% n`` picks one of n points."""
    return mix32(_stream_hash(seeds, stream) + 0x632BE5AB)


@functools.lru_cache(maxsize=16)
def _position_weights(length: int, device: torch.device) -> Tensor:
    """A pseudo-random 31-bit multiplier per position (cached: pixel rows are long and always the same)."""
    return mix32(torch.arange(length, dtype=torch.int64, device=device) + 0x5BD1E995) >> 1


def content_seeds(values: Tensor, mask: Tensor | None = None, seed: int = 0) -> Tensor:
    """One 32-bit seed per row from the row's discrete content: ``values`` is ``(B, ...)`` of integers (token
    ids; float tensors are read through their bits), ``mask`` marks the entries that count. Equal content gives
    an equal seed wherever the row sits and however it is padded; ``seed`` shifts every seed.

    The row hash is ``sum_j v_j w_{rank j} mod 2**32`` with fixed pseudo-random 31-bit multipliers ``w``
    (three integer operations per entry, so hashing the pixels of an image costs little), then mixed."""
    if values.is_floating_point():
        values = values.float().contiguous().view(torch.int32)
    values = values.reshape(len(values), -1).to(torch.int64) & _MASK32
    weights = _position_weights(values.shape[1], values.device)
    if mask is None:
        terms = (values * weights) & _MASK32
        count = torch.full((len(values),), values.shape[1], dtype=torch.int64, device=values.device)
    else:
        mask = mask.reshape(len(values), -1).bool()
        ranks = (mask.long().cumsum(1) - 1).clamp_min(0)
        terms = ((values * weights[ranks]) & _MASK32) * mask
        count = mask.sum(1)
    total = terms.sum(1) & _MASK32
    return mix32(mix32(total) ^ mix32(count + 0x27D4EB2F) ^ mix32(torch.full_like(total, seed)))


@dataclass
class VMFMixture:
    """Fitted mixtures, one per row: ``means`` (B, K, D) unit vectors and ``log_weights`` (B, K), ``-inf`` for
    components beyond ``n_components`` (= min(K, valid points)). ``log_likelihood`` (B, iterations) is the
    mean log-density (constant dropped) at each E-step; ``reinitialised`` (B, iterations) counts components
    re-initialised after each M-step."""

    means: Tensor
    log_weights: Tensor
    kappa: float
    n_components: Tensor
    log_likelihood: Tensor
    reinitialised: Tensor

    def __len__(self) -> int:
        return len(self.means)

    def __getitem__(self, rows: Tensor) -> "VMFMixture":
        return VMFMixture(self.means[rows], self.log_weights[rows], self.kappa, self.n_components[rows],
                          self.log_likelihood[rows], self.reinitialised[rows])

    def log_density(self, x: Tensor, mask: Tensor | None = None, rows: Tensor | None = None) -> Tensor:
        """``log p(x)`` (constant dropped) of every point, ``(B', N)``; 0 where ``mask`` is False. Row ``b`` of
        ``x`` is scored by mixture ``rows[b]`` (default: mixture ``b``)."""
        means, log_w = (self.means, self.log_weights) if rows is None else (self.means[rows], self.log_weights[rows])
        x = x.to(means.dtype)
        logits = self.kappa * torch.bmm(x, means.transpose(1, 2)) + log_w[:, None, :]
        out = torch.logsumexp(logits, dim=-1)
        return out if mask is None else torch.where(mask.bool(), out, torch.zeros_like(out))


@dataclass
class Points:
    """Rows of points ready for fitting and scoring: ``x`` (B, N, D) as given, zero at padding, in the dtype the
    products with the means run in; ``scale`` (B, N) the reciprocal of each point's norm in the fit's dtype, 0 at
    padding; ``mask`` (B, N); ``counts`` (B,) valid points per row. The unit vectors ``x * scale`` are never
    formed: every product with the points is scaled afterwards, on its (B, K, N) result or on the (B, K, N)
    responsibilities. So the (large) patch tensor is neither copied nor rewritten when it comes in the product
    dtype, and the normalisation itself is done in the fit's dtype. Made once by :func:`points`, shared by the fit
    and the KL."""

    x: Tensor
    mask: Tensor
    counts: Tensor
    scale: Tensor

    def __getitem__(self, rows: Tensor) -> "Points":
        return Points(self.x[rows], self.mask[rows], self.counts[rows], self.scale[rows])

    def unit(self) -> Tensor:
        """The unit vectors, in the fit's dtype (a copy: for small uses)."""
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
    if not bool(mask.all()):
        values = values.masked_fill(~mask[..., None], 0.0)  # NaN at padding would reach every product
    norm = _norm(values).to(dtype).clamp_min_(1e-12)
    return Points(values, mask, mask.sum(1), torch.where(mask, 1.0 / norm, 0.0))


def _norm(x: Tensor) -> Tensor:
    """Norms of the last axis. A float32 norm over 768 values is off by up to ~2e-7 (relative); taken over groups
    of 32 values in float32 and across the groups in float64 it is within ~3e-8, at no extra cost. float64 (or a
    width with no such grouping) is taken as it is."""
    width = x.shape[-1]
    if x.dtype == torch.float64 or width % 32:
        return torch.linalg.vector_norm(x, dim=-1)
    parts = torch.linalg.vector_norm(x.reshape(*x.shape[:-1], width // 32, 32), dim=-1)
    return torch.linalg.vector_norm(parts.double(), dim=-1)


# The points of the rows fitted together in one chunk: small enough to stay in cache over the 2 x iterations
# passes the EM makes over them (at batch 256 the whole patch tensor is 400 MB in float64), large enough to
# spread the fixed cost of each tensor operation over several rows. 6 MiB is 4 rows of 256 ViT-L/14 patches in
# float64, 8 in float32. On the 2-core development machine 12 MiB was the fastest when it was quiet; with other
# jobs sharing its cache, 6 MiB was 1.1-1.4x faster than 12 and no slower in the quietest repeats
# (benchmarks/msd_em.py --chunk-mib).
CHUNK_BYTES = 6 << 20

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
    budget = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    per_row = max(1, x[0].numel() * x.element_size()) if len(x) else 1
    return len(x) if budget <= 0 else max(1, min(len(x), budget // per_row))


def initial_positions(seeds: Tensor, mask: Tensor, n_components: int) -> Tensor:
    """(B, K): where each component's mean starts, the first K points of a random permutation of the row's valid
    points (positions beyond a row's valid points point at position 0: those components are inactive)."""
    ranks = mask.long().cumsum(1) - 1
    keys = random_keys(seeds[:, None], INIT_STREAM, ranks).masked_fill(~mask, _NO_KEY)
    first = keys.topk(min(n_components, mask.shape[1]), dim=1, largest=False).indices
    return F.pad(first, (0, n_components - first.shape[1]))


def restart_positions(seeds: Tensor, mask: Tensor, counts: Tensor, iterations: int, n_components: int) -> Tensor:
    """(B, iterations, K): where component k restarts if it collapses after step t (a random valid point of its
    row), drawn for every (t, k) before the EM starts, so the loop itself draws nothing."""
    device = mask.device
    steps = torch.arange(iterations, device=device)[None, :, None]
    components = torch.arange(n_components, device=device)[None, None, :]
    rank = random_draws(seeds[:, None, None], reinit_stream(steps, components)) % counts[:, None, None]
    by_rank = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices  # position of the r-th valid point
    return torch.gather(by_rank, 1, rank.reshape(len(mask), -1)).reshape(rank.shape)


def _em(at: Points, floor: Tensor, means: Tensor, log_w: Tensor, restart_at: Tensor, kappa: float,
        iterations: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``iterations`` EM steps on one chunk of rows. ``floor`` (B, K) is the mass below which a component
    collapses (-inf for inactive components), ``restart_at`` (B, iterations, K) where it then restarts. Returns
    the means, log-weights, ``log p(x_n)`` at every E-step (iterations, B, N) and the collapse flags
    (iterations, B, K).

    A step is a fixed sequence of tensor operations with no host synchronisation and no data-dependent branch:
    one log-sum-exp over the components gives both ``log p(x_n)`` and the responsibilities from a single
    exponential; padding (zero vectors, scale 0) is kept out of the masses by a masked sum and adds nothing to
    the resultants; a collapsed component's responsibilities are replaced, with ``where`` whether or not anything
    collapsed, by the indicator of its restart point (all made before the loop). Both matrix products read the
    points in their (N, D) layout (the E-step through a transposed view), so one copy of them is what stays in
    cache; they run in the points' dtype, everything else in the means' dtype."""
    x, dtype = at.x, means.dtype
    N = x.shape[1]
    columns = x.transpose(1, 2)
    scale = at.scale[:, None, :]
    kappa_scale = kappa * scale
    restart = (torch.arange(N, device=x.device) == restart_at[..., None]).to(dtype)  # (B, iterations, K, N)
    valid = at.mask.to(dtype)[:, :, None]
    log_norms = means.new_empty(iterations, *at.mask.shape)
    collapsed = torch.zeros(iterations, *floor.shape, dtype=torch.bool, device=x.device)
    for step in range(iterations):
        logits = torch.bmm(means.to(x.dtype), columns).to(dtype).mul_(kappa_scale).add_(log_w[:, :, None])
        top = logits.amax(1, keepdim=True)  # logits, resp: (B, K, N)
        resp = logits.sub_(top).exp_()
        total = resp.sum(1, keepdim=True)
        torch.add(top, total.log(), out=log_norms[step, :, None, :])
        resp.div_(total)
        mass = torch.bmm(resp, valid)[..., 0]
        dead = torch.lt(mass, floor, out=collapsed[step])
        # A collapsed component restarts at a random valid point of its row, with weight 1/N (mass 1): as the
        # point's indicator, the M-step's product below makes that point its mean.
        resp = torch.where(dead[..., None], restart[:, step], resp)
        kept = torch.where(dead, 1.0, mass)
        log_w = torch.log(kept / kept.sum(-1, keepdim=True))
        means = F.normalize(torch.bmm(resp.mul_(scale).to(x.dtype), x).to(dtype), dim=-1)
    return means, log_w, log_norms, collapsed


def fit_vmf_mixture(
    x: Tensor | Points,
    mask: Tensor | None = None,
    *,
    n_components: int,
    kappa: float = 20.0,
    iterations: int = 20,
    seeds: Tensor | None = None,
    reinit_threshold: float = 1e-6,
    dtype: torch.dtype = torch.float64,
    product_dtype: torch.dtype | None = None,
    chunk_bytes: int | None = None,
) -> VMFMixture:
    """Fit a fixed-kappa vMF mixture to every row of ``x`` (B, N, D, or :class:`Points`) at once.

    ``seeds`` (B,) drive the random choices; by default they come from the row's own points
    (:func:`content_seeds` of their bits), which is exact only when those bits do not depend on the batch:
    pass seeds derived from discrete content (token ids, pixels) when features may carry float noise.
    Rows are fitted in chunks of about ``chunk_bytes`` of points (default :data:`CHUNK_BYTES`; 0: all at once),
    which changes the speed, not the result.

    ``dtype`` is the precision of the fit (means, weights, responsibilities, log-likelihoods); ``product_dtype``
    the one the points are kept in and multiplied with the means in (default ``dtype``, or for :class:`Points`
    the dtype they hold; see :data:`PRECISIONS`).
    """
    if n_components < 1 or iterations < 0:
        raise ValueError("n_components must be >= 1 and iterations >= 0")
    prepared = points(x, mask, dtype, product_dtype)
    x, mask, counts = prepared.x, prepared.mask, prepared.counts
    empty = (counts == 0).nonzero().flatten()
    if len(empty):
        raise ValueError(f"rows {empty.tolist()} have no valid points to fit a mixture to")
    B, K, device = len(x), n_components, x.device
    if seeds is None:
        seeds = content_seeds(x, mask[..., None].expand_as(x))
    seeds = seeds.to(device=device, dtype=torch.int64)
    k_eff = counts.clamp(max=K)
    active = torch.arange(K, device=device)[None, :] < k_eff[:, None]
    row, first = torch.arange(B, device=device)[:, None], initial_positions(seeds, mask, K)
    means = x[row, first].to(dtype) * prepared.scale[row, first][..., None]
    minus_inf = torch.tensor(-math.inf, dtype=dtype, device=device)
    log_w = torch.where(active, -torch.log(k_eff.to(dtype))[:, None], minus_inf)
    floor = torch.where(active, reinit_threshold * counts.to(dtype)[:, None], minus_inf)
    restart_at = restart_positions(seeds, mask, counts, iterations, K)

    parts = [_em(prepared[rows], floor[rows], means[rows], log_w[rows], restart_at[rows], float(kappa), iterations)
             for rows in _row_chunks(B, _chunk_size(x, chunk_bytes))]
    means = torch.cat([p[0] for p in parts])
    log_w = torch.cat([p[1] for p in parts])
    log_norms = torch.cat([p[2] for p in parts], dim=1)
    collapsed = torch.cat([p[3] for p in parts], dim=1)
    trace = ((log_norms * mask).sum(-1) / counts.to(dtype)).T
    return VMFMixture(means, log_w, float(kappa), k_eff, trace, collapsed.sum(-1).T)


def _row_chunks(n: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def monte_carlo_kl(log_p: Tensor, log_q: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """KL(p || q) estimated on points drawn from p: the mean over valid points of ``log p - log q``.

    Returns ``(kl (B,), contributions (B, N))``; a point's contribution is its log-ratio divided by the
    row's number of valid points (0 at padding), so the contributions of a row sum to its KL."""
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
        density = torch.logsumexp(mixture.kappa * part + mixture.log_weights[:, None, :], dim=-1)
        out.append(torch.where(at.mask, density, torch.zeros_like(density)))
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
    log_q_tokens, log_p_tokens = _log_densities(tokens, text_mixture, image_mixture[image_index])
    kl_it, patch_terms = monte_carlo_kl(log_p_patches, log_q_patches, pairs.mask)
    kl_ti, token_terms = monte_carlo_kl(log_q_tokens, log_p_tokens, tokens.mask)
    return BiKL(kl_it, kl_ti, patch_terms, token_terms)
