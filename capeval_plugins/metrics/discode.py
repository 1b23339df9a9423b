"""DISCODE and RefDISCODE (Inoue et al., AAAI 2026): FLEUR's prompt and greedy answer, then a test-time head
that balances the LVLM's distribution at the score digit against a Gaussian prior around the raw score.

At the target position T (the first decimal of "0.x" on the default 0.0-1.0 scale, the label itself on the
1-5, 0-9 and A-E scales) with label logits z: s_raw = argmax z, q(x) proportional to exp(-(x - s_raw)^2 / 2),
alpha = min(1, N(s_raw; mean of the labels, sigma^2)) (label k of K read as k / K, capped at 1: the reading
that keeps alpha in the paper's [0, 1] without discarding the head, see the card) and
psi = softmax((z + (1 - alpha) log q) / alpha) (Eq. 6, float64, alpha -> 0 taken explicitly). s_hat = E_psi[x]; on the 0.0-1.0 scale the decimal part of the
written score is replaced by 0.1 * s_hat.

An answer "1.0" has its target (the paper's T, the first decimal) at the "0" after "1.": ``alpha`` and
``distribution`` are the head's there, for every answer. Its score is FLEUR's "1.0" rule by default
(``one_rule="fleur"``), which does not use them; the ``from_att_head`` extra says which samples' scores came
from the head (1) and which from that rule (0). The conversation (system prompt, padded images) is FLEUR's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from capeval_plugins.contract import Batch, MetricInfo, bounded
from capeval_plugins.core import heads
from capeval_plugins.models.lvlm import JudgeOutput, RatingScale, get_scale
from capeval_plugins.metrics.fleur import LVLMJudgeConfig, LVLMJudgeMetric, fleur_scores

CITATION = """@inproceedings{inoue2026discode,
  title     = {{DISCODE}: Distribution-Aware Score Decoder for Robust Automatic Evaluation of Image Captioning},
  author    = {Inoue, Nakamasa and Goto, Kanoko and Oi, Masanari and Gruszka, Martyna and Ukai, Mahiro and
               Hirose, Takumi and Sekikawa, Yusuke},
  booktitle = {Proceedings of the AAAI Conference on Artificial Intelligence},
  year      = {2026}
}"""

SOLVERS = ("auto", "closed_form", "adam", "converge")


@dataclass
class DISCODEConfig(LVLMJudgeConfig):
    model: str = "llava-hf/llava-next-72b-hf"
    scale: str = "0.0-1.0"
    sigma2: float = bounded(0.1, gt=0)
    # Eq. 4 with label k of K read as k / K (mu = 0.45 for the digits), capped at 1: the text's alpha in [0, 1],
    # largest near mu and smallest at the ends (card). "label", the literal reading on the digits (mu = 4.5),
    # returns the written digit for all digits but 4 and 5; alpha_clip=False is Eq. 4 uncapped (up to 1.26).
    alpha_scale: str = "unit"
    alpha_clip: bool = True
    # "density": Eq. 4 as printed; "kernel": without its normalising constant (1 at mu), a guess (card).
    alpha_form: str = "density"
    # Table 10's ablations: "no_cross_entropy", "no_divergence", "fixed_alpha" (alpha = 0.5); "none" the method.
    ablation: str = "none"
    divergence: str = "weighted_kl"
    # "auto": the closed form where there is one (weighted KL, KL), else the paper's Adam.
    solver: str = "auto"
    solver_steps: int = bounded(10, ge=1, le=100_000)
    solver_lr: float = bounded(1e-3, gt=0)
    divergence_order: float = bounded(0.5, gt=0)
    # What "1.0" scores: FLEUR's rule (0.9 P('0') + P('1') at the '1') or 1 + 0.1 s_hat at its decimal.
    one_rule: str = "fleur"


class DISCODE(LVLMJudgeMetric):
    info = MetricInfo(
        name="discode",
        display_name="DISCODE",
        description=(
            "An LVLM rates the caption (FLEUR prompt; RefDISCODE prompt when references are given); the digit "
            "distribution at the score position is adapted at test time towards a Gaussian prior around the raw "
            "score (closed-form ATT head) and its expectation replaces the score's decimal part."
        ),
        citation=CITATION,
        references="optional",
        images="always",
        score_range=(0.0, 1.0),
        paper="https://arxiv.org/abs/2512.14420",
        paper_config={"model": "LLaVA-NeXT-72B", "scale": "0.0-1.0", "sigma2": 0.1, "divergence": "weighted KL",
                      "alpha": "Eq. 4 on the digits read as tenths (mu = 0.45), capped at 1; see the card",
                      "solver": "closed form (Eq. 6)", "conversation": "FLEUR's official script (llava_v1, pad)"},
    )
    Config = DISCODEConfig
    extra_names: ClassVar[tuple[str, ...]] = ("raw_score", "fleur_score", "alpha", "distribution", "from_att_head")
    extra_shapes: ClassVar[dict[str, tuple[int, ...]]] = {"distribution": (10,)}
    optional_extras: ClassVar[tuple[str, ...]] = ("alpha",)
    mean_extras: ClassVar[tuple[str, ...]] = ("raw_score", "fleur_score")

    def __init__(self, **config):
        super().__init__(**config)
        cfg = self.config
        self.scale: RatingScale = get_scale(cfg.scale)
        self.extra_shapes = {"distribution": (len(self.scale.labels),)}
        checks = [
            (cfg.alpha_scale in heads.ALPHA_SCALES, f"alpha_scale must be 'label' or 'unit', got {cfg.alpha_scale!r}"),
            (cfg.alpha_form in heads.ALPHA_FORMS, f"alpha_form must be 'density' or 'kernel', got {cfg.alpha_form!r}"),
            (cfg.ablation in heads.ABLATIONS, f"ablation must be one of {heads.ABLATIONS}, got {cfg.ablation!r}"),
            (cfg.ablation == "none" or cfg.divergence == "weighted_kl",
             "the ablations (Table 10) are of the weighted-KL loss: use divergence='weighted_kl'"),
            (not (cfg.ablation == "no_divergence" and cfg.solver == "converge"),
             "without the divergence the loss is linear in psi and has no interior minimum: use solver='auto'"),
            (cfg.divergence in heads.DIVERGENCES, f"divergence must be one of {heads.DIVERGENCES}"),
            (cfg.solver in SOLVERS, f"solver must be one of {SOLVERS}"),
            (cfg.solver != "closed_form" or cfg.divergence in heads.CLOSED_FORM,
             f"the {cfg.divergence} divergence has no closed form; use solver='adam' (paper) or 'converge'"),
            (cfg.one_rule in ("fleur", "decimal"), f"one_rule must be 'fleur' or 'decimal', got {cfg.one_rule!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"discode: {message}")
        self.values = torch.tensor(self.scale.values, dtype=torch.float64)
        # The prior and alpha depend on the raw label only: one row per label, computed once.
        labels = torch.arange(len(self.scale.labels))
        self.log_priors, self.alphas = heads.att_prior(labels, self.values, cfg.sigma2, cfg.alpha_scale,
                                                       cfg.divergence, clip=cfg.alpha_clip,
                                                       form=cfg.alpha_form)  # (K, K), (K,)
        if cfg.ablation == "fixed_alpha":
            self.alphas = torch.full_like(self.alphas, 0.5)

    @property
    def closed_form(self) -> bool:
        cfg = self.config
        return cfg.solver == "closed_form" or (cfg.solver == "auto" and cfg.divergence in heads.CLOSED_FORM)

    def score(self, batch: Batch) -> dict[str, Tensor]:
        return self.head(self.ask(batch, self.scale, keep_hidden=not self.closed_form))

    def head(self, out: JudgeOutput) -> dict[str, Tensor]:
        """Everything after the judge, vectorised over the batch: the ATT head, the score and the extras."""
        target = 1 if self.scale.decimal else 0
        valid = out.valid
        logits = torch.where(valid[:, None], out.logprobs_at(target).double(), 0.0)
        psi, alpha = self.adapt(out, target, logits)
        s_hat = heads.expected_value(psi, self.values)
        fleur = self.smoothed(out, logits)
        score, from_head = self.final_score(out, s_hat, fleur)
        nan = torch.full_like(score, float("nan"))
        return {
            "score": torch.where(valid, score, nan),
            "raw_score": out.raw,
            "fleur_score": fleur,
            "alpha": torch.where(valid, alpha, nan),
            "distribution": torch.where(valid[:, None], psi, float("nan")),
            "from_att_head": torch.where(valid, from_head.double(), nan),
        }

    def adapt(self, out: JudgeOutput, target: int, logits: Tensor) -> tuple[Tensor, Tensor]:
        """The ATT head: psi (B, K) and the alpha it used (NaN for divergences without one)."""
        cfg = self.config
        raw = logits.argmax(-1)
        log_q, alpha = self.log_priors[raw], self.alphas[raw]
        if self.closed_form:
            psi = heads.att_ablation(logits, log_q, alpha, cfg.ablation)
        else:
            weight, bias = self.judge.lm_head_rows(out.label_ids_at(target))
            hidden = torch.nan_to_num(out.hidden_at(target)).to(weight.device)
            psi = heads.att_solve(hidden, weight, bias, log_q.to(weight.device), alpha.to(weight.device),
                                  cfg.divergence, order=cfg.divergence_order, steps=cfg.solver_steps,
                                  lr=cfg.solver_lr, converge=cfg.solver == "converge", ablation=cfg.ablation).cpu()
        if cfg.divergence not in heads.CLOSED_FORM or cfg.ablation == "no_divergence":
            alpha = torch.full_like(alpha, float("nan"))
        return psi, alpha

    def final_score(self, out: JudgeOutput, s_hat: Tensor, fleur: Tensor) -> tuple[Tensor, Tensor]:
        """The score and whether it is the head's (False where FLEUR's "1.0" rule gave it)."""
        head = torch.ones_like(s_hat, dtype=torch.bool)
        if not self.scale.decimal:
            return s_hat, head
        one = out.labels[:, 0] == 1
        if self.config.one_rule == "decimal":
            return torch.where(one, 1.0 + 0.1 * s_hat, 0.1 * s_hat), head
        return torch.where(one, fleur, 0.1 * s_hat), ~one

    def smoothed(self, out: JudgeOutput, logits: Tensor) -> Tensor:
        """The score-smoothing baseline on the same answer: FLEUR on the 0.0-1.0 scale, the expected label
        under the LVLM's label distribution otherwise."""
        if self.scale.decimal:
            return fleur_scores(out)
        expected = heads.expected_value(torch.softmax(logits, dim=-1), self.values)
        return torch.where(out.valid, expected, torch.full_like(expected, float("nan")))


METRICS = [DISCODE]
