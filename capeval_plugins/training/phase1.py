"""Rigel phase 1, denoised head self-distillation (paper Section 3.1): the backbone is frozen; the teacher is
q = softmax(z_score / tau) from the LM-head logits of the score tokens at the score position; the scoring head
g on the final hidden state h is trained with tau * EMD(q, softmax(g(h) / tau)).

The backbone runs once over the data (hidden states cached on disk, :mod:`.features`); epochs then train the
head alone. Defaults are the paper's Table 4: Adam (0.9, 0.999), learning rate 5e-4, batch 64, weight decay
0.01, 50 epochs, early stopping on the validation Kendall tau-c with patience 5, keeping the best epoch.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from capeval_plugins.core import heads
from capeval_plugins.core.bounds import bounded, check_fields
from capeval_plugins.models.lvlm import JudgeSpec, LVLMJudge
from capeval_plugins.digests import model_files_digest
from capeval_plugins.training.data import JudgmentSet
from capeval_plugins.training.features import Features, extract_features
from capeval_plugins.models.rigel import RigelModel, RigelSettings, hidden_size_of
from capeval_plugins.training.checkpoint import save_checkpoint
from capeval_plugins.training.state import (chunks, correlation, epoch_order, progress_bar, signature,
                                             start_or_resume)


@dataclass
class Phase1Config:
    """Phase 1 hyper-parameters; defaults are the paper's (Table 4, Appendix D)."""

    epochs: int = bounded(50, ge=1)
    batch_size: int = bounded(64, ge=1)
    lr: float = bounded(5e-4, gt=0)
    weight_decay: float = bounded(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    patience: int = bounded(5, ge=1)
    seed: int = bounded(0, ge=0)
    extract_batch_size: int = bounded(16, ge=1)
    shard_size: int = 1024
    # The distillation objective: "emd" (Eq. 2) or "kl" (the paper's Table 5 ablation).
    objective: str = "emd"

    def __post_init__(self) -> None:
        check_fields(self, "phase 1")
        if self.objective not in heads.RIGEL_OBJECTIVES:
            raise ValueError(f"objective must be one of {heads.RIGEL_OBJECTIVES}, got {self.objective!r}")


def head_metrics(head: heads.ScoringHead, features: Features, temperature: float) -> dict[str, float]:
    """On a feature set: the mean EMD between the head's and the teacher's distributions (both at
    temperature tau, the distillation objective without the factor tau) and the Kendall tau of the head's
    expected label against the human scores."""
    if len(features) == 0:
        return {"emd": math.nan, "kendall_tau_c": math.nan, "kendall_tau_b": math.nan}
    with torch.no_grad():
        logits = head(features.hidden).double()
    teacher = heads.tempered_softmax(features.teacher, temperature)
    emd = heads.emd_1d(teacher, heads.tempered_softmax(logits, temperature)).mean().item()
    expected = heads.label_expectation(torch.softmax(logits, dim=-1))
    return {"emd": emd, **correlation(expected, features.scores)}


def new_head(settings: RigelSettings, seed: int) -> heads.ScoringHead:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return settings.build_head()


def train_head(features: Features, val: Features | None, settings: RigelSettings, config: Phase1Config,
               out_dir: str | os.PathLike, *, progress: bool = True, overwrite: bool = False,
               run_signature: str = "", on_epoch_end: Callable[[dict[str, Any]], None] | None = None
               ) -> tuple[heads.ScoringHead, dict[str, Any]]:
    """The head trained on cached features, resumable: the state is saved after every epoch in
    ``<out_dir>/training_state``, and a run of the same signature continues from it. Returns the best head
    (by validation tau-c; the last one without validation data) and the run's record."""
    state, loaded = start_or_resume(out_dir, run_signature, overwrite)
    head = new_head(settings, config.seed)
    best = {k: v.clone() for k, v in head.state_dict().items()}
    opt = torch.optim.Adam(head.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    record: dict[str, Any] = {"signature": run_signature, "phase": 1, "epochs_done": 0, "best_epoch": None,
                              "best_tau_c": None, "bad_epochs": 0, "stopped_early": False, "done": False,
                              "history": []}
    if loaded is not None:
        record, tensors, opt_state = loaded
        head.load_state_dict(tensors["head"])
        best = tensors["best_head"]
        opt.load_state_dict(opt_state)
    with progress_bar(config.epochs, "phase 1", progress, "epoch") as bar:
        bar.update(record["epochs_done"])
        while not record["done"]:
            entry = _epoch(head, opt, features, val, settings, config, record["epochs_done"])
            if _advance(record, entry, config):
                best = {k: v.detach().clone() for k, v in head.state_dict().items()}
            state.save(record, {"head": head.state_dict(), "best_head": best}, opt.state_dict())
            bar.update(1)
            bar.set_postfix(loss=f"{entry['train_loss']:.4f}",
                            tau_c=f"{entry.get('validation', {}).get('kendall_tau_c', math.nan):.4f}")
            if on_epoch_end is not None:
                on_epoch_end(entry)
    head.load_state_dict(best)
    return head.eval(), record


def _epoch(head: heads.ScoringHead, opt: torch.optim.Optimizer, features: Features, val: Features | None,
           settings: RigelSettings, config: Phase1Config, epoch: int) -> dict[str, Any]:
    """One pass over the shuffled features, then the metrics of the epoch."""
    head.train()
    total = 0.0
    for rows in chunks(epoch_order(len(features), config.seed, epoch), config.batch_size):
        loss = heads.distillation_loss(head(features.hidden[rows]), features.teacher[rows],
                                       settings.temperature, config.objective).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item() * len(rows)
    head.eval()
    entry = {"epoch": epoch + 1, "train_loss": total / max(len(features), 1),
             "train": head_metrics(head, features, settings.temperature)}
    if val is not None and len(val) > 1:
        entry["validation"] = head_metrics(head, val, settings.temperature)
    return entry


def _advance(record: dict[str, Any], entry: dict[str, Any], config: Phase1Config) -> bool:
    """Book-keeping after an epoch (history, best epoch, patience, done); True when this epoch is the new
    best. Without validation data the last epoch is the result."""
    record["history"].append(entry)
    record["epochs_done"] = entry["epoch"]
    tau = entry.get("validation", {}).get("kendall_tau_c", math.nan)
    improved = "validation" not in entry or record["best_epoch"] is None or (
        not math.isnan(tau) and (record["best_tau_c"] is None or tau > record["best_tau_c"]))
    if improved:
        record["best_epoch"], record["bad_epochs"] = entry["epoch"], 0
        record["best_tau_c"] = None if math.isnan(tau) else tau
    else:
        record["bad_epochs"] += 1
    record["stopped_early"] = record["bad_epochs"] >= config.patience
    record["done"] = record["stopped_early"] or record["epochs_done"] >= config.epochs
    return improved


def train_phase1(out_dir: str | os.PathLike, train: JudgmentSet, val: JudgmentSet | None = None, *,
                 settings: RigelSettings | None = None, config: Phase1Config | None = None,
                 spec: JudgeSpec | None = None, cache_dir: str | os.PathLike | None = None, progress: bool = True,
                 overwrite: bool = False, on_epoch_end: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Phase 1 end to end; writes a checkpoint (head only) to ``out_dir`` and returns it.

    ``spec`` loads the backbone (default: ``settings.base_model``, device and dtype chosen automatically);
    it is shared and stays frozen. Features are cached under ``cache_dir`` (default ``<out_dir>/features``).
    Interrupted runs continue where they stopped when called again with the same arguments."""
    settings = dataclasses.replace(settings or RigelSettings())
    config = config or Phase1Config()
    spec = spec or JudgeSpec(settings.base_model, revision=settings.revision)
    settings.base_model, settings.revision = spec.model, spec.revision
    judge = LVLMJudge.shared(spec)
    settings.hidden_size, settings.phase, settings.lora = hidden_size_of(judge), 1, None
    model = RigelModel(judge, settings.build_head(), settings)
    if cache_dir is None:  # the cache goes inside the output folder: both refused as outputs (a symbolic link at
        from capeval_plugins import files  # either) before anything is written

        for folder in (Path(out_dir), Path(out_dir) / "features"):
            files.Folder.open(folder, create=True, mine=True)[0].close()
    cache = Path(cache_dir) if cache_dir is not None else Path(out_dir) / "features"
    train_features = extract_features(model, train, cache, batch_size=config.extract_batch_size,
                                      shard_size=config.shard_size, progress=progress, desc="backbone (train)")
    val_features = None if val is None else extract_features(
        model, val, cache, batch_size=config.extract_batch_size, shard_size=config.shard_size, progress=progress,
        desc="backbone (validation)")
    run = signature("rigel-phase1", settings.to_dict(), dataclasses.asdict(config), train.fingerprint(),
                    None if val is None else val.fingerprint(), model_files_digest(spec.model, spec.revision))
    head, record = train_head(train_features, val_features, settings, config, out_dir, progress=progress,
                              overwrite=overwrite, run_signature=run, on_epoch_end=on_epoch_end)
    record.update(config=dataclasses.asdict(config), train_samples=len(train),
                  validation_samples=0 if val is None else len(val))
    return save_checkpoint(out_dir, settings, head, record=record)
