"""Per-metric classes an adapter exposes, named after ``MetricInfo.display_name``.

``CLIPScore`` -> torchmetrics-style ``CLIPScore``; pycocoevalcap-style (``Bleu``, ``Cider``) ``ClipScore``; a
``+`` is spelled ``Plus`` (``PAC-S++`` -> ``PACSPlusPlus`` / ``PacSPlusPlus``), so that variants keep names of
their own (a ``MetricCollection`` keys its metrics by class name). Two registered metrics never share a class
name: where a plugin's display name spells like one registered before it, its class is named after its
registry name instead (``my_clip`` -> ``MyClip``). Either spelling, or the registry name, finds the metric.
"""
from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any, Callable

from capeval_plugins import registry
from capeval_plugins.contract import MetricInfo

# An acronym ends where a capitalised word of 2+ lowercase letters starts ("CLIP|Score"), not before a
# one-letter tail ("CIDEr" stays one word).
_WORDS = re.compile(r"[A-Z]+(?=[A-Z][a-z]{2,})|[A-Z]?[a-z]+|[A-Z]+[a-z]?|\d+")


def _spelled(display_name: str) -> str:
    return display_name.replace("+", "Plus")


def identifier(info: MetricInfo) -> str:
    """``display_name`` with non-identifier characters removed, ``+`` spelled out: "MSD-Score" -> "MSDScore",
    "PAC-S++" -> "PACSPlusPlus"."""
    name = re.sub(r"\W", "", _spelled(info.display_name))
    return name if name.isidentifier() else "Metric" + name


def coco_identifier(info: MetricInfo) -> str:
    """Capitalised words, as pycocoevalcap names its scorers: "CLIPScore" -> "ClipScore", "PAC-S++" ->
    "PacSPlusPlus"."""
    return "".join(w.capitalize() for w in _WORDS.findall(_spelled(info.display_name))) or identifier(info)


def registry_identifier(name: str) -> str:
    """A class name from a registry name: "my_clip" -> "MyClip"."""
    camel = "".join(part.capitalize() for part in re.split(r"[^0-9A-Za-z]+", name) if part)
    return camel if camel.isidentifier() else "Metric" + camel


def class_names(namer: Callable[[MetricInfo], str]) -> dict[str, str]:
    """Registry name -> class name, for every registered metric (in registration order): ``namer``'s, or the
    registry name's where an earlier metric has that name already. Read from the listing (display names), so
    naming one class imports no other metric's module."""
    out: dict[str, str] = {}
    for entry in registry.listing(by_name=False):
        wanted = namer(SimpleNamespace(display_name=entry.row["display_name"]))
        out[entry.name] = wanted if wanted not in out.values() else registry_identifier(entry.name)
    return out


def lookup(attribute: str) -> str | None:
    """Registry name of the metric a class attribute refers to (either spelling, the registry name, or any
    capitalisation of them: ``Cider``, ``CIDEr``), or None."""
    folded = attribute.lower().replace("_", "")
    torchmetrics_names, coco_names = class_names(identifier), class_names(coco_identifier)
    candidates = [(name, (torchmetrics_names[name], coco_names[name], name)) for name in torchmetrics_names]
    for name, spellings in candidates:  # an exact spelling first: "PACS" is PAC-S, not a folded "PACs"
        if attribute in spellings:
            return name
    for name, spellings in candidates:
        if folded in {s.lower().replace("_", "") for s in spellings}:
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
            self._classes[name] = type(class_names(self.namer)[name], (self.base,), body)
        return self._classes[name]

    def attribute(self, attr: str) -> type:
        name = lookup(attr) if not attr.startswith("__") else None
        if name is None:
            raise AttributeError(f"module {self.module!r} has no attribute {attr!r}")
        return self(name)

    def names(self) -> list[str]:
        return sorted(class_names(self.namer).values())

    def module_hooks(self, exported: list[str]) -> tuple[Callable, Callable]:
        """``__getattr__`` and ``__dir__`` for the public module."""
        return self.attribute, lambda: sorted(set(exported) | set(self.names()))
