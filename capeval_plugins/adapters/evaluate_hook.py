"""Everything capeval-plugins does with Hugging Face ``evaluate``'s internals, in one place; and the start-up
hook that lets ``evaluate.load("<metric>")`` find registered metrics with no user import.

``capeval_plugins_evaluate.pth`` (installed at the site-packages root) calls :func:`install` when the
interpreter starts. That only adds a meta-path finder: nothing is imported until ``evaluate.loading`` is,
and then its ``evaluation_module_factory`` is wrapped so that names registered with capeval (plain, unless
they are canonical evaluate modules, or ``capeval/<name>``) resolve to a module built in memory, with no
network call, and ``CombinedEvaluations`` passes each module only the inputs it takes (see
:func:`patch_combine`). Everything else goes to evaluate unchanged. Any failure here leaves evaluate untouched.

evaluate has no public hook for these, so they are kept here and nowhere else, and :func:`check` says which one
moved on an evaluate whose internals differ from those of the versions in :data:`CHECKED_ON`:

* ``evaluate.loading.evaluation_module_factory(path, module_type, ...)`` returning an
  ``ImportableModule(module_path, hash)``: what ``evaluate.load`` resolves a name with;
* :data:`CANONICAL`: the modules evaluate's hub serves under plain names (never shadowed; no offline list of
  them exists);
* :func:`discard`: the writer, buffer, cache file and lock an ``EvaluationModule`` keeps between ``add_batch``
  and ``compute``.

Every interpreter pays for this file at start-up, so it imports nothing beyond ``sys``, ``os`` and
``importlib.machinery`` (no ``typing``, no ``importlib.abc``: they cost milliseconds), and the wheel installs
it as the top-level module ``capeval_plugins_evaluate_hook`` so the package itself is not imported either.
"""
import importlib.machinery
import os
import sys

TARGET = "evaluate.loading"
LIBRARY = "evaluate"
# The versions these internals were read and tested on (requirements/main.txt and requirements/lowest.txt pin
# one each; tests/test_internals.py fails when a pinned version is not listed here: read the internals again).
CHECKED_ON = ("0.4.0", "0.4.6")
# Canonical modules of the evaluate hub (metrics, comparisons, measurements) as of evaluate 0.4.6: never shadowed.
CANONICAL = frozenset(
    """accuracy bertscore bleu bleurt brier_score cer character charcut_mt chrf code_eval comet
    competition_math confusion_matrix coval cuad exact_match f1 fever frugalscore glue google_bleu indic_glue
    mae mahalanobis mape mase matthews_correlation mauve mean_iou meteor mse nist_mt pearsonr perplexity
    poseval precision r_squared recall rl_reliability roc_auc rouge sacrebleu sari seqeval smape spearmanr
    squad squad_v2 super_glue ter trec_eval wer wiki_split xnli xtreme_s
    mcnemar wilcoxon
    honest label_distribution regard text_duplicates toxicity word_count word_length""".split()
)
# What an EvaluationModule keeps between add_batch() and compute() (see discard).
MODULE_STATE = ("writer", "buf_writer", "cache_file_name", "filelock", "selected_feature_format")


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
    """``evaluate.combine([...])`` with modules that take different inputs. ``compute(images=...)``: evaluate
    hands every keyword to every module, so its own modules (``bleu``, ...) fail on an input only ours take; a
    keyword that is an input (feature) of some module of the combination goes only to the modules that take it,
    other keywords (compute-time options) still go to every module, as evaluate sends them. ``add`` and
    ``add_batch``: evaluate hands each module every input it declares, and fails on one the caller left out; an
    optional input of ours (``ids``, ``group_ids``, ``images`` of a reference-free call) is left out instead and
    filled by the module as when it is called alone. (Checked on evaluate 0.4.6: ``CombinedEvaluations.compute(
    predictions, references, **kwargs)``, ``add(prediction, reference, **kwargs)``, ``add_batch(predictions,
    references, **kwargs)``.)"""
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

    def add_batch(self, predictions=None, references=None, **kwargs):
        given = {"predictions": predictions, "references": references, **kwargs}
        for module in self.evaluation_modules:
            module.add_batch(**{name: given[name] for name in module._feature_names() if name in given})

    def add(self, prediction=None, reference=None, **kwargs):
        from capeval_plugins.adapters.hf_evaluate import SINGULAR

        for module in self.evaluation_modules:
            own = set(module._feature_names())  # a capeval module's add() takes its features' singular names too
            module.add(prediction=prediction, reference=reference,
                       **{k: v for k, v in kwargs.items() if k in own or k in SINGULAR and k + "s" in own})

    for name, wrapper in (("compute", compute), ("add_batch", add_batch), ("add", add)):
        wrapper._capeval_wrapped = True
        wrapper.__wrapped__ = getattr(combined, name)
        wrapper.__doc__ = getattr(combined, name).__doc__
        setattr(combined, name, wrapper)


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


# ---------------------------------------------------------------------------------------------------------
# Used by capeval_plugins.adapters.hf_evaluate (with evaluate imported)


def check() -> None:
    """Raise ``InternalsMoved`` (an ImportError) naming what differs from the checked versions."""
    import inspect

    import evaluate
    import evaluate.loading as loading

    from capeval_plugins.core.messages import InternalsMoved as moved

    version = evaluate.__version__
    factory = getattr(loading, "evaluation_module_factory", None)
    if factory is None:
        raise moved(LIBRARY, version, CHECKED_ON, "no evaluate.loading.evaluation_module_factory")
    params = list(inspect.signature(getattr(factory, "__wrapped__", factory)).parameters)
    if params[:2] != ["path", "module_type"]:
        raise moved(LIBRARY, version, CHECKED_ON, f"evaluation_module_factory takes {params[:2]}, not path, module_type")
    importable = getattr(loading, "ImportableModule", None)
    if importable is None or list(inspect.signature(importable).parameters)[:2] != ["module_path", "hash"]:
        raise moved(LIBRARY, version, CHECKED_ON, "no ImportableModule(module_path, hash) in evaluate.loading")
    names = {n for method in (evaluate.EvaluationModule.__init__, evaluate.EvaluationModule._init_writer)
             for n in method.__code__.co_names}  # the attributes they set, among others
    absent = [name for name in MODULE_STATE if name not in names]
    if absent:
        raise moved(LIBRARY, version, CHECKED_ON, f"EvaluationModule keeps no {', '.join(absent)}")


def discard(module, folder_of) -> None:
    """Drop the batches ``module`` (an ``EvaluationModule``) added so far: evaluate keeps them in a writer, and
    in a cache file under a lock, until compute() reads them. ``folder_of(path)`` opens the folder of the
    module's own cache file (capeval_plugins.files: a regular file, no link followed)."""
    writer, module.writer = getattr(module, "writer", None), None
    if writer is not None:
        try:
            writer.finalize()
        except Exception:  # nothing written yet: nothing to close
            pass
    module.buf_writer = None
    path, lock = getattr(module, "cache_file_name", None), getattr(module, "filelock", None)
    if path and os.path.exists(path):
        with folder_of(os.path.dirname(os.path.abspath(path))) as folder:
            folder.unlink(os.path.basename(path))
    if lock is not None:
        lock.release()
    module.cache_file_name, module.filelock, module.selected_feature_format = None, None, None
