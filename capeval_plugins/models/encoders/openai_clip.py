"""CLIP run the way OpenAI's ``clip`` and ``open_clip`` packages run it (PAC-S, PAC-S++, Polos), on a transformers
``CLIPModel``; and the mapping of their state dicts (OpenAI's module layout) onto that model.

Preprocessing, as ``clip.load``'s and ``open_clip``'s evaluation transforms (torchvision on a PIL image): the short
side resized to the crop size with PIL bicubic (the long side ``int(size * long / short)``), a centre crop whose
offsets are ``round((extent - size) / 2)`` (transformers' image processor floors them: a one-pixel shift on
some aspect ratios), ``/ 255`` and per-channel normalisation in float32. Text, as ``clip.tokenize(text,
truncate=True)``: ``ftfy.fix_text``, HTML entities unescaped twice, whitespace collapsed, lower case, then the
byte-level BPE (the transformers tokenizer of the same vocabulary), 77 tokens with the end-of-text token kept.

The model is the :class:`~capeval_plugins.models.encoders.clip.ClipEncoder` of the checkpoint, so CLIPScore on the
same checkpoint shares it (one load). Features are returned raw (not normalised), as ``encode_image`` /
``encode_text`` return them.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from capeval_plugins.resources import loading
from capeval_plugins.files import paths
from capeval_plugins.core import shared_results
from capeval_plugins.models.encoders.clip import ClipEncoder
from capeval_plugins.models.encoders.common import EncoderSpec, pooled

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
# open_clip's pretrained tag laion2b_s32b_b82k (PAC-S's ViT-L/14 backbone) normalises with 0.5 / 0.5.
LAION_MEAN = (0.5, 0.5, 0.5)
LAION_STD = (0.5, 0.5, 0.5)

_WHITESPACE = re.compile(r"\s+")


def converted_model_dir(name: str) -> Path:
    """Where ``capeval convert pacs|polos`` puts a released checkpoint by default and where the metrics look for it:
    ``$CAPEVAL_CACHE/models/NAME``, else ``$XDG_CACHE_HOME/capeval_plugins/models/NAME`` (``~/.cache``; see
    :func:`capeval_plugins.files.paths.cache_dir`)."""
    return paths.cache_dir("models") / name


def clean_text(text: str) -> str:
    """The text ``clip.tokenize`` encodes: ``ftfy.fix_text``, HTML entities unescaped twice, whitespace collapsed
    and stripped, lower case (OpenAI's ``basic_clean`` + ``whitespace_clean`` + ``lower``)."""
    import ftfy

    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return _WHITESPACE.sub(" ", text).strip().lower()


def resized_size(width: int, height: int, size: int) -> tuple[int, int]:
    """(width, height) after torchvision's ``Resize(size)``: the short side becomes ``size``, the long side
    ``int(size * long / short)``."""
    if width <= height:
        return size, int(size * height / width)
    return int(size * width / height), size


def center_crop_box(width: int, height: int, size: int) -> tuple[int, int, int, int]:
    """torchvision's ``CenterCrop(size)`` box on a (width, height) image at least ``size`` on each side."""
    left, top = int(round((width - size) / 2.0)), int(round((height - size) / 2.0))
    return left, top, left + size, top + size


def official_pixels(images: Sequence[Image.Image], size: int, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """(B, 3, size, size) float32 pixels of RGB PIL images, as the official evaluation transform makes them."""
    arrays = []
    for image in images:
        width, height = image.size
        new = resized_size(width, height, size)
        if new != (width, height):
            image = image.resize(new, Image.BICUBIC)
        image = image.crop(center_crop_box(*image.size, size))
        arrays.append(np.asarray(image.convert("RGB"), dtype=np.uint8))
    pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).to(torch.float32).div(255)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    return pixels.sub(mean_t).div(std_t)


class OfficialClip:
    """A CLIP checkpoint (transformers layout) fed as OpenAI's ``clip`` / ``open_clip`` feed theirs. The image size,
    mean and standard deviation are the checkpoint's image processor's (its ``crop_size``, ``image_mean``,
    ``image_std``); the resize, crop and text cleaning are the official code's."""

    def __init__(self, spec: EncoderSpec, clip: ClipEncoder | None = None):
        self.clip = clip if clip is not None else ClipEncoder.shared(spec)  # (a quantized or compiled copy: given)
        processor = self.clip.processor.image_processor
        crop = getattr(processor, "crop_size", None) or {}
        self.size = int(crop.get("height", 0) or crop.get("shortest_edge", 0)
                        or self.clip.model.config.vision_config.image_size)
        self.mean = tuple(float(x) for x in processor.image_mean)
        self.std = tuple(float(x) for x in processor.image_std)
        self.pixels = shared_results.Results()  # the latest images' pixels, by content (prefetch, then the batch)

    @classmethod
    def shared(cls, spec: EncoderSpec) -> "OfficialClip":
        return loading.shared(("OfficialClip", spec), lambda: cls(spec))

    @property
    def device(self) -> torch.device:
        return self.clip.device

    @property
    def model(self):
        """The transformers model both feeds share (one load)."""
        return self.clip.model

    @property
    def dtype(self) -> torch.dtype:
        return self.clip.dtype

    def pixel_values(self, images: Sequence[Image.Image]) -> Tensor:
        """:func:`official_pixels` of ``images``, kept by content: what the runner's prefetch thread prepared for a
        batch (:meth:`preprocess`) is not computed again."""
        images = list(images)
        return self.pixels.get(shared_results.digest("official-pixels", images),
                               lambda: official_pixels(images, self.size, self.mean, self.std))

    preprocess = pixel_values  # what capeval_plugins.prefetch runs ahead for the next batch

    @torch.inference_mode()
    def image_features(self, images: Sequence[Image.Image]) -> Tensor:
        """(B, D) float32 image embeddings (``encode_image``), not normalised."""
        pixels = self.pixel_values(images)
        feats = pooled(self.clip.model.get_image_features(pixel_values=pixels.to(self.device, self.clip.dtype)))
        return feats.float().to(self.device)

    @torch.inference_mode()
    def text_features(self, texts: Sequence[str]) -> Tensor:
        """(B, D) float32 text embeddings (``encode_text`` of ``clip.tokenize(text, truncate=True)``), not
        normalised."""
        return self.clip.text_features([clean_text(t) for t in texts])

    # ClipEncoder's interface (L2-normalised embeddings), so CLIPScore's scoring runs on this encoder unchanged.
    def encode_images(self, images: Sequence[Image.Image]) -> Tensor:
        return torch.nn.functional.normalize(self.image_features(images), dim=-1)

    def encode_texts(self, texts: Sequence[str]) -> Tensor:
        return torch.nn.functional.normalize(self.text_features(texts), dim=-1)


# How a metric's ``preprocessing`` option feeds a CLIP: "official", as OpenAI's clip package feeds it (the
# official code of CLIPScore, PAC-S and MID), for a checkpoint of CLIP's architecture; "transformers", the
# checkpoint's own processor and tokenizer (torchmetrics). Other architectures (SigLIP) get their processor.
PREPROCESSING = ("official", "transformers")


def check_preprocessing(metric: str, value: str) -> None:
    if value not in PREPROCESSING:
        raise ValueError(f"{metric}: preprocessing must be one of {PREPROCESSING}, got {value!r}")


def fed(spec: EncoderSpec, preprocessing: str, clip: ClipEncoder | None = None,
        key: tuple | None = None) -> "ClipEncoder | OfficialClip":
    """The encoder a metric scores with: ``clip`` (the shared one of ``spec`` unless given: a quantized or
    compiled copy, shared under ``key``) fed as ``preprocessing`` says."""
    base = clip if clip is not None else ClipEncoder.shared(spec)
    if preprocessing != "official" or base.model.config.model_type != "clip":
        return base
    if clip is None:
        return OfficialClip.shared(spec)  # one per checkpoint: CLIPScore, PAC-S and MID on it share it
    return loading.shared(("OfficialClip", key), lambda: OfficialClip(spec, clip))


# --- OpenAI / open_clip state dicts -> transformers CLIPModel -----------------------------------------------------

_LAYER = re.compile(r"^(visual\.)?transformer\.resblocks\.(\d+)\.(.+)$")
_LAYER_PARTS = {
    "ln_1.weight": "layer_norm1.weight", "ln_1.bias": "layer_norm1.bias",
    "ln_2.weight": "layer_norm2.weight", "ln_2.bias": "layer_norm2.bias",
    "mlp.c_fc.weight": "mlp.fc1.weight", "mlp.c_fc.bias": "mlp.fc1.bias",
    "mlp.c_proj.weight": "mlp.fc2.weight", "mlp.c_proj.bias": "mlp.fc2.bias",
    "attn.out_proj.weight": "self_attn.out_proj.weight", "attn.out_proj.bias": "self_attn.out_proj.bias",
}
_TOP = {
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight", "ln_final.bias": "text_model.final_layer_norm.bias",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight", "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "logit_scale": "logit_scale",
}
_TRANSPOSED = {"text_projection": "text_projection.weight", "visual.proj": "visual_projection.weight"}
# Metadata some OpenAI checkpoints carry beside the weights (the JIT archive's attributes).
_METADATA = ("input_resolution", "context_length", "vocab_size")

# LoRA factors of PAC-S++'s CLIP (models/custom_loralib): lora_alpha = 1, so each delta is (B @ A) / r.
_LORA_SUFFIXES = ("_lora_A", "_lora_B", ".lora_A", ".lora_B")


@dataclass
class ClipMapping:
    """An OpenAI-layout state dict mapped onto ``CLIPModel``: ``state`` (transformers names), ``config`` (the
    ``CLIPConfig`` keyword arguments read from the shapes), and what was done with every other entry."""

    state: dict[str, Tensor]
    config: dict
    lora_merged: list[str] = field(default_factory=list)
    lora_left_out: list[str] = field(default_factory=list)
    metadata: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


def merge_lora(state: Mapping[str, Tensor], mlp_lora: str = "ignore") -> tuple[dict[str, Tensor], list[str], list[str]]:
    """Fold PAC-S++'s LoRA factors into the weights as its official scoring applies them (model in eval mode
    after ``load_state_dict``): the attention input and output projections and the patch embedding add
    ``(B @ A) / r``; the MLP layers' factors are not applied (their ``merged`` flag was set before the weights
    were loaded, so ``eval()`` never folds them in) unless ``mlp_lora="merge"``. Returns (state without LoRA
    entries, weights that got a delta, MLP weights whose factors were left out)."""
    if mlp_lora not in ("ignore", "merge"):
        raise ValueError(f"mlp_lora must be 'ignore' or 'merge', got {mlp_lora!r}")
    out = {k: v for k, v in state.items() if not k.endswith(_LORA_SUFFIXES)}
    merged, left_out = [], []
    for key in sorted(state):
        if key.endswith("in_proj_weight_lora_A"):
            base = key[: -len("_lora_A")]
            a, b = state[key].double(), state[base + "_lora_B"].double()
            out[base] = (state[base].double() + (b @ a) / a.shape[0]).to(state[base].dtype)
            merged.append(base)
        elif key.endswith(".lora_A"):
            module = key[: -len(".lora_A")]
            a, b = state[key].double(), state[module + ".lora_B"].double()
            weight = module + ".weight"
            if module.endswith("conv1"):  # Conv2d: A (r k, in k), B (out k, r k), delta viewed as the kernel
                rank = a.shape[0] // state[weight].shape[-1]
                delta = (b @ a).view(state[weight].shape) / rank
            else:
                delta = (b @ a) / a.shape[0]
            if ".mlp." in module and mlp_lora == "ignore":
                left_out.append(weight)
                continue
            out[weight] = (state[weight].double() + delta).to(state[weight].dtype)
            merged.append(weight)
    return out, merged, left_out


def map_openai_state_dict(state: Mapping[str, Tensor], hidden_act: str = "quick_gelu",
                          mlp_lora: str = "ignore") -> ClipMapping:
    """Map an OpenAI-layout CLIP ViT state dict (OpenAI ``clip``, ``open_clip``, PAC-S's ``clip_lora``) onto
    transformers' ``CLIPModel``; the configuration comes from the shapes (heads = width / 64, as both packages
    build it) and ``hidden_act`` (OpenAI's models use QuickGELU, open_clip's LAION ViT-L/14 exact GELU)."""
    if "visual.proj" not in state or "text_projection" not in state:
        raise ValueError("not an OpenAI-layout CLIP ViT state dict (no visual.proj / text_projection)")
    state, merged, left_out = merge_lora(state, mlp_lora)
    mapping = ClipMapping({}, {}, merged, left_out)
    for key, value in state.items():
        if key in _TOP:
            mapping.state[_TOP[key]] = value
        elif key in _TRANSPOSED:
            mapping.state[_TRANSPOSED[key]] = value.t().contiguous()
        elif key in _METADATA or key == "attn_mask":
            mapping.metadata.append(key)
        elif (match := _LAYER.match(key)) is not None:
            tower = "vision_model" if match.group(1) else "text_model"
            prefix, part = f"{tower}.encoder.layers.{match.group(2)}.", match.group(3)
            if part in _LAYER_PARTS:
                mapping.state[prefix + _LAYER_PARTS[part]] = value
            elif part in ("attn.in_proj_weight", "attn.in_proj_bias"):
                kind = part.rsplit("_", 1)[1]
                for name, chunk in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0)):
                    mapping.state[f"{prefix}self_attn.{name}.{kind}"] = chunk.contiguous()
            else:
                mapping.unknown.append(key)
        else:
            mapping.unknown.append(key)
    mapping.config = clip_config(state, hidden_act)
    return mapping


def _count_layers(state: Mapping[str, Tensor], prefix: str) -> int:
    return len({k[len(prefix):].split(".")[0] for k in state if k.startswith(prefix)})


def clip_config(state: Mapping[str, Tensor], hidden_act: str) -> dict:
    """``CLIPConfig`` keyword arguments of an OpenAI-layout ViT state dict."""
    vision_width, _, patch, _ = state["visual.conv1.weight"].shape
    grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    text_width = state["ln_final.weight"].shape[0]
    vocab = state["token_embedding.weight"].shape[0]
    text = dict(vocab_size=vocab, hidden_size=text_width,
                intermediate_size=state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
                num_hidden_layers=_count_layers(state, "transformer.resblocks."),
                num_attention_heads=max(text_width // 64, 1),
                max_position_embeddings=state["positional_embedding"].shape[0], hidden_act=hidden_act,
                # OpenAI's BPE: <|startoftext|> and <|endoftext|> are the last two ids; padding is end-of-text
                bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=vocab - 1)
    vision = dict(hidden_size=vision_width,
                  intermediate_size=state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
                  num_hidden_layers=_count_layers(state, "visual.transformer.resblocks."),
                  num_attention_heads=max(vision_width // 64, 1), image_size=patch * grid, patch_size=patch,
                  hidden_act=hidden_act)
    return dict(text_config=text, vision_config=vision, projection_dim=state["text_projection"].shape[1],
                logit_scale_init_value=float(state["logit_scale"]) if "logit_scale" in state else 2.6592)
