"""What the adapters use of other libraries' internals lives in one module per library, each naming the versions
it was checked on; on a version whose internals moved, importing the adapter fails in one clear line (the library,
what moved, the versions checked), never an adapter that silently syncs, logs or resolves names wrongly."""
from __future__ import annotations

import re

import pytest
from conftest import ROOT
from packaging.utils import canonicalize_name

from capeval_plugins.core.messages import InternalsMoved


def pinned(distribution: str) -> dict[str, str]:
    """The version of ``distribution`` in every lock that pins it."""
    found = {}
    for lock in sorted((ROOT / "requirements").glob("*.txt")):
        for line in lock.read_text().splitlines():
            match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line.strip())
            if match and canonicalize_name(match.group(1)) == canonicalize_name(distribution):
                found[lock.stem] = match.group(2)
    return found


def internals(library: str):
    if library == "evaluate":
        pytest.importorskip("evaluate")
        from capeval_plugins.adapters import evaluate_hook as module
    elif library == "torchmetrics":
        pytest.importorskip("torchmetrics")
        from capeval_plugins.adapters import torchmetrics_internals as module
    elif library == "lm-eval":
        pytest.importorskip("lm_eval")
        from capeval_plugins.adapters import lm_eval_internals as module
    else:
        pytest.importorskip("lmms_eval")
        from capeval_plugins.adapters import lmms_eval_internals as module
    return module


# lmms-eval's checks run in .venv-lmms (make test's lmms part); the lowest-versions set has no lmms-eval
LIBRARIES = ["evaluate", "torchmetrics", "lm-eval", pytest.param("lmms-eval", marks=pytest.mark.lmms)]


@pytest.mark.parametrize("library", LIBRARIES)
def test_every_pinned_version_is_one_the_internals_were_checked_on(library):
    """`make lock` moving a library to a version nobody read the internals of fails here, naming it."""
    module = internals(library)
    assert module.LIBRARY == library
    unchecked = {lock: v for lock, v in pinned(library).items() if v not in module.CHECKED_ON}
    assert not unchecked, (f"{library} {unchecked} is pinned but its internals were checked on {module.CHECKED_ON}: "
                           f"read what {module.__name__} uses on it, then add the version")


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_installed_version_passes_its_check(library):
    internals(library).check()


def moved_message(err: InternalsMoved, library: str, module) -> None:
    message = str(err)
    assert message.startswith(f"capeval-plugins relies on {library} internals that {library} ")
    assert all(v in message for v in module.CHECKED_ON) and "\n" not in message


def test_evaluate_with_a_moved_factory_or_module_state_is_refused(monkeypatch):
    module = internals("evaluate")
    import evaluate
    import evaluate.loading as loading

    original = loading.evaluation_module_factory
    monkeypatch.setattr(loading, "evaluation_module_factory", lambda name, kind=None: None)
    with pytest.raises(InternalsMoved, match="evaluation_module_factory takes") as err:
        module.check()
    moved_message(err.value, "evaluate", module)
    monkeypatch.setattr(loading, "evaluation_module_factory", original)
    for method in ("__init__", "_init_writer"):  # a module that keeps its batches elsewhere
        monkeypatch.setattr(evaluate.EvaluationModule, method, lambda self, *args, **kwargs: None)
    with pytest.raises(InternalsMoved, match="EvaluationModule keeps no writer, buf_writer"):
        module.check()


def test_torchmetrics_with_a_moved_sync_is_refused(monkeypatch):
    module = internals("torchmetrics")
    import torchmetrics

    monkeypatch.setattr(torchmetrics.Metric, "_sync_dist", lambda self, fn=None, group=None: None)
    with pytest.raises(InternalsMoved, match="Metric._sync_dist takes no dist_sync_fn, process_group") as err:
        module.check()
    moved_message(err.value, "torchmetrics", module)


def test_lm_eval_with_a_moved_task_manager_or_task_tables_is_refused(monkeypatch):
    module = internals("lm-eval")
    from lm_eval.tasks import TaskManager

    original = TaskManager.__init__
    monkeypatch.setattr(TaskManager, "__init__", lambda self, verbosity="INFO", paths=None: None)
    with pytest.raises(InternalsMoved, match="TaskManager.__init__ takes no include_path") as err:
        module.check()
    moved_message(err.value, "lm-eval", module)
    monkeypatch.setattr(TaskManager, "__init__", original)

    class Renamed:  # a task class whose metric tables are kept under other names
        def __init__(self, config=None):
            self.metrics, self.aggregations = {}, {}

    with pytest.raises(InternalsMoved, match="Renamed keeps no _aggregation_list"):
        module.check_task_class(Renamed, "lm-eval", "9", module.CHECKED_ON)


@pytest.mark.lmms
def test_lmms_eval_with_a_moved_loader_is_refused(monkeypatch):
    module = internals("lmms-eval")
    from lmms_eval.tasks import TaskManager

    monkeypatch.setattr(TaskManager, module.LOADER, lambda self, task, parent_name=None: None)
    with pytest.raises(InternalsMoved, match="task_type") as err:
        module.check()
    moved_message(err.value, "lmms-eval", module)


def test_capeval_lm_eval_adds_its_tasks_through_the_one_patch():
    internals("lm-eval")
    from lm_eval.tasks import TaskManager

    from capeval_plugins.adapters import lm_eval_internals

    class Manager:
        def __init__(self, verbosity="INFO", include_path=None):
            self.include_path = include_path

    lm_eval_internals.add_include_path(Manager, ROOT)
    lm_eval_internals.add_include_path(Manager, ROOT)  # once
    assert Manager(include_path="mine").include_path == ["mine", ROOT]
    assert Manager().include_path == [ROOT]
    assert "include_path" in TaskManager.__init__.__code__.co_varnames


def test_torchmetrics_internals_read_no_private_attribute_that_has_a_public_spelling():
    """A private attribute is read only where torchmetrics has no public one: ``update_count`` (public since 1.0)
    and ``device`` replace ``_update_count`` and ``_device``. The methods the adapter overrides (``_sync_dist``,
    ``_apply``, ``_plot``) are hooks, not readings, and their public namesakes do other things."""
    import ast
    import inspect

    module = internals("torchmetrics")
    import torchmetrics

    read = {node.attr for node in ast.walk(ast.parse(inspect.getsource(module)))
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")}
    read |= set(module.ATTRIBUTES)
    public = sorted(name for name in read - set(module.METHODS) if hasattr(torchmetrics.Metric, name[1:]))
    assert not public, f"read through their private names although torchmetrics has public ones: {public}"
