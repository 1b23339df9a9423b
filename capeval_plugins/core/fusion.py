"""Weighted fusion of component scores and its calibration on human ratings.

``fuse`` is the weighted sum RS = sum_k w_k * s_k. ``calibrate`` searches every weight vector on the simplex
(w_k >= 0, sum w_k = 1) with a fixed step (Redemption Score: 0.02, i.e. 1326 points for three components)
and keeps the one whose fused scores correlate best with human ratings (Kendall tau-c by default). All
candidate fusions are one matrix product; each correlation is a vectorised O(n log^2 n) count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from capeval_plugins.core.correlation import kendall_tau


def fuse(components: np.ndarray, weights: Sequence[float]) -> np.ndarray:
    """Weighted sum of the columns of ``components`` (N, K): RS = components @ weights, float64."""
    comps = np.asarray(components, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if comps.ndim != 2 or comps.shape[1] != len(w):
        raise ValueError(f"components must be (N, {len(w)}) for {len(w)} weights, got {comps.shape}")
    return comps @ w


def simplex_grid(n_components: int, step: float = 0.02) -> np.ndarray:
    """Every weight vector with non-negative multiples of ``step`` summing to 1, as (M, K) float64 rows in
    lexicographic order of the integer units (so the first row is (0, ..., 0, 1))."""
    if n_components < 1:
        raise ValueError("need at least one component")
    units = round(1.0 / step)
    if step <= 0 or units < 1 or not math.isclose(units * step, 1.0, rel_tol=0, abs_tol=1e-9):
        raise ValueError(f"step must divide 1 into a whole number of parts (e.g. 0.02, 0.01), got {step}")
    rows = np.zeros((1, 0), dtype=np.int64)
    for _ in range(n_components - 1):  # one more coordinate, every value the units left allow
        used = rows.sum(axis=1)
        counts = units - used + 1
        rows = np.column_stack([np.repeat(rows, counts, axis=0),
                                np.concatenate([np.arange(c) for c in counts])])
    last = units - rows.sum(axis=1)
    return np.column_stack([rows, last]).astype(np.float64) / units


@dataclass
class Calibration:
    """The best weights found, their correlation with the ratings, and how the search was set up."""

    weights: dict[str, float]
    correlation: float
    variant: str
    step: float
    n_samples: int
    n_grid: int
    n_best: int
    scores: np.ndarray = field(repr=False)

    def as_dict(self) -> dict:
        return {"weights": self.weights, "correlation": self.correlation, "variant": self.variant,
                "step": self.step, "n_samples": self.n_samples, "n_grid": self.n_grid, "n_best": self.n_best}


def _as_matrix(components, names: Sequence[str] | None) -> tuple[np.ndarray, list[str]]:
    if isinstance(components, Mapping):
        names = list(components) if names is None else list(names)
        missing = [n for n in names if n not in components]
        if missing:
            raise ValueError(f"no scores for component(s) {missing}")
        columns = [np.asarray(components[n], dtype=np.float64).ravel() for n in names]
        if len({len(c) for c in columns}) > 1:
            raise ValueError(f"components differ in length: {dict(zip(names, map(len, columns)))}")
        matrix = np.column_stack(columns)
    else:
        matrix = np.asarray(components, dtype=np.float64)
        if matrix.ndim != 2:
            raise ValueError(f"components must be an (N, K) array or a mapping name -> scores, got {matrix.shape}")
        names = [f"w{k}" for k in range(matrix.shape[1])] if names is None else list(names)
    if len(names) != matrix.shape[1]:
        raise ValueError(f"{len(names)} names for {matrix.shape[1]} components")
    return matrix, names


def _check_finite(matrix: np.ndarray, ratings: np.ndarray, names: Sequence[str]) -> None:
    bad_rows = ~np.isfinite(matrix).all(axis=1) | ~np.isfinite(ratings)
    if bad_rows.any():
        first = int(np.flatnonzero(bad_rows)[0])
        raise ValueError(
            f"sample {first}: non-finite component score or rating ({int(bad_rows.sum())} such samples; "
            f"components {list(names)}); drop or fill them before calibrating"
        )


def calibrate(
    components,
    ratings: Sequence[float],
    *,
    names: Sequence[str] | None = None,
    step: float = 0.02,
    variant: str = "c",
) -> Calibration:
    """Exhaustive simplex grid search for the fusion weights that maximise Kendall tau (``variant`` "c", as
    Redemption Score, or "b") between ``fuse(components, w)`` and human ``ratings``.

    ``components`` is an (N, K) array (with ``names``) or a mapping name -> N scores. Ties between grid
    points are broken by grid order (see :func:`simplex_grid`); ``n_best`` says how many points tie."""
    matrix, names = _as_matrix(components, names)
    human = np.asarray(ratings, dtype=np.float64).ravel()
    if len(human) != len(matrix):
        raise ValueError(f"got {len(human)} ratings for {len(matrix)} samples")
    if len(human) < 2:
        raise ValueError("calibration needs at least two rated samples")
    _check_finite(matrix, human, names)
    grid = simplex_grid(len(names), step)
    fused = matrix @ grid.T  # (N, M): every candidate fusion at once
    taus = np.array([kendall_tau(fused[:, m], human, variant=variant) for m in range(len(grid))])
    taus = np.where(np.isnan(taus), -np.inf, taus)
    best = int(np.argmax(taus))
    if not np.isfinite(taus[best]):
        raise ValueError("Kendall tau is undefined for every weight vector (constant ratings or scores)")
    n_best = int(np.sum(taus >= taus[best] - 1e-12))
    weights = {n: round(float(w), 10) for n, w in zip(names, grid[best])}
    return Calibration(weights, float(taus[best]), variant, step, len(human), len(grid), n_best, fused[:, best])
