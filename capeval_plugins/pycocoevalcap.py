"""``from capeval_plugins.pycocoevalcap import ClipScore, COCOEvalCap, ImageResolver``.

Every registered metric as a pycocoevalcap scorer; see :mod:`capeval_plugins.adapters.pycocoevalcap`.
"""
from capeval_plugins.adapters.pycocoevalcap import COCOEvalCap, CapevalScorer, ImageResolver, scorer_class

__all__ = ["COCOEvalCap", "CapevalScorer", "ImageResolver", "scorer_class"]
__getattr__, __dir__ = scorer_class.module_hooks(__all__)
