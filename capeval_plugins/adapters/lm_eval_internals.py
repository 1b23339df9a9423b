"""Everything the lm-eval adapter (and the lmms-eval one, whose tasks descend from lm-eval's design) does with
a harness's internals, in one place.

* ``TaskManager.__init__(..., include_path=...)``: ``capeval-lm-eval`` puts the shipped caption tasks on the
  include path of every task manager lm-eval's CLI builds (its ``--include_path`` takes one folder, the user's);
* ``lm_eval.evaluator.evaluate(lm, task_dict, ...)``: ``capeval-lm-eval`` checks the tasks lm-eval's CLI built
  (their capeval metrics, options and documents) there, before the model generates anything;
* ``ConfigurableTask._aggregation_list``, ``._higher_is_better``, ``._metric_fn_list``: a task's metrics, which
  a capeval task extends with its own (lm-eval reads them there; there is no public setter).

:func:`check` (run when the adapter is imported) says clearly which moved on a version whose internals differ
from those of the versions in :data:`CHECKED_ON`, instead of tasks that silently lose their metrics.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from pathlib import Path
from typing import Any, Callable, Iterator

from capeval_plugins.core.messages import InternalsMoved

LIBRARY = "lm-eval"
# The versions these internals were read and tested on (requirements/main.txt and requirements/lowest.txt pin
# one each; tests/test_internals.py fails when a pinned version is not listed here: read the internals again).
CHECKED_ON = ("0.4.12", "0.4.13")
TASK_ATTRIBUTES = ("_aggregation_list", "_higher_is_better", "_metric_fn_list")


def check_task_class(task_class: type, library: str, version: str, checked_on: tuple[str, ...]) -> None:
    """``task_class`` (its methods, or a base's) keeps the metric tables a capeval task extends."""
    names = {n for c in task_class.__mro__ for f in vars(c).values() if inspect.isfunction(f)
             for n in f.__code__.co_names}  # the attributes its methods use, among other names
    absent = [name for name in TASK_ATTRIBUTES if name not in names]
    if absent:
        raise InternalsMoved(library, version, checked_on, f"{task_class.__name__} keeps no {', '.join(absent)}")


def check() -> None:
    from importlib.metadata import version

    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks import TaskManager

    found = version("lm_eval")
    import lm_eval.evaluator

    if "task_dict" not in inspect.signature(lm_eval.evaluator.evaluate).parameters:
        raise InternalsMoved(LIBRARY, found, CHECKED_ON, "lm_eval.evaluator.evaluate takes no task_dict")
    if "include_path" not in inspect.signature(TaskManager.__init__).parameters:
        raise InternalsMoved(LIBRARY, found, CHECKED_ON, "TaskManager.__init__ takes no include_path")
    check_task_class(ConfigurableTask, LIBRARY, found, CHECKED_ON)


def add_include_path(task_manager: type, folder: Path) -> None:
    """Every ``task_manager(...)`` built from now on also looks in ``folder`` (after the user's paths)."""
    original = task_manager.__init__
    if getattr(original, "_capeval_folder", None) == folder:
        return

    @functools.wraps(original)
    def init_with_capeval_tasks(self: Any, *args: Any, include_path: Any = None, **kwargs: Any) -> None:
        paths = [] if include_path is None else list(include_path) if isinstance(include_path, (list, tuple)) else [include_path]
        return original(self, *args, include_path=[*paths, folder], **kwargs)

    init_with_capeval_tasks._capeval_folder = folder  # type: ignore[attr-defined]
    task_manager.__init__ = init_with_capeval_tasks


def check_before_evaluate(evaluator: Any, check: Any) -> None:
    """``evaluator.evaluate(lm, task_dict, ...)`` (what lm-eval's CLI calls once its tasks are built) runs
    ``check(task_dict)`` first, so a task's problems are found before any generation."""
    original = evaluator.evaluate
    if getattr(original, "_capeval_check", None) is check:
        return

    @functools.wraps(original)
    def evaluate_checked(lm: Any, task_dict: Any, *args: Any, **kwargs: Any) -> Any:
        check(task_dict)
        return original(lm, task_dict, *args, **kwargs)

    evaluate_checked._capeval_check = check  # type: ignore[attr-defined]
    evaluator.evaluate = evaluate_checked


def add_task_metric(task: Any, name: str, aggregate: Callable, higher_is_better: bool) -> None:
    """Give ``task`` (an lm-eval or lmms-eval task) the metric ``name``, aggregated by ``aggregate`` (lm-eval reads
    a task's aggregations and directions from these tables; there is no public setter)."""
    task._aggregation_list[name] = aggregate
    task._higher_is_better[name] = higher_is_better


def task_metric_functions(task: Any) -> dict[str, Any]:
    """The task's per-document metric functions, by the names its metric list gives them."""
    return task._metric_fn_list


@contextlib.contextmanager
def task_metric_functions_limited(task: Any, names: Any) -> Iterator[None]:
    """Within the block, ``task`` computes only the metrics ``names`` of its own per-document functions (lm-eval's
    ``process_results`` runs every function it holds)."""
    kept = task._metric_fn_list
    task._metric_fn_list = {m: fn for m, fn in kept.items() if m in names}
    try:
        yield
    finally:
        task._metric_fn_list = kept
