"""Metric discovery: a pluggy plugin manager fed from the ``capeval_plugins`` entry-point group.

Our own metrics register through that same entry point (``builtin = "capeval_plugins.metrics"``), so a
third-party package that declares::

    [project.entry-points.capeval_plugins]
    my_metrics = "my_package.capeval_hooks"

with a module implementing the hook below shows up in ``capeval list``, ``evaluate.load``, torchmetrics,
pycocoevalcap and lm-eval without any code of ours changing.

Listing names and needs (``capeval list``, :func:`listing`) imports no metric: a plugin that also implements
``capeval_metric_catalog`` describes its metrics there (plain values), so the listing costs no import of torch or
of a model library; ours come from ``capeval_plugins/metrics/catalog.json``. Looking one metric up (:func:`get`)
imports only its module when it is one of ours (the built-in plugin's ``capeval_metric_class``): a run of the
classic metrics imports no model library and no torch. This module imports neither.
"""
from __future__ import annotations

import difflib
import importlib.metadata
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

from capeval_plugins.core.messages import UnknownName

if TYPE_CHECKING:
    from capeval_plugins.contract import Metric, MetricInfo

PROJECT = "capeval_plugins"
BUILTIN = "builtin"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class HookSpecs:
    @hookspec
    def capeval_metrics(self) -> list[type[Metric]]:
        """Return the :class:`~capeval_plugins.contract.Metric` subclasses this plugin provides."""

    @hookspec
    def capeval_metric_class(self, name: str) -> type[Metric] | None:
        """Optional: the class of the metric ``name`` if this plugin provides it, importing no more than its
        module (else None). Asked of the first plugin (the built-in one) only: another plugin's names are found
        by collecting every plugin's classes, so that the first to register a name keeps it."""

    @hookspec
    def capeval_metric_catalog(self) -> list[dict[str, Any]]:
        """Optional: the same metrics described without importing them, one dict per metric with the
        :data:`LISTED` fields of its ``MetricInfo`` (see :func:`catalog_row`), for ``capeval list``."""


@dataclass(frozen=True)
class Registered:
    cls: type[Metric]
    plugin: str
    distribution: str | None

    @property
    def info(self) -> MetricInfo:
        return self.cls.info


# What a listing shows of a metric: these fields of its MetricInfo.
LISTED = ("name", "display_name", "references", "images", "video", "groups", "description")


@dataclass(frozen=True)
class Listed:
    """One metric as ``capeval list`` shows it: :data:`LISTED` fields, and where it came from."""

    row: dict[str, Any]
    plugin: str
    distribution: str | None

    @property
    def name(self) -> str:
        return self.row["name"]


def catalog_row(info: MetricInfo) -> dict[str, Any]:
    """The :data:`LISTED` fields of ``info``: what ``capeval_metric_catalog`` returns for one metric."""
    return {key: getattr(info, key) for key in LISTED}


_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_metrics: dict[str, Registered] | None = None
_looked_up: dict[str, Registered] = {}  # single metrics found by capeval_metric_class, before a full collection
_distributions: dict[str, str | None] = {}


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with every installed entry point loaded. A plugin that fails to
    import is reported and skipped; it does not take the others down."""
    global _manager
    with _lock:
        if _manager is None:
            pm = pluggy.PluginManager(PROJECT)
            pm.add_hookspecs(HookSpecs)
            for ep in importlib.metadata.entry_points(group=PROJECT):
                if pm.has_plugin(ep.name):
                    continue
                try:
                    plugin = ep.load()
                except Exception as err:  # a broken third-party plugin
                    warnings.warn(f"capeval plugin {ep.name!r} ({ep.value}) failed to load: {err}", stacklevel=2)
                    continue
                dist = getattr(ep, "dist", None)
                pm.register(plugin, name=ep.name)
                _distributions[ep.name] = dist.name if dist else None
            _manager = pm
        return _manager


def register_plugin(plugin: Any, name: str | None = None) -> None:
    """Register a hook-implementing object at run time (notebooks, tests); same effect as an entry point."""
    with _lock:
        plugin_manager().register(plugin, name=name)
        refresh()


def refresh() -> None:
    """Forget the collected metrics so the next lookup asks every plugin again."""
    global _metrics
    with _lock:
        _metrics = None
        _looked_up.clear()


def _builtin_first(pm: pluggy.PluginManager) -> list[Any]:
    """Built-in first, so a third-party plugin can add names but never replace ours."""
    return sorted(pm.get_plugins(), key=lambda p: pm.get_name(p) != BUILTIN)


def listing(by_name: bool = True) -> list[Listed]:
    """Every registered metric by name (or, not ``by_name``, in registration order, as :func:`metrics` has them),
    described without importing a metric where its plugin has a catalog (``capeval_metric_catalog``); the classes
    of a plugin without one are collected as :func:`metrics` does."""
    pm = plugin_manager()
    found: dict[str, Listed] = {}
    for plugin in _builtin_first(pm):
        name = pm.get_name(plugin)
        catalog = getattr(plugin, "capeval_metric_catalog", None)
        if catalog is not None:
            rows = [dict(row) for row in catalog() or ()]
        else:
            rows = [catalog_row(cls.info) for cls in _classes(plugin, name)]
        for row in rows:
            found.setdefault(row["name"], Listed(row, name, _distributions.get(name)))
    return [found[key] for key in (sorted(found) if by_name else found)]


def _collect() -> dict[str, Registered]:
    pm = plugin_manager()
    found: dict[str, Registered] = {}
    for plugin in _builtin_first(pm):
        name = pm.get_name(plugin)
        for cls in _classes(plugin, name):
            key = cls.info.name
            if key in found:
                if found[key].cls is not cls:
                    warnings.warn(
                        f"metric {key!r} from plugin {name!r} ignored: already registered by {found[key].plugin!r}",
                        stacklevel=2,
                    )
                continue
            found[key] = Registered(cls, name, _distributions.get(name))
    return found


def _classes(plugin: Any, name: str) -> list[type[Metric]]:
    """The Metric subclasses ``plugin`` returns (anything else is reported and left out)."""
    impl = getattr(plugin, "capeval_metrics", None)
    return [cls for cls in ((impl() or ()) if impl is not None else ()) if _checked(cls, name, stacklevel=4)]


def _checked(cls: Any, plugin: str, stacklevel: int = 3) -> type[Metric] | None:
    """``cls`` if it is a Metric subclass with its ``info``; else reported, and None."""
    from capeval_plugins.contract import Metric

    if not (isinstance(cls, type) and issubclass(cls, Metric)) or not hasattr(cls, "info"):
        warnings.warn(f"capeval plugin {plugin!r} returned {cls!r}, not a Metric subclass", stacklevel=stacklevel)
        return None
    return cls


def metrics() -> dict[str, Registered]:
    """Every registered metric by name."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = _collect()
        return dict(_metrics)


def canonical_name(name: str) -> str:
    """``"capeval/clipscore"`` and ``"clipscore"`` both name our ``clipscore``."""
    return name[len("capeval/") :] if name.startswith("capeval/") else name


def _one(key: str) -> Registered | None:
    """The metric ``key`` when the first plugin (the built-in one) provides it, asked through
    ``capeval_metric_class``; else None, and every class is collected as :func:`metrics` does, so the first
    plugin to register a name keeps it whatever another plugin's hook answers."""
    pm = plugin_manager()
    first = next(iter(_builtin_first(pm)), None)
    lookup = getattr(first, "capeval_metric_class", None)
    if lookup is None:
        return None
    name = pm.get_name(first)
    try:
        cls = lookup(name=key)
    except Exception as err:  # a plugin's bug: reported, and the full collection decides
        warnings.warn(f"capeval plugin {name!r}: capeval_metric_class({key!r}) failed: {err}", stacklevel=3)
        return None
    checked = _checked(cls, name) if cls is not None else None
    return Registered(checked, name, _distributions.get(name)) if checked and cls.info.name == key else None


def get(name: str) -> Registered:
    key = canonical_name(name)
    with _lock:
        if _metrics is None:
            found = _looked_up.get(key) or _one(key)
            if found is not None:
                _looked_up[key] = found
                return found
    table = metrics()
    if key not in table:
        close = difflib.get_close_matches(key, table, n=3)
        hint = f"; did you mean {close}?" if close else f"; registered: {sorted(table)}"
        raise UnknownName(f"no capeval metric named {name!r}{hint}")
    return table[key]


def load(name: str, **config: Any) -> Metric:
    """Build a registered metric with its options (the paper's defaults where not given)."""
    return get(name).cls(**config)


def list_metrics() -> list[MetricInfo]:
    return [entry.info for _, entry in sorted(metrics().items())]
