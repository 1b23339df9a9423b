"""What the lm-eval and lmms-eval adapters share: finding capeval metrics (and their options) in a task's
``metric_list``, and scoring a task's documents with all of them in one pass through the runner."""
from __future__ import annotations

import warnings
from typing import Any, Mapping, NamedTuple, Sequence

from capeval_plugins import registry

# Keys of a metric_list entry that belong to the harness; every other key is an option of the metric.
HARNESS_KEYS = ("metric", "aggregation", "higher_is_better", "hf_evaluate")

# The per-document policy of an aggregation unless a task's metric_list says otherwise: a document that cannot be
# scored (its image is missing or does not decode, its generation holds text no tokenizer takes) costs that
# document, not the whole evaluation, and is counted in the results (``<metric>_n_skipped``). An empty generation
# is not such a document: it is the model's answer, scored as the reference implementation scores it.
DEFAULT_ON_ERROR = "skip"


def skip_count_name(harness_name: str) -> str:
    """The results key that counts the documents a metric left out: ``clipscore_n_skipped``."""
    return f"{harness_name}_n_skipped"


def with_default_policy(options: Mapping[str, Any]) -> dict[str, Any]:
    """A metric_list entry's options with the harness default ``on_error`` where the entry sets none."""
    return {"on_error": DEFAULT_ON_ERROR, **options}


class MetricEntry(NamedTuple):
    """A capeval metric named in a task's metric_list: the harness's name for it (``clipscore`` or
    ``capeval/clipscore``), the registered name, and the options written beside it."""

    harness_name: str
    name: str
    options: dict[str, Any]


def capeval_name(harness_name: Any) -> str | None:
    """The registered capeval metric a metric_list name refers to, or None if it is not one of ours."""
    if not isinstance(harness_name, str):
        return None
    name = registry.canonical_name(harness_name)
    return name if name in registry.metrics() else None


def split_metric_list(metric_list: Sequence[Mapping[str, Any]] | None) -> tuple[list[MetricEntry], list[dict]]:
    """Our metrics (with their options) and the harness's own entries, each in their order."""
    ours, others = [], []
    for entry in metric_list or []:
        name = capeval_name(entry.get("metric"))
        if name is None:
            others.append(dict(entry))
        else:
            options = {k: v for k, v in entry.items() if k not in HARNESS_KEYS}
            ours.append(MetricEntry(entry["metric"], name, options))
    return ours, others


def reference_list(refs: Any) -> list | None:
    """A document's references as the metrics take them: one string is one reference (``list`` of it would be
    its characters), a list, tuple or array its items as they are, anything else one item (the metrics' own
    checks refuse what is not text, naming the document)."""
    if refs is None:
        return None
    if isinstance(refs, (list, tuple)) or hasattr(refs, "tolist"):
        return list(refs)
    return [refs]


def score_documents(metrics: Mapping[str, Any], images: Sequence[Any] | None, captions: Sequence[str],
                    references: Sequence[Any] | None, ids: Sequence[int], describe=None) -> dict:
    """Score one task's documents with every metric at once (images decoded once, shared backbones loaded
    once); errors name the task's own document ids. ``metrics``: harness name -> Metric."""
    from capeval_plugins import runner

    needs_images = any(m.info.images != "never" for m in metrics.values())
    needs_refs = any(m.uses_references() for m in metrics.values())
    if references is not None and all(not r for r in references):
        references = None
    return runner.score_many(dict(metrics), images if needs_images else None, list(captions),
                             references if needs_refs else None, ids=list(ids), describe=describe)


def warn_skipped(name: str, result: Any, n_documents: int) -> Any:
    """Warn, naming up to five documents and the count, when ``result`` left some documents out (a per-sample
    ``on_error: skip``); the corpus score is then over the others. Returns ``result``."""
    if result.skipped:
        shown = "; ".join(f"document {i}: {why}" for i, why in sorted(result.skipped.items())[:5])
        more = "; ..." if len(result.skipped) > 5 else ""
        warnings.warn(f"{name}: {len(result.skipped)} of {n_documents} documents not scored ({shown}{more}); the "
                      f"score is over the other {n_documents - len(result.skipped)} (on_error: raise in metric_list "
                      "stops instead)", stacklevel=3)
    return result
