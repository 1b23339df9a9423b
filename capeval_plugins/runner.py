"""A whole corpus through one :class:`~capeval_plugins.session.Session` pass: :func:`run` (``capeval score``, the
evaluate, pycocoevalcap, lm-eval and lmms-eval adapters, and ``Metric.__call__`` through :func:`score`).

The batch loop itself is the session's (:meth:`Session.run <capeval_plugins.session.Session.run>`: batches,
their order, prefetching, mapping, skips, stop after a batch). Around it the runner **shards** the samples over
torch.distributed ranks (contiguous slices of the image-grouped order, cut at image boundaries),
**checkpoints** every finished batch into a run folder (the loop's batch hook), so that the same call resumes
where an interrupted one stopped and ends with the same result, bit for bit, as an uninterrupted run (see
:mod:`capeval_plugins.checkpoint`), and **gathers** the ranks in rank order before finalizing.
:func:`stop_on_signals` turns SIGINT/SIGTERM into a stop after the current batch.

The session's names (``Session``, ``Corpus``, ``schedule``, ``StopFlag``, ``ImageCache``, ``map_part``, ...) are
importable from here too, as before the session had a package of its own.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from capeval_plugins.checkpoint import RunFolderError, RunStore, batch_digest
from capeval_plugins.contract import Metric, MetricResult
from capeval_plugins.digests import ContentDigests
from capeval_plugins.files import FileError
from capeval_plugins.inputs import InputError, Samples, image_runs
# the session's names, importable from the runner as before the session had a package of its own
from capeval_plugins.session import (BATCH_IMAGE_BYTES, IMAGE_CACHE_BYTES, not_a_sample_fault,  # noqa: F401
                                     OWN_METRICS, SIZE_SPEC, Corpus, Describe, Finished, ImageCache, Plan,
                                     RowOrderError, Session, StopFlag, build_batch, check_paths, check_row_order,
                                     checks_corpus, corpus_size, finalize, image_bytes, image_cache, image_pieces,
                                     map_part, policy, schedule, size_of_rows, size_rows, validate)


class Interrupted(Exception):
    """A signal stopped the run after a finished batch; what was done is saved in the run folder."""

@dataclass
class RunOutcome:
    """Results by metric name (None on ranks other than ``gather_to``) and what the run did."""

    results: dict[str, MetricResult | None]
    batches_scored: int = 0
    batches_resumed: int = 0
    samples: int = 0
    run_id: str | None = None  # the run in the run folder, for :func:`finish`


# ---------------------------------------------------------------------------------------------------------
# The run


def world(shard: bool) -> tuple[int, int]:
    torch = sys.modules.get("torch")  # a process group needs torch imported: none without it
    if shard and torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _shard(samples: Samples, rank: int, size: int) -> Samples:
    """This rank's contiguous slice of the image-grouped order, cut at the image boundary nearest to an even
    split, so that no image's work is done on two ranks."""
    order, runs = image_runs(samples)
    bounds = np.concatenate([[0], np.cumsum(runs, dtype=np.int64)])

    def cut(r: int) -> int:
        target = r * len(order) // size
        right = int(np.searchsorted(bounds, target))  # bounds[right - 1] < target <= bounds[right]
        left = max(right - 1, 0)
        return int(bounds[right] if bounds[right] - target < target - bounds[left] else bounds[left])

    return samples.subset(order[cut(rank):cut(rank + 1)])


def local_inputs(metrics: Iterable[Metric]) -> list[str]:
    """The local files and folders the metrics' options name (``Config.input_paths``: models, saved fits,
    feature folders): an output must not be one of them or lie inside one."""
    found = []
    for metric in metrics:
        for key in getattr(metric.config, "input_paths", ()):
            value = getattr(metric.config, key, None)
            if isinstance(value, str) and value and os.path.exists(os.path.expanduser(value)):
                found.append(os.path.expanduser(value))
    return found


# How samples are cut into shards and batches: part of a run's fingerprint, so that a run folder whose batches
# were cut otherwise (before batches ended at image boundaries) is refused with a word naming restart, never
# resumed against another plan.
BATCH_PLAN = "image-aligned"


def fingerprint(metrics: Mapping[str, Metric], corpus: Corpus, world_size: int, on_error: str | None) -> dict:
    """What a run folder is a run of: every metric with its options, the models and data files they name (by
    content: a local folder's files are hashed, a hub id resolves to its cached commit), the inputs (by
    content, see :meth:`Corpus.digest`), the world size and how batches are cut (:data:`BATCH_PLAN`)."""
    contents = ContentDigests()  # each file hashed once in this run
    described = {}
    for name, metric in metrics.items():
        options = {**dataclasses.asdict(metric.config), **contents.options(metric.config,
                                                                         defaults=metric.default_sources())}
        options["on_error"] = policy(metric, on_error)
        described[name] = {"metric": f"{type(metric).__module__}.{type(metric).__qualname__}", **options}
    return {"metrics": described, "inputs": corpus.digest(contents), "world_size": world_size, "batches": BATCH_PLAN}


def gather(obj: Any, size: int, dst: int | None) -> list[Any] | None:
    """``obj`` of every rank, in rank order, on every rank (``dst`` None) or on rank ``dst`` only (None elsewhere)."""
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
    """Rank 0 locks and checks (or clears) the folder first; every rank then learns the verdict and the run
    id. Rank 0 holds the lock until the run ends."""
    store = RunStore(run_dir, rank, size)
    verdict: tuple[str, str] | tuple[str, bytes] | None = None
    error: Exception | None = None
    if rank == 0:
        try:
            store.open(fp, restart)
            verdict = (store.run_id, store.key)
        except (InputError, FileError) as err:
            error, verdict = err, (str(err), getattr(err, "cli_message", str(err)))
    verdict = gather(verdict, size, None)[0]
    if error is not None:
        raise error
    if isinstance(verdict[1], str):
        raise _RankError(*verdict)
    store.attach(*verdict)  # the run's key too: ranks on other machines need not share the user's secret
    return store


class _RankError(RunFolderError):
    """A run-folder error found on one rank, raised on every rank with both its messages."""

    def __init__(self, python_message: str, cli_message: str) -> None:
        InputError.__init__(self, python_message)
        self.text = python_message
        self._cli = cli_message

    @property
    def cli_message(self) -> str:
        return self._cli


def _load_progress(plans: list[Plan], store: RunStore, size: int) -> None:
    """Every plan's saved progress, checked against the run and its batch plan; a damaged part on any rank
    stops every rank."""
    error, mine = None, None
    try:
        for plan in plans:
            has_sums = any(s.reduce == "sum" for s in plan.spec.values())
            plan.progress = store.load(plan.name, has_sums, [batch_digest(part.indices) for part in plan.parts])
    except (RunFolderError, FileError) as err:
        error, mine = err, (str(err), getattr(err, "cli_message", str(err)))
    errors = [e for e in gather(mine, size, None) if e is not None]
    if error is not None:
        raise error
    if errors:
        raise _RankError(*errors[0])


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
    """Score ``corpus`` with every metric in one pass (one :class:`Session`).

    ``on_error`` overrides each metric's own policy. ``run_dir``: checkpoint there after every batch and
    resume from it (a folder of another run is refused; ``restart`` clears it). ``shard``: split the work over
    torch.distributed ranks when it is initialised. ``gather_to``: the rank that finalizes (None: every
    rank). ``stop``: polled after every batch; when it says so, raise :class:`Interrupted`."""
    session = Session(metrics, on_error=on_error, describe=corpus.describe)
    valid = session.validate(corpus)
    session.check_fits({name: corpus_size(samples) for name, (samples, _) in valid.items()})
    rank, size = world(shard)
    store = _open_store(run_dir, fingerprint(metrics, corpus, size, on_error), restart, rank, size) if run_dir else None
    plans = [session.plan(name, _shard(valid[name][0], rank, size), valid[name][1]) for name in metrics]
    try:
        return _run_plans(session, plans, corpus, store, run_dir, progress, rank, size, gather_to, stop)
    except (RunFolderError, FileError):  # a refusal changes nothing: the folder is left as it is
        raise
    except BaseException:
        # a run that started afresh and finished no batch leaves nothing to resume (one process: other ranks
        # may have saved some); a folder that held progress is never removed by a failure
        if store is not None and size == 1 and not store.had_progress and not any(p.progress.batches for p in plans):
            store.remove()
        raise
    finally:
        if store is not None:
            store.close()


def _run_plans(session: Session, plans: list[Plan], corpus: Corpus, store: RunStore | None, run_dir: Any,
               progress: bool, rank: int, size: int, gather_to: int | None,
               stop: Callable[[], bool] | None) -> RunOutcome:
    """The session's pass over this rank's plans, each finished batch saved in the run folder; then the ranks
    gathered in rank order and finalized."""
    for plan in plans:
        plan.spec = session.spec(plan.name)  # may load the model: only now, after validation
    if store is not None:
        _load_progress(plans, store, size)
    resumed = sum(p.progress.batches for p in plans)

    def save(plan: Plan, done: Finished) -> None:
        store.save(plan.name, done.k, done.rows, plan.progress.sums, done.skipped, batch_digest(done.part.indices))

    outcome = session.run(plans, on_batch=save if store is not None else None, stop=stop,
                          progress=progress and rank == 0)
    counts = gather((outcome.stopped, outcome.scored, resumed), size, None)  # every rank learns whether any stopped
    scored, resumed = sum(c[1] for c in counts), sum(c[2] for c in counts)
    if any(c[0] for c in counts):
        done, total = sum(p.progress.batches for p in plans), sum(p.n_batches for p in plans)
        where = f", saved in {run_dir}" if run_dir else ""
        raise Interrupted(f"interrupted after {done} of {total} batches{_stopped_ranks(counts, rank)}{where}")

    results: dict[str, MetricResult | None] = {}
    stage = _FinalizeBar(plans, progress and rank == (gather_to or 0))
    for plan in plans:
        stage.start(plan.name)
        # this rank's batches (their rows, then the running sums), then the ranks in order: one reduce
        parts = gather((session.state(plan), plan.progress.skipped), size, gather_to)
        if parts is None:
            results[plan.name] = None
            continue
        skipped = dict(plan.skipped)
        for _, part_skipped in parts:
            skipped.update(part_skipped)
        results[plan.name] = session.finalize(plan.name, session.merge(plan.name, [p for p, _ in parts]), skipped)
    stage.close()
    n = len(corpus.candidates) if corpus.candidates is not None else 0
    return RunOutcome(results, scored, resumed, n, store.run_id if store is not None else None)


def _stopped_ranks(counts: Sequence[tuple], rank: int) -> str:
    """Under several ranks, which were asked to stop: rank 0 alone prints, and its own count ("38 of 38") may be
    of a rank that finished everything."""
    if len(counts) == 1:
        return ""
    stopped = [str(r) for r, c in enumerate(counts) if c[0]]
    asked = f"rank {stopped[0]} was" if len(stopped) == 1 else f"ranks {', '.join(stopped)} were"
    return f" on this rank, rank {rank} ({asked} asked to stop)"


class _FinalizeBar:
    """After the batches, the corpus step of every metric (a corpus metric's whole computation, e.g. CIDEr's
    idf or METEOR's Java scorer, happens here): one bar over the metrics, naming the one at work."""

    def __init__(self, plans: list[Plan], enabled: bool) -> None:
        self.bar = None
        self.started = False  # ours, not tqdm's postfix: a bar disabled by TQDM_DISABLE has none
        if enabled and plans:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=len(plans), desc="corpus scores", unit="metric", dynamic_ncols=True)

    def start(self, name: str) -> None:
        if self.bar is not None:
            if self.started:  # the previous metric is done
                self.bar.update(1)
            self.started = True
            self.bar.set_postfix_str(name, refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.bar.total - self.bar.n)
            self.bar.set_postfix_str("done", refresh=False)
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
        finish(run_dir, shard, outcome.run_id)
    return outcome.results  # type: ignore[return-value]


def score(metric: Metric, images: Sequence[Any] | None = None, candidates: Sequence[str] | None = None,
          references: Sequence[Any] | None = None, **kwargs: Any) -> MetricResult:
    """Score one corpus with one metric (see :func:`score_many` for the options)."""
    return score_many({metric.info.name: metric}, images, candidates, references, **kwargs)[metric.info.name]


def finish(run_dir: str | os.PathLike, shard: bool = False, run_id: str | None = None) -> None:
    """Remove what a finished run wrote in its folder (rank 0, once every rank is done with it): the files its
    manifest lists, the folder itself only if the run made it and nothing else is in it. ``run_id`` (from
    :class:`RunOutcome`): only if the folder still holds that run; a folder another run holds now is left."""
    rank, size = world(shard)
    if size > 1:
        sys.modules["torch"].distributed.barrier()
    if rank == 0:
        RunStore(run_dir).remove(run_id)


@contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """SIGINT and SIGTERM ask the run to stop after the current batch, or at once outside the batches or
    when sent twice (see :class:`StopFlag`). Outside the main thread, signals are left alone."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum: int, frame: Any) -> None:
        if flag.requested or not flag.scoring:
            raise KeyboardInterrupt
        flag.requested = True
        print(f"capeval: {signal.Signals(signum).name}: stopping after the current batch", file=sys.stderr,
              flush=True)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
