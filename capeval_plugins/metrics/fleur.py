"""FLEUR and RefFLEUR (Lee et al., ACL 2024): an LVLM rates the caption from 0.0 to 1.0, and the written score
is smoothed by the digit distributions at its decimal positions.

score = 0.1 * sum_d P(d) d at the first decimal (+ 0.01 * sum_d P(d) d at the second, if written); for "1.0",
0.9 P('0') + P('1') at the integer digit. P is the full-vocabulary softmax (not renormalised over digits).
With references, the RefFLEUR prompt is used. As in the official script, the conversation starts with LLaVA's
"llava_v1" system sentence, images are padded to a square, and the judge runs in float16 on GPUs. On LLaVA-1.5
(the paper's judge) the prompt is read at the official script's token level (``template="auto"``): LLaVA's own
conversation tokenised as its ``tokenizer_image_token`` does, the next token and P taken over the 32,000 rows of
LLaVA-1.5's vocabulary (not the 32,064 of the transformers conversion); other checkpoints use their chat template.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from capeval_plugins.contract import Batch, MetricInfo, ModelConfig, PointwiseMetric, bounded
from capeval_plugins.core.heads import fleur_smooth
from capeval_plugins.resources.loading import resolve_device
from capeval_plugins.inputs import InputError
from capeval_plugins.models.lvlm import (LLAVA_CONVERSATIONS, LLAVA_IMAGE, LLAVA_V1_SYSTEM, JudgeOutput, JudgeSpec,
                                         LVLMJudge, RatingScale, SCALES, VisualInput, fleur_instruction)

FLEUR_CITATION = """@inproceedings{lee2024fleur,
  title     = {{FLEUR}: An Explainable Reference-Free Evaluation Metric for Image Captioning Using a Large
               Multimodal Model},
  author    = {Lee, Yebin and Park, Imseong and Kang, Myungjoo},
  booktitle = {Proceedings of the 62nd Annual Meeting of the Association for Computational Linguistics},
  pages     = {3732--3746},
  year      = {2024}
}"""

INVALID_POLICIES = ("nan", "raise")
TRAILING_ZERO = ("smooth", "drop")
PROMPT_TEMPLATES = ("auto", "llava", "chat")
VOCABULARIES = ("auto", "base", "full")


@dataclass
class LVLMJudgeConfig(ModelConfig):
    """Options of metrics that ask an LVLM for a score (:mod:`capeval_plugins.models.lvlm`). The conversation
    defaults are the official FLEUR script's: LLaVA's "llava_v1" system sentence, images padded to a square."""

    batch_size: int = 16
    max_new_tokens: int = bounded(10, ge=1, le=4096)
    on_invalid: str = "nan"
    system_prompt: str | None = LLAVA_V1_SYSTEM
    system_placement: str = "auto"
    image_aspect: str = "pad"
    # "llava": LLaVA's own "llava_v1" conversation, tokenised as LLaVA's tokenizer_image_token does (the official
    # script); "chat": the checkpoint's chat template; "auto": "llava" on LLaVA-1.5 checkpoints (unless
    # system_placement is set, which places the system prompt in a chat template), "chat" on the others.
    template: str = "auto"
    # The LM-head rows the next token and the softmax range over: "base" the tokenizer's base vocabulary (LLaVA-1.5's
    # 32,000 rows, as the official script's model has them), "full" every row of the checkpoint (32,064 on the
    # transformers conversion); "auto": "base" with LLaVA's conversation, "full" with a chat template.
    vocabulary: str = "auto"


class LVLMJudgeMetric(PointwiseMetric):
    """Shared plumbing: the shared judge, the FLEUR prompt (RefFLEUR with references) and the policy for
    answers without a valid score. ``accelerator_dtype`` is the judge's dtype on GPUs when ``dtype`` is not
    given (float32 on CPU)."""

    accelerator_dtype: ClassVar[str] = "bfloat16"
    reports_invalid: ClassVar[bool] = True  # n_invalid in every result: answers without a valid score counted

    def __init__(self, **config):
        super().__init__(**config)
        cfg = self.config
        if cfg.on_invalid not in INVALID_POLICIES:
            raise ValueError(f"{self.info.name}: on_invalid must be one of {INVALID_POLICIES}, got {cfg.on_invalid!r}")
        try:
            self.visual_input = self.build_visual_input()
        except ValueError as err:
            raise ValueError(f"{self.info.name}: {err}") from None

    def build_visual_input(self) -> VisualInput:
        """How the conversation around the prompt is built in a chat template, from the options (checked here)."""
        cfg = self.config
        for option, value, allowed in (("template", cfg.template, PROMPT_TEMPLATES),
                                       ("vocabulary", cfg.vocabulary, VOCABULARIES)):
            if value not in allowed:
                raise ValueError(f"{option} must be one of {allowed}, got {value!r}")
        if cfg.template == "llava" and cfg.system_placement != "auto":
            raise ValueError("system_placement places the system prompt in a chat template; with template='llava' "
                             "it opens LLaVA's conversation: leave system_placement at 'auto' or use template='chat'")
        return VisualInput(system_prompt=cfg.system_prompt or None, system_placement=cfg.system_placement,
                           image_aspect=cfg.image_aspect)

    def reading(self, judge: LVLMJudge) -> tuple[str, int | None]:
        """How ``judge`` is asked and read: the template (``"llava"`` or ``"chat"``) and the LM-head rows the
        next token and the softmax range over (None: every row)."""
        cfg = self.config
        template = cfg.template
        if template == "auto":
            template = "llava" if judge.is_llava15 and cfg.system_placement == "auto" else "chat"
        vocabulary = cfg.vocabulary if cfg.vocabulary != "auto" else ("base" if template == "llava" else "full")
        return template, judge.base_vocab_size if vocabulary == "base" else None

    def llava_prompts(self, instructions: list[str], batch: Batch) -> list[str]:
        """The instructions as the official script's prompts: LLaVA's "llava_v1" conversation (its system sentence
        the ``system_prompt`` option), the image placeholder first."""
        texts = list(batch.candidates) + [r for refs in batch.references or [] for r in refs or []]
        if any(LLAVA_IMAGE in t for t in texts):  # the runner narrows this down to the samples at fault
            raise InputError(f"the caption or a reference holds LLaVA's image placeholder {LLAVA_IMAGE!r}, which the "
                             "prompt cannot carry (LLaVA's conversation would read it as a second image)")
        conversation = dataclasses.replace(LLAVA_CONVERSATIONS["llava_v1"], system=self.config.system_prompt or "")
        return [conversation.prompt([(text, None)]) for text in instructions]

    def judge_spec(self) -> JudgeSpec:
        """The judge to load: the options as given, with ``accelerator_dtype`` on GPUs unless ``dtype`` is set."""
        spec = JudgeSpec.from_config(self.config)
        if spec.dtype is None and resolve_device(spec.device).type != "cpu":
            spec = dataclasses.replace(spec, dtype=self.accelerator_dtype)
        return spec

    @property
    def judge(self) -> LVLMJudge:
        return LVLMJudge.shared(self.judge_spec())

    def ask(self, batch: Batch, scale: RatingScale, keep_hidden: bool = False) -> JudgeOutput:
        refs = batch.references or [None] * len(batch)
        instructions = [fleur_instruction(c, r, scale) for c, r in zip(batch.candidates, refs)]
        judge = self.judge
        template, rows = self.reading(judge)
        visual_input = self.visual_input
        if template == "llava":
            instructions = self.llava_prompts(instructions, batch)
            visual_input = VisualInput(image_aspect=self.config.image_aspect, template="llava")
        out = judge.judge(batch.images, batch.image_index, instructions, scale,
                          max_new_tokens=self.config.max_new_tokens, batch_size=self.config.batch_size,
                          keep_hidden=keep_hidden, visual_input=visual_input, vocab_rows=rows)
        self.check_answers(batch, out)
        return out

    def check_answers(self, batch: Batch, out: JudgeOutput) -> None:
        self.report_invalid(batch, out.errors, out.texts)

    def report_invalid(self, batch: Batch, errors: list[str | None], texts: list[str]) -> None:
        """Answers without a valid score (``errors[i]`` the reason): a warning naming them (their samples get
        NaN), or an error under ``on_invalid="raise"``."""
        bad = [i for i, e in enumerate(errors) if e is not None]
        if not bad:
            return
        ids = batch.indices.tolist()
        lines = [f"sample {ids[i]}: {errors[i]} (answer {texts[i][:60]!r})" for i in bad[:5]]
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        if self.config.on_invalid == "raise":
            raise ValueError(f"{self.info.name}: no valid score in the judge's answer for " + "; ".join(lines) + more)
        warnings.warn(f"{self.info.name}: {len(bad)} sample(s) get NaN (no valid score): " + "; ".join(lines) + more,
                      stacklevel=4)


def fleur_scores(out: JudgeOutput, trailing_zero: str = "smooth") -> Tensor:
    """FLEUR's smoothed score of every sample of a 0.0-1.0 judge output (NaN where there is none). A second
    decimal is smoothed where one is written; with ``trailing_zero="drop"`` a written second decimal "0"
    ("0.50") is not, as in the official script (which reads the answer through ``float``)."""
    has_second = out.positions[:, 2] >= 0
    if trailing_zero == "drop":
        has_second &= out.labels[:, 2] != 0
    score = fleur_smooth(out.logprobs_at(1), out.logprobs_at(2), out.logprobs_at(0), has_second,
                         out.labels[:, 0] == 1)
    return torch.where(out.valid, score, torch.full_like(score, float("nan")))


@dataclass
class FLEURConfig(LVLMJudgeConfig):
    model: str = "llava-hf/llava-1.5-13b-hf"
    # A written second decimal "0" ("0.50"): "smooth" it like any written digit (paper), or "drop" it (the
    # official script, which reads the answer through float and so never sees it).
    trailing_zero: str = "smooth"


class FLEUR(LVLMJudgeMetric):
    info = MetricInfo(
        name="fleur",
        display_name="FLEUR",
        description=(
            "An LVLM rates the caption from 0.0 to 1.0 (FLEUR prompt; RefFLEUR prompt when references are given) "
            "and the written score is smoothed by the digit probabilities at its decimal positions."
        ),
        citation=FLEUR_CITATION,
        references="optional",
        images="always",
        score_range=(0.0, 1.0),
        paper="https://aclanthology.org/2024.acl-long.205",
        paper_config={"model": "LLaVA-1.5-13B", "decoding": "greedy", "scale": "0.0-1.0",
                      "conversation": "llava_v1 (official script)", "image_aspect": "pad (official script)",
                      "tokenisation": "LLaVA's tokenizer_image_token (official script)",
                      "vocabulary": "LLaVA-1.5's 32,000 rows (official script)", "dtype": "float16 (official script)"},
        codebase_urls=("https://github.com/Yebin46/FLEUR",),
    )
    Config = FLEURConfig
    extra_names: ClassVar[tuple[str, ...]] = ("raw_score", "digit_probs")
    extra_shapes: ClassVar[dict[str, tuple[int, ...]]] = {"digit_probs": (10,)}
    mean_extras: ClassVar[tuple[str, ...]] = ("raw_score",)
    accelerator_dtype: ClassVar[str] = "float16"  # the official script's

    def __init__(self, **config):
        super().__init__(**config)
        if self.config.trailing_zero not in TRAILING_ZERO:
            raise ValueError(f"fleur: trailing_zero must be one of {TRAILING_ZERO}, got {self.config.trailing_zero!r}")

    def score(self, batch: Batch) -> dict[str, Tensor]:
        return self.head(self.ask(batch, SCALES["0.0-1.0"]))

    def head(self, out: JudgeOutput) -> dict[str, Tensor]:
        """Everything after the judge: the smoothed score and the extras."""
        return {"score": fleur_scores(out, self.config.trailing_zero), "raw_score": out.raw,
                "digit_probs": out.logprobs_at(1).double().exp()}


METRICS = [FLEUR]
