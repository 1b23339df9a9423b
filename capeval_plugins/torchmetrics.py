"""``from capeval_plugins.torchmetrics import CLIPScore``: every registered metric as a torchmetrics Metric.

See :mod:`capeval_plugins.adapters.torchmetrics`.
"""
from capeval_plugins.adapters.torchmetrics import CapevalMetric, metric_class

__all__ = ["CapevalMetric", "metric_class"]
__getattr__, __dir__ = metric_class.module_hooks(__all__)
