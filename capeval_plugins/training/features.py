"""Frozen backbones run once: their outputs cached on disk in shards (:func:`cached_shards`, also used by the
MSD aligner's vision-feature cache), and Rigel phase 1's backbone pass (:func:`extract_features`): the final
hidden state at the score position and the score tokens' log-probabilities there, for every sample.

The frozen backbone's outputs do not change between epochs, so phase 1 runs it once and trains the head on
the cache. The cache lives in ``<cache>/<key>/``, ``key`` a digest of the backbone (name, revision, dtype),
the prompts, labels and visual input, and the data (see :meth:`JudgmentSet.fingerprint`); it is written in
shards of ``shard_size`` samples, so an interrupted extraction resumes at the first missing shard, and a
second run on the same data (another head shape, temperature or seed) reuses it whole.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from capeval_plugins import files
from capeval_plugins.inputs import iter_batches
from capeval_plugins.digests import model_files_digest
from capeval_plugins.training.checkpoint import tensor_bytes
from capeval_plugins.training.data import JudgmentSet
from capeval_plugins.models.rigel import RigelModel
from capeval_plugins.training.state import progress_bar, signature


@dataclass
class Features:
    """Per sample: ``hidden`` (N, d) float32, ``teacher`` (N, K) float32 (full-vocabulary log-probabilities of
    the score tokens: softmax(teacher / tau) is the paper's q), ``scores`` (N,) human scores on [0, 1]."""

    hidden: Tensor
    teacher: Tensor
    scores: np.ndarray

    def __len__(self) -> int:
        return len(self.hidden)


def cache_key(model: RigelModel, data: JudgmentSet) -> str:
    judge, settings = model.judge, model.settings
    backbone = getattr(judge.model.config, "name_or_path", "") or type(judge.model).__name__
    dtype = str(next(judge.model.parameters()).dtype)
    # the backbone's files by content: new weights saved at the same path made other features (a path alone
    # reused the old ones)
    weights = model_files_digest(backbone, settings.revision)
    return signature("rigel-features-v2", backbone, weights, settings.revision, dtype, settings.labels, settings.prompts,
                     settings.reference_separator, settings.video_input, settings.video_fps, settings.answer_prefix,
                     data.fingerprint())[:32]


def extract_features(model: RigelModel, data: JudgmentSet, cache_dir: str | os.PathLike | None = None, *,
                     batch_size: int = 16, shard_size: int = 1024, progress: bool = True,
                     desc: str = "backbone") -> Features:
    """Run the backbone once over ``data`` (or read what an earlier run cached) and return the features."""
    folder = Path(cache_dir) / cache_key(model, data) if cache_dir is not None else None
    parts = cached_shards(folder, len(data), lambda start, stop: _extract(model, data.subset(range(start, stop)),
                                                                          batch_size),
                          shard_size=shard_size, progress=progress, desc=desc)
    hidden = torch.cat([p["hidden"] for p in parts]) if parts else torch.zeros((0, 0))
    teacher = torch.cat([p["teacher"] for p in parts]) if parts else torch.zeros((0, len(model.settings.labels)))
    return Features(hidden, teacher, data.scores.copy())


def cached_shards(folder: Path | None, n: int, compute: Callable[[int, int], dict[str, Tensor]], *,
                  shard_size: int = 1024, progress: bool = True, desc: str = "backbone",
                  keep: bool = True) -> list[dict[str, Tensor] | Path]:
    """A frozen model's outputs for samples ``0..n-1``, in shards of ``shard_size`` samples:
    ``compute(start, stop)`` gives the tensors of one shard (one row per sample). With a ``folder`` each
    shard is written there once and read back afterwards, so an interrupted extraction resumes at the first
    missing shard and a later run reuses them all. Returns the shards in order: their tensors, or with
    ``keep=False`` (a cache too large to hold in memory) the paths of their files."""
    if shard_size < 1:
        raise ValueError("shard_size must be at least 1")
    cache = None
    if folder is not None:  # a cache folder of the user's: files written by descriptor, never through a link
        cache, _ = files.Folder.open(folder, create=True, mine=True)
        cache.write("about.json", (json.dumps({"samples": n, "shard_size": shard_size}) + "\n").encode())
    elif not keep:
        raise ValueError("shards can only be left on disk when there is a folder to write them to")
    try:
        parts: list[dict[str, Tensor] | Path] = []
        with progress_bar(n, desc, progress, "sample") as bar:
            for start in range(0, n, shard_size):
                stop = min(start + shard_size, n)
                path = None if folder is None else folder / f"shard-{start // shard_size:05d}-{stop - start}.safetensors"
                part: dict[str, Tensor] | Path | None = None
                if cache is not None and cache.kind(path.name) == "file":
                    part = _read_shard(cache, path.name) if keep else (path if _valid(path) else None)
                if part is None:
                    tensors = compute(start, stop)
                    if cache is not None:
                        cache.write(path.name, tensor_bytes(tensors))
                    part = tensors if keep else path
                parts.append(part)
                bar.update(stop - start)
    finally:
        if cache is not None:
            cache.close()
    return parts


class ShardedRows:
    """Rows of a shard cache left on disk (``cached_shards(..., keep=False)``), read on demand through
    memory-mapped safetensors files: for caches too large to hold in memory. Each call opens the shards it
    needs and closes them again, so a cache of any number of shards holds no file open between calls."""

    def __init__(self, paths: Sequence[Path], shard_size: int):
        self.paths, self.shard_size = list(paths), shard_size

    def get(self, key: str, rows: Sequence[int]) -> Tensor:
        """``key``'s rows ``rows`` (in that order), stacked."""
        from safetensors import safe_open

        wanted: dict[int, list[tuple[int, int]]] = {}
        for position, row in enumerate(rows):
            shard, offset = divmod(int(row), self.shard_size)
            wanted.setdefault(shard, []).append((position, offset))
        picked: list[Tensor | None] = [None] * len(rows)
        for shard, places in wanted.items():
            with safe_open(str(self.paths[shard]), framework="pt") as f:
                rows_of = f.get_slice(key)
                for position, offset in places:
                    picked[position] = rows_of[offset:offset + 1]
        return torch.cat(picked)


def _extract(model: RigelModel, part: JudgmentSet, batch_size: int) -> dict[str, Tensor]:
    n, d, k = len(part), int(model.judge.head.weight.shape[1]), len(model.settings.labels)
    hidden = torch.full((n, d), float("nan"))
    teacher = torch.full((n, k), float("nan"))
    for batch in iter_batches(part.samples, batch_size):  # the candidates of an image together
        out = model.states(batch.images, batch.image_index, batch.candidates, batch.references, batch_size=batch_size)
        hidden[batch.indices] = out.hidden.float().cpu()
        teacher[batch.indices] = out.label_logprobs.float().cpu()
    return {"hidden": hidden, "teacher": teacher}


def _valid(path: Path) -> bool:
    """Whether a shard file is whole (a shard cut short by an interruption is not)."""
    from capeval_plugins.resources.tensorfile import check_file

    try:
        check_file(path)
        return True
    except Exception:
        return False


def _read_shard(cache: files.Folder, name: str) -> dict[str, Tensor] | None:
    from capeval_plugins.resources.tensorfile import load_bytes

    try:
        return load_bytes(cache.read(name), str(cache.path / name))
    except Exception:  # a shard cut short by an interruption, a link: extract it again
        return None
