"""The package's own metrics, registered through the ``capeval_plugins`` entry point like any plugin.

Every module in this package that defines ``METRICS`` (a list of Metric subclasses) is picked up: registering a
metric needs no other code. A metric also needs its card (``metric_cards/<name>/README.md``) and its tiny recipes
in the test suite (tests/test_empty_captions.py, tests/test_resume_every_metric.py): docs/adding-a-metric.md lists
every file a new metric touches, built in or as a plugin.

``capeval list`` describes them without importing them (torch, the model libraries): ``catalog.json`` holds each
module's metrics as :func:`capeval_plugins.registry.catalog_row` gives them, with a digest of the module's source;
a module that is new or changed since the catalog was written is imported and described from its classes, so the
listing is never stale, only slower. ``python tools/metric_catalog.py`` writes the catalog anew (the suite fails
while it is out of date).
"""
from __future__ import annotations

import hashlib
import importlib
import json
import pkgutil
from pathlib import Path

from capeval_plugins.registry import catalog_row, hookimpl

CATALOG = Path(__file__).with_name("catalog.json")


def metric_modules() -> list[str]:
    """The modules of this package that may define metrics, by name, in order."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def builtin_metrics() -> list:
    found = []
    for name in metric_modules():
        module = importlib.import_module(f"{__name__}.{name}")
        found.extend(getattr(module, "METRICS", ()))
    return found


def module_digest(name: str) -> str:
    """A digest of a metric module's source, which the catalog's entry for it was written from."""
    return hashlib.blake2b(Path(__file__).with_name(f"{name}.py").read_bytes(), digest_size=16).hexdigest()


def catalog_entries() -> dict[str, dict]:
    """Each metric module's catalog entry, described from its classes (imports every module): what
    ``catalog.json`` holds."""
    entries = {}
    for name in metric_modules():
        module = importlib.import_module(f"{__name__}.{name}")
        rows = [catalog_row(cls.info) for cls in getattr(module, "METRICS", ())]
        entries[name] = {"digest": module_digest(name), "metrics": rows}
    return entries


@hookimpl
def capeval_metrics() -> list:
    return builtin_metrics()


def _current_entries() -> dict[str, dict | None]:
    """Each metric module's catalog entry, None where the module is new or changed since the catalog was written
    (then only its classes can say what it holds)."""
    try:
        catalog = json.loads(CATALOG.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        catalog = {}
    entries = {}
    for name in metric_modules():
        entry = catalog.get(name)
        entries[name] = entry if entry is not None and entry.get("digest") == module_digest(name) else None
    return entries


@hookimpl
def capeval_metric_class(name: str) -> type | None:
    """Our metric ``name``, importing only the module whose catalog entry lists it (a module whose entry is
    missing or out of date is imported to look)."""
    for module_name, entry in _current_entries().items():
        if entry is not None and all(row["name"] != name for row in entry["metrics"]):
            continue
        module = importlib.import_module(f"{__name__}.{module_name}")
        for cls in getattr(module, "METRICS", ()):
            if cls.info.name == name:
                return cls
    return None


@hookimpl
def capeval_metric_catalog() -> list[dict]:
    rows: list[dict] = []
    for name, entry in _current_entries().items():
        if entry is None:  # new or changed: from its classes
            module = importlib.import_module(f"{__name__}.{name}")
            rows += [catalog_row(cls.info) for cls in getattr(module, "METRICS", ())]
        else:
            rows += entry["metrics"]
    return rows
