"""Encoders shared by several metrics. Pure tensor code over transformers models; no ecosystem imports."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from capeval_plugins.core import loading
from capeval_plugins.inputs import warn_once


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

    def hub(self) -> dict:
        return {
            "revision": self.revision,
            "local_files_only": self.local_files_only,
            "trust_remote_code": self.trust_remote_code,
        }


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


def segment_max(values: Tensor, segments: Tensor, n_segments: int) -> Tensor:
    """Max of ``values`` within each segment id (0..n_segments-1), vectorised (empty segments -> -inf)."""
    out = torch.full((n_segments,), float("-inf"), dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, segments.to(values.device), values, reduce="amax", include_self=True)
