"""A batched LVLM judge: (image, instruction) -> the score it writes and the distributions behind it.

FLEUR and DISCODE (and Rigel) all read a score that an LVLM writes and the distribution of the label tokens at
that position. :class:`LVLMJudge` does the model work once for all of them:

* **Prompt**: one image, then the instruction, inside the processor's chat template, with the generation
  prompt; :func:`fleur_instruction` writes the FLEUR / RefFLEUR instruction for any :class:`RatingScale`.
  An optional system prompt goes into the template's system turn, or, for templates without one, before the
  instruction in the user turn (:class:`VisualInput`); images may be padded to a square first, as LLaVA's
  ``image_aspect_ratio="pad"`` does.
* **Shared prefix**: the candidates of one image share the image and everything of the prompt before the
  caption. That prefix (vision encoder included) runs once per image and chunk; its key/value cache is
  copied to each candidate, and only the candidate-specific suffixes run per sample. Padding between prefix
  and suffix is masked and positions are recomputed, so the numbers equal those of a one-prompt forward
  pass up to float rounding, whatever the batch size, padding or composition.
* **Greedy decoding from raw logits**: the next token is the argmax of the model's logits (no generation
  config, no logits processors, no sampling); the label log-probabilities are a float32 log-softmax over
  the model's full output vocabulary (padded rows included). A sample stops as soon as its score is written
  (:meth:`RatingScale.complete`), at an end-of-sequence token, or at the token budget; finished samples
  leave the batch.
* **Per step** ``k`` of the answer: the token, the log-probabilities of the scale's label tokens, and the
  final hidden state ``h`` (the LM head's input) whose logits chose that token, so
  ``softmax(V h)`` over the label rows ``V`` (:meth:`LVLMJudge.lm_head_rows`) is the label distribution at
  that step (for a bias-free linear LM head without logit scaling, which holds for the supported families).
* **Parsing**: the answer is parsed by the scale's strict pattern; the steps holding the score's label
  characters are found by decoding, never assumed.
* **Memory**: a chunk that runs out of memory is retried with half the samples (down to one).
* **Prompt end** (:meth:`LVLMJudge.prompt_end`): one forward pass per sample and no decoding: the final
  hidden state at the end of the prompt (the position whose logits choose the answer's first token) and the
  label log-probabilities there, with the same batching and prefix sharing; with ``grad=True`` it runs with
  autograd (fine-tuning through the shared prefix: the cache is copied out of place, so gradients reach it).
* **Video**: a visual given as a list of frames is a video: the checkpoint's video input where its processor
  has one (``video_input="auto"`` or ``"video"``: Qwen-VL), else the frames as that many images in one
  prompt (``"frames"``: LLaVA-style checkpoints).

Families: any ``AutoModelForImageTextToText`` checkpoint whose processor takes ``text`` and ``images`` and
whose chat template puts the image before the text: LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision, InternVL (the
``-hf`` checkpoints), Qwen2-VL, Qwen2.5-VL, Qwen3-VL (multimodal RoPE positions from the model's
``get_rope_index``, with ``mm_token_type_ids`` carried and padded).
"""
from __future__ import annotations

import inspect
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from capeval_plugins.core import loading, shared_results
from capeval_plugins.core.messages import MissingExtra, install_extra, warn_once

# Token-level processor outputs (one value per token): padded with the ids, sliced with the prefix.
TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")

# --- rating scales and the FLEUR prompt -------------------------------------------------------------------

_NUMBER = re.compile(r"(?<![\d.\-])(\d+)(?:\.(\d+))?")


@dataclass(frozen=True)
class ParsedScore:
    """A valid score in an answer: its value, and for each score position (see
    :attr:`RatingScale.positions`) the character index in the answer and the label index written there
    (``-1`` where absent)."""

    value: float
    chars: tuple[int, ...]
    labels: tuple[int, ...]


@dataclass(frozen=True)
class RatingScale:
    """What the judge is asked to write and how it is read.

    ``labels`` are the label tokens in value order and ``values`` their values. ``low`` and ``high`` replace
    "0.0" and "1.0" in the FLEUR prompt (DISCODE, Appendix B: the scales of Table 5). A ``decimal`` scale is
    a real number "0.d[d]" or "1.0[0]" whose positions are (integer digit, first decimal, second decimal);
    the others have one position, the label itself."""

    name: str
    labels: tuple[str, ...]
    values: tuple[float, ...]
    low: str
    high: str
    decimal: bool = False

    @property
    def positions(self) -> tuple[str, ...]:
        return ("integer", "decimal1", "decimal2") if self.decimal else ("label",)

    @property
    def letters(self) -> bool:
        return all(label.isalpha() for label in self.labels)

    def _letter_pattern(self, settled: bool = False) -> re.Pattern:
        # The label first (after an optional "Score:"-like lead-in), alone: not the article of "A dog". It is
        # settled once a character other than a space or a letter follows it.
        choices = "".join(re.escape(label) for label in self.labels)
        after = r"(?=[^\w ]| +[^\w ])" if settled else r"(?=$|[^\w ]| +[^\w ]| *$)"
        return re.compile(rf"^\s*(?:[A-Za-z ()]{{1,30}}:\s*)?[\"'*(\[]*([{choices}]){after}")

    def parse(self, text: str) -> ParsedScore | str:
        """The score written in ``text``, or the reason there is none."""
        if self.letters:
            match = self._letter_pattern().match(text)
            if match is None:
                return f"no label {self.low}-{self.high} at the start of the answer"
            label = self.labels.index(match.group(1))
            return ParsedScore(float(self.values[label]), (match.start(1),), (label,))
        match = _NUMBER.search(text)
        if match is None:
            return "no number in the answer"
        whole, fraction = match.group(1), match.group(2)
        if self.decimal:
            if fraction is None or whole not in ("0", "1") or (whole == "1" and fraction.strip("0")):
                return f"{match.group(0)!r} is not a number from 0.0 to 1.0 with a decimal digit"
            second = match.start(2) + 1 if len(fraction) > 1 else -1
            chars = (match.start(1), match.start(2), second)
            labels = tuple(self.labels.index(text[c]) if c >= 0 else -1 for c in chars)
            return ParsedScore(float(match.group(0)), chars, labels)
        if fraction is not None or whole not in self.labels:
            return f"{match.group(0)!r} is not one of {self.low}-{self.high}"
        label = self.labels.index(whole)
        return ParsedScore(float(self.values[label]), (match.start(1),), (label,))

    def complete(self, text: str) -> bool:
        """Whether the answer so far already holds its (first) score: more tokens cannot change it."""
        if self.letters:
            return self._letter_pattern(settled=True).match(text) is not None
        match = _NUMBER.search(text)
        if match is None:
            return False
        two_decimals = match.group(2) is not None and len(match.group(2)) >= 2
        rest = text[match.end():]
        return (rest != "" and rest != ".") or (self.decimal and two_decimals)


_DIGITS = tuple(str(d) for d in range(10))
SCALES: dict[str, RatingScale] = {
    "0.0-1.0": RatingScale("0.0-1.0", _DIGITS, tuple(float(d) for d in range(10)), "0.0", "1.0", decimal=True),
    "1-5": RatingScale("1-5", _DIGITS[1:6], (1.0, 2.0, 3.0, 4.0, 5.0), "1", "5"),
    "0-9": RatingScale("0-9", _DIGITS, tuple(float(d) for d in range(10)), "0", "9"),
    "A-E": RatingScale("A-E", ("A", "B", "C", "D", "E"), (1.0, 2.0, 3.0, 4.0, 5.0), "A", "E"),
}


def get_scale(name: str) -> RatingScale:
    try:
        return SCALES[name]
    except KeyError:
        raise ValueError(f"unknown rating scale {name!r}; choose one of {sorted(SCALES)}") from None


def normalise_space(text: str) -> str:
    return " ".join(text.split())


def fleur_instruction(candidate: str, references: Sequence[str] | None = None,
                      scale: RatingScale = SCALES["0.0-1.0"]) -> str:
    """The FLEUR prompt (RefFLEUR with references), "0.0" and "1.0" replaced by the scale's ends.
    Captions are whitespace-normalised; references go one per line."""
    lo, hi = scale.low, scale.high
    what = "the candidate caption" if references else "the caption"
    head = (f"Your task is to evaluate and rate {what} on a scale of {lo} to {hi} based on the given Grading "
            f"Criteria. (Print Real Number Score ONLY)\n\nGrading Criteria:\n\n{lo}: The caption does not describe "
            f"the image at all.\n{hi}: The caption accurately and clearly describes the image.\n\n")
    tail = f"\n\nScore(Choose a rating from {lo} to {hi}):"
    if references:
        refs = "\n".join(normalise_space(r) for r in references)
        return f"{head}Reference Captions: {refs}\n\nCandidate Caption: {normalise_space(candidate)}{tail}"
    return f"{head}Caption: {normalise_space(candidate)}{tail}"


# --- what a judge returns -----------------------------------------------------------------------------------


@dataclass
class JudgeOutput:
    """Per sample (rows in input order) and per answer step ``k`` (columns; ``n_steps`` of them).

    - ``texts``: the answers (special tokens dropped); ``tokens`` (B, S) their ids, ``-1`` after the end.
    - ``label_logprobs`` (B, S, K) float32: log-softmax over the full output vocabulary of the logits that
      chose token ``k``, at the scale's K label tokens (NaN after the end). Where a tokenizer has a bare and
      a space-prefixed form of the labels ("A" / " A"), the form of the token written at that step is used
      (``label_variant`` (B, S) indexes the rows of ``label_table`` (variants, K)).
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


def _cat_outputs(parts: list[JudgeOutput], label_table: Tensor) -> JudgeOutput:
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


# --- the judge ----------------------------------------------------------------------------------------------


JudgeSpec = loading.ModelSpec  # which LVLM to load and how; one spec, one shared judge


QWEN_EXTRA = install_extra("qwen")


def load_lvlm_processor(spec: JudgeSpec) -> Any:
    """The checkpoint's processor, with a one-line error naming the ``qwen`` extra when it needs torchvision
    (Qwen-VL, LLaVA-OneVision and others build a video processor that requires it) and torchvision is missing
    or does not load with this torch."""
    from transformers import AutoProcessor

    try:
        return loading.load_processor(AutoProcessor, spec.model, **spec.hub())
    except (ImportError, AttributeError, RuntimeError) as err:
        if "torchvision" not in f"{type(err).__name__} {err}".lower():
            raise
        raise MissingExtra(
            f"the processor of {spec.model} needs torchvision (its video processor requires it), which is not "
            f"installed or does not load with this torch: {QWEN_EXTRA} (the torchvision build matching your torch)"
        ) from err


@dataclass
class _ImageWork:
    """One distinct image: its processor output for the full prompt of a representative sample."""

    rep: int
    ids: Tensor
    tokens: dict[str, Tensor]
    vision: dict[str, Tensor]
    shift: int  # tokens the processor added (image expansion) relative to the text-only tokenisation


@dataclass
class _Run:
    """Everything of one ``judge`` call that does not depend on chunking."""

    text_ids: list[list[int]]
    image_of: list[int]
    work: dict[int, _ImageWork]
    forced: list[list[int] | None]
    scale: RatingScale | None
    max_new_tokens: int
    keep_hidden: bool


VIDEO_INPUTS = ("auto", "video", "frames")
SYSTEM_PLACEMENTS = ("auto", "system", "user")
IMAGE_ASPECTS = ("crop", "pad")
# The system sentence of LLaVA's "llava_v1" conversation, which the official FLEUR script uses.
LLAVA_V1_SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. "
                   "The assistant gives helpful, detailed, and polite answers to the human's questions.")


@dataclass(frozen=True)
class VisualInput:
    """How the visual and the conversation around the instruction enter the prompt.

    A video (a list of frames) goes in ``"video"`` through the processor's video input (frames used as given,
    ``fps`` their sampling rate: Qwen-VL timestamps and temporal positions), ``"frames"`` as that many images,
    ``"auto"``: video where the processor has a video processor. A single image is one image either way.
    ``answer_prefix`` is appended after the generation prompt (the assistant's first characters, e.g. a space
    for templates whose answers start with one).

    ``system_prompt`` (None or "": none) is placed by ``system_placement``: ``"system"`` as the template's
    system turn (an error if the template has none), ``"user"`` before the instruction in the user turn,
    separated by a blank line (Mistral's own convention for its system-less format), ``"auto"``: the system
    turn where the chat template renders one with the text in it, else the user turn.

    ``image_aspect``: ``"crop"`` hands images to the processor as they are (its own resizing, e.g. LLaVA-1.5's
    shorter side to 336 and a centre crop); ``"pad"`` first pads each image (and each frame fed as an image)
    to a square with the image processor's mean colour, image centred, as LLaVA's ``expand2square`` does for
    ``image_aspect_ratio="pad"``. Videos through a video processor are not padded."""

    video: str = "auto"
    fps: float | None = 2.0
    answer_prefix: str = ""
    system_prompt: str | None = None
    system_placement: str = "auto"
    image_aspect: str = "crop"

    def __post_init__(self) -> None:
        if self.video not in VIDEO_INPUTS:
            raise ValueError(f"video input must be one of {VIDEO_INPUTS}, got {self.video!r}")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"fps must be positive, got {self.fps}")
        if self.system_placement not in SYSTEM_PLACEMENTS:
            raise ValueError(f"system_placement must be one of {SYSTEM_PLACEMENTS}, got {self.system_placement!r}")
        if self.image_aspect not in IMAGE_ASPECTS:
            raise ValueError(f"image_aspect must be one of {IMAGE_ASPECTS}, got {self.image_aspect!r}")


def pad_to_square(image: Any, fill: Sequence[float]) -> np.ndarray:
    """``image`` (a PIL image or an (H, W, C) array) centred on a square canvas of ``fill`` (one value per
    channel, 0-1; scaled to 0-255 and truncated for 8-bit images, as LLaVA's ``expand2square`` does with the
    image processor's mean). Returns an (S, S, C) array; a square image comes back unchanged as an array."""
    pixels = np.asarray(image)
    if pixels.ndim != 3 or pixels.shape[-1] != len(fill):
        raise ValueError(f"cannot pad an image of shape {pixels.shape} with a {len(fill)}-channel colour")
    height, width = pixels.shape[:2]
    side = max(height, width)
    colour = [int(v * 255) for v in fill] if pixels.dtype == np.uint8 else list(fill)
    canvas = np.empty((side, side, pixels.shape[-1]), dtype=pixels.dtype)
    canvas[...] = np.asarray(colour, dtype=pixels.dtype)
    top, left = (side - height) // 2, (side - width) // 2
    canvas[top:top + height, left:left + width] = pixels
    return canvas


def is_video(visual: Any) -> bool:
    return isinstance(visual, (list, tuple))


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


class LVLMJudge:
    """A loaded LVLM (model + processor) used as a greedy judge; see the module docstring.

    Build with :meth:`shared` (through :mod:`capeval_plugins.core.loading`: hub id or local path, safetensors,
    device and dtype chosen once: bfloat16 on GPU, float32 on CPU) or directly from a model and a processor.

    The model may be dispatched by accelerate (a ``device_map``: layers on several GPUs, or offloaded to CPU
    memory or disk). ``device`` (:func:`loading.input_device`: by default where the input embeddings compute)
    is then where inputs start and where logits, hidden states and LM-head rows are gathered; the key/value
    cache of each layer stays on that layer's device."""

    def __init__(self, model: Any, processor: Any, device: str | torch.device | None = None):
        self.model = model
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.device = loading.input_device(model, device)
        # Rows of a cache spread over devices are selected with CPU indices, which index a tensor on any device.
        self.index_device = torch.device("cpu") if loading.is_dispatched(model) else self.device
        self.head = model.get_output_embeddings()
        self.vocab_size = int(self.head.weight.shape[0])
        self.eos_ids = self._eos_ids()
        image_token = getattr(processor, "image_token", None)
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(image_token) if image_token else None
        video_token = getattr(processor, "video_token", None)
        self.video_token_id = self.tokenizer.convert_tokens_to_ids(video_token) if video_token else None
        self.rope_index = getattr(getattr(model, "model", model), "get_rope_index", None)
        self.cache_arg = cache_argument(model)
        self.results = shared_results.Results()  # metrics asking this judge the same questions run it once
        self._system_turns: dict[str, dict | None] = {}  # system prompt -> the system turn the template takes

    @classmethod
    def shared(cls, spec: JudgeSpec) -> "LVLMJudge":
        from transformers import AutoModelForImageTextToText

        def build() -> "LVLMJudge":
            processor = load_lvlm_processor(spec)
            model = loading.load_spec(AutoModelForImageTextToText, spec, gpu_dtype=torch.bfloat16)
            return cls(model, processor, spec.device)

        return loading.shared(("LVLMJudge", spec), build)

    # -- prompts and tokens --

    def chat(self, instruction: str, visual: Any = None, visual_input: VisualInput = VisualInput()) -> str:
        """One user turn (an image, then ``instruction``) in the processor's chat template, ready to answer,
        after the system prompt if :class:`VisualInput` has one (see there for where it goes). With ``visual``
        a video (a list of frames), the video or its frames take the image's place; ``answer_prefix`` ends the
        text."""
        system = visual_input.system_prompt
        where = self.system_placement(system, visual_input.system_placement) if system else None
        text = f"{system}\n\n{instruction}" if where == "user" else instruction
        content = self._visual_content(visual, visual_input) + [{"type": "text", "text": text}]
        messages = [{"role": "user", "content": content}]
        if where == "system":
            messages.insert(0, self._system_turn(system))
        chat = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return chat + visual_input.answer_prefix

    def system_placement(self, system_prompt: str, placement: str = "auto") -> str:
        """``"system"`` or ``"user"``: where :meth:`chat` puts ``system_prompt`` under ``placement``."""
        if placement == "user":
            return "user"
        if system_prompt not in self._system_turns:
            self._system_turns[system_prompt] = self._renders_system_turn(system_prompt)
        if self._system_turns[system_prompt] is not None:
            return "system"
        if placement == "system":
            raise ValueError("this checkpoint's chat template has no system turn; use system_placement='user' "
                             "(the system prompt before the instruction) or 'auto'")
        return "user"

    def _renders_system_turn(self, system_prompt: str) -> dict | None:
        """The first form of system turn (content as a list of parts, then as a string) that the template
        renders with the text in it; None if it rejects both or drops the text."""
        user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}
        for turn in ({"role": "system", "content": [{"type": "text", "text": system_prompt}]},
                     {"role": "system", "content": system_prompt}):
            try:  # templates without a system role raise from inside jinja (or fail on the content's form)
                rendered = self.processor.apply_chat_template([turn, user], add_generation_prompt=True,
                                                              tokenize=False)
            except Exception:
                continue
            if system_prompt in rendered:
                return turn
        return None

    def _system_turn(self, system_prompt: str) -> dict:
        return self._system_turns[system_prompt]

    def video_mode(self, visual_input: VisualInput) -> str:
        """``"video"`` or ``"frames"``: how this judge feeds a video under ``visual_input``."""
        has_video = getattr(self.processor, "video_processor", None) is not None
        if visual_input.video == "video" and not has_video:
            raise ValueError("this checkpoint's processor has no video input; use video input 'frames'")
        return "video" if visual_input.video == "video" or (visual_input.video == "auto" and has_video) else "frames"

    def _visual_content(self, visual: Any, visual_input: VisualInput) -> list[dict]:
        if not is_video(visual):
            return [{"type": "image"}]
        if self.video_mode(visual_input) == "video":
            return [{"type": "video"}]
        return [{"type": "image"} for _ in visual]

    def _eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        gen = getattr(self.model, "generation_config", None)
        extra = getattr(gen, "eos_token_id", None)
        ids.update(extra if isinstance(extra, (list, tuple)) else [extra])
        return {int(i) for i in ids if i is not None}

    def _adds_special(self, chat: str) -> bool:
        # Templates that write the BOS themselves must not get a second one from the tokenizer.
        bos = self.tokenizer.bos_token
        return not (bos and chat.startswith(bos))

    def label_table(self, labels: Sequence[str]) -> Tensor:
        """(variants, K) token ids of the labels: the bare form ("0") first, then space-prefixed forms
        ("▁0", "Ġ0") where the tokenizer has them for every label. Raises if a label is not one token."""
        unk = self.tokenizer.unk_token_id
        rows = []
        for prefix in ("", "▁", "Ġ"):
            ids = [self.tokenizer.convert_tokens_to_ids(prefix + label) for label in labels]
            ok = all(
                i is not None and i != unk and 0 <= i < self.vocab_size
                and self.tokenizer.decode([i]).strip() == label
                for i, label in zip(ids, labels)
            )
            if ok and ids not in rows:
                rows.append(ids)
        if not rows or rows[0] != [self.tokenizer.convert_tokens_to_ids(label) for label in labels]:
            missing = [label for label in labels if len(self.tokenizer.encode(label, add_special_tokens=False)) > 1]
            raise ValueError(f"the tokenizer of this judge has no single token for the labels {missing or labels}")
        return torch.tensor(rows, dtype=torch.long)

    def lm_head_rows(self, token_ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """The LM head's rows ``V`` (..., d) and bias (..., or None) for ``token_ids``, float32 on
        :attr:`device`: the logits of those tokens are ``h @ V.T + bias`` for a final hidden state ``h`` from
        :class:`JudgeOutput`. A head offloaded to CPU memory or disk (its weight is on the meta device between
        forward passes) is loaded for the read, as its own forward pass would."""
        with torch.no_grad(), _onloaded(self.head):
            weight, bias = self.head.weight, getattr(self.head, "bias", None)
            ids = token_ids.to(weight.device)
            rows = weight[ids].float().to(self.device)
            return rows, None if bias is None else bias[ids].float().to(self.device)

    # -- scoring --

    @torch.inference_mode()
    def judge(
        self,
        images: Sequence[Any],
        image_index: Sequence[int] | Tensor,
        instructions: Sequence[str],
        scale: RatingScale,
        *,
        max_new_tokens: int = 10,
        batch_size: int = 64,
        forced: Sequence[str | None] | None = None,
        keep_hidden: bool = True,
        visual_input: VisualInput = VisualInput(),
    ) -> JudgeOutput:
        """Answer every instruction about its image (``images[image_index[i]]``) greedily and read the score.

        ``forced`` (optional, per sample) replaces generation by teacher forcing: that answer is fed token by
        token and read as if the model had written it (the answer ends with it). Samples are processed in
        chunks of ``batch_size`` in the given order (keep the candidates of an image together: their prefix
        is shared within a chunk); a chunk that runs out of memory is split in halves. An image may be a
        video (a list of frames), fed as ``visual_input`` says. The last answers are kept
        (:mod:`~capeval_plugins.core.shared_results`): the same call again, by content, returns them (the
        output is shared: treat it as read-only)."""
        n = len(instructions)
        index = _check_index(image_index, n)
        if max_new_tokens < 1 or batch_size < 1:
            raise ValueError("max_new_tokens and batch_size must be at least 1")
        table = self.label_table(scale.labels)
        if n == 0:
            return _empty_output(table, len(scale.labels), len(scale.positions))

        def answer() -> JudgeOutput:
            run = self._prepare(images, index, list(instructions), forced, scale, max_new_tokens, keep_hidden,
                                visual_input)
            parts = list(self._chunks(run, batch_size, lambda rows: self._run_chunk(run, rows, table)))
            return _cat_outputs(parts, table)

        # FLEUR and DISCODE of one pass ask the same questions of the same judge: answered once (an answer
        # kept with its hidden states serves a call without them)
        key = shared_results.digest("judge", images, index, list(instructions), scale, max_new_tokens, batch_size,
                                    None if forced is None else list(forced), visual_input)
        return self.results.get(key, answer, lambda out: out.hidden is not None or not keep_hidden)

    def prompt_end(
        self,
        images: Sequence[Any],
        image_index: Sequence[int] | Tensor,
        instructions: Sequence[str],
        labels: Sequence[str],
        *,
        batch_size: int = 64,
        grad: bool = False,
        visual_input: VisualInput = VisualInput(),
    ) -> PromptEnd:
        """One forward pass per sample, no decoding: the final hidden state at the end of each prompt and the
        label log-probabilities there (:class:`PromptEnd`), batched and with each image's prefix shared as in
        :meth:`judge`. ``grad=True`` runs under autograd (for fine-tuning; the out-of-memory retry then keeps
        the graphs of the chunks already done)."""
        n = len(instructions)
        index = _check_index(image_index, n)
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        table = self.label_table(labels)
        with torch.enable_grad() if grad else torch.inference_mode():
            if n == 0:
                d, k = int(self.head.weight.shape[1]), len(labels)
                return PromptEnd(torch.zeros((0, d), device=self.device), torch.zeros((0, k), device=self.device))
            run = self._prepare(images, index, list(instructions), None, None, 1, True, visual_input)
            parts = list(self._chunks(run, batch_size, lambda rows: self._end_chunk(run, rows, table)))
            return PromptEnd(torch.cat([p.hidden for p in parts]), torch.cat([p.label_logprobs for p in parts]))

    def _prepare(self, images, index, instructions, forced, scale, max_new_tokens, keep_hidden,
                 visual_input: VisualInput = VisualInput()) -> _Run:
        chats = [self.chat(text, images[g], visual_input) for text, g in zip(instructions, index)]
        special = self._adds_special(chats[0])
        text_ids = self.tokenizer(chats, add_special_tokens=special)["input_ids"]
        work = {}
        for i, g in enumerate(index):
            if g not in work:  # the processor (image preprocessing) runs once per distinct image
                work[g] = self._encode_image(images[g], chats[i], len(text_ids[i]), i, special, visual_input)
        forced_ids: list[list[int] | None] = [None] * len(chats)
        if forced is not None:
            if len(forced) != len(chats):
                raise ValueError(f"{len(forced)} forced answers for {len(chats)} instructions")
            forced_ids = [None if f is None else self.tokenizer(f, add_special_tokens=False)["input_ids"]
                          for f in forced]
            if any(f is not None and not f for f in forced_ids):
                raise ValueError("a forced answer is empty")
        return _Run(text_ids, index, work, forced_ids, scale, max_new_tokens, keep_hidden)

    def _encode_image(self, image, chat: str, text_len: int, rep: int, special: bool,
                      visual_input: VisualInput = VisualInput()) -> _ImageWork:
        enc = self.processor(text=[chat], return_tensors="pt", add_special_tokens=special,
                             **self._visual_kwargs(image, visual_input))
        ids = enc["input_ids"][0]
        tokens = {k: v[0] for k, v in enc.items() if k in TOKEN_KEYS and k not in ("input_ids", "attention_mask")}
        if self.rope_index is not None and "mm_token_type_ids" not in tokens:
            tokens["mm_token_type_ids"] = self._mm_token_types(ids)
        vision = {k: v for k, v in enc.items() if k not in TOKEN_KEYS and isinstance(v, Tensor)}
        if "second_per_grid_ts" in enc:  # Qwen2.5-VL video: seconds per temporal patch, a list
            vision["second_per_grid_ts"] = torch.as_tensor(enc["second_per_grid_ts"], dtype=torch.float32).reshape(-1)
        return _ImageWork(rep, ids, tokens, vision, len(ids) - text_len)

    def _visual_kwargs(self, visual: Any, visual_input: VisualInput) -> dict[str, Any]:
        """The processor's visual arguments for one image or video."""
        if not is_video(visual):
            return {"images": [self._shaped(visual, visual_input)]}
        frames = list(visual)
        if self.video_mode(visual_input) == "frames":
            return {"images": [self._shaped(f, visual_input) for f in frames]}
        kwargs: dict[str, Any] = {"videos": [frames], "do_sample_frames": False}  # the frames as given
        if visual_input.fps is not None:
            kwargs["video_metadata"] = [{"total_num_frames": len(frames), "fps": visual_input.fps,
                                         "frames_indices": list(range(len(frames)))}]
        return kwargs

    def _shaped(self, image: Any, visual_input: VisualInput) -> Any:
        """The image as the processor gets it: as given (``"crop"``) or padded to a square (``"pad"``)."""
        if visual_input.image_aspect == "crop":
            return image
        mean = getattr(getattr(self.processor, "image_processor", None), "image_mean", None)
        if mean is None:
            raise ValueError("image_aspect='pad' pads with the image processor's mean colour, but this processor "
                             "has no image_mean; use image_aspect='crop'")
        return pad_to_square(image, mean)

    def _mm_token_types(self, ids: Tensor) -> Tensor:
        # What Qwen-VL processors return: 1 on image tokens, 2 on video tokens, 0 on text.
        config = self.model.config
        types = torch.zeros_like(ids)
        for value, name in ((1, "image_token_id"), (2, "video_token_id")):
            token = getattr(config, name, None)
            if token is not None:
                types[ids == token] = value
        return types

    def _chunks(self, run: _Run, batch_size: int, process: Callable[[list[int]], Any]) -> Iterator[Any]:
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

    def _split(self, run: _Run, rows: list[int]) -> tuple[list[int], list[int], list[int]]:
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

    def _check_cut(self, work: _ImageWork, rep_ids: list[int], cut: int) -> None:
        if any(t is not None and t in rep_ids[cut:] for t in (self.image_token_id, self.video_token_id)):
            raise ValueError("this chat template puts the image after text that differs between candidates; "
                             "the judge needs the image first")
        tail = work.ids[cut + work.shift:].tolist()
        if cut + work.shift < 0 or tail != rep_ids[cut:]:
            raise ValueError("the processor's tokenisation of the prompt differs from the tokenizer's beyond the "
                             "image tokens; this processor is not supported")

    def _run_chunk(self, run: _Run, rows: list[int], table: Tensor) -> JudgeOutput:
        return self._decode(run, rows, table, *self._prefill(run, rows))

    def _end_chunk(self, run: _Run, rows: list[int], table: Tensor) -> PromptEnd:
        cache, ids, mask, positions = self._prefill(run, rows)
        logits, h = self._forward_step(ids, mask, positions, cache)
        return PromptEnd(h, torch.log_softmax(logits, dim=-1)[:, table[0].to(self.device)])

    def _prefill(self, run: _Run, rows: list[int]) -> tuple[Any, Tensor, Tensor, Tensor]:
        """The chunk's shared prefixes through the model, their caches copied to each sample: (cache, suffix
        ids, attention mask over prefix + suffix, suffix positions), ready for the first forward step."""
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
        return cache, suf_ids, mask, positions

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

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

    def _forward_step(self, ids: Tensor, mask: Tensor, positions: Tensor, cache: Any) -> tuple[Tensor, Tensor]:
        """(logits, final hidden state) at the last position, float32, gathered on :attr:`device` (a dispatched
        model computes its last layers and head elsewhere)."""
        dev = self.device
        with self._capture_hidden() as seen:
            out = self.model(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                             position_ids=self._step_positions(positions).to(dev), use_cache=True,
                             logits_to_keep=1, **{self.cache_arg: cache})
        return out.logits[:, -1].float().to(dev), seen[-1].float().to(dev)

    def _decode(self, run: _Run, rows: list[int], table: Tensor, cache: Any, ids: Tensor, mask: Tensor,
                positions: Tensor) -> JudgeOutput:
        """Greedy answers from raw logits, one step per token, finished samples leaving the batch."""
        forced = [run.forced[r] for r in rows]
        b, k = len(rows), table.shape[1]
        budget = max([run.max_new_tokens] + [len(f) for f in forced if f is not None])
        forced_ids = torch.full((b, budget), -1, dtype=torch.long)
        for i, f in enumerate(forced):
            if f is not None:
                forced_ids[i, : len(f)] = torch.tensor(f)
        tokens = torch.full((b, budget), -1, dtype=torch.long)
        logprobs = torch.full((b, budget, k), float("nan"))
        variants = torch.zeros((b, budget), dtype=torch.long)
        hidden: Tensor | None = None
        ends = np.zeros((b, budget), dtype=np.int64)
        texts = [""] * b
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long)
        table_dev = table.to(self.device)
        active = torch.arange(b)
        logits, h = self._forward_step(ids, mask, positions, cache)
        step = 0
        while True:
            teacher = forced_ids[active, step]
            chosen = torch.where(teacher >= 0, teacher, logits.argmax(-1).cpu())
            logp = torch.log_softmax(logits, dim=-1)
            forms = logp[:, table_dev]  # (A, variants, K)
            form = (chosen.to(self.device)[:, None, None] == table_dev).any(-1).float().argmax(-1)
            logprobs[active, step] = forms[torch.arange(len(active), device=self.device), form].cpu()
            variants[active, step] = form.cpu()
            tokens[active, step] = chosen
            if run.keep_hidden:
                if hidden is None:
                    hidden = torch.full((b, budget, h.shape[-1]), float("nan"))
                hidden[active, step] = h.cpu()
            done = self._finished(run, texts, ends, tokens, active, step, chosen, eos, forced)
            keep = ~done
            if step + 1 == budget or not bool(keep.any()):
                break
            active = active[keep]
            cache.batch_select_indices(keep.nonzero()[:, 0].to(self.index_device))
            mask = torch.cat([mask[keep], torch.ones((len(active), 1), dtype=mask.dtype)], dim=1)
            positions = positions[keep][:, -1:] + 1
            logits, h = self._forward_step(chosen[keep][:, None], mask, positions, cache)
            step += 1
        return self._read(run, rows, tokens, logprobs, variants, table, hidden, ends, texts)

    def _finished(self, run, texts, ends, tokens, active, step, chosen, eos, forced) -> Tensor:
        """Update the answers of the active rows and say which are complete."""
        act = active.tolist()
        decoded = self.tokenizer.batch_decode([tokens[r, : step + 1].tolist() for r in act], skip_special_tokens=True)
        done = torch.isin(chosen, eos)
        for j, (r, text) in enumerate(zip(act, decoded)):
            texts[r] = text
            ends[r, step] = len(text)
            if forced[r] is not None:
                done[j] = step + 1 >= len(forced[r])
            elif run.scale.complete(text):
                done[j] = True
        return done

    def _read(self, run, rows, tokens, logprobs, variants, table, hidden, ends, texts) -> JudgeOutput:
        """Parse each answer and find the steps that hold its score's label characters."""
        b, p = len(rows), len(run.scale.positions)
        raw = torch.full((b,), float("nan"), dtype=torch.float64)
        positions = torch.full((b, p), -1, dtype=torch.long)
        labels = torch.full((b, p), -1, dtype=torch.long)
        errors: list[str | None] = [None] * b
        n_steps = int((tokens >= 0).sum(1).max())
        for i in range(b):
            parsed = run.scale.parse(texts[i])
            if isinstance(parsed, str):
                errors[i] = parsed
                continue
            n = int((tokens[i] >= 0).sum())
            steps = np.searchsorted(ends[i, :n], parsed.chars, side="right")
            bad = [c for c, s in zip(parsed.chars, steps) if c >= 0 and (
                s >= n or self.tokenizer.decode([int(tokens[i, s])]).strip() != texts[i][c])]
            if bad:
                errors[i] = f"the score character {texts[i][bad[0]]!r} is not a token of its own"
                continue
            raw[i] = parsed.value
            positions[i] = torch.tensor([int(s) if c >= 0 else -1 for c, s in zip(parsed.chars, steps)])
            labels[i] = torch.tensor(parsed.labels)
        return JudgeOutput(
            texts=texts, tokens=tokens[:, :n_steps], label_logprobs=logprobs[:, :n_steps],
            label_variant=variants[:, :n_steps], label_table=table,
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


@contextmanager
def _onloaded(module: torch.nn.Module) -> Iterator[None]:
    """``module``'s own weights readable for the duration: a module that accelerate offloaded (weights on the
    meta device, loaded by a hook around each forward pass) is loaded to its execution device by that hook."""
    if getattr(module, "_hf_hook", None) is None or all(p.device.type != "meta" for p in module.parameters()):
        yield
        return
    from accelerate.utils import align_module_device  # present: its hooks are on the module

    with align_module_device(module):
        yield


def _empty_output(table: Tensor, k: int, p: int) -> JudgeOutput:
    return JudgeOutput([], torch.zeros((0, 0), dtype=torch.long), torch.zeros((0, 0, k)),
                       torch.zeros((0, 0), dtype=torch.long), table, None,
                       torch.zeros(0, dtype=torch.float64), torch.zeros((0, p), dtype=torch.long),
                       torch.zeros((0, p), dtype=torch.long), [])


def _check_index(image_index: Sequence[int] | Tensor, n: int) -> list[int]:
    index = [int(i) for i in (image_index.tolist() if isinstance(image_index, Tensor) else image_index)]
    if len(index) != n:
        raise ValueError(f"{len(index)} image indices for {n} instructions")
    return index


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
