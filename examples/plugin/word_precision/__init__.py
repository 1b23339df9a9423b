"""WordPrecision, an example capeval-plugins metric (docs/adding-a-metric.md)."""
from word_precision.metric import WordPrecision

__all__ = ["WordPrecision"]
