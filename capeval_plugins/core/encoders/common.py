"""Pieces every encoder family shares."""
from __future__ import annotations

import torch
from torch import Tensor

from capeval_plugins.core.loading import ModelSpec


def pooled(output: Tensor | object) -> Tensor:
    """transformers 5 returns an output object from ``get_*_features``; 4.x returned the tensor."""
    return output if isinstance(output, Tensor) else output.pooler_output  # type: ignore[attr-defined]


EncoderSpec = ModelSpec  # which encoder checkpoint to load and how


def segment_max(values: Tensor, segments: Tensor, n_segments: int) -> Tensor:
    """Max of ``values`` within each segment id (0..n_segments-1), vectorised (empty segments -> -inf)."""
    out = torch.full((n_segments,), float("-inf"), dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, segments.to(values.device), values, reduce="amax", include_self=True)
