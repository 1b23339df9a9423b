"""DINO vision transformers (Caron et al., 2021): L2-normalised [CLS] embeddings.

``facebook/dino-vitb8`` (ViT-B/8) is what Redemption Score uses. Two preprocessings
(:data:`PREPROCESSINGS`):

- ``"official"``: Redemption Score's ``scripts/dino_similarity.py`` (ashimdahal/Redemption-Score), torchvision's
  ``Resize(224)`` (the shorter side to 224, the longer to ``int(224 * long / short)``, PIL bilinear),
  ``CenterCrop(224)`` (offsets ``round((size - 224) / 2)``), ``ToTensor`` and ``Normalize`` with mean and std
  0.5; written here with PIL and numpy (torchvision is not needed). 224 is the checkpoint's input size
  (``config.image_size``), so a smaller test checkpoint gets its own.
- ``"paper"``: the paper's text (Sec. 3.2, "resized to 224 x 224 and ImageNet-normalised"), which is what the
  checkpoint's own image processor does (a square resize, ImageNet mean and std).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from capeval_plugins.resources import loading
from capeval_plugins.models.encoders.common import EncoderSpec

PREPROCESSINGS: tuple[str, ...] = ("official", "paper")


def official_pixels(images: Sequence, size: int) -> Tensor:
    """(N, 3, size, size) float32 pixels as Redemption Score's dino_similarity.py prepares them: the shorter
    side resized to ``size`` (PIL bilinear; an image whose shorter side is already ``size`` is left as it is),
    a centred ``size`` x ``size`` crop, values / 255, then (x - 0.5) / 0.5."""
    from PIL import Image

    out = np.empty((len(images), size, size, 3), dtype=np.float32)
    for i, image in enumerate(images):
        img = image if image.mode == "RGB" else image.convert("RGB")
        w, h = img.size
        if min(w, h) != size:
            short, long = min(w, h), max(w, h)
            longer = int(size * long / short)
            w, h = (size, longer) if w <= h else (longer, size)
            img = img.resize((w, h), Image.BILINEAR)
        top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
        out[i] = np.asarray(img, dtype=np.float32)[top:top + size, left:left + size] / 255.0
    return torch.from_numpy((out - 0.5) / 0.5).permute(0, 3, 1, 2).contiguous()


class DinoEncoder:
    """[CLS] token of the last layer (after the final layer norm, as DINO's own ``forward`` returns it),
    L2-normalised, float32."""

    def __init__(self, spec: EncoderSpec):
        from transformers import AutoImageProcessor, AutoModel

        self.spec = spec
        # DINO checkpoints ship no pooler (facebook/dino-*; DINOv2's architecture has none to leave out)
        self.model = loading.load_spec(AutoModel, spec, **loading.without_pooler(spec))
        self.processor = loading.load_processor(AutoImageProcessor, spec.model, **spec.hub())
        self.device = loading.input_device(self.model, spec.device)
        self.dtype = next(self.model.parameters()).dtype

    @classmethod
    def shared(cls, spec: EncoderSpec) -> "DinoEncoder":
        return loading.shared(("DinoEncoder", spec), lambda: cls(spec))

    def pixels(self, images: Sequence, preprocessing: str = "official") -> Tensor:
        """The model's input for these images under ``preprocessing`` (:data:`PREPROCESSINGS`)."""
        if preprocessing == "official":
            return official_pixels(images, int(self.model.config.image_size))
        if preprocessing == "paper":
            return self.processor(images=list(images), return_tensors="pt")["pixel_values"]
        raise ValueError(f"preprocessing must be one of {PREPROCESSINGS}, got {preprocessing!r}")

    @torch.inference_mode()
    def encode_images(self, images: Sequence, chunk: int = 64, preprocessing: str = "official") -> Tensor:
        """(N, hidden) unit vectors, ``chunk`` images per forward pass."""
        images = list(images)
        if not images:
            return torch.zeros((0, self.model.config.hidden_size), device=self.device)
        parts = []
        for start in range(0, len(images), chunk):
            pixels = self.pixels(images[start : start + chunk], preprocessing)
            hidden = self.model(pixel_values=pixels.to(self.device, self.dtype)).last_hidden_state
            parts.append(F.normalize(hidden[:, 0].float(), dim=-1))
        return torch.cat(parts)
