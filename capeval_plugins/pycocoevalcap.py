"""``from capeval_plugins.pycocoevalcap import ClipScore, COCOEvalCap, ImageResolver``.

Every registered metric as a pycocoevalcap scorer, and pycocoevalcap's own scorer names (``Bleu``, ``Meteor``,
``Rouge``, ``Cider``, ``Spice``) with its signatures, return types and ``method()`` names, and ``PTBTokenizer``
(stock's, whose ``tokenize`` also remembers the captions as written, so the usual loop gives every capeval scorer
the captions it should read). Importing it changes nothing of pycocoevalcap's. See
:mod:`capeval_plugins.adapters.pycocoevalcap`.
"""
from capeval_plugins.adapters.pycocoevalcap import (STOCK_ALIASES, Bleu, COCOEvalCap, CapevalScorer, ImageResolver,
                                                    PTBTokenizer, TokenizedCaptions, scorer_class)

# Rouge (and every metric's scorer) comes from the module's __getattr__
__all__ = ["Bleu", "COCOEvalCap", "CapevalScorer", "ImageResolver", "PTBTokenizer", "Rouge",  # noqa: F822
           "TokenizedCaptions", "scorer_class"]
_generated, __dir__ = scorer_class.module_hooks(__all__)


def __getattr__(name: str):
    if name in STOCK_ALIASES:
        return scorer_class(STOCK_ALIASES[name])
    return _generated(name)
