"""The one place a corpus becomes a :class:`~capeval_plugins.contract.MetricResult`.

``capeval score``, ``capeval bench``, ``Metric.__call__`` and the adapters all score through here:

1. **validate** everything before any model is loaded: every caption, image (file header, array layout),
   reference list and list length, for every metric of the run. Problems are reported together, each naming
   the sample's own index (the ``ids`` given, a caption file's row, else the position in the user's
   lists), never a position inside a batch or a shard. ``on_error="skip"`` scores the rest instead and
   records the skipped samples, with their reason, in the result;
2. **shard** the samples over torch.distributed ranks (contiguous slices, an image's captions together),
   **batch** them (each metric at its own batch size, images decoded once for all metrics of a pass),
   **map**, **merge** (``"cat"`` rows concatenated, ``"sum"`` statistics added; corpus metrics stay exact) and
   **finalize**;
3. **checkpoint** after every batch into a run folder, so that the same call resumes where an interrupted
   one stopped and ends with the same result, bit for bit, as an uninterrupted run (see
   :mod:`capeval_plugins.checkpoint`). :func:`stop_on_signals` turns SIGINT/SIGTERM into a stop after the
   current batch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import sys
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from capeval_plugins.checkpoint import Progress, RunStore
from capeval_plugins.contract import (ON_ERROR, Batch, Metric, MetricResult, StateSpec, finalize_state, full_spec,
                                      map_batch)
from capeval_plugins.inputs import (ImageSource, InputError, ProblemReport, Samples, _reason, group_by_image,
                                    to_batch, validate_samples)

Describe = Callable[[int], str]


class Interrupted(Exception):
    """A signal stopped the run after a finished batch; what was done is saved in the run folder."""


@dataclass
class Corpus:
    """A corpus as given: parallel lists, the ids that name its samples (default: positions) and how an
    error describes a sample (default ``"sample <id>"``; the CLI adds the caption file's line)."""

    candidates: Sequence[Any] | None
    images: Sequence[Any] | None = None
    references: Sequence[Any] | None = None
    group_ids: Sequence[Any] | None = None
    ids: Sequence[int] | None = None
    describe: Describe | None = None

    def name(self, index: int) -> str:
        return self.describe(index) if self.describe else f"sample {index}"

    def digest(self) -> str:
        """A fingerprint of the inputs (captions, references, groups, ids, and each image by its file and
        size, its bytes or its pixels), for checkpoints."""
        h = hashlib.sha256()
        n = len(self.candidates) if self.candidates is not None else 0
        texts = [self.candidates, self.references, self.group_ids, self.ids]
        for i in range(n):
            row = [None if c is None else _plain(c[i]) for c in texts]
            row.append(None if self.images is None else _image_token(self.images[i]))
            h.update(json.dumps(row, sort_keys=True, default=str).encode())
        return h.hexdigest()


def _plain(value: Any) -> Any:
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.tolist()
    return value


def _image_token(value: Any) -> Any:
    """A JSON-able identity of one image as given: a file by its real path and size, bytes and pixels by
    their hash."""
    from PIL import Image

    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        return ["file", os.path.realpath(path), os.path.getsize(path) if os.path.isfile(path) else None]
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", hashlib.sha1(value).hexdigest()]
    if isinstance(value, Image.Image):
        return ["pil", value.mode, value.size, hashlib.sha1(value.tobytes()).hexdigest()]
    if isinstance(value, (np.ndarray, torch.Tensor)):
        arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
        return ["array", str(arr.dtype), list(arr.shape), hashlib.sha1(np.ascontiguousarray(arr).tobytes()).hexdigest()]
    if isinstance(value, dict):
        return {k: _image_token(v) if k != "bytes" or v else None for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_image_token(v) for v in value]
    return repr(value)


@dataclass
class RunOutcome:
    """Results by metric name (None on ranks other than ``gather_to``) and what the run did."""

    results: dict[str, MetricResult | None]
    batches_scored: int = 0
    batches_resumed: int = 0
    samples: int = 0


@dataclass
class _Task:
    name: str
    metric: Metric
    samples: Samples  # this rank's share, in scoring order
    skipped: dict[int, str]  # left out by validation, over the whole corpus
    on_error: str
    progress: Progress = field(default_factory=Progress)
    spec: dict[str, StateSpec] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.metric.config.batch_size

    @property
    def n_batches(self) -> int:
        return -(-len(self.samples) // self.batch_size)

    def batch(self, k: int) -> Samples:
        return self.samples.subset(range(k * self.batch_size, min((k + 1) * self.batch_size, len(self.samples))))

    def fraction_done(self) -> float:
        return 1.0 if not self.n_batches else self.progress.batches / self.n_batches


# ---------------------------------------------------------------------------------------------------------
# Validation


def policy(metric: Metric, on_error: str | None = None) -> str:
    how = on_error if on_error is not None else metric.config.on_error
    if how not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {how!r}")
    return how


def validate(metric: Metric, corpus: Corpus, on_error: str | None = None,
             checked: dict | None = None) -> tuple[Samples, dict[int, str]]:
    """The samples ``metric`` can score and the ones it skips (``{index: reason}``); with ``on_error="raise"``
    any problem raises one :class:`InputError` naming every bad sample (the first 20, then a count)."""
    samples, problems = _check(metric, corpus, checked)
    if problems and policy(metric, on_error) == "raise":
        raise problems.error(corpus.describe)
    return samples, problems.reasons()


def _check(metric: Metric, corpus: Corpus, checked: dict | None,
           shared: bool = False) -> tuple[Samples, ProblemReport]:
    """``shared``: the corpus serves several metrics, so inputs this one never uses are not its concern."""
    references = None if shared and metric.info.references == "never" else corpus.references
    return validate_samples(metric.info, corpus.images, corpus.candidates, references, corpus.group_ids,
                            corpus.ids, reader=metric.image_reader(), references_required=metric.references_required(),
                            checked=checked)


def _validate_all(metrics: Mapping[str, Metric], corpus: Corpus,
                  on_error: str | None) -> dict[str, tuple[Samples, dict[int, str]]]:
    """Every metric's valid samples; the problems of every metric that raises, reported together."""
    checked: dict = {}
    report, out = ProblemReport(), {}
    for name, metric in metrics.items():
        samples, problems = _check(metric, corpus, checked, shared=len(metrics) > 1)
        if problems and policy(metric, on_error) == "raise":
            report.merge(problems)
        out[name] = (samples, problems.reasons())
    if report:
        raise report.error(corpus.describe)
    return out


def check_paths(metric: Metric) -> None:
    """Options that name local files or folders (``Config.input_paths``) must exist: a typo fails here, not
    after a long load. Hub ids (``org/name``) are left to the loader."""
    from capeval_plugins.core.loading import local_path_problem

    for key in getattr(metric.config, "input_paths", ()):
        value = getattr(metric.config, key, None)
        problem = local_path_problem(value) if isinstance(value, str) and value else None
        if problem:
            raise InputError(f"{metric.info.name}: option {key}: {problem}")


# ---------------------------------------------------------------------------------------------------------
# Batching


class ImageCache:
    """Decoded images shared by the batches and metrics of one pass (least recently used first out); an
    image that fails to decode fails once, for every metric."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.items: OrderedDict[Any, Any] = OrderedDict()

    def load(self, source: ImageSource) -> Any:
        key = source.key
        if key in self.items:
            self.items.move_to_end(key)
        else:
            try:
                self.items[key] = source.load()
            except InputError as err:
                self.items[key] = err
            while len(self.items) > self.capacity:
                self.items.popitem(last=False)
        value = self.items[key]
        if isinstance(value, InputError):
            raise value
        return value


def build_batch(part: Samples, cache: ImageCache, on_error: str,
                describe: Describe | None = None) -> tuple[Batch | None, dict[int, str]]:
    """The batch of ``part`` and the samples dropped because their image would not decode (``"skip"``); with
    ``"raise"`` such an image raises, naming its sample."""
    skipped: dict[int, str] = {}
    if part.images is not None:
        failed: dict[Any, str] = {}
        for source in {s.key: s for s in part.images}.values():
            try:
                cache.load(source)
            except InputError as err:
                failed[source.key] = _reason(err, source.index)
        if failed:
            bad = [p for p, s in enumerate(part.images) if s.key in failed]
            if on_error == "raise":
                first = part.indices[bad[0]]
                name = describe(first) if describe else f"sample {first}"
                err = InputError(f"{name}: {failed[part.images[bad[0]].key]}")
                err.rank_specific = True  # found while scoring this rank's share, not by the shared validation
                raise err
            skipped = {part.indices[p]: failed[part.images[p].key] for p in bad}
            part = part.subset([p for p in range(len(part)) if p not in set(bad)])
    return (to_batch(part, cache.load) if len(part) else None), skipped


def iter_batches(metric: Metric, samples: Samples, on_error: str | None = None,
                 describe: Describe | None = None) -> Iterator[tuple[Batch | None, dict[int, str]]]:
    """``samples`` in batches of the metric's size (an image's captions together), each with the samples
    skipped from it."""
    ordered = samples.subset(group_by_image(samples))
    size = metric.config.batch_size
    cache = ImageCache(2 * size)
    how = policy(metric, on_error)
    for start in range(0, len(ordered), size):
        yield build_batch(ordered.subset(range(start, min(start + size, len(ordered)))), cache, how, describe)


def map_with_context(metric: Metric, batch: Batch) -> dict[str, Tensor]:
    """``map_batch``, with the samples of the batch named in any error."""
    try:
        return map_batch(metric, batch)
    except Exception as err:
        first, last = int(batch.indices.min()), int(batch.indices.max())
        if hasattr(err, "add_note"):
            err.add_note(f"(while {metric.info.name} scored the batch of samples {first}..{last})")
        raise


# ---------------------------------------------------------------------------------------------------------
# Merging and finalizing


def local_state(spec: Mapping[str, StateSpec], progress: Progress) -> dict[str, Tensor]:
    """One rank's merged state: rows concatenated in batch order, sums as accumulated."""
    state = {}
    for key, want in spec.items():
        if want.reduce == "cat":
            state[key] = want.cat([rows[key] for rows in progress.rows])
        else:
            state[key] = progress.sums[key] if progress.sums is not None else want.empty()
    return state


def merge_ranks(spec: Mapping[str, StateSpec], states: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Rank states merged in rank order (deterministic: the same ranks give the same bits)."""
    merged = {}
    for key, want in spec.items():
        if want.reduce == "cat":
            merged[key] = want.cat([s[key] for s in states])
        else:
            total = states[0][key].clone()
            for s in states[1:]:
                total.add_(s[key])
            merged[key] = total
    return merged


def finalize(metric: Metric, state: Mapping[str, Tensor], skipped: Mapping[int, str] | None = None) -> MetricResult:
    """Finalize a merged state and put the skipped samples back (NaN, with their reasons)."""
    return finalize_state(metric, state).with_skipped(dict(skipped or {}))


# ---------------------------------------------------------------------------------------------------------
# The run


def world(shard: bool) -> tuple[int, int]:
    if shard and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _shard(samples: Samples, rank: int, size: int) -> Samples:
    order = group_by_image(samples)
    return samples.subset(order[rank * len(order) // size : (rank + 1) * len(order) // size])


def fingerprint(metrics: Mapping[str, Metric], corpus: Corpus, world_size: int, on_error: str | None) -> dict:
    from capeval_plugins.core.loading import source_key

    described = {}
    for name, metric in metrics.items():
        options = dataclasses.asdict(metric.config)
        for key in getattr(metric.config, "input_paths", ()):
            if isinstance(options.get(key), str) and options[key]:
                options[key] = source_key(options[key])
        options["on_error"] = policy(metric, on_error)
        described[name] = {"metric": f"{type(metric).__module__}.{type(metric).__qualname__}", **options}
    return {"metrics": described, "inputs": corpus.digest(), "world_size": world_size}


def _gather(obj: Any, size: int, dst: int | None) -> list[Any] | None:
    if size == 1:
        return [obj]
    import torch.distributed as dist

    if dst is None:
        out: list[Any] = [None] * size
        dist.all_gather_object(out, obj)
        return out
    out = [None] * size if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def _open_store(run_dir: str | os.PathLike, fp: dict, restart: bool, rank: int, size: int) -> RunStore:
    """Rank 0 checks (or clears) the folder first; every rank then learns the verdict."""
    store = RunStore(run_dir, rank, size)
    error = None
    if rank == 0:
        try:
            store.check(fp, restart)
        except InputError as err:
            error = str(err)
    verdict = _gather(error, size, None)[0]
    if verdict is not None:
        raise InputError(verdict)
    if rank != 0:
        store.check(fp, False)
    return store


def run(
    metrics: Mapping[str, Metric],
    corpus: Corpus,
    *,
    on_error: str | None = None,
    run_dir: str | os.PathLike | None = None,
    restart: bool = False,
    progress: bool = False,
    shard: bool = False,
    gather_to: int | None = None,
    stop: Callable[[], bool] | None = None,
) -> RunOutcome:
    """Score ``corpus`` with every metric in one pass.

    ``on_error`` overrides each metric's own policy. ``run_dir``: checkpoint there after every batch and
    resume from it (a folder of another run is refused; ``restart`` clears it). ``shard``: split the work over
    torch.distributed ranks when it is initialised. ``gather_to``: the rank that finalizes (None: every
    rank). ``stop``: polled after every batch; when it says so, raise :class:`Interrupted`."""
    if not metrics:
        raise ValueError("no metric to run")
    for metric in metrics.values():
        check_paths(metric)
    valid = _validate_all(metrics, corpus, on_error)
    rank, size = world(shard)
    store = _open_store(run_dir, fingerprint(metrics, corpus, size, on_error), restart, rank, size) if run_dir else None

    tasks = [_Task(name, metric, _shard(valid[name][0], rank, size), valid[name][1], policy(metric, on_error))
             for name, metric in metrics.items()]
    for task in tasks:
        task.spec = full_spec(task.metric)  # may load the model: only now, after validation
        if store is not None:
            task.progress = store.load(task.name, any(s.reduce == "sum" for s in task.spec.values()))
    resumed = sum(t.progress.batches for t in tasks)
    cache = ImageCache(2 * max(t.batch_size for t in tasks))
    events = sorted(((k + 1) / t.n_batches, i, k) for i, t in enumerate(tasks) for k in range(t.progress.batches, t.n_batches))
    bar = _ProgressBar(tasks, progress and rank == 0)
    interrupted, scored = False, 0
    try:
        for task in tasks:
            _prepare_corpus(task)
        for n, (_, i, k) in enumerate(events, 1):
            _score_batch(tasks[i], k, cache, corpus.describe, store)
            scored += 1
            bar.update(tasks)
            if stop is not None and n < len(events) and stop():
                interrupted = True
                break
    finally:
        bar.close()
        for task in tasks:
            task.metric.release_corpus()
    counts = _gather((interrupted, scored, resumed), size, None)  # every rank learns whether any stopped
    scored, resumed = sum(c[1] for c in counts), sum(c[2] for c in counts)
    if any(c[0] for c in counts):
        done, total = sum(t.progress.batches for t in tasks), sum(t.n_batches for t in tasks)
        where = f", saved in {run_dir}" if run_dir else ""
        raise Interrupted(f"interrupted after {done} of {total} batches{' on this rank' if size > 1 else ''}{where}")

    results: dict[str, MetricResult | None] = {}
    for task in tasks:
        mine = (local_state(task.spec, task.progress), task.progress.skipped)
        parts = _gather(mine, size, gather_to)
        if parts is None:
            results[task.name] = None
            continue
        skipped = dict(task.skipped)
        for _, part_skipped in parts:
            skipped.update(part_skipped)
        results[task.name] = finalize(task.metric, merge_ranks(task.spec, [p for p, _ in parts]), skipped)
    n = len(corpus.candidates) if corpus.candidates is not None else 0
    return RunOutcome(results, scored, resumed, n)


def _prepare_corpus(task: _Task) -> None:
    """The metric's whole-corpus hook, with the text of every sample this pass still has to map."""
    todo = task.samples.subset(range(min(task.progress.batches * task.batch_size, len(task.samples)),
                                     len(task.samples)))
    if len(todo):
        task.metric.prepare_corpus(to_batch(dataclasses.replace(todo, images=None)))


def _score_batch(task: _Task, k: int, cache: ImageCache, describe: Describe | None, store: RunStore | None) -> None:
    batch, skipped = build_batch(task.batch(k), cache, task.on_error, describe)
    rows = {key: want.empty() for key, want in task.spec.items() if want.reduce == "cat"}
    sum_keys = [key for key, want in task.spec.items() if want.reduce == "sum"]
    if batch is not None:
        out = map_with_context(task.metric, batch)
        rows = {key: out[key].cpu() for key in rows}
        if sum_keys and task.progress.sums is None:  # the first batch's sums start the running total
            task.progress.sums = {key: out[key].cpu().clone() for key in sum_keys}
        elif sum_keys:
            for key in sum_keys:
                task.progress.sums[key].add_(out[key].cpu())
    elif sum_keys and task.progress.sums is None:  # an empty first batch (all skipped)
        task.progress.sums = {key: task.spec[key].empty() for key in sum_keys}
    task.progress.rows.append(rows)
    task.progress.skipped.update(skipped)
    task.progress.batches = k + 1
    if store is not None:
        store.save(task.name, k, rows, task.progress.sums, skipped)


class _ProgressBar:
    """One progress bar for a pass over every metric: samples/s and ETA of the slowest metric."""

    def __init__(self, tasks: list[_Task], enabled: bool) -> None:
        self.total = max((len(t.samples) for t in tasks), default=0)
        self.bar = None
        if enabled and self.total:
            from tqdm.auto import tqdm

            desc = ", ".join(t.name for t in tasks)
            self.bar = tqdm(total=self.total, initial=self._position(tasks), desc=desc, unit="sample",
                            dynamic_ncols=True)

    def _position(self, tasks: list[_Task]) -> int:
        return int(min(t.fraction_done() for t in tasks) * self.total)

    def update(self, tasks: list[_Task]) -> None:
        if self.bar is not None:
            self.bar.update(self._position(tasks) - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def score_many(metrics: Mapping[str, Metric], images: Sequence[Any] | None = None,
               candidates: Sequence[str] | None = None, references: Sequence[Any] | None = None, *,
               group_ids: Sequence[Any] | None = None, ids: Sequence[int] | None = None, on_error: str | None = None,
               run_dir: str | os.PathLike | None = None, restart: bool = False, progress: bool = False,
               shard: bool = False, describe: Describe | None = None) -> dict[str, MetricResult]:
    """Score one corpus with several metrics in one pass (images decoded once, shared backbones loaded
    once). With ``run_dir``, the folder is removed once the run is complete. ``describe(index)`` names a
    sample in errors (default ``"sample <index>"``)."""
    corpus = Corpus(candidates, images, references, group_ids, ids, describe)
    outcome = run(metrics, corpus, on_error=on_error, run_dir=run_dir, restart=restart, progress=progress,
                  shard=shard)
    if run_dir is not None:
        finish(run_dir, shard)
    return outcome.results  # type: ignore[return-value]


def score(metric: Metric, images: Sequence[Any] | None = None, candidates: Sequence[str] | None = None,
          references: Sequence[Any] | None = None, **kwargs: Any) -> MetricResult:
    """Score one corpus with one metric (see :func:`score_many` for the options)."""
    return score_many({metric.info.name: metric}, images, candidates, references, **kwargs)[metric.info.name]


def finish(run_dir: str | os.PathLike, shard: bool = False) -> None:
    """Remove a finished run's folder (rank 0, once every rank is done with it)."""
    rank, size = world(shard)
    if size > 1:
        torch.distributed.barrier()
    if rank == 0:
        RunStore(run_dir).remove()


@contextmanager
def stop_on_signals() -> Iterator[Callable[[], bool]]:
    """SIGINT and SIGTERM ask the run to stop after the current batch (a second Ctrl-C stops at once).
    Yields the flag to pass as ``run(stop=...)``. Outside the main thread, signals are left alone."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag.is_set
        return

    def handler(signum: int, frame: Any) -> None:
        if flag.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag.set()
        print(f"capeval: {signal.Signals(signum).name}: stopping after the current batch", file=sys.stderr,
              flush=True)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag.is_set
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
