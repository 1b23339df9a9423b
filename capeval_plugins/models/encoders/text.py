"""Contextual token embeddings of a text encoder at one layer (BERT, RoBERTa, DeBERTa, DeBERTa-v2/v3 ...).

Tokenisation follows bert_score: captions are stripped, special tokens added ([CLS] ... [SEP] or <s> ... </s>),
GPT-2 and RoBERTa tokenizers see a leading space so the first word is tokenised like any other (``prefix_space=
"paper"``: what bert_score asks for and, under transformers 5, no longer gets; ``"as_saved"``: the tokenizer as
saved, bert_score's tokens under transformers 5), and text beyond the tokenizer's limit is truncated (keeping the closing special token) with one warning per
model. The embedding of layer k is the output of the k-th transformer block (``hidden_states[k]``; 0 is the
embedding layer), which is what bert_score gets by dropping the blocks above k; blocks above k are skipped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from capeval_plugins.image_sources import InputError
from capeval_plugins.resources import loading
from capeval_plugins.resources.wholeness import ModelLoadError
from capeval_plugins.models.encoders.bert_score_layers import BERT_SCORE_LAYERS, bert_score_layer  # noqa: F401
from capeval_plugins.models.encoders.common import EncoderSpec
from capeval_plugins.core.messages import warn_once

# How a text is prepared for a byte-level BPE tokenizer (see :func:`bert_score_prefix_space`).
PREFIX_SPACE = ("paper", "as_saved")
# The classes bert_score asks for a leading space (``isinstance(tokenizer, (GPT2Tokenizer, RobertaTokenizer))``),
# with their transformers 4 fast twins, which are no subclasses of them there.
BERT_SCORE_SPACED_CLASSES = frozenset({"GPT2Tokenizer", "GPT2TokenizerFast", "RobertaTokenizer", "RobertaTokenizerFast"})


@dataclass
class TokenEmbeddings:
    """Token embeddings of a batch of texts, right-padded: ``embeddings`` (B, L, D), ``input_ids`` (B, L),
    ``attention_mask`` (B, L) bool (real tokens) and ``special`` (B, L) bool (special tokens: [CLS]/[SEP] or
    <s>/</s> for :class:`TextEncoder`, the tokenizer's special-token mask for image-conditioned encoders)."""

    embeddings: Tensor
    input_ids: Tensor
    attention_mask: Tensor
    special: Tensor

    def __len__(self) -> int:
        return self.embeddings.shape[0]

    def rows(self, index: Tensor) -> "TokenEmbeddings":
        index = index.to(self.embeddings.device)
        return TokenEmbeddings(self.embeddings[index], self.input_ids[index], self.attention_mask[index],
                               self.special[index])

    def unit(self) -> "TokenEmbeddings":
        """The same with every token embedding L2-normalised (padding stays 0)."""
        return TokenEmbeddings(F.normalize(self.embeddings.float(), dim=-1), self.input_ids, self.attention_mask,
                               self.special)


class _Stop(Exception):
    """Raised by a forward pre-hook to skip the transformer blocks above the requested layer."""


def transformer_blocks(module: Any) -> torch.nn.ModuleList:
    """The list of transformer blocks of an encoder (``encoder.layer`` in BERT-like models)."""
    for path in ("encoder.layer", "transformer.layer"):
        obj = module
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if isinstance(obj, torch.nn.ModuleList):
            return obj
    raise ValueError(f"{type(module).__name__}: cannot find its transformer blocks (encoder.layer); "
                     "supported are BERT-like encoders (BERT, RoBERTa, DeBERTa, DeBERTa-v2/v3, ...)")


def resolve_layer(layer: int, n_blocks: int, name: str) -> int:
    """A layer index in 0..n_blocks (0 = embeddings); negative counts from the end (-1 = last block)."""
    index = layer + n_blocks + 1 if layer < 0 else layer
    if not 0 <= index <= n_blocks:  # an option of the user's that this model cannot take: one line, exit 2
        raise InputError(f"{name}: layer {layer} does not exist; the model has layers 0..{n_blocks} "
                         f"(or -1..-{n_blocks + 1} from the end)")
    return index


def hidden_state_at(forward: Callable[..., Any], blocks: torch.nn.ModuleList, layer: int, **inputs: Any) -> Tensor:
    """``hidden_states[layer]`` of ``forward(**inputs)`` without running the blocks above ``layer``: the input
    of block ``layer`` (0-based) is the output of the block before it (and of anything the encoder applies in
    between, e.g. DeBERTa-v2's convolution). A pre-hook captures it and stops the forward there; the hook lives
    only for this call (do not run one shared model from several threads at once)."""
    if layer >= len(blocks):
        return forward(**inputs, output_hidden_states=True).hidden_states[layer]
    captured: dict[str, Tensor] = {}

    def stop(module, args, kwargs):
        captured["h"] = args[0] if args else kwargs["hidden_states"]
        raise _Stop

    handle = blocks[layer].register_forward_pre_hook(stop, with_kwargs=True)
    try:
        forward(**inputs)
    except _Stop:
        pass
    finally:
        handle.remove()
    # Gathered where the inputs are: a model spread over devices computes block ``layer`` elsewhere.
    device = next(v.device for v in inputs.values() if isinstance(v, Tensor))
    return captured["h"].to(device)


def pad_rows(rows: Sequence[Sequence[int]], value: int) -> tuple[Tensor, Tensor]:
    """Right-pad lists of ids into a (B, L) tensor and its bool mask."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = True
    return ids, mask


def length_order(lengths: Sequence[int]) -> list[int]:
    """Positions sorted longest first, so chunks hold texts of similar length (little padding)."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def concat_padded(chunks: Sequence[TokenEmbeddings], order: Sequence[int]) -> TokenEmbeddings:
    """Concatenate chunk outputs (padded to the longest) and undo the length ordering."""
    width = max(c.embeddings.shape[1] for c in chunks)

    def pad(t: Tensor, value) -> Tensor:
        extra = width - t.shape[1]
        if extra == 0:
            return t
        shape = (t.shape[0], extra, *t.shape[2:])
        return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=1)

    out = TokenEmbeddings(
        torch.cat([pad(c.embeddings, 0) for c in chunks]),
        torch.cat([pad(c.input_ids, 0) for c in chunks]),
        torch.cat([pad(c.attention_mask, False) for c in chunks]),
        torch.cat([pad(c.special, False) for c in chunks]),
    )
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return out.rows(inverse)


def text_encoder_problem(config: dict) -> str | None:
    """Why a checkpoint (its ``config.json``) is not a text encoder BERTScore can embed with, or None: one with an
    image tower (CLIP, SigLIP, LLaVA, ...) is refused."""
    if "vision_config" in config:
        return f"it is a {config.get('model_type', '?')} checkpoint (an image-text model), not a text encoder"
    return None


def position_limit(model: Any) -> int:
    """How many tokens the model's absolute position table takes: its rows, less the ones before the first
    position when positions start past the padding index (RoBERTa's family: 514 rows, 512 tokens); a model
    without such a table (DeBERTa's relative positions), its configuration's max_position_embeddings."""
    embeddings = getattr(getattr(model, "embeddings", None), "position_embeddings", None)
    if isinstance(embeddings, torch.nn.Embedding):
        offset = 0 if embeddings.padding_idx is None else embeddings.padding_idx + 1
        return embeddings.num_embeddings - offset
    return int(getattr(model.config, "max_position_embeddings", None) or 512)


class TextEncoder:
    """Token embeddings of a BERT-like text encoder at one layer, for greedy matching."""

    def __init__(self, spec: EncoderSpec, num_layers: int | None = None, prefix_space: str = "paper"):
        from transformers import AutoModel, AutoTokenizer

        if prefix_space not in PREFIX_SPACE:
            raise ValueError(f"prefix_space must be one of {PREFIX_SPACE}, got {prefix_space!r}")
        self.spec = spec
        self.tokenizer = loading.load_processor(AutoTokenizer, spec.model, **spec.hub())
        # BERTScore reads one layer's hidden states, never the pooler; roberta-large, xlm-roberta-* and
        # mpnet-base ship none (saved from their masked-LM models)
        self.model = loading.load_spec(AutoModel, spec, **loading.without_pooler(spec))
        self.device = loading.input_device(self.model, spec.device)
        self.blocks = transformer_blocks(self.model)
        if num_layers is None:
            num_layers = bert_score_layer(spec.model)
        self.layer = len(self.blocks) if num_layers is None else resolve_layer(num_layers, len(self.blocks), spec.model)
        self.max_tokens = self._max_tokens()
        self.prefix_space = prefix_space == "paper" and bert_score_prefix_space(self.tokenizer)
        self.special_ids = frozenset(
            i for i in (self.tokenizer.cls_token_id, self.tokenizer.sep_token_id) if i is not None
        )

    @classmethod
    def shared(cls, spec: EncoderSpec, num_layers: int | None = None, prefix_space: str = "paper") -> "TextEncoder":
        return loading.shared(("TextEncoder", spec, num_layers, prefix_space),
                              lambda: cls(spec, num_layers, prefix_space))

    def _max_tokens(self) -> int:
        """The tokenizer's limit (bert_score's), never past the positions the model has: a tokenizer that sets
        none (the "no limit" sentinel) or more than the model holds would index past its position table."""
        limit, positions = self.tokenizer.model_max_length, position_limit(self.model)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit < 3:
            raise ModelLoadError(f"cannot load the tokenizer of {self.spec.model!r}: its model_max_length is {limit}, "
                                 "too short for a text between its special tokens (tokenizer_config.json)")
        if limit is None or limit > 100_000:
            return positions
        return int(min(limit, positions))

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids with special tokens, as bert_score's ``sent_encode``; captions over the limit are truncated
        keeping the closing special token, with a warning (once per model)."""
        # bert_score encodes an empty (or blank) text as the special tokens alone, with no prefix space
        prepared = [(" " + t.strip()) if self.prefix_space and t.strip() else t.strip() for t in texts]
        ids = self.tokenizer(prepared, add_special_tokens=True)["input_ids"]
        too_long = [i for i, row in enumerate(ids) if len(row) > self.max_tokens]
        if too_long:
            warn_once(
                ("truncate", self.spec.model),
                f"{len(too_long)} text(s) exceed the {self.max_tokens}-token limit of {self.spec.model}; they are "
                "truncated keeping the closing special token, as bert_score does (reported once per model)",
            )
            cut = self.tokenizer([prepared[i] for i in too_long], add_special_tokens=True, truncation=True,
                                 max_length=self.max_tokens)["input_ids"]
            for i, row in zip(too_long, cut):
                ids[i] = row
        return [list(row) for row in ids]

    @torch.inference_mode()
    def embed_ids(self, ids: Sequence[Sequence[int]], batch_size: int = 64) -> TokenEmbeddings:
        """Embeddings at ``self.layer`` of tokenised texts, in chunks of ``batch_size`` texts of similar length."""
        if not ids:
            raise ValueError("no texts to embed")
        order = length_order([len(r) for r in ids])
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        chunks = []
        for start in range(0, len(order), max(1, batch_size)):
            rows = [ids[i] for i in order[start : start + batch_size]]
            input_ids, mask = pad_rows(rows, pad_id)
            hidden = hidden_state_at(self.model, self.blocks, self.layer, input_ids=input_ids.to(self.device),
                                     attention_mask=mask.long().to(self.device))
            special = torch.zeros_like(mask)
            for sid in self.special_ids:
                special |= input_ids == sid
            chunks.append(TokenEmbeddings(hidden.float(), input_ids.to(self.device), mask.to(self.device),
                                          special.to(self.device)))
        return concat_padded(chunks, order)

    def embed(self, texts: Sequence[str], batch_size: int = 64) -> TokenEmbeddings:
        return self.embed_ids(self.tokenize(texts), batch_size)

    @torch.inference_mode()
    def embed_packed(self, texts: Sequence[str], batch_size: int = 64) -> "PackedEmbeddings":
        """Each distinct text of ``texts`` embedded once, longest first in chunks of ``batch_size`` (little
        padding), kept unpadded: what a whole corpus needs in memory (as bert_score keeps it)."""
        distinct = list(dict.fromkeys(texts))
        ids = self.tokenize(distinct)
        order = length_order([len(r) for r in ids])
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        pieces: list[Tensor | None] = [None] * len(ids)
        for start in range(0, len(order), max(1, batch_size)):
            rows = order[start : start + batch_size]
            input_ids, mask = pad_rows([ids[i] for i in rows], pad_id)
            hidden = hidden_state_at(self.model, self.blocks, self.layer, input_ids=input_ids.to(self.device),
                                     attention_mask=mask.long().to(self.device)).float()
            for k, i in enumerate(rows):
                pieces[i] = hidden[k, : len(ids[i])]
        return PackedEmbeddings.pack(distinct, ids, pieces, self.special_ids)


@dataclass
class PackedEmbeddings:
    """Token embeddings of distinct texts, concatenated without padding (``flat`` (T + 1, D), ``ids`` (T + 1,),
    ``special`` (T + 1,); the last row is a zero padding row) with each text's ``start`` and ``length``;
    :meth:`gather` pads any selection back with one ``index_select`` per tensor."""

    row: dict[str, int]
    flat: Tensor
    ids: Tensor
    special: Tensor
    start: Tensor
    length: Tensor

    @classmethod
    def pack(cls, texts: Sequence[str], ids: Sequence[Sequence[int]], pieces: Sequence[Tensor],
             special_ids: frozenset[int]) -> "PackedEmbeddings":
        length = torch.tensor([len(r) for r in ids], dtype=torch.long)
        start = torch.cumsum(length, 0) - length
        flat_ids = torch.tensor([t for r in ids for t in r] + [0], dtype=torch.long)
        special = torch.isin(flat_ids, torch.tensor(sorted(special_ids), dtype=torch.long))
        special[-1] = False
        width = pieces[0].shape[-1] if pieces else 0
        device = pieces[0].device if pieces else None
        flat = torch.cat([*pieces, torch.zeros(1, width, device=device)])
        return cls({t: i for i, t in enumerate(texts)}, flat, flat_ids.to(flat.device), special.to(flat.device),
                   start, length)

    def covers(self, texts: Sequence[str]) -> bool:
        return all(t in self.row for t in texts)

    def unit(self) -> "PackedEmbeddings":
        """The same with every token embedding L2-normalised: done once for the corpus, not once per pair."""
        return PackedEmbeddings(self.row, F.normalize(self.flat.float(), dim=-1), self.ids, self.special,
                                self.start, self.length)

    def gather(self, texts: Sequence[str], width: int | None = None) -> TokenEmbeddings:
        """The texts' embeddings, right-padded to the longest of them or to ``width`` (no model call)."""
        rows = torch.tensor([self.row[t] for t in texts], dtype=torch.long)
        length = self.length[rows]
        longest = int(length.max()) if len(rows) else 0
        width = longest if width is None else max(width, longest)
        pos = torch.arange(width)
        mask = pos[None, :] < length[:, None]
        index = torch.where(mask, self.start[rows][:, None] + pos[None, :], len(self.flat) - 1)
        mask, index = mask.to(self.flat.device), index.flatten().to(self.flat.device)
        shape = mask.shape
        emb = self.flat.index_select(0, index).view(*shape, -1)
        return TokenEmbeddings(emb, self.ids.index_select(0, index).view(shape), mask,
                               self.special.index_select(0, index).view(shape))


def bert_score_prefix_space(tokenizer: Any) -> bool:
    """Whether bert_score gives ``tokenizer`` its texts with a leading space, so that the first word is tokenised
    like any later one ("ĠA", not "A"): it asks GPT-2 and RoBERTa tokenizers (and their subclasses: BART, and
    Longformer's in transformers 5) for ``add_prefix_space=True`` and no other (DeBERTa's GPT-2 BPE included).
    bert_score's authors made the change to reproduce the paper's RoBERTa results (bert_score 0.2.2). Decided by
    the class, as bert_score decides; adding the space ourselves is what the request did on transformers 4
    (transformers 5 ignores it), and is harmless for a tokenizer saved with its own prefix-space setting, which
    adds none to a text that starts with one."""
    return any(c.__name__ in BERT_SCORE_SPACED_CLASSES for c in type(tokenizer).__mro__)
