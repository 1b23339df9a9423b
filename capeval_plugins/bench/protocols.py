"""From per-row metric scores to the figures papers report, with paired bootstrap confidence intervals and
significance tests.

Correlation benchmarks: Kendall tau-b and tau-c (:mod:`capeval_plugins.core.correlation`, equal to scipy's),
Pearson's r and Spearman's rho between metric and human scores, against every human column the benchmark has
(averaged over the columns where its protocol says so, as VATEX-EVAL's annotators), and over systems (one
mean per captioning model) where the benchmark names them. Pairwise benchmarks: per-category accuracy (a pair is right
when the metric scores the preferred caption strictly higher; ties count ``ties="wrong"`` 0 or ``"half"`` 0.5)
and the mean over categories. Every figure is x100. Rows (pairs) whose metric score is NaN are left out and
counted in ``n_invalid``.

The bootstrap is paired: every replicate draws one set of resampling units (images by default, or rows),
stratified by category for pairwise benchmarks, and evaluates every metric on it, so two metrics are compared
on the same resampled data. Intervals are percentile intervals; the p-value of a difference is two-sided,
``2 * min(P(d <= 0), P(d >= 0))`` over replicates with add-one smoothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import combinations
from typing import Iterator, Mapping, Sequence

import numpy as np

from capeval_plugins.bench.benchmarks import Protocol
from capeval_plugins.bench.data import Pairs, Ratings
from capeval_plugins.core.correlation import KendallPlan, pearson

SCALE = 100.0
CORRELATION_STATS = ("kendall_tau_b", "kendall_tau_c", "pearson", "spearman")
SYSTEM_STATS = ("kendall_tau_b", "spearman", "pearson")


@dataclass
class Evaluation:
    """One metric on one benchmark: point estimates (x100) by statistic name, the rows used, and the values
    of each statistic over the bootstrap replicates."""

    stats: dict[str, float]
    n: int
    n_invalid: int = 0
    n_ties: int | None = None
    category_sizes: dict[str, int] = field(default_factory=dict)
    category_stats: dict[str, dict[str, float]] = field(default_factory=dict)
    replicates: dict[str, np.ndarray] = field(default_factory=dict)
    system_stats: dict[str, float] = field(default_factory=dict)
    n_systems: int = 0


# ------------------------------------------------------------------------------------------ correlation

class RankPlan:
    """Spearman's rho of fixed ``(x, y)`` under integer sample weights: equal to ``scipy.stats.spearmanr`` on
    the data with item ``i`` repeated ``weights[i]`` times (tied values share their mean rank), without
    re-sorting per bootstrap replicate."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x_group = np.unique(x, return_inverse=True)[1].ravel()
        self.y_group = np.unique(y, return_inverse=True)[1].ravel()

    @staticmethod
    def _ranks(groups: np.ndarray, w: np.ndarray) -> np.ndarray:
        sizes = np.bincount(groups, weights=w, minlength=int(groups.max()) + 1 if len(groups) else 1)
        before = np.cumsum(sizes) - sizes
        return (before + (sizes + 1) / 2)[groups]

    def rho(self, weights: np.ndarray | None = None) -> float:
        w = np.ones(len(self.x_group)) if weights is None else np.asarray(weights, dtype=np.float64)
        if not len(w):
            return math.nan
        return pearson(self._ranks(self.x_group, w), self._ranks(self.y_group, w), w)


def correlation_stats(scores: np.ndarray, human: np.ndarray, plan: KendallPlan | None = None,
                      weights: np.ndarray | None = None, ranks: RankPlan | None = None) -> dict[str, float]:
    plan = plan if plan is not None else KendallPlan(scores, human)
    ranks = ranks if ranks is not None else RankPlan(scores, human)
    tau = plan.statistics(weights)
    return {"kendall_tau_b": SCALE * tau["b"], "kendall_tau_c": SCALE * tau["c"],
            "pearson": SCALE * pearson(scores, human, weights), "spearman": SCALE * ranks.rho(weights)}


def column_stats(per_column: Mapping[str, dict[str, float]], average: bool,
                 keys: Sequence[str] = CORRELATION_STATS) -> dict[str, float]:
    """One human column: its statistics as they are. Several: ``<stat>:<column>`` for each and, when the
    protocol averages them (VATEX-EVAL's annotators), the mean under the plain name."""
    if list(per_column) == ["human"]:
        return dict(per_column["human"])
    out = {f"{k}:{col}": v for col, stats in per_column.items() for k, v in stats.items()}
    if average:
        for k in keys:
            out[k] = float(np.mean([stats[k] for stats in per_column.values()]))
    return out


class RatingPlans:
    """Precomputed Kendall and rank plans of one metric against every human column, on the valid rows."""

    def __init__(self, scores: np.ndarray, data: Ratings, valid: np.ndarray, average: bool) -> None:
        self.x = scores[valid]
        self.valid = valid
        self.average = average
        self.columns = {col: (y[valid], KendallPlan(self.x, y[valid]), RankPlan(self.x, y[valid]))
                        for col, y in data.human_columns().items()}

    def stats(self, weights: np.ndarray | None = None) -> dict[str, float]:
        w = None if weights is None else weights[self.valid]
        per = {col: correlation_stats(self.x, y, plan, w, ranks) for col, (y, plan, ranks) in self.columns.items()}
        return column_stats(per, self.average)


def system_stats(scores: np.ndarray, data: Ratings, valid: np.ndarray, average: bool) -> tuple[dict[str, float], int]:
    """Correlation over systems: each system's mean metric score against its mean human score (valid rows)."""
    systems = np.asarray(data.systems, dtype=object)[valid]
    names, index = np.unique(systems.astype(str), return_inverse=True)
    if len(names) < 3:
        return {}, len(names)
    count = np.bincount(index, minlength=len(names))

    def means(values: np.ndarray) -> np.ndarray:  # scaled first: a sum of values near 1e308 would overflow
        kept = values[valid]
        top = float(np.abs(kept).max()) if len(kept) else 0.0
        top = top if 0 < top < np.inf else 1.0
        return np.bincount(index, weights=kept / top, minlength=len(names)) / count * top

    x = means(scores)
    per = {}
    for col, y in data.human_columns().items():
        full = correlation_stats(x, means(y))
        per[col] = {k: full[k] for k in SYSTEM_STATS}
    return column_stats(per, average, SYSTEM_STATS), len(names)


def evaluate_ratings(scores: np.ndarray, data: Ratings, average: bool = False
                     ) -> tuple[Evaluation, RatingPlans]:
    scores = np.asarray(scores, dtype=np.float64)
    valid = np.isfinite(scores)
    for y in data.human_columns().values():
        valid &= np.isfinite(y)
    plans = RatingPlans(scores, data, valid, average)
    evaluation = Evaluation(plans.stats(), int(valid.sum()), int((~valid).sum()))
    if data.systems is not None:
        evaluation.system_stats, evaluation.n_systems = system_stats(scores, data, valid, average)
    if data.categories is not None:
        cats = np.asarray(data.categories)
        for cat in dict.fromkeys(data.categories):
            rows = valid & (cats == cat)
            evaluation.category_sizes[cat] = int(rows.sum())
            per = {col: correlation_stats(scores[rows], y[rows]) for col, y in data.human_columns().items()}
            evaluation.category_stats[cat] = column_stats(per, average)
    return evaluation, plans


# --------------------------------------------------------------------------------------------- pairwise

# "b": a tie is a vote for the pair's second caption (B), as Polos's Pascal-50S code decides
# (``0 if score_a > score_b else 1``), so it is right exactly where humans preferred B.
TIES = ("wrong", "half", "tie", "b")


def pair_outcomes(scores: np.ndarray, data: Pairs, ties: str, margin: float | str = 0.0
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pair: credit, whether both scores are finite, whether the metric tied them (scores within
    ``margin``; 0: equal). The metric's decision is the caption it scores higher. A metric tie counts
    ``ties="wrong"`` 0, ``"half"`` 0.5, ``"b"`` a vote for the second caption (right where humans preferred it:
    Polos's Pascal-50S code), or ``"tie"``: the metric predicts a tie, right exactly where humans judged one
    (CapArena's caption-level agreement). A human tie is right only when the metric predicts one.
    ``margin="calibrated"`` (PoSh's reading of CapArena): a tie below the k-th smallest absolute difference,
    k the number of pairs humans judged a tie, so the metric predicts at most as many ties as humans gave."""
    if ties not in TIES:
        raise ValueError(f"ties must be one of {TIES}, got {ties!r}")
    a, b = scores[data.first], scores[data.second]
    valid = np.isfinite(a) & np.isfinite(b)
    diff = np.where(valid, a - b, 0.0)
    human_tie = np.zeros(len(diff), dtype=bool) if data.human_tie is None else data.human_tie
    if margin == "calibrated":
        gaps = np.sort(np.abs(diff[valid]))
        k = int((human_tie & valid).sum())
        threshold = gaps[k] if k < len(gaps) else np.inf
        tied = valid & (np.abs(diff) < threshold)
        if threshold == 0:  # PoSh's loop: a difference >= 0 goes to the first caption
            diff = np.where(diff == 0, np.finfo(np.float64).tiny, diff)
    elif isinstance(margin, str) or not margin >= 0:
        raise ValueError(f"the tie margin must be 0 or more, or 'calibrated', got {margin!r}")
    else:
        tied = valid & (np.abs(diff) <= margin)
    right = np.where(data.label == 0, diff > 0, diff < 0).astype(np.float64)
    right[human_tie] = 0.0
    right[tied] = {"wrong": 0.0, "half": 0.5}.get(ties, 0.0)
    if ties == "b":
        right[tied & ~human_tie] = (data.label[tied & ~human_tie] == 1).astype(np.float64)
    if ties == "tie":
        right[tied & human_tie] = 1.0
    return right, valid, tied


def accuracy_stats(credit: np.ndarray, category_index: np.ndarray, names: list[str], mean: bool,
                   weights: np.ndarray, groups: Mapping[str, Sequence[str]] | None = None,
                   pooled: bool = False) -> dict[str, float]:
    """``{"category:<name>": accuracy, "group:<name>": mean of its categories, "accuracy": mean of all
    categories (``pooled``: share over all pairs)}`` (x100) with per-pair weights."""
    totals = np.bincount(category_index, weights=weights * credit, minlength=len(names))
    counts = np.bincount(category_index, weights=weights, minlength=len(names))
    with np.errstate(invalid="ignore", divide="ignore"):
        per_category = SCALE * totals / counts
    out = {f"category:{name}": float(v) for name, v in zip(names, per_category)}
    for group, members in (groups or {}).items():
        present = [out[f"category:{m}"] for m in members if f"category:{m}" in out]
        if present:
            out[f"group:{group}"] = float(np.mean(present))
    if mean:
        with np.errstate(invalid="ignore", divide="ignore"):
            out["accuracy"] = float(SCALE * totals.sum() / counts.sum() if pooled else np.mean(per_category))
    return out


def category_order(data: Pairs, protocol: Protocol) -> list[str]:
    present = list(dict.fromkeys(data.categories))
    known = [c for c in protocol.categories if c in present]
    return known + [c for c in present if c not in known]


def evaluate_pairs(scores: np.ndarray, data: Pairs, protocol: Protocol, ties: str, margin: float | str = 0.0):
    scores = data.unit_scores(np.asarray(scores, dtype=np.float64))
    credit, valid, tied = pair_outcomes(scores, data, ties, margin)
    # the pairs the accuracy counts: every scored pair, or (human_ties="skip") those humans did not tie
    counted = valid & ~data.human_tie if protocol.human_ties == "skip" and data.human_tie is not None else valid
    names = category_order(data, protocol)
    index = np.array([names.index(c) for c in data.categories], dtype=np.int64)
    stats = accuracy_stats(credit[counted], index[counted], names, protocol.mean, np.ones(int(counted.sum())),
                           protocol.category_groups, protocol.pooled)
    sizes = {c: int((counted & (index == i)).sum()) for i, c in enumerate(names)}
    evaluation = Evaluation(stats, int(counted.sum()), int((~valid).sum()), int((tied & counted).sum()), sizes)
    if data.pair_systems is not None and protocol.model_ranking is not None:
        from capeval_plugins.bench.ranking import model_level_agreement

        evaluation.system_stats, evaluation.n_systems = model_level_agreement(scores, data, valid, tied, protocol)
    return evaluation, (credit, counted, index, names)


# -------------------------------------------------------------------------------------------- bootstrap

class Resampler:
    """Integer weights per item for each bootstrap replicate: resampling units drawn with replacement within
    each stratum, every item weighted by how often its unit was drawn. Seeded, so reruns are identical."""

    def __init__(self, units: np.ndarray, strata: np.ndarray | None, replicates: int, seed: int) -> None:
        self.replicates = replicates
        self.seed = seed
        strata = np.zeros(len(units), dtype=np.int64) if strata is None else np.asarray(strata)
        self.groups = []
        for s in np.unique(strata):
            items = np.flatnonzero(strata == s)
            local = np.unique(np.asarray(units)[items], return_inverse=True)[1].ravel()
            self.groups.append((items, local, int(local.max()) + 1 if len(local) else 0))
        self.n = len(units)

    def __iter__(self) -> Iterator[np.ndarray]:
        rng = np.random.default_rng(self.seed)
        for _ in range(self.replicates):
            w = np.zeros(self.n, dtype=np.int64)
            for items, local, m in self.groups:
                if m:
                    counts = np.bincount(rng.integers(0, m, size=m), minlength=m)
                    w[items] = counts[local]
            yield w


def interval(values: np.ndarray, level: float = 0.95) -> list[float] | None:
    finite = values[np.isfinite(values)]
    if not len(finite):
        return None
    tail = 100 * (1 - level) / 2
    return [float(np.percentile(finite, tail)), float(np.percentile(finite, 100 - tail))]


def p_value(differences: np.ndarray) -> float:
    """Two-sided paired-bootstrap p-value of a difference being zero, with add-one smoothing."""
    d = differences[np.isfinite(differences)]
    if not len(d):
        return math.nan
    below, above = (np.sum(d <= 0) + 1) / (len(d) + 1), (np.sum(d >= 0) + 1) / (len(d) + 1)
    return float(min(1.0, 2 * min(below, above)))


# ---------------------------------------------------------------------------------------------- evaluate

def evaluate(data: Ratings | Pairs, protocol: Protocol, scores: Mapping[str, np.ndarray], *,
             replicates: int = 1000, seed: int = 0, unit: str = "image", ties: str | None = None,
             compare_only: Sequence[str] | None = None, tie_margin: float | str | None = None
             ) -> tuple[dict[str, Evaluation], list[dict]]:
    """Every metric's figures (with bootstrap intervals when ``replicates > 0``) and the paired comparisons
    of every two metrics on the benchmark's headline statistics. ``ties`` and ``tie_margin``: the protocol's
    unless given. Scores are rounded first where the protocol says so (VATEX-EVAL: 4 decimals)."""
    ties = ties or protocol.ties
    tie_margin = protocol.tie_margin if tie_margin is None else tie_margin
    scores = {name: np.asarray(s, dtype=np.float64) for name, s in scores.items()}
    if protocol.round_scores is not None:
        scores = {name: np.round(s, protocol.round_scores) for name, s in scores.items()}
    if isinstance(data, Ratings):
        prepare = lambda sc: _ratings(data, protocol, sc)  # noqa: E731
        resampler = Resampler(data.units(unit), None, replicates, seed)
    else:
        prepare = lambda sc: _pairs(data, protocol, sc, ties, tie_margin)  # noqa: E731
        resampler = Resampler(data.units(unit), np.asarray(data.categories), replicates, seed)
    evaluations, replicate = prepare(scores)
    for name, values in _replicates(replicate, resampler).items():
        evaluations[name].replicates = values
    compared = evaluations if compare_only is None else {n: evaluations[n] for n in compare_only}
    return evaluations, compare(compared, protocol, resampler, scores, prepare)


def _replicates(replicate, resampler: Resampler) -> dict[str, dict[str, np.ndarray]]:
    """Every statistic of every metric over the bootstrap replicates (one pass, shared weights)."""
    rows: dict[str, dict[str, list[float]]] = {}
    for w in resampler:
        for name, stats in replicate(w).items():
            for key, value in stats.items():
                rows.setdefault(name, {}).setdefault(key, []).append(value)
    return {name: {k: np.asarray(v) for k, v in stats.items()} for name, stats in rows.items()}


def _ratings(data: Ratings, protocol: Protocol, scores: Mapping[str, np.ndarray]):
    evaluations, plans = {}, {}
    for name, s in scores.items():
        evaluations[name], plans[name] = evaluate_ratings(s, data, protocol.average_columns)

    def replicate(w: np.ndarray) -> dict[str, dict[str, float]]:
        return {name: plan.stats(w) for name, plan in plans.items()}

    return evaluations, replicate


GRADE_DIFFERENCE = np.array([2.0, 1.0, 0.0, -1.0, -2.0])  # label -> how much better the first caption is
GRADE_CLASS = np.array([0, 0, 1, 2, 2])                   # label -> first better, equal, second better
GRADED_RULES = ("posh", "binary")


class GradedPlans:
    """One metric on a graded pairwise benchmark (DOCENT), for each judgment type, by the protocol's
    ``graded_rule``:

    * ``"posh"`` (PoSh's official script): accuracy over three classes (first better, equal, second better), the
      metric predicting "equal" when the score difference is below a threshold calibrated so that the metric
      predicts at most as many ties as humans gave (the ``k``-th smallest absolute difference, ``k`` the number
      of human ties); Spearman and Kendall tau-b between the 5-level human label (as +2 .. -2) and the score
      difference.
    * ``"binary"`` (MSD-Score's script): accuracy over the pairs humans did not judge equal, right when
      ``difference > 0`` exactly where humans preferred the first caption; Spearman, Kendall tau-b and Pearson
      between the label (+2 .. -2) and the difference over all pairs."""

    def __init__(self, scores: np.ndarray, data: Pairs, rule: str = "posh") -> None:
        if rule not in GRADED_RULES:
            raise ValueError(f"graded rule must be one of {GRADED_RULES}, got {rule!r}")
        a, b = scores[data.first], scores[data.second]
        self.valid = np.isfinite(a) & np.isfinite(b)
        self.rule = rule
        diff = (a - b)[self.valid]
        self.diff = diff
        self.columns = {}
        for kind, labels in data.graded.items():
            labels = np.asarray(labels)[self.valid]
            human = GRADE_DIFFERENCE[labels]
            if rule == "binary":
                counted = human != 0
                credit = ((human > 0) == (diff > 0)).astype(np.float64)
                metric_ties = int((diff == 0).sum())
            else:
                ties = int((labels == 2).sum())
                gaps = np.sort(np.abs(diff))
                threshold = gaps[ties] if ties < len(gaps) else np.inf
                predicted = np.where(diff >= threshold, 0, np.where(-diff >= threshold, 2, 1))
                counted = np.ones(len(diff), dtype=bool)
                credit = (predicted == GRADE_CLASS[labels]).astype(np.float64)
                metric_ties = int((predicted == 1).sum())
            self.columns[kind] = (credit, counted, human, KendallPlan(human, diff), RankPlan(human, diff), metric_ties)

    def stats(self, weights: np.ndarray | None = None) -> dict[str, float]:
        w = np.ones(int(self.valid.sum())) if weights is None else np.asarray(weights, np.float64)[self.valid]
        out = {}
        for kind, (credit, counted, human, plan, ranks, _) in self.columns.items():
            wc = w * counted
            with np.errstate(invalid="ignore", divide="ignore"):
                out[f"accuracy:{kind}"] = float(SCALE * (wc * credit).sum() / wc.sum())
            out[f"spearman:{kind}"] = SCALE * ranks.rho(w)
            out[f"kendall_tau_b:{kind}"] = SCALE * plan.statistics(w.astype(np.int64))["b"]
            if self.rule == "binary":
                out[f"pearson:{kind}"] = SCALE * pearson(human, self.diff, w)
        return out


def _graded(data: Pairs, scores: Mapping[str, np.ndarray], rule: str = "posh"):
    evaluations, plans = {}, {}
    for name, s in scores.items():
        plan = GradedPlans(np.asarray(s, dtype=np.float64), data, rule)
        ties = sum(col[-1] for col in plan.columns.values())
        evaluations[name] = Evaluation(plan.stats(), int(plan.valid.sum()), int((~plan.valid).sum()), ties)
        plans[name] = plan

    def replicate(w: np.ndarray) -> dict[str, dict[str, float]]:
        return {name: plan.stats(w) for name, plan in plans.items()}

    return evaluations, replicate


def _pairs(data: Pairs, protocol: Protocol, scores: Mapping[str, np.ndarray], ties: str, margin: float | str):
    if data.graded is not None:
        return _graded(data, scores, protocol.graded_rule)
    evaluations, outcomes = {}, {}
    for name, s in scores.items():
        evaluations[name], outcomes[name] = evaluate_pairs(s, data, protocol, ties, margin)

    def replicate(w: np.ndarray) -> dict[str, dict[str, float]]:
        out = {}
        for name, (credit, valid, index, cats) in outcomes.items():
            out[name] = accuracy_stats(credit[valid], index[valid], cats, protocol.mean, w[valid],
                                       protocol.category_groups, protocol.pooled)
        return out

    return evaluations, replicate


def compare(evaluations: Mapping[str, Evaluation], protocol: Protocol, resampler: Resampler,
            scores: Mapping[str, np.ndarray], prepare) -> list[dict]:
    """Paired comparison of every two metrics on each headline statistic. Where either metric left rows out
    (NaN scores), both are re-evaluated on the rows they share."""
    out = []
    for a, b in combinations(list(evaluations), 2):
        pair = {a: evaluations[a], b: evaluations[b]}
        if evaluations[a].n_invalid or evaluations[b].n_invalid:
            both = np.isfinite(scores[a]) & np.isfinite(scores[b])
            pair, replicate = prepare({m: np.where(both, scores[m], np.nan) for m in (a, b)})
            for name, values in _replicates(replicate, resampler).items():
                pair[name].replicates = values
        for stat in protocol.headline():
            if stat not in pair[a].stats or stat not in pair[b].stats:
                continue
            entry = {"metrics": [a, b], "statistic": stat.removeprefix("category:"),
                     "difference": pair[a].stats[stat] - pair[b].stats[stat]}
            if resampler.replicates > 0:
                d = pair[a].replicates[stat] - pair[b].replicates[stat]
                entry["ci95"] = interval(d)
                entry["p_value"] = p_value(d)
            out.append(entry)
    return out
