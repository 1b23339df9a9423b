"""Start-up hook that lets ``evaluate.load("<metric>")`` find registered metrics with no user import.

``capeval_plugins_evaluate.pth`` (installed at the site-packages root) calls :func:`install` when the
interpreter starts. That only adds a meta-path finder: nothing is imported until ``evaluate.loading`` is,
and then its ``evaluation_module_factory`` is wrapped so that names registered with capeval (plain, unless
they are canonical evaluate modules, or ``capeval/<name>``) resolve to a module built in memory, with no
network call, and ``CombinedEvaluations.compute`` passes each module only the inputs it takes (see
:func:`patch_combine`). Everything else goes to evaluate unchanged. Any failure here leaves evaluate untouched.

Every interpreter pays for this file at start-up, so it imports nothing beyond ``sys``, ``os`` and
``importlib.machinery`` (no ``typing``, no ``importlib.abc``: they cost milliseconds), and the wheel installs
it as the top-level module ``capeval_plugins_evaluate_hook`` so the package itself is not imported either.
"""
import importlib.machinery
import os
import sys

TARGET = "evaluate.loading"


def install() -> None:
    module = sys.modules.get(TARGET)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def patch(loading) -> None:
    original = loading.evaluation_module_factory
    if getattr(original, "_capeval_wrapped", False):
        return

    def evaluation_module_factory(path, module_type=None, *args, **kwargs):
        found = _capeval_module(path, module_type)
        if found is not None:
            return found
        return original(path, module_type, *args, **kwargs)

    evaluation_module_factory._capeval_wrapped = True
    evaluation_module_factory.__wrapped__ = original
    evaluation_module_factory.__doc__ = original.__doc__
    loading.evaluation_module_factory = evaluation_module_factory
    module = sys.modules.get("evaluate.module")  # imported by evaluate.loading
    if module is not None:
        patch_combine(module.CombinedEvaluations)


def patch_combine(combined) -> None:
    """``evaluate.combine([...]).compute(images=...)``: evaluate hands every keyword to every module, so its own
    modules (``bleu``, ...) fail on an input only ours take. A keyword that is an input (feature) of some module
    of the combination goes only to the modules that take it; other keywords (compute-time options) still go
    to every module, as evaluate sends them. ``add``/``add_batch`` already pass each module its own inputs.
    (Checked on evaluate 0.4.6: ``CombinedEvaluations.compute(predictions, references, **kwargs)``.)"""
    original = combined.compute
    if getattr(original, "_capeval_wrapped", False):
        return

    def compute(self, predictions=None, references=None, **kwargs):
        inputs = {name for m in self.evaluation_modules for name in m._feature_names()}
        results = []
        for module in self.evaluation_modules:
            own = set(module._feature_names())
            batch = {k: v for k, v in kwargs.items() if k not in inputs or k in own}
            results.append(module.compute(predictions=predictions, references=references, **batch))
        return self._merge_results(results)

    compute._capeval_wrapped = True
    compute.__wrapped__ = original
    compute.__doc__ = original.__doc__
    combined.compute = compute


def _is_local(path: str) -> bool:
    """evaluate's own rule: a local script or a folder holding ``<name>/<name>.py`` wins."""
    base = os.path.basename(path.rstrip("/"))
    return os.path.isfile(path) or os.path.isfile(os.path.join(path, base + ".py"))


def _capeval_module(path, module_type):
    if not isinstance(path, str) or module_type not in (None, "metric") or _is_local(path):
        return None
    if "/" in path and not path.startswith("capeval/"):
        return None
    from capeval_plugins.adapters import hf_evaluate  # imports evaluate, which is being used anyway

    return hf_evaluate.importable_module(path)


class _PatchingLoader:
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            patch(module)
        except Exception:  # never break evaluate itself
            pass

    def __getattr__(self, name):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._inner, name)


class _Finder:
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec
