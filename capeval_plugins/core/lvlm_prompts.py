"""What an LVLM judge is asked and how its answer is read: rating scales, the FLEUR instruction, the visual input
and the chat template around the instruction (:class:`ChatTemplate`). No model here: the judge
(:mod:`capeval_plugins.models.lvlm`) tokenises what these build and decodes (:mod:`capeval_plugins.models.lvlm_decode`)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

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


# --- the visual and the conversation around the instruction ------------------------------------------------

VIDEO_INPUTS = ("auto", "video", "frames")
SYSTEM_PLACEMENTS = ("auto", "system", "user")
IMAGE_ASPECTS = ("crop", "pad")
TEMPLATES = ("chat", "llava")
LLAVA_IMAGE = "<image>"  # LLaVA's DEFAULT_IMAGE_TOKEN: where the image goes in a prompt written LLaVA's way
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
    ``image_aspect_ratio="pad"``. Videos through a video processor are not padded.

    ``template``: ``"chat"`` puts the instruction into the processor's chat template; ``"llava"`` takes the
    instruction as the whole prompt, written in one of LLaVA's own conversations (:class:`LlavaConversation`,
    the image as :data:`LLAVA_IMAGE`), and tokenises it as LLaVA's ``tokenizer_image_token`` does: the text on
    each side of the image tokenised on its own, the first piece with the tokenizer's special tokens, the
    others without their first token (the BOS). (With a SentencePiece tokenizer the piece after the image then
    starts with the dummy-prefix token "▁", which a chat template's one-string tokenisation does not write.)
    The system prompt is then part of the conversation: ``system_prompt`` must be None."""

    video: str = "auto"
    fps: float | None = 2.0
    answer_prefix: str = ""
    system_prompt: str | None = None
    system_placement: str = "auto"
    image_aspect: str = "crop"
    template: str = "chat"

    def __post_init__(self) -> None:
        if self.video not in VIDEO_INPUTS:
            raise ValueError(f"video input must be one of {VIDEO_INPUTS}, got {self.video!r}")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"fps must be positive, got {self.fps}")
        if self.system_placement not in SYSTEM_PLACEMENTS:
            raise ValueError(f"system_placement must be one of {SYSTEM_PLACEMENTS}, got {self.system_placement!r}")
        if self.image_aspect not in IMAGE_ASPECTS:
            raise ValueError(f"image_aspect must be one of {IMAGE_ASPECTS}, got {self.image_aspect!r}")
        if self.template not in TEMPLATES:
            raise ValueError(f"template must be one of {TEMPLATES}, got {self.template!r}")
        if self.template == "llava" and self.system_prompt:
            raise ValueError("a prompt written in LLaVA's conversation holds its own system sentence: "
                             "system_prompt must be None with template='llava'")


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


class ChatTemplate:
    """A processor's chat template around one instruction: the image (or video) first, then the text, after the
    system prompt where :class:`VisualInput` has one, with the generation prompt."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self._system_turns: dict[str, dict | None] = {}  # system prompt -> the system turn the template takes

    def chat(self, instruction: str, visual: Any = None, visual_input: VisualInput = VisualInput()) -> str:
        """One user turn (an image, then ``instruction``) in the processor's chat template, ready to answer,
        after the system prompt if :class:`VisualInput` has one (see there for where it goes). With ``visual``
        a video (a list of frames), the video or its frames take the image's place; ``answer_prefix`` ends the
        text. With ``template="llava"`` the instruction is the prompt (see :class:`VisualInput`)."""
        if visual_input.template == "llava":
            if is_video(visual) or instruction.count(LLAVA_IMAGE) != (visual is not None):
                raise ValueError(f"a prompt in LLaVA's conversation holds one image, as {LLAVA_IMAGE!r}, once")
            return instruction + visual_input.answer_prefix
        system = visual_input.system_prompt
        where = self.system_placement(system, visual_input.system_placement) if system else None
        text = f"{system}\n\n{instruction}" if where == "user" else instruction
        content = self._visual_content(visual, visual_input) + [{"type": "text", "text": text}]
        messages = [{"role": "user", "content": content}]
        if where == "system":
            messages.insert(0, self._system_turns[system])
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

    def video_mode(self, visual_input: VisualInput) -> str:
        """``"video"`` or ``"frames"``: how a video enters the prompt under ``visual_input``."""
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

    def adds_special(self, chat: str) -> bool:
        """Whether the tokenizer should add its special tokens to ``chat``: templates that write the BOS
        themselves must not get a second one."""
        bos = self.tokenizer.bos_token
        return not (bos and chat.startswith(bos))


# --- LLaVA's own conversations and its stop rule -------------------------------------------------------------

@dataclass(frozen=True)
class LlavaConversation:
    """One of LLaVA's conversation templates (``llava/conversation.py`` of haotian-liu/LLaVA), rendered as its
    ``get_prompt`` renders it: ``"single"`` style (``llava_v0``: ``{system}###Human: {m}###Assistant: {a}###...``)
    or ``"two"`` (``llava_v1``: ``{system} USER: {m} ASSISTANT: {a}</s>USER: ...``). The image goes before the
    first user message, as ``"<image>\\n" + message``. An answer to come is left open (``"Assistant:"``)."""

    name: str
    system: str
    roles: tuple[str, str]
    sep: str
    sep2: str | None = None

    @property
    def stop(self) -> str:
        """The string LLaVA's scripts stop generation at: ``sep`` for the single style, ``sep2`` for two."""
        return self.sep if self.sep2 is None else self.sep2

    def prompt(self, turns: Sequence[tuple[str, str | None]], image: bool = True) -> str:
        """``turns``: (user message, assistant answer or None for the one to come), in order."""
        seps = (self.sep, self.sep if self.sep2 is None else self.sep2)
        out = self.system + seps[0]
        messages = []
        for k, (user, answer) in enumerate(turns):
            messages += [(self.roles[0], f"{LLAVA_IMAGE}\n{user}" if image and k == 0 else user),
                         (self.roles[1], answer)]
        for i, (role, message) in enumerate(messages):
            out += f"{role}: {message}{seps[i % 2]}" if message else f"{role}:"
        return out


LLAVA_V0_SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. "
                   "The assistant gives helpful, detailed, and polite answers to the human's questions.")
LLAVA_CONVERSATIONS: dict[str, LlavaConversation] = {
    "llava_v0": LlavaConversation("llava_v0", LLAVA_V0_SYSTEM, ("Human", "Assistant"), "###"),
    "llava_v1": LlavaConversation("llava_v1", LLAVA_V0_SYSTEM, ("USER", "ASSISTANT"), " ", "</s>"),
}


@dataclass(frozen=True)
class KeywordStop:
    """LLaVA's ``KeywordsStoppingCriteria`` as its scripts run it under transformers 4.37 (where ``generate``
    from input embeddings returns the BOS, then the new tokens): after each new token, stop when the output
    ``[BOS] + answer`` ends with a keyword's token ids (the keyword tokenised alone, without its BOS), or when
    a keyword is in the decoded window ``output[-offset:]``, ``offset = min(len(output) - prompt_len,
    longest keyword's ids)``. ``prompt_len`` is the prompt's length in LLaVA's tokens (the image one token), so
    until the answer is about half the prompt long that window starts from the front or is empty: the rule as
    the scripts apply it, quirk included. Build with :meth:`build`."""

    keywords: tuple[str, ...]
    keyword_ids: tuple[tuple[int, ...], ...]
    bos_id: int

    @classmethod
    def build(cls, keywords: Sequence[str], tokenizer: Any) -> "KeywordStop":
        ids = []
        for keyword in keywords:
            found = list(tokenizer(keyword)["input_ids"])
            if len(found) > 1 and found[0] == tokenizer.bos_token_id:
                found = found[1:]
            ids.append(tuple(int(i) for i in found))
        bos = tokenizer.bos_token_id
        return cls(tuple(keywords), tuple(ids), int(bos) if bos is not None else -1)

    def done(self, tokenizer: Any, prompt_len: int, answer_ids: Sequence[int]) -> bool:
        output = [self.bos_id, *answer_ids]
        longest = max((len(k) for k in self.keyword_ids), default=0)
        if any(k and tuple(output[-len(k):]) == k for k in self.keyword_ids):
            return True
        offset = min(len(output) - prompt_len, longest)
        window = tokenizer.decode(output[-offset:], skip_special_tokens=True)
        return any(keyword in window for keyword in self.keywords)
