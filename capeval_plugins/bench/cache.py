"""A per-sample score cache (SQLite, standard library), so an interrupted or repeated benchmark run does not
recompute what it already has.

Scores are keyed by a *metric key* and a *sample key*. The metric key hashes everything that can change a
score: the metric's class and registry name, the package version, every option of its configuration except
``batch_size`` (the contract makes scores independent of batching), whether images and references are passed,
and every option that names a model or a file by what it is, exactly as ``capeval score``'s resume does
(:meth:`capeval_plugins.digests.ContentDigests.options`): a local file or folder by the content of its files,
a hub id by the commit its cached snapshot resolves to (new weights under the same id or the same folder are a
new key). A hub model not in the local cache yet cannot be pinned: its scores are neither read from nor
written to the cache. The sample key hashes the candidate, the references when the metric sees them, and the
image when it does (a file by its content; embedded images by content). Corpus-level metrics, whose
per-sample scores depend on the whole corpus, are cached per corpus: the key hashes every sample key in order.
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

from capeval_plugins import files
from capeval_plugins.contract import Metric
from capeval_plugins.digests import ContentDigests, unresolved

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


def metric_key(metric: Metric, images: bool, references: bool, contents: ContentDigests | None = None) -> str | None:
    """The key of a configured metric's scores, or None when one of its models cannot be pinned now (a hub
    id not in the local cache yet)."""
    from capeval_plugins import __version__

    config = dataclasses.asdict(metric.config)
    config.pop("batch_size", None)
    contents = contents if contents is not None else ContentDigests()
    local = [k for k, v in config.items() if isinstance(v, str) and v and os.path.exists(os.path.expanduser(v))]
    sources = contents.options(metric.config, sorted({*getattr(metric.config, "input_paths", ()), *local}))
    if any(unresolved(v) for v in sources.values()):
        return None
    return digest({
        "metric": metric.info.name,
        "class": f"{type(metric).__module__}.{type(metric).__qualname__}",
        "version": __version__,
        "config": config,
        "sources": sources,
        "images": images,
        "references": references,
    })


def image_fingerprint(image: Any, contents: ContentDigests | None = None) -> Any:
    """An image's identity by content: a file by its bytes' digest, embedded bytes by their hash, a video by
    its frames'."""
    contents = contents if contents is not None else ContentDigests()
    if isinstance(image, (list, tuple)):  # a video as frames
        return [image_fingerprint(frame, contents) for frame in image]
    if isinstance(image, dict) and image.get("bytes"):
        return "sha1:" + hashlib.sha1(image["bytes"]).hexdigest()
    _, _, size, content = contents.file(os.fspath(image))
    return [size, content]


def sample_keys(candidates: Sequence[str], references: Sequence[Sequence[str]] | None,
                images: Sequence[Any] | None, contents: ContentDigests | None = None) -> list[str]:
    contents = contents if contents is not None else ContentDigests()
    prints: dict[int, Any] = {}
    keys = []
    for i, cand in enumerate(candidates):
        image = None
        if images is not None:
            ident = id(images[i]) if isinstance(images[i], dict) else (
                tuple(images[i]) if isinstance(images[i], list) else images[i])
            if ident not in prints:
                prints[ident] = image_fingerprint(images[i], contents)
            image = prints[ident]
        keys.append(digest([cand, list(references[i]) if references is not None else None, image]))
    return keys


class ScoreCache:
    """Scores by (metric key, sample key), and per-corpus score vectors by (metric key, corpus key)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        files.Folder.open(self.path.parent, create=True)[0].close()
        files.check_output(self.path, what="--cache")  # a regular file or a new name: no link, no device
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
