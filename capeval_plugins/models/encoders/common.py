"""Pieces every encoder family shares."""
from __future__ import annotations

from torch import Tensor

from capeval_plugins.core.pooling import mean_pooled, segment_max  # noqa: F401  (the encoders' names)
from capeval_plugins.resources.loading import ModelSpec


def pooled(output: Tensor | object) -> Tensor:
    """transformers 5 returns an output object from ``get_*_features``; 4.x returned the tensor."""
    return output if isinstance(output, Tensor) else output.pooler_output  # type: ignore[attr-defined]


EncoderSpec = ModelSpec  # which encoder checkpoint to load and how
