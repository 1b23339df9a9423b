"""``capeval reproduce``: run metrics on benchmarks and compare with the figures their papers publish.

The published figures ship with the package (``published.json``: each with its paper and table). A *pair* is a
metric in a paper's setting (an entry: the metric, its options, with or without references) on a benchmark in a
setting (its protocol, reference count, label set); each has one or more published values (a statistic, from one
or more tables). :func:`plan` says for every pair what it needs (data, weights, a GPU) and whether it can run
here; :func:`reproduce` runs the runnable pairs, one :func:`~capeval_plugins.bench.runner.run_benchmark` call per
benchmark setting (every metric of it in one pass, each model loaded once per process), and judges each value:
reproduced when the measured figure is within the paper's rounding (half a unit of its last printed digit).
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from capeval_plugins.inputs import InputError

PUBLISHED = Path(__file__).with_name("published.json")
SETTINGS = {"num_references": int, "labels": str}  # what a column may fix besides the benchmark and protocol


@dataclass(frozen=True)
class Setting:
    """A benchmark as a column of a paper's table names it: its protocol and settings."""

    benchmark: str
    protocol: str | None = None
    num_references: int | None = None
    labels: str | None = None  # "original": the file's own judgments, not the corrections a fetch applies

    @property
    def key(self) -> str:
        extra = "&".join(f"{k}={getattr(self, k)}" for k in SETTINGS if getattr(self, k) is not None)
        return self.benchmark + (f"/{self.protocol}" if self.protocol else "") + (f"?{extra}" if extra else "")


@dataclass(frozen=True)
class Entry:
    """A metric in the setting a paper ran it in."""

    id: str
    metric: str
    label: str
    options: tuple[tuple[str, Any], ...] = ()
    with_references: bool = False
    gpu: bool = False
    blocked: str = ""
    note: str = ""
    external: bool = False  # a published metric capeval does not implement: runs where a plugin registers it


@dataclass(frozen=True)
class Value:
    entry: Entry
    setting: Setting
    statistic: str
    value: float
    decimals: int
    source: str  # the table's id (legend: :func:`sources`)


@dataclass
class Pair:
    entry: Entry
    setting: Setting
    values: list[Value]


@dataclass
class Plan:
    """What a pair needs and whether it runs here (``problem`` None)."""

    pair: Pair
    data: str = ""
    weights: list[str] = field(default_factory=list)
    problem: str | None = None
    scores: str | None = None  # a per-sample score file given for the pair


@dataclass
class Inputs:
    """What the user gave: local benchmark files and image folders by benchmark, score files by (table entry,
    benchmark), metric options (``metric.key=value``)."""

    data: Mapping[str, str] = field(default_factory=dict)
    images: Mapping[str, str] = field(default_factory=dict)
    scores: Mapping[tuple[str, str], str] = field(default_factory=dict)
    options: Sequence[str] = ()


# ---------------------------------------------------------------------------------------------- the table

def parse_column(text: str) -> tuple[Setting, str]:
    """``benchmark[/protocol][?key=value&...]:statistic``."""
    head, _, statistic = text.partition(":")
    head, _, query = head.partition("?")
    benchmark, _, protocol = head.partition("/")
    fixed: dict[str, Any] = {}
    for item in filter(None, query.split("&")):
        key, _, value = item.partition("=")
        if key not in SETTINGS:
            raise ValueError(f"column {text!r}: unknown setting {key!r}")
        fixed[key] = SETTINGS[key](value)
    if not statistic:
        raise ValueError(f"column {text!r} names no statistic")
    return Setting(benchmark, protocol or None, **fixed), statistic


def load_published(path: str | os.PathLike = PUBLISHED) -> list[Value]:
    """Every published value of the table file, in table order."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    entries = {key: Entry(key, e["metric"], e["label"], tuple(sorted(e.get("options", {}).items())),
                          bool(e.get("with_references")), bool(e.get("gpu")), e.get("blocked", ""), e.get("note", ""),
                          bool(e.get("external")))
               for key, e in doc["entries"].items()}
    values = []
    for table in doc["tables"]:
        columns = [parse_column(c) for c in table["columns"]]
        source = table["id"]
        for row in table["rows"]:
            entry, numbers, decimals = row[0], row[1], (row[2] if len(row) > 2 else table.get("decimals", 1))
            if entry not in entries or len(numbers) != len(columns):
                raise ValueError(f"{path}: table {table['id']}: bad row {row!r}")
            for (setting, statistic), number in zip(columns, numbers):
                if number is not None:
                    values.append(Value(entries[entry], setting, statistic, float(number), decimals, source))
    return values


def benchmark_notes(path: str | os.PathLike = PUBLISHED) -> dict[str, str]:
    return json.loads(Path(path).read_text(encoding="utf-8")).get("benchmark_notes", {})


@functools.lru_cache(maxsize=None)
def sources(path: str | os.PathLike = PUBLISHED) -> dict[str, str]:
    """Table id -> its paper and table."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    return {t["id"]: f"{t['paper']}, {t['table']}" for t in doc["tables"]}


def select(values: Sequence[Value], metrics: Sequence[str] = (), benchmarks: Sequence[str] = ()) -> list[Pair]:
    """The pairs with a published value, optionally only those of some metrics (an entry id or a metric name)
    and benchmarks."""
    pairs: dict[tuple[str, Setting], Pair] = {}
    for v in values:
        if metrics and v.entry.id not in metrics and v.entry.metric not in metrics:
            continue
        if benchmarks and v.setting.benchmark not in benchmarks:
            continue
        pairs.setdefault((v.entry.id, v.setting), Pair(v.entry, v.setting, [])).values.append(v)
    return list(pairs.values())


# ---------------------------------------------------------------------------------------------- planning

def plan(pairs: Sequence[Pair], inputs: Inputs, fetch_now: bool = False, refresh: bool = False,
         progress: bool = True) -> list[Plan]:
    """What each pair needs and the first reason it cannot run here: its metric first (installed, public weights,
    options, a GPU, weights and runtimes in place), then its data and images. ``fetch_now``: fetch a benchmark
    that is not cached when a pair of it can run (a run); otherwise only say what would be fetched
    (``--dry-run``: no network)."""
    from capeval_plugins import registry

    installed = set(registry.metrics())
    plans = [Plan(pair, scores=_scores_file(pair, inputs)) for pair in pairs]
    for p in plans:
        p.problem = None if p.scores else _metric_problem(p.pair, p, inputs, installed)
    wanted = {p.pair.setting.benchmark for p in plans if p.problem is None}
    data = {}
    for p in plans:
        bench = p.pair.setting.benchmark
        if bench not in data:
            data[bench] = _data(bench, inputs, fetch_now and bench in wanted, refresh, progress)
        p.data = data[bench].description
        if p.problem is None:
            p.problem = data[bench].problem or _images_problem(p, inputs, data[bench])
    return plans


def _scores_file(pair: Pair, inputs: Inputs) -> str | None:
    """A score file given for the pair's entry (``fleur``, ``reffleur``: each setting its own file)."""
    return inputs.scores.get((pair.entry.id, pair.setting.benchmark))


@dataclass
class _Data:
    """A benchmark's data for the plan: what it is, the local path or fetched copy, why there is none, and
    whether images come with it (a fetched benchmark brings them)."""

    description: str
    source: Any = None
    problem: str | None = None
    images: bool = False


def _data(bench: str, inputs: Inputs, fetch_now: bool, refresh: bool, progress: bool) -> _Data:
    from capeval_plugins.bench import fetch
    from capeval_plugins.bench.benchmarks import BENCHMARKS

    if bench in inputs.data:
        return _Data(f"local: {inputs.data[bench]}", inputs.data[bench])
    if not fetch.fetchable(bench):
        return _Data("not fetchable", problem=f"no data: {bench} has no public home capeval fetches from; pass "
                                              f"--data {bench}=PATH ({BENCHMARKS[bench].data_format})")
    repo = fetch.SOURCES[bench].repo
    try:
        found = None if refresh else fetch.cached(bench)
        if found is None and fetch_now:
            found = fetch.fetch(bench, refresh=refresh, progress=progress)
    except fetch.FetchError as err:
        return _Data(f"fetch: {repo}", problem=f"no data: {err}")
    if found is not None:
        return _Data(f"cached: {repo}@{found.provenance['revision'][:12]}", found, images=True)
    if fetch.offline():
        return _Data(f"fetch: {repo}", problem=f"no data: {bench} is not cached and downloads are off "
                                               f"(HF_HUB_OFFLINE=1); pass --data {bench}=PATH")
    return _Data(f"fetched on first use: {repo}", images=True)


def _images_problem(p: Plan, inputs: Inputs, data: _Data) -> str | None:
    """A metric that scores images needs the benchmark's: fetched with it, or ``--images``."""
    if p.scores:
        return None
    bench = p.pair.setting.benchmark
    metric = build(p.pair.entry, bench, inputs.options)
    if metric.info.images != "never" and not inputs.images.get(bench) and not data.images:
        return f"scores images: pass the benchmark's images with --images {bench}=DIR"
    return None


def _metric_problem(pair: Pair, p: Plan, inputs: Inputs, installed: set[str]) -> str | None:
    entry = pair.entry
    if entry.metric not in installed:
        return f"metric {entry.metric} not installed" + (f" ({entry.note})" if entry.external else "")
    if entry.blocked and not any(o.startswith(entry.metric + ".") for o in inputs.options):
        return entry.blocked
    try:
        metric = build(entry, pair.setting.benchmark, inputs.options)
    except (InputError, KeyError, ValueError, TypeError) as err:
        return f"{entry.metric}: {err.args[0] if err.args else err}"
    p.weights = [r.target for r in metric.requirements() if r.kind == "model"]
    if entry.gpu and not _cuda():
        return f"needs a GPU ({entry.note or entry.label}), none here"
    from capeval_plugins.preflight import problems

    missing = problems({entry.metric: metric})
    return "; ".join(missing) if missing else None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


_BUILT: dict[tuple, Any] = {}


def build(entry: Entry, benchmark: str, user_options: Sequence[str]) -> Any:
    """The entry's metric with its paper options, the benchmark's defaults and the user's options for it; one
    instance per configuration in a process, so its model loads once for every benchmark."""
    from capeval_plugins.bench.benchmarks import metric_options
    from capeval_plugins.options import build_metrics

    own = [f"{entry.metric}.{k}={v}" for k, v in entry.options]
    own += [o for o in user_options if o.startswith(entry.metric + ".")]
    own = metric_options(benchmark, [entry.metric], own)
    key = (entry.metric, tuple(own))
    if key not in _BUILT:
        _BUILT[key] = build_metrics([entry.metric], own)[entry.metric]
    return _BUILT[key]


# ---------------------------------------------------------------------------------------------- running

@dataclass
class Row:
    """One published statistic of a pair: its values (with their sources), the measured figure and the verdict."""

    entry: Entry
    setting: Setting
    statistic: str
    published: list[Value]
    measured: float | None = None
    status: str = ""
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"entry": self.entry.id, "metric": self.entry.metric, "label": self.entry.label,
                "benchmark": self.setting.benchmark, "setting": self.setting.key, "statistic": self.statistic,
                "published": [{"value": v.value, "decimals": v.decimals, "source": v.source,
                               "table": sources().get(v.source, v.source)} for v in self.published],
                "measured": None if self.measured is None else round(self.measured, 4), "status": self.status,
                **({"reason": self.reason} if self.reason else {})}


def reproduce(plans: Sequence[Plan], inputs: Inputs, *, limit: int | None = None, cache: Any = None,
              progress: bool = True) -> tuple[list[Row], dict[str, Any]]:
    """Run every runnable pair and judge its published values; returns the rows and, per benchmark setting, what
    the run read and how long it took."""
    from capeval_plugins.bench.fetch import Fetched
    from capeval_plugins.bench.runner import open_cache, run_benchmark

    rows = {id(p): _rows(p) for p in plans}
    groups: dict[tuple, list[Plan]] = {}  # one run per data, protocol and settings: every metric of it in one pass
    sources_of: dict[str, Any] = {}
    for p in plans:
        if p.problem is None:
            setting = p.pair.setting
            bench = setting.benchmark
            sources_of.setdefault(bench, _source(bench, inputs))
            paths = _paths(sources_of[bench], setting, inputs)
            key = (bench, setting.protocol, setting.num_references, paths, p.pair.entry.with_references)
            groups.setdefault(key, []).append(p)
    runs: dict[str, Any] = {}
    read = {key: _read(key, members, limit) for key, members in groups.items()}  # a bad --scores file: before any run
    store = open_cache(cache)
    try:
        for (bench_name, protocol, num_references, (path, images, labels), with_refs), members in groups.items():
            source = sources_of[bench_name]
            bench, data, started = read[bench_name, protocol, num_references, (path, images, labels), with_refs]
            metrics = {p.pair.entry.id: build(p.pair.entry, bench_name, inputs.options)
                       for p in members if not p.scores}
            scores = {p.pair.entry.id: p.scores for p in members if p.scores}
            settings = sorted({p.pair.setting.key for p in members})
            label = " = ".join(settings) + (" (references given)" if with_refs else "")
            if progress:
                print(f"reproduce: {label}: {', '.join([*metrics, *scores])}", file=sys.stderr)
            try:
                report = run_benchmark(bench, data, metrics, images=images, cache=store, bootstrap=0,
                                       with_references=with_refs, progress=progress, scores=scores,
                                       num_references=num_references, labels=labels)
            except (InputError, RuntimeError, KeyError, ImportError, ValueError) as err:
                for p in members:
                    for row in rows[id(p)]:
                        row.status, row.reason = "not runnable here", f"{type(err).__name__}: {err}"
                continue
            runs[label] = {
                "data": source.provenance if isinstance(source, Fetched) else str(source), "rows": len(data.captions),
                "labels": report.data.notes.get("labels"), "seconds": round(time.perf_counter() - started, 3),
                "metrics": sorted(metrics) + sorted(scores)}
            for p in members:
                for row in rows[id(p)]:
                    _judge(row, report.evaluations.get(p.pair.entry.id), limit)
    finally:
        store.close()
    out = [row for p in plans for row in rows[id(p)]]
    for p in plans:
        if p.problem is not None:
            for row in rows[id(p)]:
                row.status, row.reason = "not runnable here", p.problem
    return out, runs


def _rows(p: Plan) -> list[Row]:
    by_stat: dict[str, list[Value]] = {}
    for v in p.pair.values:
        by_stat.setdefault(v.statistic, []).append(v)
    return [Row(p.pair.entry, p.pair.setting, stat, values) for stat, values in by_stat.items()]


def _source(bench: str, inputs: Inputs) -> Any:
    from capeval_plugins.bench import fetch

    return inputs.data.get(bench) or fetch.cached(bench)


def _paths(source: Any, setting: Setting, inputs: Inputs) -> tuple[str, str | None, str | None]:
    from capeval_plugins.bench.fetch import Fetched

    images = inputs.images.get(setting.benchmark)
    if isinstance(source, Fetched):
        labels = str(source.labels) if source.labels and setting.labels != "original" else None
        return str(source.data), images or (str(source.images) if source.images else None), labels
    return str(source), images, None


def _judge(row: Row, ev: Any, limit: int | None) -> None:
    if ev is None:
        row.status, row.reason = "not runnable here", "no result"
        return
    stat = row.statistic
    found = ev.system_stats.get(stat.removeprefix("system:")) if stat.startswith("system:") else ev.stats.get(stat)
    if found is None or not np.isfinite(found):
        row.status, row.reason = "not reproduced", f"capeval reports no {stat} here"
        return
    row.measured = float(found)
    if limit is not None:
        row.status = f"smoke pass (--limit {limit}), not compared"
        return
    matched = [v for v in row.published if abs(row.measured - v.value) <= 0.5 * 10 ** -v.decimals + 1e-9]
    if matched and len(matched) == len(row.published):
        row.status = "reproduced"
    elif matched:
        row.status = "reproduced"
        row.reason = f"matches {_values(matched)}, not {_values([v for v in row.published if v not in matched])}"
    else:
        nearest = min(row.published, key=lambda v: abs(row.measured - v.value))
        row.status = "not reproduced"
        row.reason = f"{row.measured - nearest.value:+.{nearest.decimals}f} from [{nearest.source}]"


def _read(key: tuple, members: Sequence[Plan], limit: int | None) -> tuple[Any, Any, float]:
    """``(benchmark, its data, when the reading started)`` of a group, every --scores file of it matched to the
    rows the run scores: a file that does not fit is the user's to fix, refused (InputError) as capeval bench
    refuses it, never the group's metrics "not runnable here"."""
    from capeval_plugins.bench.benchmarks import get_benchmark
    from capeval_plugins.bench.scorefiles import match_score_file

    bench_name, protocol, _, (path, _, _), _ = key
    started = time.perf_counter()
    bench = get_benchmark(bench_name).with_protocol(protocol)
    data = bench.read(path)
    if limit is not None:
        data = head(data, limit)
    for p in members:
        if p.scores:
            match_score_file(p.scores, data)
    return bench, data, started


def head(data: Any, n: int) -> Any:
    """The first ``n`` rows (ratings) or pairs of a benchmark: a smoke pass. Its notes keep how many rows the
    benchmark has (``first_rows_of``): a row-keyed score file of the whole benchmark then fits it, its later rows
    left out (every reader numbers rows pair by pair, so the first pairs' rows are the first rows)."""
    from capeval_plugins.bench.data import Captions, Pairs

    notes = {**data.notes, "first_rows_of": data.notes.get("first_rows_of", len(data.captions))}

    if isinstance(data, Pairs):
        keep = np.arange(min(n, len(data)))
        used = np.unique(np.concatenate([data.first[keep], data.second[keep]]))
        if data.row_units is not None:  # every row of a kept unit
            used = np.flatnonzero(np.isin(data.row_units, data.row_units[used]))
        remap = np.full(len(data.captions), -1)
        remap[used] = np.arange(len(used))
        captions = _take_captions(data.captions, used)
        return replace(data, captions=captions, first=remap[data.first[keep]], second=remap[data.second[keep]],
                       label=data.label[keep], categories=[data.categories[i] for i in keep],
                       human_tie=None if data.human_tie is None else data.human_tie[keep],
                       pair_systems=None if data.pair_systems is None else [data.pair_systems[i] for i in keep],
                       row_units=None if data.row_units is None else data.row_units[used],
                       graded=None if data.graded is None else {k: v[keep] for k, v in data.graded.items()},
                       notes=notes)
    keep = np.arange(min(n, len(data.captions)))
    assert isinstance(data.captions, Captions)
    return replace(data, captions=_take_captions(data.captions, keep), human=data.human[keep],
                   categories=None if data.categories is None else [data.categories[i] for i in keep],
                   targets=None if data.targets is None else {k: np.asarray(v)[keep] for k, v in data.targets.items()},
                   systems=None if data.systems is None else [data.systems[i] for i in keep], notes=notes)


def _take_captions(captions: Any, keep: np.ndarray) -> Any:
    pick = lambda values: None if values is None else [values[i] for i in keep]  # noqa: E731
    return replace(captions, images=pick(captions.images), candidates=pick(captions.candidates),
                   references=pick(captions.references), corpus=pick(captions.corpus), groups=pick(captions.groups),
                   segments=pick(captions.segments))


# ---------------------------------------------------------------------------------------------- output

def _values(values: Sequence[Value], statistic: bool = False) -> str:
    """``16.4 [rigel-t1]; 16.9 [discode-t3, discode-t9]`` (with the statistic first when asked)."""
    by: dict[tuple, list[str]] = {}
    for v in values:
        by.setdefault((v.statistic if statistic else "", f"{v.value:.{v.decimals}f}"), []).append(v.source)
    return "; ".join(f"{stat + ' ' if stat else ''}{value} [{', '.join(ids)}]" for (stat, value), ids in by.items())


def legend(values: Sequence[Value]) -> str:
    named = sources()
    used = dict.fromkeys(v.source for v in values)
    return "\n".join(f"- [{key}] {named.get(key, key)}" for key in used)


class SharedReasons:
    """Each reason said once: one that several rows share (a missing runtime, a model not in the cache) gets a
    number, the rows name it (``see [1]``) and its text comes once below the table; a reason of one row stays
    in its row."""

    def __init__(self, reasons: Iterable[str | None]) -> None:
        seen = [r for r in reasons if r]
        shared = [r for r in dict.fromkeys(seen) if seen.count(r) > 1]
        self.numbers = {reason: k + 1 for k, reason in enumerate(shared)}

    def cell(self, reason: str) -> str:
        number = self.numbers.get(reason)
        return reason if number is None else f"see [{number}]"

    def notes(self) -> str:
        return "".join(f"\n\n[{k}] {reason}" for reason, k in self.numbers.items())


def markdown(rows: Sequence[Row], notes: Mapping[str, str] | None = None) -> str:
    """The status table: one line per published statistic, then the sources, the benchmarks' notes and the
    counts."""
    lines = ["| metric | benchmark | statistic | published | measured | status |", "|---|---|---|---|---|---|"]
    reasons = SharedReasons(r.reason for r in rows)
    for r in rows:
        measured = "–" if r.measured is None else f"{r.measured:.{max(v.decimals for v in r.published)}f}"
        status = r.status + (f": {reasons.cell(r.reason)}" if r.reason else "")
        lines.append(f"| {r.entry.label} | {r.setting.key} | {r.statistic} | {_values(r.published)} | {measured} "
                     f"| {status} |")
    used = {r.setting.benchmark for r in rows}
    extra = [f"- {bench}: {note}" for bench, note in (notes or {}).items() if bench in used]
    return ("\n".join(lines) + reasons.notes() + "\n\n" + legend([v for r in rows for v in r.published])
            + ("\n" + "\n".join(extra) if extra else "") + "\n\n" + summary_line(rows))


def summary(rows: Sequence[Row]) -> dict[str, int]:
    out = {"reproduced": 0, "not reproduced": 0, "not runnable here": 0, "smoke pass": 0}
    for r in rows:
        out[next(k for k in out if r.status.startswith(k))] += 1
    return out


def summary_line(rows: Sequence[Row]) -> str:
    counts = summary(rows)
    return ", ".join(f"{v} {k}" for k, v in counts.items() if v or k != "smoke pass") + f" (of {len(rows)} values)"


def dry_run_markdown(plans: Sequence[Plan], notes: Mapping[str, str]) -> str:
    """The pairs, their published values and what each needs, then the sources and the benchmarks' notes."""
    lines = ["| metric | benchmark | published | data | weights | GPU | runs here |", "|---|---|---|---|---|---|---|"]
    reasons = SharedReasons(p.problem for p in plans)
    for p in plans:
        weights = ", ".join(p.weights) or ("score file" if p.scores else "–")
        runs = ("yes" + (f" (scores from {p.scores})" if p.scores else "") if p.problem is None
                else f"no: {reasons.cell(p.problem)}")
        lines.append(f"| {p.pair.entry.label} | {p.pair.setting.key} | {_values(p.pair.values, statistic=True)} | "
                     f"{p.data} | {weights} | {'yes' if p.pair.entry.gpu else 'no'} | {runs} |")
    used = {p.pair.setting.benchmark for p in plans}
    extra = [f"- {bench}: {note}" for bench, note in notes.items() if bench in used]
    runnable = sum(p.problem is None for p in plans)
    return ("\n".join(lines) + reasons.notes() + "\n\n" + legend([v for p in plans for v in p.pair.values])
            + ("\n" + "\n".join(extra) if extra else "") + f"\n\n{len(plans)} pairs, {runnable} runnable here")
