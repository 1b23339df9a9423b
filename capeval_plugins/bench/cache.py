"""A per-sample score cache (SQLite, standard library), so an interrupted or repeated benchmark run does not
recompute what it already has.

Scores are keyed by a *metric key* and a *sample key*. The metric key hashes everything that can change a
score: the metric's class and registry name, the package version, every option of its configuration except
``batch_size`` (the contract makes scores independent of batching), whether images and references are passed,
and, for options naming a local file or folder (a model checkpoint), the names, sizes and modification times
of its files. The sample key hashes the candidate, the references when the metric sees them, and the image
when it does (its resolved path, size and modification time; embedded images by content). Corpus-level
metrics, whose per-sample scores depend on the whole corpus, are cached per corpus: the key hashes every
sample key in order.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sqlite3
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from capeval_plugins.contract import Metric

SCHEMA = """
CREATE TABLE IF NOT EXISTS sample_scores (metric TEXT, sample TEXT, score REAL, PRIMARY KEY (metric, sample));
CREATE TABLE IF NOT EXISTS corpus_scores (metric TEXT, corpus TEXT, scores BLOB, PRIMARY KEY (metric, corpus));
"""
_MAX_FILES = 10_000


def default_cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "capeval_plugins" / "bench" / "scores.sqlite"


def digest(payload: Any) -> str:
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def path_fingerprint(path: str) -> list:
    """Names, sizes and modification times of a file, or of the files under a folder."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())[:_MAX_FILES]
    out = []
    for f in files:
        stat = f.stat()
        out.append([str(f.relative_to(root)) if f != root else f.name, stat.st_size, stat.st_mtime_ns])
    return out


def metric_key(metric: Metric, images: bool, references: bool) -> str:
    from capeval_plugins import __version__

    config = dataclasses.asdict(metric.config)
    config.pop("batch_size", None)
    files = {k: path_fingerprint(v) for k, v in config.items() if isinstance(v, str) and v and os.path.exists(v)}
    return digest({
        "metric": metric.info.name,
        "class": f"{type(metric).__module__}.{type(metric).__qualname__}",
        "version": __version__,
        "config": config,
        "files": files,
        "images": images,
        "references": references,
    })


def image_fingerprint(image: Any) -> Any:
    if isinstance(image, (list, tuple)):  # a video as frames
        return [image_fingerprint(frame) for frame in image]
    if isinstance(image, dict) and image.get("bytes"):
        return "sha1:" + hashlib.sha1(image["bytes"]).hexdigest()
    path = os.fspath(image)
    stat = os.stat(path)
    return [os.path.realpath(path), stat.st_size, stat.st_mtime_ns]


def sample_keys(candidates: Sequence[str], references: Sequence[Sequence[str]] | None,
                images: Sequence[Any] | None) -> list[str]:
    prints: dict[int, Any] = {}
    keys = []
    for i, cand in enumerate(candidates):
        image = None
        if images is not None:
            ident = id(images[i]) if isinstance(images[i], dict) else (
                tuple(images[i]) if isinstance(images[i], list) else images[i])
            if ident not in prints:
                prints[ident] = image_fingerprint(images[i])
            image = prints[ident]
        keys.append(digest([cand, list(references[i]) if references is not None else None, image]))
    return keys


class ScoreCache:
    """Scores by (metric key, sample key), and per-corpus score vectors by (metric key, corpus key)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path), timeout=60)
        self.db.executescript(SCHEMA)

    def get(self, metric: str, samples: Iterable[str]) -> dict[str, float]:
        samples = list(samples)
        found: dict[str, float] = {}
        for start in range(0, len(samples), 500):
            chunk = samples[start : start + 500]
            marks = ",".join("?" * len(chunk))
            query = f"SELECT sample, score FROM sample_scores WHERE metric = ? AND sample IN ({marks})"
            for sample, score in self.db.execute(query, [metric, *chunk]):
                found[sample] = math.nan if score is None else float(score)  # SQLite stores NaN as NULL
        return found

    def put(self, metric: str, scores: Mapping[str, float]) -> None:
        rows = [(metric, k, None if math.isnan(v) else float(v)) for k, v in scores.items()]
        with self.db:
            self.db.executemany("INSERT OR REPLACE INTO sample_scores VALUES (?, ?, ?)", rows)

    def get_corpus(self, metric: str, corpus: str) -> np.ndarray | None:
        row = self.db.execute("SELECT scores FROM corpus_scores WHERE metric = ? AND corpus = ?",
                              (metric, corpus)).fetchone()
        return None if row is None else np.frombuffer(row[0], dtype=np.float64).copy()

    def put_corpus(self, metric: str, corpus: str, scores: np.ndarray) -> None:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO corpus_scores VALUES (?, ?, ?)",
                            (metric, corpus, np.asarray(scores, dtype=np.float64).tobytes()))

    def close(self) -> None:
        self.db.close()


class NoCache:
    """Stands in for :class:`ScoreCache` when caching is off."""

    def get(self, metric: str, samples: Iterable[str]) -> dict[str, float]:
        return {}

    def put(self, metric: str, scores: Mapping[str, float]) -> None:
        pass

    def get_corpus(self, metric: str, corpus: str) -> None:
        return None

    def put_corpus(self, metric: str, corpus: str, scores: np.ndarray) -> None:
        pass

    def close(self) -> None:
        pass
