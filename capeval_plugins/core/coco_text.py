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

Inputs are plain strings (already PTB-tokenised, or taken as given); the module needs numpy only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Sequence

import numpy as np

BLEU_TINY = 1e-15   # pycocoevalcap's bleu_scorer: "so that if guess is 0 still return 0"
BLEU_SMALL = 1e-9
ROUGE_BETA = 1.2
WORD_BITS = 64      # LCS rows of up to this many tokens are one machine word
LONG_TEXT = 512     # LCS pairs whose other side is longer are done one at a time (Python integers)


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


def _pow(values: np.ndarray, exponent: float) -> np.ndarray:
    """``x ** exponent`` for each value through the C library's ``pow``, as Python (and a numpy scalar) does."""
    return np.fromiter(map(pow, values.tolist(), repeat(exponent)), dtype=np.float64, count=len(values))


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


def text_rows(candidates: Sequence[str], references: Sequence[Sequence[str]]) -> TextRows:
    """The rows ``(candidates[i], references[i])`` over their distinct texts (see :class:`TextRows`)."""
    if len(candidates) != len(references):
        raise ValueError(f"{len(candidates)} candidates but {len(references)} reference lists")
    ids: dict[str, int] = {}
    cand = [ids.setdefault(c, len(ids)) for c in candidates]
    refs = [tuple(ids.setdefault(r, len(ids)) for r in rs) for rs in references]
    if any(not r for r in refs):
        raise ValueError("every row needs at least one reference")
    rows: dict[tuple, int] = {}
    inverse = np.fromiter((rows.setdefault(key, len(rows)) for key in zip(cand, refs)), np.int64, len(cand))
    groups: dict[tuple, int] = {}
    group = np.fromiter((groups.setdefault(key[1], len(groups)) for key in rows), np.int64, len(rows))
    unique_refs = [key[1] for key in rows]
    counts = np.bincount(inverse, minlength=len(rows))
    return TextRows(
        texts=list(ids),
        cand=np.fromiter((key[0] for key in rows), np.int64, len(rows)),
        ref_start=_offsets(np.fromiter(map(len, unique_refs), np.int64, len(rows))),
        ref_text=np.fromiter((t for r in unique_refs for t in r), np.int64),
        inverse=inverse,
        counts=counts,
        group=group,
        group_counts=np.bincount(group, weights=counts, minlength=len(groups)).astype(np.int64),
    )


def _vocabulary(words: list[list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """Word ids of every token (texts one after another) and each text's length."""
    lengths = np.fromiter(map(len, words), np.int64, len(words))
    vocab: dict[str, int] = {}
    flat = np.fromiter((vocab.setdefault(w, len(vocab)) for ws in words for w in ws), np.int64, int(lengths.sum()))
    return flat, lengths


@dataclass
class Ngrams:
    """The n-grams of one order of every distinct text, as pycocoevalcap's ``precook`` counts them.

    Entries ``(owner, gram, count)`` run by text, then by first occurrence in the text (the order of its
    dict); ``start[t]:start[t + 1]`` are text ``t``'s. ``keys`` (sorted ``owner * n_grams + gram``) and
    ``key_entry`` find the entry of a (text, n-gram)."""

    owner: np.ndarray
    gram: np.ndarray
    count: np.ndarray
    start: np.ndarray
    keys: np.ndarray
    key_entry: np.ndarray
    n_grams: int

    def find(self, owner: np.ndarray, gram: np.ndarray) -> np.ndarray:
        """The entry of each (text, n-gram), -1 where the text does not hold it."""
        if not len(self.keys):
            return np.full(len(owner), -1, dtype=np.int64)
        query = owner * self.n_grams + gram
        at = np.minimum(np.searchsorted(self.keys, query), len(self.keys) - 1)
        return np.where(self.keys[at] == query, self.key_entry[at], -1)


def ngram_tables(texts: Sequence[str], n: int) -> tuple[np.ndarray, list[Ngrams]]:
    """Each text's length in whitespace tokens (``str.split()``) and its n-grams of orders 1..n."""
    flat, lengths = _vocabulary([t.split() for t in texts])
    n_texts = len(texts)
    owner = np.repeat(np.arange(n_texts), lengths)
    left = lengths[owner] - (np.arange(len(flat)) - _offsets(lengths)[:-1][owner])  # tokens from here on
    vocab = int(flat.max()) + 1 if len(flat) else 1
    code, n_codes = flat, vocab
    tables = []
    for k in range(1, n + 1):
        at = np.nonzero(left >= k)[0]
        if k > 1:  # a k-gram is a (k-1)-gram and the word after it
            uniq, inverse = np.unique(code[at] * vocab + flat[at + k - 1], return_inverse=True)
            code = np.full(len(flat), -1, dtype=np.int64)
            code[at] = inverse
            n_codes = max(len(uniq), 1)
        keys, first, count = np.unique(owner[at] * n_codes + code[at], return_index=True, return_counts=True)
        order = np.argsort(first, kind="stable")  # by text, then first occurrence: pycocoevalcap's dict order
        key_entry = np.empty(len(order), dtype=np.int64)
        key_entry[order] = np.arange(len(order))
        entry_owner = keys[order] // n_codes
        tables.append(Ngrams(owner=entry_owner, gram=keys[order] % n_codes, count=count[order],
                             start=_offsets(np.bincount(entry_owner, minlength=n_texts)), keys=keys,
                             key_entry=key_entry, n_grams=n_codes))
    return lengths, tables


@dataclass
class Matches:
    """Every n-gram of a row's candidate against each of the row's references: element ``x`` is candidate
    entry ``entry[x]`` in pair ``pair[x]`` (pairs in row order, entries in the candidate's dict order), and
    ``ref_entry[x]`` the reference's entry of the same n-gram (-1: not in the reference)."""

    pair: np.ndarray
    entry: np.ndarray
    ref_entry: np.ndarray


def _matches(rows: TextRows, table: Ngrams) -> Matches:
    cand_of_pair = rows.cand[rows.pair_row]
    n_entries = np.diff(table.start)[cand_of_pair]
    pair = np.repeat(np.arange(len(cand_of_pair)), n_entries)
    entry = _ranges(table.start[cand_of_pair], n_entries)
    return Matches(pair, entry, table.find(rows.ref_text[pair], table.gram[entry]))


@dataclass
class CocoCorpus:
    """A corpus of tokenised (candidate, references) rows, prepared once for BLEU, CIDEr-D and ROUGE-L:
    each method returns pycocoevalcap's corpus score and per-row scores (input order), computed once per
    configuration and remembered."""

    rows: TextRows
    _lengths: np.ndarray | None = None
    _tables: list[Ngrams] = field(default_factory=list)
    _matches: dict[int, Matches] = field(default_factory=dict)
    _memo: dict[tuple, Any] = field(default_factory=dict)

    @classmethod
    def from_texts(cls, candidates: Sequence[str], references: Sequence[Sequence[str]]) -> "CocoCorpus":
        return cls(text_rows(candidates, references))

    def tables(self, n: int) -> tuple[np.ndarray, list[Ngrams]]:
        if len(self._tables) < n:
            self._lengths, self._tables = ngram_tables(self.rows.texts, n)
            self._matches.clear()
        return self._lengths, self._tables[:n]

    def matches(self, k: int) -> Matches:
        """Candidate n-grams of order ``k + 1`` against each reference (shared by BLEU and CIDEr-D)."""
        if k not in self._matches:
            self._matches[k] = _matches(self.rows, self._tables[k])
        return self._matches[k]

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
    lengths, tables = corpus.tables(n)
    test_len = lengths[rows.cand]
    ref_len = lengths[rows.ref_text]
    # closest reference length, a tie to the shorter: min over (|l - test|, l)
    scale = int(ref_len.max(initial=0)) + 1
    distance = np.abs(ref_len - test_len[rows.pair_row]) * scale + ref_len
    closest = np.minimum.reduceat(distance, rows.ref_start[:-1]) % scale
    guess = np.maximum(test_len[:, None] - np.arange(n)[None, :], 0)
    correct = np.zeros((len(rows.cand), n), dtype=np.int64)
    for k in range(n):
        correct[:, k] = _clipped_matches(rows, tables[k], corpus.matches(k))
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


def _clipped_matches(rows: TextRows, table: Ngrams, matches: Matches) -> np.ndarray:
    """Per unique row: the candidate's n-gram counts clipped at their largest count in any reference."""
    cand_entries = np.diff(table.start)[rows.cand]
    slot_start = _offsets(cand_entries)  # one slot per (row, candidate n-gram)
    row_of_pair = rows.pair_row[matches.pair]
    slot = slot_start[row_of_pair] + (matches.entry - table.start[rows.cand[row_of_pair]])
    best = np.zeros(int(slot_start[-1]), dtype=np.int64)
    found = matches.ref_entry >= 0
    np.maximum.at(best, slot[found], table.count[matches.ref_entry[found]])
    slot_entry = _ranges(table.start[rows.cand], cand_entries)
    clipped = np.minimum(table.count[slot_entry], best)
    return np.bincount(np.repeat(np.arange(len(rows.cand)), cand_entries), weights=clipped,
                       minlength=len(rows.cand)).astype(np.int64)


# ---------------------------------------------------------------------------------------------- CIDEr-D


def _document_frequency(rows: TextRows, table: Ngrams) -> np.ndarray:
    """In how many rows' references (any of them) each n-gram occurs: every input row counts, repeats too."""
    n_groups = len(rows.group_counts)
    first_row = np.zeros(n_groups, dtype=np.int64)
    first_row[rows.group] = np.arange(len(rows.group))  # a row of each distinct reference list (any: same list)
    n_refs = np.diff(rows.ref_start)[first_row]
    pair_group = np.repeat(np.arange(n_groups), n_refs)
    ref_texts = rows.ref_text[_ranges(rows.ref_start[first_row], n_refs)]
    n_entries = np.diff(table.start)[ref_texts]
    entries = _ranges(table.start[ref_texts], n_entries)
    keys = np.unique(np.repeat(pair_group, n_entries) * table.n_grams + table.gram[entries])
    return np.bincount(keys % table.n_grams, weights=rows.group_counts[keys // table.n_grams].astype(np.float64),
                       minlength=table.n_grams)


def _cider(corpus: CocoCorpus, n: int, sigma: float) -> tuple[np.float64, np.ndarray]:
    rows = corpus.rows
    # orders past the longest text have no n-grams: their similarity terms are 0, so only the others are computed
    orders = min(n, max((len(t.split()) for t in rows.texts), default=1) or 1)
    lengths, tables = corpus.tables(orders)
    ref_len = np.log(float(rows.n_rows))
    pair_row = rows.pair_row
    pair_cand = rows.cand[pair_row]
    values = np.zeros((len(pair_row), orders))
    for k, table in enumerate(tables):
        df = _document_frequency(rows, table)
        distinct, which = np.unique(df, return_inverse=True)
        log_df = np.array([np.log(max(1.0, float(v))) for v in distinct], dtype=np.float64)
        vec = table.count.astype(np.float64) * (ref_len - log_df[which][table.gram])  # tf * idf per entry
        norm = np.sqrt(_sums(table.owner, _pow(vec, 2), len(rows.texts)))
        m = corpus.matches(k)
        found = np.nonzero(m.ref_entry >= 0)[0]
        hyp, ref = vec[m.entry[found]], vec[m.ref_entry[found]]
        val = _sums(m.pair[found], np.minimum(hyp, ref) * ref, len(pair_row))
        norm_h, norm_r = norm[pair_cand], norm[rows.ref_text]
        scaled = (norm_h != 0) & (norm_r != 0)
        val[scaled] /= norm_h[scaled] * norm_r[scaled]
        values[:, k] = val
    # Gaussian penalty on the difference of *bigram* counts, as pycocoevalcap's counts2vec measures length
    bigrams = np.maximum(lengths - 1, 0) if n >= 2 else np.zeros_like(lengths)
    delta = bigrams[pair_cand] - bigrams[rows.ref_text]
    distinct, which = np.unique(delta, return_inverse=True)
    penalty = np.array([np.e ** (-(float(d) ** 2) / (2 * sigma ** 2)) for d in distinct.tolist()], dtype=np.float64)
    values *= penalty[which][:, None]
    score = np.stack([_sums(pair_row, values[:, k], len(rows.cand)) for k in range(orders)], 1)
    mean = np.mean(score, axis=1) if orders == n else score.sum(axis=1) / n  # the mean over all n orders
    items = mean / rows.n_refs * 10.0
    items = items[rows.inverse]
    return np.mean(items), items


# ---------------------------------------------------------------------------------------------- ROUGE-L


def _rouge_l(rows: TextRows) -> tuple[np.float64, np.ndarray]:
    pair_row = rows.pair_row
    cand_of_pair = rows.cand[pair_row]
    lcs, len_c, len_r = lcs_pairs([t.split(" ") for t in rows.texts], cand_of_pair, rows.ref_text)
    prec = lcs / len_c.astype(np.float64)
    rec = lcs / len_r.astype(np.float64)
    prec_max = np.maximum.reduceat(prec, rows.ref_start[:-1])
    rec_max = np.maximum.reduceat(rec, rows.ref_start[:-1])
    beta2 = ROUGE_BETA ** 2
    both = (prec_max != 0) & (rec_max != 0)
    items = np.zeros(len(rows.cand))
    p, r = prec_max[both], rec_max[both]
    items[both] = ((1 + beta2) * p * r) / (r + beta2 * p)
    items = items[rows.inverse]
    return np.mean(items), items


def lcs_pairs(tokens: Sequence[Sequence[str]], a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Length of the longest common subsequence of token lists ``tokens[a[p]]`` and ``tokens[b[p]]`` for
    every pair ``p``, with both lengths.

    Bit-parallel (Hyyro, 2004): the shorter list is a bit row and the longer is walked token by token, so a
    pair costs a few word operations per token of the longer list, all pairs at once. Pairs whose shorter
    list exceeds a machine word, or whose longer one is very long, are walked one at a time with Python
    integers as bit rows (same recurrence, any width)."""
    flat, lengths = _vocabulary(list(tokens))
    start = _offsets(lengths)
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
    return lcs, la, lb


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
