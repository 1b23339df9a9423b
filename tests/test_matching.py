"""Greedy cosine matching (core/matching.py) against plain loops over token pairs."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from capeval_plugins.core.matching import (best_similarities, document_frequency, f_measure, greedy_prf, idf_weights,
                                           reduce_references, to_grid, weighted_mean)


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def plain_prf(cand, ref, cand_match, ref_match, cand_w, ref_w):
    """One pair, token by token: P over candidate tokens, R over reference tokens, each the weighted mean of
    the best cosine to a matchable token of the other side."""
    def side(src, src_w, dst, dst_match):
        total = sum(src_w)
        if total == 0:
            return 0.0
        acc = 0.0
        for tok, w in zip(src, src_w):
            if w == 0:
                continue
            sims = [cosine(tok, other) for other, ok in zip(dst, dst_match) if ok]
            acc += w * (max(sims) if sims else 0.0)
        return acc / total

    p = side(cand, cand_w, ref, ref_match)
    r = side(ref, ref_w, cand, cand_match)
    f = 0.0 if p + r == 0 else 2 * p * r / (p + r)
    return p, r, f


def random_pairs(seed: int, n: int = 6, dim: int = 5):
    """Pairs of different lengths (some with negative cosines), padded into batch tensors with garbage in the
    padding, plus per-token match masks and weights."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lc = [rng.randint(1, 7) for _ in range(n)]
    lr = [rng.randint(1, 9) for _ in range(n)]
    cand = torch.randn(n, max(lc), dim, generator=gen, dtype=torch.float64) * 3
    ref = torch.randn(n, max(lr), dim, generator=gen, dtype=torch.float64) * 3
    cand_mask = torch.arange(max(lc))[None] < torch.tensor(lc)[:, None]
    ref_mask = torch.arange(max(lr))[None] < torch.tensor(lr)[:, None]
    # A matchable-but-weightless token (like bert_score's [CLS]) in front, random idf-like weights elsewhere.
    cand_w = torch.rand(n, max(lc), generator=gen, dtype=torch.float64) * cand_mask
    ref_w = torch.rand(n, max(lr), generator=gen, dtype=torch.float64) * ref_mask
    cand_w[:, 0] = 0
    ref_w[:, 0] = 0
    return cand, cand_mask, ref, ref_mask, cand_w, ref_w, lc, lr


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_prf_equals_a_plain_loop_over_token_pairs(seed):
    cand, cand_mask, ref, ref_mask, cand_w, ref_w, lc, lr = random_pairs(seed)
    p, r, f = greedy_prf(cand, cand_mask, ref, ref_mask, cand_w, ref_w)
    for i in range(len(lc)):
        expected = plain_prf(cand[i, : lc[i]].tolist(), ref[i, : lr[i]].tolist(), [True] * lc[i], [True] * lr[i],
                             cand_w[i, : lc[i]].tolist(), ref_w[i, : lr[i]].tolist())
        assert (p[i].item(), r[i].item(), f[i].item()) == pytest.approx(expected, abs=1e-5)


def test_unweighted_matching_counts_every_matchable_token_once():
    cand, cand_mask, ref, ref_mask, _, _, lc, lr = random_pairs(3)
    # Exclude a token from matching altogether (as ViLBERTScore does with [CLS]/[SEP]).
    cand_match = cand_mask.clone()
    cand_match[:, 0] = False
    p, r, f = greedy_prf(cand, cand_match, ref, ref_mask)
    for i in range(len(lc)):
        match = [j > 0 for j in range(lc[i])]
        expected = plain_prf(cand[i, : lc[i]].tolist(), ref[i, : lr[i]].tolist(), match, [True] * lr[i],
                             [float(m) for m in match], [1.0] * lr[i])
        assert (p[i].item(), r[i].item(), f[i].item()) == pytest.approx(expected, abs=1e-5)


def test_padding_never_matches_even_when_every_cosine_is_negative():
    # One reference token opposite to every candidate token; padding (zeros) must not win the max.
    cand = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    ref = torch.tensor([[[-1.0, -1.0], [0.0, 0.0], [0.0, 0.0]]])
    cand_best, ref_best = best_similarities(cand, torch.tensor([[True, True]]), ref,
                                            torch.tensor([[True, False, False]]))
    assert cand_best.tolist()[0] == pytest.approx([-math.sqrt(0.5)] * 2)
    assert ref_best[0, 0].item() == pytest.approx(-math.sqrt(0.5))
    assert ref_best[0, 1:].tolist() == [0.0, 0.0]


def test_result_of_a_pair_does_not_depend_on_the_others_in_the_batch():
    cand, cand_mask, ref, ref_mask, cand_w, ref_w, lc, lr = random_pairs(4)
    batched = torch.stack(greedy_prf(cand, cand_mask, ref, ref_mask, cand_w, ref_w), -1)
    for i in range(len(lc)):
        alone = torch.stack(greedy_prf(cand[i : i + 1, : lc[i]], cand_mask[i : i + 1, : lc[i]], ref[i : i + 1, : lr[i]],
                                       ref_mask[i : i + 1, : lr[i]], cand_w[i : i + 1, : lc[i]],
                                       ref_w[i : i + 1, : lr[i]]), -1)
        assert alone[0].tolist() == pytest.approx(batched[i].tolist(), abs=1e-6)


def test_empty_sides_give_zero_not_nan():
    cand = torch.randn(2, 3, 4)
    ref = torch.randn(2, 2, 4)
    cand_mask = torch.tensor([[True, True, False], [True, False, False]])
    ref_mask = torch.tensor([[False, False], [True, True]])  # pair 0 has no reference token
    p, r, f = greedy_prf(cand, cand_mask, ref, ref_mask)
    assert (p[0].item(), r[0].item(), f[0].item()) == (0.0, 0.0, 0.0)
    assert not torch.isnan(torch.stack([p, r, f])).any()
    assert f_measure(torch.tensor([0.0]), torch.tensor([0.0])).item() == 0.0
    assert weighted_mean(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 0.0]])).item() == 0.0


def test_document_frequency_and_idf_equal_bert_scores_counting():
    rng = random.Random(0)
    docs = [[rng.randint(0, 12) for _ in range(rng.randint(1, 8))] for _ in range(9)]
    width = max(map(len, docs))
    padded = torch.tensor([d + [-1] * (width - len(d)) for d in docs])
    df = document_frequency(padded, pad_id=-1)
    counts = Counter(tok for d in docs for tok in set(d))
    assert df.tolist() == [float(counts.get(t, 0)) for t in range(len(df))]
    idf = idf_weights(df, len(docs))
    for tok in range(len(df)):
        assert idf[tok].item() == pytest.approx(math.log((len(docs) + 1) / (counts.get(tok, 0) + 1)))
    assert len(document_frequency(torch.zeros((0, 0), dtype=torch.long))) == 0  # no documents at all


def test_reference_reduction_and_grid():
    values = torch.tensor([0.2, 0.9, 0.4, 0.7, 0.1], dtype=torch.float64)
    owner = torch.tensor([0, 0, 0, 2, 2])
    slot = torch.tensor([0, 1, 2, 0, 1])
    grid, valid = to_grid(values, owner, slot, 3)
    mean = reduce_references(grid, valid, "mean")
    best = reduce_references(grid, valid, "max")
    assert mean[0].item() == pytest.approx(0.5) and mean[2].item() == pytest.approx(0.4)
    assert best[0].item() == pytest.approx(0.9) and best[2].item() == pytest.approx(0.7)
    assert math.isnan(mean[1].item()) and math.isnan(best[1].item())  # no reference: NaN, never a made-up value
    with pytest.raises(ValueError, match="multi_reference"):
        reduce_references(grid, valid, "min")
