"""Weighted fusion of component scores and its calibration on human ratings.

``fuse`` is the weighted sum RS = sum_k w_k * s_k. ``calibrate`` searches every weight vector on the simplex
(w_k >= 0, sum w_k = 1) with a fixed step (Redemption Score: 0.02, i.e. 1326 points for three components)
and keeps the one whose fused scores correlate best with human ratings (Kendall tau-c by default). All
candidate fusions are one matrix product; each correlation is a vectorised O(n log^2 n) count.

The search is bounded before anything is built: at most :data:`MAX_GRID_POINTS` weight vectors (C(1/step + K - 1,
K - 1) for K components) and at most :data:`MAX_FUSED_SCORES` fused scores (samples x weight vectors, 8 bytes
each). A finer step is refused in one line naming the size and the finest step that fits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from capeval_plugins.core.correlation import kendall_tau

MAX_GRID_POINTS = 1_000_000  # weight vectors: 0.001 for three components (501,501) fits, 0.0005 does not
MAX_FUSED_SCORES = 2 ** 27  # the (N, M) matrix of every candidate fusion: 1 GiB of float64


class GridTooLarge(ValueError):
    """A step whose grid or matrix of fused scores would exceed the bounds (see the module docstring)."""


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
    units = check_grid(n_components, step)
    rows = np.zeros((1, 0), dtype=np.int64)
    for _ in range(n_components - 1):  # one more coordinate, every value the units left allow
        used = rows.sum(axis=1)
        counts = units - used + 1
        rows = np.column_stack([np.repeat(rows, counts, axis=0),
                                np.concatenate([np.arange(c) for c in counts])])
    last = units - rows.sum(axis=1)
    return np.column_stack([rows, last]).astype(np.float64) / units


def grid_units(n_components: int, step: float) -> int:
    """How many parts ``step`` divides 1 into (0.02: 50), refused unless it divides 1 into a whole number."""
    if n_components < 1:
        raise ValueError("need at least one component")
    refusal = f"step must divide 1 into a whole number of parts (e.g. 0.02, 0.01), got {step}"
    if not step > 0:
        raise ValueError(refusal)
    parts = 1.0 / step
    if not math.isfinite(parts):  # 5e-324: more parts than a float counts
        raise GridTooLarge(f"step {step:g} divides 1 into more parts than can be counted; {_finest(n_components, 1)}")
    units = round(parts)
    if units < 1 or not math.isclose(units * step, 1.0, rel_tol=0, abs_tol=1e-9):
        raise ValueError(refusal)
    return units


def grid_size(n_components: int, units: int) -> int:
    """Weight vectors on the simplex in steps of 1/units: C(units + K - 1, K - 1)."""
    return math.comb(units + n_components - 1, n_components - 1)


def check_grid(n_components: int, step: float, n_samples: int = 1) -> int:
    """Refuse, before anything is built, a grid of more than :data:`MAX_GRID_POINTS` weight vectors, or more
    than :data:`MAX_FUSED_SCORES` fused scores for ``n_samples``, naming the size and the finest step that fits.
    Returns :func:`grid_units`."""
    units = grid_units(n_components, step)
    points = grid_size(n_components, units)  # an integer: exact however large (1e-300 on two components)
    if points > MAX_GRID_POINTS:
        raise GridTooLarge(f"step {step:g} makes a grid of {_count(points)} weight vectors for {n_components} "
                           f"components (at most {MAX_GRID_POINTS:,}); {_finest(n_components, n_samples)}")
    if n_samples * points > MAX_FUSED_SCORES:
        raise GridTooLarge(f"step {step:g} makes {n_samples:,} samples x {points:,} weight vectors = "
                           f"{n_samples * points:,} fused scores (at most {MAX_FUSED_SCORES:,}: 1 GiB); "
                           f"{_finest(n_components, n_samples)}")
    return units


def _count(number: int) -> str:
    """``1,000,000,001``; past a trillion, its order of magnitude (a grid of 1e-300 has 301 digits)."""
    return f"{number:,}" if number < 10 ** 12 else f"about 10^{int(number.bit_length() * math.log10(2))}"


def _fits(n_components: int, units: int, n_samples: int) -> bool:
    points = grid_size(n_components, units)
    return points <= MAX_GRID_POINTS and n_samples * points <= MAX_FUSED_SCORES


def _finest(n_components: int, n_samples: int) -> str:
    """The finest step of the form 1, 0.5, 0.2, 0.1, 0.05, ... that fits the bounds, as advice."""
    best = None
    for units in (m * 10 ** e for e in range(7) for m in (1, 2, 5)):  # steps 1 down to 2e-7
        if units > MAX_GRID_POINTS or not _fits(n_components, units, n_samples):
            break
        best = units
    if best is None:
        return f"no step fits {n_samples:,} samples x {n_components} components: use fewer of either"
    return f"the finest step that fits is {1 / best:g}"


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
    check_grid(len(names), step, len(human))  # before the grid or the (N, M) matrix is built
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
