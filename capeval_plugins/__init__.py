"""capeval-plugins: recent caption-evaluation metrics for evaluate, torchmetrics, pycocoevalcap and lm-eval.

``load(name, **config)`` builds a registered metric; calling it scores a corpus::

    import capeval_plugins
    clip_s = capeval_plugins.load("clipscore", model="openai/clip-vit-base-patch32")
    result = clip_s(images, candidates, references)   # MetricResult: .score, .scores, .extras

``caption_and_score(images, metrics, predict=...)`` captions images with a Hugging Face image-to-text model or
any function and scores the captions in the same call.

Importing this package is cheap: it does not import evaluate, lm_eval, pycocoevalcap or Lightning.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["load", "list_metrics", "score", "caption_and_score", "Metric", "MetricInfo", "MetricResult", "Batch", "StateSpec", "InputError"]


def load(name: str, **config: Any):
    """Build the registered metric ``name`` (``"clipscore"`` or ``"capeval/clipscore"``)."""
    from capeval_plugins import registry

    return registry.load(name, **config)


def list_metrics():
    """``MetricInfo`` of every registered metric, ours and third-party plugins'."""
    from capeval_plugins import registry

    return registry.list_metrics()


def __getattr__(name: str) -> Any:
    if name in ("Metric", "MetricInfo", "MetricResult", "Batch", "StateSpec"):
        from capeval_plugins import contract

        return getattr(contract, name)
    if name == "InputError":
        from capeval_plugins.inputs import InputError

        return InputError
    raise AttributeError(f"module 'capeval_plugins' has no attribute {name!r}")


def score(metric, images=None, candidates=None, references=None, **options: Any):
    """Score one corpus with one metric, in this process: what ``metric(images, candidates, references)``
    does (:func:`capeval_plugins.runner.score`; see it for the options). The contract's ``Metric.__call__``
    forwards here, so a metric class is callable whatever was imported first, and the contract never imports
    the runner that stands on it."""
    from capeval_plugins import runner

    return runner.score(metric, images, candidates, references, **options)


def caption_and_score(images, metrics, predict, references=None, **options: Any):
    """Caption ``images`` with ``predict`` (a Hugging Face image-to-text model id or path, or a function
    ``images -> captions``) and score the captions with ``metrics`` (names or metrics), batched and resumable
    (``run_dir``): :func:`capeval_plugins.captioning.caption_and_score` (see it for the options). Returns the
    captions and each metric's result."""
    from capeval_plugins import captioning

    return captioning.caption_and_score(images, metrics, predict, references, **options)
