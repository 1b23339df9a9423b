"""DINO vision transformers (Caron et al., 2021): L2-normalised [CLS] embeddings.

``facebook/dino-vitb8`` (ViT-B/8) is what Redemption Score uses; its processor resizes to 224 x 224 and
normalises with the ImageNet statistics, as the paper describes.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from capeval_plugins.core import loading
from capeval_plugins.core.encoders.common import EncoderSpec


class DinoEncoder:
    """[CLS] token of the last layer (after the final layer norm, as DINO's own ``forward`` returns it),
    L2-normalised, float32."""

    def __init__(self, spec: EncoderSpec):
        from transformers import AutoImageProcessor, AutoModel

        self.spec = spec
        # DINO checkpoints ship no pooler; without this AutoModel would add a randomly initialised one.
        self.model = loading.load_spec(AutoModel, spec, add_pooling_layer=False)
        self.processor = loading.load_processor(AutoImageProcessor, spec.model, **spec.hub())
        self.device = loading.input_device(self.model, spec.device)
        self.dtype = next(self.model.parameters()).dtype

    @classmethod
    def shared(cls, spec: EncoderSpec) -> "DinoEncoder":
        return loading.shared(("DinoEncoder", spec), lambda: cls(spec))

    @torch.inference_mode()
    def encode_images(self, images: Sequence, chunk: int = 64) -> Tensor:
        """(N, hidden) unit vectors, ``chunk`` images per forward pass."""
        images = list(images)
        if not images:
            return torch.zeros((0, self.model.config.hidden_size), device=self.device)
        parts = []
        for start in range(0, len(images), chunk):
            pixels = self.processor(images=images[start : start + chunk], return_tensors="pt")["pixel_values"]
            hidden = self.model(pixel_values=pixels.to(self.device, self.dtype)).last_hidden_state
            parts.append(F.normalize(hidden[:, 0].float(), dim=-1))
        return torch.cat(parts)
