"""Rigel phase 2, human-guided score adaptation (paper Section 3.2): the phase-1 head is frozen; LoRA (rank 8,
alpha 16, via peft) adapts the backbone; the loss is the cross-entropy between softmax(g(h)) and the one-hot
of the averaged human score. The paper's Table 3 ablations: against a random frozen head (row (iii)) or against
the LM head's label tokens (row (i), ``head_init="lm"``). Defaults are the paper's Table 4: Adam (0.9, 0.999), learning rate 1e-4, batch 8,
weight decay 0.01, one epoch.

LoRA goes on the language model's query and value projections (``lora_targets``, a regular expression over
module names): on Qwen3-VL-2B that is the paper's 1.61M trainable parameters. The state (LoRA weights and
optimizer) is saved every ``save_every`` steps and after every epoch; a run called again with the same
arguments continues from the last save.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from capeval_plugins.core import heads
from capeval_plugins.core.bounds import bounded, check_fields
from capeval_plugins.models.lvlm import JudgeSpec, LVLMJudge, PromptEnd, load_lvlm_processor
from capeval_plugins.digests import model_files_digest
from capeval_plugins.training.data import JudgmentSet
from capeval_plugins.models.rigel import (RigelModel, RigelSettings, hidden_size_of, load_head,
                                          load_private_backbone, quiet_peft, read_settings, require_peft)
from capeval_plugins.training.checkpoint import save_checkpoint
from capeval_plugins.training.state import (batch_of, correlation, expectation, predict, run_steps, signature,
                                            start_or_resume, step_record)

LANGUAGE_QV = r".*language_model.*\.(q_proj|v_proj)"
HEAD_INITS = ("phase1", "random", "lm")
LM_SOFTMAX = ("labels", "vocabulary")


@dataclass
class Phase2Config:
    """Phase 2 hyper-parameters; defaults are the paper's (Table 4)."""

    epochs: int = bounded(1, ge=1)
    batch_size: int = bounded(8, ge=1)
    lr: float = bounded(1e-4, gt=0)
    weight_decay: float = bounded(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    lora_r: int = bounded(8, ge=1)
    lora_alpha: int = bounded(16, ge=1)
    lora_dropout: float = bounded(0.0, ge=0, lt=1)
    lora_targets: str = LANGUAGE_QV
    ties: str = "up"
    seed: int = bounded(0, ge=0)
    save_every: int = bounded(200, ge=1)
    eval_batch_size: int = bounded(16, ge=1)
    # The frozen head the backbone learns against: "phase1" (init's distilled head), "random" (freshly
    # initialised with ``seed``: the paper's Table 3 row (iii), phase 2 without phase 1) or "lm" (the LM head's
    # label tokens, no scoring head: Table 3 row (i)).
    head_init: str = "phase1"
    # With head_init="lm", p of Eq. 3: "labels" (softmax over the label tokens' logits, the distribution the LM
    # head scores with) or "vocabulary" (over the whole vocabulary: plain next-token cross-entropy on the gold
    # label's token).
    lm_softmax: str = "labels"

    def __post_init__(self) -> None:
        check_fields(self, "phase 2")
        if self.ties not in ("up", "down"):
            raise ValueError(f"ties must be 'up' or 'down', got {self.ties!r}")
        if self.head_init not in HEAD_INITS:
            raise ValueError(f"head_init must be one of {HEAD_INITS}, got {self.head_init!r}")
        if self.lm_softmax not in LM_SOFTMAX:
            raise ValueError(f"lm_softmax must be one of {LM_SOFTMAX}, got {self.lm_softmax!r}")

    def lora(self) -> dict[str, Any]:
        return {"r": self.lora_r, "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout,
                "target_modules": self.lora_targets}


def add_lora(backbone: Any, config: Phase2Config) -> Any:
    """The backbone with LoRA adapters injected in place (a peft model around it); only they train."""
    peft = require_peft()
    lora = peft.LoraConfig(**config.lora())
    try:
        with quiet_peft():
            wrapped = peft.get_peft_model(backbone, lora)
    except ValueError as err:
        raise ValueError(f"LoRA targets {config.lora_targets!r} match no module of this backbone: {err}") from err
    return wrapped


def train_phase2(out_dir: str | os.PathLike, init: str | os.PathLike | None, train: JudgmentSet,
                 val: JudgmentSet | None = None, *, config: Phase2Config | None = None,
                 settings: RigelSettings | None = None, model: str | None = None, device: str | None = None,
                 dtype: str | None = None, local_files_only: bool | None = None, trust_remote_code: bool = False,
                 progress: bool = True, overwrite: bool = False,
                 on_step_end: Callable[[int], None] | None = None) -> Path:
    """Phase 2 from the phase-1 checkpoint ``init``; writes a checkpoint (head + adapter) to ``out_dir``.
    ``model`` replaces the base model ``init`` names (e.g. a local copy). A run that needs no distilled head
    (``head_init`` "random" or "lm") may start from ``settings`` (base model, prompts, labels) instead of
    ``init``."""
    config = config or Phase2Config()
    settings = start_settings(init, settings, config)
    spec = JudgeSpec(model or settings.base_model, device, dtype, settings.revision, local_files_only,
                     trust_remote_code)
    rigel = build_trainable(spec, init, config, settings)
    # the backbone actually loaded (``model`` may replace the one ``init`` names), by its files and dtype: a run
    # resumed on other weights would train one LoRA on two models
    dtype = str(next(rigel.judge.model.parameters()).dtype)
    backbone = (spec.model, model_files_digest(spec.model, spec.revision), dtype)
    run = signature("rigel-phase2", rigel.settings.to_dict(), dataclasses.asdict(config), train.fingerprint(),
                    None if val is None else val.fingerprint(), _head_digest(rigel.head), backbone)
    record = fit(rigel, train, val, config, out_dir, run, progress=progress, overwrite=overwrite,
                 on_step_end=on_step_end)
    settings = dataclasses.replace(rigel.settings, phase=2, lora=config.lora())
    record.update(config=dataclasses.asdict(config), init=None if init is None else str(Path(init).resolve()),
                  train_samples=len(train), validation_samples=0 if val is None else len(val))
    return save_checkpoint(out_dir, settings, rigel.head, peft_model=rigel.peft_model, record=record)


class TrainableRigel(RigelModel):
    """A Rigel scorer whose backbone carries LoRA adapters (``peft_model`` wraps it)."""

    def __init__(self, judge: LVLMJudge, head: heads.ScoringHead, settings, peft_model: Any):
        super().__init__(judge, head, settings)
        self.peft_model = peft_model

    def lora_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.peft_model.parameters() if p.requires_grad]

    def lora_state(self) -> dict[str, torch.Tensor]:
        return require_peft().get_peft_model_state_dict(self.peft_model)

    def load_lora_state(self, state: dict[str, torch.Tensor]) -> None:
        require_peft().set_peft_model_state_dict(self.peft_model, state)


def start_settings(init: str | os.PathLike | None, settings: RigelSettings | None,
                   config: Phase2Config) -> RigelSettings:
    """What phase 2 starts from: ``init``'s settings (else ``settings``), with the head it trains against."""
    if init is None and (settings is None or config.head_init == "phase1"):
        raise ValueError("phase 2 needs init (a phase-1 checkpoint folder)" + (
            "" if config.head_init != "phase1" else " to train against its distilled head"))
    settings = read_settings(init) if init is not None else settings
    return dataclasses.replace(settings, head="lm" if config.head_init == "lm" else "scoring")


def build_trainable(spec: JudgeSpec, init: str | os.PathLike | None, config: Phase2Config,
                    settings: RigelSettings | None = None) -> TrainableRigel:
    """The base model (a copy of its own) with fresh LoRA adapters, and the frozen head of ``init`` (a fresh
    seeded one for ``head_init="random"``; none for ``"lm"``, whose LM head is the backbone's own)."""
    settings = start_settings(init, settings, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)  # LoRA's A matrices are drawn at random
        wrapped = add_lora(load_private_backbone(spec), config)
    judge = LVLMJudge(wrapped.get_base_model(), load_lvlm_processor(spec))
    if settings.hidden_size is None:
        settings = dataclasses.replace(settings, hidden_size=hidden_size_of(judge))
    if config.head_init == "phase1":
        head = load_head(init, settings, judge.device)
    elif config.head_init == "random":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            head = settings.build_head().to(judge.device).eval().requires_grad_(False)
    else:
        head = None
    return TrainableRigel(judge, head, settings, wrapped)


def fit(rigel: TrainableRigel, train: JudgmentSet, val: JudgmentSet | None, config: Phase2Config,
        out_dir: str | os.PathLike, run_signature: str, *, progress: bool = True, overwrite: bool = False,
        on_step_end: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The LoRA training loop, resumable; returns the run's record."""
    state, loaded = start_or_resume(out_dir, run_signature, overwrite)
    params = rigel.lora_parameters()
    opt = torch.optim.Adam(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    record = step_record(run_signature, phase=2)
    if loaded is not None:
        record, tensors, opt_state = loaded
        rigel.load_lora_state(tensors["lora"])
        opt.load_state_dict(opt_state)
    gold = heads.gold_labels(torch.as_tensor(train.scores), len(rigel.settings.labels), config.ties)

    def save() -> None:
        state.save(record, {"lora": rigel.lora_state()}, opt.state_dict())

    def step(rows: list[int], global_step: int) -> float:
        return _step(rigel, opt, train, rows, gold, config.seed + global_step, config.lm_softmax)

    run_steps(record, samples=len(train), batch_size=config.batch_size, epochs=config.epochs, seed=config.seed,
              save_every=config.save_every, step=step, save=save, end_epoch=lambda: _validate(rigel, val, config),
              on_step_end=on_step_end, progress=progress, desc="phase 2")
    rigel.peft_model.eval()
    return record


def phase2_loss(rigel: RigelModel, end: PromptEnd, gold: torch.Tensor, lm_softmax: str = "labels") -> torch.Tensor:
    """Eq. 3 averaged over a batch: the cross-entropy of softmax(g(h)) against the gold labels; against the
    LM head, of the softmax over its label tokens' logits (``lm_softmax="labels"``), or of the full vocabulary's
    (``"vocabulary"``: the log-probability of the gold label's token, as next-token training has it)."""
    gold = gold.to(end.hidden.device)
    if rigel.settings.head == "lm" and lm_softmax == "vocabulary":
        return -end.label_logprobs.double().gather(1, gold[:, None]).mean()
    return F.cross_entropy(rigel.label_logits(end).double(), gold)


def _step(rigel: TrainableRigel, opt: torch.optim.Optimizer, data: JudgmentSet, rows: list[int],
          gold: torch.Tensor, seed: int, lm_softmax: str = "labels") -> float:
    """One optimiser step on a batch: cross-entropy of the score distribution against the gold labels (Eq. 3)."""
    rigel.peft_model.train()
    torch.manual_seed(seed)  # dropout, if any, draws the same masks when the run is resumed
    batch = batch_of(data, rows)
    out = rigel.states(batch.images, batch.image_index, batch.candidates, batch.references,
                       batch_size=len(rows), grad=True)
    loss = phase2_loss(rigel, out, gold[rows], lm_softmax)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.item())


def _validate(rigel: TrainableRigel, val: JudgmentSet | None, config: Phase2Config) -> dict[str, Any]:
    if val is None or len(val) < 2:
        return {}
    rigel.peft_model.eval()
    return {"validation": correlation(expectation(predict(rigel, val, config.eval_batch_size)), val.scores)}


def _head_digest(head: heads.ScoringHead | None) -> str:
    if head is None:
        return "lm-head"
    digest = hashlib.sha256()
    for value in head.state_dict().values():
        digest.update(value.detach().cpu().numpy().tobytes())
    return digest.hexdigest()
