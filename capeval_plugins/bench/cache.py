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

import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import math
import os
import sqlite3
import stat
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from capeval_plugins import files
from capeval_plugins.contract import Metric
from capeval_plugins.files import paths
from capeval_plugins.digests import ContentDigests, unresolved

# SQLite's application_id ("CPEV"): the file is capeval's score cache, whatever its rows say
APPLICATION_ID = 0x43504556
SCHEMA_VERSION = 2  # SQLite's user_version: rows carry an HMAC (version 1 had none and is started afresh)
SCHEMA = f"""
PRAGMA application_id = {APPLICATION_ID};
PRAGMA user_version = {SCHEMA_VERSION};
CREATE TABLE sample_scores (metric TEXT, sample TEXT, score REAL, tag TEXT, PRIMARY KEY (metric, sample));
CREATE TABLE corpus_scores (metric TEXT, corpus TEXT, scores BLOB, tag TEXT, PRIMARY KEY (metric, corpus));
"""
# the tables of version 1 (no application_id, no tags): capeval's own, replaced by a new empty cache
_VERSION_1 = {"sample_scores": ["metric", "sample", "score"], "corpus_scores": ["metric", "corpus", "scores"]}
_SQLITE_MAGIC = b"SQLite format 3\0"
# SQLite's errors that say nothing about the file's content (Python 3.11+ names them), by primary code: an
# extended one (SQLITE_IOERR_DELETE: a journal SQLite may not remove) is its primary's kind
_NOT_DAMAGE = {"SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_READONLY", "SQLITE_IOERR", "SQLITE_FULL", "SQLITE_CANTOPEN",
               "SQLITE_PERM", "SQLITE_NOMEM", "SQLITE_INTERRUPT"}
# the files SQLite keeps beside a database and reads as part of it (a hot journal is rolled back into it; a
# write-ahead log's pages are read as its own)
SIDECARS = ("-journal", "-wal", "-shm")
_MAX_FILES = 10_000


class CacheError(files.FileError):
    """A score cache that cannot be used: another user's, writable by others, damaged, or not capeval's
    (one line, exit code 2)."""


def default_cache_path() -> Path:
    """``$CAPEVAL_CACHE/bench/scores.sqlite``, else ``$XDG_CACHE_HOME/capeval_plugins/bench/scores.sqlite``."""
    return paths.cache_dir("bench") / "scores.sqlite"


def remove_cache(path: str | os.PathLike) -> bool:
    """Remove the score cache at ``path`` (``capeval cache clear``) when it is capeval's (SQLite's header with
    capeval's application id), with SQLite's journal files beside it; anything else there is left as it is.
    False when nothing of the package's was there."""
    path = Path(path)
    if not path.is_file():
        return False
    with files.Folder.open(path.parent)[0] as folder:
        if folder.kind(path.name) != "file" or os.stat(path.name, dir_fd=folder.fd).st_uid != os.geteuid():
            return False
        with files.open_input(path, "score cache") as f:
            head = f.read(100)
        if head[:16] != _SQLITE_MAGIC or int.from_bytes(head[68:72], "big") != APPLICATION_ID:
            return False
        for name in (path.name + "-journal", path.name + "-wal", path.name + "-shm", path.name):
            if folder.kind(name) == "file":
                folder.unlink(name)
    return True


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
    sources = contents.options(metric.config, sorted({*getattr(metric.config, "input_paths", ()), *local}),
                               metric.default_sources())
    if any(unresolved(v) for v in sources.values()):
        return None
    return digest({
        "metric": metric.info.name,
        "class": f"{type(metric).__module__}.{type(metric).__qualname__}",
        "version": __version__,
        "dependencies": dependency_versions(),
        "config": config,
        "sources": sources,
        "images": images,
        "references": references,
    })


# What scores are computed with beside the package: an upgrade of any of these may move a number (bert_score's
# bundled baselines, pycocoevalcap's jars, a model class's code), so it makes the scores cached before unreachable.
SCORING_DEPENDENCIES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "pillow", "ftfy",
                        "pycocoevalcap", "bert_score", "nltk", "diffusers", "peft", "polos", "open_clip_torch")


@functools.lru_cache(maxsize=1)
def dependency_versions() -> dict[str, str | None]:
    """The installed version of each of :data:`SCORING_DEPENDENCIES` (None when it is not installed), read in
    one pass over the installed distributions (a lookup per name costs ten times more)."""
    from importlib.metadata import distributions

    installed: dict[str, str] = {}
    for dist in distributions():
        installed.setdefault((dist.metadata["Name"] or "").lower().replace("-", "_"), dist.version)
    return {name: installed.get(name.replace("-", "_")) for name in SCORING_DEPENDENCIES}


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
    """Scores by (metric key, sample key), and per-corpus score vectors by (metric key, corpus key).

    The file must be the user's and writable by no one else, and so must its folder (a sticky one such as
    ``/tmp`` too: anyone may create there the journal names SQLite reads as part of the cache), so no one else
    can plant or change scores in it; a journal or write-ahead log beside it that is not the user's own regular
    file is refused, leaving both as they are (never rolled into the cache, never a reason to set the cache
    aside); it is created whole (mode 0600) with
    SQLite's application id set to capeval's, and every row carries an HMAC keyed by the user's secret (the
    one run folders use, :func:`capeval_plugins.files.secret`): a row that does not verify (written by hand,
    copied from another account) is never returned, so its score is computed again and the row replaced. A
    file that is not an SQLite database of capeval's is refused as it is; a capeval cache that SQLite finds
    damaged is set aside under a new name (never deleted) and refused once, so the next run starts a new
    cache."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.db: sqlite3.Connection | None = None
        folder = files.Folder.open(self.path.parent, create=True, mode=0o700)[0]
        with folder:
            _check_folder(folder)
            files.check_output(self.path, what="--cache")  # a regular file or a new name: no link, no device
            if folder.kind(self.path.name) is None:
                with contextlib.suppress(FileExistsError):  # another run made it first
                    folder.write(self.path.name, _new_database(), replace=False, mode=0o600)
            self._check_file(folder)
            _check_sidecars(folder, self.path, os.geteuid())
            with self._guard(folder):  # closes the connection on any refusal
                self.db = sqlite3.connect(str(self.path), timeout=60)
                if not self._current():
                    self.db.close()
                    folder.write(self.path.name, _new_database(), mode=0o600)  # version 1, checked as capeval's
                    self.db = sqlite3.connect(str(self.path), timeout=60)
                self._key = bytes.fromhex(files.mac(files.secret(), "score-cache"))

    def _check_file(self, folder: files.Folder) -> None:
        st = os.stat(self.path.name, dir_fd=folder.fd, follow_symlinks=False)
        if st.st_uid != os.geteuid():
            raise CacheError(f"the score cache {self.path} belongs to another user (uid {st.st_uid}); capeval reads "
                             "only a cache of yours: give --cache FILE (a new name) or --no-cache")
        if st.st_mode & 0o022:
            raise CacheError(f"the score cache {self.path} is writable by others (mode {stat.filemode(st.st_mode)}), "
                             f"who could change its scores: chmod go-w {self.path}, or give --cache FILE (a new name)")

    def _current(self) -> bool:
        """Whether the database is a capeval cache of this version (False: capeval's version 1, to be started
        afresh); anything else is refused."""
        assert self.db is not None
        app, version = (self.db.execute(f"PRAGMA {p}").fetchone()[0] for p in ("application_id", "user_version"))
        if app == APPLICATION_ID and version == SCHEMA_VERSION:
            return True
        tables = {name: [row[1] for row in self.db.execute(f"PRAGMA table_info({name})")]
                  for (name,) in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if app == 0 and version == 0 and tables == _VERSION_1:
            return False
        raise CacheError(f"{self.path} is not a capeval score cache (another SQLite database, or one of a newer "
                         "version); capeval leaves it as it is: give --cache FILE (a new name) or --no-cache")

    @contextlib.contextmanager
    def _guard(self, folder: files.Folder | None = None) -> Iterator[None]:
        """SQLite's errors as one line; a damaged cache of capeval's is set aside, so the next run starts anew
        (a busy, read-only or unreadable one is only reported: it is not damaged)."""
        try:
            yield
        except BaseException as err:
            if self.db is not None:
                self.db.close()
                self.db = None
            if not isinstance(err, sqlite3.DatabaseError):
                raise
            if _primary(getattr(err, "sqlite_errorname", None)) in _NOT_DAMAGE or (
                    not hasattr(err, "sqlite_errorname") and isinstance(err, sqlite3.OperationalError)):
                raise CacheError(f"cannot use the score cache {self.path}: {err}") from None
            raise self._damaged(err, folder) from None

    def _damaged(self, err: Exception, folder: files.Folder | None) -> CacheError:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        own = folder or files.Folder.open(self.path.parent)[0]
        try:
            with files.open_input(self.path, "score cache") as f:
                head = f.read(100)
            ours = head[:16] == _SQLITE_MAGIC and int.from_bytes(head[68:72], "big") == APPLICATION_ID
            if not ours:
                return CacheError(f"{self.path} is not a capeval score cache ({reason}); capeval leaves it as it is: "
                                  "give --cache FILE (a new name) or --no-cache")
            aside = own.set_aside(self.path.name, "damaged")
        finally:
            if folder is None:
                own.close()
        return CacheError(f"the score cache {self.path} is damaged ({reason}); capeval moved it to {aside} and the "
                          "next run starts a new cache (scores are computed again)")

    def _tag(self, *parts: bytes | str) -> str:
        return files.mac(self._key, *parts)

    def _sample_tag(self, metric: str, sample: str, score: float | None) -> str:
        return self._tag("score", metric, sample, "nan" if score is None else float(score).hex())

    def get(self, metric: str, samples: Iterable[str]) -> dict[str, float]:
        """The authentic scores of ``samples`` found (a row whose HMAC does not verify is not found)."""
        assert self.db is not None
        samples = list(samples)
        found: dict[str, float] = {}
        with self._guard():
            for start in range(0, len(samples), 500):
                chunk = samples[start : start + 500]
                marks = ",".join("?" * len(chunk))
                query = f"SELECT sample, score, tag FROM sample_scores WHERE metric = ? AND sample IN ({marks})"
                for sample, score, tag in self.db.execute(query, [metric, *chunk]):
                    if not isinstance(score, (float, int, type(None))) or not _is_tag(tag):
                        continue
                    if hmac.compare_digest(tag, self._sample_tag(metric, sample, score)):
                        found[sample] = math.nan if score is None else float(score)  # SQLite stores NaN as NULL
        return found

    def put(self, metric: str, scores: Mapping[str, float]) -> None:
        assert self.db is not None
        rows = []
        for k, v in scores.items():
            value = None if math.isnan(v) else float(v)
            rows.append((metric, k, value, self._sample_tag(metric, k, value)))
        with self._guard(), self.db:
            self.db.executemany("INSERT OR REPLACE INTO sample_scores VALUES (?, ?, ?, ?)", rows)

    def get_corpus(self, metric: str, corpus: str) -> np.ndarray | None:
        assert self.db is not None
        with self._guard():
            row = self.db.execute("SELECT scores, tag FROM corpus_scores WHERE metric = ? AND corpus = ?",
                                  (metric, corpus)).fetchone()
        if row is None or not isinstance(row[0], bytes) or not _is_tag(row[1]):
            return None
        if not hmac.compare_digest(row[1], self._tag("corpus", metric, corpus, row[0])) or len(row[0]) % 8:
            return None
        return np.frombuffer(row[0], dtype=np.float64).copy()

    def put_corpus(self, metric: str, corpus: str, scores: np.ndarray) -> None:
        assert self.db is not None
        blob = np.asarray(scores, dtype=np.float64).tobytes()
        with self._guard(), self.db:
            self.db.execute("INSERT OR REPLACE INTO corpus_scores VALUES (?, ?, ?, ?)",
                            (metric, corpus, blob, self._tag("corpus", metric, corpus, blob)))

    def close(self) -> None:
        if self.db is not None:
            self.db.close()


def _is_tag(value: Any) -> bool:
    return isinstance(value, str) and value.isascii()  # compare_digest takes ASCII text only


def _primary(name: str | None) -> str | None:
    """``SQLITE_IOERR_DELETE`` -> ``SQLITE_IOERR``: the kind of an extended SQLite error."""
    return "_".join(name.split("_")[:2]) if name else name


def _check_folder(folder: files.Folder) -> None:
    """The cache's folder must let no one else put files beside the cache: the user's or root's, and not
    writable by others, sticky or not (in ``/tmp`` anyone may create ``scores.sqlite-journal`` before the
    owner's run, and SQLite would roll it into the owner's cache)."""
    st = os.fstat(folder.fd)
    if st.st_uid not in (os.geteuid(), 0):
        raise CacheError(f"the score cache's folder {folder.path} belongs to another user (uid {st.st_uid}); give "
                         "--cache FILE in a folder of yours, or --no-cache")
    if st.st_mode & 0o002:
        raise CacheError(f"the score cache's folder {folder.path} is writable by others (mode "
                         f"{stat.filemode(st.st_mode)}), who could put journals beside the cache that SQLite reads as "
                         "part of it: give --cache FILE in a folder only you can write, or --no-cache")


def _check_sidecars(folder: files.Folder, path: Path, owner: int) -> None:
    """Refuse, leaving every file as it is, a journal, write-ahead log or shared-memory file beside the cache
    that is not ``owner``'s own regular file with one name and writable by no one else: SQLite would read it
    as part of the cache (roll a hot journal back into it, read a log's pages as its own) or fail on it, and a
    failure must not set the owner's valid cache aside."""
    for suffix in SIDECARS:
        name = path.name + suffix
        try:
            st = os.stat(name, dir_fd=folder.fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            problem = f"is a {files.file_kind(folder.path / name, follow=False)}, not a regular file"
        elif st.st_uid != owner:
            problem = f"belongs to another user (uid {st.st_uid})"
        elif st.st_nlink != 1:
            problem = f"has {st.st_nlink} names (a hard link)"
        elif st.st_mode & 0o022:
            problem = f"is writable by others (mode {stat.filemode(st.st_mode)})"
        else:
            continue
        raise CacheError(f"{folder.path / name}, beside the score cache, {problem}; SQLite would read it as part of "
                         "the cache, so capeval leaves both as they are: have it removed, or give --cache FILE in a "
                         "folder only you can write, or --no-cache")


def _new_database() -> bytes:
    """An empty cache of this version, whole (written under a private name, then linked in)."""
    where = files.private_folder("capeval-cache-")
    try:
        db = sqlite3.connect(str(where / "new.sqlite"))
        try:
            db.executescript(SCHEMA)
            db.commit()
        finally:
            db.close()
        return files.read_input(where / "new.sqlite")
    finally:
        files.remove_private(where)


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
