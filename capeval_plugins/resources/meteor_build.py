"""METEOR's paraphrase table file read into the arrays of its index (the format :mod:`.meteor_table` keeps in
the cache and reads; the argument for the cut it makes is that module's docstring).

The English table is 272 MB of 15.8 M lines (5,274,084 entries of a probability, a phrase A and a paraphrase B).
The build reads it a window of whole blocks of entries at a time, inflated a piece at a time
(:func:`gunzip_pieces`), with a few vectorised passes per window and no Python object per line: every line end
and the count of blank bytes of each line in one pass (:func:`_scan_lines`), the runs of entries with the same A
line by comparing each A line with the one before eight bytes at a time (:func:`_run_starts`), the B lines and
the runs' A lines gathered by numpy (:func:`_lines`), and the most tokens in a core string computed exactly
but only for the lines whose blank count allows more than the most found so far (:func:`_most_tokens`). The
files are the same, byte for byte, as the line-by-line build before it (``FORMAT`` 3), in about a third of its
CPU and a quarter of its memory (``benchmarks/meteor_index_build.py``): the build's temporaries stay the size of
a window, so their memory is reused rather than new pages every time.
"""
from __future__ import annotations

import contextlib
import os
import re
import zlib
from typing import Iterable, Iterator, Sequence

import numpy as np
import xxhash


BLOCK = 1024      # entries per zlib block of B lines in the index
WINDOW = 1 << 22  # bytes of the table read at once: the build's temporaries stay this small, so their memory
                  # is reused, not new every time
CORE_BATCH = 4096  # lines whose core strings are computed at once while looking for the most tokens in one
_LOW_BYTES = np.array([(1 << 8 * k) - 1 for k in range(8)] + [(1 << 64) - 1], dtype=np.uint64)
# A table phrase's characters that are neither alphanumeric nor outside meteor_table.SUPPORTED, in UTF-8 (removed
# from its cores); characters outside SUPPORTED stay, so a phrase holding one matches no corpus.
_PUNCT_ASCII = bytes(c for c in range(0x21, 0x7F) if not chr(c).isalnum())
_PUNCT_WIDE = re.compile(rb"\xc2[\xa0-\xbf]|\xc3[\x97\xb7]|\xe2\x80[\x93\x94\x98\x99\x9c\x9d\xa6]")
_TOKEN_BREAKS = bytes.maketrans(b"\t\f", b"  ")  # StringTokenizer's separators within a line, as spaces
_NONZERO = re.compile(rb"[^\0]")


def hashes(strings: Iterable[bytes], count: int = -1) -> np.ndarray:
    return np.fromiter(map(xxhash.xxh3_64_intdigest, strings), dtype=np.uint64, count=count)


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


def core_hashes(lines: Sequence[bytes]) -> np.ndarray:
    return hashes(phrase_cores(b"\n".join(lines) + b"\n"), len(lines)) if lines else np.zeros(0, np.uint64)


try:  # ISA-L's deflate and inflate (the `fast` extra): the same formats, 2-4 times faster than zlib's
    from isal import isal_zlib as _zlib_fast
except ImportError:  # pragma: no cover - the extra is not installed
    _zlib_fast = None
_zlib = _zlib_fast or zlib


def _deflate(data: bytes) -> bytes:
    return _zlib.compress(data, 1)


def gunzip_pieces(gz: bytes, size: int = 1 << 22) -> Iterator[bytes]:
    """The decompressed table, at most ``size`` bytes at a time, as ``gzip.decompress`` reads it (members one
    after another, zero padding after one skipped), fed a little input at a time: the build never holds the
    table whole nor copies what is left of the input (half gunzip's CPU is the memory of a whole copy, on the
    development machine). ValueError when it is not gzip data, is damaged or is cut short."""
    view, at, step = memoryview(gz), 0, max(size // 8, 1)
    try:
        while at < len(gz):
            member = _zlib.decompressobj(wbits=31)
            while not member.eof:
                feed, at = view[at:at + step], min(at + step, len(gz))
                while True:  # until the output stops (the last input: until it ends)
                    piece = member.decompress(feed, size)
                    feed = member.unconsumed_tail
                    if piece:
                        yield piece
                    if member.eof or not feed and (at < len(gz) or not piece):
                        break
                if not member.eof and at == len(gz):
                    raise ValueError("the paraphrase table's gzip data is cut short or damaged")
            at -= len(member.unused_data)
            following = _NONZERO.search(gz, at)  # the next member, after any zero padding
            at = following.start() if following else len(gz)
    except _zlib.error as err:
        raise ValueError(f"the paraphrase table is not gzip data ({err})") from None


def build_arrays(table: bytes | Iterable[bytes], block: int = BLOCK) -> tuple[dict[str, np.ndarray | bytes], dict]:
    """The index of a decompressed table (:mod:`.meteor_table`'s docstring), given whole or in pieces
    (:func:`gunzip_pieces`): ``group_start`` (the first entry of each run of entries with the same A line, then
    the number of entries), the A lines' core-string hashes sorted (``a_hash``) with their runs (``a_group``), the
    runs' A lines (``a_text``, cut at ``a_offsets``), and every entry's B line in zlib blocks of ``block``
    entries (``b_blocks``, cut at ``b_offsets``). Returns the arrays and the metadata they imply (entries, runs,
    block, the most tokens in one core string). Read a window of whole blocks of entries at a time, with a few
    vectorised passes each (no Python object per line)."""
    # Bytes that are not UTF-8 need no check: the JVM reads them as U+FFFD, which no supported corpus holds, and
    # their core strings here keep them, so no corpus's core string equals them either: such a phrase matches
    # nothing, in the jar and in the selection alike.
    whole = table if isinstance(table, (bytes, bytearray)) else None
    pieces = iter(table) if whole is None else (whole[at:at + WINDOW] for at in range(0, len(whole), WINDOW))
    starts: list[np.ndarray] = []
    heads: list[bytes] = []  # the runs' A lines, each with its line end
    head_lengths: list[np.ndarray] = []
    blocks: list[bytes] = []
    most, n, previous = 1, 0, None
    for data, ends, blanks in _windows(pieces, block):
        a_start, a_end = ends[0::3] + 1, ends[1::3]  # entry k's probability, A and B lines end at ends[3k:3k + 3]
        b_start, b_end = a_end + 1, ends[2::3]
        first = _run_starts(data, a_start, a_end)
        if data[a_start[0]:a_end[0]] == previous:
            first = first[1:]  # the window's first entry continues the previous window's last run
        most = _most_tokens(data, np.concatenate((a_start[first], b_start)), np.concatenate((a_end[first], b_end)),
                            np.concatenate((blanks[1::3][first], blanks[2::3])) + 1, most)
        blocks += map(_deflate, _lines(data, b_start, b_end, block))
        heads += _lines(data, a_start[first], a_end[first], max(len(first), 1))
        head_lengths.append(a_end[first] - a_start[first])
        starts.append(first + n)
        previous, n = data[a_start[-1]:a_end[-1]], n + len(a_start)
    heads = b"".join(heads)
    groups = heads.count(b"\n")
    a_hash = hashes(phrase_cores(heads), groups)
    order = np.argsort(a_hash, kind="stable")
    a_offsets = np.zeros(groups + 1, dtype=np.uint64)
    np.cumsum(np.concatenate(head_lengths), out=a_offsets[1:])
    arrays = {
        "group_start": np.concatenate(starts + [np.array([n])]).astype(np.uint32),
        "a_hash": a_hash[order], "a_group": order.astype(np.uint32),
        "a_offsets": a_offsets, "a_text": heads.replace(b"\n", b""),  # (a line holds no line end)
        "b_offsets": _lengths_to_offsets(map(len, blocks), len(blocks)), "b_blocks": b"".join(blocks),
    }
    return arrays, {"entries": n, "groups": groups, "block": block, "max_cores": most}


def _windows(pieces: Iterator[bytes], block: int) -> Iterator[tuple[bytes, np.ndarray, np.ndarray]]:
    """The table as windows of whole blocks of entries, the last one what remains, each with its lines'
    :func:`_scan_lines`. A window takes at least :data:`WINDOW` new bytes, and twice as many as it has while it
    holds no whole block. ValueError when the table is not in the layout the index reads."""
    rest, ended, empty = b"", False, True
    while not ended:
        parts, wanted = [rest], max(WINDOW, len(rest))
        while wanted > 0 and not ended:
            piece = next(pieces, None)
            ended = piece is None
            if piece is not None:
                parts.append(piece)
                wanted -= len(piece)
        data = b"".join(parts)
        if b"\r" in data or b"\x0b" in data or ended and (data or empty) and not data.endswith(b"\n"):
            raise ValueError("the paraphrase table is not in the layout the index reads (\\r, \\x0b, or no final "
                             "line end)")
        ends, blanks = _scan_lines(data)
        whole = len(ends) if ended else len(ends) - len(ends) % (3 * block)
        if whole % 3:
            raise ValueError("the paraphrase table's lines are not three per entry")
        rest = data[int(ends[whole - 1]) + 1:] if whole else data
        if whole:
            empty = False
            yield data, ends[:whole], blanks[:whole]


def _scan_lines(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Where each line of ``data`` ends (its ``\\n``), and how many of its bytes are at most ``b" "`` (``\\n``
    aside): two vectorised passes. Every StringTokenizer separator (space, tab, form feed) is such a byte, so a
    line's tokens, and its core string's, are at most that count plus one."""
    view = np.frombuffer(data, dtype=np.uint8)
    low = np.flatnonzero(view <= 32)
    breaks = np.flatnonzero(view[low] == 10)
    return low[breaks], np.diff(breaks, prepend=-1) - 1


def _run_starts(data: bytes, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """The ``k`` whose line ``data[start[k]:end[k]]`` differs from line ``k - 1`` (0 first), sorted: lines of
    the same length compared eight bytes at a time, all pairs at once (the bytes past a line's end masked)."""
    length = end - start
    same = np.zeros(len(start), dtype=bool)
    same[1:] = length[1:] == length[:-1]
    near_end = same & (end + 7 > len(data)) & (length > 0)  # an 8-byte read would pass the end: compared as bytes
    for k in np.flatnonzero(near_end).tolist():
        same[k] = data[start[k]:end[k]] == data[start[k - 1]:end[k - 1]]
    k = np.flatnonzero(same & ~near_end & (length > 0))  # (two empty lines are the same)
    if len(k):
        words = np.ndarray((len(data) - 7,), dtype="<u8", buffer=data, strides=(1,))  # one starting at each byte
        at, before, left = start[k], start[k - 1], length[k]
        while len(k):
            differs = (words[at] ^ words[before]) & _LOW_BYTES[np.minimum(left, 8)] != 0
            same[k[differs]] = False
            more = ~differs & (left > 8)
            k, at, before, left = k[more], at[more] + 8, before[more] + 8, left[more] - 8
    return np.flatnonzero(~same)


def _most_tokens(data: bytes, start: np.ndarray, end: np.ndarray, bound: np.ndarray, best: int) -> int:
    """The most tokens in the core string of a line ``data[start[i]:end[i]]``, or ``best`` when none has more,
    given ``bound[i]`` at least that line's: only the lines whose bound exceeds the best found get their cores
    computed, the highest bounds first, :data:`CORE_BATCH` lines or more at a time."""
    counts = np.bincount(bound)
    level = len(counts) - 1
    while level > best:
        lower, taken = level, int(counts[level])
        while lower - 1 > best and taken < CORE_BATCH:
            lower -= 1
            taken += int(counts[lower])
        chosen = np.flatnonzero((bound >= lower) & (bound <= level)).tolist()
        text = b"".join(data[start[i]:end[i] + 1] for i in chosen)  # each with its line end
        best = max([best] + [c.count(b" ") + 1 for c in phrase_cores(text) if c])
        level = lower - 1  # every line with a higher bound is counted
    return best


def _lines(data: bytes, start: np.ndarray, end: np.ndarray, block: int) -> list[memoryview]:
    """The lines ``data[start[k]:end[k] + 1]`` (each with its line end), ``block`` at a time, gathered by numpy."""
    lengths = end + 1 - start
    text = memoryview(np.frombuffer(data, dtype=np.uint8)[_line_bytes(start, end, lengths)].tobytes())
    cuts = np.cumsum(lengths)[block - 1::block].tolist()
    if len(lengths) % block:
        cuts.append(len(text))
    return [text[a:b] for a, b in zip([0] + cuts[:-1], cuts)]


def _line_bytes(start: np.ndarray, end: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The position of every byte of the lines ``start[k]..end[k]`` (in order, apart), as one cumulative sum of
    steps: 1 inside a line, the jump to the next line at its first byte (int32 within a window: half the memory
    traffic of :func:`~capeval_plugins.core.coco_text._ranges`, which this equals)."""
    if not len(start):
        return np.zeros(0, dtype=np.int64)
    kind = np.int32 if int(end[-1]) < 2**31 - 1 else np.int64
    step = np.ones(int(lengths.sum()), dtype=kind)
    step[np.cumsum(lengths[:-1])] = start[1:] - end[:-1]
    step[0] = start[0]
    return np.cumsum(step, dtype=kind)


# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_MAX = 32 << 20  # where glibc's own adjustment of its mmap threshold stops (64-bit)


@contextlib.contextmanager
def kept_heap() -> Iterator[None]:
    """The build's freed memory kept for its next window. glibc gives the top of its heap back to the system
    whenever more than twice its mmap threshold lies free there, so every window's temporaries (the inflated
    pieces, the window joined, numpy's arrays) were new pages, zeroed by the kernel: about 90,000 page faults and
    0.2 CPU-s a build (benchmarks/README.md). During the build the free top is kept (trim threshold 256 MB) and
    blocks up to 32 MB come from the heap; after it the trim threshold is twice that, the state glibc's own
    adjustment reaches once a 32 MB block is freed, and what lies free is given back (``malloc_trim``).
    Elsewhere than glibc, nothing changes."""
    libc = _glibc()
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX)
    libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20)
    try:
        yield
    finally:
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_MAX)
        libc.malloc_trim(0)


def _glibc():
    """The C library through ctypes when it is glibc (its mallopt and malloc_trim), else None."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        import ctypes

        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except (AttributeError, ValueError, OSError):  # no confstr name (not glibc), or no C library to load
        return None


def _lengths_to_offsets(lengths: Iterable[int], count: int) -> np.ndarray:
    out = np.zeros(count + 1, dtype=np.uint64)
    np.cumsum(np.fromiter(lengths, dtype=np.uint64, count=count), out=out[1:])
    return out
