"""Pooling over ragged groups, vectorised: per-segment maxima (a candidate's best reference) and masked means of
local embeddings (a global embedding from patches or tokens)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def segment_max(values: Tensor, segments: Tensor, n_segments: int) -> Tensor:
    """Max of ``values`` within each segment id (0..n_segments-1), vectorised (empty segments -> -inf)."""
    out = torch.full((n_segments,), float("-inf"), dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, segments.to(values.device), values, reduce="amax", include_self=True)


def mean_pooled(local: Tensor, mask: Tensor) -> Tensor:
    """The normalised mean of the valid local embeddings (each already normalised): a global embedding
    pooled from patch or token embeddings."""
    total = (local * mask[..., None].to(local.dtype)).sum(1)
    return F.normalize(total, dim=-1)
