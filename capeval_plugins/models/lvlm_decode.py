"""The judge's model work: a shared-prefix key/value cache and greedy decoding from raw logits.

The candidates of one image share the image and everything of the prompt before the caption. That prefix (vision
encoder included) runs once per image and chunk (:meth:`PrefixDecoder._prefill`); its cache is copied to each
candidate, and only the candidate-specific suffixes run per sample. Padding between prefix and suffix is masked
and positions are recomputed, so the numbers equal those of a one-prompt forward pass up to float rounding. The
decoder then writes one token per step (:meth:`PrefixDecoder._decode`), its state over a chunk held in one
:class:`Answers`; finished samples leave the batch. A chunk that runs out of memory is retried with half the
samples (:meth:`PrefixDecoder._chunks`). The judge (:class:`capeval_plugins.models.lvlm.LVLMJudge`) prepares the
tokens (:class:`JudgeRun`) and reads what is returned (:class:`JudgeOutput`, :class:`PromptEnd`)."""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from capeval_plugins.resources import loading
from capeval_plugins.core.lvlm_prompts import KeywordStop, RatingScale
from capeval_plugins.core.messages import warn_once

# --- what a judge returns -----------------------------------------------------------------------------------


@dataclass
class JudgeOutput:
    """Per sample (rows in input order) and per answer step ``k`` (columns; ``n_steps`` of them).

    - ``texts``: the answers (special tokens dropped); ``tokens`` (B, S) their ids, ``-1`` after the end.
    - ``label_logprobs`` (B, S, K) float32: log-softmax over the output vocabulary (every row of the LM head, or
      the first ``vocab_rows``) of the logits that chose token ``k``, at the scale's K label tokens (NaN after
      the end). It is computed in float64: in float32, the log-sum-exp of 32,000 logits is off by about 1e-6,
      the size of differences the metrics' tests resolve; the labels' values keep float32's 6e-8. Where a
      tokenizer has a bare and a space-prefixed form of the labels ("A" / " A"), the form of the token written
      at that step is used (``label_variant`` (B, S) indexes the rows of ``label_table`` (variants, K)).
    - ``hidden`` (B, S, d) float32: the final hidden state (LM-head input) that produced those logits, or
      None when not kept.
    - ``raw`` (B,) float64: the parsed score (NaN where there is none, ``errors`` says why);
      ``positions`` (B, P): the step holding each of the scale's score positions, ``labels`` (B, P) the
      label index written there (``-1`` where absent).

    A head on the hidden state (Rigel's) reads, at score position ``j``, ``h = out.hidden_at(j)`` (B, d) and
    ``V, bias = judge.lm_head_rows(out.label_ids_at(j))`` (B, K, d): ``softmax(einsum("bkd,bd->bk", V, h))``
    is ``softmax(out.logprobs_at(j))``, the label distribution renormalised over the labels.
    """

    texts: list[str]
    tokens: Tensor
    label_logprobs: Tensor
    label_variant: Tensor
    label_table: Tensor
    hidden: Tensor | None
    raw: Tensor
    positions: Tensor
    labels: Tensor
    errors: list[str | None]
    _score_logprobs: Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def valid(self) -> Tensor:
        return ~torch.isnan(self.raw)

    def logprobs_at(self, position: int) -> Tensor:
        """(B, K) label log-probabilities at score position ``position`` (NaN rows where absent)."""
        return self.score_logprobs[:, position]

    @property
    def score_logprobs(self) -> Tensor:
        """(B, P, K) label log-probabilities at every score position (NaN rows where absent): one gather for
        all of them, kept (the heads read each position several times)."""
        if self._score_logprobs is None:
            self._score_logprobs = _gather_steps(self.label_logprobs, self.positions, float("nan"))
        return self._score_logprobs

    def hidden_at(self, position: int) -> Tensor:
        """(B, d) final hidden state at score position ``position`` (NaN rows where absent)."""
        if self.hidden is None:
            raise ValueError("hidden states were not kept (keep_hidden=False)")
        return _gather_steps(self.hidden, self.positions[:, position:position + 1], float("nan"))[:, 0]

    def label_ids_at(self, position: int) -> Tensor:
        """(B, K) ids of the label tokens read at score position ``position`` (the bare form where absent)."""
        steps = self.positions[:, position].clamp_min(0)
        variant = self.label_variant.gather(1, steps[:, None])[:, 0]
        return self.label_table[variant]


def _gather_steps(values: Tensor, steps: Tensor, fill: float) -> Tensor:
    """``values`` (B, S, ...) at the steps ``steps`` (B, P) of each row: (B, P, ...), ``fill`` where a step is
    -1 (absent). Vectorised: one gather and one select, no host synchronisation."""
    tail = values.shape[2:]
    index = steps.clamp_min(0).view(*steps.shape, *([1] * len(tail))).expand(*steps.shape, *tail)
    out = values.gather(1, index)
    absent = (steps < 0).view(*steps.shape, *([1] * len(tail)))
    return torch.where(absent, torch.full((), fill, dtype=out.dtype), out)


def cat_outputs(parts: list[JudgeOutput], label_table: Tensor) -> JudgeOutput:
    steps = max(p.tokens.shape[1] for p in parts)

    def pad(t: Tensor, value: float) -> Tensor:
        return F.pad(t, [0, 0] * (t.dim() - 2) + [0, steps - t.shape[1]], value=value)

    hidden = None if parts[0].hidden is None else torch.cat([pad(p.hidden, float("nan")) for p in parts])
    return JudgeOutput(
        texts=[t for p in parts for t in p.texts],
        tokens=torch.cat([pad(p.tokens, -1) for p in parts]),
        label_logprobs=torch.cat([pad(p.label_logprobs, float("nan")) for p in parts]),
        label_variant=torch.cat([pad(p.label_variant, 0) for p in parts]),
        label_table=label_table,
        hidden=hidden,
        raw=torch.cat([p.raw for p in parts]),
        positions=torch.cat([p.positions for p in parts]),
        labels=torch.cat([p.labels for p in parts]),
        errors=[e for p in parts for e in p.errors],
    )


@dataclass
class PromptEnd:
    """Per sample (rows in input order), at the end of the prompt: ``hidden`` (B, d) float32, the final hidden
    state (LM-head input), and ``label_logprobs`` (B, K) float32, the log-softmax over the full output
    vocabulary of the logits there, at the labels' bare tokens. On the model's device; part of the autograd
    graph when computed with ``grad=True``."""

    hidden: Tensor
    label_logprobs: Tensor

    def __len__(self) -> int:
        return len(self.hidden)


def empty_output(table: Tensor, k: int, p: int) -> JudgeOutput:
    return JudgeOutput([], torch.zeros((0, 0), dtype=torch.long), torch.zeros((0, 0, k)),
                       torch.zeros((0, 0), dtype=torch.long), table, None,
                       torch.zeros(0, dtype=torch.float64), torch.zeros((0, p), dtype=torch.long),
                       torch.zeros((0, p), dtype=torch.long), [])


# --- what the decoder reads and holds -----------------------------------------------------------------------


@dataclass
class ImageWork:
    """One distinct image: its processor output for the full prompt of a representative sample."""

    rep: int
    ids: Tensor
    tokens: dict[str, Tensor]
    vision: dict[str, Tensor]
    shift: int  # tokens the processor added (image expansion) relative to the text-only tokenisation


@dataclass
class JudgeRun:
    """Everything of one ``judge`` call that does not depend on chunking."""

    text_ids: list[list[int]]
    image_of: list[int]
    work: dict[int, ImageWork]
    forced: list[list[int] | None]
    scale: RatingScale | None
    max_new_tokens: int
    keep_hidden: bool
    stop: KeywordStop | None = None  # free answers, ended by this rule (no score parsed)
    vocab_rows: int | None = None  # the LM head rows the next token and the log-softmax are taken over


@dataclass
class StepInput:
    """What the next forward step reads: each active sample's key/value cache (one cache object, a row per
    sample), its new token ids, the attention mask over everything so far and the new tokens' positions."""

    cache: Any
    ids: Tensor
    mask: Tensor
    positions: Tensor

    def advance(self, keep: Tensor, chosen: Tensor, index_device: torch.device) -> StepInput:
        """The input of the step after ``chosen`` (A,) was written: the rows ``keep`` only, one more position."""
        self.cache.batch_select_indices(keep.nonzero()[:, 0].to(index_device))
        kept = self.mask[keep]
        mask = torch.cat([kept, torch.ones((len(kept), 1), dtype=kept.dtype)], dim=1)
        return StepInput(self.cache, chosen[keep][:, None], mask, self.positions[keep][:, -1:] + 1)


@dataclass
class Answers:
    """The decoder's state over one chunk of B samples and ``budget`` steps: what each sample wrote so far.

    ``forced`` (per sample, the ids of a teacher-forced answer, or None) and ``forced_ids`` (B, budget: those
    ids by step, -1 where the model chooses); by step ``k``: ``tokens`` (B, budget) the token written (-1 after
    the end), ``label_logprobs`` (B, budget, K) the labels' log-probabilities at the form (``variants``: row of
    the label table) of that token, ``hidden`` (B, budget, d) the final hidden state when kept, ``ends``
    (B, budget) the answer's length in characters; ``texts`` the answers so far; ``active`` the rows still
    decoding, at step ``step``."""

    forced: list[list[int] | None]
    forced_ids: Tensor
    tokens: Tensor
    label_logprobs: Tensor
    variants: Tensor
    ends: np.ndarray
    texts: list[str]
    active: Tensor
    step: int = 0
    hidden: Tensor | None = None

    @classmethod
    def start(cls, forced: list[list[int] | None], max_new_tokens: int, k: int) -> Answers:
        b = len(forced)
        budget = max([max_new_tokens] + [len(f) for f in forced if f is not None])
        forced_ids = torch.full((b, budget), -1, dtype=torch.long)
        for i, f in enumerate(forced):
            if f is not None:
                forced_ids[i, : len(f)] = torch.tensor(f)
        return cls(forced, forced_ids, tokens=torch.full((b, budget), -1, dtype=torch.long),
                   label_logprobs=torch.full((b, budget, k), float("nan")),
                   variants=torch.zeros((b, budget), dtype=torch.long), ends=np.zeros((b, budget), dtype=np.int64),
                   texts=[""] * b, active=torch.arange(b))

    @property
    def budget(self) -> int:
        return self.tokens.shape[1]

    def record(self, chosen: Tensor, label_logprobs: Tensor, variant: Tensor, hidden: Tensor | None) -> None:
        """The active rows' current step: the token written, the label log-probabilities at its form and that
        form, and the final hidden state (None: not kept)."""
        active, step = self.active, self.step
        self.label_logprobs[active, step] = label_logprobs.to(self.label_logprobs.dtype)
        self.variants[active, step] = variant
        self.tokens[active, step] = chosen
        if hidden is not None:
            if self.hidden is None:
                self.hidden = torch.full((len(self.texts), self.budget, hidden.shape[-1]), float("nan"))
            self.hidden[active, step] = hidden

    def advance(self, keep: Tensor) -> None:
        self.active = self.active[keep]
        self.step += 1


# --- the decoder --------------------------------------------------------------------------------------------


class PrefixDecoder:
    """A loaded image-text-to-text model run with a shared prefix per image and greedy decoding from raw logits
    (see the module docstring); the base of :class:`~capeval_plugins.models.lvlm.LVLMJudge`, which prepares its
    :class:`JudgeRun`.

    The model may be dispatched by accelerate (a ``device_map``). ``device`` (:func:`loading.input_device`: by
    default where the input embeddings compute) is then where inputs start and where logits and hidden states
    are gathered; the key/value cache of each layer stays on that layer's device. ``visual_token_ids`` are the
    image and video placeholder tokens (None where absent), which must come before the shared prefix's end."""

    def __init__(self, model: Any, tokenizer: Any, device: str | torch.device | None = None,
                 visual_token_ids: tuple[int | None, int | None] = (None, None)):
        self.model = model
        self.tokenizer = tokenizer
        self.device = loading.input_device(model, device)
        # Rows of a cache spread over devices are selected with CPU indices, which index a tensor on any device.
        self.index_device = torch.device("cpu") if loading.is_dispatched(model) else self.device
        self.head = model.get_output_embeddings()
        self.eos_ids = self._eos_ids()
        self.image_token_id, self.video_token_id = visual_token_ids
        self.rope_index = getattr(getattr(model, "model", model), "get_rope_index", None)
        self.cache_arg = cache_argument(model)

    def _eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        gen = getattr(self.model, "generation_config", None)
        extra = getattr(gen, "eos_token_id", None)
        ids.update(extra if isinstance(extra, (list, tuple)) else [extra])
        return {int(i) for i in ids if i is not None}

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    # -- chunks and their shared prefixes --

    def _chunks(self, run: JudgeRun, batch_size: int, process: Callable[[list[int]], Any]) -> Iterator[Any]:
        """``process(rows)`` on chunks of at most ``batch_size`` samples in order; on out-of-memory, halve and
        retry."""
        start, size, n = 0, batch_size, len(run.text_ids)
        while start < n:
            rows = list(range(start, min(start + size, n)))
            try:
                part = process(rows)
            except RuntimeError as err:
                if not _is_oom(err) or size == 1:
                    raise
                size = max(1, len(rows) // 2)
                warn_once(("lvlm-oom", id(self), size),
                          f"out of memory on a chunk of {len(rows)} samples; retrying with {size}")
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
            start += len(rows)
            yield part

    def _split(self, run: JudgeRun, rows: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Per distinct image of the chunk: the shared prefix length in text tokens (at least one token of
        every sample is left to its suffix). Returns (images, group of each row, prefix length per image)."""
        groups: dict[int, list[int]] = {}
        for r in rows:
            groups.setdefault(run.image_of[r], []).append(r)
        images = list(groups)
        group_of = [images.index(run.image_of[r]) for r in rows]
        cuts = []
        for g in images:
            work = run.work[g]
            rep = run.text_ids[work.rep]
            cut = min(min(_common_prefix(run.text_ids[r], rep), len(run.text_ids[r]) - 1) for r in groups[g])
            self._check_cut(work, rep, cut)
            cuts.append(cut)
        return images, group_of, cuts

    def _check_cut(self, work: ImageWork, rep_ids: list[int], cut: int) -> None:
        if any(t is not None and t in rep_ids[cut:] for t in (self.image_token_id, self.video_token_id)):
            raise ValueError("this chat template puts the image after text that differs between candidates; "
                             "the judge needs the image first")
        tail = work.ids[cut + work.shift:].tolist()
        if cut + work.shift < 0 or tail != rep_ids[cut:]:
            raise ValueError("the processor's tokenisation of the prompt differs from the tokenizer's beyond the "
                             "image tokens; this processor is not supported")

    def _run_chunk(self, run: JudgeRun, rows: list[int], table: Tensor) -> JudgeOutput:
        return self._decode(run, rows, table, self._prefill(run, rows))

    def _end_chunk(self, run: JudgeRun, rows: list[int], table: Tensor) -> PromptEnd:
        logits, h = self._forward_step(self._prefill(run, rows), run.vocab_rows)
        return PromptEnd(h, torch.log_softmax(logits.double(), dim=-1)[:, table[0].to(self.device)].float())

    def _prefill(self, run: JudgeRun, rows: list[int]) -> StepInput:
        """The chunk's shared prefixes through the model, their caches copied to each sample: the input of the
        first forward step (the suffixes, attending to prefix + suffix)."""
        images, group_of, cuts = self._split(run, rows)
        dev = self.device
        # 1. Shared prefixes (image + prompt up to the caption), left-padded, once per image.
        prefixes = [run.work[g] for g in images]
        pre_ids, pre_mask, pre_tokens = _left_pad(
            [w.ids[: c + w.shift] for w, c in zip(prefixes, cuts)],
            [{k: v[: c + w.shift] for k, v in w.tokens.items()} for w, c in zip(prefixes, cuts)],
            self._pad_id(),
        )
        vision = _collate_vision([w.vision for w in prefixes])
        pre_pos = self._prefix_positions(pre_ids, pre_mask, pre_tokens, vision)
        out = self.model(input_ids=pre_ids.to(dev), attention_mask=pre_mask.to(dev), position_ids=pre_pos.to(dev),
                         **{k: v.to(dev) for k, v in {**pre_tokens, **vision}.items()},
                         use_cache=True, logits_to_keep=1)
        cache = getattr(out, self.cache_arg)
        next_pos = _next_positions(pre_pos, pre_mask)
        # 2. Each candidate's suffix on a copy of its image's cache.
        group = torch.tensor(group_of, dtype=torch.long)
        cache.batch_select_indices(group.to(self.index_device))
        suf_ids, suf_mask, _ = _left_pad(
            [torch.tensor(run.text_ids[r][cuts[g]:]) for r, g in zip(rows, group_of)], None, self._pad_id())
        mask = torch.cat([pre_mask[group], suf_mask], dim=1)
        positions = next_pos[group, None] + (suf_mask.cumsum(1) - 1).clamp_min(0)
        return StepInput(cache, suf_ids, mask, positions)

    def _prefix_positions(self, ids: Tensor, mask: Tensor, tokens: dict[str, Tensor],
                          vision: dict[str, Tensor]) -> Tensor:
        """Position ids of the left-padded prefixes: 1-D RoPE positions counting real tokens, or the
        model's multimodal RoPE positions (3, G, L) for Qwen-VL families."""
        if self.rope_index is None:
            return (mask.cumsum(1) - 1).clamp_min(0)
        params = inspect.signature(self.rope_index).parameters
        extra = {k: v for k, v in {**tokens, **vision}.items() if k in params}
        dev = self.device
        positions, _ = self.rope_index(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                       **{k: v.to(dev) for k, v in extra.items()})
        return positions.cpu()

    # -- one step and greedy decoding --

    def _step_positions(self, positions: Tensor) -> Tensor:
        return positions if self.rope_index is None else positions[None].expand(3, *positions.shape)

    @contextmanager
    def _capture_hidden(self) -> Iterator[list[Tensor]]:
        seen: list[Tensor] = []
        handle = self.head.register_forward_pre_hook(lambda _mod, args: seen.append(args[0][:, -1]))
        try:
            yield seen
        finally:
            handle.remove()

    def _forward_step(self, step: StepInput, vocab_rows: int | None = None) -> tuple[Tensor, Tensor]:
        """(logits, final hidden state) at the last position, gathered on :attr:`device` (a dispatched model
        computes its last layers and head elsewhere); the logits of the first ``vocab_rows`` rows only, when
        given. The hidden state is float32, the logits float32 or the model's wider dtype (float64)."""
        dev = self.device
        with self._capture_hidden() as seen:
            out = self.model(input_ids=step.ids.to(dev), attention_mask=step.mask.to(dev),
                             position_ids=self._step_positions(step.positions).to(dev), use_cache=True,
                             logits_to_keep=1, **{self.cache_arg: step.cache})
        logits = out.logits[:, -1, :vocab_rows]
        return logits.to(dev, torch.promote_types(logits.dtype, torch.float32)), seen[-1].float().to(dev)

    def _decode(self, run: JudgeRun, rows: list[int], table: Tensor, step: StepInput) -> JudgeOutput:
        """Greedy answers from raw logits, one step per token, finished samples leaving the batch."""
        answers = Answers.start([run.forced[r] for r in rows], run.max_new_tokens, table.shape[1])
        table_dev = table.to(self.device)
        logits, h = self._forward_step(step, run.vocab_rows)
        while True:
            teacher = answers.forced_ids[answers.active, answers.step]
            chosen = torch.where(teacher >= 0, teacher, logits.argmax(-1).cpu())
            forms = torch.log_softmax(logits.double(), dim=-1)[:, table_dev]  # (A, variants, K)
            form = (chosen.to(self.device)[:, None, None] == table_dev).any(-1).float().argmax(-1)
            picked = forms[torch.arange(len(answers.active), device=self.device), form]
            answers.record(chosen, picked.cpu(), form.cpu(), h.cpu() if run.keep_hidden else None)
            keep = ~self._finished(run, rows, answers, chosen)
            if answers.step + 1 == answers.budget or not bool(keep.any()):
                break
            answers.advance(keep)
            step = step.advance(keep, chosen, self.index_device)
            logits, h = self._forward_step(step, run.vocab_rows)
        return self._read(run, answers, table)

    def _finished(self, run: JudgeRun, rows: list[int], answers: Answers, chosen: Tensor) -> Tensor:
        """Update the answers of the active rows (of the chunk ``rows``) and say which are complete."""
        act, step = answers.active.tolist(), answers.step
        decoded = self.tokenizer.batch_decode([answers.tokens[r, : step + 1].tolist() for r in act],
                                              skip_special_tokens=True)
        done = torch.isin(chosen, torch.tensor(sorted(self.eos_ids), dtype=torch.long))
        for j, (r, text) in enumerate(zip(act, decoded)):
            answers.texts[r] = text
            answers.ends[r, step] = len(text)
            forced = answers.forced[r]
            if forced is not None:
                done[j] = step + 1 >= len(forced)
            elif run.stop is not None:
                written = answers.tokens[r, : step + 1].tolist()
                done[j] = bool(done[j]) or run.stop.done(self.tokenizer, len(run.text_ids[rows[r]]), written)
            elif run.scale.complete(text):
                done[j] = True
        return done

    def _read(self, run: JudgeRun, answers: Answers, table: Tensor) -> JudgeOutput:
        """Parse each answer and find the steps that hold its score's label characters."""
        tokens, texts = answers.tokens, answers.texts
        b, p = len(texts), len(run.scale.positions)
        raw = torch.full((b,), float("nan"), dtype=torch.float64)
        positions = torch.full((b, p), -1, dtype=torch.long)
        labels = torch.full((b, p), -1, dtype=torch.long)
        errors: list[str | None] = [None] * b
        n_steps = int((tokens >= 0).sum(1).max())
        for i in range(b if run.stop is None else 0):  # free answers (a stop rule): nothing to parse
            parsed = run.scale.parse(texts[i])
            if isinstance(parsed, str):
                errors[i] = parsed
                continue
            n = int((tokens[i] >= 0).sum())
            steps = np.searchsorted(answers.ends[i, :n], parsed.chars, side="right")
            bad = [c for c, s in zip(parsed.chars, steps) if c >= 0 and (
                s >= n or self.tokenizer.decode([int(tokens[i, s])]).strip() != texts[i][c])]
            if bad:
                errors[i] = f"the score character {texts[i][bad[0]]!r} is not a token of its own"
                continue
            raw[i] = parsed.value
            positions[i] = torch.tensor([int(s) if c >= 0 else -1 for c, s in zip(parsed.chars, steps)])
            labels[i] = torch.tensor(parsed.labels)
        hidden = answers.hidden
        return JudgeOutput(
            texts=texts, tokens=tokens[:, :n_steps], label_logprobs=answers.label_logprobs[:, :n_steps],
            label_variant=answers.variants[:, :n_steps], label_table=table,
            hidden=None if hidden is None else hidden[:, :n_steps], raw=raw, positions=positions,
            labels=labels, errors=errors,
        )


def cache_argument(model: Any) -> str:
    """The name under which ``model`` takes and returns its key/value cache: ``cache`` (transformers 5.24 on;
    ``past_key_values`` is deprecated there and removed in 5.40), else ``past_key_values`` (earlier versions)."""
    forward = getattr(model, "forward", model)
    try:
        return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return "past_key_values"


def _is_oom(err: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch.OutOfMemoryError: 2.5+
    return isinstance(err, oom) or "out of memory" in str(err).lower()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def _left_pad(seqs: list[Tensor], extras: list[dict[str, Tensor]] | None, pad_id: int
              ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Left-pad id sequences (and their token-level companions, with zeros) to one width."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = s
        mask[i, width - len(s):] = 1
    padded: dict[str, Tensor] = {}
    for key in (extras[0] if extras else {}):
        out = torch.zeros((len(seqs), width), dtype=extras[0][key].dtype)
        for i, e in enumerate(extras):
            out[i, width - len(e[key]):] = e[key]
        padded[key] = out
    return ids, mask, padded


def _collate_vision(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Stack per-image processor outputs along their first axis. Flat patch lists (Qwen-VL, InternVL:
    one row per patch, ``image_grid_thw`` per image) concatenate; per-image stacks of varying patch counts
    (LLaVA-NeXT any-resolution) are zero-padded, as the processor itself pads, and ``image_sizes`` tells the
    model how many are real. Keys missing from a part (a video's ``pixel_values_videos`` next to an image's
    ``pixel_values``) are collated over the parts that have them, in order, as the model reads each modality."""
    out = {}
    for key in dict.fromkeys(k for part in parts for k in part):
        values = [p[key] for p in parts if key in p]
        rest = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
        values = [F.pad(v, [x for d in reversed(range(1, v.dim())) for x in (0, rest[d - 1] - v.shape[d])])
                  for v in values]
        out[key] = torch.cat(values, dim=0)
    return out


def _next_positions(positions: Tensor, mask: Tensor) -> Tensor:
    """The position of the first token after each prefix: one past its largest real position."""
    flat = positions if positions.dim() == 2 else positions.amax(0)
    return flat.masked_fill(mask == 0, -1).amax(1) + 1
