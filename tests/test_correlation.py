"""Kendall tau-b / tau-c equal scipy's, with ties; inversions equal a plain double loop."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import kendalltau

from capeval_plugins.core.correlation import count_inversions, kendall_tau, pairwise_accuracy


@pytest.mark.parametrize("seed", range(6))
def test_inversions_equal_a_double_loop(seed):
    rng = np.random.default_rng(seed)
    r = rng.integers(0, 5 + seed * 3, size=rng.integers(1, 60))
    plain = sum(int(r[i] > r[j]) for i in range(len(r)) for j in range(i + 1, len(r)))
    assert count_inversions(r) == plain


@pytest.mark.parametrize("n, levels", [(2, 2), (7, 3), (50, 4), (301, 10), (1000, 1000), (5000, 4)])
@pytest.mark.parametrize("variant", ["b", "c"])
def test_tau_equals_scipy_with_ties(n, levels, variant):
    rng = np.random.default_rng(n * levels)
    x = rng.integers(0, levels, size=n).astype(float)  # human ratings: heavy ties
    y = np.round(x + rng.normal(0, 1.5, size=n), 1)     # metric scores: some ties
    ours, theirs = kendall_tau(x, y, variant), kendalltau(x, y, variant=variant).statistic
    np.testing.assert_allclose(ours, theirs, atol=1e-12, equal_nan=True)


def test_degenerate_inputs():
    assert np.isnan(kendall_tau([1.0], [2.0]))
    assert np.isnan(kendall_tau([1, 1, 1], [1, 2, 3], "b"))
    with pytest.raises(ValueError, match="NaN"):
        kendall_tau([1, np.nan], [1, 2])
    with pytest.raises(ValueError, match="length"):
        kendall_tau([1, 2], [1, 2, 3])


def test_pairwise_accuracy_counts_ties():
    a, b, pref = [0.9, 0.1, 0.5, 0.3], [0.1, 0.9, 0.5, 0.7], [0, 1, 0, 0]
    assert pairwise_accuracy(a, b, pref) == pytest.approx((1 + 1 + 0.5 + 0) / 4)
    assert pairwise_accuracy(a, b, pref, ties="wrong") == pytest.approx(2 / 4)
