"""EXPERT (Kim et al., Findings of ACL 2025): a LLaVA-1.5-13B fine-tuned (LoRA) to score a caption from 0.0 to 1.0
and then explain the score along three criteria, Fluency, Relevance and Descriptiveness.

As the official ``expert.py`` (hjkim811/EXPERT) runs it, per caption: a first turn asks for the score
(:func:`scoring_prompt`); the answer is read by the script's own rule (:func:`official_score`: every digit and
dot of the answer kept, ``float`` of that, then FLEUR's smoothing at the tokens of its decimal digits, found by
token id); a second turn, with the smoothed score as the first answer in the history, asks for the explanation
(:func:`explanation_prompt`), parsed into its three parts (:func:`parse_explanation`). Both turns are LLaVA's own
conversation (``llava_v0`` as the released script's defaults select it), tokenised LLaVA's way, decoded greedily
from raw logits until LLaVA's stop rule (:class:`~capeval_plugins.models.lvlm.KeywordStop`) or the end of sequence,
the image padded to a square, float16 on GPUs. Each turn is one batched judge pass over a batch's captions (each
image's prefix shared); explanations are kept per sample (``result.extras["explanation"]`` and its parts).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np
import torch
from torch import Tensor

from capeval_plugins.contract import (TEXT_STATE, Batch, MetricInfo, MetricResult, ModelConfig, Requirement, StateSpec,
                                      bounded, decode_text_lists, encode_text_lists)
from capeval_plugins.models.lvlm import LLAVA_CONVERSATIONS, LLAVA_IMAGE, SCALES, JudgeOutput, KeywordStop, VisualInput
from capeval_plugins.metrics.fleur import INVALID_POLICIES, LVLMJudgeMetric

CITATION = """@inproceedings{kim2025expert,
  title     = {{EXPERT}: An Explainable Image Captioning Evaluation Metric with Structured Explanations},
  author    = {Kim, Hyunjong and Kim, Sangyeop and Jeong, Jongheon and Cho, Yeongjae and Cho, Sungzoon},
  booktitle = {Findings of the Association for Computational Linguistics: ACL 2025},
  year      = {2025}
}"""
CODE = "https://github.com/hjkim811/EXPERT"
# The released weights: a LoRA adapter (and the trained projector) over liuhaotian/llava-v1.5-13b, in LLaVA's
# own format; `capeval convert expert` folds them into the transformers checkpoint of the same base.
RELEASED = "hjkim811/EXPERT-llava-13b-lora"
BASE = "llava-hf/llava-1.5-13b-hf"
VOCABULARIES = ("base", "full")
CRITERIA = ("fluency", "relevance", "descriptiveness")
_EXPLANATION = re.compile(r"Fluency:\s*(.*?)\nRelevance:\s*(.*?)\nDescriptiveness:\s*(.*)", re.DOTALL)


def scoring_prompt(caption: str) -> str:
    """The first turn (``get_scoring_prompt``)."""
    return ("Evaluate the caption and assign a score on a scale of 0.0 to 1.0.\n\n"
            f"Caption: {caption}\n\nScore (0.0~1.0):")


def explanation_prompt(caption: str) -> str:
    """The second turn (``get_explanation_prompt``)."""
    return ("Provide a brief explanation for the score based on three criteria: Fluency, Relevance, and "
            f"Descriptiveness.\n\nCaption: {caption}\n\nEvaluation Criteria:\n"
            "- Fluency: Whether the caption is fluent, natural, and grammatically correct.\n"
            "- Relevance: Whether the sentence correctly describes the visual content and be closely relevant to "
            "the image.\n"
            "- Descriptiveness: Whether the sentence is a precise, informative caption that describes important "
            "details of the image.\n\nOutput Format:\nFluency: {Provide explanation here.}\n"
            "Relevance: {Provide explanation here.}\nDescriptiveness: {Provide explanation here.}")


def parse_explanation(text: str) -> dict[str, str] | None:
    """The three parts of an explanation as the official ``parse_explanation`` finds them (None: not in the
    format)."""
    match = _EXPLANATION.search(text)
    return None if match is None else {k: match.group(i + 1).strip() for i, k in enumerate(CRITERIA)}


def official_score(text: str, answer_ids: Sequence[int], digit_logprobs: Tensor,
                   digit_ids: Sequence[int]) -> float | str:
    """The score the official script reads from an answer, or why it gets none (where the script stops with an
    error or leaves the sample without a score).

    ``text``: the answer decoded (special tokens dropped); ``answer_ids``: its tokens; ``digit_logprobs`` (S, 10):
    at each answer step, the log-softmax of the logits that chose that step's token, at the digit tokens
    ``digit_ids`` (``tokenizer.encode(str(d))[-1]``). The rule, as the script applies it: keep the answer's digits
    and dots, strip dots at both ends, ``float`` it (v); outside [0, 1] there is no score. For v < 1, written back
    as ``str(v)``: the first digit after the point, d1, is looked up among the answer's tokens (its first
    occurrence; the second when d1 is 0 and it occurs more than once, the first being the integer zero), and
    score = 0.1 sum_d P(d) d there; if ``str(v)`` is longer than three characters, the digit after that, d2, is
    looked up (the second occurrence when it occurs more than once) and 0.01 sum_d P(d) d there is added. For
    v = 1: 0.9 P('0') + P('1') at the one token '1' of the answer. P: the full-vocabulary softmax."""
    numbers = re.sub(r"\.+$", "", re.sub(r"^\.+", "", re.sub(r"[^\d\.]", "", text.strip())))
    try:
        value = float(numbers)
    except ValueError:
        return "no number in the answer" if not numbers else f"{numbers!r} (its digits and dots) is not a number"
    if value < 0 or value > 1:
        return f"{numbers} is outside 0.0-1.0"
    ids = list(answer_ids)
    probs = digit_logprobs.double().exp()

    def expected_digit(step: int) -> float:
        return float((probs[step] * torch.arange(10, dtype=torch.float64)).sum())

    def step_of(digit: int, repeated: int) -> int | str:
        found = [k for k, token in enumerate(ids) if token == digit_ids[digit]]
        if not found:
            return f"the digit {digit} of {numbers} is not a token of the answer"
        return found[0] if len(found) == 1 else found[repeated]

    if value == 1.0:
        found = [k for k, token in enumerate(ids) if token == digit_ids[1]]
        if len(found) != 1:
            return f"the answer {numbers} has {len(found)} tokens '1' (the script reads exactly one)"
        return float(0.9 * probs[found[0], 0] + probs[found[0], 1])
    written = str(value)
    try:
        first = int(written[written.index(".") + 1])
    except ValueError:
        return f"{numbers} reads as {written!r}, which has no decimal digit after a point"
    step = step_of(first, 1 if first == 0 else 0)
    if isinstance(step, str):
        return step
    score = 0.1 * expected_digit(step)
    if len(written) > 3:
        try:
            second = int(written[written.index(".") + 2])
        except ValueError:
            return f"{numbers} reads as {written!r}, whose second character after the point is not a digit"
        step = step_of(second, 1)
        if isinstance(step, str):
            return step
        score += 0.01 * expected_digit(step)
    return score


def history_answer(score: float) -> str:
    """The first answer as the script puts it back into the conversation: the smoothed score (a float32 in the
    script) as Python writes it, and the end-of-sequence string."""
    return f"{float(np.float32(score))}</s>"


@dataclass
class EXPERTConfig(ModelConfig):
    # "" = the folder `capeval convert expert` writes; or any LLaVA-1.5 checkpoint with EXPERT's weights folded in.
    model: str = ""
    batch_size: int = 16
    # Generate the explanation (the second turn); the score does not depend on it.
    explanation: bool = True
    # LLaVA's conversation: "llava_v0" (what the released script runs: its conversation for the model path it
    # defaults to) or "llava_v1" (LLaVA-1.5's own, the one its --conv-mode argument names).
    conversation: str = "llava_v0"
    image_aspect: str = "pad"
    max_new_tokens: int = bounded(512, ge=1, le=4096)
    # "base": next token and softmax over the 32,000 rows LLaVA-1.5 was trained with (the tokenizer's base
    # vocabulary, as the script's model has them); "full": every row of the transformers checkpoint's LM head.
    vocabulary: str = "base"
    on_invalid: str = "nan"


class EXPERT(LVLMJudgeMetric):
    info = MetricInfo(
        name="expert",
        display_name="EXPERT",
        description=(
            "Reference-free: a fine-tuned LLaVA-1.5-13B scores the caption from 0.0 to 1.0 (score smoothing over the "
            "digits it writes) and explains the score by fluency, relevance and descriptiveness (kept per sample)."
        ),
        citation=CITATION,
        references="never",
        images="always",
        score_range=(0.0, 1.0),
        paper="https://arxiv.org/abs/2506.24016",
        paper_config={"model": "LLaVA-1.5-13B + EXPERT LoRA (hjkim811/EXPERT-llava-13b-lora)", "decoding": "greedy",
                      "conversation": "llava_v0 (released script)", "image_aspect": "pad", "dtype": "float16",
                      "max_new_tokens": 512},
        codebase_urls=(CODE,),
    )
    Config = EXPERTConfig
    extra_names: ClassVar[tuple[str, ...]] = ("raw_score",)
    mean_extras: ClassVar[tuple[str, ...]] = ("raw_score",)
    accelerator_dtype: ClassVar[str] = "float16"  # the official script's
    scale = SCALES["0-9"]  # the digit tokens, read at every answer step

    def __init__(self, **config):
        super().__init__(**config)
        cfg = self.config
        for option, value, allowed in (("conversation", cfg.conversation, tuple(LLAVA_CONVERSATIONS)),
                                       ("vocabulary", cfg.vocabulary, VOCABULARIES),
                                       ("on_invalid", cfg.on_invalid, INVALID_POLICIES)):
            if value not in allowed:
                raise ValueError(f"expert: {option} must be one of {allowed}, got {value!r}")

    def build_visual_input(self) -> VisualInput:
        return VisualInput(image_aspect=self.config.image_aspect, template="llava")

    def checkpoint(self) -> str:
        from capeval_plugins.models.encoders.openai_clip import converted_model_dir

        return self.config.model or str(converted_model_dir("expert"))

    def judge_spec(self):
        import dataclasses

        return dataclasses.replace(super().judge_spec(), model=self.checkpoint())

    def requirements(self) -> list[Requirement]:
        needs = super().requirements()  # the model option, when set
        if not self.config.model:
            needs.append(Requirement(
                "model", self.checkpoint(), "the EXPERT weights folded into LLaVA-1.5-13B",
                remedy=f"download {RELEASED} (adapter) and run `capeval convert expert ADAPTER_DIR` (base {BASE}), "
                       "or pass model=FOLDER"))
        return needs

    # -- states: the score, the number written, and the explanation texts --

    def states(self) -> dict[str, StateSpec]:
        return {**super().states(), "explanation": TEXT_STATE}

    def map(self, batch: Batch) -> dict[str, Tensor]:
        out = self.score(batch)
        texts = out.pop("explanation_texts")
        return {**out, "explanation": encode_text_lists(texts, packed=True)}

    def score(self, batch: Batch) -> dict:
        if any(LLAVA_IMAGE in c for c in batch.candidates):  # the runner narrows this down to the samples
            raise ValueError(f"the caption holds LLaVA's image placeholder {LLAVA_IMAGE!r}, which the prompt cannot "
                             "carry")
        judge = self.judge
        conversation = LLAVA_CONVERSATIONS[self.config.conversation]
        stop = KeywordStop.build([conversation.stop], judge.tokenizer)
        digits = self.digit_ids()
        first = self.ask([conversation.prompt([(scoring_prompt(c), None)]) for c in batch.candidates],
                         batch.images, batch.image_index.tolist(), stop)
        scores, raw, errors = [], [], []
        for i in range(len(batch)):
            n = int((first.tokens[i] >= 0).sum())
            read = official_score(first.texts[i], first.tokens[i, :n].tolist(), first.label_logprobs[i, :n], digits)
            errors.append(read if isinstance(read, str) else None)
            scores.append(math.nan if isinstance(read, str) else read)
            raw.append(_written(first.texts[i]))
        self.report_invalid(batch, errors, first.texts)
        texts: list[list[str]] = [[] for _ in range(len(batch))]
        valid = [i for i, e in enumerate(errors) if e is None]
        if self.config.explanation and valid:
            index = batch.image_index.tolist()
            prompts = [conversation.prompt([(scoring_prompt(batch.candidates[i]), history_answer(scores[i])),
                                            (explanation_prompt(batch.candidates[i]), None)]) for i in valid]
            second = self.ask(prompts, batch.images, [index[i] for i in valid], stop)
            for k, i in enumerate(valid):
                said = second.texts[k].strip().replace("\x00", "\ufffd")
                parts = parse_explanation(said)
                texts[i] = [said] + ([parts[c] for c in CRITERIA] if parts else [])
        return {"score": torch.tensor(scores, dtype=torch.float64), "raw_score": torch.tensor(raw, dtype=torch.float64),
                "explanation_texts": texts}

    def ask(self, prompts: list[str], images, image_index: list[int], stop: KeywordStop) -> JudgeOutput:
        judge = self.judge
        rows = judge.tokenizer.vocab_size if self.config.vocabulary == "base" else None
        return judge.judge(images, image_index, prompts, self.scale, max_new_tokens=self.config.max_new_tokens,
                           batch_size=self.config.batch_size, keep_hidden=False, visual_input=self.visual_input,
                           stop=stop, vocab_rows=rows)

    def digit_ids(self) -> list[int]:
        """The script's ``rate2token``: each digit's last token id (``tokenizer.encode(str(d))[-1]``), which must be
        the digit's own single token (the judge's table)."""
        tokenizer = self.judge.tokenizer
        ids = [int(tokenizer.encode(str(d))[-1]) for d in range(10)]
        if ids != self.judge.label_table(self.scale.labels)[0].tolist():
            raise ValueError("expert: this judge's tokenizer does not write each digit as a token of its own (EXPERT "
                             "reads the digits as LLaVA-1.5's Llama tokenizer writes them)")
        return ids

    def finalize(self, state: dict[str, Tensor]) -> MetricResult:
        result = super().finalize({k: v for k, v in state.items() if k != "explanation"})
        rows = decode_text_lists(state["explanation"])
        explained = [r for r in rows if r]
        result.extras["explanation"] = [r[0] if r else None for r in rows]
        for k, criterion in enumerate(CRITERIA):
            result.extras[criterion] = [r[k + 1] if len(r) > 1 else None for r in rows]
        if self.config.explanation:
            result.corpus_extras["n_unparsed_explanations"] = float(sum(len(r) == 1 for r in explained))
        return result


def _written(text: str) -> float:
    """The number the answer writes as the script reads it (its digits and dots), NaN where there is none."""
    numbers = re.sub(r"\.+$", "", re.sub(r"^\.+", "", re.sub(r"[^\d\.]", "", text.strip())))
    try:
        return float(numbers)
    except ValueError:
        return math.nan


METRICS = [EXPERT]
