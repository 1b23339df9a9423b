"""pycocoevalcap adapter, generic over the contract.

A scorer per registered metric (``ClipScore``, ...) with ``compute_score(gts, res)`` and ``method()``, so it
drops into the usual ``for scorer, method in scorers`` loop (taking the captions as COCO holds them, plain, or
from capeval's :class:`PTBTokenizer`, a subclass of stock's that remembers them as written; no stock class is
changed); image metrics are built with an
:class:`ImageResolver` (a metric that finds its images by id itself, such as ViLBERTScore on region features,
takes the ids when no resolver is given). :class:`COCOEvalCap` runs the stock scorers (by default capeval's
implementation of them, :mod:`.coco_eval_stock`: pycocoevalcap's numbers and types, faster)
and adds ours, feeding raw (untokenised) captions to scorers that want them.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from capeval_plugins import options as metric_options
from capeval_plugins import registry, runner
from capeval_plugins.adapters.coco_eval_stock import (SPICE_MISSING, Unavailable, _stock_scorers, spice_available,
                                                     stock_typed)
from capeval_plugins.adapters.naming import GeneratedClasses, coco_identifier
from capeval_plugins.contract import Metric, MetricResult
from capeval_plugins.core import jsonio
from capeval_plugins.core.messages import require, warn_once
from capeval_plugins.resources.java import PTB_LINE_BREAKS

# the ecosystem this adapter plugs into: without it, one line naming the extra that installs it
StockCOCOEvalCap = require("pycocoevalcap.eval", "pycocoevalcap", "capeval_plugins.pycocoevalcap").COCOEvalCap


class ImageResolver:
    """Image id -> image file under ``root``, from a COCO annotation file (``images[].id`` ->
    ``file_name``), a mapping, or a ``pattern`` such as ``"{id:012d}.jpg"``. Ids that resolve outside
    ``root`` are refused."""

    def __init__(
        self,
        root: str | os.PathLike,
        annotation_file: str | os.PathLike | None = None,
        mapping: Mapping[Any, str] | None = None,
        pattern: str | None = None,
    ) -> None:
        self.root = Path(root).resolve()
        self.files: dict[str, str] = {}
        if annotation_file is not None:
            with open(annotation_file, encoding="utf-8") as f:  # JSON is UTF-8, whatever the locale
                images = jsonio.load(f).get("images", [])
            self._add(((img["id"], img["file_name"]) for img in images), f"{annotation_file}: images")
        if mapping is not None:
            self._add(mapping.items(), "mapping")
        self.pattern = pattern
        if not self.files and pattern is None:
            raise ValueError("ImageResolver needs an annotation file, a mapping or a pattern")

    @classmethod
    def from_coco(cls, root: str | os.PathLike, coco: Any) -> "ImageResolver":
        """From a loaded ``pycocotools.coco.COCO`` object."""
        return cls(root, mapping={i: img["file_name"] for i, img in coco.imgs.items()})

    def _add(self, pairs: Iterable[tuple[Any, Any]], where: str) -> None:
        """Ids to file names; an id given twice with different files (``1`` and ``"1"``, ``7`` and ``7.0``
        are one id) is refused rather than resolved to whichever came last."""
        for image_id, name in pairs:
            key, name = id_key(image_id), str(name)
            if self.files.get(key, name) != name:
                raise ValueError(f"{where}: image id {image_id!r} is given twice, as {self.files[key]!r} and "
                                 f"{name!r}")
            self.files[key] = name

    def __call__(self, image_id: Any) -> Path:
        relative = self.files.get(id_key(image_id))
        if relative is None:
            if self.pattern is None:
                raise KeyError(f"image id {image_id!r} is not in the resolver's annotations")
            relative = self.pattern.format(id=_plain_id(image_id))
        path = (self.root / relative).resolve()
        if not path.is_relative_to(self.root):
            raise ValueError(f"image id {image_id!r} resolves outside the image root: {path}")
        return path


def _plain_id(image_id: Any) -> Any:
    """An integral id as an int (numpy integers, ``7.0`` from a float column), anything else as it is."""
    if isinstance(image_id, bool):
        raise ValueError(f"image id {image_id!r} is a boolean, not an id")
    if isinstance(image_id, (int, np.integer)):
        return int(image_id)
    if isinstance(image_id, (float, np.floating)) and float(image_id).is_integer():
        return int(image_id)
    return image_id


def id_key(image_id: Any) -> str:
    """How ids are matched: COCO's integer ids, the same ids read as strings or floats, one key each."""
    return str(_plain_id(image_id))


def same_id(image_id: Any) -> Any:
    """The resolver of a metric that reads its images by id itself (``Metric.image_reader()``)."""
    return image_id


# ---------------------------------------------------------------------------------------------------------
# The captions as written, in the usual loop (PTB-tokenise, then ``for scorer, method in scorers``). Nothing of
# pycocoevalcap's is changed: a scorer finds the captions as written in what it is handed, or refuses tokens.

# pycocoevalcap's tokenizer drops these tokens (its PUNCTUATIONS, pycocoevalcap 1.2)
PTB_DROPPED = frozenset(["''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-", ".", "?", "!", ",", ":", "-",
                         "--", "...", ";"])
SENTENCE_MARKS = (".", ",", "!", "?", ";", ":")


class TokenizedCaptions(dict):
    """What :class:`PTBTokenizer` (capeval's, a subclass of pycocoevalcap's) returns: the same dict of tokenised
    captions (every stock scorer takes it as before), remembering the captions as written, so that a capeval
    scorer in the usual loop scores those (CLIPScore and the LVLM judges read case and punctuation; the classic
    metrics tokenise them as their option ``tokenize`` says, as stock does)."""

    def __init__(self, tokens: Mapping[Any, list[str]], written: Mapping[Any, list[str]]) -> None:
        super().__init__(tokens)
        self._tokens = {k: list(v) for k, v in tokens.items()}
        self._written = {k: list(v) for k, v in written.items()}

    def as_written(self) -> dict[Any, list[str]] | None:
        """The captions as written, or None when the dict was changed after tokenisation."""
        same = self.keys() == self._tokens.keys() and all(self[k] == v for k, v in self._tokens.items())
        return dict(self._written) if same else None


def _stock_tokenizer() -> type:
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer as Stock

    return Stock


class PTBTokenizer(_stock_tokenizer()):
    """pycocoevalcap's ``PTBTokenizer``, the same tokens, returned as :class:`TokenizedCaptions`: import this one
    instead of stock's and every capeval scorer in the usual loop scores the captions as written."""

    def tokenize(self, captions_for_image):
        tokens = super().tokenize(captions_for_image)
        written = annotation_captions(captions_for_image)
        _remember_stock_tokens(written, tokens)
        return TokenizedCaptions(tokens, written)


def _remember_stock_tokens(written: Mapping[Any, list[str]] | None, tokens: Mapping[Any, list[str]]) -> None:
    """Stock's tokens of captions, remembered as capeval's PTB step would make them, so that a classic scorer of
    the usual loop, which tokenises the captions as written again, starts no second tokenizer. Stock's tokens
    are capeval's (the same jar and options, a line per caption) unless a caption holds a character Java reads
    as a line break beside ``\\n``: then every later caption's tokens are shifted, and nothing is remembered."""
    from capeval_plugins.metrics.coco import TAIL, ptb_keys, remember_ptb

    if written is None or written.keys() != tokens.keys():
        return
    lines = [c for k in written for c in written[k]]
    made = [t for k in written for t in tokens[k]]
    if len(lines) == len(made) and all(isinstance(c, str) and c.translate(SHIFTING_BREAKS) == c for c in lines):
        keys, tail = ptb_keys(lines)  # by what each line's tokens depend on in that one call
        found: dict[tuple, Any] = {key: t for key, t in zip(keys[:tail], made) if key is not None}
        if tail < len(lines):
            found[(TAIL, tuple(lines[tail:]))] = tuple(made[tail:])
        remember_ptb(found)


# What Java's tokenizer reads as a line break and stock's PTBTokenizer leaves in a caption (it replaces "\n")
SHIFTING_BREAKS = {c: None for c in PTB_LINE_BREAKS if c != ord("\n")}


def annotation_captions(captions: Mapping[Any, Any]) -> dict[Any, list[str]] | None:
    """``{id: [caption, ...]}`` from captions as COCO holds them and ``PTBTokenizer().tokenize`` takes them
    (``{id: [{"caption": ...}, ...]}``), or None for any other shape."""
    try:
        return {k: [c["caption"] for c in v] for k, v in captions.items()}
    except (TypeError, KeyError, AttributeError, IndexError):
        return None


def looks_ptb_tokenized(caption: Any) -> bool:
    """Whether a caption could be pycocoevalcap's PTB output: lower-case, single spaces, no sentence mark ending
    it or a word (PTB splits them off and drops them), none of the tokens it drops."""
    if not isinstance(caption, str) or caption != caption.lower() or caption != " ".join(caption.split()):
        return False
    words = caption.split()
    return not caption.endswith(SENTENCE_MARKS) and not any(
        w in PTB_DROPPED or (len(w) > 1 and w.endswith(SENTENCE_MARKS[1:])) for w in words)


# pycocoevalcap's own names for the classic metrics: method() and the per-item type its scorers return.
STOCK_METHOD = {"meteor": "METEOR", "rouge_l": "Rouge", "cider": "CIDEr", "spice": "SPICE",
                **{f"bleu{n}": f"Bleu_{n}" for n in range(1, 5)}}
# COCOEvalCap's eval keys where they differ from method()
EVAL_KEY = {"rouge_l": "ROUGE_L"}


class CapevalScorer:
    """A registered metric as a pycocoevalcap scorer. ``last_result`` keeps the full result (per-sample
    extras) of the latest ``compute_score``. Per-item scores come back as pycocoevalcap's scorers return
    them (a list; a numpy array for ROUGE-L and CIDEr, as stock), ``method()`` is stock's name for the
    classic metrics (``CIDEr``, ``METEOR``, ``Rouge``, ``Bleu_4``) and the display name for the others."""

    _capeval_name: str = ""

    def __init__(self, resolver: ImageResolver | None = None, metric: Metric | None = None, *,
                 assume_written: bool = False, **options: Any):
        if metric is not None and options:
            raise TypeError("pass either a built metric or its options, not both")
        self.metric = metric if metric is not None else registry.load(self._capeval_name, **options)
        info = self.metric.info
        if resolver is None and self.metric.image_reader() is not None:
            resolver = same_id  # the metric finds its images by id itself (e.g. precomputed feature files)
        if info.images == "always" and resolver is None:
            raise ValueError(f"{info.display_name} scores images: build it with an ImageResolver")
        self.resolver = resolver
        # the captions as written (a classic metric tokenises them itself unless told the text is tokenised)
        self.wants_raw_text = info.text_input == "raw" or bool(getattr(self.metric.config, "tokenize", False))
        # plain strings that all look PTB-tokenised are scored as given only when the user says they are written so
        self.assume_written = assume_written
        self.last_result: MetricResult | None = None
        self._as_given: dict[int, Metric] = {}  # id of a metric -> its twin scoring text as given (tokenize=False)

    def _scoring(self, metric: Metric, written: bool) -> Metric:
        """The metric that scores these dicts. A classic metric handed plain ``{id: [text]}`` (stock's scorer API:
        the usual loop's PTB tokens from stock's tokenizer) scores the text as given, as pycocoevalcap's scorers
        do: PTB is not the identity on its own tokens ("'t was" -> "t was"), and a blank token string is what it
        made of "...". Captions known to be as written, or ``assume_written=True``, are tokenised by the metric."""
        if written or self.assume_written or not getattr(metric.config, "tokenize", False):
            return metric
        if id(metric) not in self._as_given:
            config = metric.config
            options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
            self._as_given[id(metric)] = type(metric)(**{**options, "tokenize": False})
        return self._as_given[id(metric)]

    def method(self) -> str:
        return STOCK_METHOD.get(self.metric.info.name, self.metric.info.display_name)

    def _inputs(self, gts: Mapping[Any, list[str]],
                res: Mapping[Any, list[str]]) -> tuple[list, list, Any, Any, bool]:
        """``(ids, candidates, references, images, written)``: ``written`` when both dicts are known to hold the
        captions as written."""
        ids = list(gts.keys())
        if set(ids) != set(res.keys()):
            raise ValueError("gts and res must have the same image ids")
        (gts, gts_written), (res, res_written) = self._as_written(gts, "gts"), self._as_written(res, "res")
        candidates = []
        for image_id in ids:
            hyp = res[image_id]
            if not isinstance(hyp, (list, tuple)) or len(hyp) != 1:
                raise ValueError(f"res[{image_id!r}] must be a list holding exactly one caption")
            candidates.append(hyp[0])
        if not (gts_written and res_written):
            self._refuse_tokens(gts, res)
        info = self.metric.info
        references = [list(gts[i]) for i in ids] if self.metric.uses_references() else None
        images = [self.resolver(i) for i in ids] if self.resolver is not None and info.images != "never" else None
        return ids, candidates, references, images, gts_written and res_written

    def _as_written(self, captions: Mapping[Any, Any], which: str) -> tuple[Mapping[Any, list[str]], bool]:
        """``(captions, known to be as written)``: as written where they were handed over so, as COCO holds them
        (``{id: [{"caption": ...}]}``, what ``PTBTokenizer().tokenize`` takes) or remembered by capeval's
        :class:`PTBTokenizer`; plain ``{id: [caption, ...]}`` as they are."""
        written = annotation_captions(captions)
        if written is not None:
            return written, True
        if not isinstance(captions, TokenizedCaptions) or not self.wants_raw_text:
            return captions, False
        written = captions.as_written()
        if written is None:
            raise ValueError(f"{self.method()} scores captions as written, but {which} holds PTB tokens changed after "
                             f"tokenisation: pass {self.method()} the captions before PTBTokenizer().tokenize, as COCO "
                             "holds them ({id: [{'caption': ...}]})")
        return written, True

    def _refuse_tokens(self, gts: Mapping[Any, list[str]], res: Mapping[Any, list[str]]) -> None:
        """A metric that reads captions as written (CLIPScore, the LVLM judges, BERTScore) would silently score
        PTB tokens in the usual loop: refuse a corpus every caption of which looks tokenised."""
        if self.metric.info.text_input != "raw" or self.assume_written:
            return
        texts = [c for caps in (*gts.values(), *res.values()) if isinstance(caps, (list, tuple)) for c in caps]
        if texts and all(looks_ptb_tokenized(c) for c in texts):
            raise ValueError(
                f"{self.method()} scores captions as written, but every caption of gts and res looks PTB-tokenised "
                "(lower-case, punctuation dropped): pass it the captions before tokenising, as COCO holds them (the "
                "{id: [{'caption': ...}]} dicts PTBTokenizer takes), or tokenise with "
                "capeval_plugins.pycocoevalcap.PTBTokenizer; if these are the captions as written, build the scorer "
                "with assume_written=True")

    def compute_score(self, gts: Mapping[Any, list[str]], res: Mapping[Any, list[str]]):
        """``(corpus score, per-item scores in gts order)``, typed as pycocoevalcap's scorers type them."""
        ids, candidates, references, images, written = self._inputs(gts, res)
        self.last_result = runner.score(self._scoring(self.metric, written), images, candidates, references,
                                        describe=lambda k: f"image id {ids[k]!r}")
        return stock_typed(self.metric.info.name, self.last_result)


def _eval_keys(scorer: Any) -> str | list[str]:
    """The keys a scorer given without them fills in ``eval``: ``Bleu_1`` .. ``Bleu_n`` for a BLEU scorer (which
    returns a score per order, as stock's loop names them), else its ``method()``."""
    method = scorer.method()
    orders = len(getattr(scorer, "_orders", ())) or getattr(scorer, "_n", 0)
    return [f"Bleu_{k}" for k in range(1, orders + 1)] if method == "Bleu" and orders else method


class Bleu(CapevalScorer):
    """pycocoevalcap's ``Bleu(n)``: ``([BLEU-1 .. BLEU-n], [[per item] per order])`` and ``method()`` "Bleu", on
    the captions as written in the usual loop (tokenised once, as stock's loop does) or on what it is given.
    ``options`` go to every order's metric (``tokenize=False`` for text that is already tokenised)."""

    _capeval_name = "bleu4"

    def __init__(self, n: int = 4, **options: Any) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 4:
            raise ValueError(f"Bleu: n must be 1, 2, 3 or 4, got {n!r}")
        super().__init__(**options)
        self._orders = {f"bleu{k}": registry.load(f"bleu{k}", **options) for k in range(1, n + 1)}

    def method(self) -> str:
        return "Bleu"

    def compute_score(self, gts, res, verbose=0):
        ids, candidates, references, _, written = self._inputs(gts, res)
        orders = {name: self._scoring(metric, written) for name, metric in self._orders.items()}
        results = runner.score_many(orders, None, candidates, references,
                                    describe=lambda k: f"image id {ids[k]!r}")
        self.last_result = results[f"bleu{len(self._orders)}"]
        return [r.score for r in results.values()], [r.scores.tolist() for r in results.values()]


def _rouge_calc_score(self, candidate: list[str], refs: list[str]) -> float:
    """pycocoevalcap's ``Rouge().calc_score``: ROUGE-L of one candidate (a list holding one string) against its
    references, on the text as given (tokens split on single spaces, as stock's), by the core
    :meth:`compute_score` uses."""
    from capeval_plugins.core.coco_text import CocoCorpus

    if not isinstance(candidate, (list, tuple)) or len(candidate) != 1 or not isinstance(candidate[0], str):
        raise ValueError(f"Rouge.calc_score: candidate must be a list holding one string, got {candidate!r:.80}")
    _check_references("Rouge.calc_score", refs)
    return float(CocoCorpus.from_texts([candidate[0]], [list(refs)]).rouge_l()[1][0])


def _meteor_stat(self, hypothesis_str: str, reference_list: list[str]) -> str:
    """pycocoevalcap's ``Meteor()._stat``: the jar's statistics line for one hypothesis and its references, on
    the text as given (as stock's: no PTB tokenisation), from the process's METEOR JVM."""
    from capeval_plugins.resources import java

    return java.METEOR.statistics(*_meteor_request(self, "_stat", hypothesis_str, reference_list))[0]


def _meteor_score(self, hypothesis_str: str, reference_list: list[str]) -> float:
    """pycocoevalcap's ``Meteor()._score`` (which writes text to a byte pipe and fails under Python 3): the
    jar's ``EVAL`` aggregate over this one segment, the score its second answer line gives."""
    from capeval_plugins.resources import java

    jar, segments, paraphrases = _meteor_request(self, "_score", hypothesis_str, reference_list)
    return float(java.METEOR.score(jar, segments, paraphrases=paraphrases)[0])


def _meteor_request(scorer: CapevalScorer, method: str, hypothesis: str, references: list[str]) -> tuple:
    from capeval_plugins.metrics.coco import meteor_jar

    config = scorer.metric.config
    if getattr(config, "implementation", "pycocoevalcap") != "pycocoevalcap":
        raise ValueError(f"Meteor.{method} asks METEOR's jar, which implementation={config.implementation!r} "
                         "does not run")
    if not isinstance(hypothesis, str):
        raise ValueError(f"Meteor.{method}: the hypothesis must be a string, got {type(hypothesis).__name__}")
    _check_references(f"Meteor.{method}", references)
    return meteor_jar(), [(hypothesis, list(references))], config.paraphrases


def _check_references(where: str, refs: Any) -> None:
    if isinstance(refs, str) or not isinstance(refs, (list, tuple)) or not refs or \
            not all(isinstance(r, str) for r in refs):
        raise ValueError(f"{where}: the references must be a non-empty list of strings, got {refs!r:.80}")


def _cider_init(self, test: Any = None, refs: Any = None, n: int = 4, sigma: float = 6.0, *,
                resolver: ImageResolver | None = None, metric: Metric | None = None, assume_written: bool = False,
                **options: Any) -> None:
    """pycocoevalcap's ``Cider(test=None, refs=None, n=4, sigma=6.0)``: stock ignores ``test`` and ``refs`` (its
    ``compute_score`` takes the captions), so any other value than None is refused rather than ignored."""
    if test is not None or refs is not None:
        raise ValueError("Cider: test and refs are not used (pycocoevalcap ignores them too): pass the captions to "
                         "compute_score(gts, res)")
    if metric is None:
        options = {"n": n, "sigma": sigma, **options}
    CapevalScorer.__init__(self, resolver, metric, assume_written=assume_written, **options)


def _meteor_del(self) -> None:
    """pycocoevalcap's ``Meteor().__del__()`` ends the scorer's own JVM; here the JVM is the process's, shared
    by every METEOR scorer, and ends with the process (``capeval_plugins.resources.java.METEOR.stop()`` ends it
    sooner), so calling this changes nothing and costs nothing."""


# pycocoevalcap's scorers' other methods and signatures, on capeval's scorers of the same metric (its loops and RL
# rewards call them: Rouge().calc_score per sample, Meteor()._stat, meteor.__del__() to end the JVM, Cider(n, sigma))
STOCK_EXTRA_METHODS = {"rouge_l": {"calc_score": _rouge_calc_score}, "cider": {"__init__": _cider_init},
                       "meteor": {"_stat": _meteor_stat, "_score": _meteor_score, "__del__": _meteor_del}}
scorer_class = GeneratedClasses(CapevalScorer, "capeval_plugins.pycocoevalcap", coco_identifier,
                                lambda info: STOCK_EXTRA_METHODS.get(info.name, {}))
# pycocoevalcap's names where they are not a metric's own: ``Rouge`` is ROUGE-L (``Bleu`` is the class above)
STOCK_ALIASES = {"Rouge": "rouge_l"}


class COCOEvalCap(StockCOCOEvalCap):
    """Drop-in for ``pycocoevalcap.eval.COCOEvalCap`` that adds capeval scorers, and runs the stock ones faster.

    ``COCOEvalCap(coco, cocoRes, scorers=[ClipScore(resolver)])``, or ``metrics=`` with ``resolver=``: a list
    of names, or a mapping from name to that metric's options (``{"clipscore": {"model": ...}, "bleu4":
    {}}``), so image and text metrics mix. Options given as keywords go to every listed metric that takes
    them (one that none takes is an error). Stock scorers see PTB-tokenised captions as always; a scorer
    with ``wants_raw_text`` sees the captions as written. ``spice=None`` runs SPICE only where its CoreNLP
    jars are present; when they are not, it warns once, ``eval["SPICE"]`` is NaN and ``unavailable``
    says why. ``eval``, ``imgToEval`` and ``evalImgs`` are filled as the stock class fills them.
    ``fast`` (default): the stock BLEU, METEOR, ROUGE-L and CIDEr and the PTB tokenisation are capeval's
    implementation of them (the same numbers bit for bit, the same types; METEOR's jar streamed, in one JVM
    per process); ``fast=False`` runs pycocoevalcap's own classes.
    """

    def __init__(
        self,
        coco: Any,
        cocoRes: Any,
        scorers: Iterable[Any] = (),
        metrics: Iterable[str] | Mapping[str, Mapping[str, Any]] = (),
        resolver: ImageResolver | None = None,
        stock: bool = True,
        spice: bool | None = None,
        fast: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(coco, cocoRes)
        extra = [s if isinstance(s, tuple) else (s, _eval_keys(s)) for s in scorers]
        own = {registry.canonical_name(k): dict(v or {}) for k, v in metrics.items()} if isinstance(metrics, Mapping) \
            else {registry.canonical_name(k): {} for k in metrics}
        if own:
            classes = {name: registry.get(name).cls for name in own}
            for name, opts in metric_options.route(classes, options, own).items():
                scorer = scorer_class(name)(resolver=resolver, **opts)
                extra.append((scorer, EVAL_KEY.get(name, scorer.method())))
        elif options:
            raise TypeError(f"options {sorted(options)} given without metrics=")
        self.extra_scorers = extra
        self.stock = stock
        self.spice = spice
        self.fast = fast
        self.unavailable: dict[str, str] = {}

    def evaluate(self) -> None:
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

        ids = self.params["image_id"]
        gts = {i: self.coco.imgToAnns[i] for i in ids}
        res = {i: self.cocoRes.imgToAnns[i] for i in ids}
        raw_gts = {i: [a["caption"] for a in anns] for i, anns in gts.items()}
        raw_res = {i: [a["caption"] for a in anns] for i, anns in res.items()}
        print("tokenization...")
        if self.fast:  # the same tokens as stock's two calls, in one Java call
            from capeval_plugins.metrics.coco import ptb_tokenize

            tok_gts, tok_res = ptb_tokenize(raw_gts, raw_res)
        else:
            tokenizer = PTBTokenizer()
            tok_gts, tok_res = tokenizer.tokenize(gts), tokenizer.tokenize(res)
        print("setting up scorers...")
        spice = spice_available() if self.spice is None else self.spice
        stock_scorers = _stock_scorers(spice, self.fast) if self.stock else []
        if self.stock and self.spice is None and not spice:
            warn_once(("coco", "spice"), SPICE_MISSING)
            self.unavailable["SPICE"] = SPICE_MISSING
            stock_scorers.append((Unavailable("SPICE"), "SPICE"))  # stock's keys, in stock's order, NaN
        scorers = stock_scorers + self.extra_scorers
        for scorer, method in scorers:
            print("computing %s score..." % scorer.method())
            raw = getattr(scorer, "wants_raw_text", False)
            g, r = (gts, res) if raw else (tok_gts, tok_res)  # as written: COCO's own annotation dicts
            score, scores = scorer.compute_score(g, r)
            if isinstance(method, list):
                for sc, scs, m in zip(score, scores, method):
                    self.setEval(sc, m)
                    self.setImgToEvalImgs(scs, g.keys(), m)
                    print("%s: %0.3f" % (m, sc))
            else:
                self.setEval(score, method)
                self.setImgToEvalImgs(scores, g.keys(), method)
                print("%s: %0.3f" % (method, score))
        self.setEvalImgs()
