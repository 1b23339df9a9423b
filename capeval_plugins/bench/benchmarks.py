"""The benchmarks ``capeval bench`` knows, by the names scripts rely on, with the protocol each expects."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from capeval_plugins.bench.data import Pairs, Ratings


@dataclass(frozen=True)
class Protocol:
    """How a benchmark is judged. ``kind="correlation"``: Kendall tau-b, tau-c and Pearson between metric and
    human scores over all rows, ``primary`` the one papers report. ``kind="pairwise"``: share of pairs where the
    metric prefers the caption humans preferred, per category, and their mean when ``mean`` is set."""

    kind: str
    primary: str
    description: str
    categories: tuple[str, ...] = ()
    mean: bool = True

    def headline(self) -> tuple[str, ...]:
        """The statistics compared between metrics (significance tests)."""
        if self.kind == "correlation":
            return (self.primary,)
        return ("accuracy",) if self.mean else tuple(f"category:{c}" for c in self.categories)


@dataclass(frozen=True)
class Benchmark:
    name: str
    title: str
    protocol: Protocol
    reader: Callable[[Path], "Ratings | Pairs"]
    data_format: str

    def read(self, path: str | Path) -> "Ratings | Pairs":
        return self.reader(Path(path))


def _reader(name: str, *args: Any) -> Callable[[Path], "Ratings | Pairs"]:
    """A reader of :mod:`capeval_plugins.bench.readers`, imported when a file is read (so listing the
    benchmarks, as the ``capeval`` parser does, imports nothing heavy)."""

    def read(path: Path) -> "Ratings | Pairs":
        from capeval_plugins.bench import readers

        return getattr(readers, name)(path, *args)

    return read


_CORRELATION = ("Kendall tau between metric scores and human scores over all rows (scipy's definition; "
                "x100), corpus-level metrics scored on all rows in one call")

BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("flickr8k-expert", "Flickr8k-Expert",
              Protocol("correlation", "kendall_tau_c",
                       _CORRELATION + "; one row per expert rating (three per caption, not averaged); candidates "
                       "identical to a reference of their image excluded; tau-c as reported by CLIPScore / PAC-S"),
              _reader("read_judgement_json", "drop_rows"), "CLIPScore / PAC-S json (flickr8k.json)"),
    Benchmark("flickr8k-cf", "Flickr8k-CF",
              Protocol("correlation", "kendall_tau_b",
                       _CORRELATION + "; one row per image-caption pair with the share of 'yes' judgements; judged "
                       "candidates removed from their image's references; tau-b as reported by CLIPScore / PAC-S"),
              _reader("read_judgement_json", "drop_references"),
              "CLIPScore / PAC-S json (crowdflower_flickr8k.json)"),
    Benchmark("composite", "Composite",
              Protocol("correlation", "kendall_tau_c",
                       _CORRELATION + "; candidates identical to a reference excluded; tau-c"),
              _reader("read_composite"), "CLIPScore json, or FLEUR / EXPERT composite.json"),
    Benchmark("pascal50s", "Pascal-50S",
              Protocol("pairwise", "accuracy",
                       "accuracy (x100) per category (HC, HI, HM, MM) and their mean: the metric is right when it "
                       "scores the caption humans preferred strictly higher; both captions of every pair scored "
                       "in one call", categories=("HC", "HI", "HM", "MM")),
              _reader("read_pairwise", ("HC", "HI", "HM", "MM")), "FLEUR / EXPERT pascal_50s.json"),
    Benchmark("foil", "FOIL",
              Protocol("pairwise", "accuracy",
                       "accuracy (x100) of preferring the original caption over its foil, with one reference "
                       "(1-ref) and four references (4-ref), each setting scored as its own corpus",
                       categories=("1-ref", "4-ref"), mean=False),
              _reader("read_foil"), "FOIL-COCO foilv1.0_test_2017.json + COCO captions_val2014.json"),
    Benchmark("nebula", "Nebula",
              Protocol("correlation", "kendall_tau_c", _CORRELATION + "; tau-c"),
              _reader("read_rated_rows"), "EXPERT nebula_test.json (imgid, mt, refs, score)"),
    Benchmark("polaris", "Polaris",
              Protocol("correlation", "kendall_tau_c", _CORRELATION + "; tau-c as Polos reports it"),
              _reader("read_rated_rows"), "Polos polaris_test.csv, EXPERT polaris_test.json or HF Parquet"),
    Benchmark("thumb", "THumB 1.0 (COCO)",
              Protocol("correlation", "kendall_tau_c", _CORRELATION + "; human_score = (P + R) / 2 + penalties; tau-c"),
              _reader("read_thumb"), "THumB mscoco_THumB-1.0.jsonl + mscoco_references.json"),
    Benchmark("mceval", "MCEval",
              Protocol("pairwise", "accuracy",
                       "accuracy (x100) per visual domain and their mean (DISCODE's MCEval protocol): the metric "
                       "is right when it scores the preferred caption strictly higher"),
              _reader("read_pairwise"), "generic pairwise JSON / JSON Lines (category = domain)"),
)}


def benchmark_names() -> list[str]:
    return list(BENCHMARKS)


def get_benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise KeyError(f"no benchmark named {name!r}; known: {benchmark_names()}")
    return BENCHMARKS[name]


def load_benchmark(name: str, path: str | Path) -> "Ratings | Pairs":
    """Read a benchmark's file (or folder) with its reader."""
    return get_benchmark(name).read(path)
