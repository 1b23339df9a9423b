"""The classic metrics' run grows linearly with its rows: no step of it walks every row again for each row, and what
stays in memory per row is a few packed arrays, not Python objects (issue 55 item 3, issue 49 item 6). Counted,
never timed: each test counts the work or the objects that a quadratic step or a per-row object would multiply."""
from __future__ import annotations

import torch

from capeval_plugins.caption_files import CaptionRecords, score_table
from capeval_plugins.contract import MetricResult


class CountingList(list):
    """A list that counts how often it is walked from the start."""

    walks = 0

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


def test_the_score_table_walks_the_image_column_a_bounded_number_of_times_whatever_the_rows():
    """It used to ask "does any record name an image?" once per row: 200,000 rows walked 200,000 x 200,000 names."""
    def walks(n: int) -> int:
        CountingList.walks = 0
        records = CaptionRecords(images=[None] * n, captions=[f"caption {i}" for i in range(n)],
                                 references=[["a"]] * n, groups=[None] * n, lines=list(range(1, n + 1)),
                                 image_names=CountingList([None] * n), path="c.jsonl")
        result = MetricResult("bleu4", 0.5, torch.full((n,), 0.5, dtype=torch.float64), torch.arange(n))
        table = score_table({"bleu4": result}, records)
        assert [row["caption"] for row in table] == records.captions and "image" not in table[0]
        return CountingList.walks

    assert walks(300) == walks(3) <= 2


# ---------------------------------------------------------------------------------------------- BLEU, CIDEr, ROUGE

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from test_coco_text import random_corpus  # noqa: E402

from capeval_plugins.core import coco_text  # noqa: E402
from capeval_plugins.core.coco_text import CocoCorpus  # noqa: E402


def every_value(corpus: CocoCorpus) -> list:
    bleu, bleu_items = corpus.bleu(4)
    return [bleu, bleu_items, *corpus.cider(4, 6.0), *corpus.cider(4, 0.5), *corpus.rouge_l()]


def assert_bit_equal(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("block", [1, 2, 7])
def test_blocks_of_rows_change_no_bit_of_any_value(seed, block, monkeypatch):
    """The matches of a block of rows at a time, and the n-grams of a block of texts (memory bounded whatever the
    corpus), give every value to the last bit, down to blocks of one pair or one token (each block then holds one
    row or one text, never half of one)."""
    cands, refs = random_corpus(seed)
    whole = every_value(CocoCorpus.from_texts(cands, refs))
    monkeypatch.setattr(coco_text, "BLOCK_PAIRS", block)
    monkeypatch.setattr(coco_text, "TEXTS_BLOCK", block)
    assert_bit_equal(every_value(CocoCorpus.from_texts(cands, refs)), whole)


def plain_rows(cands, refs):
    """Identical rows numbered with a dict of tuples, in order of first appearance: the reference for the arrays."""
    rows, groups, inverse = {}, {}, []
    for c, r in zip(cands, refs):
        inverse.append(rows.setdefault((c, tuple(r)), len(rows)))
    group = [groups.setdefault(key[1], len(groups)) for key in rows]
    return inverse, [key[0] for key in rows], [list(key[1]) for key in rows], group


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("collide", [False, True])
def test_identical_rows_are_merged_exactly_even_when_digests_collide(seed, collide, monkeypatch):
    """Rows merge by a digest of their reference ids, checked id by id: with every digest made equal (a collision
    on every pair of lists) the rows are still numbered exactly, as a dict of tuples numbers them."""
    if collide:
        monkeypatch.setattr(coco_text, "_list_digests", lambda ids, offsets: np.zeros(len(offsets) - 1, np.int64))
    cands, refs = random_corpus(seed)
    rows = coco_text.text_rows(cands, refs)
    inverse, unique_cands, unique_refs, group = plain_rows(cands, refs)
    assert rows.inverse.tolist() == inverse and rows.group.tolist() == group
    assert [rows.texts[c] for c in rows.cand.tolist()] == unique_cands
    assert [[rows.texts[t] for t in rows.ref_text[a:b].tolist()] for a, b in
            zip(rows.ref_start[:-1].tolist(), rows.ref_start[1:].tolist())] == unique_refs
    assert rows.counts.tolist() == np.bincount(inverse).tolist()


def distinct_corpus(n: int) -> tuple[list[str], list[list[str]]]:
    """``n`` rows, each its own candidate and five references of its own (a last word naming the row): nothing
    repeats, so nothing is merged and every text's n-grams are counted (the costly case)."""
    import random

    rng = random.Random(n)
    words = [f"w{i}" for i in range(3000)]

    def text(i: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(8, 14))) + f" r{i}"

    return [text(i) for i in range(n)], [[text(i) for _ in range(5)] for i in range(n)]


def peak_bytes_per_token(n: int) -> float:
    """tracemalloc's peak (numpy's buffers included) while BLEU-4, CIDEr-D and ROUGE-L are computed on ``n`` distinct
    rows, over the corpus's whitespace tokens."""
    import tracemalloc

    cands, refs = distinct_corpus(n)
    tokens = sum(len(t.split()) for t in cands) + sum(len(t.split()) for rs in refs for t in rs)
    corpus = CocoCorpus.from_texts(cands, refs)
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        corpus.bleu(4), corpus.cider(4, 6.0), corpus.rouge_l()
        return (tracemalloc.get_traced_memory()[1] - start) / tokens
    finally:
        tracemalloc.stop()


def test_the_classic_metrics_memory_per_token_is_bounded_and_flat():
    """Memory is counted, not timed: the arrays alive at once are the tokens, one order's n-gram numbers and
    table, one sort over them and one block of matches, each a machine word or half of one per token: under 32
    words a token in all, and no more per token for four times the rows. Every order's table and every (row,
    reference, n-gram) match kept for the whole corpus at once, as before, took about 45 words a token."""
    small, large = peak_bytes_per_token(500), peak_bytes_per_token(2000)
    assert large < 32 * 8
    assert large <= small * 1.1
