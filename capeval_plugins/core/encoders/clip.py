"""CLIP-family dual encoders (CLIP, SigLIP, ...): embeddings in the joint image-text space."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from capeval_plugins.core import loading
from capeval_plugins.core.encoders.common import EncoderSpec, pooled
from capeval_plugins.core.messages import warn_once


class ClipEncoder:
    """Global image and text embeddings of a CLIP-family dual encoder (CLIP, SigLIP, ...) in their joint
    space, L2-normalised, float32."""

    def __init__(self, spec: EncoderSpec):
        from transformers import AutoModel, AutoProcessor

        self.spec = spec
        self.model = loading.load_model(
            AutoModel, spec.model, device=spec.device, dtype=spec.dtype, **spec.hub()
        )
        self.processor = loading.load_processor(AutoProcessor, spec.model, **spec.hub())
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        text_config = getattr(self.model.config, "text_config", self.model.config)
        self.max_tokens = int(text_config.max_position_embeddings)
        # SigLIP was trained on text padded to a fixed length and pools the last position.
        self.pad_to_max = "siglip" in str(getattr(self.model.config, "model_type", ""))

    @classmethod
    def shared(cls, spec: EncoderSpec) -> "ClipEncoder":
        return loading.shared(("ClipEncoder", spec), lambda: cls(spec))

    @torch.inference_mode()
    def encode_images(self, images: Sequence) -> Tensor:
        pixels = self.processor.image_processor(images=list(images), return_tensors="pt")["pixel_values"]
        feats = pooled(self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype)))
        return F.normalize(feats.float(), dim=-1)

    def tokenize(self, texts: Sequence[str]) -> dict[str, Tensor]:
        """Tokenise with truncation that keeps the end-of-text token; warn (once per model) when a caption
        is longer than the text encoder allows."""
        tokenizer = self.processor.tokenizer
        lengths = [len(ids) for ids in tokenizer(list(texts), truncation=False)["input_ids"]]
        too_long = sum(n > self.max_tokens for n in lengths)
        if too_long:
            warn_once(
                ("truncate", self.spec.model),
                f"{too_long} caption(s) exceed the {self.max_tokens}-token limit of {self.spec.model}; they "
                "are truncated keeping the end-of-text token (reported once per model)",
            )
        return tokenizer(
            list(texts),
            padding="max_length" if self.pad_to_max else True,
            truncation=True,
            max_length=self.max_tokens,
            return_tensors="pt",
        )

    @torch.inference_mode()
    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        tokens = self.tokenize(texts)
        inputs = {k: v.to(self.device) for k, v in tokens.items() if k in ("input_ids", "attention_mask")}
        feats = pooled(self.model.get_text_features(**inputs))
        return F.normalize(feats.float(), dim=-1)
