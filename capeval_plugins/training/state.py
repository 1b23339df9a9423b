"""Resumable training state and the pieces every training run shares (the step loop, batching, progress,
scoring a judgment set).

A run keeps its state in ``<out>/training_state/``: ``record.json`` (what is done: epochs, steps, history,
and the run's signature), one safetensors file per named tensor set (head weights, LoRA weights, projector)
and ``optimizer.pt`` (the optimizer's state, read back with ``weights_only=True``). The directory is replaced
as a whole (written next to it, then swapped), so an interrupted save leaves the previous state intact.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from capeval_plugins.core import heads
from capeval_plugins.core.correlation import kendall_tau
from capeval_plugins.inputs import iter_batches, to_batch
from capeval_plugins.training.data import JudgmentSet
from capeval_plugins.training.checkpoint import json_bytes, output_folder, tensor_bytes
from capeval_plugins.models.rigel import CONFIG_FILE, RigelModel

STATE_DIR = "training_state"


class RunState:
    """The resumable state of one training run in ``<out>/training_state``, written through the output
    folder's :class:`~capeval_plugins.files.Claim` (only files it wrote are ever replaced or removed)."""

    def __init__(self, out_dir: str | os.PathLike):
        self.claim = output_folder(out_dir)
        self.dir = Path(out_dir) / STATE_DIR
        self._tmp, self._old = STATE_DIR + ".tmp", STATE_DIR + ".old"

    def _current(self) -> str | None:
        for name in (STATE_DIR, self._old):  # .old: interrupted between the two renames of a save
            if self.claim.owns(f"{name}/record.json") and self.claim.read(f"{name}/record.json") is not None:
                return name
        return None

    def exists(self) -> bool:
        return self._current() is not None

    def load(self) -> tuple[dict[str, Any], dict[str, dict[str, Tensor]], dict | None]:
        import io

        from capeval_plugins.resources.tensorfile import load_bytes

        where = self._current()
        if where is None:
            raise FileNotFoundError(f"no training state in {self.dir}")
        record = json.loads(self.claim.read(f"{where}/record.json"))
        tensors = {name[len(where) + 1:-len(".safetensors")]: load_bytes(self.claim.read(name), f"{self.dir}/{name}")
                   for name in sorted(self.claim.files)
                   if name.startswith(where + "/") and name.endswith(".safetensors") and self.claim.read(name) is not None}
        opt = self.claim.read(f"{where}/optimizer.pt")
        optimizer = torch.load(io.BytesIO(opt), map_location="cpu", weights_only=True) if opt is not None else None
        return record, tensors, optimizer

    def save(self, record: dict[str, Any], tensors: dict[str, dict[str, Tensor]], optimizer: dict | None) -> None:
        """Write the state beside the current one and swap the two folders, so an interruption leaves one
        whole state."""
        import io

        contents = {f"{name}.safetensors": tensor_bytes(values) for name, values in tensors.items()}
        if optimizer is not None:
            buffer = io.BytesIO()
            torch.save(optimizer, buffer)
            contents["optimizer.pt"] = buffer.getvalue()
        contents["record.json"] = json_bytes(record)
        for name in (STATE_DIR, self._tmp, self._old):  # whole folders are renamed below: only ours may be in them
            self._refuse_foreign(name)
        self._discard(self._tmp)
        for name, data in contents.items():
            self.claim.write(f"{self._tmp}/{name}", data)
        self._discard(self._old)
        folder = self.claim.folder
        names = {d: [n[len(self._tmp):] for n in self.claim.files if n.startswith(self._tmp + "/")]
                 for d in (STATE_DIR, self._old)}
        self.claim.own([d + n for d, rest in names.items() for n in rest] + [d + "/" for d in names])
        if folder.kind(STATE_DIR) == "dir":
            folder.rename(STATE_DIR, self._old)
        folder.rename(self._tmp, STATE_DIR)
        self._discard(self._old)

    def _refuse_foreign(self, name: str) -> None:
        """FileExistsError (one line) when the folder ``name`` holds an entry this run did not write: the state
        swap renames whole folders, which moved a user's notes (and a folder of the user's named like the
        scratch one) aside, or failed with a traceback on a folder not empty."""
        folder = self.claim.folder
        if folder.kind(name) is None:
            return
        if folder.kind(name) != "dir":
            raise FileExistsError(f"{folder.path / name} is not a folder of capeval's training state; move it out "
                                  "or choose another output folder")
        with folder.sub(name) as sub:
            foreign = sorted(n for n in sub.names() if f"{name}/{n}" not in self.claim.files)
        if foreign:
            raise FileExistsError(f"{folder.path / name} holds files capeval did not write ({', '.join(foreign[:3])}"
                                  f"{', ...' if len(foreign) > 3 else ''}); move them out or choose another output "
                                  "folder")

    def _discard(self, name: str) -> None:
        self.claim.remove([n for n in self.claim.files if n.startswith(name + "/")] + [name + "/"])

    def clear(self) -> None:
        for name in (STATE_DIR, self._tmp, self._old):
            self._discard(name)


def start_or_resume(out_dir: str | os.PathLike, signature: str, overwrite: bool, *, finished: str = CONFIG_FILE,
                    what: str = "Rigel"
                    ) -> tuple[RunState, tuple[dict[str, Any], dict[str, dict[str, Tensor]], dict | None] | None]:
    """The run's state, and what it holds when an earlier run of the same signature left some (to continue
    from). A different run in the same folder, or a finished ``what`` checkpoint (its ``finished`` file), is
    refused unless ``overwrite`` (which discards only what an earlier run of the package wrote)."""
    state = RunState(out_dir)
    if overwrite:
        state.clear()
    if not state.exists():
        if (Path(out_dir) / finished).is_file() and not overwrite:
            raise FileExistsError(f"{out_dir} already holds a finished {what} checkpoint; choose another output "
                                  "folder or pass overwrite (--overwrite)")
        return state, None
    loaded = state.load()
    if loaded[0].get("signature") != signature:
        raise FileExistsError(f"{out_dir} holds the state of a different training run (other data or settings); "
                              "choose another output folder, or pass overwrite (--overwrite) to start afresh")
    return state, loaded


def signature(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled sample order of one epoch: a function of (seed, epoch) alone, so a resumed run sees the
    same batches as an uninterrupted one."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def chunks(order: Sequence[int], size: int) -> list[list[int]]:
    return [list(map(int, order[i:i + size])) for i in range(0, len(order), size)]


def step_record(run_signature: str, **extra: Any) -> dict[str, Any]:
    """The record of a fresh step-wise run (:func:`run_steps` keeps it up to date)."""
    return {"signature": run_signature, **extra, "epoch": 0, "step": 0, "global_step": 0, "done": False,
            "history": [], "losses": []}


def run_steps(record: dict[str, Any], *, samples: int, batch_size: int, epochs: int, seed: int, save_every: int,
              step: Callable[[list[int], int], float | dict[str, float]], save: Callable[[], None],
              end_epoch: Callable[[], dict[str, Any]] | None = None,
              on_step_end: Callable[[int], None] | None = None, progress: bool = True,
              desc: str = "training") -> dict[str, Any]:
    """The optimisation loop of a step-wise run, resumable: every epoch the shuffled sample order
    (:func:`epoch_order`, a function of seed and epoch) is cut into batches and ``step(rows, global_step)``
    runs on each, returning the loss (or a dict of losses with ``"loss"``), appended to ``record["losses"]``.
    ``save()`` runs every ``save_every`` steps and after each epoch; ``end_epoch()`` adds to the epoch's
    history entry. A record left by an interrupted run continues at its next step, so the run ends exactly
    where an uninterrupted one would."""
    steps_per_epoch = math.ceil(samples / batch_size)
    with progress_bar(steps_per_epoch * epochs, desc, progress, "step") as bar:
        bar.update(record["global_step"])
        while not record["done"]:
            batches = chunks(epoch_order(samples, seed, record["epoch"]), batch_size)
            for rows in batches[record["step"]:]:
                loss = step(rows, record["global_step"])
                record["losses"].append(loss)
                record["step"] += 1
                record["global_step"] += 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss if isinstance(loss, float) else loss['loss']:.4f}")
                if record["global_step"] % save_every == 0 and record["step"] < len(batches):
                    save()
                if on_step_end is not None:
                    on_step_end(record["global_step"])
            record["history"].append({"epoch": record["epoch"] + 1, **(end_epoch() if end_epoch else {})})
            record["epoch"], record["step"] = record["epoch"] + 1, 0
            record["done"] = record["epoch"] >= epochs
            save()
    return record


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "it"):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, leave=False)


def batch_of(data: JudgmentSet, positions: Sequence[int]):
    """The decoded batch of these samples (each distinct image once)."""
    return to_batch(data.samples.subset(list(positions)))


def predict(model: RigelModel, data: JudgmentSet, batch_size: int = 16, progress: bool = False) -> Tensor:
    """softmax(g(h)) for every sample (N, K) float64, in the set's order; the candidates of an image batched
    together."""
    out = torch.full((len(data), len(model.settings.labels)), float("nan"), dtype=torch.float64)
    with progress_bar(len(data), "scoring", progress, "sample") as bar:
        for batch in iter_batches(data.samples, batch_size):
            out[batch.indices] = model.probabilities(batch.images, batch.image_index, batch.candidates,
                                                     batch.references, batch_size=batch_size)
            bar.update(len(batch))
    return out


def correlation(expected: Tensor | np.ndarray, human: np.ndarray) -> dict[str, float]:
    """Kendall tau-c and tau-b of predicted and human scores (NaN where undefined)."""
    x = np.asarray(expected, dtype=np.float64)
    return {"kendall_tau_c": kendall_tau(x, human, "c"), "kendall_tau_b": kendall_tau(x, human, "b")}


def expectation(probs: Tensor) -> Tensor:
    return heads.label_expectation(probs)
