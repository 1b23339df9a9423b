"""``from capeval_plugins.torchmetrics import CLIPScore``: every registered metric as a torchmetrics Metric.

See :mod:`capeval_plugins.adapters.torchmetrics`.
"""
from __future__ import annotations

from capeval_plugins.adapters.torchmetrics import CapevalMetric, metric_class

__all__ = ["CapevalMetric", "metric_class"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    from capeval_plugins.adapters.torchmetrics import attribute

    return attribute(name)


def __dir__() -> list[str]:
    from capeval_plugins.adapters.torchmetrics import names

    return sorted(set(__all__) | set(names()))
