"""The :class:`Session` and its pass: the one batch loop every entry point feeds.

A pass is a list of :class:`Plan` (one per metric: its samples in scoring order, cut into batches, and what is
already done), and :meth:`Session.run` is the loop over them: it builds each metric's states (its model loads
here, after the checks), calls each metric's whole-pass hook (``prepare_corpus``), scores the batches of every
metric in one interleaved order (:func:`schedule`) while the next batch's images are decoded ahead
(:mod:`capeval_plugins.prefetch`), maps each one (decoded once for every metric of the pass, bisected on
failure, skipped per the policy: :mod:`capeval_plugins.session.mapping`), keeps its rows and adds its sums to the
metric's running total (:func:`~capeval_plugins.contract.merge_states`), hands the finished batch to the caller's
hook (the runner's checkpoint, the benchmark's score cache), stops after a batch when asked, and shows one
progress bar. What differs between callers is only what they plan and what they do with a finished batch.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from capeval_plugins import prefetch, preflight
from capeval_plugins.checkpoint import Progress
from capeval_plugins.core.arrays import on_cpu
from capeval_plugins.contract import CorpusSize, Metric, MetricResult, StateSpec, full_spec, merge_states
from capeval_plugins.inputs import InputError, ProblemReport, Samples, image_batches, to_batch
from capeval_plugins.session import mapping
from capeval_plugins.session.corpus import Corpus, Describe, _check, check_paths, corpus_size, policy

if TYPE_CHECKING:
    from torch import Tensor


@dataclass
class Plan:
    """One metric's work in a pass: its ``samples`` (this rank's share, in scoring order) cut into ``parts``
    (its batches), the samples validation left out (``skipped``), what is done (``progress``: a resumed run
    starts part-way; the loop adds each batch's rows, running sums and skipped samples to it) and the time
    its batches took (``seconds``: its model's load included; an image decoded for several metrics counts
    for the first that read it)."""

    name: str
    samples: Samples
    parts: list[Samples]
    skipped: dict[int, str] = field(default_factory=dict)
    progress: Progress = field(default_factory=Progress)
    spec: dict[str, StateSpec] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def n_batches(self) -> int:
        return len(self.parts)

    def fraction_done(self) -> float:
        return 1.0 if not self.n_batches else self.progress.batches / self.n_batches

    def all_skipped(self) -> dict[int, str]:
        """Every sample left out: by validation, then while scoring."""
        return {**self.skipped, **self.progress.skipped}


@dataclass
class Finished:
    """A batch the loop has just scored, as its hook sees it: its number ``k`` in the plan, its samples, its
    rows, its own sums (the running total is ``plan.progress.sums``) and the samples left out while scoring it."""

    k: int
    part: Samples
    rows: dict[str, Tensor]
    sums: dict[str, Tensor]
    skipped: dict[int, str]


@dataclass
class Outcome:
    """What a pass did: batches scored, and whether a stop cut it short."""

    scored: int = 0
    stopped: bool = False


@dataclass
class Folded:
    """A metric's merged state over a corpus, not finalized (e.g. a fit to save), and the samples it left out
    (``{index: reason}``), as a result would list them."""

    state: dict[str, Tensor]
    skipped: dict[int, str]


BatchHook = Callable[[Plan, Finished], None]


def schedule(batches: Mapping[str, int], done: Mapping[str, int] | None = None) -> list[tuple[str, int]]:
    """The order a pass scores its batches in: ``(metric, batch)`` pairs, every metric's batches interleaved
    by the fraction of its work each one completes (ties in the metrics' order), so the metrics of a pass
    advance together (and an image decoded for one is still cached when the others reach it). ``batches``:
    each metric's number of batches; ``done``: how many each has finished already (a resumed run)."""
    done = done or {}
    names = list(batches)
    events = sorted(((k + 1) / batches[name], i, k) for i, name in enumerate(names)
                    for k in range(done.get(name, 0), batches[name]))
    return [(names[i], k) for _, i, k in events]


class StopFlag:
    """A stop a caller can ask for (pass it as ``stop=``; :func:`capeval_plugins.runner.stop_on_signals` sets
    it from SIGINT/SIGTERM): true once asked. While a pass scores batches (``scoring``) a stop comes after the
    current batch; anywhere else nothing would poll it, so a signal handler stops the process at once."""

    def __init__(self) -> None:
        self.requested = False
        self.scoring = False

    def __call__(self) -> bool:
        return self.requested


class Session:
    """One streaming pass of some metrics over samples that arrive in batches: the only corpus loop.

    ``Session(metrics)`` opens it: every metric's local paths and machine requirements are checked before any
    work. Then :meth:`validate` a corpus (or one batch of a stream, or one corpus per metric) and
    :meth:`check_fits` the samples each metric will score, :meth:`plan` each metric's batches and :meth:`run`
    the pass (the loop), then :meth:`state` (a plan's batches merged) and :meth:`finalize`, or :meth:`merge`
    states from several passes or ranks first. :func:`~capeval_plugins.runner.run` plans a shard of a corpus and
    checkpoints each batch; the torchmetrics adapter plans the batch of an ``update()``; ``capeval bench`` plans
    what its score cache lacks and caches each batch; MID's ``fit_reference`` :meth:`fold` s a corpus. Images
    decoded for one metric are kept for the others of the session (:func:`~mapping.image_cache`)."""

    def __init__(self, metrics: Mapping[str, Metric], *, on_error: str | None = None,
                 describe: Describe | None = None) -> None:
        if not metrics:
            raise ValueError("no metric to run")
        self.metrics = dict(metrics)
        self.on_error = on_error
        self.describe = describe
        for metric in self.metrics.values():
            policy(metric, on_error)
            check_paths(metric)
        preflight.check(self.metrics)  # models, Java, extras: before any work
        self.cache = mapping.image_cache(list(self.metrics.values()))
        self._specs: dict[str, dict[str, StateSpec]] = {}
        self._order_checked: set[str] = set()

    def policy(self, name: str) -> str:
        return policy(self.metrics[name], self.on_error)

    # -- before any work ---------------------------------------------------------------------------------------

    def validate(self, corpus: Corpus | Mapping[str, Corpus]) -> dict[str, tuple[Samples, dict[int, str]]]:
        """Every metric's valid samples and the ones it skips (``{index: reason}``); the problems of every
        metric whose policy is ``"raise"``, reported together in one :class:`InputError`. ``corpus``: one for
        every metric, or each metric's own (``capeval bench`` gives each the references and frames it uses):
        an image shared by several is checked once and decoded once either way."""
        checked: dict = {}
        report, out = ProblemReport(), {}
        own = isinstance(corpus, Mapping)
        for name, metric in self.metrics.items():
            given = corpus[name] if own else corpus
            samples, problems = _check(metric, given, checked, shared=not own and len(self.metrics) > 1)
            if problems and self.policy(name) == "raise":
                report.merge(problems)
            out[name] = (samples, problems.reasons())
        if report:
            first = next(iter(corpus.values())) if own else corpus
            raise report.error(first.describe or self.describe)
        return out

    def check_fits(self, sizes: Mapping[str, CorpusSize]) -> None:
        """Every metric's :meth:`~capeval_plugins.contract.Metric.check_corpus` on the samples it will score
        (the whole corpus: corpus statistics merge over ranks); the problems, one line each, raise one
        :class:`InputError`."""
        problems = []
        for name, size in sizes.items():
            problem = self.metrics[name].check_corpus(size)
            if problem is not None:
                problems.append(problem.message(name))
        if problems:
            raise InputError("; ".join(problems))

    def spec(self, name: str) -> dict[str, StateSpec]:
        """The metric's states with the contract's own (building them may load its model: only after the
        checks)."""
        if name not in self._specs:
            self._specs[name] = full_spec(self.metrics[name])
        return self._specs[name]

    def batches(self, name: str, samples: Samples) -> list[Samples]:
        """``samples`` in the metric's batches (not yet decoded), an image's captions together: a batch ends at
        an image boundary wherever the next image does not fit (:func:`~capeval_plugins.inputs.image_batches`)."""
        return [samples.subset(positions) for positions in image_batches(samples, self.metrics[name].config.batch_size)]

    def plan(self, name: str, samples: Samples, skipped: Mapping[int, str] | None = None) -> Plan:
        """The metric's plan for ``samples`` (in its batches), with the samples validation left out."""
        return Plan(name, samples, self.batches(name, samples), dict(skipped or {}))

    # -- the loop --------------------------------------------------------------------------------------------

    def run(self, plans: Sequence[Plan], *, on_batch: BatchHook | None = None, stop: Callable[[], bool] | None = None,
            progress: bool = False, prepare: bool = True) -> Outcome:
        """The pass: every plan's remaining batches, in :func:`schedule`'s order, each mapped (:meth:`feed`) and
        added to its plan's progress, then handed to ``on_batch``; ``stop`` is polled after every batch but the
        last (a :class:`StopFlag` learns that batches are being scored). Each metric's whole-pass hook
        (``prepare_corpus``) runs first, with the text of all its samples (the batches already done included:
        what it prepares must not depend on where a resumed run had got to); ``release_corpus`` runs at the end.
        ``prepare=False`` leaves the whole-pass hook out: each batch is mapped alone, as it comes (the metric test
        kit's streams and ranks, whose batches must give the same bits whichever others share their pass)."""
        for plan in plans:
            began = time.perf_counter()
            plan.spec = plan.spec or self.spec(plan.name)  # may load the model: only now, after the checks
            plan.seconds += time.perf_counter() - began
        by_name = {plan.name: plan for plan in plans}
        events = schedule({p.name: p.n_batches for p in plans}, {p.name: p.progress.batches for p in plans})
        bar = _ProgressBar(plans, progress)
        outcome = Outcome()
        flag = stop if isinstance(stop, StopFlag) else None
        if flag is not None:
            flag.scoring = True  # a signal now stops after the batch at work
        try:
            for plan in plans if prepare else ():
                _prepare_corpus(self.metrics[plan.name], plan)
            # PREFETCH HOOK (capeval_plugins/prefetch.py): the next batch's images decoded and preprocessed
            # while this one is scored (but those this one decodes: another metric's batch of the same images)
            def ahead_of(n: int) -> prefetch.Prefetched | None:
                (name, k), before = events[n], events[n - 1] if n else None
                busy = by_name[before[0]].parts[before[1]] if before is not None else None
                return self.prefetch(name, by_name[name].parts[k], busy)

            images = any(plan.samples.images is not None for plan in plans)
            for n, (event, ready) in enumerate(prefetch.Prefetcher(ahead_of).iterate(range(len(events)), images), 1):
                name, k = events[event]
                _score_batch(self, by_name[name], k, ready, on_batch)
                outcome.scored += 1
                bar.update(plans)
                if stop is not None and n < len(events) and stop():
                    outcome.stopped = True
                    break
        finally:
            if flag is not None:
                flag.scoring = False
            bar.close()
            self.release()
        return outcome

    def prefetch(self, name: str, part: Samples, busy: Samples | None = None) -> prefetch.Prefetched | None:
        """What the prefetch thread prepares for a batch of ``name`` (see :mod:`capeval_plugins.prefetch`): its
        images decoded (those the cache holds, or the batch being scored meanwhile (``busy``) is decoding into it,
        are left to the cache), and the metric's own ``preprocess_images`` on them where it has one."""
        metric = self.metrics[name]
        if part.images is None or metric.image_reader() is not None:
            return None
        hooks = [metric.preprocess_images] if hasattr(metric, "preprocess_images") else []
        decoding = {s.key for s in busy.images} if busy is not None and busy.images is not None else set()
        return prefetch.prepare(part.images, hooks, known=lambda key: key in self.cache.items or key in decoding)

    def feed(self, name: str, part: Samples, ready: prefetch.Prefetched | None = None,
             ) -> tuple[dict[str, Tensor] | None, dict[int, str]]:
        """Map one batch: its state (rows, and the batch's own sums; None when no sample was scored) and the
        samples left out while scoring it, with their reasons (see :func:`~mapping.map_part`). ``ready``: its
        images as :meth:`prefetch` prepared them. The loop's step; a metric's first batch of a session probes
        its row order (:func:`~mapping.check_row_order`)."""
        cache = self.cache if ready is None else prefetch.CacheView(self.cache, ready)
        if name not in self._order_checked and len(part) > 1:
            self._order_checked.add(name)
            if not type(self.metrics[name]).__module__.startswith(mapping.OWN_METRICS):  # ours: checked by the suite
                mapping.check_row_order(self.metrics[name], part, cache)
        outs, skipped = mapping.map_part(self.metrics[name], part, cache, self.policy(name), self.describe)
        if len(outs) > 1:  # mapped in pieces (images too large together, or a failure bisected)
            return merge_states(self.spec(name), outs), skipped
        return (outs[0] if outs else None), skipped

    def release(self) -> None:
        for metric in self.metrics.values():
            metric.release_corpus()

    # -- after the loop --------------------------------------------------------------------------------------

    def state(self, plan: Plan) -> dict[str, Tensor]:
        """A plan's batches merged: their rows, then the running sums."""
        return self.merge(plan.name, [*plan.progress.rows, plan.progress.sums or {}])

    def merge(self, name: str, parts: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
        """:func:`~capeval_plugins.contract.merge_states` of batch, stream or rank parts, in their order."""
        return merge_states(self.spec(name), parts)

    def finalize(self, name: str, state: Mapping[str, Tensor], skipped: Mapping[int, str] | None = None,
                 allowed_repeats: int | None = 0) -> MetricResult:
        return mapping.finalize(self.metrics[name], state, skipped, allowed_repeats)

    def fold(self, corpus: Corpus, progress: bool = False) -> dict[str, Folded]:
        """Every metric's merged state over ``corpus`` in this process, not finalized (e.g. a fit to save), with
        the samples it left out: validated, checked, planned and run as any pass."""
        valid = self.validate(corpus)
        self.check_fits({name: corpus_size(samples) for name, (samples, _) in valid.items()})
        plans = [self.plan(name, samples, skipped) for name, (samples, skipped) in valid.items()]
        self.run(plans, progress=progress)
        return {plan.name: Folded(self.state(plan), plan.all_skipped()) for plan in plans}


def _prepare_corpus(metric: Metric, plan: Plan) -> None:
    """The metric's whole-pass hook, with the text of every sample of the plan, the batches already done
    included (what it prepares, e.g. BERTScore's texts embedded in chunks, longest first, must not depend on how
    far a resumed run had got, so that a resumed run ends with the same bits as an uninterrupted one). Skipped
    when every batch is done, or when the metric has no such hook (the corpus batch is not built for nothing)."""
    if plan.progress.batches < plan.n_batches and type(metric).prepare_corpus is not Metric.prepare_corpus:
        metric.prepare_corpus(to_batch(_without_images(plan.samples)))


def _without_images(samples: Samples) -> Samples:
    return dataclasses.replace(samples, images=None)


def _score_batch(session: Session, plan: Plan, k: int, ready: prefetch.Prefetched | None,
                 on_batch: BatchHook | None) -> None:
    """Feed batch ``k`` of a plan (with its images ``ready`` when prefetched), add it to the plan's progress (rows
    kept per batch, sums running) and hand it to ``on_batch``."""
    began = time.perf_counter()
    part = plan.parts[k]
    state, skipped = session.feed(plan.name, part, ready)
    cat = [key for key, want in plan.spec.items() if want.reduce == "cat"]
    sum_keys = [key for key, want in plan.spec.items() if want.reduce == "sum"]
    if state is None:  # every sample skipped
        rows = {key: plan.spec[key].empty() for key in cat}
        sums: dict[str, Tensor] = {}
    else:
        rows = {key: on_cpu(state[key]) for key in cat}
        sums = {key: on_cpu(state[key]) for key in sum_keys}
    if sum_keys:  # the running total: the sums so far, then this batch's (an empty first batch starts at zero)
        plan.progress.sums = merge_states({key: plan.spec[key] for key in sum_keys}, [plan.progress.sums or {}, sums])
    plan.progress.rows.append(rows)
    plan.progress.skipped.update(skipped)
    plan.progress.batches = k + 1
    plan.seconds += time.perf_counter() - began
    if on_batch is not None:
        on_batch(plan, Finished(k, part, rows, sums, skipped))


class _ProgressBar:
    """One progress bar for a pass over every metric: samples/s and ETA of the slowest metric."""

    def __init__(self, plans: Sequence[Plan], enabled: bool) -> None:
        self.total = max((len(p.samples) for p in plans), default=0)
        self.bar = None
        if enabled and self.total:
            from tqdm.auto import tqdm

            desc = ", ".join(p.name for p in plans)
            self.bar = tqdm(total=self.total, initial=self._position(plans), desc=desc, unit="sample",
                            dynamic_ncols=True)

    def _position(self, plans: Sequence[Plan]) -> int:
        return int(min(p.fraction_done() for p in plans) * self.total)

    def update(self, plans: Sequence[Plan]) -> None:
        if self.bar is not None:
            self.bar.update(self._position(plans) - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
