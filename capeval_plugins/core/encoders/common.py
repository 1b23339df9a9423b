"""Pieces every encoder family shares."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def pooled(output: Tensor | object) -> Tensor:
    """transformers 5 returns an output object from ``get_*_features``; 4.x returned the tensor."""
    return output if isinstance(output, Tensor) else output.pooler_output  # type: ignore[attr-defined]


@dataclass(frozen=True)
class EncoderSpec:
    """Which checkpoint to load and how; one spec, one shared encoder."""

    model: str
    device: str | None = None
    dtype: str | None = None
    revision: str | None = None
    local_files_only: bool | None = None
    trust_remote_code: bool = False

    @classmethod
    def from_config(cls, config, model: str | None = None) -> "EncoderSpec":
        """From a metric's ``ModelConfig`` (``model`` overrides ``config.model``)."""
        return cls(model or config.model, config.device, config.dtype, config.revision, config.local_files_only,
                   config.trust_remote_code)

    def hub(self) -> dict:
        return {
            "revision": self.revision,
            "local_files_only": self.local_files_only,
            "trust_remote_code": self.trust_remote_code,
        }


def segment_max(values: Tensor, segments: Tensor, n_segments: int) -> Tensor:
    """Max of ``values`` within each segment id (0..n_segments-1), vectorised (empty segments -> -inf)."""
    out = torch.full((n_segments,), float("-inf"), dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, segments.to(values.device), values, reduce="amax", include_self=True)
