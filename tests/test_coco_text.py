"""BLEU, CIDEr-D and ROUGE-L of core/coco_text.py equal pycocoevalcap's own scorers, run side by side on the same
text, to 1e-12 relative on every corpus and per-item value (the arithmetic is pycocoevalcap's, in its order, so
the values agree to the last bit; 1e-12 is the promise), on seeded random corpora built to hit its quirks:
repeated rows (CIDEr's df counts them), empty texts, double spaces and tabs (ROUGE-L splits on single
spaces, BLEU and CIDEr on any whitespace), texts longer than a machine word and than the bit-parallel LCS's
cut-off, unicode and punctuation. No Java needed."""
from __future__ import annotations

import random

import numpy as np
import pytest

from capeval_plugins.core.coco_text import CocoCorpus, lcs_pairs

WORDS = ["a", "a", "the", "dog", "dog", "runs", "café", "naïve", "中文", "😀", ",", ".", "!", "x", "y", "|||", "'s",
         "", "e-mail", "İ", "ﬁ"]


def random_corpus(seed: int) -> tuple[list[str], list[list[str]]]:
    rng = random.Random(seed)

    def text() -> str:
        n = rng.choice([0, 1, 2, 3, 8, 20, 70, 600]) if rng.random() < 0.15 else rng.randint(1, 15)
        return rng.choice([" ", " ", " ", "  ", "\t"]).join(rng.choice(WORDS) for _ in range(n))

    n = rng.randint(1, 40)
    cands = [text() for _ in range(n)]
    refs = [[text() for _ in range(rng.randint(1, 6))] for _ in range(n)]
    for _ in range(n // 3):  # repeated rows, and candidates equal to a reference
        i, j = rng.randrange(n), rng.randrange(n)
        cands[i], refs[i] = cands[j], list(refs[j])
        k = rng.randrange(n)
        cands[k] = refs[k][0]
    return cands, refs


def close(ours, theirs) -> bool:
    ours, theirs = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    return ours.shape == theirs.shape and bool(np.all(np.abs(ours - theirs) <= 1e-12 * np.abs(theirs)))


@pytest.mark.parametrize("seed", range(40))
def test_bleu_cider_rouge_equal_pycocoevalcap_on_random_corpora(seed):
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    cands, refs = random_corpus(seed)
    gts, res = {i: r for i, r in enumerate(refs)}, {i: [c] for i, c in enumerate(cands)}
    corpus = CocoCorpus.from_texts(cands, refs)
    bleu, bleu_items = Bleu(4).compute_score(gts, res, verbose=0)
    ours, ours_items = corpus.bleu(4)
    assert close(ours, bleu)
    for k in range(4):
        assert close(ours_items[:, k], bleu_items[k]), k
    for sigma in (6.0, 0.5):
        score, items = Cider(sigma=sigma).compute_score(gts, res)
        ours, ours_items = corpus.cider(4, sigma)
        assert close(ours, score) and close(ours_items, items), sigma
    score, items = Rouge().compute_score(gts, res)
    ours, ours_items = corpus.rouge_l()
    assert close(ours, score) and close(ours_items, items)


def test_repeated_rows_are_scored_once_and_counted_as_often_as_they_occur():
    """Identical rows are scored once, yet CIDEr's df and ref length and BLEU's pooled counts see every row, as
    pycocoevalcap's do."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider

    cands = ["a dog runs", "a cat sits on a mat", "a dog runs"]
    refs = [["a dog runs fast", "dogs run"], ["a cat sits", "the cat on the mat"], ["a dog runs fast", "dogs run"]]
    corpus = CocoCorpus.from_texts(cands, refs)
    assert corpus.rows.counts.tolist() == [2, 1] and corpus.rows.inverse.tolist() == [0, 1, 0]
    gts, res = {i: r for i, r in enumerate(refs)}, {i: [c] for i, c in enumerate(cands)}
    score, items = Cider().compute_score(gts, res)
    assert close(corpus.cider()[1], items) and close(corpus.cider()[0], score)
    assert close(corpus.bleu()[0], Bleu(4).compute_score(gts, res, verbose=0)[0])
    alone = CocoCorpus.from_texts(cands[:2], refs[:2])  # without the repeat, pooled counts differ
    assert not close(alone.bleu()[0], corpus.bleu()[0])


def plain_lcs(a: list[str], b: list[str]) -> int:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a, 1):
        for j, y in enumerate(b, 1):
            table[i][j] = table[i - 1][j - 1] + 1 if x == y else max(table[i - 1][j], table[i][j - 1])
    return table[-1][-1]


def test_bit_parallel_lcs_equals_dynamic_programming():
    rng = random.Random(7)
    texts = [[rng.choice("abcde") for _ in range(rng.choice([1, 2, 5, 13, 63, 64, 65, 100, 600]))]
             for _ in range(60)]
    a = np.array([rng.randrange(len(texts)) for _ in range(300)])
    b = np.array([rng.randrange(len(texts)) for _ in range(300)])
    lcs, la, lb = lcs_pairs(texts, a, b)
    assert la.tolist() == [len(texts[i]) for i in a] and lb.tolist() == [len(texts[i]) for i in b]
    assert lcs.tolist() == [plain_lcs(texts[i], texts[j]) for i, j in zip(a, b)]
