"""CLIP-family dual encoders (CLIP, SigLIP, ...): embeddings in the joint image-text space."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from capeval_plugins.core import shared_results
from capeval_plugins.resources import loading
from capeval_plugins.models.encoders.common import EncoderSpec, pooled
from capeval_plugins.core.messages import warn_once


@dataclass
class LocalFeatures:
    """Global and local embeddings of one batch in the model's joint space, L2-normalised, float32:
    ``pooled`` (B, D) is what ``encode_images`` / ``encode_texts`` return; ``local`` (B, N, D) are the image
    patches or text tokens, ``mask`` (B, N) marks real patches or content tokens (special tokens and padding
    are False); ``ids`` (B, N) are the token ids (texts only)."""

    pooled: Tensor
    local: Tensor
    mask: Tensor
    ids: Tensor | None = None


def dual_encoder_problem(config: dict) -> str | None:
    """Why a checkpoint (its ``config.json``) is not an image-text dual encoder, or None: it needs a text and a
    vision tower (CLIP, SigLIP, ...), and is not a generative vision-language model."""
    kind = config.get("model_type", "?")
    generative = any(a.endswith(("ForConditionalGeneration", "ForCausalLM")) for a in config.get("architectures") or ())
    if "vision_config" in config and "text_config" in config and not generative:
        return None
    return f"it is a {kind} checkpoint, not an image-text dual encoder (CLIP, SigLIP)"


class ClipEncoder:
    """Global image and text embeddings of a CLIP-family dual encoder (CLIP, SigLIP, ...) in their joint
    space, L2-normalised, float32."""

    def __init__(self, spec: EncoderSpec):
        from transformers import AutoProcessor

        self.spec = spec
        self.model = loading.load_spec(model_class(spec), spec)
        self.processor = loading.load_processor(AutoProcessor, spec.model, **spec.hub())
        self.device = loading.input_device(self.model, spec.device)
        self.dtype = next(self.model.parameters()).dtype
        text_config = getattr(self.model.config, "text_config", self.model.config)
        self.max_tokens = int(text_config.max_position_embeddings)
        # SigLIP was trained on text padded to a fixed length and pools the last position.
        self.pad_to_max = "siglip" in str(getattr(self.model.config, "model_type", ""))
        self.pixels = shared_results.Results()  # the processor's output for the latest images, by content

    @classmethod
    def shared(cls, spec: EncoderSpec) -> "ClipEncoder":
        return loading.shared(("ClipEncoder", spec), lambda: cls(spec))

    @torch.inference_mode()
    def encode_images(self, images: Sequence) -> Tensor:
        pixels = self.pixel_values(images)
        feats = pooled(self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype)))
        return F.normalize(feats.float(), dim=-1).to(self.device)  # gathered, for a model spread over devices

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
        return F.normalize(feats.float(), dim=-1).to(self.device)

    # Local features (MSD-Score). Patch tokens: the vision tower's last hidden state without the class token,
    # through the visual projection; text tokens: the text tower's last hidden state through the text
    # projection. Both towers run once per batch and also give the pooled embeddings, so global and local
    # features come from one forward pass.

    def family(self) -> str:
        """``"clip"`` (CLIP-style projections), ``"siglip"`` (attention-pooling head) or ``"blip_itm"`` (BLIP's
        image-text retrieval model: its contrastive projections); anything else is refused, since its patch and
        token embeddings have no defined place in the joint space here."""
        model = self.model
        if hasattr(model, "visual_projection") and hasattr(model, "text_projection"):
            return "clip"
        if all(hasattr(model, name) for name in ("vision_proj", "text_proj", "text_encoder")):
            return "blip_itm"
        head = getattr(getattr(model, "vision_model", None), "head", None)
        if hasattr(head, "probe") and hasattr(getattr(model, "text_model", None), "head"):
            return "siglip"
        raise NotImplementedError(
            f"{self.spec.model}: patch and token embeddings are defined for CLIP, SigLIP and BLIP-ITM models, not for "
            f"{type(model).__name__}"
        )

    def pixel_values(self, images: Sequence) -> Tensor:
        """The image processor's output for ``images`` (float32, on CPU; read-only: the latest are kept by content,
        so what the runner's prefetch thread prepared for a batch, :meth:`preprocess`, is not computed again)."""
        images = list(images)
        return self.pixels.get(shared_results.digest("pixels", images),
                               lambda: self.processor.image_processor(images=images, return_tensors="pt")["pixel_values"])

    preprocess = pixel_values  # what capeval_plugins.prefetch runs ahead for the next batch

    @torch.inference_mode()
    def encode_image_patches(self, pixel_values: Tensor, post_layernorm: bool = False,
                             siglip_features: str = "hidden") -> LocalFeatures:
        """Pooled image embeddings and patch embeddings in the joint space.

        CLIP: patches are ``visual_projection(last_hidden_state[:, 1:])``; ``post_layernorm=True`` applies the
        vision tower's final layer norm first, as the pooled class token gets it. SigLIP has no class token and
        no projection: ``siglip_features="hidden"`` takes the raw last hidden state (MSD-Score's official SigLIP
        script), ``"head"`` maps each patch by the attention-pooling head as if the head attended to it alone
        (value and output projections, then the head's residual MLP); the last hidden state is already
        layer-normed there, so ``post_layernorm`` changes nothing. BLIP-ITM: ``vision_proj`` of the last hidden
        state, its class token the pooled embedding and the rest the patches (its official MSD script)."""
        family = self.family()
        check_siglip_features(siglip_features)
        out = self.model.vision_model(pixel_values=pixel_values.to(self.device, self.dtype))
        hidden = out.last_hidden_state
        if family == "clip":
            pooled_feats = self.model.visual_projection(out.pooler_output)
            hidden = hidden[:, 1:]
            if post_layernorm:
                hidden = self.model.vision_model.post_layernorm(hidden)
            local = self.model.visual_projection(hidden)
        elif family == "blip_itm":
            projected = self.model.vision_proj(hidden)
            pooled_feats, local = projected[:, 0], projected[:, 1:]
        else:
            pooled_feats = out.pooler_output
            local = hidden if siglip_features == "hidden" else attention_head_per_token(self.model.vision_model.head, hidden)
        mask = torch.ones(local.shape[:2], dtype=torch.bool, device=self.device)
        return LocalFeatures(F.normalize(pooled_feats.float(), dim=-1).to(self.device),
                             F.normalize(local.float(), dim=-1).to(self.device), mask)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text before truncation, special tokens included."""
        return [len(ids) for ids in self.processor.tokenizer(list(texts), truncation=False)["input_ids"]]

    @torch.inference_mode()
    def encode_text_tokens(self, texts: Sequence[str], siglip_features: str = "hidden") -> LocalFeatures:
        """Pooled text embeddings and token embeddings in the joint space, tokenised exactly as
        ``encode_texts`` does (same truncation and warning). ``mask`` drops special tokens (BOS, EOS, padding).
        SigLIP: the raw last hidden state (``siglip_features="hidden"``) or the text head per token
        (``"head"``); BLIP-ITM: ``text_proj`` of its text encoder's last hidden state (text only), [CLS] pooled."""
        family = self.family()
        check_siglip_features(siglip_features)
        tokens = self.tokenize(texts)
        inputs = {k: v.to(self.device) for k, v in tokens.items() if k in ("input_ids", "attention_mask")}
        if family == "blip_itm":
            out = self.model.text_encoder(**inputs, return_dict=True)
            projected = self.model.text_proj(out.last_hidden_state)
            pooled_feats, local = projected[:, 0], projected
        else:
            out = self.model.text_model(**inputs)
        if family == "clip":
            pooled_feats = self.model.text_projection(out.pooler_output)
            local = self.model.text_projection(out.last_hidden_state)
        elif family == "siglip":
            pooled_feats = out.pooler_output
            local = out.last_hidden_state if siglip_features == "hidden" else self.model.text_model.head(out.last_hidden_state)
        ids = inputs["input_ids"]
        mask = ~torch.isin(ids, self.boundary_token_ids().to(ids.device))
        if "attention_mask" in inputs:
            mask &= inputs["attention_mask"].bool()
        return LocalFeatures(F.normalize(pooled_feats.float(), dim=-1).to(self.device),
                             F.normalize(local.float(), dim=-1).to(self.device), mask, ids)

    def boundary_token_ids(self) -> Tensor:
        """Ids of the tokens that mark sequence boundaries (BOS, EOS, padding, CLS, SEP); an unknown-word token
        stands for caption content and is kept."""
        tokenizer = self.processor.tokenizer
        names = ("bos_token_id", "eos_token_id", "pad_token_id", "cls_token_id", "sep_token_id")
        ids = {getattr(tokenizer, name, None) for name in names} - {None}
        return torch.tensor(sorted(ids), dtype=torch.int64)


SIGLIP_FEATURES: tuple[str, ...] = ("hidden", "head")


def check_siglip_features(value: str) -> None:
    if value not in SIGLIP_FEATURES:
        raise ValueError(f"siglip_features must be one of {SIGLIP_FEATURES}, got {value!r}")


def model_class(spec: EncoderSpec):
    """The transformers class for a checkpoint: BLIP's image-text retrieval model when its configuration names
    it (AutoModel would load a BlipModel and leave its ITM projections untrained), else AutoModel."""
    from transformers import AutoModel

    try:
        config = loading.load_config(spec.model, spec.revision, spec.local_files_only, spec.trust_remote_code)
    except loading.ModelLoadError:
        return AutoModel  # let AutoModel report the problem
    if "BlipForImageTextRetrieval" in (getattr(config, "architectures", None) or []):
        from transformers import BlipForImageTextRetrieval

        return BlipForImageTextRetrieval
    return AutoModel


def attention_head_per_token(head: torch.nn.Module, hidden: Tensor) -> Tensor:
    """A SigLIP attention-pooling head applied to every token on its own: with a single key the attention
    weight is 1, so the pooled output is ``out_proj(v_proj(x))`` followed by the head's residual MLP."""
    attention = head.attention
    dim = attention.embed_dim
    if attention.in_proj_weight is not None:  # one packed q/k/v projection (torch's layout when sizes agree)
        weight = attention.in_proj_weight[2 * dim:]
    else:
        weight = attention.v_proj_weight
    bias = None if attention.in_proj_bias is None else attention.in_proj_bias[2 * dim:]
    values = attention.out_proj(F.linear(hidden, weight, bias))
    return values + head.mlp(head.layernorm(values))
