"""Any scoring function on a benchmark: ``run_benchmark(..., metrics={"mine": fn})`` with
``fn(images, candidates, references) -> scores``, one score per row.

The function is called once per corpus of the benchmark (all rows, or each corpus a corpus-level metric
scores on its own), so a corpus-level function (CIDEr-like) sees what a registered one would. ``images`` are
the files under ``images=`` when it is given (video frames as lists), else the images as the benchmark names
them (or embedded ``{"bytes": ...}``); ``references`` are the rows' references (None when the file has none).
Its answer must hold one number per row: ``None`` is a row without a score (left out and counted, as a
metric's invalid sample); a wrong count, a non-number, NaN or an infinity is refused in one line naming the
function and the first bad row.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import numpy as np

from capeval_plugins.bench.data import Captions, resolve_images
from capeval_plugins.contract import Metric
from capeval_plugins.inputs import InputError


def is_scoring_function(value: Any) -> bool:
    """A plain callable (a function, a lambda, an object with ``__call__``), not a registered metric."""
    return callable(value) and not isinstance(value, Metric)


def check_metric_values(metrics: dict[str, Any]) -> None:
    """Every value a metric or a scoring function; anything else is refused naming its label."""
    for name, value in metrics.items():
        if not isinstance(value, Metric) and not callable(value):
            raise InputError(f"metric {name!r} is a {type(value).__name__}: give a metric (capeval_plugins.load) or "
                             "a function (images, candidates, references) -> one score per row")


def score_function(name: str, fn: Callable, captions: Captions, *, images: Any = None, benchmark: str = "",
                   frames: int | None = None):
    """Per-row scores of ``fn`` on the benchmark's rows (a :class:`~capeval_plugins.bench.runner.MetricRun`)."""
    from capeval_plugins.bench.runner import MetricRun

    start = time.perf_counter()
    pictures = (resolve_images(captions.images, images, benchmark, captions.segments, frames)
                if images is not None else list(captions.images))
    scores = np.full(len(captions.candidates), np.nan)
    for rows in captions.corpora():
        rows_list = rows.tolist()
        refs = None if captions.references is None else [list(captions.references[i]) for i in rows_list]
        answer = fn([pictures[i] for i in rows_list], [captions.candidates[i] for i in rows_list], refs)
        scores[rows] = _values(name, answer, len(rows_list), rows_list)
    return MetricRun(scores, time.perf_counter() - start, 0, len(scores))


def _values(name: str, answer: Any, count: int, rows: Sequence[int]) -> np.ndarray:
    """The function's answer as float64, None as NaN; anything else that is not one finite number per row is
    refused naming the benchmark row."""
    if hasattr(answer, "detach"):  # a torch tensor
        answer = answer.detach().cpu().double().numpy()
    if isinstance(answer, np.ndarray):
        if answer.ndim != 1:
            raise InputError(f"{name}: returned an array of shape {tuple(answer.shape)}; expected one score per "
                             f"row ({count})")
        answer = answer.tolist()
    if isinstance(answer, (str, bytes, dict)) or not hasattr(answer, "__len__"):
        raise InputError(f"{name}: returned {type(answer).__name__}; expected a sequence of {count} scores, one per "
                         "row")
    if len(answer) != count:
        raise InputError(f"{name}: returned {len(answer)} scores for {count} rows; expected one per row")
    out = np.empty(count)
    for k, value in enumerate(answer):
        if value is None:
            out[k] = math.nan
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise InputError(f"{name}: the score of benchmark row {rows[k]} is {type(value).__name__} "
                             f"{str(value)[:40]!r}, not a number")
        if not math.isfinite(float(value)):
            raise InputError(f"{name}: the score of benchmark row {rows[k]} is {float(value)}; return None for a row "
                             "without a score")
        out[k] = float(value)
    return out
