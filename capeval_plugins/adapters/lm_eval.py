"""lm-eval adapter, generic over the contract.

``register()`` (idempotent, run on import of this module) adds every registered capeval metric to lm-eval's
metric and aggregation registries without removing the built-ins: under its own name where lm-eval has no
metric of that name, and always as ``capeval/<name>``. A metric's per-document value is a
:class:`CaptionItem`; the aggregation scores the whole corpus in one batched call (so corpus metrics such
as MID work too). Beside each metric ``<name>`` the results carry ``<name>_n_skipped``: how many documents
the metric could not score (a missing image, text no tokenizer takes) and left out of its number. An empty
generation is not one of them: it is the model's answer and is scored as the reference implementation
scores it.

Image metrics need the image, which only a task can supply: the shipped ``capeval_caption`` task uses
:class:`CaptionTask`, whose ``process_results`` emits items for every metric in its ``metric_list`` (with
per-metric options such as ``model:`` taken from that list, or from ``--metadata '{"metrics": {name:
options}}'``, which replaces the list), beside lm-eval's own metrics of the list (``bleu``, ...).
:func:`check_tasks` says before generation whether every capeval metric of a task can be scored there
(``capeval-lm-eval``, :mod:`capeval_plugins.adapters.lm_eval_cli`, runs it on every task).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple

from capeval_plugins import preflight, registry
from capeval_plugins.adapters.harness import (capeval_name, score_documents, skip_count_name, split_metric_list,
                                              reference_list, warn_skipped, with_default_policy)
from capeval_plugins.core.messages import install_extra, require
from capeval_plugins.inputs import InputError
from capeval_plugins.options import built

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
    metrics), the generated caption, the references and (in a plain lm-eval task) the options written beside
    the metric in its ``metric_list`` entry, as sorted ``(key, value)`` pairs."""

    image: Any
    caption: str
    references: list[str] | None
    options: tuple = ()


class SkipCount(NamedTuple):
    """The per-document value of ``<name>_n_skipped``: the document's item, so the count's aggregation finds
    the scoring it reports on."""

    item: CaptionItem


# The latest result of each (metric, options, corpus): a metric's score and its skip count are two
# aggregations of one scoring.
_scored: dict[tuple, Any] = {}


def _corpus_key(items: list[CaptionItem]) -> tuple:
    return tuple((_image_key(it.image), it.caption, tuple(it.references or ())) for it in items)


def _image_key(image: Any) -> Any:
    """A path with its file's version (a file written again is another image); an image given decoded by its
    pixels (items gathered from other ranks are copies)."""
    if image is None:
        return image
    if isinstance(image, str):
        from capeval_plugins.digests import files_stamp

        return image, files_stamp(image)
    from capeval_plugins.image_sources import pixel_digest

    return ("pixels", pixel_digest(image))  # PIL, numpy, tensors: the contract's one identity of an image


def _options_key(options: Mapping[str, Any] | tuple) -> str:
    """Options as a key (values may be lists or mappings: ``max_memory``)."""
    return json.dumps(dict(options), sort_keys=True, default=repr)


def _options_of(items: list, options: Mapping[str, Any]) -> dict[str, Any]:
    """The aggregation's own options, else those the items carry (all the same: one metric_list entry)."""
    carried = {_options_key(it.options): it.options for it in items}
    if len(carried) > 1:
        raise ValueError(f"documents carry different options for one metric: {sorted(carried)}")
    return {**dict(next(iter(carried.values()), ())), **options}


def _files_of(options: Mapping[str, Any]) -> tuple:
    """The stamps of the local files and folders ``options`` name (a model rebuilt in place is another model)."""
    from capeval_plugins.digests import files_stamp

    return tuple(files_stamp(v) for v in options.values() if isinstance(v, str) and v and os.path.exists(v))


def _score(name: str, items: list[CaptionItem], options: Mapping[str, Any]) -> Any:
    key = (name, _options_key(options), _files_of(options), _corpus_key(items))
    if key not in _scored:
        metric = registry.load(name, **with_default_policy(options))
        images = [it.image for it in items] if metric.info.images != "never" else None
        if images is not None and any(img is None for img in images):
            raise ValueError(
                f"{name} scores images, but this task does not pass them: use the capeval_caption task "
                "(or a task built on capeval_plugins.adapters.lm_eval.CaptionTask)")
        _scored.clear()  # one corpus at a time
        _scored[key] = score_documents({name: metric}, images, [it.caption for it in items],
                                       [it.references for it in items], range(len(items)))[name]
    return _scored[key]


def aggregate(name: str, items: list, **options: Any) -> float:
    """Score all documents of a task at once: the corpus score, or for ``<name>_n_skipped`` items the number
    of documents left out (a document that cannot be scored is skipped by default, with a warning naming it;
    ``on_error: raise`` in the metric's ``metric_list`` entry stops instead). An empty generation is scored."""
    if items and isinstance(items[0], SkipCount):
        docs = [it.item for it in items]
        return float(len(_score(name, docs, _options_of(docs, options)).skipped))
    result = _score(name, items, _options_of(items, options))
    return float(warn_skipped(name, result, len(items)).score)


def _item_from_generation(lm_name: str, references: list, predictions: list, **options: Any) -> dict:
    """lm-eval's default ``process_results`` calls a metric with one gold target, one generation and the
    options of its ``metric_list`` entry; the item carries the options to the aggregation, and a second key
    carries the document to ``<name>_n_skipped``."""
    gold = references[0]
    refs = [gold] if isinstance(gold, str) else list(gold)
    item = CaptionItem(None, predictions[0], refs, tuple(sorted(options.items(), key=lambda kv: kv[0])))
    return {lm_name: item, skip_count_name(lm_name): SkipCount(item)}


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
                fn = functools.partial(_item_from_generation, lm_name)
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
    receives (image, generated caption, references), all of them are scored over the whole task in one pass,
    and lm-eval's own metrics of the list (``bleu``, ...) are computed as lm-eval computes them."""

    def __init__(self, config: dict | None = None, **kwargs: Any) -> None:
        register()
        config = {k: v for k, v in (config or {}).items() if k != "class"}
        chosen = (config.get("metadata") or {}).get("metrics")
        if chosen:  # --metadata '{"metrics": {"clipscore": {"model": "..."}}}' replaces metric_list
            chosen = {m: {} for m in chosen} if isinstance(chosen, (list, tuple)) else dict(chosen)
            unknown = [m for m in chosen if capeval_name(m) is None]
            if unknown:
                raise InputError(f"--metadata metrics: {', '.join(map(repr, unknown))} not registered with capeval "
                                 f"(registered: {', '.join(sorted(registry.metrics()))})")
            config["metric_list"] = [
                {"metric": m, "aggregation": f"capeval/{registry.canonical_name(m)}",
                 "higher_is_better": registry.get(m).info.higher_is_better, **(opts or {})}
                for m, opts in chosen.items()
            ]
        super().__init__(config=config, **kwargs)
        self._capeval_entries = split_metric_list(self.config.metric_list)[0]
        self._capeval_built: dict[str, Any] = {}
        self._capeval_scored: tuple[tuple, dict] | None = None
        for lm_name, name, options in self._capeval_entries:
            internals.add_task_metric(self, lm_name, functools.partial(self._capeval_aggregate, lm_name),
                                      registry.get(name).info.higher_is_better)
            internals.add_task_metric(self, skip_count_name(lm_name), functools.partial(self._capeval_skipped, lm_name),
                                      False)
            self._capeval_built[lm_name] = built(registry.get(name).cls, with_default_policy(options))
        check_tasks(self)

    def _capeval_names(self) -> set[str]:
        return {entry.harness_name for entry in self._capeval_entries}

    def process_results(self, doc: dict, results: list) -> dict:
        ours = self._capeval_names()
        others = [m for m in internals.task_metric_functions(self) if m not in ours]
        out: dict[str, Any] = {}
        if others or callable(self.config.process_results):  # lm-eval's own metrics, as lm-eval computes them
            with internals.task_metric_functions_limited(self, others):
                out = {k: v for k, v in super().process_results(doc, results).items() if k not in ours}
        image = doc.get("image_path") or self.doc_to_image(doc)
        if isinstance(image, list):
            image = image[0]
        # the document's "references" (every reference; the shipped task's doc_to_target gives the first only),
        # else what the task's doc_to_target gives
        refs = doc["references"] if "references" in doc else self.doc_to_target(doc)
        item = CaptionItem(image, results[0], reference_list(refs) or None)
        for lm_name in self._capeval_names():
            out[lm_name] = item
            out[skip_count_name(lm_name)] = SkipCount(item)
        return out

    def _capeval_results(self, items: list[CaptionItem]) -> dict:
        """Every capeval metric of the task over the task's documents, in one runner pass (images decoded
        once, a backbone shared by several metrics loaded once); kept for the other aggregations."""
        key = (_corpus_key(items), tuple(_files_of(dataclasses.asdict(m.config)) for m in self._capeval_built.values()))
        if self._capeval_scored is None or self._capeval_scored[0] != key:
            metrics = self._capeval_built
            images = [it.image for it in items] if any(m.info.images != "never" for m in metrics.values()) else None
            scored = score_documents(metrics, images, [it.caption for it in items], [it.references for it in items],
                                     range(len(items)), describe=lambda i: f"{self.config.task} document {i}")
            self._capeval_scored = (key, scored)
        return self._capeval_scored[1]

    def _capeval_aggregate(self, lm_name: str, items: list[CaptionItem]) -> float:
        return float(warn_skipped(lm_name, self._capeval_results(items)[lm_name], len(items)).score)

    def _capeval_skipped(self, lm_name: str, items: list[SkipCount]) -> float:
        return float(len(self._capeval_results([it.item for it in items])[lm_name].skipped))


# ---------------------------------------------------------------------------------------------------------
# Before generation: can every capeval metric of a task be scored there?

def _walk_tasks(obj: Any) -> Iterator[Any]:
    from lm_eval.api.task import Task

    if isinstance(obj, Task):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _walk_tasks(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _walk_tasks(value)
    elif hasattr(obj, "task"):  # lm-eval's TaskOutput
        yield from _walk_tasks(obj.task)


def check_tasks(tasks: Any) -> None:
    """Refuse, before the model generates anything, a task where a capeval metric of its ``metric_list``
    could not be scored: an image metric in a task that passes no image, a ``doc_to_target`` that gives a list
    (lm-eval would then call the metric once per target and keep "any true"), a metric of the list that neither
    lm-eval nor evaluate knows; and check what the capeval metrics need (models, Java, extras). ``tasks``: a
    task, or lm-eval's task dict (any nesting of tasks)."""
    problems, built = [], {}
    for task in _walk_tasks(tasks):
        name = getattr(task.config, "task", type(task).__name__)
        ours, _ = split_metric_list(getattr(task.config, "metric_list", None))
        if not ours:
            continue
        caption_task = isinstance(task, CaptionTask)
        if task.OUTPUT_TYPE != "generate_until":
            problems.append(f"task {name}: capeval metrics score generated captions, but its output_type is "
                            f"{task.OUTPUT_TYPE!r} (use generate_until)")
        for lm_name, fn in internals.task_metric_functions(task).items():
            if fn is None and task.config.process_results is None:
                problems.append(f"task {name}: metric {lm_name!r} is neither an lm-eval metric nor an evaluate "
                                "module")
        for entry in ours:
            metric = task._capeval_built[entry.harness_name] if caption_task else \
                registry.load(entry.name, **with_default_policy(entry.options))
            built[entry.harness_name if entry.harness_name not in built else f"{entry.harness_name} (task {name})"] = metric
            if caption_task:
                continue
            if metric.info.images == "always":
                problems.append(f"task {name}: {entry.harness_name} scores images, which this task does not pass: "
                                "use `class: !function capeval_plugins.adapters.lm_eval.CaptionTask` (or include "
                                "the shipped capeval_caption task)")
            if getattr(task, "multiple_target", 0) and task.config.process_results is None:
                problems.append(f"task {name}: doc_to_target gives a list, so lm-eval would score "
                                f"{entry.harness_name} once per target and keep only whether any was true: use "
                                "CaptionTask (it passes every reference), or a doc_to_target giving one string")
    if problems:
        raise InputError("; ".join(problems))
    preflight.check(built)  # the metrics' models, Java and extras


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
    """``capeval-lm-eval``: lm-eval's command line with capeval metrics registered, the shipped caption tasks
    on the include path (in addition to any ``--include_path`` given), and :func:`check_tasks` run on the tasks
    lm-eval built before it generates anything; problems found there are one line, exit 2."""
    import lm_eval.evaluator
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.tasks.manager import TaskManager

    args = sys.argv[1:] if argv is None else list(argv)
    if not any(a in ("-h", "--help") for a in args):
        check_model_backend(args)
    register()
    internals.add_include_path(TaskManager, TASKS_DIR)
    internals.check_before_evaluate(lm_eval.evaluator, check_tasks)
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except (preflight.RequirementError, InputError) as err:  # found when the tasks are built, before generation
        message = getattr(err, "cli_message", None) or (err.args[0] if err.args else str(err))
        print(f"capeval-lm-eval: error: {message}", file=sys.stderr)
        sys.exit(2)


register()
