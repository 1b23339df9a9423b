"""What FLEUR's released outputs can and cannot say about DISCODE's Eq. 4 (alpha).

FLEUR's released Flickr8k-Expert outputs (Yebin46/FLEUR, results/fleur_flickr8k_expert.txt: LLaVA-1.5-13B) hold,
per caption, the score the model wrote and FLEUR's smoothed score; no per-digit probabilities. So:

1. **Without any assumption on the digit distributions** (part 1): where alpha is so small that the head's psi is
   the one-hot of the written digit in float64 for *every* distribution with that argmax, DISCODE's score is
   0.1 x the written first decimal, whatever the LVLM's probabilities. Elsewhere a written digit d only bounds
   the score: psi is proportional to r(x) exp(-c (x - d)^2 / 2), c = (1 - alpha) / alpha, for some r with
   argmax d, so 0.1 E_psi lies in an interval computed exactly (a linear-fractional programme over r, solved
   at its vertices). Captions whose intervals overlap may be ranked either way; the tau-c range over all such
   orders is bounded by summing, over those caption pairs, the largest share they can add or take away.
2. **With an assumed distribution** (part 2): each caption gets a distribution with the written digit as argmax
   and the expectation FLEUR's score implies, from one of several families, and DISCODE is computed with the
   package's closed-form head. In a family whose members are ordered by one parameter that also orders their
   expectation (an exponential tilt, a mixture weight), the head keeps that order within a written digit, so
   DISCODE gives back FLEUR's own ranking and its 53.0: the figure is the family's, not the reading's.

Kendall tau-c x 100 against the expert ratings (16,992 rows, the Flickr8k-Expert protocol).

    python benchmarks/discode_alpha_simulation.py --fleur-results PATH/fleur_flickr8k_expert.txt \\
        --flickr8k ../shared/benchdata/flickr8k_expert/flickr8k.json [--seeds 5]

The FLEUR outputs and the human ratings are third-party data: the script reads them from where they are.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import numpy as np
import torch
from scipy import stats

from capeval_plugins.core import heads

DIGITS = np.arange(10.0)
SIGMA2 = (1.0, 0.5, 0.1, 0.05, 0.01)  # the rows of the paper's Table 11
# (name, alpha_scale, clip, form): the readings of Eq. 4 the package offers
READINGS = [
    ("unit, capped (default)", "unit", True, "density"),
    ("unit, uncapped", "unit", False, "density"),
    ("unit, kernel", "unit", False, "kernel"),
    ("label (literal)", "label", False, "density"),
]


# --- the data ----------------------------------------------------------------------------------------------


def read_fleur_results(path: str) -> dict[tuple[str, str], tuple[str, float]]:
    """(image file name, caption) -> (the written score as text, FLEUR's smoothed score)."""
    out, image, caption, raw = {}, None, None, None
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("image file :"):
                image = os.path.basename(line.split(":", 1)[1].strip())
            elif line.startswith("caption :"):
                caption = " ".join(line.split(":", 1)[1].split())
            elif line.startswith("model score :"):
                raw = line.split(":", 1)[1].strip()
            elif line.startswith("our score :"):
                out[(image, caption)] = (raw, float(line.split(":", 1)[1]))
    return out


def read_captions(flickr8k: str, fleur: dict) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Per caption: the written score, FLEUR's score and its expert ratings (a (N, 3) array)."""
    with open(flickr8k, encoding="utf-8") as f:
        data = json.load(f)
    rows: dict[tuple[str, str], list[float]] = {}
    for item in data.values():
        for judgement in item["human_judgement"]:
            key = (os.path.basename(judgement["image_path"]), " ".join(judgement["caption"].split()))
            rows.setdefault(key, []).append(float(judgement["rating"]))
    keys = list(rows)
    if {len(r) for r in rows.values()} != {3}:
        raise ValueError("expected three expert ratings per caption")
    return [fleur[k][0] for k in keys], np.array([fleur[k][1] for k in keys]), np.array([rows[k] for k in keys])


def first_decimal(written: str) -> int:
    if float(written) >= 1.0:
        raise ValueError("a '1.0' answer: scored by FLEUR's rule, not the head; not in these outputs")
    return int(written.split(".")[1][0]) if "." in written else 0


def tau_c(scores: np.ndarray, ratings: np.ndarray) -> float:
    """Kendall tau-c x 100 over the rating rows (each caption's score repeated for its three ratings)."""
    return 100 * stats.kendalltau(np.repeat(scores, ratings.shape[1]), ratings.ravel(), variant="c")[0]


def alpha_of(digit: int, sigma2: float, scale: str, clip: bool, form: str) -> float:
    """Eq. 4 at a written digit, through the package's own function."""
    _, alpha = heads.att_prior(torch.tensor([digit]), torch.tensor(DIGITS), sigma2, scale, clip=clip, form=form)
    return float(alpha[0])


# --- part 1: what holds for every digit distribution ---------------------------------------------------------


def score_interval(d: int, alpha: float) -> tuple[float, float]:
    """The range of 0.1 E_psi[x] over every digit distribution whose argmax is ``d``: psi is proportional to
    r(x) w(x), w(x) = exp(-c (x - d)^2 / 2), r any weights with r(x) <= r(d) = 1, and the extremes of the ratio
    are at vertices, r(x) in {0, 1}. Float64 as the head: where every w(x != d) underflows, psi is the one-hot."""
    if alpha <= 0:  # underflowed: the head takes the limit, the one-hot of d
        return 0.1 * d, 0.1 * d
    c = (1 - alpha) / alpha
    with np.errstate(over="ignore"):
        w = np.exp(-c * (DIGITS - d) ** 2 / 2)
    others = [x for x in range(10) if x != d]
    means = []
    for size in range(len(others) + 1):
        for subset in itertools.combinations(others, size):
            keep = np.isin(DIGITS, (d, *subset))
            means.append(float((DIGITS * w)[keep].sum() / w[keep].sum()))
    return 0.1 * min(means), 0.1 * max(means)


def rating_types(ratings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each caption's multiset of ratings as a type index, and w[t, u] = sum over a rating of a type-t caption and
    one of a type-u caption of sign(a - b): the share of (C - D) a pair of captions adds when t scores higher."""
    multisets = [tuple(sorted(r)) for r in ratings]
    types = sorted(set(multisets))
    index = np.array([types.index(m) for m in multisets])
    w = np.array([[np.sign(np.subtract.outer(t, u)).sum() for u in types] for t in types])
    return index, w


def tau_c_bounds(digits: np.ndarray, intervals: dict[int, tuple[float, float]], ratings: np.ndarray
                 ) -> tuple[float, float, float]:
    """(tau-c with every undetermined pair tied, lowest, highest possible) over all scores consistent with the
    intervals: a pair of captions is ordered by the intervals when they do not overlap, else free (either order,
    or a tie). The free pairs move (C - D) by at most the sum of |w| over them."""
    index, w = rating_types(ratings)
    groups = sorted(set(digits.tolist()))
    counts = {g: np.bincount(index[digits == g], minlength=len(w)).astype(float) for g in groups}
    fixed = free = 0.0
    for g, h in itertools.combinations_with_replacement(groups, 2):
        (lo_g, hi_g), (lo_h, hi_h) = intervals[g], intervals[h]
        pairs = np.outer(counts[g], counts[h]) * w  # (C - D) if every g caption scores above every h caption
        if g == h:
            if hi_g > lo_g:
                # unordered pairs of distinct captions; same-type pairs add nothing (w[t, t] = 0)
                free += np.abs(np.triu(pairs, 1)).sum()
        elif lo_g > hi_h or lo_h > hi_g:
            fixed += pairs.sum() * (1 if lo_g > hi_h else -1)
        else:
            free += np.abs(pairs).sum()
    n, m = ratings.size, len(np.unique(ratings))  # the score has at least m distinct values in every case here
    scale = 100 * 2 * m / (n * n * (m - 1))
    return scale * fixed, scale * (fixed - free), scale * (fixed + free)


# --- part 2: figures that need an assumed distribution -------------------------------------------------------


def targets(written: list[str], smooth: np.ndarray) -> np.ndarray:
    """The expectation at the first decimal that FLEUR's released score implies, taking the second decimal's
    expectation to be the digit written there (the outputs do not release it either)."""
    second = np.array([int(w.split(".")[1][1]) if "." in w and len(w.split(".")[1]) > 1 else 0 for w in written])
    return np.clip(10 * (smooth - 0.01 * second), 0.0, 9.0)


def spike_and_bump(d: int, target: float, rng: np.random.Generator, fixed: bool = False) -> np.ndarray:
    """m one-hot(d) + (1 - m) bump, a unit-variance discrete Gaussian bump at 8 (above d) or 0 (below) when
    ``fixed`` (the paper's Figure 4 shape), else at a random centre beyond the target; m from the target."""
    for _ in range(50):
        if fixed:
            c = 8.0 if target >= d else 0.0
        elif abs(target - d) < 1e-6:
            c = d + rng.uniform(-3, 3)
        elif target > d:
            c = rng.uniform(min(target + 0.5, 9.5), 9.5)
        else:
            c = rng.uniform(-0.5, max(target - 0.5, -0.5))
        bump = np.exp(-0.5 * (DIGITS - c) ** 2)
        bump /= bump.sum()
        mean = bump @ DIGITS
        m = 1.0 if abs(mean - d) < 1e-9 else float(np.clip((mean - target) / (mean - d), 0.0, 1.0))
        p = m * (DIGITS == d) + (1 - m) * bump
        if p.argmax() == d:
            break
    p = 0.999 * p + 0.001 / 10  # no digit has probability 0
    return p / p.sum()


def tilted_spike(d: int, target: float, rng: np.random.Generator, decay: float = 2.0) -> np.ndarray:
    """Unimodal at d: p(x) proportional to exp(-decay |x - d| + t (x - d)), t in (-decay, decay) solved by
    bisection for the expectation (clamped to what the family reaches): an exponential tilt."""
    def dist(t: float) -> np.ndarray:
        e = -decay * np.abs(DIGITS - d) + t * (DIGITS - d)
        p = np.exp(e - e.max())
        return p / p.sum()
    lo, hi = -decay + 1e-6, decay - 1e-6
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if dist(mid) @ DIGITS < target else (lo, mid)
    return dist(0.5 * (lo + hi))


def two_point(d: int, target: float, rng: np.random.Generator) -> np.ndarray:
    """The written digit and one other digit, drawn at random on the target's side, weighted for the target
    (the second digit's mass capped below d's)."""
    side = [x for x in range(10) if (x > d if target >= d else x < d)] or [x for x in range(10) if x != d]
    x = int(rng.choice(side))
    share = float(np.clip((target - d) / (x - d), 0.0, 0.49))
    p = (1 - share) * (DIGITS == d) + share * (DIGITS == x)
    p = 0.999 * p + 0.001 / 10
    return p / p.sum()


FAMILIES = {
    "tilted_spike": (tilted_spike, False),
    "fixed_bump": (lambda d, t, rng: spike_and_bump(d, t, rng, fixed=True), False),
    "random_bump": (spike_and_bump, True),
    "two_point": (two_point, True),
}


def discode_scores(p: np.ndarray, digits: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """0.1 E_psi[x], psi the package's closed-form head at the written digits."""
    raw = torch.tensor(digits)
    log_q = heads.gaussian_log_prior(torch.tensor(DIGITS)[raw], torch.tensor(DIGITS))
    psi = heads.att_closed_form(torch.tensor(np.log(p)), log_q, torch.tensor(alpha, dtype=torch.float64))
    return 0.1 * (psi.numpy() @ DIGITS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fleur-results", required=True)
    parser.add_argument("--flickr8k", required=True)
    parser.add_argument("--seeds", type=int, default=5, help="seeds of the random families")
    args = parser.parse_args()
    written, smooth, ratings = read_captions(args.flickr8k, read_fleur_results(args.fleur_results))
    digits = np.array([first_decimal(w) for w in written])
    print(f"captions {len(written)}, rating rows {ratings.size}; written first decimal: "
          + ", ".join(f"{d}: {np.sum(digits == d)}" for d in range(10) if np.any(digits == d)))
    print(f"raw score tau-c {tau_c(np.array([float(w) for w in written]), ratings):.1f}; "
          f"first decimal only {tau_c(0.1 * digits, ratings):.1f}; FLEUR {tau_c(smooth, ratings):.1f}")

    print("\nPart 1: every digit distribution. tau-c with undetermined pairs tied [lowest, highest possible];")
    print("'exact' = share of captions whose score is 0.1 x the written digit whatever the distribution.")
    print("| reading | " + " | ".join(f"sigma2 = {s}" for s in SIGMA2) + " |")
    print("| --- |" + " --- |" * len(SIGMA2))
    present = sorted(set(digits.tolist()))
    for name, scale, clip, form in READINGS:
        cells = []
        for s2 in SIGMA2:
            intervals = {d: score_interval(d, alpha_of(d, s2, scale, clip, form)) for d in present}
            base, lo, hi = tau_c_bounds(digits, intervals, ratings)
            exact = np.mean([intervals[d][0] == intervals[d][1] for d in digits])
            cells.append(f"{base:.1f} [{lo:.1f}, {hi:.1f}], exact {exact:.0%}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    # self-check: where every written digit is exact, the bound is the first-decimal score's tau-c
    tiny = {d: score_interval(d, 1e-6) for d in present}
    assert abs(tau_c_bounds(digits, tiny, ratings)[0] - tau_c(0.1 * digits, ratings)) < 1e-9

    print(f"\nPart 2: assumed distributions (sigma2 = 0.1). tau-c; random families: mean (min-max) of {args.seeds} seeds")
    target = targets(written, smooth)
    readings = READINGS + [("fixed alpha = 0.5 (Table 10)", None, None, None)]
    print("| reading | " + " | ".join(FAMILIES) + " |")
    print("| --- |" + " --- |" * len(FAMILIES))
    table: dict[str, list[str]] = {"E_p of the assumed p (FLEUR's first decimal)": []}
    for family, (make, random) in FAMILIES.items():
        runs: dict[str, list[float]] = {}
        for seed in range(args.seeds if random else 1):
            rng = np.random.default_rng(seed)
            p = np.array([make(int(d), float(t), rng) for d, t in zip(digits, target)])
            runs.setdefault("E_p of the assumed p (FLEUR's first decimal)", []).append(tau_c(0.1 * (p @ DIGITS), ratings))
            for name, scale, clip, form in readings:
                per_digit = {d: 0.5 if scale is None else alpha_of(d, 0.1, scale, clip, form) for d in present}
                alpha = np.array([per_digit[int(d)] for d in digits])
                runs.setdefault(name, []).append(tau_c(discode_scores(p, digits, alpha), ratings))
        for name, values in runs.items():
            v = np.array(values)
            cell = f"{v.mean():.1f}" if len(v) == 1 else f"{v.mean():.1f} ({v.min():.1f}-{v.max():.1f})"
            table.setdefault(name, []).append(cell)
    for name, cells in table.items():
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
