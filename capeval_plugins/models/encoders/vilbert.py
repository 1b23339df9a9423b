"""ViLBERT (Lu et al., 2019) and its 12-in-1 multi-task version (Lu et al., 2020): a two-stream transformer.

Written from the papers and the released configuration ``bert_base_6layer_6conect``: a BERT-base text stream
(12 post-LayerNorm layers, width 768), a visual stream over detector regions (6 layers, width 1024, 8 heads,
feed-forward 1024) and 6 co-attention layers that exchange keys and values between the streams. Co-attention
layer k (0-based here) runs before text layer ``t_biattention_id[k]`` and visual layer ``v_biattention_id[k]``;
with the released ids the text stream runs T0-T5, C0, T6, C1, T7, ..., C5, T11 and the visual stream C0, V0, C1,
V1, ..., C5, V5.

- Text input: [CLS] caption [SEP] word pieces; LayerNorm(word + position + segment) embeddings. The 12-in-1 model
  splices a task embedding in right after [CLS] (no position or segment embedding; later tokens keep their
  positions), so its text stream is one position longer than the input ids.
- Image input: the region features with a "global" region (their mean) in front, each with a 5-d box location;
  LayerNorm(Linear(feature) + Linear(location)) (see :mod:`capeval_plugins.resources.regions`).
- Co-attention: text queries attend over the regions' keys and values and region queries over the text's, 8 heads
  of ``bi_hidden_size / 8``; each side then adds its context (``dense2`` text, ``dense1`` regions) to its input,
  normalises, and applies its own feed-forward block.

Parameter names are the released ones without the leading ``bert.``: a released state dict loads after
:func:`map_released_state_dict` (strip ``bert.`` / ``module.``, rename ``gamma``/``beta`` to ``weight``/``bias``,
leave out the parts scoring never uses: the pretraining and task heads, the two poolers and the co-attention
layers' unused ``q_dense1``/``q_dense2``). Dropout is left out: the model is for inference only.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "swish": F.silu, "silu": F.silu}


class ViLBertConfig(PretrainedConfig):
    """The released configuration's keys (``bert_base_6layer_6conect.json``), defaults as in that file, plus
    ``num_task_tokens`` (20 in the 12-in-1 checkpoint, 0 without task tokens) and ``tokenizer_source`` (where
    to load the WordPiece tokenizer from when the model folder carries none)."""

    model_type = "vilbert"

    def __init__(
        self,
        vocab_size: int = 30522,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        intermediate_size: int = 3072,
        hidden_act: str = "gelu",
        max_position_embeddings: int = 512,
        type_vocab_size: int = 2,
        v_feature_size: int = 2048,
        v_hidden_size: int = 1024,
        v_num_hidden_layers: int = 6,
        v_num_attention_heads: int = 8,
        v_intermediate_size: int = 1024,
        v_hidden_act: str = "gelu",
        bi_hidden_size: int = 1024,
        bi_num_attention_heads: int = 8,
        v_biattention_id: Sequence[int] = (0, 1, 2, 3, 4, 5),
        t_biattention_id: Sequence[int] = (6, 7, 8, 9, 10, 11),
        num_task_tokens: int = 0,
        layer_norm_eps: float = 1e-12,
        tokenizer_source: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.v_feature_size = v_feature_size
        self.v_hidden_size = v_hidden_size
        self.v_num_hidden_layers = v_num_hidden_layers
        self.v_num_attention_heads = v_num_attention_heads
        self.v_intermediate_size = v_intermediate_size
        self.v_hidden_act = v_hidden_act
        self.bi_hidden_size = bi_hidden_size
        self.bi_num_attention_heads = bi_num_attention_heads
        self.v_biattention_id = list(v_biattention_id)
        self.t_biattention_id = list(t_biattention_id)
        self.num_task_tokens = num_task_tokens
        self.layer_norm_eps = layer_norm_eps
        self.tokenizer_source = tokenizer_source
        super().__init__(**kwargs)

    def check(self) -> None:
        """Raise ValueError if the streams cannot be built or interleaved as configured."""
        t_ids, v_ids = self.t_biattention_id, self.v_biattention_id
        if not t_ids or len(t_ids) != len(v_ids):
            raise ValueError(f"ViLBERT: t_biattention_id {t_ids} and v_biattention_id {v_ids} must pair up")
        for ids, n, side in ((t_ids, self.num_hidden_layers, "t"), (v_ids, self.v_num_hidden_layers, "v")):
            if list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= n:
                raise ValueError(f"ViLBERT: {side}_biattention_id {ids} must increase within 0..{n - 1}")
        for width, heads, name in ((self.hidden_size, self.num_attention_heads, "text"),
                                   (self.v_hidden_size, self.v_num_attention_heads, "visual"),
                                   (self.bi_hidden_size, self.bi_num_attention_heads, "co-attention")):
            if width % heads:
                raise ValueError(f"ViLBERT: {name} width {width} is not a multiple of its {heads} heads")
        for act in (self.hidden_act, self.v_hidden_act):
            if act not in _ACTIVATIONS:
                raise ValueError(f"ViLBERT: activation {act!r} is not one of {sorted(_ACTIVATIONS)}")

    @property
    def num_coattention_layers(self) -> int:
        return len(self.t_biattention_id)


# --- blocks -----------------------------------------------------------------------------------------------------
def _heads(x: Tensor, n_heads: int) -> Tensor:
    b, s, d = x.shape
    return x.view(b, s, n_heads, d // n_heads).transpose(1, 2)


def _attend(query: Tensor, key: Tensor, value: Tensor, key_mask: Tensor, n_heads: int) -> Tensor:
    """Multi-head scaled dot-product attention of queries over keys where ``key_mask`` (B, S) is True."""
    mask = key_mask[:, None, None, :].bool()
    out = F.scaled_dot_product_attention(_heads(query, n_heads), _heads(key, n_heads), _heads(value, n_heads),
                                         attn_mask=mask)
    b, _, s, _ = out.shape
    return out.transpose(1, 2).reshape(b, s, -1)


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return _attend(self.query(x), self.key(x), self.value(x), mask, self.heads)


class ResidualNorm(nn.Module):
    """``LayerNorm(dense(x) + residual)``: BERT's SelfOutput / Output."""

    def __init__(self, width_in: int, width_out: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(width_in, width_out)
        self.LayerNorm = nn.LayerNorm(width_out, eps=eps)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Intermediate(nn.Module):
    def __init__(self, width: int, inner: int, act: str):
        super().__init__()
        self.dense = nn.Linear(width, inner)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.dense(x))


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, eps: float):
        super().__init__()
        self.self = SelfAttention(width, heads)
        self.output = ResidualNorm(width, width, eps)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.output(self.self(x, mask), x)


class Layer(nn.Module):
    """A post-LayerNorm BERT layer (text stream ``layer.N``, visual stream ``v_layer.N``)."""

    def __init__(self, width: int, heads: int, inner: int, act: str, eps: float):
        super().__init__()
        self.attention = Attention(width, heads, eps)
        self.intermediate = Intermediate(width, inner, act)
        self.output = ResidualNorm(inner, width, eps)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class BiAttention(nn.Module):
    """Projections of the two streams into the co-attention space: ``*1`` from regions, ``*2`` from text."""

    def __init__(self, config: ViLBertConfig):
        super().__init__()
        v, t, bi = config.v_hidden_size, config.hidden_size, config.bi_hidden_size
        self.heads = config.bi_num_attention_heads
        self.query1, self.key1, self.value1 = nn.Linear(v, bi), nn.Linear(v, bi), nn.Linear(v, bi)
        self.query2, self.key2, self.value2 = nn.Linear(t, bi), nn.Linear(t, bi), nn.Linear(t, bi)

    def forward(self, regions: Tensor, region_mask: Tensor, text: Tensor, text_mask: Tensor) -> tuple[Tensor, Tensor]:
        """(context of each region from the text, context of each text token from the regions)."""
        for_text = _attend(self.query2(text), self.key1(regions), self.value1(regions), region_mask, self.heads)
        for_regions = _attend(self.query1(regions), self.key2(text), self.value2(text), text_mask, self.heads)
        return for_regions, for_text


class BiOutput(nn.Module):
    def __init__(self, config: ViLBertConfig):
        super().__init__()
        eps = config.layer_norm_eps
        self.dense1 = nn.Linear(config.bi_hidden_size, config.v_hidden_size)
        self.LayerNorm1 = nn.LayerNorm(config.v_hidden_size, eps=eps)
        self.dense2 = nn.Linear(config.bi_hidden_size, config.hidden_size)
        self.LayerNorm2 = nn.LayerNorm(config.hidden_size, eps=eps)


class CoAttentionLayer(nn.Module):
    """``c_layer.N``: co-attention, then each stream's own residual LayerNorm and feed-forward block."""

    def __init__(self, config: ViLBertConfig):
        super().__init__()
        eps = config.layer_norm_eps
        self.biattention = BiAttention(config)
        self.biOutput = BiOutput(config)
        self.v_intermediate = Intermediate(config.v_hidden_size, config.v_intermediate_size, config.v_hidden_act)
        self.v_output = ResidualNorm(config.v_intermediate_size, config.v_hidden_size, eps)
        self.t_intermediate = Intermediate(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.t_output = ResidualNorm(config.intermediate_size, config.hidden_size, eps)

    def forward(self, regions: Tensor, region_mask: Tensor, text: Tensor, text_mask: Tensor) -> tuple[Tensor, Tensor]:
        for_regions, for_text = self.biattention(regions, region_mask, text, text_mask)
        out = self.biOutput
        regions = out.LayerNorm1(out.dense1(for_regions) + regions)
        text = out.LayerNorm2(out.dense2(for_text) + text)
        regions = self.v_output(self.v_intermediate(regions), regions)
        text = self.t_output(self.t_intermediate(text), text)
        return regions, text


class Encoder(nn.Module):
    def __init__(self, config: ViLBertConfig):
        super().__init__()
        eps = config.layer_norm_eps
        self.layer = nn.ModuleList(
            Layer(config.hidden_size, config.num_attention_heads, config.intermediate_size, config.hidden_act, eps)
            for _ in range(config.num_hidden_layers))
        self.v_layer = nn.ModuleList(
            Layer(config.v_hidden_size, config.v_num_attention_heads, config.v_intermediate_size,
                  config.v_hidden_act, eps)
            for _ in range(config.v_num_hidden_layers))
        self.c_layer = nn.ModuleList(CoAttentionLayer(config) for _ in range(config.num_coattention_layers))


class TextEmbeddings(nn.Module):
    def __init__(self, config: ViLBertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if config.num_task_tokens:
            self.task_embeddings = nn.Embedding(config.num_task_tokens, config.hidden_size)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None,
                task_ids: Tensor | None = None) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None] + \
            self.token_type_embeddings(types)
        if task_ids is not None:
            x = torch.cat([x[:, :1], self.task_embeddings(task_ids.view(-1, 1)), x[:, 1:]], dim=1)
        return self.LayerNorm(x)


class RegionEmbeddings(nn.Module):
    def __init__(self, config: ViLBertConfig):
        super().__init__()
        self.image_embeddings = nn.Linear(config.v_feature_size, config.v_hidden_size)
        self.image_location_embeddings = nn.Linear(5, config.v_hidden_size)
        self.LayerNorm = nn.LayerNorm(config.v_hidden_size, eps=config.layer_norm_eps)

    def forward(self, features: Tensor, locations: Tensor) -> Tensor:
        return self.LayerNorm(self.image_embeddings(features) + self.image_location_embeddings(locations))


@dataclass
class ViLBertOutput:
    """``coattention_text[k]``: the text stream after co-attention layer k (1-based; entry 0 is the text stream
    entering the first co-attention layer); ``text`` and ``regions``: the final outputs of the two streams."""

    coattention_text: list[Tensor] = field(default_factory=list)
    text: Tensor | None = None
    regions: Tensor | None = None


# --- the model ----------------------------------------------------------------------------------------------------
class ViLBertModel(PreTrainedModel):
    """ViLBERT's two streams (the released ``bert`` module) without pretraining or task heads."""

    config_class = ViLBertConfig
    base_model_prefix = "vilbert"
    main_input_name = "input_ids"

    def __init__(self, config: ViLBertConfig):
        config.check()
        super().__init__(config)
        self.embeddings = TextEmbeddings(config)
        self.v_embeddings = RegionEmbeddings(config)
        self.encoder = Encoder(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # As the released code: normal(0, 0.02) weights, zero biases, unit LayerNorms.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()
        if isinstance(module, nn.LayerNorm):
            module.weight.data.fill_(1.0)
            module.bias.data.zero_()

    def embed_regions(self, features: Tensor, locations: Tensor) -> Tensor:
        """Region embeddings (B, R, v_hidden) of features (B, R, v_feature_size) and locations (B, R, 5)."""
        return self.v_embeddings(features, locations)

    def text_inputs(self, input_ids: Tensor, attention_mask: Tensor, task_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        """Embedded text and its mask; with ``task_ids`` (B,), the task slot is spliced in after [CLS]."""
        if task_ids is not None and not self.config.num_task_tokens:
            raise ValueError("this ViLBERT has no task tokens (not a multi-task checkpoint): give no task id")
        text = self.embeddings(input_ids, task_ids=task_ids)
        mask = attention_mask.bool()
        if task_ids is not None:
            mask = torch.cat([mask[:, :1], torch.ones_like(mask[:, :1]), mask[:, 1:]], dim=1)
        return text, mask

    def streams(self, text: Tensor, text_mask: Tensor, regions: Tensor,
                region_mask: Tensor) -> Iterator[tuple[str, int, Tensor, Tensor]]:
        """Run the two streams from embedded ``text`` and ``regions``, lazily, yielding ``(point, k, text, regions)``:
        ``("coattention", k, ...)`` as the text leaves co-attention layer k (1-based; k = 0: as it enters the first
        one), ``("text_layers", k, ...)`` after the text layers that follow co-attention layer k, and last
        ``("final", ...)``. Stop iterating and nothing further is computed."""
        t_ids, v_ids = self.config.t_biattention_id, self.config.v_biattention_id
        layers, v_layers, c_layers = self.encoder.layer, self.encoder.v_layer, self.encoder.c_layer
        region_mask = region_mask.bool()
        t_start = v_start = 0
        for k in range(len(c_layers) + 1):
            t_end = t_ids[k] if k < len(c_layers) else len(layers)
            for i in range(t_start, t_end):
                text = layers[i](text, text_mask)
            yield ("coattention" if k == 0 else "text_layers"), k, text, regions
            v_end = v_ids[k] if k < len(c_layers) else len(v_layers)
            for i in range(v_start, v_end):
                regions = v_layers[i](regions, region_mask)
            if k < len(c_layers):
                regions, text = c_layers[k](regions, region_mask, text, text_mask)
                yield "coattention", k + 1, text, regions
            t_start, v_start = t_end, v_end
        yield "final", len(c_layers), text, regions

    def text_at(self, layer: int, text: Tensor, text_mask: Tensor, regions: Tensor, region_mask: Tensor,
                through_text_layers: bool = False) -> Tensor:
        """The text stream after co-attention layer ``layer`` (0: entering the first one) or, with
        ``through_text_layers``, after the text layers that follow it; the layers above are not run."""
        if not 0 <= layer <= self.config.num_coattention_layers:
            raise ValueError(f"co-attention layer {layer} does not exist (0..{self.config.num_coattention_layers})")
        if through_text_layers and layer == 0:
            raise ValueError("through_text_layers needs a co-attention layer (1 or above), not 0")
        want = ("text_layers" if through_text_layers else "coattention", layer)
        for point, k, value, _ in self.streams(text, text_mask, regions, region_mask):
            if (point, k) == want:
                return value
        raise AssertionError("unreachable: every layer is visited")

    def encode(self, text: Tensor, text_mask: Tensor, regions: Tensor, region_mask: Tensor) -> ViLBertOutput:
        out = ViLBertOutput()
        for point, _, value, final_regions in self.streams(text, text_mask, regions, region_mask):
            if point == "coattention":
                out.coattention_text.append(value)
            elif point == "final":
                out.text, out.regions = value, final_regions
        return out

    def forward(self, input_ids: Tensor, region_features: Tensor, region_locations: Tensor,
                attention_mask: Tensor | None = None, region_mask: Tensor | None = None,
                task_ids: Tensor | None = None) -> ViLBertOutput:
        """Every co-attention layer's text output and the final outputs of both streams."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        if region_mask is None:
            region_mask = torch.ones(region_features.shape[:2], dtype=torch.bool, device=region_features.device)
        text, text_mask = self.text_inputs(input_ids, attention_mask, task_ids)
        return self.encode(text, text_mask, self.embed_regions(region_features, region_locations), region_mask)


# --- released checkpoints ---------------------------------------------------------------------------------------
# Released parameters scoring never uses, left out of a conversion on purpose (names after normalisation).
IGNORED_ON_PURPOSE = {
    "pretraining heads (cls.*)": re.compile(r"^cls\."),
    "multi-task heads": re.compile(
        r"^(vil_prediction|vil_prediction_gqa|vil_binary_prediction|vil_logit|vil_tri_prediction|vision_logit|"
        r"linguisic_logit)\."),
    "poolers (feed only the heads)": re.compile(r"^bert\.(t_pooler|v_pooler)\."),
    "co-attention q_dense1/q_dense2 (never used in the forward pass)":
        re.compile(r"^bert\.encoder\.c_layer\.\d+\.biOutput\.q_dense[12]\."),
}
# Keys of the released configuration JSON that inference does not depend on, and those whose other values would
# need a different model than this one.
CONFIG_REQUIRED_VALUES = {"with_coattention": True, "dynamic_attention": False, "model": "bert"}


def normalised_names(released: Mapping[str, Any]) -> dict[str, str]:
    """Each released parameter name -> the name the official loader reads: no DataParallel ``module.`` prefix,
    ``bert.`` in front of backbone names (also in a checkpoint of the backbone alone), TF-style ``gamma``/``beta``
    as ``weight``/``bias``."""
    bare = not any(k.removeprefix("module.").startswith("bert.") for k in released)
    out = {}
    for raw in released:
        name = ("bert." if bare else "") + raw.removeprefix("module.")
        out[raw] = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", name))
    return out


def released_backbone(released: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The backbone part of a released state dict under this module's names (``bert.`` removed)."""
    return {name.removeprefix("bert."): released[raw]
            for raw, name in normalised_names(released).items() if name.startswith("bert.")}


@dataclass
class ReleasedMapping:
    """A released state dict sorted out: ``state`` under this module's names, what was ``ignored`` on purpose
    (by reason), ``unknown`` names, parameters the checkpoint is ``missing`` and shape ``mismatched`` ones."""

    state: dict[str, Tensor]
    ignored: dict[str, list[str]]
    unknown: list[str]
    missing: list[str]
    mismatched: list[str]


def map_released_state_dict(released: Mapping[str, Tensor], expected: Mapping[str, Sequence[int]]) -> ReleasedMapping:
    """Map a released ViLBERT state dict onto the parameter names and shapes ``expected`` (of a
    :class:`ViLBertModel`): ``bert.<name>`` -> ``<name>``; everything else is reported, never dropped silently."""
    state: dict[str, Tensor] = {}
    ignored: dict[str, list[str]] = {}
    unknown, mismatched = [], []
    for raw, name in normalised_names(released).items():
        tensor = released[raw]
        ours = name.removeprefix("bert.")
        if name.startswith("bert.") and ours in expected:
            if tuple(tensor.shape) != tuple(expected[ours]):
                mismatched.append(f"{raw}: {tuple(tensor.shape)}, expected {tuple(expected[ours])}")
            state[ours] = tensor
            continue
        reason = next((why for why, pattern in IGNORED_ON_PURPOSE.items() if pattern.search(name)), None)
        if reason is None:
            unknown.append(raw)
        else:
            ignored.setdefault(reason, []).append(raw)
    missing = sorted(set(expected) - set(state))
    return ReleasedMapping(state, ignored, sorted(unknown), missing, mismatched)


def config_from_released_json(values: Mapping[str, Any] | None) -> tuple[ViLBertConfig, list[str]]:
    """A configuration from the released JSON's ``values`` (None: ``bert_base_6layer_6conect``) and the keys of it
    that inference does not read (dropout rates, initialisation, training switches, head sizes)."""
    values = dict(values or {})
    for key, required in CONFIG_REQUIRED_VALUES.items():
        if key in values and values[key] != required:
            raise ValueError(f"configuration {key}={values[key]!r} is not supported (this ViLBERT needs {required!r})")
    known = set(inspect.signature(ViLBertConfig.__init__).parameters) - {"self", "kwargs", "tokenizer_source"}
    config = ViLBertConfig(**{k: v for k, v in values.items() if k in known})
    return config, sorted(k for k in values if k not in known)


def released_config(values: Mapping[str, Any] | None, state: Mapping[str, Tensor]) -> tuple[ViLBertConfig, list[str]]:
    """:func:`config_from_released_json`, checked against the shapes in the backbone ``state``
    (:func:`released_backbone`), with the task-token count taken from the weights."""
    config, ignored_keys = config_from_released_json(values)
    task = state.get("embeddings.task_embeddings.weight")
    config.num_task_tokens = int(task.shape[0]) if task is not None else 0
    from_weights = _shapes_to_config(state)
    disagree = {k: (v, getattr(config, k)) for k, v in from_weights.items() if getattr(config, k) != v}
    if disagree:
        detail = ", ".join(f"{k} {w} in the weights but {c} in the configuration" for k, (w, c) in disagree.items())
        hint = "" if values else " (pass the checkpoint's configuration JSON)"
        raise ValueError(f"the checkpoint does not match its configuration: {detail}{hint}")
    config.check()
    return config, ignored_keys


def _count(state: Mapping[str, Tensor], prefix: str) -> int:
    found = [int(m.group(1)) for k in state if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))]
    return max(found) + 1 if found else 0


def _shapes_to_config(state: Mapping[str, Tensor]) -> dict[str, int]:
    """The sizes a state dict determines on its own (missing entries are left to the missing-key report)."""
    shape = lambda key, dim: int(state[key].shape[dim]) if key in state else None  # noqa: E731
    sizes = {
        "vocab_size": shape("embeddings.word_embeddings.weight", 0),
        "hidden_size": shape("embeddings.word_embeddings.weight", 1),
        "max_position_embeddings": shape("embeddings.position_embeddings.weight", 0),
        "type_vocab_size": shape("embeddings.token_type_embeddings.weight", 0),
        "intermediate_size": shape("encoder.layer.0.intermediate.dense.weight", 0),
        "v_feature_size": shape("v_embeddings.image_embeddings.weight", 1),
        "v_hidden_size": shape("v_embeddings.image_embeddings.weight", 0),
        "v_intermediate_size": shape("encoder.v_layer.0.intermediate.dense.weight", 0),
        "bi_hidden_size": shape("encoder.c_layer.0.biattention.query1.weight", 0),
        "num_hidden_layers": _count(state, "encoder.layer."),
        "v_num_hidden_layers": _count(state, "encoder.v_layer."),
        "num_coattention_layers": _count(state, "encoder.c_layer."),
    }
    return {k: v for k, v in sizes.items() if v}
