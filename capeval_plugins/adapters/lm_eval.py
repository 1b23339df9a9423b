"""lm-eval adapter, generic over the contract.

``register()`` (idempotent, run on import of this module) adds every registered capeval metric to lm-eval's
metric and aggregation registries without removing the built-ins: under its own name where lm-eval has no
metric of that name, and always as ``capeval/<name>``. A metric's per-document value is a
:class:`CaptionItem`; the aggregation scores the whole corpus in one batched call (so corpus metrics such
as MID work too).

Image metrics need the image, which only a task can supply: the shipped ``capeval_caption`` task uses
:class:`CaptionTask`, whose ``process_results`` emits items for every metric in its ``metric_list`` (with
per-metric options such as ``model:`` taken from that list, or from ``--metadata '{"metrics": {name:
options}}'``, which replaces the list). ``capeval-lm-eval`` is lm-eval's CLI with the
plugin registered and the shipped tasks on the include path.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, NamedTuple

from capeval_plugins import preflight, registry
from capeval_plugins.adapters.harness import score_documents, split_metric_list, warn_skipped, with_default_policy
from capeval_plugins.core.messages import install_extra, require

# the ecosystem this adapter plugs into: without it, one line naming the extra that installs it
# (lm_eval.api.metrics first: it fills lm-eval's registries, so ours never replace its built-ins)
require("lm_eval.api.metrics", "lm-eval", "capeval_plugins.lm_eval")
import lm_eval.api.registry as lm_registry  # noqa: E402
from lm_eval.api.task import ConfigurableTask  # noqa: E402

from capeval_plugins.adapters import lm_eval_internals as internals  # noqa: E402  (lm-eval's internals, one place)

internals.check()  # lm-eval's internals used here are where they were on the versions checked

TASKS_DIR = Path(__file__).resolve().parent.parent / "lm_eval_tasks"


class CaptionItem(NamedTuple):
    """What a document contributes to a capeval metric: its image (a path or PIL image; None for text-only
    metrics), the generated caption and the references."""

    image: Any
    caption: str
    references: list[str] | None


def aggregate(name: str, items: list[CaptionItem], **options: Any) -> float:
    """Score all documents of a task at once; the corpus score. Documents that cannot be scored (an empty
    generation) are skipped by default, with a warning naming them by position and the count; the score is
    over the others (``on_error: raise`` in the metric's ``metric_list`` entry stops instead)."""
    metric = registry.load(name, **with_default_policy(options))
    info = metric.info
    images = [it.image for it in items] if info.images != "never" else None
    if images is not None and any(img is None for img in images):
        raise ValueError(
            f"{name} scores images, but this task does not pass them: use the capeval_caption task "
            "(or a task built on capeval_plugins.adapters.lm_eval.CaptionTask)"
        )
    scored = score_documents({name: metric}, images, [it.caption for it in items], [it.references for it in items],
                             range(len(items)))
    return float(warn_skipped(name, scored[name], len(items)).score)


def _item_from_generation(references: list, predictions: list) -> CaptionItem:
    """lm-eval's default ``process_results`` calls a metric with one gold target and one generation."""
    gold = references[0]
    refs = [gold] if isinstance(gold, str) else list(gold)
    return CaptionItem(None, predictions[0], refs)


def metric_names(name: str) -> list[str]:
    """lm-eval names of a capeval metric: its own (unless lm-eval already has one) and ``capeval/<name>``."""
    names = [f"capeval/{name}"]
    if name not in lm_registry.metric_registry or _is_ours(name):
        names.insert(0, name)
    return names


def _is_ours(lm_name: str) -> bool:
    try:
        return getattr(lm_registry.metric_registry.get(lm_name), "_capeval", False)
    except KeyError:
        return False


def register() -> list[str]:
    """Register every capeval metric with lm-eval (safe to call repeatedly); returns the lm-eval names."""
    registered = []
    for name, entry in registry.metrics().items():
        agg_name = f"capeval/{name}"
        if agg_name not in lm_registry.aggregation_registry:
            lm_registry.register_aggregation(agg_name)(functools.partial(aggregate, name))
        for lm_name in metric_names(name):
            if lm_name not in lm_registry.metric_registry:
                fn = functools.partial(_item_from_generation)
                fn._capeval = True  # type: ignore[attr-defined]
                lm_registry.register_metric(
                    metric=lm_name,
                    higher_is_better=entry.info.higher_is_better,
                    output_type="generate_until",
                    aggregation=agg_name,
                )(fn)
            registered.append(lm_name)
    return registered


class CaptionTask(ConfigurableTask):
    """A ``generate_until`` task whose documents carry an image: every capeval metric in ``metric_list``
    receives (image, generated caption, references) and is scored over the whole task in one call."""

    def __init__(self, config: dict | None = None, **kwargs: Any) -> None:
        register()
        config = {k: v for k, v in (config or {}).items() if k != "class"}
        chosen = (config.get("metadata") or {}).get("metrics")
        if chosen:  # --metadata '{"metrics": {"clipscore": {"model": "..."}}}' replaces metric_list
            chosen = {m: {} for m in chosen} if isinstance(chosen, (list, tuple)) else dict(chosen)
            config["metric_list"] = [
                {"metric": m, "aggregation": f"capeval/{registry.canonical_name(m)}",
                 "higher_is_better": registry.get(m).info.higher_is_better, **(opts or {})}
                for m, opts in chosen.items()
            ]
        super().__init__(config=config, **kwargs)
        self._capeval_metrics: dict[str, str] = {}
        built = {}
        for lm_name, name, options in split_metric_list(self.config.metric_list)[0]:
            self._capeval_metrics[lm_name] = name
            self._aggregation_list[lm_name] = functools.partial(aggregate, name, **options)
            self._higher_is_better[lm_name] = registry.get(name).info.higher_is_better
            built[lm_name] = registry.load(name, **with_default_policy(options))
        preflight.check(built)  # the metrics' models, Java and extras: before anything is generated

    def process_results(self, doc: dict, results: list) -> dict:
        out = super().process_results(doc, results) if self._other_metrics() else {}
        image = doc.get("image_path") or self.doc_to_image(doc)
        if isinstance(image, list):
            image = image[0]
        refs = doc.get("references")
        caption = results[0]
        for lm_name in self._capeval_metrics:
            out[lm_name] = CaptionItem(image, caption, list(refs) if refs else None)
        return out

    def _other_metrics(self) -> bool:
        return any(m not in self._capeval_metrics for m in self._metric_fn_list)


def tasks_dir() -> Path:
    return TASKS_DIR


def _option(args: list[str], name: str, default: str) -> str:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return default


def check_model_backend(args: list[str]) -> None:
    """Import the lm-eval model class ``--model`` names before any work: a backend whose packages are missing
    (``hf`` and ``hf-multimodal`` need accelerate, lm-eval's own ``hf`` extra) ends in one line, exit 2."""
    name = _option(args, "--model", "hf")
    try:
        lm_registry.get_model(name)
    except ModuleNotFoundError as err:
        missing = err.name or str(err)
        hint = install_extra("accelerate") if missing == "accelerate" else f"pip install {missing}"
        print(f"capeval-lm-eval: lm-eval's --model {name} needs {missing}, which is not installed: {hint}",
              file=sys.stderr)
        raise SystemExit(2) from None
    except ValueError:
        pass  # an unknown model name: lm-eval's own message follows


def main(argv: list[str] | None = None) -> None:
    """``capeval-lm-eval``: lm-eval's command line with capeval metrics registered and the shipped caption
    tasks on the include path (in addition to any ``--include_path`` given)."""
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.tasks.manager import TaskManager

    args = sys.argv[1:] if argv is None else list(argv)
    check_model_backend(args)
    register()
    internals.add_include_path(TaskManager, TASKS_DIR)
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except preflight.RequirementError as err:  # found when the task is built, before any generation
        print(f"capeval-lm-eval: error: {err}", file=sys.stderr)
        sys.exit(2)


register()
