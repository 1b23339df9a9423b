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
  vectors, bound by reading the points, which in float64 is the floor; ``dtype=torch.float32`` halves it.
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
    """Rows of points ready for fitting and scoring: unit vectors ``x`` (B, N, D) in the working dtype, zero
    at padding, ``mask`` (B, N) and ``counts`` (B,) valid points per row. Made once by :func:`points` and
    shared by the fit and the KL, so the (large) patch tensor is copied and normalised once."""

    x: Tensor
    mask: Tensor
    counts: Tensor

    def __getitem__(self, rows: Tensor) -> "Points":
        return Points(self.x[rows], self.mask[rows], self.counts[rows])


def points(x: Tensor | Points, mask: Tensor | None = None, dtype: torch.dtype = torch.float64) -> Points:
    """Validate, cast and L2-normalise ``x`` (B, N, D); padding (``mask`` False) never reaches the arithmetic,
    even if it holds NaN. A :class:`Points` in the right dtype is returned as it is."""
    if isinstance(x, Points):
        return x if x.x.dtype == dtype else Points(x.x.to(dtype), x.mask, x.counts)
    if x.ndim != 3:
        raise ValueError(f"points must be (B, N, D), got shape {tuple(x.shape)}")
    mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else mask.bool()
    if mask.shape != x.shape[:2]:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match points {tuple(x.shape[:2])}")
    # One copy in ``dtype``, then in place (this is the largest tensor of a batch); padding (which may hold NaN)
    # is cleared only where there is some.
    unit = x.to(dtype, copy=True)
    if not bool(mask.all()):
        unit.masked_fill_(~mask[..., None], 0.0)
    unit.div_(torch.linalg.vector_norm(unit, dim=-1, keepdim=True).clamp_min_(1e-12))
    return Points(unit, mask, mask.sum(1))


# The points of the rows fitted together in one chunk: small enough to stay in cache over the 2 x iterations
# passes the EM makes over them (at batch 256 the whole patch tensor is 400 MB in float64), large enough to
# spread the fixed cost of each tensor operation over several rows. 12 MiB is 8 rows of 256 ViT-L/14 patches in
# float64, 16 in float32, the fastest on the CPUs measured (benchmarks/msd_em.py --chunk-mib).
CHUNK_BYTES = 12 << 20


def _chunk_size(x: Tensor, chunk_bytes: int | None) -> int:
    budget = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    per_row = max(1, x[0].numel() * x.element_size()) if len(x) else 1
    return len(x) if budget <= 0 else max(1, min(len(x), budget // per_row))


def _restart_positions(seeds: Tensor, mask: Tensor, counts: Tensor, iterations: int, n_components: int) -> Tensor:
    """(B, iterations, K): where component k restarts if it collapses after step t (a random valid point of its
    row), drawn for every (t, k) before the EM starts, so the loop itself draws nothing."""
    device = mask.device
    steps = torch.arange(iterations, device=device)[None, :, None]
    components = torch.arange(n_components, device=device)[None, None, :]
    rank = random_draws(seeds[:, None, None], reinit_stream(steps, components)) % counts[:, None, None]
    by_rank = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices  # position of the r-th valid point
    return torch.gather(by_rank, 1, rank.reshape(len(mask), -1)).reshape(rank.shape)


def _em(x: Tensor, mask: Tensor, floor: Tensor, means: Tensor, log_w: Tensor, restart_at: Tensor, kappa: float,
        iterations: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``iterations`` EM steps on one chunk of rows. ``floor`` (B, K) is the mass below which a component
    collapses (-inf for inactive components), ``restart_at`` (B, iterations, K) where it then restarts. Returns
    the means, log-weights, ``log p(x_n)`` at every E-step (iterations, B, N) and the collapse flags
    (iterations, B, K).

    A step is a fixed sequence of tensor operations with no host synchronisation and no data-dependent branch:
    one log-sum-exp over the components gives both ``log p(x_n)`` and the responsibilities from a single
    exponential; padding (zero vectors) is kept out of the masses by a masked sum and adds nothing to the
    resultants; a collapsed component's restart point (gathered for every step before the loop) is selected
    with ``where``, whether or not anything collapsed. Both matrix products read the points in their (N, D)
    layout (the E-step through a transposed view), so one copy of them is what stays in cache."""
    B, N, _ = x.shape
    columns = x.transpose(1, 2)
    rows = torch.arange(B, device=x.device)[:, None, None] * N
    restart = x.reshape(B * N, -1).index_select(0, (rows + restart_at).flatten()).reshape(*restart_at.shape, -1)
    valid = mask.to(x.dtype)[:, :, None]
    log_norms = x.new_empty(iterations, B, N)
    collapsed = torch.zeros(iterations, B, floor.shape[1], dtype=torch.bool, device=x.device)
    for step in range(iterations):
        logits = torch.bmm(means, columns).mul_(kappa).add_(log_w[:, :, None])  # (B, K, N)
        top = logits.amax(1, keepdim=True)
        resp = logits.sub_(top).exp_()
        total = resp.sum(1, keepdim=True)
        torch.add(top, total.log(), out=log_norms[step, :, None, :])
        resp.div_(total)
        mass = torch.bmm(resp, valid)[..., 0]
        dead = torch.lt(mass, floor, out=collapsed[step])
        # A collapsed component restarts at a random valid point of its row, with weight 1/N (mass 1).
        sums = torch.where(dead[..., None], restart[:, step], torch.bmm(resp, x))
        kept = torch.where(dead, 1.0, mass)
        log_w = torch.log(kept / kept.sum(-1, keepdim=True))
        means = F.normalize(sums, dim=-1)
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
    chunk_bytes: int | None = None,
) -> VMFMixture:
    """Fit a fixed-kappa vMF mixture to every row of ``x`` (B, N, D, or :class:`Points`) at once.

    ``seeds`` (B,) drive the random choices; by default they come from the row's own points
    (:func:`content_seeds` of their bits), which is exact only when those bits do not depend on the batch:
    pass seeds derived from discrete content (token ids, pixels) when features may carry float noise.
    Rows are fitted in chunks of about ``chunk_bytes`` of points (default :data:`CHUNK_BYTES`; 0: all at once),
    which changes the speed, not the result.
    """
    if n_components < 1 or iterations < 0:
        raise ValueError("n_components must be >= 1 and iterations >= 0")
    prepared = points(x, mask, dtype)
    x, mask, counts = prepared.x, prepared.mask, prepared.counts
    empty = (counts == 0).nonzero().flatten()
    if len(empty):
        raise ValueError(f"rows {empty.tolist()} have no valid points to fit a mixture to")
    B, N, _ = x.shape
    K = n_components
    device = x.device
    if seeds is None:
        seeds = content_seeds(x, mask[..., None].expand_as(x))
    seeds = seeds.to(device=device, dtype=torch.int64)
    ranks = mask.long().cumsum(1) - 1
    k_eff = counts.clamp(max=K)
    active = torch.arange(K, device=device)[None, :] < k_eff[:, None]

    # Initial means: the first K points of a random permutation of the row's valid points.
    keys = random_keys(seeds[:, None], INIT_STREAM, ranks).masked_fill(~mask, _NO_KEY)
    first = keys.topk(min(K, N), dim=1, largest=False).indices
    first = F.pad(first, (0, K - first.shape[1]))  # components beyond N are inactive anyway
    means = x[torch.arange(B, device=device)[:, None], first]
    minus_inf = torch.tensor(-math.inf, dtype=dtype, device=device)
    log_w = torch.where(active, -torch.log(k_eff.to(dtype))[:, None], minus_inf)
    floor = torch.where(active, reinit_threshold * counts.to(dtype)[:, None], minus_inf)
    restart_at = _restart_positions(seeds, mask, counts, iterations, K)

    parts = [_em(x[rows], mask[rows], floor[rows], means[rows], log_w[rows], restart_at[rows], float(kappa),
                 iterations)
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
    dots = torch.bmm(at.x, torch.cat([first.means, second.means], 1).transpose(1, 2))
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
    once for all of its captions. Masks are ignored for :class:`Points`."""
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
