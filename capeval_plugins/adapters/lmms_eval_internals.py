"""Everything the lmms-eval adapter does with lmms-eval's internals, in one place.

lmms-eval builds a plain YAML task as a ``ConfigurableTask`` for simple models and a ``ConfigurableMessagesTask``
for chat models, but builds a ``class:`` task as that class whatever the model, and passes the kind it is loading
(``task_type``) down its loader without handing it to the class. :func:`loading_task_type` reads it from the
loader's frame (``TaskManager._load_individual_task_or_group``, its local ``task_type``): there is no public way.
:func:`check` (run when the adapter is imported) says clearly when that loader moved, instead of every chat
model silently getting the simple task.
"""
from __future__ import annotations

import inspect
import sys

LIBRARY = "lmms-eval"
# The versions these internals were read and tested on (requirements/lmms.txt pins one; tests/test_internals.py
# fails when a pinned version is not listed here: read the internals again).
CHECKED_ON = ("0.7.3",)
LOADER = "_load_individual_task_or_group"


def check() -> None:
    from importlib.metadata import version

    from lmms_eval.tasks import TaskManager

    from capeval_plugins.core.messages import InternalsMoved

    from lmms_eval.api.task import ConfigurableTask

    from capeval_plugins.adapters.lm_eval_internals import check_task_class

    found = version("lmms_eval")
    loader = getattr(TaskManager, LOADER, None)
    if loader is None or "task_type" not in inspect.signature(loader).parameters:
        raise InternalsMoved(LIBRARY, found, CHECKED_ON,
                             f"no TaskManager.{LOADER}(..., task_type) to learn which kind of task it loads")
    check_task_class(ConfigurableTask, LIBRARY, found, CHECKED_ON)


def loading_task_type() -> str:
    """``"chat"`` or ``"simple"``: the task kind of the lmms-eval ``TaskManager`` call building a task now (read
    from its loader's frame); ``"simple"`` outside one."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == LOADER and "task_type" in frame.f_locals:
            return frame.f_locals["task_type"]
        frame = frame.f_back
    return "simple"
