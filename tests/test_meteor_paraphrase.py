"""METEOR's paraphrase table cut down to the corpus (capeval_plugins/resources/meteor_table.py) gives the jar's own
statistics and scores. Checked step by step: the n-gram enumeration against a brute force over every choice of
joins; the table's core strings against a token-by-token computation; the selection against a brute-force
filter; the argument's key step against the jar's own normaliser (and its character classes and Java's
lower-casing, read from the JVM); and the jar's answers with the cut table against pycocoevalcap's METEOR with
the full table, on captions dense in punctuation and on captions built from the table's own paraphrases.
Corpora the argument does not cover get the full table; the JVMs are kept while their table serves; the index
is built once per cache, safely."""
from __future__ import annotations

import gzip
import itertools
import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import xxhash
from conftest import HANG_GUARD, PYTHON, has_java

import capeval_plugins
from capeval_plugins import files
from capeval_plugins.resources import java
from capeval_plugins.resources import meteor_table as mt

needs_java = pytest.mark.skipif(not has_java(), reason="METEOR needs Java")
SUPPORTED = re.compile(f"[{mt.SUPPORTED}]")
JOINABLE = set(".'`,-\u2018\u2019")
MAX_N = 7  # the longest phrase of METEOR's English table, in tokens


def is_alnum(ch: str) -> bool:
    """The normaliser's alphanumerics (Normalizer.alnum: 0-9A-Za-zŠŽšžŸÀ-ÖØ-öø-ž, Latin part), written apart."""
    o = ord(ch)
    return ch.isascii() and ch.isalnum() or 0xC0 <= o <= 0xD6 or 0xD8 <= o <= 0xF6 or 0xF8 <= o <= 0x17E


def brute_ngrams(text: str, max_n: int) -> set[str]:
    """Every n-gram (n <= max_n) of the runs of ``text`` lower-cased, under every choice of joins across the
    joinable separators: all 2 ** k segmentations, one after the other."""
    groups = [(alnum, "".join(chars)) for alnum, chars in itertools.groupby(text.lower(), key=is_alnum)]
    runs = [s for alnum, s in groups if alnum]
    first = next((k for k, (alnum, _) in enumerate(groups) if alnum), len(groups))
    gaps = [s for alnum, s in groups[first:] if not alnum][:max(0, len(runs) - 1)]
    optional = [k for k, gap in enumerate(gaps) if set(gap) <= JOINABLE]
    out = set()
    for choice in itertools.product([False, True], repeat=len(optional)):
        joined = dict(zip(optional, choice))
        tokens = [runs[0]] if runs else []
        for k in range(1, len(runs)):
            if joined.get(k - 1):
                tokens[-1] += runs[k]
            else:
                tokens.append(runs[k])
        out |= {" ".join(tokens[i:i + n]) for n in range(1, max_n + 1) for i in range(len(tokens) - n + 1)}
    return out


def brute_core(line: str) -> str:
    """A table phrase's core string, token by token (Java's StringTokenizer splits on space, tab, newline,
    carriage return and form feed only)."""
    cores = ["".join(c for c in token if is_alnum(c) or not SUPPORTED.fullmatch(c))
             for token in re.split("[ \t\n\r\f]+", line)]
    return " ".join(c for c in cores if c)


TRICKY = ["U.S.", "u.s.-based", "1,000", "5'x", "don't", "1990's", "a-.b", "--", "...", "..", "a--b", "e.g.",
          "Mr.", "''quoted''", "``x''", '"x"', "'single'", "\u2018tick\u2019", "rock\u2019n\u2019roll", "x,y,z",
          "a.b.c.", "-x-", "(a)", "[b]", "x/y", "&", "#1", "50%", "No. 5", "3.5", "dog's", "dogs'", "O'Neil",
          "\u201cx\u201d", "a\u2013b", "a\u2014b", "wait\u2026", "Caf\u00e9", "na\u00efve", "\u00c6r\u00f8",
          "\u0141\u00f3d\u017a", "\u0153uvre", "2\u00d73", "\u00bd", "\xa0", "\xad", "\t", "\f", "A.B", "x.-y"]
ALPHABET = "abcXYZ019\u00e9\u00c6\u0153\u0141" + ".'`,-\u2018\u2019" + " \t!?\"()/&\u2013\u2026\u201c\xa0\u00d7"
WORDS = "a dog man woman red ball runs on the grass two kids play house street car big small".split()


def tricky_text(rng: random.Random) -> str:
    """A caption dense in the characters the normaliser joins across or wraps, in words, pieces and noise."""
    parts = []
    for _ in range(rng.randint(1, 9)):
        kind = rng.random()
        if kind < 0.4:
            parts.append(rng.choice(TRICKY))
        elif kind < 0.7:
            parts.append(rng.choice(WORDS).capitalize() if rng.random() < 0.2 else rng.choice(WORDS))
        else:
            parts.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 8))))
    return "".join(p + rng.choice([" ", " ", " ", "", ".", "-", "'", ","]) for p in parts).strip()


# ---------------------------------------------------------------------------------------------- pure Python


@pytest.mark.parametrize("seed", range(3))
def test_text_ngrams_are_every_segmentations_ngrams(seed):
    rng = random.Random(seed)
    texts = [tricky_text(rng) for _ in range(400)] + ["U.S.-based 1,000 dogs", "a.b.c.d.e", "", "...", "x"]
    joined = 0
    for text in texts:
        got = mt.text_ngrams(text, 4)
        if got is None:
            assert mt.unsupported(text) is not None
            continue
        if sum(set(gap) <= JOINABLE for gap in re.findall(f"(?<=[{mt.ALNUM}])[^{mt.ALNUM}]+(?=[{mt.ALNUM}])",
                                                           text.lower())) > 12:
            continue  # 2 ** k segmentations: too many for the brute force
        expected = brute_ngrams(text, 4)
        assert set(got) == expected, text
        joined += len(expected) > len(brute_ngrams(text.replace(".", " ").replace("-", " ").replace("'", " ")
                                                   .replace(",", " ").replace("`", " "), 4))
    assert joined > 50  # the texts do exercise the joins


def test_texts_outside_the_argument_are_refused():
    for text in ["a \u4e2d\u6587 caption", "\u0130stanbul", "DOTMULTI", "a DOT.MULTI. b", "D.O.T.M.U.L.T.I",
                 "x\u0301", "emoji \U0001f600", "\x0b", "\x1c", "\u2028", "\u03a9"]:
        assert mt.unsupported(text) is not None and mt.text_ngrams(text, 3) is None, text
    assert mt.text_ngrams("-".join(f"w{k}" for k in range(40)), 3) is None  # 40 runs, each join optional: too many


def test_a_long_text_with_many_spread_joins_is_inside_the_argument():
    """A paragraph caption has many joins (U.S., e-mail, don't) but few in any one place: its core strings are
    enumerated (no full table), and they hold every piece's own."""
    pieces = [f"the U.S. man's e-mail {k} don't 1,000 dogs" for k in range(40)]  # 160 joins in all
    got = mt.text_ngrams(" and ".join(pieces), 4)
    assert got is not None
    assert set(got) >= set().union(*(brute_ngrams(piece, 4) for piece in pieces))
    assert mt.unsupported("dotmulti DOT MULTI") is None  # case-sensitive in the jar, and not joined across spaces
    assert mt.corpus_grams(["a dog", "\u4e2d"], 3).reason.startswith("the character")


def test_phrase_cores_equal_a_token_by_token_computation():
    rng = random.Random(0)
    alphabet = ALPHABET + "ABC\u00c0\u00d7\u00f7\u00bf\u03b1\u4e2d\x1c;:_"
    lines = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20))) for _ in range(3000)]
    lines += [", . !", "u.s.", " lead and trail ", "a  b", "\u2018x\u2019 \u201cy\u201d \u2013 z\u2026"]
    lines = [line.replace("\n", " ") for line in lines]
    assert mt.phrase_cores(("\n".join(lines) + "\n").encode()) == [brute_core(x).encode() for x in lines]
    assert mt.phrase_cores(b"") == [] and mt.phrase_cores(b"x ,y\n") == [b"x y"]


def synthetic_table(rng: random.Random, entries: int) -> bytes:
    """A paraphrase table in METEOR's layout: phrases of words, punctuation tokens, case, accents."""
    vocab = WORDS + ["u.s.", "us", "don't", "do", "n't", ",", ".", "'s", "caf\u00e9", "Dog", "1,000", "1000",
                     "e-mail", "email", "\u03b1\u03b2", "x\u0301"]
    phrase = lambda: " ".join(rng.choice(vocab) for _ in range(rng.randint(1, 4)))  # noqa: E731
    return "".join(f"{rng.random()}\n{phrase()}\n{phrase()}\n" for _ in range(entries)).encode()


@pytest.mark.parametrize("grouped", [False, True])
def test_selection_keeps_exactly_the_entries_whose_phrases_both_occur(grouped):
    rng = random.Random(1)
    data = synthetic_table(rng, 5000)
    if grouped:  # METEOR's own tables list the entries of one A phrase together, in runs
        entries = data.decode().split("\n")[:-1]
        entries = sorted(zip(entries[0::3], entries[1::3], entries[2::3]), key=lambda e: e[1])
        data = "".join(f"{p}\n{a}\n{b}\n" for p, a, b in entries).encode()
    index = mt.ParaphraseIndex.from_table(data, block=64)
    lines = data.decode().split("\n")
    assert index.entries == 5000 and (index.arrays["a_group"].size < 4000) == grouped
    texts = [" ".join(rng.choice(WORDS + ["U.S.", "don't", "1,000", "e-mail", "Caf\u00e9"])
                      for _ in range(rng.randint(1, 6))) for _ in range(60)]
    most = index.max_n
    assert most == max(len(brute_core(x).split()) for x in lines[1::3] + lines[2::3])
    grams = set().union(*(brute_ngrams(t, most) for t in texts)) | {""}
    expected = [k for k in range(len(lines) // 3)
                if brute_core(lines[3 * k + 1]) in grams and brute_core(lines[3 * k + 2]) in grams]
    got = index.select(mt.corpus_grams(texts, most).hashes)
    assert got.tolist() == expected and 0 < len(expected) < len(lines) // 3
    kept = index.entry_bytes(got).decode().split("\n")[:-1]
    # the A and B lines byte for byte, in file order; the probability line, which the jar never parses, as "1"
    assert kept == [line for k in expected for line in ["1"] + lines[3 * k + 1:3 * k + 3]]
    either = [k for k in range(len(lines) // 3)
              if brute_core(lines[3 * k + 1]) in grams or brute_core(lines[3 * k + 2]) in grams]
    assert index.select_either(mt.corpus_grams(texts, most).hashes).tolist() == either and len(either) > len(got)


# ---------------------------------------------------------------------------------------------- the jar


def jar() -> str:
    from capeval_plugins.metrics.coco import meteor_jar

    return meteor_jar()


@pytest.fixture(scope="module")
def real_index():
    """The index of METEOR's own English table (built in the session's cache on first use)."""
    if not has_java():
        pytest.skip("METEOR needs Java")
    index = mt.index_for(mt.default_table(jar()))
    assert index is not None and index.entries == 5_274_084 and index.max_n == MAX_N
    return index


def test_the_real_tables_index_holds_its_entries_core_strings(real_index):
    data = gzip.decompress(mt.default_table(jar()).read_bytes()).decode().split("\n")
    rng = np.random.default_rng(0)
    sample = np.sort(rng.choice(real_index.entries, 4000, replace=False))
    assert np.all(np.diff(real_index.arrays["a_hash"].astype(np.float64)) >= 0)  # sorted
    starts = real_index.arrays["group_start"].astype(np.int64)
    assert [data[3 * k + 1] for k in starts[:-1].tolist()[:1000]] != []
    group = np.searchsorted(starts, sample, side="right") - 1
    where = np.empty(len(real_index.arrays["a_group"]), dtype=np.int64)
    where[real_index.arrays["a_group"]] = np.arange(len(where))
    b_lines = real_index.b_lines(sample)
    for k, g, b in zip(sample.tolist(), group.tolist(), b_lines):
        assert all(data[3 * e + 1] == data[3 * k + 1] for e in range(starts[g], starts[g + 1]))  # one A per run
        core = brute_core(data[3 * k + 1]).encode()
        assert real_index.arrays["a_hash"][where[g]] == xxhash.xxh3_64_intdigest(core)
        assert b.decode() == data[3 * k + 2]
    assert real_index.entry_bytes(sample[:3]).decode().split("\n")[:-1] == [
        x for k in sample[:3].tolist() for x in ["1", data[3 * k + 1], data[3 * k + 2]]]


def java_probe(tmp_path: Path, source: str, *args: str, stdin: str = "") -> str:
    """Compile and run a small Java class against METEOR's jar; its output."""
    if shutil.which("javac") is None:
        pytest.skip("needs a JDK (javac)")
    name = re.search(r"class (\w+)", source).group(1)
    (tmp_path / f"{name}.java").write_text(source, encoding="utf-8")
    subprocess.run(["javac", "-encoding", "UTF-8", "-cp", jar(), "-d", str(tmp_path), str(tmp_path / f"{name}.java")],
                   check=True, capture_output=True, timeout=HANG_GUARD)
    out = subprocess.run(["java", "-Dfile.encoding=UTF-8", "-Dsun.stdout.encoding=UTF-8", "-Duser.language=en",
                          "-cp", f"{tmp_path}{os.pathsep}{jar()}", name, *args], input=stdin.encode(),
                         capture_output=True, check=True, timeout=HANG_GUARD)
    return out.stdout.decode("utf-8")


CLASSES = """
import edu.cmu.meteor.util.Normalizer;
import java.lang.reflect.Field;
import java.util.regex.Pattern;
public class Classes {
  public static void main(String[] args) throws Exception {
    Field f = Normalizer.class.getDeclaredField("alnum"); f.setAccessible(true);
    Pattern alnum = Pattern.compile("[" + f.get(null) + "]");
    Field g = Normalizer.class.getDeclaredField("r_sep_other"); g.setAccessible(true);
    Pattern wrapped = (Pattern) g.get(null);
    StringBuilder out = new StringBuilder();
    for (int c = 0; c < 0x2100; c++) {
      String s = String.valueOf((char) c), low = s.toLowerCase();
      out.append(c).append(' ').append(alnum.matcher(s).matches() ? 1 : 0).append(' ')
         .append(wrapped.matcher(s).matches() ? 1 : 0);
      for (int i = 0; i < low.length(); i++) out.append(' ').append((int) low.charAt(i));
      out.append('\\n');
    }
    System.out.print(out);
  }
}
"""


@needs_java
def test_the_jars_character_classes_and_javas_lower_casing_are_the_arguments(tmp_path):
    """Read from the JVM: on every supported character, the normaliser's alphanumerics are ALNUM, it wraps in
    spaces exactly what is neither alphanumeric, whitespace nor joinable, and Java lower-cases it to the one
    character Python does, of the same class."""
    checked = 0
    for line in java_probe(tmp_path, CLASSES).splitlines():
        code, alnum, wrapped, *low = map(int, line.split())
        ch = chr(code)
        if not SUPPORTED.fullmatch(ch):
            continue
        checked += 1
        assert bool(alnum) == is_alnum(ch) == bool(re.fullmatch(f"[{mt.ALNUM}]", ch)), hex(code)
        assert bool(wrapped) == (not is_alnum(ch) and ch not in " \t\n\r\f" and ch not in JOINABLE), hex(code)
        assert "".join(map(chr, low)) == ch.lower() and len(ch.lower()) == 1, hex(code)
        assert is_alnum(ch.lower()) == is_alnum(ch) and SUPPORTED.fullmatch(ch.lower()), hex(code)
    assert checked == 95 + 4 + 0x17F - 0xA0 - 1 + 7


@needs_java
def test_every_normalised_phrase_has_a_core_string_among_the_texts_ngrams():
    """The argument's key step against the jar's own normaliser (Normalizer.normalizeLine, as -norm runs it,
    then lower-cased): every run of at most 7 consecutive normalised tokens has its core string among
    text_ngrams of the raw text."""
    rng = random.Random(7)
    texts = [t for t in (tricky_text(rng) for _ in range(4000)) if mt.text_ngrams(t, MAX_N) is not None]
    texts += ["The U.S.-based firm's 1,000 dogs... e.g. Mr. Smith a--b a-.b 5'x 1990's ''quoted'' \u2018tick\u2019"]
    out = subprocess.run(["java", "-Dfile.encoding=UTF-8", "-Dsun.stdout.encoding=UTF-8", "-Duser.language=en",
                          "-cp", jar(), "edu.cmu.meteor.util.Normalizer", "en", "true"],
                         input="".join(t + "\n" for t in texts).encode(), capture_output=True, check=True,
                         timeout=HANG_GUARD).stdout.decode("utf-8").split("\n")
    assert len(out) == len(texts) + 1
    joined = 0
    for text, normalised in zip(texts, out):
        tokens = [t for t in re.split("[ \t\n\r\f]+", normalised.lower()) if t]
        cores = [c for c in ("".join(ch for ch in t if is_alnum(ch)) for t in tokens) if c]
        phrases = {" ".join(cores[i:i + n]) for n in range(1, MAX_N + 1) for i in range(len(cores) - n + 1)}
        assert phrases <= set(mt.text_ngrams(text, MAX_N)), (text, normalised)
        joined += any(len(re.findall(f"[{mt.ALNUM}]+", t)) > 1 or re.search(r"[.'`,\-]", t)
                      for t in tokens if re.search(f"[{mt.ALNUM}]", t))
    assert joined > 500  # tokens that hold separators or joined runs were met


def corpus_phrases(segments) -> mt.CorpusPhrases:
    fields = [java.score_line(h, refs).split("|||") for h, refs in segments]
    return mt.phrases(jar(), (f for parts in fields for f in parts[1:-1]), (parts[-1] for parts in fields))


def table_stats(table: mt.FilteredTable, segments) -> list[str]:
    """The jar's statistics of ``segments`` with ``table`` (a JVM of its own); the table is removed."""
    jvm = java.MeteorJVM(jar(), table.path)
    try:
        return jvm.stats([java.score_line(h, refs) for h, refs in segments])
    finally:
        jvm.close()
        table.remove()


def full_table_stats(coco_meteor, segments) -> list[str]:
    """pycocoevalcap's METEOR (the jar with its full table), one request at a time."""
    return [coco_meteor._stat(h, list(refs)) for h, refs in segments]


def tricky_segments(seed: int, n: int) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        refs = [tricky_text(rng) for _ in range(rng.randint(1, 4))]
        hyp = rng.choice([tricky_text(rng), rng.choice(refs).upper(), rng.choice(refs).replace(" ", "-")])
        segment = (hyp.replace("  ", " "), refs)
        if all(mt.unsupported(t) is None and "|||" not in t and t.strip() for t in [hyp, *refs]):
            out.append(segment)
    return out


@needs_java
def test_the_jar_answers_the_same_with_the_corpus_table_on_tricky_captions(real_index, coco_meteor):
    segments = tricky_segments(0, 300)
    corpus = corpus_phrases(segments)
    assert corpus.index is real_index
    assert table_stats(real_index.table_for(corpus), segments) == full_table_stats(coco_meteor, segments)
    # candidates outside the argument (other scripts, the placeholder): the table for the references serves
    rng = random.Random(1)
    outside = ["\u4e2d\u6587", "dogDOTMULTIs", "\u0130stanbul", "x\u0301", "U.S.\U0001f600"]
    odd = [(f"{h} {rng.choice(outside)} {h}", refs) for h, refs in segments[:150]]
    corpus = corpus_phrases(odd)
    assert corpus.grams() is None and corpus.references is not None
    assert table_stats(real_index.table_for_references(corpus.references), odd) == full_table_stats(coco_meteor, odd)
    # and through the metric, per sample and corpus, against pycocoevalcap's own loop
    java.METEOR.reset()
    cands, refs = [h for h, _ in segments], [r for _, r in segments]
    got = capeval_plugins.load("meteor", tokenize=False)(None, cands, refs)
    assert java.METEOR.used == "corpus"
    gts, res = {i: r for i, r in enumerate(refs)}, {i: [c] for i, c in enumerate(cands)}
    score, items = coco_meteor.compute_score(gts, res)
    assert got.score == pytest.approx(score, rel=1e-12, abs=0)
    assert np.asarray(got.scores) == pytest.approx(np.asarray(items), rel=1e-12, abs=0)


def table_phrases(index, rng: np.random.Generator, count: int) -> list[tuple[str, str]]:
    """(A, B) of random entries of the real table made of lower-case ASCII words."""
    out = []
    for k in rng.choice(index.entries, 40 * count, replace=False).tolist():
        _, a, b, _ = index.entry_bytes([k]).decode().split("\n")
        if re.fullmatch("[a-z]+( [a-z]+)*", a) and re.fullmatch("[a-z]+( [a-z]+)*", b) and a != b:
            out.append((a, b))
    return out[:count]


def decorate(words: str, rng: random.Random) -> str:
    """A phrase as a caption might write it: capitals, dotted abbreviations, hyphens, trailing punctuation."""
    out = []
    for word in words.split():
        r = rng.random()
        if r < 0.15 and len(word) <= 4:
            word = ".".join(word.upper()) + "."  # "u.s." style: the normaliser drops the dots
        elif r < 0.3:
            word = word.capitalize()
        elif r < 0.4:
            word += rng.choice([",", ".", "'s", "!"])
        out.append(word)
    sep = " " if rng.random() < 0.7 else "-"
    return sep.join(out)


@needs_java
def test_the_jar_answers_the_same_with_the_corpus_table_on_its_own_paraphrases(real_index, coco_meteor):
    """Property-style: captions built from random entries of the table (A in the candidate, B in a reference,
    dressed with capitals, dots, hyphens and punctuation), so that paraphrase matches happen: the jar's
    statistics with the cut table are the full table's, and a table missing some of the kept entries is
    caught."""
    rng, pick = random.Random(3), np.random.default_rng(3)
    filler = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 4)))  # noqa: E731
    segments = []
    for a, b in table_phrases(real_index, pick, 250):
        hyp = f"{filler()} {decorate(a, rng)} {filler()}".strip()
        refs = [f"{filler()} {decorate(b, rng)} {filler()}".strip(), filler() or "a dog"]
        segments.append((hyp.replace("  ", " "), refs))
    full = full_table_stats(coco_meteor, segments)
    paraphrased = sum(sum(float(x) for x in stats.split()[16:20]) > 0 for stats in full)  # stage 4: paraphrase
    assert paraphrased > 100
    corpus = corpus_phrases(segments)
    tight, either = real_index.table_for(corpus), real_index.table_for_references(corpus.references)
    assert len(tight.entries) < len(either.entries)
    assert table_stats(tight, segments) == full
    assert table_stats(either, segments) == full  # the table for these references and any candidates
    # the check has teeth: every other kept entry dropped changes some statistics
    assert table_stats(real_index.write(tight.entries[::2], corpus.references), segments) != full


# ---------------------------------------------------------------------------------------------- the JVMs


@pytest.fixture
def fake_jvms(tmp_path, monkeypatch):
    """METEOR's protocol spoken by tests/helpers/fake_meteor.py, beside a small table in METEOR's layout:
    every JVM start recorded with the table it was given."""
    folder = tmp_path / "meteor"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "paraphrase-en.gz").write_bytes(gzip.compress(synthetic_table(random.Random(5), 3000)))
    starts: list[str | None] = []

    def command(jar: str, table: str | None = None) -> list[str]:
        starts.append(Path(table).read_bytes() if table else None)
        return [PYTHON, str(Path(__file__).parent / "helpers" / "fake_meteor.py"), "ok", "never"]

    java.METEOR.reset()
    monkeypatch.setattr(java, "meteor_command", command)
    yield str(folder / "meteor-1.5.jar"), starts
    java.METEOR.reset()


def test_jvms_are_kept_while_their_table_serves_and_a_validation_loop_starts_one_more(fake_jvms):
    fake_jar, starts = fake_jvms
    first = [("a dog runs on the grass", ["a big dog plays"]), ("two kids", ["two kids play"])]
    java.METEOR.score(fake_jar, first)
    assert len(starts) == 1 and starts[0] is not None and java.METEOR.used == "corpus"
    table = java.METEOR.table
    assert not table.any_hypothesis
    java.METEOR.score(fake_jar, first[:1])  # needs no entry the table lacks: the same JVM
    assert len(starts) == 1 and java.METEOR.table is table
    # the next epoch: new captions of the same images; the table for their references and any captions
    java.METEOR.score(fake_jar, [("U.S. caf\u00e9 e-mail", ["a big dog plays"]), ("a red car", ["two kids play"])])
    assert len(starts) == 2 and not os.path.exists(table.path) and java.METEOR.table.any_hypothesis
    rng = random.Random(0)
    for epoch in range(5):  # later epochs: kept, whatever the captions
        captions = [" ".join(rng.choices(WORDS + ["us", "1,000", "don't", "Dog"], k=5)) for _ in first]
        java.METEOR.score(fake_jar, [(c, refs) for c, (_, refs) in zip(captions, first)])
    java.METEOR.score(fake_jar, first)
    assert len(starts) == 2
    java.METEOR.score(fake_jar, [("a dog", ["an e-mail from the US"])])  # new references: their union
    assert len(starts) == 3  # ... and still the first references
    assert java.METEOR.table.serves(mt.phrases(fake_jar, ["a big dog plays", "two kids play"], ["anything at all"]))
    java.METEOR.score(fake_jar, first, paraphrases="full")  # asked for: the jar's own table
    assert len(starts) == 4 and starts[-1] is None and java.METEOR.used == "full"
    java.METEOR.score(fake_jar, [("a red car", ["a car"])])  # the full table serves every corpus
    assert len(starts) == 4 and java.METEOR.used == "full"
    java.METEOR.reset()
    java.METEOR.score(fake_jar, [("a \u4e2d\u6587 caption", ["a dog"])])  # a candidate outside the argument:
    assert starts[-1] is not None and java.METEOR.table.any_hypothesis  # the table for any candidates
    java.METEOR.score(fake_jar, [("a dog", ["a \u4e2d\u6587 caption"])])  # a reference outside: the full table
    assert starts[-1] is None and "a reference holds the character" in java.METEOR.full_reason


def test_after_enough_corpus_tables_the_full_table_is_loaded_for_good(fake_jvms):
    fake_jar, starts = fake_jvms
    rng = random.Random(0)
    for k in range(java.MAX_CORPUS_TABLES + 2):
        java.METEOR.score(fake_jar, [(f"{rng.choice(WORDS)} {k}", [" ".join(rng.sample(WORDS, 3)), str(k)])])
    assert [s is None for s in starts] == [False] * java.MAX_CORPUS_TABLES + [True]
    assert java.METEOR.used == "full" and str(java.MAX_CORPUS_TABLES) in java.METEOR.full_reason


def test_paraphrases_option_is_checked():
    with pytest.raises(ValueError, match="paraphrases must be one of"):
        capeval_plugins.load("meteor", paraphrases="some")
    with pytest.raises(ValueError, match="paraphrases must be one of"):
        java.METEOR.score("meteor.jar", [("a", ["b"])], paraphrases="none")


# ---------------------------------------------------------------------------------------------- the cache

BUILD_SCRIPT = """
import sys, warnings
from capeval_plugins.resources import meteor_table as mt
warnings.simplefilter("error")
index = mt.index_for(sys.argv[1])
print(index.entries, index.max_n, index.select(mt.corpus_grams(["a dog runs on the grass"], index.max_n).hashes).tolist())
"""


def test_the_index_is_built_once_per_cache_even_by_processes_building_at_once(tmp_path):
    table = tmp_path / "paraphrase-en.gz"
    table.write_bytes(gzip.compress(synthetic_table(random.Random(2), 150_000)))
    env = {**os.environ, "CAPEVAL_CACHE": str(tmp_path / "cache")}
    runs = [subprocess.Popen([PYTHON, "-c", BUILD_SCRIPT, str(table)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [run.communicate(timeout=HANG_GUARD) for run in runs]
    assert all(run.returncode == 0 for run in runs), outs
    assert sum("building METEOR's paraphrase index once" in err for _, err in outs) == 1
    assert len({out for out, _ in outs}) == 1 and outs[0][0].startswith("150000 4 [")
    again = subprocess.run([PYTHON, "-c", BUILD_SCRIPT, str(table)], env=env, capture_output=True, text=True,
                           timeout=HANG_GUARD, check=True)
    assert again.stdout == outs[0][0] and "building" not in again.stderr
    root = tmp_path / "cache" / "meteor"
    claim = files.Claim(root, mt.INDEX_KIND).open(create=False)
    listed = set(claim.files)
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert on_disk - listed == {".capeval-owned", mt.LOCK}  # every other file is listed as the package's


def test_a_damaged_index_is_built_again_never_read(tmp_path, monkeypatch, capfd):
    """A byte flipped anywhere in any file of the cached index (the table, a hash array, the offsets, the
    metadata) would silently drop or change entries: each is caught when a process opens the index, and the
    index is rebuilt to the same selection."""
    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "cache"))
    table = tmp_path / "paraphrase-en.gz"
    table.write_bytes(gzip.compress(synthetic_table(random.Random(6), 2000)))
    corpus = mt.corpus_grams(WORDS, 4).hashes
    mt._loaded.clear()
    expected = mt.index_for(table).select(corpus).tolist()
    folder = tmp_path / "cache" / "meteor" / mt.index_for(table).source
    rng = random.Random(7)
    for path in sorted(folder.iterdir()):
        data = bytearray(path.read_bytes())
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        mt._loaded.clear()  # a new process
        capfd.readouterr()
        index = mt.index_for(table)
        assert "the one in the cache is damaged" in capfd.readouterr().err, path.name
        assert index.select(corpus).tolist() == expected, path.name
        assert index.entry_bytes(np.arange(index.entries)).split(b"\n")[2::3] == \
            gzip.decompress(table.read_bytes()).split(b"\n")[2::3]


def test_a_new_table_replaces_only_the_packages_old_index_and_a_forged_cache_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "cache"))
    first, second = tmp_path / "one.gz", tmp_path / "two.gz"
    first.write_bytes(gzip.compress(synthetic_table(random.Random(3), 500)))
    second.write_bytes(gzip.compress(synthetic_table(random.Random(4), 500)))
    one = mt.index_for(first)
    root = tmp_path / "cache" / "meteor"
    (root / "mine.txt").write_text("the user's")
    (root / one.source / "notes.txt").write_text("the user's too")
    two = mt.index_for(second)
    assert two.source != one.source and (root / "mine.txt").read_text() == "the user's"
    assert {p.name for p in (root / one.source).iterdir()} == {"notes.txt"}  # only what the package listed went
    # a marker the package did not write (here: another user's key) makes the cache unusable, not trusted
    forged = tmp_path / "forged"
    shutil.copytree(root, forged / "meteor")
    monkeypatch.setenv("CAPEVAL_CACHE", str(forged))
    monkeypatch.setenv("CAPEVAL_CONFIG_DIR", str(tmp_path / "other-user"))
    with pytest.warns(UserWarning, match="paraphrase index is not available"):
        assert mt.index_for(second) is None
    assert mt.phrases(str(tmp_path / "meteor-1.5.jar"), ["a dog"], ["a cat"]).index is None  # no table there


def test_the_cache_follows_capeval_cache_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "c"))
    assert mt.cache_dir() == tmp_path / "c" / "meteor"
    monkeypatch.delenv("CAPEVAL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert mt.cache_dir() == tmp_path / "x" / "capeval_plugins" / "meteor"


CRAFTED_META = [
    b'{"content": {"format": 3, "files": [1, 2]}, "hmac": "0"}',  # another shape, no valid signature
    b"[" * 100_000 + b"]" * 100_000,  # deeper than the JSON reader's recursion limit
    b"\xff\xfe not json",
    b'{"format": 3, "entries": -5, "files": {"a_hash": {"bytes": "x"}}}',
]


def test_a_crafted_or_foreign_meta_file_rebuilds_the_index(tmp_path, monkeypatch, capfd):
    """meta.json is signed with the user's key: a crafted one (any shape, also one deeper than Python's
    recursion limit, or the right shape re-signed with another user's key) is never read: the index is built
    again, to the same selection (a traceback before)."""
    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "cache"))
    table = tmp_path / "paraphrase-en.gz"
    table.write_bytes(gzip.compress(synthetic_table(random.Random(8), 1500)))
    corpus = mt.corpus_grams(WORDS, 4).hashes
    mt._loaded.clear()
    index = mt.index_for(table)
    expected = index.select(corpus).tolist()
    meta_path = tmp_path / "cache" / "meteor" / index.source / "meta.json"
    genuine = json.loads(meta_path.read_bytes())["content"]
    other_key = files.signed_json({**genuine, "max_cores": 1}, mt.INDEX_KIND, key=b"k" * 32)
    for crafted in CRAFTED_META + [other_key]:
        meta_path.write_bytes(crafted)
        mt._loaded.clear()
        capfd.readouterr()
        again = mt.index_for(table)
        assert again is not None and again.select(corpus).tolist() == expected
        assert "building METEOR's paraphrase index again" in capfd.readouterr().err


KILLED_BUILD = """
import os, signal, sys
from capeval_plugins import files
from capeval_plugins.resources import meteor_table as mt
write = files.Folder.write
def dying_write(self, name, data, **kw):
    if name == "a_hash":
        def half(f):
            f.write(bytes(data)[: len(data) // 2]); f.flush(); os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return write(self, name, half, **kw)
    return write(self, name, data, **kw)
files.Folder.write = dying_write
mt.index_for(sys.argv[1])
"""


def test_a_build_killed_mid_write_leaves_nothing_the_next_build_does_not_remove(tmp_path):
    """kill -9 while a file of the index is being written: the partial file is a listed file of the
    package's, and the next build removes it (a hidden `.a_hash.<hex>.tmp`, never removed, before)."""
    table = tmp_path / "paraphrase-en.gz"
    table.write_bytes(gzip.compress(synthetic_table(random.Random(9), 20_000)))
    env = {**os.environ, "CAPEVAL_CACHE": str(tmp_path / "cache"), "CAPEVAL_QUIET": "1"}
    killed = subprocess.run([PYTHON, "-c", KILLED_BUILD, str(table)], env=env, capture_output=True, timeout=HANG_GUARD)
    assert killed.returncode == -9, killed.stderr
    root = tmp_path / "cache" / "meteor"
    partial = [p for p in root.rglob("*") if p.is_file() and p.stat().st_size and "a_hash" in p.name]
    assert partial, "the killed build left its partial file"
    subprocess.run([PYTHON, "-c", BUILD_SCRIPT, str(table)], env=env, capture_output=True, timeout=HANG_GUARD, check=True)
    claim = files.Claim(root, mt.INDEX_KIND).open(create=False)
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert on_disk - set(claim.files) == {".capeval-owned", mt.LOCK}
    assert not [name for name in on_disk if name.endswith(mt.SCRATCH) or name.endswith(".tmp")]


KILLED_RUN = """
import os, signal
from capeval_plugins.resources import meteor_table as mt
path, lock = mt.write_temp_table(b"a table")
print(path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_table_folders_of_killed_runs_are_removed_and_nothing_else(tmp_path, monkeypatch):
    """A run killed while its JVM read the cut table leaves its capeval-meteor-* folder in TMPDIR; the next
    run removes it, but not a live run's folder, a folder of the same name without a marker of the
    package's, nor one whose marker does not verify with the user's key."""
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}

    def killed_run() -> Path:
        run = subprocess.run([PYTHON, "-c", KILLED_RUN], env=env, capture_output=True, text=True, timeout=HANG_GUARD)
        assert run.returncode == -9, run.stderr
        return Path(run.stdout.strip()).parent

    first = killed_run()
    assert first.is_dir() and first.name.startswith(mt.TEMP_PREFIX) and (first / "paraphrase.gz").is_file()
    left = [killed_run()]
    assert not first.exists() and left[0].is_dir()  # the next run removed the killed one's
    mine = tmp / (mt.TEMP_PREFIX + "users-own")
    mine.mkdir()
    (mine / "paraphrase.gz").write_bytes(b"the user's")
    forged = tmp / (mt.TEMP_PREFIX + "forged")
    shutil.copytree(left[0], forged)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with monkeypatch.context() as other:
        other.setenv("CAPEVAL_CONFIG_DIR", str(tmp_path / "someone-else"))
        assert mt.sweep_temp_tables() == []  # another user's key: nothing is provably capeval's
    path, lock = mt.write_temp_table(b"live")  # this process's, in use: it sweeps the dead ones first
    live = Path(path).parent
    assert not any(folder.exists() for folder in left) and (mine / "paraphrase.gz").read_bytes() == b"the user's"
    assert mt.sweep_temp_tables() == [] and Path(path).read_bytes() == b"live"
    table = mt.FilteredTable("x", np.zeros(0), path, np.zeros(0), lock=lock)
    table.remove()
    assert not live.exists() and mine.exists()


def test_jvms_are_bounded_by_the_machine(fake_jvms, monkeypatch):
    """meteor.jvms=1000 starts at most one JVM per CPU (one per distinct segment, before), same scores."""
    fake_jar, starts = fake_jvms
    monkeypatch.setattr(java, "max_jvms", lambda: 2)
    segments = [(f"{w} dog", [f"a {w}"]) for w in WORDS[:6]]
    with pytest.warns(UserWarning, match="at most 2"):
        java.METEOR.score(fake_jar, segments, jvms=1000)
    assert len(starts) == 2
    metric = capeval_plugins.load("meteor", jvms=1000)
    assert metric.config.jvms == 1000  # bounded where it runs: a config travels between machines


def test_capeval_cache_shows_the_index_and_clears_only_the_packages_files(tmp_path, monkeypatch, capsys):
    import tempfile

    from capeval_plugins.cli import main

    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    table = tmp_path / "paraphrase-en.gz"
    table.write_bytes(gzip.compress(synthetic_table(random.Random(11), 3000)))
    mt._loaded.clear()
    index = mt.index_for(table)
    root = tmp_path / "cache" / "meteor"
    (root / "notes.txt").write_text("the user's")
    dead = subprocess.run([PYTHON, "-c", KILLED_RUN], env={**os.environ, "TMPDIR": str(tmp)}, capture_output=True,
                          text=True, timeout=HANG_GUARD)
    dead_folder = Path(dead.stdout.strip()).parent
    capsys.readouterr()
    assert main(["cache"]) == 0
    shown = capsys.readouterr().out
    size = sum(p.stat().st_size for p in (root / index.source).iterdir())
    assert f"{size / 1e6:.1f} MB" in shown and "a_hash" in shown and "hashes of the phrases A" in shown
    assert "1 capeval-meteor-* folders" in shown and "notes.txt" not in shown
    assert main(["cache", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["meteor"]["bytes"] == size and len(info["meteor"]["files"]) == len(list((root / index.source).iterdir()))
    assert main(["cache", "clear"]) == 0
    assert "1 table folder(s) of killed runs" in capsys.readouterr().out
    assert not dead_folder.exists() and (root / "notes.txt").read_text() == "the user's"
    assert not (root / index.source).exists() and not (root / ".capeval-owned").exists()
    mt._loaded.clear()
    assert mt.index_for(table).select(mt.corpus_grams(WORDS, 4).hashes).tolist() == \
        index.select(mt.corpus_grams(WORDS, 4).hashes).tolist()  # built again on the next use
