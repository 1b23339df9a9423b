"""lmms-eval adapter, generic over the contract.

lmms-eval scores a task in two steps: ``process_results(doc, results)`` turns each document's generation into
one item per metric (on every rank, for that rank's documents), and each metric's aggregation turns the items
of the whole split, gathered on rank 0, into the task's number. :class:`CaptionTask`, named in a task YAML
through lmms-eval's own ``class: !function ...`` hook, adds every capeval metric of the task's ``metric_list``
(with the options written beside it) to that flow:

* ``process_results`` keeps what the task's own function returns (BLEU, CIDEr, ...) and adds, for each of our
  metrics, a small item: the document id, the generated caption and the references (text only: images never
  travel between ranks);
* beside each of our metrics ``<name>``, ``<name>_n_skipped`` counts the documents it could not score (an image
  that does not load, text no tokenizer takes) and left out of its number; an empty generation is the model's
  answer and is scored, as lmms-eval's own COCO metrics score it;
* the first of our aggregations on rank 0 scores every document of the split with **all** our metrics of the
  task in one runner pass (the images rank 0's ``doc_to_visual`` gave its model, kept; those of other ranks'
  documents through the same ``doc_to_visual``; each decoded once for every metric; one model load per
  backbone for the whole run); the other aggregations read that result. The documents are scored in id
  order, so a multi-process run scores exactly the corpus a one-process run scores.

``base_task: <name>`` extends an existing lmms-eval task (its YAML found among lmms-eval's tasks, read by
lmms-eval's own loader) instead of copying it: its prompts, generation settings and metrics stay, ours are
added. ``capeval_references`` names the documents' reference captions (a field name or a ``!function``;
default: the task's ``doc_to_target``). ``capeval_keep_visuals: false`` loads the images again at scoring
time instead of keeping them.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from capeval_plugins import preflight, registry
from capeval_plugins.adapters.harness import (MetricEntry, score_documents, skip_count_name, split_metric_list,
                                              reference_list, warn_skipped, with_default_policy)
from capeval_plugins.core.messages import require

# the ecosystem this adapter plugs into: without it, one line naming the extra that installs it
_task = require("lmms_eval.api.task", "lmms", "capeval_plugins.adapters.lmms_eval")
ConfigurableMessagesTask, ConfigurableTask = _task.ConfigurableMessagesTask, _task.ConfigurableTask
from capeval_plugins.adapters import lmms_eval_internals as internals  # noqa: E402  (lmms-eval's internals)
from capeval_plugins.adapters.lm_eval_internals import add_task_metric, task_metric_functions  # noqa: E402

internals.check()  # lmms-eval's internals used here are where they were on the versions checked

TASKS_DIR = Path(__file__).resolve().parent.parent / "lmms_eval_tasks"
DOC_ID = "_capeval_doc_id"  # added to the documents so process_results knows which document it scores


class CaptionItem(NamedTuple):
    """What one document contributes to a capeval metric (no image: rank 0 takes it from its own copy of
    the task's documents)."""

    doc_id: int
    caption: str
    references: list[str] | None


def tasks_dir() -> Path:
    """The shipped task YAMLs (pass as ``--include_path``)."""
    return TASKS_DIR


class CaptionTask:
    """``class: !function capeval_plugins.adapters.lmms_eval.CaptionTask`` in a task YAML.

    lmms-eval builds a plain YAML task as a ``ConfigurableTask`` for simple models and a
    ``ConfigurableMessagesTask`` for chat models, but builds a ``class:`` task as that class whatever the
    model; this factory builds the kind lmms-eval is loading tasks for, with our metrics added."""

    def __new__(cls, config: dict | None = None, **kwargs: Any) -> ConfigurableTask:
        return _task_class(internals.loading_task_type())(config=config, **kwargs)

    def __init__(self, config: dict | None = None, **kwargs: Any) -> None:  # signature read by lmms-eval
        pass


@functools.cache
def _task_class(task_type: str) -> type:
    base = ConfigurableMessagesTask if task_type == "chat" else ConfigurableTask
    return type(f"Capeval{base.__name__}", (_CapevalMixin, base), {"__module__": __name__})


class _CapevalMixin:
    """The capeval part of :class:`CaptionTask` (mixed into lmms-eval's task class)."""

    def __init__(self, config: dict | None = None, **kwargs: Any) -> None:
        config = _resolve_base(dict(config or {}))
        config.pop("class", None)
        references = config.pop("capeval_references", None)
        keep = config.pop("capeval_keep_visuals", True)
        ours, others = split_metric_list(config.get("metric_list"))
        if not ours:
            raise ValueError(f"task {config.get('task')!r}: no capeval metric in metric_list "
                             f"(registered: {sorted(registry.metrics())})")
        config["metric_list"] = others
        # Only rank 0 scores, so only rank 0 keeps what its model was shown (memory: its share of the split).
        self._capeval_keep_visuals = bool(keep) and int(os.environ.get("RANK", "0")) == 0
        self._capeval_visuals: dict[int, Any] = {}
        super().__init__(config=config, **kwargs)
        self._capeval_entries: list[MetricEntry] = ours
        self._capeval_references = references
        self._capeval_metrics: dict[str, Any] | None = None
        self._capeval_scored: tuple[Any, dict] | None = None
        for entry in ours:
            add_task_metric(self, entry.harness_name, functools.partial(self._capeval_aggregate, entry.harness_name),
                            registry.get(entry.name).info.higher_is_better)
            # documents the metric left out, in the results table
            add_task_metric(self, skip_count_name(entry.harness_name),
                            functools.partial(self._capeval_skipped, entry.harness_name), False)
        preflight.check(self._metrics())  # the metrics' models, Java and extras: before anything is generated
        self._number_documents()

    # -- documents ---------------------------------------------------------------------------------------

    def _number_documents(self) -> None:
        """Give every document of the evaluated split its id, in both copies lmms-eval hands to
        process_results (with media or without)."""
        split = self.config.test_split if self.has_test_docs() else self.config.validation_split
        for dataset in {id(d): d for d in (self.dataset, self.dataset_no_image)}.values():
            docs = dataset[split]
            if DOC_ID not in docs.column_names:
                dataset[split] = docs.add_column(DOC_ID, list(range(len(docs))))
        self.task_docs = self.dataset[split]

    def _references(self, doc: dict) -> list[str] | None:
        how = self._capeval_references
        return reference_list(how(doc) if callable(how) else doc[how] if isinstance(how, str) else self.doc_to_target(doc))

    def doc_to_visual(self, doc: dict) -> Any:
        """The task's own ``doc_to_visual``; on rank 0, what it gave the model is kept for scoring, so the
        metrics take the images the task already loaded instead of loading them again."""
        visuals = super().doc_to_visual(doc)
        if self._capeval_keep_visuals and isinstance(doc, dict) and DOC_ID in doc:
            self._capeval_visuals[int(doc[DOC_ID])] = visuals
        return visuals

    def _image(self, doc_id: int) -> Any:
        visuals = self._capeval_visuals.pop(doc_id, None)
        if visuals is None:  # generated on another rank (or not kept): the task loads it
            visuals = super().doc_to_visual(self.eval_docs[doc_id])
        if isinstance(visuals, (list, tuple)):
            if len(visuals) != 1:
                raise ValueError(f"{self.config.task} document {doc_id}: doc_to_visual gave {len(visuals)} "
                                 "images; capeval metrics score one image (or one video) per caption")
            visuals = visuals[0]
        return visuals

    # -- lmms-eval hooks ---------------------------------------------------------------------------------

    def process_results(self, doc: dict, results: list, full_docs: Any = None) -> dict:
        has_own = callable(self.config.process_results) or bool(task_metric_functions(self))
        out = dict(super().process_results(doc, results, full_docs)) if has_own else {}
        caption = results[0] if results else ""
        if isinstance(caption, (list, tuple)):  # repeats: the first generation
            caption = caption[0] if caption else ""
        item = CaptionItem(int(doc[DOC_ID]), (caption or "").strip(), self._references(doc))
        for entry in self._capeval_entries:
            out[entry.harness_name] = item
            out[skip_count_name(entry.harness_name)] = item
        return out

    def _capeval_results(self, items: list) -> dict:
        """Every capeval metric of the task over the split, scored once (the first aggregation) and kept."""
        items = sorted(items, key=lambda it: it.doc_id)
        key = tuple((it.doc_id, it.caption) for it in items)
        if self._capeval_scored is None or self._capeval_scored[0] != key:
            self._capeval_scored = (key, self._score(items))
        return self._capeval_scored[1]

    def _capeval_aggregate(self, harness_name: str, items: list) -> float:
        return float(warn_skipped(harness_name, self._capeval_results(items)[harness_name], len(items)).score)

    def _capeval_skipped(self, harness_name: str, items: list) -> float:
        """``<metric>_n_skipped``: how many documents the metric could not score and left out of its number."""
        return float(len(self._capeval_results(items)[harness_name].skipped))

    def _score(self, items: list[CaptionItem]) -> dict:
        metrics = self._metrics()
        needs_images = any(m.info.images != "never" for m in metrics.values())
        images = [self._image(it.doc_id) for it in items] if needs_images else None
        task = self.config.task
        return score_documents(metrics, images, [it.caption for it in items], [it.references for it in items],
                               [it.doc_id for it in items], describe=lambda i: f"{task} document {i}")

    def _metrics(self) -> dict[str, Any]:
        """Our metrics, built once per task (a backbone shared by several loads once)."""
        if self._capeval_metrics is None:
            self._capeval_metrics = {e.harness_name: registry.load(e.name, **_on_device(e.name, with_default_policy(e.options)))
                                     for e in self._capeval_entries}
        return self._capeval_metrics


def _on_device(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The metric's options, on this process's accelerator where the task does not say otherwise (under
    ``accelerate launch`` each process's current CUDA device; rank 0 aggregates)."""
    import dataclasses

    import torch

    options = dict(options)
    fields = {f.name for f in dataclasses.fields(registry.get(name).cls.Config)}
    placed = options.get("device") is not None or "device_map" in options
    if "device" in fields and not placed and torch.cuda.is_available():
        options["device"] = f"cuda:{torch.cuda.current_device()}"
    return options


def _resolve_base(config: dict) -> dict:
    """``base_task: <name>``: the named lmms-eval task's config, with this YAML's keys on top and its
    metric_list extended (not replaced) by this one's."""
    base_name = config.pop("base_task", None)
    if not base_name:
        return config
    base = _base_config(base_name)
    mine = config.get("metric_list") or []
    names = {m.get("metric") for m in mine}
    merged = {**base, **config}
    merged["metric_list"] = [m for m in base.get("metric_list") or [] if m.get("metric") not in names] + list(mine)
    return merged


def _base_config(name: str) -> dict:
    """The config of lmms-eval's task ``name``: its YAML, includes and ``!function`` resolved by lmms-eval."""
    import lmms_eval.tasks
    from lmms_eval.utils import load_yaml_config

    for path in sorted(Path(lmms_eval.tasks.__file__).parent.rglob("*.yaml")):
        if name not in path.read_text(errors="replace"):  # cheap filter before parsing
            continue
        if load_yaml_config(str(path), mode="simple").get("task") == name:
            base = load_yaml_config(str(path), mode="full")
            if "class" in base:
                raise ValueError(f"base_task {name!r} is a class-based task; include its YAML instead")
            return base
    raise ValueError(f"base_task {name!r} is not one of lmms-eval's tasks")


__all__ = ["CaptionItem", "CaptionTask", "tasks_dir"]
