"""COCOEvalCap's stock scorers as capeval computes them (``COCOEvalCap(fast=True)``, the default): BLEU-1..4,
METEOR, ROUGE-L and CIDEr-D through the session, every metric of one ``evaluate()`` in one pass, on the PTB tokens
COCOEvalCap hands them; pycocoevalcap's return values and types (:func:`stock_typed`), bit for bit its numbers.
Also SPICE's availability and the NaN stand-in for a scorer that cannot run."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from capeval_plugins import registry, runner
from capeval_plugins.contract import Metric, MetricResult

ARRAY_ITEMS = {"rouge_l", "cider"}  # stock Rouge and Cider: (numpy float, numpy array); the others lists


def stock_typed(name: str, result: MetricResult) -> tuple[Any, Any]:
    """``(score, per-item)`` with pycocoevalcap's types: numpy float and array for ROUGE-L and CIDEr, a float
    and a list of floats otherwise (as its Bleu, Meteor and Spice per order)."""
    items = result.scores.tolist()
    if name in ARRAY_ITEMS:
        return np.float64(result.score), np.array(items)
    return float(result.score), items


def spice_available() -> bool:
    """SPICE needs Stanford CoreNLP jars that pycocoevalcap downloads on first use (impossible offline)."""
    import pycocoevalcap.spice as spice

    lib = Path(spice.__file__).parent / "lib"
    return any(lib.glob("stanford-corenlp-*-models.jar"))


class _StockCorpus:
    """The stock-named scorers of one ``evaluate()`` (or one scorer alone): every classic metric they stand for is
    scored in one session pass (:func:`capeval_plugins.runner.score_many`: the runner's checks, one batch loop,
    the PTB-tokenised texts prepared once for all of them), on the first dicts any of them is given; the others
    read their results (dicts changed between calls are scored again). The texts are the tokens COCOEvalCap
    hands its scorers, so the metrics take them as they are (``tokenize=False``)."""

    def __init__(self) -> None:
        self.wanted: dict[str, Metric] = {}
        self.key: tuple | None = None
        self.results: dict[str, MetricResult] = {}

    def want(self, label: str, name: str, **options: Any) -> str:
        """Ask for the registered metric ``name`` with ``options`` under ``label`` (results found by it)."""
        if label not in self.wanted:
            self.wanted[label] = registry.load(name, tokenize=False, **options)
            self.key = None  # the next call scores the new metric too
        return label

    def get(self, gts: Mapping[Any, list[str]], res: Mapping[Any, list[str]]) -> dict[str, MetricResult]:
        """Every wanted metric's result on these dicts (scored now unless they are the last ones scored)."""
        if gts.keys() != res.keys():
            raise ValueError("gts and res must have the same image ids")
        ids = list(gts)
        key = (ids, [list(gts[i]) for i in ids], [list(res[i]) for i in ids])
        if self.key != key:
            for i in ids:
                if not isinstance(res[i], list) or len(res[i]) != 1:
                    raise ValueError(f"res[{i!r}] must be a list holding exactly one caption")
                if not isinstance(gts[i], list) or not gts[i]:
                    raise ValueError(f"gts[{i!r}] must be a non-empty list of captions")
            self.results = runner.score_many(self.wanted, None, [r[0] for r in key[2]], key[1],
                                             describe=lambda k: f"image id {ids[k]!r}")
            self.key = key
        return self.results


class StockBleu:
    """pycocoevalcap's ``Bleu(4)`` (same arguments, same return values and types), computed by capeval's
    BLEU-1..n metrics (:mod:`capeval_plugins.metrics.coco`) through the session."""

    def __init__(self, n: int = 4, shared: _StockCorpus | None = None) -> None:
        self._n, self.shared = n, shared or _StockCorpus()
        self._labels = [self.shared.want(f"bleu{k}", f"bleu{k}") for k in range(1, n + 1)]

    def compute_score(self, gts, res, verbose=0):
        results = self.shared.get(gts, res)
        return [results[k].score for k in self._labels], [results[k].scores.tolist() for k in self._labels]

    def method(self) -> str:
        return "Bleu"


class StockMeteor:
    """pycocoevalcap's ``Meteor()``: the same jar and command line, on the process's shared JVM, streamed,
    every wait bounded (:mod:`capeval_plugins.resources.java`), through capeval's METEOR metric;
    ``(corpus float, [per-item floats])``. ``paraphrases``: the paraphrase table the JVM loads, ``"corpus"``
    (the entries the corpus can use) or ``"full"``; the same scores (metric_cards/meteor)."""

    def __init__(self, shared: _StockCorpus | None = None, paraphrases: str = "corpus") -> None:
        self.shared = shared or _StockCorpus()
        self.paraphrases = paraphrases
        self._label = self.shared.want(f"meteor:{paraphrases}", "meteor", paraphrases=paraphrases)

    def compute_score(self, gts, res):
        result = self.shared.get(gts, res)[self._label]
        return float(result.score), result.scores.tolist()

    def method(self) -> str:
        return "METEOR"


class StockRouge:
    """pycocoevalcap's ``Rouge()``: ``(numpy float mean, numpy array of per-item ROUGE-L)``."""

    def __init__(self, shared: _StockCorpus | None = None) -> None:
        self.shared = shared or _StockCorpus()
        self._label = self.shared.want("rouge_l", "rouge_l")

    def compute_score(self, gts, res):
        return stock_typed("rouge_l", self.shared.get(gts, res)[self._label])

    def method(self) -> str:
        return "Rouge"


class StockCider:
    """pycocoevalcap's ``Cider()`` (CIDEr-D, n = 4, sigma = 6): ``(numpy float mean, numpy array)``."""

    def __init__(self, n: int = 4, sigma: float = 6.0, shared: _StockCorpus | None = None) -> None:
        self._n, self._sigma, self.shared = n, sigma, shared or _StockCorpus()
        self._label = self.shared.want(f"cider:{n}:{sigma!r}", "cider", n=n, sigma=sigma)

    def compute_score(self, gts, res):
        return stock_typed("cider", self.shared.get(gts, res)[self._label])

    def method(self) -> str:
        return "CIDEr"


def _stock_scorers(spice: bool, fast: bool = True) -> list[tuple[Any, Any]]:
    """COCOEvalCap's scorers: capeval's implementation of them (``fast``: same numbers, bit for bit, and types),
    or pycocoevalcap's own classes."""
    from pycocoevalcap.eval import Bleu, Cider, Meteor, Rouge, Spice

    if fast:
        shared = _StockCorpus()
        scorers = [(StockBleu(4, shared), ["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4"]), (StockMeteor(shared), "METEOR"),
                   (StockRouge(shared), "ROUGE_L"), (StockCider(shared=shared), "CIDEr")]
    else:
        scorers = [(Bleu(4), ["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4"]), (Meteor(), "METEOR"),
                   (Rouge(), "ROUGE_L"), (Cider(), "CIDEr")]
    if spice:
        scorers.append((Spice(), "SPICE"))
    return scorers


class Unavailable:
    """A stock scorer that could not run: NaN for the corpus and for every image, so ``eval``, ``imgToEval`` and
    ``evalImgs`` keep stock's keys in stock's order."""

    def __init__(self, method: str) -> None:
        self._method = method

    def method(self) -> str:
        return self._method

    def compute_score(self, gts, res):
        return float("nan"), [float("nan")] * len(gts)


SPICE_MISSING = ("SPICE was not run: it needs Stanford CoreNLP jars that pycocoevalcap downloads on first use "
                 "(not possible offline); run it once online, or pass spice=False")
