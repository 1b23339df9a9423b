"""Counter-based pseudo-random draws for the mixture fits of :mod:`capeval_plugins.core.vmf`: a 32-bit integer
mixing hash keyed by a per-row seed, a stream (the initial means, each re-initialisation) and a point's rank among
its row's valid points, so a row's draws depend only on the row itself: not on the batch it sits in, its position
there, or where its padding is. :func:`content_seeds` derives such a seed from a row's discrete content (token ids,
pixel bits). The same functions on CPU and GPU give the same draws."""
from __future__ import annotations

import functools
import hashlib

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: a 32-bit value times this stays far below 2**63, so int64 never overflows
_RANK_BITS = 20  # keys carry the point's rank in their low bits: unique per row for rows up to 2**20 points
_NO_KEY = torch.iinfo(torch.int64).max
_STREAM, _RANK, _DRAW = 0x9E3779B9, 0x7F4A7C15, 0x632BE5AB
INIT_STREAM = 0


def mix32(x: Tensor) -> Tensor:
    """A 32-bit integer mixing hash on int64 tensors (values taken mod 2**32), identical on CPU and GPU."""
    x = x & _MASK32
    x = (((x >> 16) ^ x) * _MUL) & _MASK32
    x = (((x >> 16) ^ x) * _MUL) & _MASK32
    return (x >> 16) ^ x


def _mix32_int(x: int) -> int:
    """:func:`mix32` of one Python integer."""
    x &= _MASK32
    x = (((x >> 16) ^ x) * _MUL) & _MASK32
    x = (((x >> 16) ^ x) * _MUL) & _MASK32
    return (x >> 16) ^ x


def reinit_stream(iteration: int | Tensor, component: int | Tensor) -> int | Tensor:
    """The random stream of the re-initialisation of ``component`` after EM step ``iteration``."""
    return 1 + iteration * 65536 + component


def _stream_hash(seeds: Tensor, stream: int | Tensor) -> Tensor:
    if isinstance(stream, int):  # a constant: hashed in Python, not as a tensor
        return mix32(seeds.to(torch.int64) ^ _mix32_int(stream + _STREAM))
    stream = torch.as_tensor(stream, dtype=torch.int64, device=seeds.device)
    return mix32(seeds.to(torch.int64) ^ mix32(stream + _STREAM))


def random_keys(seeds: Tensor, stream: int | Tensor, ranks: Tensor) -> Tensor:
    """Distinct pseudo-random int64 keys, one per (seed, stream, rank); sorting a row's keys gives a random
    permutation of its points. Shapes broadcast (``seeds`` and ``stream`` against the leading dims of
    ``ranks``)."""
    h = _stream_hash(seeds.to(ranks.device), stream)
    return (mix32(h ^ mix32(ranks + _RANK)) << _RANK_BITS) + ranks


def random_draws(seeds: Tensor, stream: int | Tensor) -> Tensor:
    """One pseudo-random 32-bit integer per (seed, stream); ``% n`` picks one of n points."""
    return mix32(_stream_hash(seeds, stream) + _DRAW)


@functools.lru_cache(maxsize=16)
def _rank_hashes(length: int, device: torch.device) -> Tensor:
    """``mix32(rank + ...)`` of the ranks 0 .. length - 1, the part of :func:`random_keys` shared by every row."""
    return mix32(torch.arange(length, dtype=torch.int64, device=device) + _RANK)


@functools.lru_cache(maxsize=16)
def _restart_streams(iterations: int, n_components: int, device: torch.device) -> Tensor:
    """(1, iterations, K): ``mix32`` of the re-initialisation streams, the part of their draws shared by every row."""
    steps = torch.arange(iterations, device=device)[None, :, None]
    components = torch.arange(n_components, device=device)[None, None, :]
    return mix32(torch.as_tensor(reinit_stream(steps, components), dtype=torch.int64) + _STREAM)


def content_seeds(values: Tensor, mask: Tensor | None = None, seed: int = 0) -> Tensor:
    """One 32-bit seed per row from the row's discrete content: ``values`` is ``(B, ...)`` of integers (token
    ids; float tensors are read through their float32 bits), ``mask`` marks the entries that count. Equal content
    gives an equal seed wherever the row sits and however it is padded; ``seed`` shifts every seed.

    The row's entries, in order, are hashed by BLAKE2b keyed with ``seed``, on the CPU, one call per row: at one
    row a call costs a tenth of the chain of tensor operations a vectorised hash takes (MSD-Score seeds every pair
    of a one-pair batch), and at 64 rows no more."""
    flat = values.detach().reshape(len(values), -1)
    if flat.is_floating_point():
        rows = flat.float().contiguous().view(torch.int32).cpu().numpy().astype("<i4", copy=False)
    else:
        rows = flat.to(torch.int64).cpu().numpy().astype("<i8", copy=False)
    keep = None if mask is None else mask.detach().reshape(len(values), -1).bool().cpu().numpy()
    key = int(seed).to_bytes(8, "little")
    out = [int.from_bytes(hashlib.blake2b((row if keep is None else row[keep[i]]).tobytes(), digest_size=4,
                                          key=key).digest(), "little") for i, row in enumerate(rows)]
    return torch.tensor(out, dtype=torch.int64, device=values.device)


def initial_positions(seeds: Tensor, mask: Tensor, n_components: int) -> Tensor:
    """(B, K): where each component's mean starts, the first K points of a random permutation of the row's valid
    points (positions beyond a row's valid points point at position 0: those components are inactive)."""
    return random_positions(seeds, mask, n_components, None)[0]


def restart_positions(seeds: Tensor, mask: Tensor, counts: Tensor, iterations: int, n_components: int) -> Tensor:
    """(B, iterations, K): where component k restarts if it collapses after step t (a random valid point of its
    row), drawn for every (t, k) before the EM starts, so the loop itself draws nothing."""
    return random_positions(seeds, mask, n_components, iterations, counts)[1]


@functools.lru_cache(maxsize=16)
def _stream_hashes(iterations: int | None, n_components: int, device: torch.device) -> Tensor:
    """(1, 1 + iterations K): ``mix32(stream + ...)`` of the initial stream and of every re-initialisation stream."""
    init = torch.tensor([[_mix32_int(INIT_STREAM + _STREAM)]], dtype=torch.int64, device=device)
    if iterations is None:
        return init
    return torch.cat([init, _restart_streams(iterations, n_components, device).reshape(1, -1)], 1)


def random_positions(seeds: Tensor, mask: Tensor, n_components: int, iterations: int | None,
                     counts: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """:func:`initial_positions` and (unless ``iterations`` is None) :func:`restart_positions` together: their
    draws (:func:`random_keys`, :func:`random_draws`) hashed in one pass each level."""
    B, N = mask.shape
    full = bool(mask.all())
    ranks = torch.arange(N, device=mask.device).expand(B, N) if full else (mask.long().cumsum(1) - 1).clamp_min_(0)
    # level 1: the (seed, stream) hashes; level 2: the initial keys' hashes and the restart draws
    streams = mix32(seeds.to(torch.int64)[:, None] ^ _stream_hashes(iterations, n_components, mask.device))
    second = _rank_hashes(N, mask.device)[ranks] ^ streams[:, :1]
    if iterations is not None:
        second = torch.cat([second, streams[:, 1:] + _DRAW], 1)
    second = mix32(second)
    keys = (second[:, :N] << _RANK_BITS) + ranks
    if not full:
        keys = keys.masked_fill_(~mask, _NO_KEY)
    first = keys.topk(min(n_components, N), dim=1, largest=False).indices
    first = torch.nn.functional.pad(first, (0, n_components - first.shape[1]))
    if iterations is None:
        return first, None
    counts = mask.sum(1) if counts is None else counts
    rank = (second[:, N:] % counts[:, None]).reshape(B, iterations, n_components)
    if full:
        return first, rank
    by_rank = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices  # position of the r-th valid point
    return first, torch.gather(by_rank, 1, rank.reshape(B, -1)).reshape(rank.shape)
