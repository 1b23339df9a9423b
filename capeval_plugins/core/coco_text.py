"""BLEU, ROUGE-L and CIDEr-D on tokenised text, exactly as pycocoevalcap computes them, vectorised (numpy).

pycocoevalcap cooks every (candidate, references) row into dicts of n-gram counts, once per metric, and walks
them in Python. Here every distinct text is split once and its n-grams are numbered once (BLEU and CIDEr-D
share them), identical rows are scored once, and the arithmetic runs over arrays. Every value is
pycocoevalcap's to the last bit, because the floating-point operations are its own, in its order:

* float sums run in the order pycocoevalcap's dicts iterate (an n-gram's first occurrence in its text, the
  references in their order): ``np.bincount`` adds its weights one after the other in array order, and terms
  that are zero (an n-gram of the candidate missing from the reference) are left out, which changes no sum of
  non-negative terms;
* what pycocoevalcap takes from the C library (``pow(x, 2)`` of a numpy float, ``x ** (1 / k)``,
  ``math.exp``, ``np.log`` of a Python float, ``np.e ** x``) is taken from it here too, value by value through
  ``map`` or once per distinct value: numpy's ``x * x`` or vectorised ``power`` differ from ``pow`` in the
  last bit for a few values in ten thousand;
* its quirks are kept: BLEU's closest reference length (a tie goes to the shorter) and its ``tiny`` /
  ``small`` constants; CIDEr-D's clipping ``min(h, r) * r``, its idf ``log(rows) - log(max(1, df))`` with df
  counted over every row (repeated rows included), and its sigma = 6 length penalty on the number of
  *bigrams*; ROUGE-L splits on single spaces (``"".split(" ")`` is one empty token).

Memory grows linearly with the rows, by some machine words per token (under 32 at the peak; see
tests/test_classic_scale.py): the rows are arrays of text ids over the
distinct texts (:func:`rows_from_ids` merges identical rows without a Python object per row), each text's
n-grams are numbered once, and the (row, reference, n-gram) matches that BLEU and CIDEr-D need are made for one
block of rows at a time (:data:`BLOCK_PAIRS`) and dropped: no block changes a value, since every sum runs within
one row, in the same order.

Inputs are plain strings (already PTB-tokenised, or taken as given); the module needs numpy only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Iterator, Sequence

import numpy as np

BLEU_TINY = 1e-15   # pycocoevalcap's bleu_scorer: "so that if guess is 0 still return 0"
BLEU_SMALL = 1e-9
ROUGE_BETA = 1.2
WORD_BITS = 64      # LCS rows of up to this many tokens are one machine word
LONG_TEXT = 512     # LCS pairs whose other side is longer are done one at a time (Python integers)
BLOCK_PAIRS = 1 << 15  # (row, reference) pairs whose n-gram matches exist at once (a few MB, whatever the corpus)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])`` without the loop."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.repeat(np.asarray(starts, dtype=np.int64) - (ends - counts), counts) + np.arange(total)


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _sums(groups: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Float sums of ``values`` by group, each group's values added one after the other in array order."""
    return np.bincount(groups, weights=values, minlength=n).astype(np.float64, copy=False)


POW_CHUNK = 1 << 16  # values turned into Python floats at a time by _pow


def _pow(values: np.ndarray, exponent: float) -> np.ndarray:
    """``x ** exponent`` for each value through the C library's ``pow``, as Python (and a numpy scalar) does; a
    chunk at a time (a Python float per value costs four times the array)."""
    out = np.empty(len(values), dtype=np.float64)
    for at in range(0, len(values), POW_CHUNK):
        part = values[at:at + POW_CHUNK].tolist()
        out[at:at + len(part)] = np.fromiter(map(pow, part, repeat(exponent)), dtype=np.float64, count=len(part))
    return out


@dataclass
class RowBlock:
    """Unique rows ``start:start + len(cand)`` of a :class:`TextRows`, with their references (``ref_start``
    counted from the block's first reference)."""

    start: int
    cand: np.ndarray
    ref_start: np.ndarray
    ref_text: np.ndarray

    @property
    def n_refs(self) -> np.ndarray:
        return np.diff(self.ref_start)

    @property
    def pair_row(self) -> np.ndarray:
        """The row (in the block) of every (row, reference) pair."""
        return np.repeat(np.arange(len(self.cand)), self.n_refs)

    @property
    def stop(self) -> int:
        return self.start + len(self.cand)


@dataclass
class TextRows:
    """(candidate, references) rows over distinct texts, identical rows once.

    ``texts`` holds each distinct text once; unique row ``r`` has candidate ``texts[cand[r]]`` and references
    ``texts[ref_text[ref_start[r]:ref_start[r + 1]]]``; input row ``i`` is unique row ``inverse[i]``; ``counts``
    says how many input rows each unique row stands for. Rows with the same reference list share ``group``."""

    texts: list[str]
    cand: np.ndarray
    ref_start: np.ndarray
    ref_text: np.ndarray
    inverse: np.ndarray
    counts: np.ndarray
    group: np.ndarray
    group_counts: np.ndarray

    @property
    def n_rows(self) -> int:
        return len(self.inverse)

    @property
    def n_refs(self) -> np.ndarray:
        return np.diff(self.ref_start)

    def segments(self) -> list[tuple[str, list[str]]]:
        """``(candidate, [references])`` of every unique row."""
        refs = [self.texts[t] for t in self.ref_text.tolist()]
        bounds = self.ref_start.tolist()
        return [(self.texts[c], refs[a:b]) for c, a, b in zip(self.cand.tolist(), bounds[:-1], bounds[1:])]

    @property
    def pair_row(self) -> np.ndarray:
        """The unique row of every (row, reference) pair."""
        return np.repeat(np.arange(len(self.cand)), self.n_refs)

    def blocks(self, pairs: int | None = None) -> Iterator[RowBlock]:
        """The unique rows in order, in blocks of about ``pairs`` (default :data:`BLOCK_PAIRS`) (row, reference)
        pairs; a row is never cut."""
        pairs = BLOCK_PAIRS if pairs is None else pairs
        bounds = self.ref_start
        row = 0
        while row < len(self.cand):
            stop = max(int(np.searchsorted(bounds, bounds[row] + pairs, side="right")) - 1, row + 1)
            stop = min(stop, len(self.cand))
            a, b = int(bounds[row]), int(bounds[stop])
            yield RowBlock(row, self.cand[row:stop], bounds[row:stop + 1] - a, self.ref_text[a:b])
            row = stop


def text_rows(candidates: Sequence[str], references: Sequence[Sequence[str]]) -> TextRows:
    """The rows ``(candidates[i], references[i])`` over their distinct texts (see :class:`TextRows`)."""
    if len(candidates) != len(references):
        raise ValueError(f"{len(candidates)} candidates but {len(references)} reference lists")
    ids: dict[str, int] = {}
    cand = np.fromiter((ids.setdefault(c, len(ids)) for c in candidates), np.int64, len(candidates))
    counts = np.fromiter(map(len, references), np.int64, len(references))
    ref_ids = np.fromiter((ids.setdefault(r, len(ids)) for rs in references for r in rs), np.int64, int(counts.sum()))
    return rows_from_ids(list(ids), cand, ref_ids, _offsets(counts))


def rows_from_ids(texts: list[str], cand: np.ndarray, ref_ids: np.ndarray, ref_offsets: np.ndarray) -> TextRows:
    """The rows over distinct ``texts``: row ``i`` has candidate ``texts[cand[i]]`` and references
    ``texts[ref_ids[ref_offsets[i]:ref_offsets[i + 1]]]``. Identical rows become one, numbered in order of first
    appearance, without a Python object per row: a reference list is known by a 64-bit digest of its ids, and
    every list is then compared, id by id, with the first list of its digest, so that a collision of digests
    never merges two lists (the lists are then numbered exactly, one tuple each)."""
    cand = np.asarray(cand, dtype=np.int64)
    ref_ids = np.asarray(ref_ids, dtype=np.int64)
    ref_offsets = np.asarray(ref_offsets, dtype=np.int64)
    n_refs = np.diff(ref_offsets)
    if len(n_refs) and not n_refs.min():
        raise ValueError("every row needs at least one reference")
    group = _first_appearance(_list_digests(ref_ids, ref_offsets))
    if not _lists_equal_to_first(group, ref_ids, ref_offsets):  # a collision of digests: number them exactly
        lists: dict[tuple, int] = {}
        bounds = ref_offsets.tolist()
        group = np.fromiter((lists.setdefault(tuple(ref_ids[a:b].tolist()), len(lists))
                             for a, b in zip(bounds[:-1], bounds[1:])), np.int64, len(cand))
    inverse = _first_appearance(group * max(len(texts), 1) + cand)  # a row is its (reference list, candidate)
    first = _first_rows(inverse)
    counts = np.bincount(inverse, minlength=len(first))
    unique_group = _first_appearance(group[first])
    unique_refs = n_refs[first]
    return TextRows(
        texts=texts,
        cand=cand[first],
        ref_start=_offsets(unique_refs),
        ref_text=ref_ids[_ranges(ref_offsets[first], unique_refs)],
        inverse=inverse,
        counts=counts,
        group=unique_group,
        group_counts=np.bincount(unique_group, weights=counts,
                                 minlength=int(unique_group.max(initial=-1)) + 1).astype(np.int64),
    )


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64, wrapping: every bit of the input reaches every bit of the output."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _list_digests(ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """A 64-bit digest (as int64) of every list ``ids[offsets[i]:offsets[i + 1]]``: its ids at their positions,
    and its length."""
    lengths = np.diff(offsets)
    if not len(lengths):
        return np.zeros(0, dtype=np.int64)
    position = np.arange(len(ids), dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    with np.errstate(over="ignore"):
        terms = _mix(ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + _mix(position.astype(np.uint64)))
        sums = np.zeros(len(lengths), dtype=np.uint64)
        filled = np.flatnonzero(lengths)
        if len(filled):
            sums[filled] = np.add.reduceat(terms, offsets[filled])
        return _mix(sums ^ _mix(lengths.astype(np.uint64) + np.uint64(1))).view(np.int64)


def _first_appearance(keys: np.ndarray) -> np.ndarray:
    """Each key's number among the distinct keys, numbered in order of first appearance."""
    if not len(keys):
        return np.zeros(0, dtype=np.int64)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[inverse.reshape(-1)]


def _first_rows(numbers: np.ndarray) -> np.ndarray:
    """The position of the first occurrence of each number ``0..max`` in ``numbers``."""
    first = np.full(int(numbers.max(initial=-1)) + 1, len(numbers), dtype=np.int64)
    np.minimum.at(first, numbers, np.arange(len(numbers)))
    return first


def _lists_equal_to_first(group: np.ndarray, ids: np.ndarray, offsets: np.ndarray) -> bool:
    """Whether every list equals, id by id, the first list of its group."""
    if not len(group):
        return True
    lengths = np.diff(offsets)
    model = _first_rows(group)[group]
    if not np.array_equal(lengths[model], lengths):
        return False
    return bool(np.array_equal(ids[_ranges(offsets[model], lengths)], ids))


def token_ids(texts: Sequence[str], separator: str | None = None, chunk: int = 1 << 14
              ) -> tuple[np.ndarray, np.ndarray]:
    """Word ids of every token of ``texts`` (``text.split(separator)``: None splits on any whitespace, ``" "``
    on single spaces), texts one after another, and each text's length in tokens. The texts are split a chunk
    at a time, so that their words never all exist as Python strings at once."""
    vocab: dict[str, int] = {}
    flats, lengths = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for at in range(0, len(texts), chunk):
        words = [t.split(separator) for t in texts[at:at + chunk]]
        size = np.fromiter(map(len, words), np.int64, len(words))
        flats.append(np.fromiter((vocab.setdefault(w, len(vocab)) for ws in words for w in ws), np.int64,
                                 int(size.sum())))
        lengths.append(size)
    return np.concatenate(flats), np.concatenate(lengths)


@dataclass
class Ngrams:
    """The n-grams of one order of every distinct text, as pycocoevalcap's ``precook`` counts them.

    Entries ``(gram, count)`` run by text, then by first occurrence in the text (the order of its dict);
    ``start[t]:start[t + 1]`` are text ``t``'s. ``keys`` (sorted ``owner * n_grams + gram``) and ``key_entry``
    find the entry of a (text, n-gram). Ids are 32-bit where they fit: a table costs 20 bytes an entry."""

    gram: np.ndarray
    count: np.ndarray
    start: np.ndarray
    keys: np.ndarray
    key_entry: np.ndarray
    n_grams: int

    @property
    def owner(self) -> np.ndarray:
        """The text of every entry."""
        return np.repeat(np.arange(len(self.start) - 1), np.diff(self.start))

    def find(self, owner: np.ndarray, gram: np.ndarray) -> np.ndarray:
        """The entry of each (text, n-gram), -1 where the text does not hold it."""
        if not len(self.keys):
            return np.full(len(owner), -1, dtype=np.int64)
        query = owner * self.n_grams + gram
        at = np.minimum(np.searchsorted(self.keys, query), len(self.keys) - 1)
        return np.where(self.keys[at] == query, self.key_entry[at], -1)


def _narrow(values: np.ndarray, bound: int) -> np.ndarray:
    """``values`` as int32 when every value below ``bound`` fits, else int64."""
    return values.astype(np.int32 if bound < 2 ** 31 else np.int64)


def ngram_tables(texts: Sequence[str], n: int) -> tuple[np.ndarray, list[Ngrams]]:
    """Each text's length in whitespace tokens (``str.split()``) and its n-grams of orders 1..n."""
    flat, lengths = token_ids(texts)
    return lengths, list(ngram_orders(flat, lengths, n))


def ngram_orders(flat: np.ndarray, lengths: np.ndarray, n: int) -> Iterator[Ngrams]:
    """The n-gram tables of orders 1..n of texts given as word ids (:func:`token_ids`), one at a time: a caller
    that uses one order at a time holds one table, not n. The n-grams of every order are numbered over all
    texts at once (a k-gram is a numbered (k-1)-gram and the word after it); each text's entries are counted a
    block of texts at a time (texts are whole in a block, so the blocks' entries, one after another, are the
    table's)."""
    n_texts = len(lengths)
    starts = _offsets(lengths)
    owner = _narrow(np.repeat(np.arange(n_texts), lengths), n_texts)
    left = _narrow(lengths[owner] - (np.arange(len(flat)) - starts[:-1][owner]), int(lengths.max(initial=0)) + 1)
    vocab = int(flat.max()) + 1 if len(flat) else 1
    code, n_codes = flat, vocab
    for k in range(1, n + 1):
        if k > 1:  # a k-gram is a (k-1)-gram and the word after it
            code, n_codes = _numbered(code, flat, vocab, np.flatnonzero(left >= k), k)
        yield _entries(code, n_codes, owner, starts, k)


def _numbered(code: np.ndarray, flat: np.ndarray, vocab: int, at: np.ndarray, k: int) -> tuple[np.ndarray, int]:
    """The k-gram number of every token at positions ``at`` (each its (k-1)-gram's number ``code`` and the word
    ``k - 1`` tokens on): its rank among the distinct k-grams, -1 at other positions; and the number of distinct
    k-grams (at least 1). Each array over the tokens is dropped as soon as it is used (this is the run's peak)."""
    keys = code[at].astype(np.int64)
    keys *= vocab
    keys += flat[at + k - 1]
    order = np.argsort(keys)
    keys = keys[order]
    new = np.empty(len(keys), dtype=bool)
    new[:1] = True
    np.not_equal(keys[1:], keys[:-1], out=new[1:])
    del keys
    wide = len(new) >= 2 ** 31
    ranks = np.cumsum(new, dtype=np.int64 if wide else np.int32)
    n_codes = max(int(ranks[-1]) if len(ranks) else 0, 1)
    del new
    ranks -= 1
    numbered = np.full(len(flat), -1, dtype=np.int64 if wide else np.int32)
    numbered[at[order]] = ranks
    return numbered, n_codes


TEXTS_BLOCK = 1 << 20  # tokens whose entries are counted at a time


def _entries(code: np.ndarray, n_codes: int, owner: np.ndarray, starts: np.ndarray, k: int) -> Ngrams:
    """The table of one order from every token's k-gram number (-1 where fewer than k tokens are left)."""
    n_texts = len(starts) - 1
    columns: list[list[np.ndarray]] = [[], [], [], [], []]  # keys, key order, gram, count, owner: per block
    text = 0
    while text < n_texts:
        stop = min(max(int(np.searchsorted(starts, starts[text] + TEXTS_BLOCK, side="right")) - 1, text + 1), n_texts)
        a, b = int(starts[text]), int(starts[stop])
        at = np.flatnonzero(code[a:b] >= 0) + a
        keys, first, count = np.unique(owner[at].astype(np.int64) * n_codes + code[at], return_index=True,
                                       return_counts=True)
        del at
        order = np.argsort(first, kind="stable")  # by text, then first occurrence: pycocoevalcap's dict order
        del first
        by_entry = keys[order]
        for column, values in zip(columns, (keys, _narrow(order, len(order)), _narrow(by_entry % n_codes, n_codes),
                                            _narrow(count[order], len(owner) + 1),
                                            _narrow(by_entry // n_codes, n_texts))):
            column.append(values)
        del keys, order, count, by_entry
        text = stop
    keys, gram, count, entry_owner = (_joined(columns[i]) for i in (0, 2, 3, 4))
    key_entry = np.empty(len(keys), dtype=np.int32 if len(keys) < 2 ** 31 else np.int64)
    at = 0
    for part in columns[1]:  # each block's entries in key order
        key_entry[part.astype(np.int64) + at] = np.arange(at, at + len(part))
        at += len(part)
    del columns
    return Ngrams(gram=gram, count=count, start=_offsets(np.bincount(entry_owner, minlength=n_texts)), keys=keys,
                  key_entry=key_entry, n_grams=n_codes)


def _joined(column: list[np.ndarray]) -> np.ndarray:
    """A column's blocks one after another; the list is emptied (each block dropped once copied)."""
    if not column:
        return np.zeros(0, dtype=np.int64)
    out = np.empty(sum(len(part) for part in column), dtype=np.result_type(*column))
    at = 0
    while column:
        part = column.pop(0)
        out[at:at + len(part)] = part
        at += len(part)
    return out


@dataclass
class Matches:
    """Every n-gram of a row's candidate against each of the row's references: element ``x`` is candidate
    entry ``entry[x]`` in pair ``pair[x]`` (pairs in row order, entries in the candidate's dict order), and
    ``ref_entry[x]`` the reference's entry of the same n-gram (-1: not in the reference)."""

    pair: np.ndarray
    entry: np.ndarray
    ref_entry: np.ndarray


def _matches(rows: RowBlock | TextRows, table: Ngrams) -> Matches:
    cand_of_pair = rows.cand[rows.pair_row]
    n_entries = np.diff(table.start)[cand_of_pair]
    pair = np.repeat(np.arange(len(cand_of_pair)), n_entries)
    entry = _ranges(table.start[cand_of_pair], n_entries)
    return Matches(pair, entry, table.find(rows.ref_text[pair], table.gram[entry].astype(np.int64)))


@dataclass
class CocoCorpus:
    """A corpus of tokenised (candidate, references) rows, prepared once for BLEU, CIDEr-D and ROUGE-L:
    each method returns pycocoevalcap's corpus score and per-row scores (input order), computed once per
    configuration and remembered."""

    rows: TextRows
    _tokens: tuple[np.ndarray, np.ndarray] | None = None
    _memo: dict[tuple, Any] = field(default_factory=dict)

    @classmethod
    def from_texts(cls, candidates: Sequence[str], references: Sequence[Sequence[str]]) -> "CocoCorpus":
        return cls(text_rows(candidates, references))

    def lengths(self) -> np.ndarray:
        """Every distinct text's length in whitespace tokens."""
        return self.tokens()[1]

    def tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """Word ids of every distinct text's whitespace tokens (texts one after another) and its length."""
        if self._tokens is None:
            flat, lengths = token_ids(self.rows.texts)
            self._tokens = _narrow(flat, int(flat.max(initial=0)) + 1), lengths
        return self._tokens

    def orders(self, n: int) -> Iterator[Ngrams]:
        """The n-gram tables of orders 1..n, one at a time (made again for each metric that needs them: kept, the
        four orders of a corpus of distinct texts would cost more than the rest of the run)."""
        return ngram_orders(*self.tokens(), n)

    def remember(self, key: tuple, compute) -> Any:
        """``compute()``, once per ``key`` for this corpus (a metric's result, shared by the metrics that need it)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def bleu(self, n: int = 4) -> tuple[list[float], np.ndarray]:
        """pycocoevalcap's ``Bleu(n)``: corpus BLEU-1..n (closest reference length) and an ``(rows, n)``
        array of sentence BLEU."""
        return self.remember(("bleu", n), lambda: _bleu(self, n))

    def cider(self, n: int = 4, sigma: float = 6.0) -> tuple[np.float64, np.ndarray]:
        """pycocoevalcap's ``Cider(n, sigma)`` (CIDEr-D): the corpus mean and the per-row scores."""
        return self.remember(("cider", n, sigma), lambda: _cider(self, n, sigma))

    def rouge_l(self) -> tuple[np.float64, np.ndarray]:
        """pycocoevalcap's ``Rouge()`` (ROUGE-L F, beta 1.2): the corpus mean and the per-row scores."""
        return self.remember(("rouge_l",), lambda: _rouge_l(self.rows))


# ---------------------------------------------------------------------------------------------- BLEU


def _bleu(corpus: CocoCorpus, n: int) -> tuple[list[float], np.ndarray]:
    rows = corpus.rows
    lengths = corpus.lengths()
    test_len = lengths[rows.cand]
    ref_len = lengths[rows.ref_text]
    # closest reference length, a tie to the shorter: min over (|l - test|, l)
    scale = int(ref_len.max(initial=0)) + 1
    distance = np.abs(ref_len - test_len[rows.pair_row]) * scale + ref_len
    closest = np.minimum.reduceat(distance, rows.ref_start[:-1]) % scale if len(distance) else distance
    del distance
    guess = np.maximum(test_len[:, None] - np.arange(n)[None, :], 0)
    correct = np.zeros((len(rows.cand), n), dtype=np.int64)
    for k, table in enumerate(corpus.orders(n)):
        for block in rows.blocks():
            correct[block.start:block.stop, k] = _clipped_matches(block, table, _matches(block, table))
        del table  # not alive while the next order's table is made
    # sentence BLEU, pycocoevalcap's float operations in its order
    ratios = (correct.astype(np.float64) + BLEU_TINY) / (guess.astype(np.float64) + BLEU_SMALL)
    products = np.cumprod(ratios, axis=1)
    items = np.empty_like(products)
    for k in range(n):
        items[:, k] = _pow(products[:, k], 1.0 / (k + 1))
    ratio = (test_len + BLEU_TINY) / (closest + BLEU_SMALL)
    short = np.nonzero(ratio < 1)[0]
    if len(short):
        penalty = np.fromiter(map(math.exp, (1 - 1 / ratio[short]).tolist()), np.float64, len(short))
        items[short] *= penalty[:, None]
    # corpus BLEU from n-gram counts pooled over every row (repeats as often as they occur)
    weights = rows.counts
    totals_correct = [int(x) for x in weights @ correct]
    totals_guess = [int(x) for x in weights @ guess]
    test_total, ref_total = int(weights @ test_len), int(weights @ closest)
    scores, bleu = [], 1.0
    for k in range(n):
        bleu *= float(totals_correct[k] + BLEU_TINY) / (totals_guess[k] + BLEU_SMALL)
        scores.append(bleu ** (1.0 / (k + 1)))
    ratio_total = (test_total + BLEU_TINY) / (ref_total + BLEU_SMALL)
    if ratio_total < 1:
        scores = [s * math.exp(1 - 1 / ratio_total) for s in scores]
    return scores, items[rows.inverse]


def _clipped_matches(rows: RowBlock, table: Ngrams, matches: Matches) -> np.ndarray:
    """Per row: the candidate's n-gram counts clipped at their largest count in any reference."""
    cand_entries = np.diff(table.start)[rows.cand]
    slot_start = _offsets(cand_entries)  # one slot per (row, candidate n-gram)
    row_of_pair = rows.pair_row[matches.pair]
    slot = slot_start[row_of_pair] + (matches.entry - table.start[rows.cand[row_of_pair]])
    best = np.zeros(int(slot_start[-1]), dtype=np.int64)
    found = matches.ref_entry >= 0
    np.maximum.at(best, slot[found], table.count[matches.ref_entry[found]].astype(np.int64))
    slot_entry = _ranges(table.start[rows.cand], cand_entries)
    clipped = np.minimum(table.count[slot_entry], best)
    return np.bincount(np.repeat(np.arange(len(rows.cand)), cand_entries), weights=clipped,
                       minlength=len(rows.cand)).astype(np.int64)


# ---------------------------------------------------------------------------------------------- CIDEr-D


def _document_frequency(rows: TextRows, table: Ngrams) -> np.ndarray:
    """In how many rows' references (any of them) each n-gram occurs: every input row counts, repeats too.
    Reference lists are taken a block at a time; the counts are whole numbers, so their float sums are exact
    in any order."""
    n_groups = len(rows.group_counts)
    first_row = np.zeros(n_groups, dtype=np.int64)
    first_row[rows.group] = np.arange(len(rows.group))  # a row of each distinct reference list (any: same list)
    n_refs = np.diff(rows.ref_start)[first_row]
    bounds = _offsets(n_refs)
    df = np.zeros(table.n_grams, dtype=np.float64)
    start, pairs = 0, BLOCK_PAIRS
    while start < n_groups:
        stop = min(max(int(np.searchsorted(bounds, bounds[start] + pairs, side="right")) - 1, start + 1), n_groups)
        pair_group = np.repeat(np.arange(start, stop), n_refs[start:stop])
        ref_texts = rows.ref_text[_ranges(rows.ref_start[first_row[start:stop]], n_refs[start:stop])]
        n_entries = np.diff(table.start)[ref_texts]
        entries = _ranges(table.start[ref_texts], n_entries)
        keys = np.unique(np.repeat(pair_group, n_entries) * table.n_grams + table.gram[entries])
        df += np.bincount(keys % table.n_grams, weights=rows.group_counts[keys // table.n_grams].astype(np.float64),
                          minlength=table.n_grams)
        start = stop
    return df


def _cider(corpus: CocoCorpus, n: int, sigma: float) -> tuple[np.float64, np.ndarray]:
    rows = corpus.rows
    # orders past the longest text have no n-grams: their similarity terms are 0, so only the others are computed
    orders = min(n, int(corpus.lengths().max(initial=0)) or 1)
    lengths = corpus.lengths()
    ref_len = np.log(float(rows.n_rows))
    # Gaussian penalty on the difference of *bigram* counts, as pycocoevalcap's counts2vec measures length
    bigrams = np.maximum(lengths - 1, 0) if n >= 2 else np.zeros_like(lengths)
    penalties: dict[int, float] = {}
    score = np.empty((len(rows.cand), orders))
    for k, table in enumerate(corpus.orders(orders)):
        df = _document_frequency(rows, table)
        distinct, which = np.unique(df, return_inverse=True)
        log_df = np.array([np.log(max(1.0, float(v))) for v in distinct], dtype=np.float64)
        del df
        vec = table.count.astype(np.float64) * (ref_len - log_df[which][table.gram])  # tf * idf per entry
        del which
        norm = np.sqrt(_sums(table.owner, _pow(vec, 2), len(rows.texts)))
        m = hyp = ref = val = None
        for block in rows.blocks():
            pair_row = block.pair_row
            pair_cand = block.cand[pair_row]
            m = _matches(block, table)
            found = np.nonzero(m.ref_entry >= 0)[0]
            hyp, ref = vec[m.entry[found]], vec[m.ref_entry[found]]
            val = _sums(m.pair[found], np.minimum(hyp, ref) * ref, len(pair_row))
            norm_h, norm_r = norm[pair_cand], norm[block.ref_text]
            scaled = (norm_h != 0) & (norm_r != 0)
            val[scaled] /= norm_h[scaled] * norm_r[scaled]
            delta = bigrams[pair_cand] - bigrams[block.ref_text]
            steps, at = np.unique(delta, return_inverse=True)
            for d in steps.tolist():
                if d not in penalties:
                    penalties[d] = np.e ** (-(float(d) ** 2) / (2 * sigma ** 2))
            val *= np.array([penalties[d] for d in steps.tolist()], dtype=np.float64)[at]
            score[block.start:block.stop, k] = _sums(pair_row, val, len(block.cand))
        del table, vec, norm, m, hyp, ref, val  # not alive while the next order's table is made
    mean = np.mean(score, axis=1) if orders == n else score.sum(axis=1) / n  # the mean over all n orders
    items = mean / rows.n_refs * 10.0
    items = items[rows.inverse]
    return np.mean(items), items


# ---------------------------------------------------------------------------------------------- ROUGE-L


def _rouge_l(rows: TextRows) -> tuple[np.float64, np.ndarray]:
    flat, lengths = token_ids(rows.texts, " ")  # pycocoevalcap splits on single spaces
    start = _offsets(lengths)
    lcs = np.zeros(len(rows.ref_text), dtype=np.int64)
    for block in rows.blocks():
        at = int(rows.ref_start[block.start])
        lcs[at:at + len(block.ref_text)] = _lcs_ids(flat, start, lengths, block.cand[block.pair_row],
                                                    block.ref_text)
    len_c, len_r = lengths[rows.cand[rows.pair_row]], lengths[rows.ref_text]
    prec = lcs / len_c.astype(np.float64)
    rec = lcs / len_r.astype(np.float64)
    prec_max = np.maximum.reduceat(prec, rows.ref_start[:-1]) if len(prec) else prec
    rec_max = np.maximum.reduceat(rec, rows.ref_start[:-1]) if len(rec) else rec
    beta2 = ROUGE_BETA ** 2
    both = (prec_max != 0) & (rec_max != 0)
    items = np.zeros(len(rows.cand))
    p, r = prec_max[both], rec_max[both]
    items[both] = ((1 + beta2) * p * r) / (r + beta2 * p)
    items = items[rows.inverse]
    return np.mean(items), items


def lcs_pairs(tokens: Sequence[Sequence[str]], a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Length of the longest common subsequence of token lists ``tokens[a[p]]`` and ``tokens[b[p]]`` for
    every pair ``p``, with both lengths (see :func:`_lcs_ids`)."""
    vocab: dict[str, int] = {}
    lengths = np.fromiter(map(len, tokens), np.int64, len(tokens))
    flat = np.fromiter((vocab.setdefault(w, len(vocab)) for ws in tokens for w in ws), np.int64, int(lengths.sum()))
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    return _lcs_ids(flat, _offsets(lengths), lengths, a, b), lengths[a], lengths[b]


def _lcs_ids(flat: np.ndarray, start: np.ndarray, lengths: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """LCS lengths of texts ``a[p]`` and ``b[p]`` (token ids ``flat[start[t]:start[t] + lengths[t]]``).

    Bit-parallel (Hyyro, 2004): the shorter list is a bit row and the longer is walked token by token, so a
    pair costs a few word operations per token of the longer list, all pairs at once. Pairs whose shorter
    list exceeds a machine word, or whose longer one is very long, are walked one at a time with Python
    integers as bit rows (same recurrence, any width)."""
    la, lb = lengths[a], lengths[b]
    swap = la > lb
    short, long_ = np.where(swap, b, a), np.where(swap, a, b)
    m, w = np.minimum(la, lb), np.maximum(la, lb)
    lcs = np.zeros(len(a), dtype=np.int64)
    fast = (m <= WORD_BITS) & (w <= LONG_TEXT) & (m > 0)
    if fast.any():
        lcs[fast] = _lcs_words(flat, start, lengths, short[fast], long_[fast])
    for p in np.nonzero(~fast & (m > 0))[0].tolist():
        s, t = int(short[p]), int(long_[p])
        lcs[p] = _lcs_big(flat[start[s]:start[s + 1]].tolist(), flat[start[t]:start[t + 1]].tolist())
    return lcs


def _lcs_words(flat: np.ndarray, start: np.ndarray, lengths: np.ndarray, short: np.ndarray,
               long_: np.ndarray) -> np.ndarray:
    # bit masks: for each (short text, token) the positions where the token occurs
    texts = np.unique(short)
    positions = _ranges(start[texts], lengths[texts])
    owner = np.repeat(texts, lengths[texts])
    bit = np.left_shift(np.uint64(1), (positions - start[owner]).astype(np.uint64))
    vocab = int(flat.max()) + 1
    keys = owner * vocab + flat[positions]
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    heads = np.concatenate([[True], keys[1:] != keys[:-1]])
    table_keys = keys[heads]
    table_masks = np.bitwise_or.reduceat(bit[order], np.nonzero(heads)[0])
    # the mask of every token of every long side, pairs longest first
    walk = np.argsort(-lengths[long_], kind="stable")
    short, long_ = short[walk], long_[walk]
    steps = lengths[long_]
    base = _offsets(steps)
    tokens = flat[_ranges(start[long_], steps)]
    query = np.repeat(short, steps) * vocab + tokens
    at = np.minimum(np.searchsorted(table_keys, query), len(table_keys) - 1)
    masks = np.where(table_keys[at] == query, table_masks[at], np.uint64(0))
    row = np.full(len(short), np.uint64(0xFFFFFFFFFFFFFFFF))
    active = len(short)
    for t in range(int(steps[0]) if len(steps) else 0):
        while active and steps[active - 1] <= t:
            active -= 1
        v = row[:active]
        u = v & masks[base[:active] + t]
        row[:active] = (v + u) | (v - u)
    m = lengths[short].astype(np.uint64)
    low = np.where(m >= WORD_BITS, np.uint64(0xFFFFFFFFFFFFFFFF),
                   np.left_shift(np.uint64(1), np.minimum(m, WORD_BITS - 1)) - np.uint64(1))
    out = np.empty(len(short), dtype=np.int64)
    out[walk] = m.astype(np.int64) - _popcount(row & low)
    return out


def _popcount(words: np.ndarray) -> np.ndarray:
    """Set bits of each uint64 (numpy 2's ``bitwise_count``; byte by byte on numpy 1.x)."""
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(words).astype(np.int64)
    as_bytes = np.ascontiguousarray(words).view(np.uint8).reshape(len(words), 8)
    return np.unpackbits(as_bytes, axis=1).sum(axis=1, dtype=np.int64)


def _lcs_big(short: list[int], long_: list[int]) -> int:
    masks: dict[int, int] = {}
    for i, token in enumerate(short):
        masks[token] = masks.get(token, 0) | (1 << i)
    full = (1 << len(short)) - 1
    row = full
    for token in long_:
        u = row & masks.get(token, 0)
        row = ((row + u) | (row - u)) & full
    return len(short) - row.bit_count()
