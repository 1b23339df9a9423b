"""``from capeval_plugins.pycocoevalcap import ClipScore, COCOEvalCap, ImageResolver``.

Every registered metric as a pycocoevalcap scorer; see :mod:`capeval_plugins.adapters.pycocoevalcap`.
"""
from __future__ import annotations

from capeval_plugins.adapters.pycocoevalcap import COCOEvalCap, CapevalScorer, ImageResolver, scorer_class

__all__ = ["COCOEvalCap", "CapevalScorer", "ImageResolver", "scorer_class"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    from capeval_plugins.adapters.pycocoevalcap import attribute

    return attribute(name)


def __dir__() -> list[str]:
    from capeval_plugins.adapters.pycocoevalcap import names

    return sorted(set(__all__) | set(names()))
