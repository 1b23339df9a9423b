"""Per-metric classes an adapter exposes, named after ``MetricInfo.display_name``.

``CLIPScore`` -> torchmetrics-style ``CLIPScore``; pycocoevalcap-style (``Bleu``, ``Cider``) ``ClipScore``.
Either spelling, or the registry name, finds the metric.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from capeval_plugins import registry
from capeval_plugins.contract import MetricInfo

# An acronym ends where a capitalised word of 2+ lowercase letters starts ("CLIP|Score"), not before a
# one-letter tail ("CIDEr" stays one word).
_WORDS = re.compile(r"[A-Z]+(?=[A-Z][a-z]{2,})|[A-Z]?[a-z]+|[A-Z]+[a-z]?|\d+")


def identifier(info: MetricInfo) -> str:
    """``display_name`` with non-identifier characters removed: "MSD-Score" -> "MSDScore"."""
    name = re.sub(r"\W", "", info.display_name)
    return name if name.isidentifier() else "Metric" + name


def coco_identifier(info: MetricInfo) -> str:
    """Capitalised words, as pycocoevalcap names its scorers: "CLIPScore" -> "ClipScore"."""
    return "".join(w.capitalize() for w in _WORDS.findall(info.display_name)) or identifier(info)


def lookup(attribute: str) -> str | None:
    """Registry name of the metric a class attribute refers to (either spelling, the registry name, or any
    capitalisation of them: ``Cider``, ``CIDEr``), or None."""
    folded = attribute.lower().replace("_", "")
    for name, entry in registry.metrics().items():
        spellings = (identifier(entry.info), coco_identifier(entry.info), name)
        if attribute in spellings or folded in {s.lower().replace("_", "") for s in spellings}:
            return name
    return None


class GeneratedClasses:
    """One subclass of an adapter's ``base`` per registered metric, built on first use and cached.

    ``module`` is the public module the classes appear in; ``namer`` names them; ``attributes(info)`` adds
    class attributes (``_capeval_name`` is always set)."""

    def __init__(self, base: type, module: str, namer: Callable[[MetricInfo], str],
                 attributes: Callable[[MetricInfo], dict[str, Any]] = lambda info: {}) -> None:
        self.base, self.module, self.namer, self.attributes = base, module, namer, attributes
        self._classes: dict[str, type] = {}

    def __call__(self, name: str) -> type:
        """The class of the registered metric ``name`` (``"clipscore"`` or ``"capeval/clipscore"``)."""
        name = registry.canonical_name(name)
        if name not in self._classes:
            info = registry.get(name).info
            body = {"_capeval_name": name, "__module__": self.module,
                    "__doc__": f"{info.display_name} ({self.module}).\n\n{info.description}",
                    **self.attributes(info)}
            self._classes[name] = type(self.namer(info), (self.base,), body)
        return self._classes[name]

    def attribute(self, attr: str) -> type:
        name = lookup(attr) if not attr.startswith("__") else None
        if name is None:
            raise AttributeError(f"module {self.module!r} has no attribute {attr!r}")
        return self(name)

    def names(self) -> list[str]:
        return sorted(self.namer(entry.info) for entry in registry.metrics().values())

    def module_hooks(self, exported: list[str]) -> tuple[Callable, Callable]:
        """``__getattr__`` and ``__dir__`` for the public module."""
        return self.attribute, lambda: sorted(set(exported) | set(self.names()))
