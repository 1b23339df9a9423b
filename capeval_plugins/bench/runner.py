"""Score a benchmark with registered metrics and report what papers report.

Pointwise metrics (:class:`~capeval_plugins.contract.PointwiseMetric` without groups) are scored once per
distinct sample (Flickr8k-Expert's three ratings of a caption share one score), in chunks that each land in the
cache, so an interrupted run resumes where it stopped. Every other metric (corpus-level such as CIDEr, group
metrics) is scored on all rows of a corpus in one call, because its per-sample scores depend on the others;
its scores are cached per corpus.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from capeval_plugins.bench.benchmarks import Benchmark, get_benchmark
from capeval_plugins.bench.cache import NoCache, ScoreCache, default_cache_path, digest, metric_key, sample_keys
from capeval_plugins.bench.data import Captions, Pairs, Ratings, resolve_images
from capeval_plugins.bench.protocols import CORRELATION_STATS, Evaluation, evaluate
from capeval_plugins.contract import Metric, PointwiseMetric
from capeval_plugins.inputs import InputError


@dataclass
class MetricRun:
    """One metric's per-row scores on a benchmark, and what producing them cost."""

    scores: np.ndarray
    seconds: float
    from_cache: int
    computed: int


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
        every correlation and accuracy on the 0-100 scale."""
        protocol = self.benchmark.protocol
        proto = {"name": self.benchmark.name, "kind": protocol.kind, "statistic": protocol.primary,
                 "description": protocol.description, "scale": 100,
                 "bootstrap": {"replicates": self.settings["bootstrap"], "unit": self.settings["unit"],
                               "seed": self.settings["seed"], "level": 0.95}}
        if self.kind == "pairwise":
            proto["ties"] = self.settings["ties"]
        data = {"path": self.source, "rows": len(self.data.captions), "excluded": self.data.excluded,
                **self.data.notes}
        if isinstance(self.data, Pairs):
            data["pairs"] = len(self.data)
        results = {name: self._result(name) for name in self.evaluations}
        return {"benchmark": self.benchmark.name, "protocol": proto, "data": data, "results": results,
                "comparisons": self.comparisons, "wall_time_s": round(self.wall_time, 3)}

    def _result(self, name: str) -> dict[str, Any]:
        ev, run = self.evaluations[name], self.runs[name]
        out: dict[str, Any] = {}
        ci = {k: _interval(v) for k, v in ev.replicates.items()}
        if self.kind == "correlation":
            out.update({k: ev.stats[k] for k in CORRELATION_STATS})
            out["n"] = ev.n
            if ev.replicates:
                out["ci95"] = {k: ci[k] for k in CORRELATION_STATS}
            if ev.category_stats:
                out["categories"] = {c: {**s, "n": ev.category_sizes[c]} for c, s in ev.category_stats.items()}
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
            if ev.replicates and "accuracy" in ci:
                out["ci95"] = {"accuracy": ci["accuracy"]}
        if ev.n_invalid:
            out["n_invalid"] = ev.n_invalid
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


def score_metric(name: str, metric: Metric, captions: Captions, *, images: str | os.PathLike | None = None,
                 cache: ScoreCache | NoCache | None = None, with_references: bool = False,
                 progress: bool = True, benchmark: str = "") -> MetricRun:
    """Per-row scores of one metric (NaN where the metric gave none), through the cache."""
    cache = cache if cache is not None else NoCache()
    info = metric.info
    use_refs = info.references == "always" or (info.references == "optional" and with_references)
    if use_refs and captions.references is None:
        if info.references == "always":
            raise InputError(f"{name} needs references, and this {benchmark or 'benchmark'} file has none")
        use_refs = False
    use_images = info.images == "always" or (info.images == "optional" and images is not None)
    image_files = resolve_images(captions.images, images, benchmark) if use_images else None
    refs = captions.references if use_refs else None
    key = metric_key(metric, use_images, use_refs)
    keys = sample_keys(captions.candidates, refs, image_files)
    start = time.perf_counter()
    inputs = (image_files, captions.candidates, refs)
    if is_pointwise(metric):
        scores, from_cache, computed = _pointwise(name, metric, inputs, keys, key, cache, progress)
    else:
        scores, from_cache, computed = _by_corpus(name, metric, inputs, keys, key, cache, captions, progress)
    return MetricRun(scores, time.perf_counter() - start, from_cache, computed)


def _pick(values, rows):
    return None if values is None else [values[i] for i in rows]


def _pointwise(name, metric, inputs, keys, key, cache, progress):
    images, candidates, refs = inputs
    first: dict[str, int] = {}
    for row, k in enumerate(keys):
        first.setdefault(k, row)
    found = cache.get(key, first)
    cached = set(found)
    todo = [row for k, row in first.items() if k not in cached]
    if images is not None:  # an image's candidates in one chunk, so each image is encoded once
        rank: dict[Any, int] = {}
        todo.sort(key=lambda row: rank.setdefault(_image_id(images[row]), len(rank)))
    chunk = max(256, 4 * metric.config.batch_size)
    from tqdm.auto import tqdm

    with tqdm(total=len(todo), desc=name, unit="sample", disable=not progress or not todo) as bar:
        for begin in range(0, len(todo), chunk):
            rows = todo[begin : begin + chunk]
            # ids: errors name benchmark rows; the result comes back in row order
            result = metric(_pick(images, rows), _pick(candidates, rows), _pick(refs, rows), ids=rows)
            new = {keys[row]: float(s) for row, s in zip(result.indices.tolist(), result.scores.tolist())}
            cache.put(key, new)
            found.update(new)
            bar.update(len(rows))
    scores = np.array([found[k] for k in keys], dtype=np.float64)
    return scores, sum(k in cached for k in keys), len(todo)


def _image_id(image: Any) -> Any:
    return id(image) if isinstance(image, dict) else image


def _by_corpus(name, metric, inputs, keys, key, cache, captions, progress):
    images, candidates, refs = inputs
    scores = np.full(len(keys), np.nan)
    from_cache = computed = 0
    for rows in captions.corpora():
        corpus_key = digest([keys[i] for i in rows])
        cached = cache.get_corpus(key, corpus_key)
        if cached is None or len(cached) != len(rows):
            if progress:
                from tqdm.auto import tqdm

                tqdm.write(f"{name}: scoring {len(rows):,} rows as one corpus", file=sys.stderr)
            result = metric(_pick(images, rows), _pick(candidates, rows), _pick(refs, rows), ids=rows, progress=progress)
            by_row = dict(zip(result.indices.tolist(), result.scores.double().cpu().tolist()))
            cached = np.array([by_row[row] for row in rows], dtype=np.float64)
            cache.put_corpus(key, corpus_key, cached)
            computed += len(rows)
        else:
            from_cache += len(rows)
        scores[rows] = cached
    return scores, from_cache, computed


def open_cache(cache: str | os.PathLike | ScoreCache | NoCache | None | bool) -> ScoreCache | NoCache:
    """``None`` / ``True``: the default cache file; ``False``: no cache; a path: that file."""
    if cache is False:
        return NoCache()
    if isinstance(cache, (ScoreCache, NoCache)):
        return cache
    return ScoreCache(default_cache_path() if cache in (None, True) else cache)


def run_benchmark(benchmark: str | Benchmark, data: str | os.PathLike | Ratings | Pairs,
                  metrics: Mapping[str, Metric], *, images: str | os.PathLike | None = None,
                  cache: Any = None, bootstrap: int = 1000, seed: int = 0, unit: str = "image",
                  ties: str = "wrong", with_references: bool = False, progress: bool = True) -> BenchReport:
    """Read the benchmark (unless ``data`` is already read), score it with every metric and evaluate them.

    ``metrics`` maps a label to a built metric. ``images`` is the image folder (needed only by metrics that
    score images). ``cache``: see :func:`open_cache`. ``bootstrap`` replicates (0: none) resample ``unit``
    (``"image"`` or ``"row"``) with ``seed``. ``ties`` counts a tied pair ``"wrong"`` or ``"half"`` right.
    ``with_references`` also gives references to metrics for which they are optional."""
    started = time.perf_counter()
    bench = benchmark if isinstance(benchmark, Benchmark) else get_benchmark(benchmark)
    source = "" if isinstance(data, (Ratings, Pairs)) else str(Path(data))
    data = data if isinstance(data, (Ratings, Pairs)) else bench.read(data)
    if not metrics:
        raise ValueError("no metric to run")
    store = open_cache(cache)
    try:
        runs = {name: score_metric(name, metric, data.captions, images=images, cache=store,
                                   with_references=with_references, progress=progress, benchmark=bench.name)
                for name, metric in metrics.items()}
    finally:
        if not isinstance(cache, (ScoreCache, NoCache)):
            store.close()
    evaluations, comparisons = evaluate(data, bench.protocol, {n: r.scores for n, r in runs.items()},
                                        replicates=bootstrap, seed=seed, unit=unit, ties=ties)
    settings = {"bootstrap": bootstrap, "seed": seed, "unit": unit, "ties": ties}
    return BenchReport(bench, data, runs, evaluations, comparisons, settings, time.perf_counter() - started, source)
