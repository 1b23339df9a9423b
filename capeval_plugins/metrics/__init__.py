"""The package's own metrics, registered through the ``capeval_plugins`` entry point like any plugin.

Every module in this package that defines ``METRICS`` (a list of Metric subclasses) is picked up: registering a
metric needs no other code. A metric also needs its card (``metric_cards/<name>/README.md``) and its tiny recipes
in the test suite (tests/test_empty_captions.py, tests/test_resume_every_metric.py): docs/adding-a-metric.md lists
every file a new metric touches, built in or as a plugin.
"""
from __future__ import annotations

import importlib
import pkgutil

from capeval_plugins.registry import hookimpl


def builtin_metrics() -> list:
    found = []
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        found.extend(getattr(module, "METRICS", ()))
    return found


@hookimpl
def capeval_metrics() -> list:
    return builtin_metrics()
