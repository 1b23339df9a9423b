"""METEOR's paraphrase index as the vectorised build makes it (capeval_plugins/resources/meteor_build.py): the
same arrays as a line-by-line build written here (every window size, runs and lines across windows, lines
longer than a window, the last lines of the table), the same table for the JVM as a plain-Python filter of a
reduced copy of the jar's real table, and gzip read as gzip reads it (a damaged table file: the full table, with
a warning, no traceback)."""
from __future__ import annotations

import gzip
import itertools
import random
import zlib

import numpy as np
import pytest
import xxhash
from test_meteor_paraphrase import TRICKY, WORDS, brute_core, brute_ngrams, synthetic_table

from capeval_plugins.resources import meteor_build as mb
from capeval_plugins.resources import meteor_table as mt


def reference_build(data: bytes, block: int) -> dict:
    """What the index's files hold, line by line in plain Python: the runs of equal A lines, their A lines and
    core-string hashes (brute_core), every block's B lines inflated, the most tokens in a core string."""
    lines = data.split(b"\n")[:-1]
    a_lines, b_lines = lines[1::3], lines[2::3]
    firsts = [k for k in range(len(a_lines)) if k == 0 or a_lines[k] != a_lines[k - 1]]
    heads = [a_lines[k] for k in firsts]
    a_hash = np.array([xxhash.xxh3_64_intdigest(brute_core(h.decode()).encode()) for h in heads], dtype=np.uint64)
    order = np.argsort(a_hash, kind="stable")
    cores = [brute_core(x.decode()) for x in heads + b_lines]
    return {
        "group_start": firsts + [len(a_lines)],
        "a_hash": a_hash[order].tolist(), "a_group": order.tolist(),
        "heads": heads,
        "blocks": [b"".join(b + b"\n" for b in b_lines[k:k + block]) for k in range(0, len(b_lines), block)],
        "max_cores": max([1] + [len(c.split()) for c in cores]),
        "entries": len(a_lines), "groups": len(heads),
    }


def built(data: bytes, block: int) -> dict:
    arrays, meta = mb.build_arrays(data, block)
    cuts, blob = arrays["a_offsets"].tolist(), arrays["a_text"]
    b_cuts = arrays["b_offsets"].tolist()
    return {
        "group_start": arrays["group_start"].tolist(),
        "a_hash": arrays["a_hash"].tolist(), "a_group": arrays["a_group"].tolist(),
        "heads": [blob[lo:hi] for lo, hi in zip(cuts, cuts[1:])],
        "blocks": [zlib.decompress(arrays["b_blocks"][lo:hi]) for lo, hi in zip(b_cuts, b_cuts[1:])],
        "max_cores": meta["max_cores"], "entries": meta["entries"], "groups": meta["groups"],
    }


def crafted_table(rng: random.Random, entries: int) -> bytes:
    """A table in runs, dense in what the vectorised passes could get wrong: A lines of one length that differ
    at the first, the 8th, 9th, 16th, 17th or last byte only, empty lines, lines of 8 and 16 bytes, tabs and
    form feeds, punctuation tokens (many blanks, few core tokens), non-ASCII letters, long phrases."""
    stems = ["abcdefghijklmnopq", "abcdefghijklmnopQ", "Abcdefghijklmnopq", "abcdefgHijklmnopq",
             "abcdefghIjklmnopq", "abcdefghijklmnoPq", "abcdefg", "abcdefG", "abcdefgh", "abcdefgX", "", "12345678abcdefgh",
             "12345678abcdefgH", "a\tb\fc", "a , . ; b", ". , ' - ! ?", "caf\u00e9 na\u00efve", "\u00e9",
             " ".join("w" * k for k in range(1, 12)), "x " * 9 + "y", ". , ' - ! ? ; : ( ) [ ] { }",
             " ".join(map(str, range(13))), "u.s. don't 1,000 e-mail"]
    out = []
    while len(out) < entries:
        a = rng.choice(stems)
        for _ in range(rng.choice([1, 1, 2, 3, 8, 40])):
            b = rng.choice(stems + [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 9)))])
            out.append(f"{rng.choice(['0.1', '', '0.0123456789', '1'])}\n{a}\n{b}\n")
    return "".join(out[:entries]).encode()


@pytest.mark.parametrize("window, batch", [(1, 1), (7, 2), (64, 3), (1000, 5), (mb.WINDOW, mb.CORE_BATCH)])
def test_the_build_equals_a_line_by_line_build_at_every_window_size(monkeypatch, window, batch):
    """Windows smaller than a line (the window grows), than a block, runs and blocks across windows, the last
    lines of the table within eight bytes of its end, the most tokens found a few lines at a time: the arrays
    are the line-by-line build's."""
    monkeypatch.setattr(mb, "WINDOW", window)
    monkeypatch.setattr(mb, "CORE_BATCH", batch)
    rng = random.Random(window)
    tables = [crafted_table(rng, 700), synthetic_table(rng, 300), b"0.5\nab\ncd\n", b"\n\n\n",
              b"1\nabcdefgh\nx\n1\nabcdefgh\ny\n", b"1\nabcdefgh\nx\n1\nabcdefgX\ny\n", b"\n\n\n" * 3]
    for data in tables:
        for block in (1, 3, 64):
            assert built(data, block) == reference_build(data, block), (data[:60], block)


def test_runs_are_found_as_a_line_by_line_comparison_finds_them():
    """Neighbouring lines of every length 0-40, equal or differing at one byte anywhere (the eight-byte words
    and the masked tail of each), some within eight bytes of the end of the data."""
    rng = random.Random(3)
    for trial in range(200):
        lines = []
        for _ in range(rng.randint(1, 60)):
            if lines and rng.random() < 0.7:
                line = bytearray(lines[-1])
                if line and rng.random() < 0.5:
                    line[rng.randrange(len(line))] ^= 1 << rng.randrange(8)
                lines.append(bytes(line).replace(b"\n", b"x"))
            else:
                lines.append(bytes(rng.choice(b"ab") for _ in range(rng.randint(0, 40))))
        data = b"".join(line + b"\n" for line in lines)
        ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
        starts = np.concatenate(([0], ends[:-1] + 1))
        expected = [k for k in range(len(lines)) if k == 0 or lines[k] != lines[k - 1]]
        assert mb._run_starts(data, starts, ends).tolist() == expected, lines



def test_picked_lines_are_their_bytes_in_order():
    """Every third line (as the build picks B lines), and lines of any chosen subset, empty ones included:
    the gathered bytes are the lines joined, line ends kept."""
    rng = random.Random(5)
    for trial in range(100):
        lines = [bytes(rng.choice(b"ab ") for _ in range(rng.randint(0, 12))) for _ in range(rng.randint(1, 40))]
        data = b"".join(line + b"\n" for line in lines)
        ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
        starts = np.concatenate(([0], ends[:-1] + 1))
        picked = sorted(rng.sample(range(len(lines)), rng.randint(1, len(lines)))) if trial % 2 else \
            list(range(2, len(lines), 3)) or [0]
        block = rng.randint(1, 5)
        got = b"".join(mb._lines(data, starts[picked], ends[picked], block))
        assert got == b"".join(lines[k] + b"\n" for k in picked)

def test_the_build_refuses_a_table_outside_its_layout_in_any_window(monkeypatch):
    monkeypatch.setattr(mb, "WINDOW", 5)
    good = crafted_table(random.Random(0), 50)
    for bad in [good[:-1], good + b"x\n", good[:40] + b"\r" + good[40:], good + b"1\na\x0bb\nc\n", b"", b"x"]:
        with pytest.raises(ValueError, match="layout|three per entry"):
            mb.build_arrays(bad, 4)


@pytest.mark.parametrize("size", [1, 5, 1000, 1 << 22])
def test_gunzip_pieces_reads_gzip_as_gzip_does(size):
    rng = random.Random(size)
    data = bytes(rng.randrange(256) for _ in range(20_000)) + b"\0" * 300_000 + b"ab\n" * 5_000
    files = [gzip.compress(data), gzip.compress(data[:999]) + gzip.compress(data[999:]), gzip.compress(b""),
             gzip.compress(data) + b"\0" * 5, gzip.compress(b"") * 2 + gzip.compress(data, 9) + b"\0" + gzip.compress(b"x")]
    for gz in files:
        pieces = list(mb.gunzip_pieces(gz, size))
        assert b"".join(pieces) == gzip.decompress(gz) and all(0 < len(p) <= size for p in pieces)
    for bad in [files[0][:-4], files[0][:50], files[0][:5], b"not gzip", files[0] + b"junk", b"\0" + files[0]]:
        with pytest.raises(ValueError, match="gzip"):
            b"".join(mb.gunzip_pieces(bad, size))


def test_a_damaged_table_file_gets_the_full_table_with_a_warning(tmp_path, monkeypatch):
    """A paraphrase table cut short or not gzip: no index (METEOR loads the jar's own table), a warning; an
    EOFError traceback out of `capeval score` before."""
    whole = gzip.compress(synthetic_table(random.Random(1), 400))
    for k, damaged in enumerate([whole[:-6], whole[: len(whole) // 2], b"plain text\n"]):
        monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / f"cache{k}"))  # (the warning is once per cache)
        table = tmp_path / f"t{k}.gz"
        table.write_bytes(damaged)
        mt._loaded.clear()
        with pytest.warns(UserWarning, match="paraphrase index is not available"):
            assert mt.index_for(table) is None


# ---------------------------------------------------------------------------------------------- the real table


def entry_start(data: bytes, at: int, line: int) -> tuple[int, int]:
    """The first entry to start at or after byte ``at`` (a line start; ``line`` is its number): its byte and line."""
    while line % 3:
        at, line = data.index(b"\n", at) + 1, line + 1
    return at, line


def reduced_real_table() -> bytes:
    """Twelve stretches of about 250 KB of METEOR's English table, spread over the whole of it, whole entries."""
    from capeval_plugins.metrics.coco import meteor_jar

    path = mt.default_table(meteor_jar())
    if not path.is_file():
        pytest.skip(f"no paraphrase table at {path}")
    data = gzip.decompress(path.read_bytes())
    parts, at, line = [], 0, 0
    for k in range(12):
        target = k * len(data) // 12
        if target > at:
            line += data.count(b"\n", at, target)
            at = target
            if data[at - 1:at] != b"\n":
                at, line = data.index(b"\n", at) + 1, line + 1
        lo, line = entry_start(data, at, line)
        hi = lo + 250_000
        line += data.count(b"\n", lo, hi)
        hi, line = entry_start(data, data.index(b"\n", hi) + 1, line + 1)
        parts.append(data[lo:hi])
        at = hi
    return b"".join(parts)


def test_a_corpus_cut_of_the_real_table_is_a_plain_filter_of_it_entry_by_entry(tmp_path, monkeypatch):
    """Through the whole path (the gz file read, inflated a piece at a time, built, written, verified), the table
    handed to the JVM for a corpus is, entry by entry, what a plain-Python filter of the table file gives: every
    entry whose A and B core strings are both among the corpus's n-grams, in file order, A and B byte for byte,
    the probability as 1. Captions are made of the table's own phrases, caption words and joins."""
    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "cache"))
    data = reduced_real_table()
    table = tmp_path / "paraphrase-en.gz"
    table.write_bytes(gzip.compress(data, 1))
    lines = data.decode("utf-8", "replace").split("\n")[:-1]
    entries = list(zip(lines[1::3], lines[2::3]))
    most = max(len(brute_core(x).split()) for x in lines[1::3] + lines[2::3])
    mt._loaded.clear()
    index = mt.index_for(table)
    assert index is not None and index.entries == len(entries) > 40_000 and index.max_n == most

    rng = random.Random(5)
    phrases = [p for e in rng.sample(entries, 600) for p in e if p.isascii()]
    fillers = WORDS + ["a man", "in the", "of", "U.S.", "don't", "1,000", "e-mail"] + TRICKY[:12]
    references = [" ".join(rng.choice(phrases if rng.random() < 0.5 else fillers) for _ in range(rng.randint(2, 6)))
                  for _ in range(300)]
    hypotheses = [" ".join(rng.choice(phrases if rng.random() < 0.5 else fillers) for _ in range(rng.randint(2, 6)))
                  for _ in range(150)]
    grams = {""}.union(*(brute_ngrams(t, most) for t in references + hypotheses))
    expected = [("1", a, b) for a, b in entries if brute_core(a) in grams and brute_core(b) in grams]
    assert 500 < len(expected) < len(entries) // 2

    refs = mt.corpus_grams(references, index.max_n)
    cut = index.table_for(mt.CorpusPhrases(index, refs.hashes, hypotheses))
    try:
        got = gzip.decompress(open(cut.path, "rb").read()).decode("utf-8", "replace").split("\n")[:-1]
    finally:
        cut.remove()
    got = list(zip(got[0::3], got[1::3], got[2::3]))
    got_set, expected_set = set(got), set(expected)
    missing = [e for e in expected if e not in got_set][:5]
    extra = [e for e in got if e not in expected_set][:5]
    assert got == expected, (len(got), len(expected), missing, extra)
    assert list(itertools.islice((e for e in got if e[1] != e[2]), 1))  # real paraphrases, not only a = b


def test_the_build_keeps_its_freed_heap_and_gives_it_back_after(monkeypatch):
    """glibc's thresholds are set for the build and put back to the state glibc's own adjustment reaches after a
    32 MB block (trim at twice the mmap threshold), then the free memory is returned, also when the build fails;
    without glibc nothing is called."""
    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append(("mallopt", param, value))
            return 1

        def malloc_trim(self, pad):
            calls.append(("malloc_trim", pad))
            return 1

    monkeypatch.setattr(mb, "_glibc", FakeLibc)
    with pytest.raises(RuntimeError):
        with mb.kept_heap():
            calls.append("build")
            raise RuntimeError("the build failed")
    assert calls == [("mallopt", -3, 32 << 20), ("mallopt", -1, 256 << 20), "build",
                     ("mallopt", -1, 64 << 20), ("malloc_trim", 0)]
    calls.clear()
    monkeypatch.setattr(mb, "_glibc", lambda: None)
    with mb.kept_heap():
        calls.append("build")
    assert calls == ["build"]


def test_the_c_library_is_found_where_it_is_glibc():
    import os

    try:
        glibc = bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        glibc = False
    assert (mb._glibc() is not None) == glibc
