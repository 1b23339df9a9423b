"""METEOR's paraphrase table cut down to the entries a corpus can use: the jar's scores, without its long load.

METEOR 1.5's JVM spends 6-7.5 s of CPU loading its English paraphrase table (``data/paraphrase-en.gz``,
5,274,084 entries of three lines: a probability, a phrase A, a paraphrase B), most of a captioning corpus's
METEOR time. The jar takes another table (``-a file``). Given only the entries whose A and B both can occur in
the corpus, in the original file order, it aligns every segment as with the full table, so every statistic
and score is the same. Why, from the jar's source (cmu-mtlab/meteor; its aligner and normaliser compile to
the jar's own bytecode):

1. The paraphrase stage (``ParaphraseMatcher``) is the table's only reader. For each position of one line it
   walks a trie of the A phrases (words become ids through the table's own vocabulary; a word the table lacks
   becomes -1, which no phrase holds) and, for each A found there (by length, then in file order), scans the
   other line for that entry's B, recording a match only where B occurs. An entry whose A is in neither line
   or whose B is not in the other line records nothing, and leaving it out reorders nothing: any table that
   holds the other entries, in file order, yields the same matches in the same order, hence the same
   alignment search and statistics.
2. Which phrases can occur in a line after ``-norm`` (``Normalizer.normalizeLine`` keeping punctuation, then
   lower-cased) is bounded without copying the normaliser. Call a *run* a maximal stretch of the normaliser's
   alphanumerics. The normaliser creates none (but for its placeholder ``DOTMULTI``, turned back into dots),
   removes none (it removes only dots and dashes), never splits a run, and can put two runs in one token only
   when nothing but ``. ' ` , -`` (or ``‘ ’``) separates them inside one whitespace-separated token: it wraps
   every other character in spaces. So the alphanumerics of each normalised token (its *core*) are
   consecutive runs of the text, joined across such separators. A phrase's *core string* is the cores of its
   tokens, empty ones left out, joined by single spaces; a phrase that occurs in a normalised line has a core
   string among the n-grams of that line's runs under some choice of joins (:func:`text_ngrams` lists them
   all, n up to the table's longest phrase). An entry is kept when the core strings of its A and of its B
   are both among the corpus's. A 64-bit hash collision only keeps an entry more.
3. The argument needs the JVM's lower-casing and character classes to agree with Python's: they do on
   :data:`SUPPORTED` (ASCII, Latin-1, Latin Extended-A but ``İ``, curly quotes, dashes, the ellipsis), and
   Java's ``StringTokenizer`` splits on space, tab, form feed and line ends only (``\\x0b`` is no separator
   for it). A corpus holding any other character, the placeholder ``DOTMULTI`` (also with dots inside), or
   a text with more core strings than :data:`MAX_NGRAMS` or, when more, :data:`MAX_NGRAMS_PER_RUN` per run
   (dense joins such as ``a-b-c-d-...``) gets the full table: correct, only slower.

4. The jar reads each entry's first line (a probability) and never parses it (``ParaphraseTransducer``: the
   parse is commented out, and every paraphrase match has probability 1), so the tables written here give
   it as ``1``; the A and B lines are the file's, byte for byte.

The index is built once per machine and table file in the user's cache (``$CAPEVAL_CACHE/meteor``, else
``$XDG_CACHE_HOME/capeval_plugins/meteor``, that is ``~/.cache/capeval_plugins/meteor``). The table lists the
entries of one A phrase together (430,639 runs for 5,274,084 entries in the English table), so the index hashes
the core string of each run's A line only (:func:`~.meteor_build.build_arrays`) and keeps the B lines
zlib-compressed in blocks of :data:`BLOCK` entries: about 37 MB for the English table, built in about 1.5 CPU-s
(``benchmarks/README.md``).
A corpus's table takes the runs whose A core string is among the corpus's, decompresses the blocks of their
entries and keeps those whose B core string is too. Every file goes through :mod:`capeval_plugins.files`: under
a lock, written whole through a listed scratch name (what a killed build leaves is removed by the next one),
listed as the package's, the metadata last, signed with the user's key and with each file's digest
(xxh3-128), checked whenever a process opens the index: a damaged or crafted index is built again, never read.
The tables written for the JVMs go to private folders of TMPDIR (``capeval-meteor-*``), each with a signed
marker and an in-use lock, so the folders a killed run left are recognised and removed by the next run
(:func:`sweep_temp_tables`); ``capeval cache`` shows and clears both.

Why one module of ~700 lines: the index's layout, the cut for one corpus and the cache that keeps the index are
one file format read and written together, and the argument above for why the cut changes no score is about all
of them at once. How the table file becomes the index's arrays (with no Python object per line) is
:mod:`.meteor_build`'s.
"""
from __future__ import annotations

import contextlib
import gzip
import itertools
import os
import re
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import xxhash

from capeval_plugins.files import paths
from capeval_plugins.core.coco_text import _ranges
from capeval_plugins.core.messages import warn_once
from capeval_plugins.resources.meteor_build import BLOCK, build_arrays, gunzip_pieces, kept_heap, phrase_cores
from capeval_plugins.resources.meteor_build import core_hashes as _core_hashes, hashes as _hashes

FORMAT = 3                  # of the index files; a new format replaces the package's old one
CACHE_ENV = paths.CACHE_ENV  # relocates every capeval cache: this one is $CAPEVAL_CACHE/meteor
QUIET_ENV = "CAPEVAL_QUIET"
INDEX_KIND = "meteor-paraphrase-index"
LOCK = "build.lock"
LOCK_WAIT = 900.0           # seconds to wait for another process's build before using the full table
BUILD_SECONDS = 2           # what the build costs (CPU) on the 2-core development machine (benchmarks/README.md)

# The normaliser's alphanumerics (edu.cmu.meteor.util.Normalizer.alnum) within SUPPORTED, as regex ranges.
ALNUM = r"0-9A-Za-z\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u017e"
# Characters the argument covers (module docstring, point 3): the JVM and Python lower-case each of them to one
# character of the same class (\u0130, "İ", lower-cases to two characters, the second no alphanumeric).
SUPPORTED = r"\t\n\r\f\x20-\x7e\u00a0-\u012f\u0131-\u017e\u2013\u2014\u2018\u2019\u201c\u201d\u2026"
JOINABLE = r".'`,\-\u2018\u2019"  # what the normaliser does not wrap in spaces (nor is whitespace)
MAX_NGRAMS = 50_000              # core strings of one text, or MAX_NGRAMS_PER_RUN per run when that is more
MAX_NGRAMS_PER_RUN = 64          # (a text without joins has at most the longest phrase's length per run)

_RUN = re.compile(f"[{ALNUM}]+")
_UNSUPPORTED = re.compile(f"[^{SUPPORTED}]")
_JOIN = re.compile(f"[{JOINABLE}]+")


class _TooMany(Exception):
    pass


# ---------------------------------------------------------------------------------------------- texts


def unsupported(text: str) -> str | None:
    """Why ``text`` is outside the argument (module docstring, point 3), or None."""
    bad = _UNSUPPORTED.search(text)
    if bad:
        return f"the character {bad.group()!r}"
    if "DOTMULTI" in text.replace(".", ""):
        return "METEOR's placeholder DOTMULTI"
    return None


def text_ngrams(text: str, max_n: int) -> list[str] | None:
    """Every core string of at most ``max_n`` tokens that a phrase occurring in ``text`` after METEOR's
    normaliser can have (module docstring, point 2); None when ``text`` is outside the argument or has more
    core strings than :data:`MAX_NGRAMS` (or :data:`MAX_NGRAMS_PER_RUN` per run). Repeats are not removed."""
    if unsupported(text):
        return None
    low = text.lower()
    runs: list[str] = []
    joins: list[bool] = []  # joins[k]: runs k and k + 1 may end up in one token
    end = 0
    for m in _RUN.finditer(low):
        if runs:
            joins.append(_JOIN.fullmatch(low, end, m.start()) is not None)
        runs.append(m.group())
        end = m.end()
    if not any(joins):
        return [" ".join(runs[i:i + n]) for n in range(1, max_n + 1) for i in range(len(runs) - n + 1)]
    budget = max(MAX_NGRAMS, MAX_NGRAMS_PER_RUN * len(runs))
    # starts[i]: (end, core) of every token core that can begin at run i: runs i .. end - 1 joined
    starts = []
    for i, run in enumerate(runs):
        options, j, core = [(i + 1, run)], i, run
        while j < len(joins) and joins[j]:
            j += 1
            core += runs[j]
            options.append((j + 1, core))
        starts.append(options)
    out: list[str] = []

    def extend(at: int, prefix: str, left: int) -> None:
        for stop, core in starts[at]:
            out.append(prefix + core)
            if left > 1 and stop < len(runs):
                extend(stop, prefix + core + " ", left - 1)
        if len(out) > budget:
            raise _TooMany

    try:
        for i in range(len(runs)):
            extend(i, "", max_n)
    except _TooMany:
        return None
    return out


def distinct(values: np.ndarray) -> np.ndarray:
    """``np.unique`` by sorting (numpy 2's hashing ``unique`` is 20 times slower on 64-bit hashes)."""
    values = np.sort(values)
    return values[np.concatenate(([True], values[1:] != values[:-1]))] if len(values) else values


def union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return distinct(np.concatenate((a, b)))


EMPTY = _hashes([b""])  # the core string of a phrase of punctuation alone: in every corpus
MEMO_TEXTS = 200_000     # texts whose hashed core strings are remembered (a validation loop's references)
_memo: dict[tuple[str, int], np.ndarray | None] = {}


def text_grams(text: str, max_n: int) -> np.ndarray | None:
    """The hashes of :func:`text_ngrams` (remembered: the references of a validation loop come back every
    epoch)."""
    key = (text, max_n)
    found = _memo.get(key, False)
    if found is not False:
        return found
    grams = text_ngrams(text, max_n)
    hashes = None if grams is None else _hashes((g.encode("utf-8") for g in grams), len(grams))
    if len(_memo) >= MEMO_TEXTS:
        _memo.clear()
    _memo[key] = hashes
    return hashes


@dataclass
class CorpusGrams:
    """The hashed core strings of a corpus (sorted, unique, the empty string among them), or why there are none."""

    hashes: np.ndarray | None
    reason: str = ""


def corpus_grams(texts: Iterable[str], max_n: int) -> CorpusGrams:
    parts = [EMPTY]
    for text in dict.fromkeys(texts):
        hashes = text_grams(text, max_n)
        if hashes is None:
            why = unsupported(text) or f"a text with more than {MAX_NGRAMS} n-grams (dense joins)"
            return CorpusGrams(None, why)
        parts.append(hashes)
    return CorpusGrams(distinct(np.concatenate(parts)))


@dataclass
class CorpusPhrases:
    """The hashed core strings a corpus's requests can use: of its references, and (:meth:`grams`) of every
    text; or (``index`` None) why the corpus gets the full table."""

    index: "ParaphraseIndex | None"
    references: np.ndarray | None = None
    hypotheses: Sequence[str] = ()
    reason: str = ""

    def grams(self) -> np.ndarray | None:
        """Of every text; None when a hypothesis is outside the argument."""
        if not hasattr(self, "_grams"):
            hyps = corpus_grams(self.hypotheses, self.index.max_n).hashes
            self._grams = None if hyps is None else union(self.references, hyps)
        return self._grams


TEMP_PREFIX = "capeval-meteor-"  # the private folders in TMPDIR that hold a JVM's table (module docstring)
TEMP_KIND = "meteor-table"
TEMP_LOCK = "in-use.lock"        # held by the process whose JVMs read the table, while it lives


@dataclass
class FilteredTable:
    """Some entries of an index (sorted ids), written for the JVM at ``path``: those a corpus can use (both
    phrases among its core strings), or, ``any_hypothesis``, every entry with a phrase among the core strings
    of ``references`` (a match needs one phrase in a reference, so this table serves those references with any
    candidates: the captions of a validation loop's next epochs)."""

    source: str
    entries: np.ndarray
    path: str
    references: np.ndarray  # core-string hashes of the references it was made for
    any_hypothesis: bool = False
    lock: int | None = None  # the descriptor of the folder's in-use lock, held while the table lives

    def serves(self, corpus: CorpusPhrases) -> bool:
        """Whether it holds every entry ``corpus`` can use."""
        if corpus.index is None or corpus.index.source != self.source:
            return False
        if self.any_hypothesis:
            return bool(np.isin(corpus.references, self.references, assume_unique=True).all())
        grams = corpus.grams()
        return grams is not None and bool(np.isin(corpus.index.select(grams), self.entries, assume_unique=True).all())

    def remove(self) -> None:
        from capeval_plugins import files

        with contextlib.suppress(OSError, files.FileError):
            _remove_temp(Path(self.path).parent)
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None


def write_temp_table(data: bytes) -> tuple[str, int]:
    """``data`` as ``paraphrase.gz`` in a new private folder of TMPDIR, listed in a marker of the package's
    with an in-use lock held by this process (so a later process can tell the folder of a killed run from a
    live one: :func:`sweep_temp_tables`). Returns the file's path and the lock's descriptor."""
    import fcntl

    from capeval_plugins import files

    sweep_temp_tables()
    claim = files.Claim(files.private_folder(TEMP_PREFIX), TEMP_KIND).open()
    try:
        claim.own([TEMP_LOCK, "paraphrase.gz"])
        fd, _ = claim.folder.lock(TEMP_LOCK)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new folder: no one else holds it
        try:
            claim.write("paraphrase.gz", data)
        except BaseException:
            os.close(fd)
            raise
        return str(claim.path / "paraphrase.gz"), fd
    except BaseException:
        with contextlib.suppress(OSError, files.FileError):
            _remove_temp(claim.path)
        raise
    finally:
        claim.folder.close()


def _remove_temp(path: Path) -> None:
    """Remove a table folder of :func:`write_temp_table`: its listed files, its marker, then the folder (only
    when nothing else is in it)."""
    from capeval_plugins import files

    claim = files.Claim(path, TEMP_KIND).open(create=False)
    try:
        claim.remove()
    finally:
        claim.folder.close()
    with contextlib.suppress(OSError):
        os.rmdir(path)


def sweep_temp_tables() -> list[str]:
    """Remove the table folders that killed runs of capeval left in TMPDIR: only folders named
    ``capeval-meteor-*`` that belong to the user, hold a marker of the package's that verifies with the user's
    key (so capeval provably made them) and whose in-use lock no process holds. Returns what it removed."""
    import fcntl
    import stat
    import tempfile

    from capeval_plugins import files

    removed = []
    root = Path(tempfile.gettempdir())
    try:
        names = [n for n in os.listdir(root) if n.startswith(TEMP_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = root / name
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            claim = files.Claim(path, TEMP_KIND).open(create=False)
        except (OSError, files.FileError):
            continue  # not ours beyond doubt: left alone
        try:
            if not claim.found or not claim.owns(TEMP_LOCK):
                continue
            fd, _ = claim.folder.lock(TEMP_LOCK)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live process's table
            finally:
                os.close(fd)
        except (OSError, files.FileError):
            continue
        finally:
            claim.folder.close()
        with contextlib.suppress(OSError, files.FileError):
            _remove_temp(path)
            removed.append(str(path))
    return removed


class ParaphraseIndex:
    """The index of one paraphrase table file (:func:`build_arrays`), its arrays mapped from the cache."""

    def __init__(self, source: str, meta: dict, arrays: dict, store=None) -> None:
        self.source = source
        self.entries = int(meta["entries"])
        self.max_n = int(meta["max_cores"])
        self.block = int(meta["block"])
        self.arrays = arrays
        self._store = store  # saves an array computed later (``b_hash``) beside the others, when given

    @classmethod
    def from_table(cls, data: bytes, source: str = "memory", block: int = BLOCK) -> "ParaphraseIndex":
        """The index of a decompressed table, in memory."""
        arrays, meta = build_arrays(data, block)
        return cls(source, meta, arrays)

    def _groups(self, grams: np.ndarray) -> np.ndarray:
        """The runs whose A core string is in ``grams`` (sorted hashes), sorted."""
        hashes = self.arrays["a_hash"]
        lo, hi = np.searchsorted(hashes, grams, side="left"), np.searchsorted(hashes, grams, side="right")
        return np.sort(self.arrays["a_group"][_ranges(lo, hi - lo)].astype(np.int64))

    def _entries_of(self, groups: np.ndarray) -> np.ndarray:
        start = self.arrays["group_start"].astype(np.int64)
        return _ranges(start[groups], start[groups + 1] - start[groups])

    def b_lines(self, entries: np.ndarray) -> list[bytes]:
        """The B lines of ``entries`` (sorted ids), each block they lie in decompressed once."""
        entries = np.asarray(entries, dtype=np.int64)
        if not len(entries):
            return []
        offsets, blob = self.arrays["b_offsets"], self.arrays["b_blocks"]
        blocks, local = np.divmod(entries, self.block)
        cuts = np.flatnonzero(np.diff(blocks)) + 1
        out: list[bytes] = []
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(entries)]):
            k = int(blocks[lo])
            lines = zlib.decompress(blob[int(offsets[k]):int(offsets[k + 1])]).split(b"\n")
            out += [lines[i] for i in local[lo:hi].tolist()]
        return out

    def _select(self, grams: np.ndarray) -> tuple[np.ndarray, list[bytes]]:
        """The entries whose A and B core strings are both in ``grams``, and their B lines."""
        entries = self._entries_of(self._groups(grams))
        lines = self.b_lines(entries)
        keep = np.isin(_core_hashes(lines), grams, assume_unique=False)
        return entries[keep], list(itertools.compress(lines, keep.tolist()))

    def select(self, grams: np.ndarray) -> np.ndarray:
        """The ids (sorted: file order) of the entries whose A and B core strings are both in ``grams``."""
        return self._select(grams)[0]

    def b_hash(self) -> np.ndarray:
        """Every entry's B core-string hash (computed on first use, then kept in the cache beside the index:
        only validation loops need it, :meth:`table_for_references`)."""
        if "b_hash" not in self.arrays:
            offsets, blob = self.arrays["b_offsets"], self.arrays["b_blocks"]
            parts = [zlib.decompress(blob[int(offsets[k]):int(offsets[k + 1])]) for k in range(len(offsets) - 1)]
            hashes = _hashes(phrase_cores(b"".join(parts)), self.entries)
            self.arrays["b_hash"] = hashes
            if self._store is not None:
                self._store("b_hash", hashes)
        return self.arrays["b_hash"]

    def select_either(self, grams: np.ndarray) -> np.ndarray:
        """The ids (sorted) of the entries whose A or B core string is in ``grams``."""
        b_hash = self.b_hash()
        at = np.searchsorted(grams, b_hash).clip(max=max(len(grams) - 1, 0))
        by_b = np.flatnonzero(grams[at] == b_hash) if len(grams) else np.zeros(0, np.int64)
        return union(self._entries_of(self._groups(grams)), by_b)

    def entry_bytes(self, entries: np.ndarray, lines: Sequence[bytes] | None = None) -> bytes:
        """``entries`` in the jar's layout, in the given order: a probability line (``1``: the jar never
        parses it), the A line and the B line, byte for byte (``lines``: their B lines, when known)."""
        entries = np.asarray(entries, dtype=np.int64)
        lines = self.b_lines(entries) if lines is None else lines
        groups = np.searchsorted(self.arrays["group_start"], entries, side="right") - 1
        offsets, text = self.arrays["a_offsets"], self.arrays["a_text"]
        heads = [bytes(text[int(offsets[g]):int(offsets[g + 1])]) for g in groups.tolist()]
        return b"".join(b"1\n%s\n%s\n" % pair for pair in zip(heads, lines))

    def write(self, entries: np.ndarray, references: np.ndarray, any_hypothesis: bool = False,
              lines: Sequence[bytes] | None = None) -> FilteredTable:
        """The entries, in file order, as a gzip table for the JVM (:func:`write_temp_table`)."""
        data = gzip.compress(self.entry_bytes(entries, lines), compresslevel=1, mtime=0)
        path, lock = write_temp_table(data)
        return FilteredTable(self.source, entries, path, references, any_hypothesis, lock)

    def table_for(self, corpus: CorpusPhrases) -> FilteredTable:
        """The entries ``corpus`` can use (its hypotheses inside the argument: :meth:`CorpusPhrases.grams`)."""
        entries, lines = self._select(corpus.grams())
        return self.write(entries, corpus.references, lines=lines)

    def table_for_references(self, references: np.ndarray) -> FilteredTable:
        """Every entry with a phrase among ``references`` (core-string hashes): any candidates of them."""
        return self.write(self.select_either(references), references, any_hypothesis=True)


# ---------------------------------------------------------------------------------------------- the cache


def cache_dir() -> Path:
    """``$CAPEVAL_CACHE/meteor``, else ``$XDG_CACHE_HOME/capeval_plugins/meteor`` (``~/.cache``; as root with
    another user's HOME, root's own: see :func:`capeval_plugins.files.paths.cache_dir`)."""
    return paths.cache_dir("meteor")


_loaded: dict[tuple, ParaphraseIndex | None] = {}
_loaded_lock = threading.Lock()


def index_for(table: str | os.PathLike) -> ParaphraseIndex | None:
    """The index of the paraphrase table file ``table``, built once per machine; None (with a warning) when
    the cache cannot hold it: METEOR then loads the full table."""
    table = Path(table)
    try:
        st = table.stat()
    except OSError:
        return None
    key = (str(table.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, str(cache_dir()))
    with _loaded_lock:
        if key not in _loaded:
            _loaded[key] = _open_or_build(table)
        return _loaded[key]


def _open_or_build(table: Path) -> ParaphraseIndex | None:
    from capeval_plugins import files

    root = cache_dir()
    try:
        gz = files.read_input(table, "METEOR's paraphrase table")
        source = f"{xxhash.xxh3_128_hexdigest(gz)}-v{FORMAT}"
        found = _open(root, source)
        if found is not None:
            return found
        return _build(root, source, gz)
    except (OSError, ValueError, files.FileError) as err:
        warn_once(("meteor-index", str(root)), f"METEOR's paraphrase index is not available in {root} ({err}); METEOR "
                  "loads its full paraphrase table instead (the same scores, about 6 s more CPU per process; set "
                  f"{CACHE_ENV} to a folder you can write)")
        return None


def _open(root: Path, source: str, claim=None) -> ParaphraseIndex | None:
    """The index ``source`` from the cache, when a complete one is there and listed as the package's."""
    from capeval_plugins import files

    if claim is not None:
        return _read(claim, source, root)
    if not (root / ".capeval-owned").is_file():
        return None
    claim = files.Claim(root, INDEX_KIND).open(create=False)
    try:
        found = _read(claim, source, root)
        if found is not None and any(name.endswith(SCRATCH) for name in claim.files):
            _locked(root, _remove_scratch, wait=0)  # a killed build's partial files, when no build runs now
        return found
    finally:
        claim.folder.close()


# What each file of the index holds: a numpy dtype, or None for bytes.
LAYOUT = {"group_start": "<u4", "a_hash": "<u8", "a_group": "<u4", "a_offsets": "<u8", "a_text": None,
          "b_offsets": "<u8", "b_blocks": None, "b_hash": "<u8"}
OPTIONAL = ("b_hash",)
SCRATCH = ".partial"  # a file of the index is written under its name + SCRATCH first (listed: a crash's is removed)


def read_meta(claim, source: str) -> dict | None:
    """The index's metadata, when it verifies (an HMAC with the user's key: a file crafted or damaged in the
    cache is never acted on, the index is built again) and has the shape this version writes."""
    from capeval_plugins import files

    raw = claim.read(f"{source}/meta.json") if claim.owns(f"{source}/meta.json") else None
    try:
        meta = files.read_signed_json(raw, INDEX_KIND)
        ok = (isinstance(meta, dict) and meta.get("format") == FORMAT and meta.get("source") == source
              and all(isinstance(meta.get(k), int) and meta[k] >= 0 for k in ("entries", "groups", "max_cores"))
              and isinstance(meta.get("block"), int) and meta["block"] >= 1
              and isinstance(meta.get("files"), dict) and set(LAYOUT) - set(OPTIONAL) <= set(meta["files"]) <= set(LAYOUT)
              and all(isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("digest"), str)
                      for v in meta["files"].values()))
    except (RecursionError, ValueError, TypeError, files.FileError):
        return None
    return meta if ok else None


def _read(claim, source: str, root: Path | None = None) -> ParaphraseIndex | None:
    """The index, when every file is there, listed as the package's, has the digest its metadata gives (a
    flipped bit would silently drop or change paraphrase entries) and the shape the metadata implies."""
    meta = read_meta(claim, source)
    if meta is None:
        return None
    arrays: dict = {}
    for name, about in meta["files"].items():
        data = claim.map(f"{source}/{name}") if claim.owns(f"{source}/{name}") else None
        if data is None or len(data) != about["bytes"] or digest(data) != about["digest"]:
            return None
        dtype = LAYOUT[name]
        if dtype is not None and len(data) % np.dtype(dtype).itemsize:
            return None
        arrays[name] = data if dtype is None else np.frombuffer(data, dtype=dtype)
    n, groups = meta["entries"], meta["groups"]
    blocks = -(-n // meta["block"])
    shapes_ok = (len(arrays["group_start"]) == groups + 1 and len(arrays["a_hash"]) == groups == len(arrays["a_group"])
                 and len(arrays["a_offsets"]) == groups + 1 and len(arrays["b_offsets"]) == blocks + 1
                 and (groups == 0 or int(arrays["group_start"][-1]) == n)
                 and int(arrays["a_offsets"][-1]) == len(arrays["a_text"])
                 and int(arrays["b_offsets"][-1]) == len(arrays["b_blocks"])
                 and ("b_hash" not in arrays or len(arrays["b_hash"]) == n))
    if not shapes_ok:
        return None
    store = None if root is None else (lambda name, array: _locked(root, _add_file, source, name, array, wait=0))
    return ParaphraseIndex(source, meta, arrays, store)


def digest(data) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _locked(root: Path, work, *args, wait: float = LOCK_WAIT):
    """``work(claim, *args)`` under the cache's build lock; None without running it when another process
    holds the lock longer than ``wait`` seconds (0: try once)."""
    import fcntl

    from capeval_plugins import files

    folder, _ = files.Folder.open(root, create=True, mine=True)
    with folder:
        # a folder whose marker is not the user's is refused before the lock file is made in it: a refusal
        # leaves the folder as it was
        files.Claim(root, INDEX_KIND).open(create=False).folder.close()
        fd, _ = folder.lock(LOCK)
        try:
            deadline = time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        if wait:
                            raise OSError(f"another process has been building the index for {wait:.0f} s") from None
                        return None
                    time.sleep(0.2)
            claim = files.Claim(root, INDEX_KIND).open()
            try:
                return work(claim, *args)
            finally:
                claim.folder.close()
        finally:
            os.close(fd)  # drops the lock


def _remove_scratch(claim) -> None:
    """The partial files a killed build left (listed, named ``<file>.partial``): removed, under the lock."""
    claim.remove([name for name in claim.files if name.endswith(SCRATCH)])


def _write_files(claim, source: str, contents: dict) -> None:
    """Write ``contents`` (name -> bytes) into the index ``source``, each through its listed scratch name."""
    names = [f"{source}/{name}" for name in contents]
    claim.own(names + [name + SCRATCH for name in names])
    for name, content in zip(names, contents.values()):
        claim.write(name, content, scratch=name + SCRATCH)
    _remove_scratch(claim)


def _add_file(claim, source: str, name: str, array: np.ndarray) -> None:
    """Add a file computed later (``b_hash``) to a complete index, its metadata rewritten last."""
    from capeval_plugins import files

    meta = read_meta(claim, source)
    if meta is None or name in meta["files"]:
        return
    content = memoryview(np.ascontiguousarray(array)).cast("B")
    _write_files(claim, source, {name: content})
    meta["files"][name] = {"bytes": len(content), "digest": digest(content)}
    _write_files(claim, source, {"meta.json": files.signed_json(meta, INDEX_KIND)})


def clear_cache() -> None:
    """Remove the index from the cache (``capeval cache clear``): under the build lock, every file the marker
    lists, the marker, and the folder when the package made it and nothing else is in it."""
    def remove(claim) -> None:
        claim.remove()
        with _loaded_lock:
            _loaded.clear()

    _locked(cache_dir(), remove)


def _build(root: Path, source: str, gz: bytes) -> ParaphraseIndex | None:
    """Build the index under the cache's lock (another process building it meanwhile: wait, then read)."""
    return _locked(root, _build_locked, root, source, gz)


def _build_locked(claim, root: Path, source: str, gz: bytes) -> ParaphraseIndex | None:
    from capeval_plugins import files

    found = _read(claim, source, root)
    if found is not None:
        return found
    if os.environ.get(QUIET_ENV) != "1":
        again = claim.owns(f"{source}/meta.json")  # there, but a file did not verify
        print(f"building METEOR's paraphrase index {'again: the one in the cache is damaged' if again else 'once'}"
              f" (about {BUILD_SECONDS} s; kept in {root})", file=sys.stderr, flush=True)
    with kept_heap():
        arrays, meta = build_arrays(gunzip_pieces(gz))
    claim.remove([name for name in claim.files if not name.startswith(source + "/") or name.endswith(SCRATCH)])
    contents = {name: a if isinstance(a, bytes) else memoryview(np.ascontiguousarray(a)).cast("B")
                for name, a in arrays.items()}
    _write_files(claim, source, contents)
    meta = {"format": FORMAT, "source": source, **meta,
            "files": {name: {"bytes": len(c), "digest": digest(c)} for name, c in contents.items()}}
    _write_files(claim, source, {"meta.json": files.signed_json(meta, INDEX_KIND)})  # last: the index is complete
    return _read(claim, source, root)


# ---------------------------------------------------------------------------------------------- a corpus


def default_table(jar: str) -> Path:
    """The English table the jar loads by default (``data/paraphrase-en.gz`` beside it)."""
    return Path(os.path.dirname(os.path.abspath(jar))) / "data" / "paraphrase-en.gz"


_references_memo: dict[str, CorpusGrams] = {}


def phrases(jar: str, references: Iterable[str], hypotheses: Iterable[str]) -> CorpusPhrases:
    """The core strings of the texts METEOR will read (the fields of its requests, as it splits them). Only the
    references need be inside the argument: a match needs one of its phrases in a reference."""
    table = default_table(jar)
    if not table.is_file():
        return CorpusPhrases(None, reason=f"no paraphrase table at {table}")
    index = index_for(table)
    if index is None:
        return CorpusPhrases(None, reason="no index of the paraphrase table")
    references = list(dict.fromkeys(references))
    key = f"{index.max_n}:{xxhash.xxh3_128_hexdigest(chr(0).join(references).encode('utf-8', 'surrogatepass'))}"
    refs = _references_memo.get(key)  # a validation loop's references, epoch after epoch
    if refs is None:
        refs = corpus_grams(references, index.max_n)
        _references_memo.clear()
        _references_memo[key] = refs
    if refs.hashes is None:
        return CorpusPhrases(None, reason=f"a reference holds {refs.reason}")
    return CorpusPhrases(index, refs.hashes, list(hypotheses))
