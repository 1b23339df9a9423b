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

The index (64-bit hashes of every entry's A and B core strings, sorted by A, and the decompressed table) is
built once per machine and table file in the user's cache (``$CAPEVAL_CACHE/meteor``, else
``$XDG_CACHE_HOME/capeval_plugins/meteor``, that is ``~/.cache/capeval_plugins/meteor``) through
:mod:`capeval_plugins.files`: under a lock, every file written whole and listed as the package's, its
metadata last, with each file's digest (xxh3-128), checked whenever a process opens the index (about 30 ms
for its 421 MB): a damaged index is built again, never read. A corpus's table then takes a few hundred
milliseconds to select and write.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import xxhash

from capeval_plugins.core.coco_text import _ranges
from capeval_plugins.core.messages import warn_once

FORMAT = 2                  # of the index files; a new format replaces the package's old one
CACHE_ENV = "CAPEVAL_CACHE"  # relocates every capeval cache: this one is $CAPEVAL_CACHE/meteor
QUIET_ENV = "CAPEVAL_QUIET"
INDEX_KIND = "meteor-paraphrase-index"
LOCK = "build.lock"
LOCK_WAIT = 900.0           # seconds to wait for another process's build before using the full table
BUILD_SECONDS = 12          # what the build costs (CPU) on the 2-core development machine (benchmarks/README.md)

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
# A table phrase's characters that are neither alphanumeric nor outside SUPPORTED, in UTF-8 (removed from its
# cores); characters outside SUPPORTED stay, so a phrase holding one matches no corpus.
_PUNCT_ASCII = bytes(c for c in range(0x21, 0x7F) if not chr(c).isalnum())
_PUNCT_WIDE = re.compile(rb"\xc2[\xa0-\xbf]|\xc3[\x97\xb7]|\xe2\x80[\x93\x94\x98\x99\x9c\x9d\xa6]")
_TOKEN_BREAKS = bytes.maketrans(b"\t\f", b"  ")  # StringTokenizer's separators within a line, as spaces


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


def _hashes(strings: Iterable[bytes], count: int = -1) -> np.ndarray:
    return np.fromiter(map(xxhash.xxh3_64_intdigest, strings), dtype=np.uint64, count=count)


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


# ---------------------------------------------------------------------------------------------- the table


def phrase_cores(block: bytes) -> list[bytes]:
    """The core string (UTF-8) of each line of ``block`` (lines ending in ``\\n``): each token's alphanumerics
    and unsupported characters, tokens left empty dropped, joined by single spaces."""
    if not block:
        return []
    block = _PUNCT_WIDE.sub(b"", block.translate(_TOKEN_BREAKS, _PUNCT_ASCII))
    if block.endswith(b"\n"):
        block = block[:-1]
    while b"  " in block:
        block = block.replace(b"  ", b" ")
    return (b"\n" + block + b"\n").replace(b" \n", b"\n").replace(b"\n ", b"\n").split(b"\n")[1:-1]


def entry_offsets(data: bytes) -> np.ndarray:
    """Where each entry (three lines) of a decompressed table starts, and its end."""
    view = np.frombuffer(data, dtype=np.uint8)
    parts, seen, step = [np.zeros(1, np.uint64)], 0, 1 << 26
    for lo in range(0, len(view), step):
        newlines = np.flatnonzero(view[lo:lo + step] == 10) + lo
        parts.append((newlines[(2 - seen) % 3::3] + 1).astype(np.uint64))  # each entry's third line end
        seen += len(newlines)
    if seen % 3:
        raise ValueError(f"the paraphrase table has {seen} lines, not three per entry")
    return np.concatenate(parts)


def build_arrays(data: bytes) -> tuple[dict[str, np.ndarray], int]:
    """The index of a decompressed table: ``offsets`` (where each entry's three lines start, and the end), the
    hashes of the A core strings sorted (``a_hash``) with their entries (``a_entry``), the same for B; and the
    most tokens in one core string."""
    if b"\r" in data or b"\x0b" in data or not data.endswith(b"\n"):
        raise ValueError("the paraphrase table is not in the layout the index reads (\\r, \\x0b, or no final line end)")
    data.decode("utf-8")  # the JVM would read malformed bytes as U+FFFD: no index for such a table
    offsets = entry_offsets(data)
    n = len(offsets) - 1
    a_hash, b_hash = np.empty(n, np.uint64), np.empty(n, np.uint64)
    most = 0
    step = 1 << 19
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        cores = phrase_cores(data[int(offsets[lo]):int(offsets[hi])])
        a, b = cores[1::3], cores[2::3]
        a_hash[lo:hi], b_hash[lo:hi] = _hashes(a, hi - lo), _hashes(b, hi - lo)
        most = max(most, max(map(bytes.count, a + b, repeat(b" ")), default=-1) + 1)
    arrays = {"offsets": offsets}
    for side, hashes in (("a", a_hash), ("b", b_hash)):
        order = np.argsort(hashes, kind="stable")
        arrays[f"{side}_hash"], arrays[f"{side}_entry"] = hashes[order], order.astype(np.uint32)
    return arrays, most


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
            files.remove_private(os.path.dirname(self.path))


class ParaphraseIndex:
    """The index of one paraphrase table file, its arrays mapped from the cache."""

    def __init__(self, source: str, meta: dict, arrays: dict[str, np.ndarray], table) -> None:
        self.source = source
        self.entries = int(meta["entries"])
        self.max_n = int(meta["max_cores"])
        self.arrays = arrays
        self.table = table

    def _having(self, side: str, grams: np.ndarray) -> np.ndarray:
        """The entries whose ``side`` ("a" or "b") core string is in ``grams`` (sorted hashes)."""
        hashes = self.arrays[f"{side}_hash"]
        lo, hi = np.searchsorted(hashes, grams, side="left"), np.searchsorted(hashes, grams, side="right")
        return self.arrays[f"{side}_entry"][_ranges(lo, hi - lo)].astype(np.int64)

    def select(self, grams: np.ndarray) -> np.ndarray:
        """The ids (sorted: file order) of the entries whose A and B core strings are both in ``grams``."""
        return np.intersect1d(distinct(self._having("a", grams)), distinct(self._having("b", grams)),
                              assume_unique=True)

    def select_either(self, grams: np.ndarray) -> np.ndarray:
        """The ids (sorted) of the entries whose A or B core string is in ``grams``."""
        return union(self._having("a", grams), self._having("b", grams))

    def entry_bytes(self, entries: Sequence[int]) -> bytes:
        offsets = self.arrays["offsets"]
        return b"".join(self.table[int(offsets[e]):int(offsets[e + 1])] for e in entries)

    def write(self, entries: np.ndarray, references: np.ndarray, any_hypothesis: bool = False) -> FilteredTable:
        """The entries, in file order and byte for byte, as a gzip table in a new private temporary folder."""
        from capeval_plugins import files

        data = gzip.compress(self.entry_bytes(entries), compresslevel=1, mtime=0)
        folder = files.private_folder("capeval-meteor-")
        with files.Folder.open(folder, mine=True)[0] as where:
            where.write("paraphrase.gz", data, replace=False)
        return FilteredTable(self.source, entries, os.path.join(folder, "paraphrase.gz"), references, any_hypothesis)

    def table_for(self, corpus: CorpusPhrases) -> FilteredTable:
        """The entries ``corpus`` can use (its hypotheses inside the argument: :meth:`CorpusPhrases.grams`)."""
        return self.write(self.select(corpus.grams()), corpus.references)

    def table_for_references(self, references: np.ndarray) -> FilteredTable:
        """Every entry with a phrase among ``references`` (core-string hashes): any candidates of them."""
        return self.write(self.select_either(references), references, any_hypothesis=True)


# ---------------------------------------------------------------------------------------------- the cache


def cache_dir() -> Path:
    """``$CAPEVAL_CACHE/meteor``, else ``$XDG_CACHE_HOME/capeval_plugins/meteor`` (``~/.cache``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]) / "meteor"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "capeval_plugins" / "meteor"


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
        return _read(claim, source)
    if not (root / ".capeval-owned").is_file():
        return None
    claim = files.Claim(root, INDEX_KIND).open(create=False)
    try:
        return _read(claim, source)
    finally:
        claim.folder.close()


def _read(claim, source: str) -> ParaphraseIndex | None:
    """The index, when every file is there, listed as the package's and has the digest its metadata gives
    (a flipped bit would silently drop or change paraphrase entries: the check reads 421 MB in ~30 ms)."""
    def mapped(name: str):
        data = claim.map(f"{source}/{name}") if claim.owns(f"{source}/{name}") else None
        return data if data is not None and digest(data) == meta["digests"].get(name) else None

    raw = claim.map(f"{source}/meta.json") if claim.owns(f"{source}/meta.json") else None
    try:
        meta = json.loads(bytes(raw)) if raw is not None else {}
    except ValueError:  # a damaged metadata file: rebuilt
        return None
    if (not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("source") != source
            or not isinstance(meta.get("digests"), dict)):
        return None
    arrays = {}
    for name, (dtype, length) in meta["arrays"].items():
        data = mapped(name)
        if data is None or len(data) != length * np.dtype(dtype).itemsize:
            return None
        arrays[name] = np.frombuffer(data, dtype=dtype, count=length)
    text = mapped("table")
    if text is None or len(text) != meta["bytes"] or int(arrays["offsets"][-1]) != meta["bytes"]:
        return None
    return ParaphraseIndex(source, meta, arrays, text)


def digest(data) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _build(root: Path, source: str, gz: bytes) -> ParaphraseIndex | None:
    """Build the index under the cache's lock (another process building it meanwhile: wait, then read)."""
    import fcntl

    from capeval_plugins import files

    folder, _ = files.Folder.open(root, create=True, mine=True)
    with folder:
        fd, _ = folder.lock(LOCK)
        try:
            deadline = time.monotonic() + LOCK_WAIT
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise OSError(f"another process has been building the index for {LOCK_WAIT:.0f} s") from None
                    time.sleep(0.2)
            claim = files.Claim(root, INDEX_KIND).open()
            found = _open(root, source, claim)
            if found is not None:
                return found
            if os.environ.get(QUIET_ENV) != "1":
                again = claim.owns(f"{source}/meta.json")  # there, but a file did not verify
                print(f"building METEOR's paraphrase index {'again: the one in the cache is damaged' if again else 'once'}"
                      f" (about {BUILD_SECONDS} s; kept in {root})", file=sys.stderr, flush=True)
            data = gzip.decompress(gz)
            arrays, most = build_arrays(data)
            old = [name for name in claim.files if not name.startswith(source + "/")]
            claim.remove(old)  # indexes of other table files or formats
            contents = {"table": data,
                        **{name: memoryview(np.ascontiguousarray(a)).cast("B") for name, a in arrays.items()}}
            for name, content in contents.items():
                claim.write(f"{source}/{name}", content)
            meta = {"format": FORMAT, "source": source, "entries": len(arrays["offsets"]) - 1, "max_cores": most,
                    "bytes": len(data), "arrays": {k: [v.dtype.str, len(v)] for k, v in arrays.items()},
                    "digests": {name: digest(content) for name, content in contents.items()}}
            claim.write(f"{source}/meta.json", json.dumps(meta, indent=1).encode())  # last: the index is complete
            return _open(root, source, claim)
        finally:
            os.close(fd)  # drops the lock


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
