"""A batched LVLM judge: (image, instruction) -> the score it writes and the distributions behind it.

FLEUR and DISCODE (and Rigel) all read a score that an LVLM writes and the distribution of the label tokens at
that position. :class:`LVLMJudge` does the model work once for all of them:

* **Prompt** (:mod:`~capeval_plugins.core.lvlm_prompts`): one image, then the instruction, inside the
  processor's chat template (:class:`ChatTemplate`), with the generation prompt; :func:`fleur_instruction`
  writes the FLEUR / RefFLEUR instruction for any :class:`RatingScale`. An optional system prompt goes into
  the template's system turn, or, for templates without one, before the instruction in the user turn
  (:class:`VisualInput`); images may be padded to a square first, as LLaVA's ``image_aspect_ratio="pad"``
  does.
* **Shared prefix** (:mod:`~capeval_plugins.models.lvlm_decode`, the judge's base :class:`PrefixDecoder`): the
  candidates of one image share the image and everything of the prompt before the caption. That prefix
  (vision encoder included) runs once per image and chunk; its key/value cache is copied to each candidate,
  and only the candidate-specific suffixes run per sample. Padding between prefix and suffix is masked and
  positions are recomputed, so the numbers equal those of a one-prompt forward pass up to float rounding,
  whatever the batch size, padding or composition.
* **Greedy decoding from raw logits**: the next token is the argmax of the model's logits (no generation
  config, no logits processors, no sampling); the label log-probabilities are a log-softmax (computed in
  float64) over the model's output vocabulary: every row of the LM head (a conversion's padded rows
  included), or its first ``vocab_rows`` (the vocabulary the original checkpoint was trained with:
  LLaVA-1.5's 32,000 of the 32,064 rows of ``llava-hf/llava-1.5-*-hf``), over which the next token is chosen
  too. A sample stops as soon as its score is written (:meth:`RatingScale.complete`), at an end-of-sequence
  token, or at the token budget; finished samples leave the batch.
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

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from capeval_plugins.core import shared_results
from capeval_plugins.resources import loading
from capeval_plugins.resources.accelerate_internals import dispatch_hook
from capeval_plugins.models.lvlm_decode import (ImageWork, JudgeOutput, JudgeRun, PrefixDecoder, PromptEnd,
                                                cache_argument, cat_outputs, empty_output)
from capeval_plugins.core.lvlm_prompts import (IMAGE_ASPECTS, LLAVA_CONVERSATIONS, LLAVA_IMAGE, LLAVA_V1_SYSTEM,
                                               SCALES, SYSTEM_PLACEMENTS, TEMPLATES, VIDEO_INPUTS, ChatTemplate,
                                               KeywordStop, LlavaConversation, ParsedScore, RatingScale,
                                               VisualInput, fleur_instruction, get_scale, is_video,
                                               normalise_space, pad_to_square)
from capeval_plugins.core.messages import MissingExtra, install_extra

__all__ = ["IMAGE_ASPECTS", "LLAVA_CONVERSATIONS", "LLAVA_IMAGE", "LLAVA_V1_SYSTEM", "SCALES", "SYSTEM_PLACEMENTS",
           "TEMPLATES", "VIDEO_INPUTS", "ChatTemplate", "JudgeOutput", "JudgeSpec", "KeywordStop", "LVLMJudge",
           "LlavaConversation", "ParsedScore", "PromptEnd", "RatingScale", "VisualInput", "cache_argument",
           "fleur_instruction", "get_scale", "is_video", "load_lvlm_processor", "normalise_space", "pad_to_square"]

# Token-level processor outputs (one value per token): padded with the ids, sliced with the prefix.
TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")

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


class LVLMJudge(PrefixDecoder):
    """A loaded LVLM (model + processor) used as a greedy judge; see the module docstring.

    Build with :meth:`shared` (through :mod:`capeval_plugins.resources.loading`: hub id or local path, safetensors,
    device and dtype chosen once: bfloat16 on GPU, float32 on CPU) or directly from a model and a processor.

    The model may be dispatched by accelerate (a ``device_map``: layers on several GPUs, or offloaded to CPU
    memory or disk). ``device`` (:func:`loading.input_device`: by default where the input embeddings compute)
    is then where inputs start and where logits, hidden states and LM-head rows are gathered; the key/value
    cache of each layer stays on that layer's device."""

    def __init__(self, model: Any, processor: Any, device: str | torch.device | None = None):
        tokenizer = getattr(processor, "tokenizer", processor)
        image_token = getattr(processor, "image_token", None)
        video_token = getattr(processor, "video_token", None)
        super().__init__(model, tokenizer, device, (
            tokenizer.convert_tokens_to_ids(image_token) if image_token else None,
            tokenizer.convert_tokens_to_ids(video_token) if video_token else None))
        self.processor = processor
        self.template = ChatTemplate(processor)
        self.vocab_size = int(self.head.weight.shape[0])
        self.results = shared_results.Results()  # metrics asking this judge the same questions run it once

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
        """:meth:`ChatTemplate.chat`: the prompt for ``instruction`` about ``visual``, ready to answer."""
        return self.template.chat(instruction, visual, visual_input)

    def system_placement(self, system_prompt: str, placement: str = "auto") -> str:
        """``"system"`` or ``"user"``: where :meth:`chat` puts ``system_prompt`` under ``placement``."""
        return self.template.system_placement(system_prompt, placement)

    def video_mode(self, visual_input: VisualInput) -> str:
        """``"video"`` or ``"frames"``: how this judge feeds a video under ``visual_input``."""
        return self.template.video_mode(visual_input)

    @property
    def is_llava15(self) -> bool:
        """Whether this is a LLaVA-1.5 checkpoint in the transformers layout (``llava``: one CLIP tile projected
        into a Llama text model, e.g. ``llava-hf/llava-1.5-13b-hf``): the family LLaVA's own ``llava_v1``
        conversation and ``tokenizer_image_token`` serve in FLEUR's official script."""
        config = self.model.config
        text = getattr(config, "text_config", None)
        return getattr(config, "model_type", None) == "llava" and getattr(text, "model_type", None) == "llama"

    @property
    def base_vocab_size(self) -> int:
        """The tokenizer's base vocabulary (without tokens added to it): for a transformers conversion of LLaVA,
        the rows the original checkpoint's LM head had (32,000 for LLaVA-1.5), before the conversion added
        ``<image>``, ``<pad>`` and padding rows (to 32,064)."""
        return min(int(self.tokenizer.vocab_size), self.vocab_size)

    def _adds_special(self, chat: str) -> bool:
        return self.template.adds_special(chat)

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
        stop: KeywordStop | None = None,
        vocab_rows: int | None = None,
    ) -> JudgeOutput:
        """Answer every instruction about its image (``images[image_index[i]]``) greedily and read the score.

        ``forced`` (optional, per sample) replaces generation by teacher forcing: that answer is fed token by
        token and read as if the model had written it (the answer ends with it). ``stop`` (optional) makes the
        answers free text: each ends where the rule says (or at an end-of-sequence token, or the budget), and no
        score is parsed (``raw`` NaN, no errors): read ``tokens`` and ``label_logprobs``, which hold the scale's
        labels at every step. ``vocab_rows``: the next token and the log-softmax are taken over the LM head's
        first ``vocab_rows`` rows only (the vocabulary the checkpoint was trained with, without rows a
        conversion added after it); None: every row. Samples are processed in
        chunks of ``batch_size`` in the given order (keep the candidates of an image together: their prefix
        is shared within a chunk); a chunk that runs out of memory is split in halves. An image may be a
        video (a list of frames), fed as ``visual_input`` says. The last answers are kept
        (:mod:`~capeval_plugins.core.shared_results`): the same call again, by content, returns them (the
        output is shared: treat it as read-only)."""
        n = len(instructions)
        index = _check_index(image_index, n)
        if max_new_tokens < 1 or batch_size < 1:
            raise ValueError("max_new_tokens and batch_size must be at least 1")
        if vocab_rows is not None and not 0 < vocab_rows <= self.vocab_size:
            raise ValueError(f"vocab_rows must lie in 1..{self.vocab_size}, got {vocab_rows}")
        table = self.label_table(scale.labels)
        if vocab_rows is not None and int(table.max()) >= vocab_rows:
            raise ValueError(f"the scale's label tokens lie beyond the first {vocab_rows} rows of the LM head")
        if n == 0:
            return empty_output(table, len(scale.labels), len(scale.positions))

        def answer() -> JudgeOutput:
            run = self._prepare(images, index, list(instructions), forced, scale, max_new_tokens, keep_hidden,
                                visual_input)
            run.stop, run.vocab_rows = stop, vocab_rows
            parts = list(self._chunks(run, batch_size, lambda rows: self._run_chunk(run, rows, table)))
            return cat_outputs(parts, table)

        # FLEUR and DISCODE of one pass ask the same questions of the same judge: answered once (an answer
        # kept with its hidden states serves a call without them)
        key = shared_results.digest("judge", images, index, list(instructions), scale, max_new_tokens, batch_size,
                                    None if forced is None else list(forced), visual_input, stop, vocab_rows)
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
                 visual_input: VisualInput = VisualInput()) -> JudgeRun:
        chats = [self.chat(text, images[g], visual_input) for text, g in zip(instructions, index)]
        special = self._adds_special(chats[0])
        if visual_input.template == "llava":
            text_ids = [self._llava_ids(chat) for chat in chats]
        else:
            text_ids = self.tokenizer(chats, add_special_tokens=special)["input_ids"]
        work = {}
        for i, g in enumerate(index):
            if g not in work:  # the processor (image preprocessing) runs once per distinct image
                if visual_input.template == "llava":
                    work[g] = self._encode_llava_image(images[g], text_ids[i], i, visual_input)
                else:
                    work[g] = self._encode_image(images[g], chats[i], len(text_ids[i]), i, special, visual_input)
        forced_ids: list[list[int] | None] = [None] * len(chats)
        if forced is not None:
            if len(forced) != len(chats):
                raise ValueError(f"{len(forced)} forced answers for {len(chats)} instructions")
            forced_ids = [None if f is None else self.tokenizer(f, add_special_tokens=False)["input_ids"]
                          for f in forced]
            if any(f is not None and not f for f in forced_ids):
                raise ValueError("a forced answer is empty")
        return JudgeRun(text_ids, index, work, forced_ids, scale, max_new_tokens, keep_hidden)

    def _encode_image(self, image, chat: str, text_len: int, rep: int, special: bool,
                      visual_input: VisualInput = VisualInput()) -> ImageWork:
        enc = self.processor(text=[chat], return_tensors="pt", add_special_tokens=special,
                             **self._visual_kwargs(image, visual_input))
        ids = enc["input_ids"][0]
        tokens = {k: v[0] for k, v in enc.items() if k in TOKEN_KEYS and k not in ("input_ids", "attention_mask")}
        if self.rope_index is not None and "mm_token_type_ids" not in tokens:
            tokens["mm_token_type_ids"] = self._mm_token_types(ids)
        vision = {k: v for k, v in enc.items() if k not in TOKEN_KEYS and isinstance(v, Tensor)}
        if "second_per_grid_ts" in enc:  # Qwen2.5-VL video: seconds per temporal patch, a list
            vision["second_per_grid_ts"] = torch.as_tensor(enc["second_per_grid_ts"], dtype=torch.float32).reshape(-1)
        return ImageWork(rep, ids, tokens, vision, len(ids) - text_len)

    def _image_token(self) -> tuple[str, int]:
        token = getattr(self.processor, "image_token", None)
        if not token or self.image_token_id is None:
            raise ValueError("template='llava' needs a processor with an image token (a LLaVA checkpoint)")
        return token, self.image_token_id

    def _llava_ids(self, prompt: str) -> list[int]:
        """``prompt`` (written with :data:`LLAVA_IMAGE`) tokenised as LLaVA's ``tokenizer_image_token`` does:
        each piece around the image on its own with the special tokens; one BOS kept, at the front; the image as
        the processor's one image token (expanded by :meth:`_encode_llava_image`)."""
        pieces = [list(self.tokenizer(piece)["input_ids"]) for piece in prompt.split(LLAVA_IMAGE)]
        bos = self.tokenizer.bos_token_id
        head = 1 if pieces[0] and bos is not None and pieces[0][0] == bos else 0
        ids = pieces[0][:head]
        for k, piece in enumerate(pieces):
            ids += ([self._image_token()[1]] if k else []) + piece[head:]
        return ids

    def _encode_llava_image(self, image: Any, text_ids: list[int], rep: int, visual_input: VisualInput) -> ImageWork:
        """The processor's pixels for ``image`` and its run of image tokens, spliced into LLaVA's tokenisation of
        the prompt in place of its one image token."""
        token, token_id = self._image_token()
        enc = self.processor(text=[token], return_tensors="pt", **self._visual_kwargs(image, visual_input))
        extra = [k for k in enc if k in TOKEN_KEYS and k not in ("input_ids", "attention_mask")]
        if extra or self.rope_index is not None:
            raise ValueError("template='llava' needs a processor whose only token-level output is the input ids "
                             f"(a LLaVA checkpoint); this one also gives {extra or 'multimodal positions'}")
        run = int((enc["input_ids"][0] == token_id).sum())
        at = text_ids.index(token_id)
        ids = torch.tensor(text_ids[:at] + [token_id] * run + text_ids[at + 1:], dtype=torch.long)
        vision = {k: v for k, v in enc.items() if k not in TOKEN_KEYS and isinstance(v, Tensor)}
        return ImageWork(rep, ids, {}, vision, run - 1)

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
        import numpy as np
        from PIL import Image

        square = pad_to_square(image, mean)
        # as LLaVA's expand2square hands it over, a PIL image: an (S, S, C) array with S of 1, 3 or 4 is read by
        # the processor as channels first (a 4 x 4 image scored as another)
        return Image.fromarray(square) if square.dtype == np.uint8 else square

    def _mm_token_types(self, ids: Tensor) -> Tensor:
        # What Qwen-VL processors return: 1 on image tokens, 2 on video tokens, 0 on text.
        config = self.model.config
        types = torch.zeros_like(ids)
        for value, name in ((1, "image_token_id"), (2, "video_token_id")):
            token = getattr(config, name, None)
            if token is not None:
                types[ids == token] = value
        return types



@contextmanager
def _onloaded(module: torch.nn.Module) -> Iterator[None]:
    """``module``'s own weights readable for the duration: a module that accelerate offloaded (weights on the
    meta device, loaded by a hook around each forward pass) is loaded to its execution device by that hook."""
    if dispatch_hook(module) is None or all(p.device.type != "meta" for p in module.parameters()):
        yield
        return
    from accelerate.utils import align_module_device  # present: its hooks are on the module

    with align_module_device(module):
        yield


def _check_index(image_index: Sequence[int] | Tensor, n: int) -> list[int]:
    index = [int(i) for i in (image_index.tolist() if isinstance(image_index, Tensor) else image_index)]
    if len(index) != n:
        raise ValueError(f"{len(index)} image indices for {n} instructions")
    return index
