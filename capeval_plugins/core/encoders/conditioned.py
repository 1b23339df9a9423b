"""Image-conditioned text token embeddings: text tokens that attend to the image, at a chosen layer.

Two families are supported:

- ViLT (``dandelin/vilt-b32-mlm`` and other ViLT checkpoints): one transformer over text tokens and image
  patches. ViLT draws its image patches at random, even in eval mode (a random order of all patches, or a
  random subset when ``max_image_length`` is set). Here each image's patch embedding is drawn once, alone,
  from a generator seeded with ``seed``, so a score is reproducible and does not depend on which other
  images share the batch; the drawn patches are then shared by every text scored against that image.
- BLIP's image-grounded text encoder (``Salesforce/blip-itm-base-coco`` and the other ``blip-itm-*``): a BERT
  whose every block cross-attends to the ViT's patch embeddings, as in ``BlipForImageTextRetrieval`` with
  its ITM head. The ViT runs once per image.

Layers are numbered as ``hidden_states``: 0 is the embedding layer, k the output of block k, -1 the last.
ViLT is pre-LayerNorm: its blocks' outputs are un-normalised residual streams and only the last gets the
model's final LayerNorm; ``final_norm`` applies that LayerNorm to whichever layer is chosen (BLIP's blocks end
in their own LayerNorm; the option does not apply).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from capeval_plugins.core import loading
from capeval_plugins.core.encoders.common import EncoderSpec
from capeval_plugins.core.encoders.text import (TokenEmbeddings, concat_padded, hidden_state_at, length_order,
                                                pad_rows, resolve_layer)
from capeval_plugins.core.messages import warn_once


@dataclass
class ImageContext:
    """What the text side attends to, one row per distinct image: ``embeddings`` (N, T, D) and ``mask``
    (N, T) (ViLT: the sampled patch embeddings; BLIP: the ViT's output)."""

    embeddings: Tensor
    mask: Tensor

    def __len__(self) -> int:
        return self.embeddings.shape[0]


class ConditionedEncoder:
    """Base of the image-conditioned text encoders: tokenisation, chunking and layer selection."""

    family = ""

    def __init__(self, spec: EncoderSpec, layer: int = -1, final_norm: bool = True):
        self.spec = spec
        self.final_norm = final_norm
        self.processor = loading.load_processor(self.processor_loader(), spec.model, **spec.hub())
        self.tokenizer = self.processor.tokenizer
        self.model = loading.load_spec(self.model_loader(), spec)
        self.device = loading.input_device(self.model, spec.device)
        self.dtype = next(self.model.parameters()).dtype
        self.blocks = self.text_blocks()
        self.layer = resolve_layer(layer, len(self.blocks), spec.model)
        self.max_tokens = int(self.text_config().max_position_embeddings)

    @staticmethod
    def shared(spec: EncoderSpec, layer: int = -1, final_norm: bool = True, seed: int = 0,
               max_image_patches: int | None = None) -> "ConditionedEncoder":
        """The encoder of ``spec.model``'s family (ViLT or BLIP), built once per process per setting."""
        family = model_family(spec)
        if family == "vilt":
            key = ("ViltConditioned", spec, layer, final_norm, seed, max_image_patches)
            return loading.shared(key, lambda: ViltConditioned(spec, layer, final_norm, seed, max_image_patches))
        key = ("BlipConditioned", spec, layer)
        return loading.shared(key, lambda: BlipConditioned(spec, layer))

    # --- per family ---------------------------------------------------------------------------------------
    def processor_loader(self) -> Any:
        from transformers import AutoProcessor

        return AutoProcessor

    def model_loader(self) -> Any:
        raise NotImplementedError

    def text_blocks(self) -> torch.nn.ModuleList:
        raise NotImplementedError

    def text_config(self) -> Any:
        raise NotImplementedError

    def encode_images(self, images: Sequence[Any]) -> ImageContext:
        raise NotImplementedError

    def text_hidden(self, input_ids: Tensor, attention_mask: Tensor, image: Tensor, image_mask: Tensor) -> Tensor:
        raise NotImplementedError

    # --- shared -------------------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> tuple[list[list[int]], list[list[int]]]:
        """Ids and special-token masks; captions over the text limit are truncated keeping [SEP], with a
        warning (once per model)."""
        texts = [t.strip() for t in texts]
        out = self.tokenizer(texts, add_special_tokens=True, truncation=True, max_length=self.max_tokens,
                             return_special_tokens_mask=True)
        full = self.tokenizer(texts, add_special_tokens=True)["input_ids"]
        too_long = sum(len(row) > self.max_tokens for row in full)
        if too_long:
            warn_once(
                ("truncate", self.spec.model),
                f"{too_long} caption(s) exceed the {self.max_tokens}-token text limit of {self.spec.model}; they "
                "are truncated keeping the closing [SEP] (reported once per model)",
            )
        return [list(r) for r in out["input_ids"]], [list(r) for r in out["special_tokens_mask"]]

    @torch.inference_mode()
    def embed(self, texts: Sequence[str], image_rows: Tensor, context: ImageContext,
              batch_size: int = 64) -> TokenEmbeddings:
        """Token embeddings of each text conditioned on image ``context[image_rows[i]]``; special tokens are
        flagged in ``special``. Texts run in chunks of ``batch_size`` of similar length."""
        if not texts:
            raise ValueError("no texts to embed")
        ids, special = self.tokenize(texts)
        order = length_order([len(r) for r in ids])
        pad_id = self.tokenizer.pad_token_id or 0
        chunks = []
        for start in range(0, len(order), max(1, batch_size)):
            pick = order[start : start + batch_size]
            input_ids, mask = pad_rows([ids[i] for i in pick], pad_id)
            special_mask, _ = pad_rows([special[i] for i in pick], 1)
            rows = image_rows[torch.tensor(pick, dtype=torch.long)].to(context.embeddings.device)
            hidden = self.text_hidden(input_ids.to(self.device), mask.to(self.device),
                                      context.embeddings[rows], context.mask[rows])
            chunks.append(TokenEmbeddings(hidden.float(), input_ids.to(self.device), mask.to(self.device),
                                          special_mask.bool().to(self.device)))
        return concat_padded(chunks, order)


def model_family(spec: EncoderSpec) -> str:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(spec.model, **spec.hub())
    family = getattr(config, "model_type", "")
    if family not in ("vilt", "blip"):
        raise ValueError(f"{spec.model}: model type {family!r} is not an image-conditioned text encoder supported "
                         "here (ViLT, e.g. dandelin/vilt-b32-mlm, or BLIP ITM, e.g. Salesforce/blip-itm-base-coco)")
    return family


class ViltConditioned(ConditionedEncoder):
    """ViLT: text tokens and (seeded) image patches in one transformer."""

    family = "vilt"

    def __init__(self, spec: EncoderSpec, layer: int = -1, final_norm: bool = True, seed: int = 0,
                 max_image_patches: int | None = None):
        super().__init__(spec, layer, final_norm)
        self.seed = seed
        configured = self.model.config.max_image_length
        self.max_image_patches = configured if max_image_patches is None else max_image_patches

    def model_loader(self) -> Any:
        from transformers import ViltModel

        return ViltModel

    def text_blocks(self) -> torch.nn.ModuleList:
        return self.model.encoder.layer

    def text_config(self) -> Any:
        return self.model.config

    @torch.inference_mode()
    def encode_images(self, images: Sequence[Any]) -> ImageContext:
        pixels = self.processor.image_processor(images=list(images), return_tensors="pt")
        values = pixels["pixel_values"].to(self.device, self.dtype)
        masks = pixels["pixel_mask"].to(self.device)
        embedded = [self._patches(values[i : i + 1], masks[i : i + 1]) for i in range(len(values))]
        width = max(e.shape[1] for e, _ in embedded)
        out = torch.zeros((len(embedded), width, embedded[0][0].shape[-1]), dtype=self.dtype, device=self.device)
        mask = torch.zeros((len(embedded), width), dtype=torch.long, device=self.device)
        for i, (e, m) in enumerate(embedded):
            out[i, : e.shape[1]] = e[0]
            mask[i, : m.shape[1]] = m[0]
        return ImageContext(out, mask)

    def _patches(self, pixel_values: Tensor, pixel_mask: Tensor) -> tuple[Tensor, Tensor]:
        # ViLT samples patches with torch.multinomial on CPU tensors: draw them for this image alone, from a
        # seeded generator, leaving the caller's random state untouched.
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(self.seed)
            embeds, mask, _ = self.model.embeddings.visual_embed(
                pixel_values, pixel_mask, max_image_length=self.max_image_patches
            )
        return embeds, mask

    def text_hidden(self, input_ids: Tensor, attention_mask: Tensor, image: Tensor, image_mask: Tensor) -> Tensor:
        hidden = hidden_state_at(
            self.model, self.blocks, self.layer, input_ids=input_ids, attention_mask=attention_mask.long(),
            token_type_ids=torch.zeros_like(input_ids), image_embeds=image, pixel_mask=image_mask,
        )
        text = hidden[:, : input_ids.shape[1]]
        return self.model.layernorm(text) if self.final_norm else text


class BlipConditioned(ConditionedEncoder):
    """BLIP's image-grounded text encoder (the ITM branch of ``BlipForImageTextRetrieval``)."""

    family = "blip"

    def __init__(self, spec: EncoderSpec, layer: int = -1):
        super().__init__(spec, layer, final_norm=True)

    def model_loader(self) -> Any:
        from transformers import BlipForImageTextRetrieval

        return BlipForImageTextRetrieval

    def text_blocks(self) -> torch.nn.ModuleList:
        return self.model.text_encoder.encoder.layer

    def text_config(self) -> Any:
        return self.model.config.text_config

    @torch.inference_mode()
    def encode_images(self, images: Sequence[Any]) -> ImageContext:
        pixels = self.processor.image_processor(images=list(images), return_tensors="pt")["pixel_values"]
        embeds = self.model.vision_model(pixel_values=pixels.to(self.device, self.dtype)).last_hidden_state
        return ImageContext(embeds, torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device))

    def text_hidden(self, input_ids: Tensor, attention_mask: Tensor, image: Tensor, image_mask: Tensor) -> Tensor:
        return hidden_state_at(
            self.model.text_encoder, self.blocks, self.layer, input_ids=input_ids,
            attention_mask=attention_mask.long(), encoder_hidden_states=image, encoder_attention_mask=image_mask,
        )
