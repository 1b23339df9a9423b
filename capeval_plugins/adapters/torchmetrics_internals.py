"""Everything the torchmetrics adapter does with torchmetrics' non-public parts, in one place.

torchmetrics has no public hook for these, so each is used here and nowhere else, and :func:`check` (run when
the adapter is imported) says clearly which one moved on a torchmetrics whose internals differ from those of
the versions in :data:`CHECKED_ON`, instead of a metric that silently syncs, casts or logs wrongly:

* ``Metric._sync_dist(dist_sync_fn, process_group)``: every rank must send one tensor per ``"cat"`` state
  (torchmetrics sends a list state item by item when it does not reduce it itself, and lists differ in length
  between ranks);
* ``Metric._apply(fn, exclude_state)``: integer states (sample ids) move with the metric but are never cast;
* ``Metric._is_synced`` and ``Metric._forward_cache`` (what Lightning logs on a step);
* ``Metric._plot(val, ax)``: how torchmetrics' own metrics implement ``plot()``.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Sequence

import torchmetrics

from capeval_plugins.contract import StateSpec
from capeval_plugins.core.messages import InternalsMoved

LIBRARY = "torchmetrics"
# The versions these internals were read and tested on (requirements/main.txt and requirements/lowest.txt pin
# one each; tests/test_internals.py fails when a pinned version is not listed here: read the internals again).
CHECKED_ON = ("1.4.0", "1.9.0")
ATTRIBUTES = ("_is_synced", "_forward_cache", "_defaults", "_computed")
METHODS = {"_sync_dist": ("dist_sync_fn", "process_group"), "_apply": ("fn", "exclude_state"),
           "_plot": ("val", "ax")}


def moved(library: str, version: str, checked_on: Sequence[str], what: str) -> InternalsMoved:
    return InternalsMoved(library, version, tuple(checked_on), what)


def check(metric_class: type = torchmetrics.Metric) -> None:
    """Raise :class:`InternalsMoved` naming what differs from the checked versions."""
    version = torchmetrics.__version__
    for name, params in METHODS.items():
        method = getattr(metric_class, name, None)
        if method is None:
            raise moved(LIBRARY, version, CHECKED_ON, f"no Metric.{name}")
        missing = [p for p in params if p not in inspect.signature(method).parameters]
        if missing:
            raise moved(LIBRARY, version, CHECKED_ON, f"Metric.{name} takes no {', '.join(missing)}")
    probe = torchmetrics.aggregation.SumMetric()
    absent = [name for name in ATTRIBUTES if not hasattr(probe, name)]
    if absent:
        raise moved(LIBRARY, version, CHECKED_ON, f"no Metric.{', '.join(absent)}")


def refuse_forward_when_synced(metric: torchmetrics.Metric) -> None:
    """torchmetrics' own rule for ``forward``."""
    if metric._is_synced:
        from torchmetrics.utilities.exceptions import TorchMetricsUserError

        raise TorchMetricsUserError("The Metric shouldn't be synced when performing ``forward``. HINT: Did you "
                                    "forget to call ``unsync`` ?.")


def forget_computed(metric: torchmetrics.Metric) -> None:
    """Drop the value ``compute()`` keeps until the next ``update()``: a ``merge_state()`` changes the state too."""
    metric._computed = None


def set_forward_cache(metric: torchmetrics.Metric, value: Any) -> None:
    """What ``forward`` returned, where Lightning reads it to log a metric object on a step."""
    metric._forward_cache = value


def apply_keeping(metric: torchmetrics.Metric, base_apply: Callable, fn: Callable, exclude_state: Sequence[str],
                  kept: Sequence[str]) -> Any:
    """``Metric._apply`` with the ``kept`` states left out of ``fn`` (a cast) and moved to the metric's new
    device as they are."""
    this = base_apply(fn, exclude_state=(*exclude_state, *kept))
    device = this.device
    for name in kept:
        if name in exclude_state:
            continue
        default, value = this._defaults[name], getattr(this, name)
        this._defaults[name] = [v.to(device) for v in default] if isinstance(default, list) else default.to(device)
        setattr(this, name, [v.to(device) for v in value] if isinstance(value, list) else value.to(device))
    return this


def sync_cat_states(metric: torchmetrics.Metric, spec: Mapping[str, StateSpec], dist_sync_fn: Callable | None,
                    process_group: Any, base_sync: Callable) -> None:
    """``Metric._sync_dist`` with every ``"cat"`` state sent as exactly one tensor of its own dtype and
    trailing shape (an empty rank's too, zero rows; ragged ones zero-padded: the gather pads and trims to each
    rank's own size): the adapter registers its states without a torchmetrics reduction, and torchmetrics sends
    such a list item by item, one collective per item, which deadlocks where ranks hold different numbers of
    blocks. Each rank's tensor comes back in rank order, for the contract's merge."""
    for name, want in spec.items():
        value = getattr(metric, name)
        if want.reduce == "cat" and isinstance(value, list):
            setattr(metric, name, [want.cat_padded(value).to(metric.device)])  # a tensor to gather
    kwargs: dict[str, Any] = {"process_group": process_group}
    if dist_sync_fn is not None:
        kwargs["dist_sync_fn"] = dist_sync_fn
    base_sync(**kwargs)


def plot(metric: torchmetrics.Metric, val: Any, ax: Any) -> Any:
    """``metric.plot(val, ax)`` as torchmetrics' own metrics draw it (within the metric's bounds)."""
    return metric._plot(val, ax)
