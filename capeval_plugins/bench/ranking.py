"""Model-level agreement on arena-style pairwise benchmarks (CapArena): the captioning models ranked by the
Elo ratings a metric's pairwise decisions give them, against the human ranking.

As CapArena's official code computes it: online Elo (K=4, scale 400, base 10, initial 1000) over the battles
in file order, a battle won by the caption the metric scores higher (a metric tie: half a win each);
1,000 bootstrap rounds, each resampling the battles with replacement (NumPy's legacy generator seeded with
42, one ``choice(n, n)`` per round, as ``pandas.DataFrame.sample(frac=1, replace=True)`` draws them); models
ranked by their median rating. Spearman's rho and Kendall's tau-b (x100) compare the positions of the models in
that ranking with their positions in the human ranking (the official script's fixed list, where it names every
model, else the same Elo procedure over the human votes).

MSD-Score's script (``elo="single"``): an online Elo pass (K=32, scale 400, base 10, initial 1000) over every
scored battle, in the order Python's ``random.Random(1234)`` shuffles them; with ``shuffle_rounds`` R (its
``--shuffle_rounds``, default 1; its README runs 5) R passes, round r from fresh ratings over the battles as
``random.Random(1234 + r)`` shuffles them, and each model's ratings averaged over the rounds; the humans' ranking
from the same passes over their votes (a tie half a win each); models ranked by rating, the ``unranked`` systems
(its "human") left out of both rankings before positions are compared.
"""
from __future__ import annotations

import random
import warnings

import numpy as np

from capeval_plugins.bench.data import Pairs

K, SCALE, BASE, INITIAL = 4.0, 400.0, 10.0, 1000.0
ROUNDS, SEED = 1000, 42
SINGLE_K, SINGLE_SEED = 32.0, 1234  # MSD-Score's caparena.py
ELO = ("bootstrap", "single")


def bootstrap_elo(first: np.ndarray, second: np.ndarray, outcome: np.ndarray, n_models: int,
                  rounds: int = ROUNDS, seed: int = SEED) -> np.ndarray:
    """Median Elo rating of each model over the bootstrap rounds (NaN for a model in no battle).
    ``outcome`` is 1 when the first model won, 0 when the second did, 0.5 for a tie. The rounds are updated
    together, battle by battle (Elo is sequential within a round)."""
    n = len(first)
    rng = np.random.RandomState(seed)
    order = np.stack([rng.choice(n, size=n, replace=True) for _ in range(rounds)]) if n else np.zeros((rounds, 0), int)
    ratings = np.full((rounds, n_models), INITIAL)
    seen = np.zeros((rounds, n_models), dtype=bool)
    every = np.arange(rounds)
    for step in range(n):
        battle = order[:, step]
        a, b, score = first[battle], second[battle], outcome[battle]
        ra, rb = ratings[every, a], ratings[every, b]
        expect_a = 1.0 / (1.0 + BASE ** ((rb - ra) / SCALE))
        expect_b = 1.0 / (1.0 + BASE ** ((ra - rb) / SCALE))
        ratings[every, a] += K * (score - expect_a)
        ratings[every, b] += K * (1.0 - score - expect_b)
        seen[every, a] = seen[every, b] = True
    ratings[~seen] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a model in no battle: an all-NaN column
        return np.nanmedian(ratings, axis=0)


def single_pass_elo(first: np.ndarray, second: np.ndarray, outcome: np.ndarray, n_models: int,
                    k: float = SINGLE_K, seed: int = SINGLE_SEED, rounds: int = 1) -> np.ndarray:
    """Elo ratings after one pass over the battles in the order ``random.Random(seed)`` shuffles them, averaged
    with ``rounds - 1`` more passes from fresh ratings, pass r in the order of ``random.Random(seed + r)`` (NaN for
    a model in no battle). ``outcome`` as in :func:`bootstrap_elo`."""
    if rounds < 1:
        raise ValueError(f"shuffle rounds must be >= 1, got {rounds}")
    total = np.zeros(n_models)
    seen = np.zeros(n_models, dtype=bool)
    for round_ in range(rounds):
        order = list(range(len(first)))
        random.Random(seed + round_).shuffle(order)
        ratings = np.full(n_models, INITIAL)
        for i in order:
            a, b = first[i], second[i]
            expect_a = 1.0 / (1.0 + BASE ** ((ratings[b] - ratings[a]) / SCALE))
            change = k * (outcome[i] - expect_a)
            ratings[a] += change
            ratings[b] -= change
            seen[a] = seen[b] = True
        total += ratings
    ratings = total / rounds
    ratings[~seen] = np.nan
    return ratings


def elo_ratings(first: np.ndarray, second: np.ndarray, outcome: np.ndarray, n_models: int, method: str,
                rounds: int = 1) -> np.ndarray:
    """Each model's rating by the procedure ``method`` (``rounds``: the single-pass procedure's shuffle rounds)."""
    if method not in ELO:
        raise ValueError(f"elo must be one of {ELO}, got {method!r}")
    if method == "single":
        return single_pass_elo(first, second, outcome, n_models, rounds=rounds)
    return bootstrap_elo(first, second, outcome, n_models)


def rank_by(ratings: np.ndarray, names: list[str]) -> list[str]:
    """Models best first by rating (models never rated are left out)."""
    rated = [i for i in np.argsort(-ratings, kind="stable") if np.isfinite(ratings[i])]
    return [names[i] for i in rated]


def model_level_agreement(scores: np.ndarray, data: Pairs, valid: np.ndarray, tied: np.ndarray, protocol
                          ) -> tuple[dict[str, float], int]:
    """``{"spearman", "kendall_tau_b"}`` (x100) between the metric's and the humans' model rankings."""
    from capeval_plugins.core.messages import require

    stats = require("scipy.stats", "bench", "capeval bench's model-level agreement")
    kendalltau, spearmanr = stats.kendalltau, stats.spearmanr

    pairs = np.flatnonzero(valid)
    systems = [data.pair_systems[i] for i in pairs]
    names = sorted({s for pair in systems for s in pair})
    index = {name: i for i, name in enumerate(names)}
    first = np.array([index[a] for a, _ in systems], dtype=np.int64)
    second = np.array([index[b] for _, b in systems], dtype=np.int64)
    a, b = scores[data.first[pairs]], scores[data.second[pairs]]
    outcome = np.where(tied[pairs], 0.5, (a > b).astype(np.float64))
    metric_order = rank_by(elo_ratings(first, second, outcome, len(names), protocol.elo, protocol.shuffle_rounds),
                           names)
    human_order = human_ranking(data, protocol, pairs, first, second, names)
    unranked = set(protocol.unranked)
    metric_order = [m for m in metric_order if m not in unranked]
    position = {name: k + 1 for k, name in enumerate(m for m in human_order if m not in unranked)}
    ranked = [m for m in metric_order if m in position]
    if len(ranked) < 3:
        return {}, len(ranked)
    human_positions = [position[m] for m in ranked]
    metric_positions = list(range(1, len(ranked) + 1))
    return ({"spearman": 100.0 * float(spearmanr(human_positions, metric_positions).statistic),
             "kendall_tau_b": 100.0 * float(kendalltau(human_positions, metric_positions).statistic)},
            len(ranked))


def human_ranking(data: Pairs, protocol, pairs: np.ndarray, first: np.ndarray, second: np.ndarray,
                  names: list[str]) -> list[str]:
    """The protocol's fixed human ranking when it names every model, else Elo over the human votes."""
    fixed = list(protocol.model_ranking or ())
    if fixed and set(names) <= set(fixed):
        return fixed
    tie = data.human_tie[pairs] if data.human_tie is not None else np.zeros(len(pairs), dtype=bool)
    outcome = np.where(tie, 0.5, (data.label[pairs] == 0).astype(np.float64))
    return rank_by(elo_ratings(first, second, outcome, len(names), protocol.elo, protocol.shuffle_rounds), names)
