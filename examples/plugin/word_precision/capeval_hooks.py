"""The module the entry point names: capeval asks it for its metrics."""
from capeval_plugins.registry import hookimpl

from word_precision.metric import WordPrecision


@hookimpl
def capeval_metrics():
    return [WordPrecision]
