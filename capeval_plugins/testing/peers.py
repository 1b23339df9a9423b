"""Shims that let peer packages run side by side with this one on the installed libraries (tests and
benchmarks/peers.py)."""
from __future__ import annotations

import torch


class TensorFeatures(torch.nn.Module):
    """torchmetrics 1.9's CLIPScore expects transformers 4's tensors from ``get_*_features``; transformers 5
    returns output objects. Unwraps them and changes nothing else."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def get_image_features(self, *args, **kwargs):
        return _pooled(self.model.get_image_features(*args, **kwargs))

    def get_text_features(self, *args, **kwargs):
        return _pooled(self.model.get_text_features(*args, **kwargs))


def _pooled(output):
    return output if isinstance(output, torch.Tensor) else output.pooler_output
