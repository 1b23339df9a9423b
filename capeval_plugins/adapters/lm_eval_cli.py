"""``capeval-lm-eval``: lm-eval's command line with capeval metrics registered, the shipped caption tasks on the
include path, and every task checked before the model generates anything.

Imports nothing of lm-eval at module level, so ``capeval-lm-eval --help`` prints help (exit 0) wherever the
package is installed, and without lm-eval every other use says in one line which extra to install (exit 2).
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

from capeval_plugins.core.messages import install_extra

PROG = "capeval-lm-eval"
ABOUT = (f"{PROG}: lm-eval's command line with every capeval metric registered (as <name> and capeval/<name>), "
         "the shipped capeval_caption task on the include path, and each task's capeval metrics checked before "
         "generation. lm-eval's own options follow.")
TASKS_DIR = Path(__file__).resolve().parent.parent / "lm_eval_tasks"


def _wants_help(args: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in args)


def _option(args: list[str], name: str, default: str) -> str:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return default


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_model_backend(args: list[str]) -> None:
    """Import the lm-eval model class ``--model`` names before any work: a backend whose packages are missing
    (``hf`` and ``hf-multimodal`` need accelerate, lm-eval's own ``hf`` extra) ends in one line, exit 2."""
    import lm_eval.api.registry as lm_registry

    name = _option(args, "--model", "hf")
    try:
        lm_registry.get_model(name)
    except ModuleNotFoundError as err:
        missing = err.name or str(err)
        hint = install_extra("accelerate") if missing == "accelerate" else f"pip install {missing}"
        _fail(f"lm-eval's --model {name} needs {missing}, which is not installed: {hint}")
    except ValueError:
        pass  # an unknown model name: lm-eval's own message follows


def main(argv: list[str] | None = None) -> None:
    """lm-eval's CLI with the plugin registered, the shipped caption tasks on the include path (beside any
    ``--include_path`` given), and :func:`~capeval_plugins.adapters.lm_eval.check_tasks` run on the tasks
    lm-eval built before it generates anything; problems found there are one line, exit 2."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as err:
        if _wants_help(args):
            print(f"usage: {PROG} [lm-eval options]\n\n{ABOUT}\n\nlm-eval is not installed ({err}): "
                  f"{install_extra('lm-eval')}")
            raise SystemExit(0) from None
        _fail(f"needs lm-eval, which is not installed: {install_extra('lm-eval')}")
    if _wants_help(args):
        print(ABOUT + "\n")
    else:
        check_model_backend(args)

    import lm_eval.evaluator
    from lm_eval.tasks.manager import TaskManager

    from capeval_plugins import preflight
    from capeval_plugins.adapters import lm_eval as adapter
    from capeval_plugins.inputs import InputError

    adapter.register()
    original_init, original_evaluate = TaskManager.__init__, lm_eval.evaluator.evaluate

    @functools.wraps(original_init)
    def init_with_capeval_tasks(self, *args, include_path=None, **kwargs):
        paths = [] if include_path is None else list(include_path) if isinstance(include_path, (list, tuple)) else [include_path]
        return original_init(self, *args, include_path=[*paths, TASKS_DIR], **kwargs)

    @functools.wraps(original_evaluate)
    def evaluate_checked(lm, task_dict, *args, **kwargs):
        adapter.check_tasks(task_dict)
        return original_evaluate(lm, task_dict, *args, **kwargs)

    TaskManager.__init__ = init_with_capeval_tasks
    lm_eval.evaluator.evaluate = evaluate_checked
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except (preflight.RequirementError, InputError) as err:  # found when the tasks are built, before generation
        _fail(getattr(err, "cli_message", None) or (err.args[0] if err.args else str(err)))
    finally:
        TaskManager.__init__, lm_eval.evaluator.evaluate = original_init, original_evaluate


if __name__ == "__main__":
    main()
