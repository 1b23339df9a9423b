"""Score a benchmark with registered metrics and report what papers report.

Every metric is scored in one pass of a :class:`~capeval_plugins.session.Session` over what the score cache lacks
(:func:`score_metrics`), as ``capeval score`` scores several metrics: an image is decoded once for all metrics
that read it and a shared backbone loads once. Pointwise metrics (:class:`~capeval_plugins.contract.PointwiseMetric`
without groups) are scored once per distinct sample (Flickr8k-Expert's three ratings of a caption share one
score), each batch landing in the cache as it finishes, so an interrupted run resumes where it stopped. Every
other metric (corpus-level such as CIDEr, group metrics) is scored on all rows of a corpus together, because its
per-sample scores depend on the others; its scores are cached per corpus.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from capeval_plugins.bench.benchmarks import Benchmark, get_benchmark
from capeval_plugins.bench.cache import NoCache, ScoreCache, default_cache_path, digest, metric_key, sample_keys
from capeval_plugins.bench.data import Captions, Pairs, Ratings, resolve_images
from capeval_plugins.bench.protocols import Evaluation, evaluate
from capeval_plugins import files
from capeval_plugins.caption_files import json_safe
from capeval_plugins.contract import Metric, PointwiseMetric
from capeval_plugins.core.arrays import host
from capeval_plugins.digests import ContentDigests
from capeval_plugins.inputs import InputError
from capeval_plugins.session import Corpus, Finished, Plan, Session, corpus_size


LABEL_ROWS = 1_000_000  # the records a label file may hold: it may label every split, not only the benchmark's


@dataclass
class MetricRun:
    """One metric's per-row scores on a benchmark (and its per-sample extras when asked for), what producing
    them cost, and the score file they were read from (``--scores``)."""

    scores: np.ndarray
    seconds: float
    from_cache: int
    computed: int
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    source: str = ""
    matched_by: str = ""  # a score file's key that matched its rows: row, image path or image file name


@dataclass
class BenchReport:
    benchmark: Benchmark
    data: Ratings | Pairs
    runs: dict[str, MetricRun]
    evaluations: dict[str, Evaluation]
    comparisons: list[dict]
    settings: dict[str, Any]
    wall_time: float = 0.0
    source: str = ""

    @property
    def kind(self) -> str:
        return self.benchmark.protocol.kind

    def to_dict(self) -> dict[str, Any]:
        """``{"benchmark", "protocol", "data", "results": {metric: {...}}, "comparisons", "wall_time_s"}``,
        every correlation and accuracy on the 0-100 scale, None where there is none."""
        protocol = self.benchmark.protocol
        proto = {"name": self.benchmark.name, "variant": self.benchmark.variant, "kind": protocol.kind,
                 "statistic": protocol.primary, "description": protocol.description, "scale": 100,
                 "bootstrap": {"replicates": self.settings["bootstrap"], "unit": self.settings["unit"],
                               "seed": self.settings["seed"], "level": 0.95}}
        if self.kind == "pairwise":
            proto["ties"] = self.settings["ties"]
            if self.settings.get("tie_margin"):
                proto["tie_margin"] = self.settings["tie_margin"]
            if protocol.human_ties != "count":
                proto["human_ties"] = protocol.human_ties
            if protocol.model_ranking is not None and protocol.elo == "single":
                proto["shuffle_rounds"] = protocol.shuffle_rounds
            if protocol.category_groups:
                proto["groups"] = {k: list(v) for k, v in protocol.category_groups.items()}
        if protocol.round_scores is not None:
            proto["round_scores"] = protocol.round_scores
        if self.settings.get("num_references") is not None:
            proto["num_references"] = self.settings["num_references"]
        data = {"path": self.source, "rows": len(self.data.captions), "excluded": self.data.excluded,
                **self.data.notes}
        if isinstance(self.data, Pairs):
            data["pairs"] = len(self.data)
        results = {name: self._result(name) for name in self.evaluations}
        # a figure without a value (no valid row, a constant score) is None: strict JSON has no NaN
        return json_safe({"benchmark": self.benchmark.name, "protocol": proto, "data": data, "results": results,
                          "comparisons": self.comparisons, "wall_time_s": round(self.wall_time, 3)})

    def _result(self, name: str) -> dict[str, Any]:
        ev, run = self.evaluations[name], self.runs[name]
        out: dict[str, Any] = {}
        ci = {k: _interval(v) for k, v in ev.replicates.items()}
        if self.kind == "correlation":
            out.update(ev.stats)
            out["n"] = ev.n
            if ev.replicates:
                out["ci95"] = ci
            if ev.system_stats:
                out["system"] = {**ev.system_stats, "n": ev.n_systems}
            if ev.category_stats:
                out["categories"] = {c: {**s, "n": ev.category_sizes[c]} for c, s in ev.category_stats.items()}
        elif isinstance(self.data, Pairs) and self.data.graded is not None:
            out.update(ev.stats)
            out["n"] = ev.n
            out["n_ties"] = ev.n_ties
            if ev.replicates:
                out["ci95"] = ci
        else:
            if "accuracy" in ev.stats:
                out["accuracy"] = ev.stats["accuracy"]
            out["n"] = ev.n
            out["n_ties"] = ev.n_ties
            out["categories"] = {}
            for cat, size in ev.category_sizes.items():
                entry = {"accuracy": ev.stats[f"category:{cat}"], "n": size}
                if ev.replicates:
                    entry["ci95"] = ci[f"category:{cat}"]
                out["categories"][cat] = entry
            groups = {k.removeprefix("group:"): {"accuracy": v} for k, v in ev.stats.items() if k.startswith("group:")}
            for group, entry in groups.items():
                if ev.replicates:
                    entry["ci95"] = ci[f"group:{group}"]
            if groups:
                out["groups"] = groups
            if ev.replicates and "accuracy" in ci:
                out["ci95"] = {"accuracy": ci["accuracy"]}
            if ev.system_stats:
                out["system"] = {**ev.system_stats, "n": ev.n_systems}
        if ev.n_invalid:
            out["n_invalid"] = ev.n_invalid
        if run.source:
            out["scores_file"] = run.source
            out["scores_matched_by"] = run.matched_by
        out["seconds"] = round(run.seconds, 3)
        out["from_cache"] = run.from_cache
        out["computed"] = run.computed
        return out

    def markdown(self) -> str:
        """The tables ``capeval bench`` prints: one row per metric, then the paired comparisons."""
        from capeval_plugins.bench.tables import report_markdown

        return report_markdown(self)


def _interval(values: np.ndarray) -> list[float] | None:
    from capeval_plugins.bench.protocols import interval

    return interval(values)


def is_pointwise(metric: Metric) -> bool:
    return isinstance(metric, PointwiseMetric) and not metric.info.groups


@dataclass
class _Inputs:
    """What one metric reads of a benchmark: its references (or none), its images at its own frame count (or
    none), its groups, each row's sample key and the metric's cache key and cache."""

    images: list | None
    references: list | None
    groups: list | None
    keys: list[str]
    key: str
    cache: Any


@dataclass
class _Job:
    """One metric's share of the benchmark's pass: the rows its score cache lacks (a pointwise metric: one row per
    distinct uncached sample; any other metric: all rows of one corpus whose scores are not cached)."""

    label: str  # the plan's name in the session: the metric's, or "<metric>#<corpus>" for a corpus
    name: str
    metric: Metric
    rows: list[int]
    inputs: _Inputs
    corpus_key: str | None = None  # a corpus job: its cache key

    def corpus(self, candidates: list[str]) -> Corpus:
        """The job's rows as a corpus; ids are benchmark rows, so errors name them and results come back by row."""
        inputs = self.inputs
        return Corpus([candidates[r] for r in self.rows], _pick(inputs.images, self.rows),
                      _pick(inputs.references, self.rows), _pick(inputs.groups, self.rows), ids=self.rows)


def score_metric(name: str, metric: Metric, captions: Captions, *, frames: int | None = None,
                 **kwargs: Any) -> MetricRun:
    """Per-row scores of one metric (see :func:`score_metrics`)."""
    return score_metrics({name: metric}, captions, frames={name: frames}, **kwargs)[name]


def score_metrics(metrics: Mapping[str, Metric], captions: Captions, *, images: str | os.PathLike | None = None,
                  cache: ScoreCache | NoCache | None = None, with_references: bool = False, progress: bool = True,
                  benchmark: str = "", extras: bool = False,
                  frames: Mapping[str, int | None] | None = None) -> dict[str, MetricRun]:
    """Per-row scores of every metric (NaN where a metric gave none), through the score cache, in ONE pass of a
    :class:`~capeval_plugins.session.Session` over what the cache lacks, as ``capeval score`` scores several
    metrics: each image decoded once for every metric that reads it, a backbone several metrics share loaded
    once, every metric's batches interleaved.

    A pointwise metric (:class:`~capeval_plugins.contract.PointwiseMetric` without groups) scores each distinct
    sample once (Flickr8k-Expert's three ratings of a caption share one score), and each of its batches lands in
    the cache as it finishes, so an interrupted run resumes where it stopped. Any other metric (corpus-level such
    as CIDEr, group metrics) scores all rows of a corpus together, because a sample's score depends on the
    others; its scores are cached per corpus. ``extras``: also each metric's one-value-per-sample extras, which
    the cache does not hold, so the metrics are then scored afresh. ``frames``: each metric's frame count."""
    cache = cache if cache is not None else NoCache()
    if extras:
        cache = _WriteOnly(cache)
    contents = ContentDigests()  # each file hashed once, for every metric
    jobs: list[_Job] = []
    inputs: dict[str, _Inputs] = {}
    found: dict[str, dict[str, float]] = {}  # pointwise: scores by distinct sample key
    by_row: dict[str, np.ndarray] = {}  # corpus metrics: scores by row
    counts = {name: [0, 0] for name in metrics}  # rows from the cache, rows computed
    collected: dict[str, dict[str, dict[Any, float]]] = {name: {} for name in metrics}
    for name, metric in metrics.items():
        inputs[name] = mine = _metric_inputs(name, metric, captions, images, with_references, benchmark,
                                             (frames or {}).get(name), cache, contents)
        order = _image_order(mine.images, len(mine.keys))
        if is_pointwise(metric):
            first: dict[str, int] = {}
            for row, k in enumerate(mine.keys):
                first.setdefault(k, row)
            found[name] = mine.cache.get(mine.key, first)
            todo = sorted((row for k, row in first.items() if k not in found[name]), key=order.__getitem__)
            counts[name] = [sum(k in found[name] for k in mine.keys), len(todo)]
            if todo:
                jobs.append(_Job(name, name, metric, todo, mine))
            continue
        by_row[name] = np.full(len(mine.keys), np.nan)
        for c, rows in enumerate(captions.corpora()):
            rows = rows.tolist()
            # a group metric's scores depend on its groups (one pair each on pairwise benchmarks)
            corpus_key = digest([mine.keys[i] for i in rows] +
                                ([] if mine.groups is None else [[mine.groups[i] for i in rows]]))
            cached = mine.cache.get_corpus(mine.key, corpus_key)
            if cached is not None and len(cached) == len(rows):
                by_row[name][rows] = cached
                counts[name][0] += len(rows)
            else:
                counts[name][1] += len(rows)
                jobs.append(_Job(f"{name}#{c}", name, metric, sorted(rows, key=order.__getitem__), mine, corpus_key))
    seconds = _run_jobs(jobs, captions.candidates, found, by_row, collected, progress) if jobs else {}
    runs = {}
    for name in metrics:
        keys = inputs[name].keys
        if name in found:
            scores = np.array([found[name].get(k, np.nan) for k in keys], dtype=np.float64)
            where = keys  # a pointwise metric's extras are kept by sample key
        else:
            scores, where = by_row[name], range(len(keys))
        # only when asked: the cache holds no extras, so a run from it has them for the recomputed rows alone
        extra_rows = {k: np.array([v.get(at, np.nan) for at in where])
                      for k, v in collected[name].items()} if extras else {}
        runs[name] = MetricRun(scores, seconds.get(name, 0.0), counts[name][0], counts[name][1], extra_rows)
    return runs


def _metric_inputs(name: str, metric: Metric, captions: Captions, images: Any, with_references: bool,
                   benchmark: str, frames: int | None, cache: Any, contents: ContentDigests) -> _Inputs:
    info = metric.info
    use_refs = info.references == "always" or (metric.uses_references() and with_references)
    if use_refs and captions.references is None:
        if info.references == "always":
            raise InputError(f"{name} needs references, and this {benchmark or 'benchmark'} file has none")
        use_refs = False
    use_images = info.images == "always" or (info.images == "optional" and images is not None)
    image_files = resolve_images(captions.images, images, benchmark, captions.segments, frames) if use_images else None
    refs = captions.references if use_refs else None
    key = metric_key(metric, use_images, use_refs, contents)
    if key is None:  # a hub model not cached yet: its scores cannot be tied to the weights they came from
        cache, key = NoCache(), ""
    keys = sample_keys(captions.candidates, refs, image_files, contents)
    groups = captions.groups if info.groups else None
    if metric.seeded_by_ids():  # its score depends on the row's id (and group) as well as on the sample
        keys = [digest([k, row, None if groups is None else groups[row]]) for row, k in enumerate(keys)]
    return _Inputs(image_files, refs, groups, keys, key, cache)


def _image_order(images: list | None, n: int) -> list[int]:
    """Each row's place in the pass: the first row of its image (then its own), so that every metric meets the
    images in one order and an image's captions batch together (each image encoded once, and, with several
    metrics, decoded once)."""
    if images is None:
        return list(range(n))
    first: dict[Any, int] = {}
    return [first.setdefault(_image_id(images[row]), row) * n + row for row in range(n)]


def _run_jobs(jobs: list[_Job], candidates: list[str], found: dict, by_row: dict, collected: dict,
              progress: bool) -> dict[str, float]:
    """The pass: one session, every job a plan; each finished batch of a pointwise job lands in its cache, each
    corpus job is finalized once its batches are done. Returns each metric's seconds."""
    session = Session({job.label: job.metric for job in jobs})
    valid = session.validate({job.label: job.corpus(candidates) for job in jobs})
    session.check_fits({label: corpus_size(samples) for label, (samples, _) in valid.items()})
    by_label = {job.label: job for job in jobs}

    def cache_batch(plan: Plan, done: Finished) -> None:
        job = by_label[plan.name]
        if job.corpus_key is None:
            state = session.merge(plan.name, [done.rows])
            _keep_pointwise(job, session.finalize(plan.name, state, done.skipped), found, collected)

    plans = [session.plan(label, samples, skipped) for label, (samples, skipped) in valid.items()]
    for plan in plans:  # samples validation left out: NaN, cached as such
        job = by_label[plan.name]
        if job.corpus_key is None and plan.skipped:
            _keep_pointwise(job, _skipped_result(job, plan.skipped), found, collected)
    session.run(plans, on_batch=cache_batch, progress=progress)
    seconds: dict[str, float] = {}
    for plan in plans:
        job = by_label[plan.name]
        if job.corpus_key is not None:
            began = time.perf_counter()
            result = session.finalize(plan.name, session.state(plan), plan.all_skipped())
            scores = dict(zip(result.indices.tolist(), host(result.scores).astype(np.float64).tolist()))
            values = np.array([scores[row] for row in job.rows], dtype=np.float64)
            job.inputs.cache.put_corpus(job.inputs.key, job.corpus_key, values)
            by_row[job.name][job.rows] = values
            _collect(collected[job.name], result, result.indices.tolist())
            plan.seconds += time.perf_counter() - began
        seconds[job.name] = seconds.get(job.name, 0.0) + plan.seconds
    return seconds


def _keep_pointwise(job: _Job, result: Any, found: dict, collected: dict) -> None:
    """A pointwise batch's scores (and extras) by sample key, in the cache as soon as they exist."""
    rows = result.indices.tolist()
    new = {job.inputs.keys[row]: float(s) for row, s in zip(rows, host(result.scores).astype(np.float64).tolist())}
    job.inputs.cache.put(job.inputs.key, new)
    found[job.name].update(new)
    _collect(collected[job.name], result, [job.inputs.keys[row] for row in rows])


def _skipped_result(job: _Job, skipped: Mapping[int, str]) -> Any:
    import torch

    from capeval_plugins.contract import MetricResult

    index = torch.tensor(sorted(skipped), dtype=torch.int64)
    return MetricResult(job.name, float("nan"), torch.full((len(index),), float("nan"), dtype=torch.float64), index)


class _WriteOnly:
    """A cache that stores new scores but finds none (``--extras`` needs every sample's extras computed)."""

    def __init__(self, cache: ScoreCache | NoCache) -> None:
        self.cache = cache

    def get(self, key, first):
        return {}

    def get_corpus(self, key, corpus_key):
        return None

    def put(self, key, values):
        self.cache.put(key, values)

    def put_corpus(self, key, corpus_key, values):
        self.cache.put_corpus(key, corpus_key, values)


def _collect(collected: dict, result, rows_or_keys) -> None:
    """Keep a result's one-value-per-sample extras by row (or sample key)."""
    for extra, values in result.extras.items():
        if isinstance(values, list) or values.dim() != 1:
            continue  # texts, or a vector per sample (an embedding, a per-token list), are no table row
        by = collected.setdefault(extra, {})
        for where, value in zip(rows_or_keys, values.double().cpu().tolist()):
            by[where] = value


def _pick(values, rows):
    return None if values is None else [values[i] for i in rows]


def _image_id(image: Any) -> Any:
    if isinstance(image, list):  # a video as frames
        return tuple(image)
    return id(image) if isinstance(image, dict) else image


def open_cache(cache: str | os.PathLike | ScoreCache | NoCache | None | bool) -> ScoreCache | NoCache:
    """``None`` / ``True``: the default cache file; ``False``: no cache; a path: that file."""
    if cache is False:
        return NoCache()
    if isinstance(cache, (ScoreCache, NoCache)):
        return cache
    return ScoreCache(default_cache_path() if cache in (None, True) else cache)


def run_inputs(source: Any, images: Any, scores: Mapping[str, Any], metrics: Mapping[str, Metric],
               cache: Any = None) -> list[str]:
    """What a benchmark run reads that an output must not replace: the benchmark and score files, the
    score cache, and the folders of local models (an output there would change the model's content digest).
    A data or image folder is only read by the file names it holds, so an output may sit in it."""
    from capeval_plugins.runner import local_inputs

    found = [p for p in (source, images, cache) if isinstance(p, (str, os.PathLike)) and os.path.isfile(p)]
    return found + [str(p) for p in scores.values()] + local_inputs(
        m for m in metrics.values() if isinstance(m, Metric))  # a scoring function names no model folder


def run_benchmark(benchmark: str | Benchmark, data: str | os.PathLike | Ratings | Pairs,
                  metrics: Mapping[str, Metric] | None = None, *, images: str | os.PathLike | None = None,
                  cache: Any = None, bootstrap: int = 1000, seed: int = 0, unit: str = "image",
                  ties: str | None = None, with_references: bool = False, progress: bool = True,
                  scores: Mapping[str, str | os.PathLike] | None = None, extras: bool = False,
                  save_scores: str | os.PathLike | None = None, num_references: int | None = None,
                  tie_margin: float | str | None = None, frames: int | Mapping[str, int] | None = None,
                  protocol: str | None = None, labels: str | os.PathLike | None = None,
                  shuffle_rounds: int | None = None, human_scale: tuple[float, float] | None = None) -> BenchReport:
    """Read the benchmark (unless ``data`` is already read), score it with every metric and evaluate them.

    ``metrics`` maps a label to a built metric or to a plain function ``(images, candidates, references) ->
    scores``, one per row (:mod:`capeval_plugins.bench.callables`); ``scores`` maps a label to a per-sample score file computed
    elsewhere (:mod:`capeval_plugins.bench.scorefiles`); both kinds are evaluated and compared together.
    ``images`` is the image (or video frame) folder, needed only by metrics that score images. ``cache``: see
    :func:`open_cache`. ``bootstrap`` replicates (0: none) resample ``unit`` (``"image"`` or ``"row"``) with
    ``seed``. ``ties`` counts a tied pair ``"wrong"``, ``"half"`` right, as a predicted ``"tie"`` or as a vote
    for the second caption (``"b"``) (default: the benchmark's official convention). ``with_references`` also gives references to metrics for which they are optional;
    ``num_references`` keeps the first n references of every row (0: none). ``frames``: a video given as a
    folder of frames is sampled to that many, uniformly (default: all); a mapping gives each metric its own
    count (as each metric's paper samples frames). ``tie_margin``: pairwise scores within it are a metric tie
    (default: the protocol's; 0: only equal scores; ``"calibrated"``: as many ties as humans gave at most).
    ``protocol`` names one of the benchmark's protocols (default: its official one; e.g. ``"msd-score"`` on
    CapArena and DOCENT). ``labels``: a label set (:mod:`capeval_plugins.bench.labels`) whose judgments replace
    the benchmark file's where it names the same rows. ``shuffle_rounds``: the passes a single-pass Elo averages
    (MSD-Score's CapArena protocol; default: the protocol's, 1). ``human_scale``: ``(low, high)``, the scale the
    file's human scores are on when it is not the benchmark's published one (a score outside the scale is
    refused, naming its row). ``extras``: a metric's
    one-value-per-sample extras are evaluated as rows of their own (``metric:extra``). ``save_scores``: a
    folder that gets ``<label>.jsonl`` with every row's score and extras, readable back with ``scores``."""
    from capeval_plugins.bench.callables import check_metric_values, is_scoring_function, score_function
    from capeval_plugins.bench.scorefiles import match_score_file, write_scores

    started = time.perf_counter()
    bench = benchmark if isinstance(benchmark, Benchmark) else get_benchmark(benchmark)
    bench = with_shuffle_rounds(bench.with_protocol(protocol), shuffle_rounds).with_scale(human_scale)
    source = "" if isinstance(data, (Ratings, Pairs)) else str(Path(data))
    data = data if isinstance(data, (Ratings, Pairs)) else bench.read(data)
    if labels is not None:
        from capeval_plugins.bench.labels import apply_labels, read_labels
        from capeval_plugins.bench.readers import row_limit

        with row_limit(max(bench.max_rows, LABEL_ROWS), f"a label set of {bench.title}"):  # may cover every split
            label_set = read_labels(labels)
        data, summary = apply_labels(data, label_set, bench.scale(), bench.title)
        data = replace(data, notes={**data.notes, "labels": summary})
    bench.check(data, source)  # data given already read, and the scores a label set put in
    data = keep_references(data, num_references)
    metrics, scores = dict(metrics or {}), dict(scores or {})
    if not metrics and not scores:
        raise ValueError("no metric to run: give metrics or score files")
    clash = sorted(set(metrics) & set(scores))
    if clash:
        raise InputError(f"{clash} named both as a metric and as a score file")
    check_metric_values(metrics)
    order = [*scores, *metrics]
    functions = {n: m for n, m in metrics.items() if is_scoring_function(m)}  # bench/callables.py
    metrics = {n: m for n, m in metrics.items() if n not in functions}
    inputs = run_inputs(source, images, scores, metrics, cache)
    saved = {}
    if save_scores is not None:  # refused now, not after the metrics ran: a link, an input (a --scores file)
        from capeval_plugins.caption_files import check_writable

        files.Folder.open(save_scores, create=True)[0].close()
        for name in order:
            saved[name] = Path(save_scores) / f"{_file_name(name)}.jsonl"
            check_writable(saved[name], inputs, "--save-scores")
    runs: dict[str, MetricRun] = {}
    for name, path in scores.items():
        begin = time.perf_counter()
        matched = match_score_file(path, data)
        runs[name] = MetricRun(matched.scores, time.perf_counter() - begin, 0, 0, matched.extras if extras else {},
                               str(path), matched.matched_by)
    store = open_cache(cache) if metrics else NoCache()
    try:  # every metric in one pass over the images (the score cache's gaps)
        runs.update(score_metrics(metrics, data.captions, images=images, cache=store, with_references=with_references,
                                  progress=progress, benchmark=bench.name, extras=extras,
                                  frames={name: _frames_for(name, frames) for name in metrics}))
    finally:
        if metrics and not isinstance(cache, (ScoreCache, NoCache)):
            store.close()
    for name, fn in functions.items():
        runs[name] = score_function(name, fn, data.captions, images=images, benchmark=bench.name,
                                    frames=_frames_for(name, frames))
    runs = {name: runs[name] for name in order}
    for name, path in saved.items():
        write_scores(path, data, runs[name].scores, runs[name].extras, inputs)
    table = {n: r.scores for n, r in runs.items()}
    for name, run in list(runs.items()):
        for extra, values in run.extras.items():
            label = f"{name}:{extra}"
            table[label] = values
            runs[label] = MetricRun(values, 0.0, run.from_cache, run.computed, source=run.source,
                                    matched_by=run.matched_by)
    ties = ties or bench.protocol.ties
    tie_margin = bench.protocol.tie_margin if tie_margin is None else tie_margin
    evaluations, comparisons = evaluate(data, bench.protocol, table, replicates=bootstrap, seed=seed, unit=unit,
                                        ties=ties, compare_only=[n for n in table if n in order],
                                        tie_margin=tie_margin)
    settings = {"bootstrap": bootstrap, "seed": seed, "unit": unit, "ties": ties, "num_references": num_references,
                "tie_margin": tie_margin}
    return BenchReport(bench, data, runs, evaluations, comparisons, settings, time.perf_counter() - started, source)


def with_shuffle_rounds(bench: Benchmark, rounds: int | None) -> Benchmark:
    """The benchmark with its single-pass Elo averaged over ``rounds`` shuffles (None: as it is)."""
    if rounds is None:
        return bench
    protocol = bench.protocol
    if protocol.model_ranking is None or protocol.elo != "single":
        raise InputError(f"shuffle rounds apply to a single-pass Elo ranking (caparena --protocol msd-score); "
                         f"{bench.name} ({bench.variant}) has none")
    if rounds < 1:
        raise InputError(f"shuffle rounds must be 1 or more, got {rounds}")
    return replace(bench, protocol=replace(protocol, shuffle_rounds=rounds))


def _frames_for(name: str, frames: int | Mapping[str, int] | None) -> int | None:
    """The frame count of one metric: its own, else the one for every metric ("*"), else all frames."""
    if isinstance(frames, Mapping):
        return frames.get(name, frames.get("*"))
    return frames


def _file_name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)


def keep_references(data: Ratings | Pairs, count: int | None) -> Ratings | Pairs:
    """The benchmark with only the first ``count`` references of each row (0: none; None: as read)."""
    if count is None:
        return data
    if count < 0:
        raise ValueError(f"num_references must be 0 or more, got {count}")
    captions = data.captions
    if count == 0:
        return replace(data, captions=replace(captions, references=None))
    if captions.references is None:
        raise InputError("--num-references: this benchmark file has no references")
    short = [i for i, refs in enumerate(captions.references) if len(refs) < count]
    if short:
        raise InputError(f"--num-references {count}: {len(short):,} rows have fewer references, e.g. row {short[0]} "
                         f"has {len(captions.references[short[0]])}")
    return replace(data, captions=replace(captions, references=[refs[:count] for refs in captions.references]))
