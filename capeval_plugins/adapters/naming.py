"""Class names adapters expose for registered metrics, derived from ``MetricInfo.display_name``.

``CLIPScore`` -> torchmetrics-style ``CLIPScore``; pycocoevalcap-style (``Bleu``, ``Cider``) ``ClipScore``.
Either spelling, or the registry name, finds the metric.
"""
from __future__ import annotations

import re

from capeval_plugins import registry
from capeval_plugins.contract import MetricInfo

_WORDS = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")


def identifier(info: MetricInfo) -> str:
    """``display_name`` with non-identifier characters removed: "MSD-Score" -> "MSDScore"."""
    name = re.sub(r"\W", "", info.display_name)
    return name if name.isidentifier() else "Metric" + name


def coco_identifier(info: MetricInfo) -> str:
    """Capitalised words, as pycocoevalcap names its scorers: "CLIPScore" -> "ClipScore"."""
    return "".join(w.capitalize() for w in _WORDS.findall(info.display_name)) or identifier(info)


def lookup(attribute: str) -> str | None:
    """Registry name of the metric a class attribute refers to, or None."""
    for name, entry in registry.metrics().items():
        if attribute in (identifier(entry.info), coco_identifier(entry.info), name):
            return name
    return None
