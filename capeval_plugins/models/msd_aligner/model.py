"""MSD-Score's local vision-language aligner (paper Sec. 3.2 and Sec. 4, "Backbone and local alignment"): the
model side, shared by training and the ``msd_score`` / ``soft_msd`` metrics.

* Image: a frozen CLIP vision tower; the hidden state of layer ``vision_layer`` (-2, LLaVA's penultimate layer),
  class token dropped (``vision_feature="patch"``); one trained linear layer (the projector) into the language
  model's input-embedding space: patch embeddings (B, N, d).
* Text (``text_features``):
  ``"last_hidden"`` (default): the frozen LLM's last hidden states of the caption alone, what the official
  evaluation scripts (``caparena.py``, ``docent.py``) do; scoring then loads the LLM.
  ``"input_embeddings"``: the language model's input-embedding rows of the caption's tokens. The paper's
  wording: the LLM is discarded at inference, and its input-embedding space is the space the patches are
  projected into (the visual prefix). The table and the tokenizer are saved with the aligner, so scoring
  needs no LLM weights.
* Global embeddings (Eq. 4 in training, Eq. 17 in scoring): the normalised mean of the normalised patch (or
  content-token) embeddings; content tokens exclude BOS, EOS and padding. ``text_pooling="raw"`` pools the
  text as the official scripts do: the normalised mean of the raw token features over every non-padding
  position, BOS included.

A trained aligner is a directory::

    msd_aligner.json               format, settings (both backbones: ids, revisions, hidden sizes, CLIP layer,
                                   a fingerprint of the vision weights; text features), training record
    projector.safetensors          ``weight`` (d, D_vision), ``bias`` (d,)
    token_embeddings.safetensors   ``weight`` (V, d): the LLM's input embeddings ("input_embeddings" only)
    tokenizer/                     the LLM's tokenizer
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from capeval_plugins.core import jsonio
from capeval_plugins.resources import loading, wholeness
from capeval_plugins.core.bounds import bounded, check_fields
from capeval_plugins.models.encoders import ClipEncoder, EncoderSpec, LocalFeatures, mean_pooled
from capeval_plugins.core.messages import warn_once
from capeval_plugins.models.msd_aligner import (DEFAULT_LLM, DEFAULT_VISION, TEXT_FEATURES, TEXT_POOLINGS,
                                                VISION_FEATURES)
from capeval_plugins.resources.trained import read_checkpoint_config

CONFIG_FILE = "msd_aligner.json"
PROJECTOR_FILE = "projector.safetensors"
TOKENS_FILE = "token_embeddings.safetensors"
TOKENIZER_DIR = "tokenizer"
FORMAT = "capeval-msd-aligner"
FORMAT_VERSION = 1
FINGERPRINT_SIZE = 128


@dataclass
class AlignerSettings:
    """What an aligner is: its two backbones and how features are taken from them (JSON in
    ``msd_aligner.json``). Sizes and the fingerprint are filled in from the loaded backbones."""

    vision_model: str = DEFAULT_VISION
    vision_revision: str | None = None
    vision_layer: int = bounded(-2, ge=-1000, le=1000)
    vision_feature: str = "patch"
    llm: str = DEFAULT_LLM
    llm_revision: str | None = None
    text_features: str = "last_hidden"
    # "content": like the image side (normalised mean of the normalised content tokens); "raw": the official
    # scripts' text global (mean of the raw features over every non-padding position, BOS kept). Checkpoints
    # written before this field existed pooled "content".
    text_pooling: str = "content"
    max_length: int = bounded(2048, ge=2, le=2**20)
    caption_suffix: str = "\n"
    # filled in from the backbones; bounded so that a crafted msd_aligner.json asks for nothing absurd
    vision_hidden_size: int | None = bounded(None, ge=1, le=2**17)
    vision_layers: int | None = bounded(None, ge=1, le=1000)
    vision_fingerprint: list[float] | None = None
    llm_hidden_size: int | None = bounded(None, ge=1, le=2**17)
    vocab_size: int | None = bounded(None, ge=1, le=2**24)

    def __post_init__(self) -> None:
        if self.text_features not in TEXT_FEATURES:
            raise ValueError(f"text_features must be one of {TEXT_FEATURES}, got {self.text_features!r}")
        if self.text_pooling not in TEXT_POOLINGS:
            raise ValueError(f"text_pooling must be one of {TEXT_POOLINGS}, got {self.text_pooling!r}")
        if self.vision_feature not in VISION_FEATURES:
            raise ValueError(f"vision_feature must be one of {VISION_FEATURES}, got {self.vision_feature!r}")
        check_fields(self, "MSD aligner settings")
        if self.vision_fingerprint is not None and not (
                isinstance(self.vision_fingerprint, list) and len(self.vision_fingerprint) <= 4096
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in self.vision_fingerprint)):
            raise ValueError("MSD aligner settings: vision_fingerprint must be a list of at most 4096 numbers")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AlignerSettings":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# --- the frozen backbones --------------------------------------------------------------------------------------


def vision_fingerprint(encoder: ClipEncoder) -> list[float]:
    """The first values of the vision tower's patch-embedding weights: enough to tell two checkpoints apart,
    robust to the dtype they are loaded in."""
    weight = encoder.model.vision_model.embeddings.patch_embedding.weight
    return [float(v) for v in weight.detach().flatten()[:FINGERPRINT_SIZE].float().cpu()]


def vision_tower(encoder: ClipEncoder) -> torch.nn.Module:
    vision = getattr(encoder.model, "vision_model", None)
    if vision is None or not hasattr(getattr(vision, "embeddings", None), "patch_embedding"):
        raise NotImplementedError(f"{encoder.spec.model}: the MSD aligner needs a CLIP-style vision tower "
                                  f"(vision_model.embeddings.patch_embedding), not {type(encoder.model).__name__}")
    return vision


def vision_hidden(encoder: ClipEncoder, pixel_values: Tensor, layer: int, feature: str = "patch") -> Tensor:
    """The frozen vision tower's hidden state at ``layer`` (indexing ``hidden_states``: -1 the last layer,
    -2 the penultimate), class token dropped for ``"patch"``: (B, N, D_vision) in the tower's dtype."""
    vision = vision_tower(encoder)
    with torch.no_grad():
        out = vision(pixel_values=pixel_values.to(encoder.device, encoder.dtype), output_hidden_states=True)
    hidden = out.hidden_states[layer]
    has_class = hasattr(vision.embeddings, "class_embedding")
    return hidden[:, 1:] if has_class and feature == "patch" else hidden


def check_vision(settings: AlignerSettings, encoder: ClipEncoder, where: str) -> None:
    """Refuse a vision backbone the aligner was not trained on (other weights, width or depth)."""
    config = getattr(vision_tower(encoder), "config", None)
    hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
    trained = f"trained on vision backbone {settings.vision_model!r}"
    if settings.vision_hidden_size is not None and hidden != settings.vision_hidden_size:
        raise ValueError(f"{where}: the aligner was {trained} (hidden size {settings.vision_hidden_size}), but "
                         f"{encoder.spec.model!r} has hidden size {hidden}; pass model={settings.vision_model!r}")
    if settings.vision_layers is not None and layers != settings.vision_layers:
        raise ValueError(f"{where}: the aligner was {trained} ({settings.vision_layers} layers), but "
                         f"{encoder.spec.model!r} has {layers}; pass model={settings.vision_model!r}")
    if settings.vision_fingerprint is not None:
        expected = torch.tensor(settings.vision_fingerprint)
        got = torch.tensor(vision_fingerprint(encoder)[:len(expected)])
        if len(got) != len(expected) or not torch.allclose(got, expected, rtol=1e-2, atol=1e-4):
            raise ValueError(f"{where}: the aligner was {trained}, but {encoder.spec.model!r} has other weights; "
                             f"pass model={settings.vision_model!r} (or a local copy of it)")


def load_llm(settings: AlignerSettings, device: str | None = None, dtype: str | None = None,
             local_files_only: bool | None = None, trust_remote_code: bool = False) -> Any:
    """The frozen causal LM (shared, safetensors only; bfloat16 on GPU unless ``dtype``)."""
    from transformers import AutoModelForCausalLM

    return loading.load_model(AutoModelForCausalLM, settings.llm, device=device, dtype=dtype,
                              gpu_dtype=torch.bfloat16, revision=settings.llm_revision,
                              local_files_only=local_files_only, trust_remote_code=trust_remote_code)


def load_llm_tokenizer(source: str, revision: str | None = None, local_files_only: bool | None = None,
                       trust_remote_code: bool = False) -> Any:
    """The LLM's tokenizer; one without a padding token pads with its unknown-word token, as LLaVA sets it (or
    with EOS where there is none): padding is masked everywhere, so the choice does not change a result."""
    from transformers import AutoTokenizer

    tokenizer = loading.load_processor(AutoTokenizer, source, revision=revision, local_files_only=local_files_only,
                                       trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token if tokenizer.unk_token is not None else tokenizer.eos_token
    return tokenizer


# --- the aligner ---------------------------------------------------------------------------------------------------


class LocalAligner:
    """Patch and token embeddings in one space (see the module docstring), with the interface the MSD metrics
    use for their features (as :class:`~capeval_plugins.models.encoders.ClipEncoder`). ``projector`` is the only
    trained part; ``token_table`` (V, d) is the LLM's input-embedding table ("input_embeddings"), ``llm`` the
    causal LM ("last_hidden")."""

    def __init__(self, settings: AlignerSettings, encoder: ClipEncoder, projector: torch.nn.Linear, tokenizer: Any,
                 token_table: Tensor | None = None, llm: Any = None):
        self.settings, self.encoder, self.projector, self.tokenizer = settings, encoder, projector, tokenizer
        self.token_table, self.llm = token_table, llm
        self.spec = encoder.spec
        limit = settings.max_length
        if llm is not None:
            limit = min(limit, int(getattr(llm.config, "max_position_embeddings", limit)))
        self.max_tokens = limit

    @property
    def device(self) -> torch.device:
        return self.projector.weight.device

    # images

    def pixel_values(self, images: Sequence) -> Tensor:
        return self.encoder.pixel_values(images)

    def vision_hidden(self, pixel_values: Tensor) -> Tensor:
        return vision_hidden(self.encoder, pixel_values, self.settings.vision_layer, self.settings.vision_feature)

    def project(self, hidden: Tensor) -> Tensor:
        """Patch embeddings (B, N, d), float32, not normalised (the LLM's visual prefix)."""
        return self.projector(hidden.to(self.device, self.projector.weight.dtype))

    def encode_image_patches(self, pixel_values: Tensor, post_layernorm: bool = False) -> LocalFeatures:
        """Normalised patch embeddings and their pooled global embedding."""
        with torch.no_grad():
            local = F.normalize(self.project(self.vision_hidden(pixel_values)).float(), dim=-1)
        mask = torch.ones(local.shape[:2], dtype=torch.bool, device=local.device)
        return LocalFeatures(mean_pooled(local, mask), local, mask)

    # texts

    def tokenize(self, texts: Sequence[str]) -> dict[str, Tensor]:
        """The captions as the LLM reads them (BOS added, right padding, truncated at ``max_tokens`` with a
        warning once per aligner)."""
        texts = list(texts)
        lengths = [len(ids) for ids in self.tokenizer(texts)["input_ids"]]
        too_long = sum(n > self.max_tokens for n in lengths)
        if too_long:
            warn_once(("truncate", "msd_aligner", self.settings.llm),
                      f"{too_long} caption(s) exceed the aligner's {self.max_tokens}-token limit; they are truncated")
        return self.tokenizer(texts, padding=True, padding_side="right", truncation=True, max_length=self.max_tokens,
                              return_tensors="pt")

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer(list(texts))["input_ids"]]

    def content_mask(self, ids: Tensor, attention: Tensor) -> Tensor:
        """True at caption tokens: not padding, BOS or EOS (an unknown-word token is content)."""
        special = {self.tokenizer.bos_token_id, self.tokenizer.eos_token_id} - {None}
        boundary = torch.tensor(sorted(special), dtype=ids.dtype, device=ids.device)
        return attention.bool() & ~torch.isin(ids, boundary)

    def token_features(self, ids: Tensor, attention: Tensor) -> Tensor:
        """Token embeddings (B, T, d), float32, not normalised; no gradient (both sources are frozen)."""
        with torch.no_grad():
            if self.settings.text_features == "input_embeddings":
                return self.token_table[ids.to(self.token_table.device)].float().to(self.device)
            base = self.llm.get_decoder() if hasattr(self.llm, "get_decoder") else self.llm
            out = base(input_ids=ids.to(self.llm.device), attention_mask=attention.to(self.llm.device))
            return out.last_hidden_state.float().to(self.device)

    def encode_text_tokens(self, texts: Sequence[str]) -> LocalFeatures:
        """Normalised content-token embeddings, their pooled global embedding (``text_pooling``) and the ids."""
        tokens = self.tokenize(texts)
        ids, attention = tokens["input_ids"], tokens["attention_mask"]
        features = self.token_features(ids, attention)
        local = F.normalize(features, dim=-1)
        mask = self.content_mask(ids, attention).to(local.device)
        if self.settings.text_pooling == "raw":
            kept = attention.to(features.device, features.dtype)[..., None]
            pooled = F.normalize((features * kept).sum(1) / kept.sum(1).clamp(min=1), dim=-1)
        else:
            pooled = mean_pooled(local, mask)
        return LocalFeatures(pooled, local, mask, ids.to(local.device))

    # loading

    @classmethod
    def shared(cls, checkpoint: str | os.PathLike, spec: EncoderSpec) -> "LocalAligner":
        """A trained aligner (shared per process, checkpoint and vision spec), its vision tower loaded from
        ``spec`` (the metric's ``model``), which must be the backbone it was trained on."""
        path = Path(checkpoint)
        settings = read_settings(path)  # checks the directory before anything is loaded
        key = ("msd_aligner", os.path.realpath(path), spec)
        return loading.shared(key, lambda: load_aligner(path, spec, settings), (path,))


def read_settings(checkpoint: str | os.PathLike) -> AlignerSettings:
    data = read_checkpoint_config(checkpoint, CONFIG_FILE, FORMAT, FORMAT_VERSION, "MSD aligner",
                                  "train one with `capeval train msd-aligner ...`")
    return AlignerSettings.from_dict(data["settings"])


def read_record(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The training record an aligner keeps (losses, history, hyper-parameters, data size)."""
    return jsonio.loads((Path(checkpoint) / CONFIG_FILE).read_text(encoding="utf-8")).get("training", {})


def _tensors(path: Path, name: str, keys: Sequence[str]) -> dict[str, Tensor]:
    from capeval_plugins.resources.tensorfile import load_file

    file = path / name
    if not file.is_file():
        raise FileNotFoundError(f"MSD aligner {path} has no {name}")
    tensors = load_file(file)
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise ValueError(f"{file}: missing tensor(s) {missing}")
    wanted = {k: tuple(tensors[k].shape) for k in keys}  # shapes: checked against each other by the caller
    problem = wholeness.tensors_problem(tensors, wanted, str(file))  # nothing else, every value finite
    if problem:
        raise ValueError(problem)
    return tensors


def build_projector(vision_hidden_size: int, llm_hidden_size: int) -> torch.nn.Linear:
    return torch.nn.Linear(vision_hidden_size, llm_hidden_size, bias=True)


def load_aligner(checkpoint: str | os.PathLike, spec: EncoderSpec,
                 settings: AlignerSettings | None = None) -> LocalAligner:
    """Load an aligner directory (not shared; :meth:`LocalAligner.shared` shares it), checking that every file is
    there and every size agrees with the others and with the vision backbone ``spec`` loads."""
    with loading.loader_boundary("MSD aligner", checkpoint):
        return _load_aligner(Path(checkpoint), spec, settings)


def _load_aligner(path: Path, spec: EncoderSpec, settings: AlignerSettings | None) -> LocalAligner:
    settings = settings or read_settings(path)
    where = f"MSD aligner {path}"
    weights = _tensors(path, PROJECTOR_FILE, ("weight", "bias"))
    weight = weights["weight"]
    if weight.ndim != 2 or tuple(weights["bias"].shape) != (weight.shape[0],):
        raise ValueError(f"{where}: projector weights of shapes {tuple(weight.shape)} and "
                         f"{tuple(weights['bias'].shape)} do not form a linear layer")
    d_llm, d_vision = weight.shape
    for name, value, expected in (("vision hidden size", d_vision, settings.vision_hidden_size),
                                  ("LLM hidden size", d_llm, settings.llm_hidden_size)):
        if expected is not None and value != expected:
            raise ValueError(f"{where}: the projector has {name} {value}, the config says {expected}")
    encoder = ClipEncoder.shared(spec)
    check_vision(settings, encoder, where)
    if not (path / TOKENIZER_DIR).is_dir():
        raise FileNotFoundError(f"{where} has no {TOKENIZER_DIR}/ (the LLM's tokenizer)")
    tokenizer = load_llm_tokenizer(str(path / TOKENIZER_DIR))
    projector = build_projector(d_vision, d_llm)
    projector.load_state_dict({k: v.float() for k, v in weights.items()})
    projector = projector.to(encoder.device).eval().requires_grad_(False)
    table = llm = None
    if settings.text_features == "input_embeddings":
        table = _tensors(path, TOKENS_FILE, ("weight",))["weight"]
        if table.ndim != 2 or table.shape[1] != d_llm:
            raise ValueError(f"{where}: token embeddings of shape {tuple(table.shape)} do not match the projector's "
                             f"output size {d_llm}")
        if len(tokenizer) > table.shape[0]:
            raise ValueError(f"{where}: the tokenizer has {len(tokenizer)} tokens, the embedding table "
                             f"{table.shape[0]} rows")
        table = table.to(encoder.device)
    else:
        llm = load_llm(settings, spec.device, spec.dtype, spec.local_files_only, spec.trust_remote_code)
        if int(llm.config.hidden_size) != d_llm:
            raise ValueError(f"{where}: the projector maps into size {d_llm}, but {settings.llm!r} has hidden size "
                             f"{llm.config.hidden_size}")
    return LocalAligner(settings, encoder, projector, tokenizer, table, llm)
