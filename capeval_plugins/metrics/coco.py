"""The classic COCO caption metrics: BLEU-1..4, METEOR, ROUGE-L, CIDEr and SPICE, computed by pycocoevalcap.

They are corpus metrics: CIDEr's idf runs over the references of every row and corpus BLEU pools n-gram
counts over the corpus (it is not the mean of sentence BLEU). So ``map`` keeps only the raw candidate and
reference texts, as ragged byte states (:func:`~capeval_plugins.contract.encode_texts`) that merge across
batches and DDP ranks like any tensor, and ``finalize`` scores the whole corpus at once: pycocoevalcap's PTB
tokenisation (Stanford PTBTokenizer, lowercased, punctuation dropped), then its scorer, exactly as
``COCOEvalCap.evaluate`` runs them. Per-sample scores are the per-item scores pycocoevalcap returns.
pycocoevalcap is imported lazily, inside ``finalize``.
"""
from __future__ import annotations

import abc
import atexit
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator

import numpy as np
import torch
from torch import Tensor

from capeval_plugins.contract import (INDEX, Batch, Metric, MetricConfig, MetricInfo, MetricResult, Requirement,
                                      StateSpec, decode_texts, encode_texts)

PYCOCOEVALCAP = "https://github.com/salaniz/pycocoevalcap"
TEXT = StateSpec("cat", torch.uint8, (-1,))

BLEU_CITATION = """@inproceedings{papineni2002bleu,
  title     = {{BLEU}: a Method for Automatic Evaluation of Machine Translation},
  author    = {Papineni, Kishore and Roukos, Salim and Ward, Todd and Zhu, Wei-Jing},
  booktitle = {Proceedings of ACL},
  year      = {2002}
}"""
METEOR_CITATION = """@inproceedings{denkowski2014meteor,
  title     = {Meteor Universal: Language Specific Translation Evaluation for Any Target Language},
  author    = {Denkowski, Michael and Lavie, Alon},
  booktitle = {Proceedings of the Ninth Workshop on Statistical Machine Translation},
  year      = {2014}
}"""
ROUGE_CITATION = """@inproceedings{lin2004rouge,
  title     = {{ROUGE}: A Package for Automatic Evaluation of Summaries},
  author    = {Lin, Chin-Yew},
  booktitle = {Text Summarization Branches Out},
  year      = {2004}
}"""
CIDER_CITATION = """@inproceedings{vedantam2015cider,
  title     = {{CIDEr}: Consensus-based Image Description Evaluation},
  author    = {Vedantam, Ramakrishna and Zitnick, C. Lawrence and Parikh, Devi},
  booktitle = {Proceedings of CVPR},
  year      = {2015}
}"""
SPICE_CITATION = """@inproceedings{anderson2016spice,
  title     = {{SPICE}: Semantic Propositional Image Caption Evaluation},
  author    = {Anderson, Peter and Fernando, Basura and Johnson, Mark and Gould, Stephen},
  booktitle = {Proceedings of ECCV},
  year      = {2016}
}"""


@dataclass
class CocoConfig(MetricConfig):
    # Samples per map step: mapping only copies text, so large batches just save overhead.
    batch_size: int = 1024
    # pycocoevalcap's PTB tokenisation before scoring, as COCOEvalCap does; off for text that is already
    # tokenised (e.g. what COCOEvalCap hands its scorers).
    tokenize: bool = True


@dataclass
class CiderConfig(CocoConfig):
    n: int = 4          # n-gram orders 1..n
    sigma: float = 6.0  # standard deviation of the Gaussian length penalty (CIDEr-D)


def require_java(what: str, hint: str = "") -> None:
    if shutil.which("java") is None:
        raise RuntimeError(f"{what} needs a Java runtime (pycocoevalcap runs jars): install Java 8 or later and "
                           f"put `java` on PATH{hint}")


QUIET_ENV = "CAPEVAL_QUIET"  # set by `capeval ... --quiet`: the Java tools' own lines are not shown


@contextmanager
def java_output() -> Iterator[None]:
    """Around a pycocoevalcap call that starts Java: under ``CAPEVAL_QUIET=1`` the process's stderr (which
    the JVM inherits) goes to a temporary file for the call, and what Java said there is attached to an error
    raised meanwhile, so nothing is lost when it matters."""
    if os.environ.get(QUIET_ENV) != "1":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except Exception as err:
            os.dup2(saved, 2)
            sink.seek(0)
            said = sink.read().decode(errors="replace").strip()
            if said and hasattr(err, "add_note"):
                err.add_note(f"Java said:\n{said[-4000:]}")
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


_ptb_cache: OrderedDict[str, dict] = OrderedDict()
_ptb_lock = threading.Lock()
PTB_CACHE_SIZE = 4


def ptb_tokenize_pair(gts: dict[int, list[str]], res: dict[int, list[str]]) -> tuple[dict, dict]:
    """References and candidates PTB-tokenised in one Java call, remembered by content: every classic metric
    of one pass finalises the same corpus, so the tokenizer runs once per pass, not once (twice) per metric."""
    joint = {**{("ref", k): v for k, v in gts.items()}, **{("cand", k): v for k, v in res.items()}}
    key = hashlib.sha256(json.dumps([[list(k), v] for k, v in joint.items()], ensure_ascii=False).encode()).hexdigest()
    with _ptb_lock:
        out = _ptb_cache.get(key)
        if out is None:
            out = ptb_tokenize(joint)
            _ptb_cache[key] = out
            while len(_ptb_cache) > PTB_CACHE_SIZE:
                _ptb_cache.popitem(last=False)
        _ptb_cache.move_to_end(key)
    return ({k: list(out[("ref", k)]) for k in gts}, {k: list(out[("cand", k)]) for k in res})


def ptb_tokenize(texts: dict[Any, list[str]]) -> dict[Any, list[str]]:
    """pycocoevalcap's PTB tokenisation of ``{id: [captions]}``. Whitespace is collapsed first (the tokenizer
    reads one caption per line; a carriage return or other line break inside a caption would shift every
    later caption onto the wrong id), and the output is checked to hold every caption."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    require_java("PTB tokenisation", ", or pass tokenize=False for text that is already tokenised")
    wrapped = {k: [{"caption": " ".join(c.split())} for c in caps] for k, caps in texts.items()}
    with java_output():
        out = PTBTokenizer().tokenize(wrapped)
    for k, caps in texts.items():
        if len(out.get(k, ())) != len(caps):
            got = len(out.get(k, ()))
            raise RuntimeError(f"PTB tokenizer returned {got} captions for item {k}, expected {len(caps)}")
    return out


class CocoMetric(Metric):
    """A pycocoevalcap scorer over the whole corpus; subclasses implement ``score_corpus``."""

    Config = CocoConfig
    java_name: ClassVar[str] = ""  # set where the scorer itself runs Java

    def requirements(self) -> list[Requirement]:
        needs = super().requirements()
        if self.config.tokenize:
            needs.append(Requirement("java", "PTB tokenisation", remedy="pass tokenize=False for text that is "
                                     "already tokenised"))
        if self.java_name:
            needs.append(Requirement("java", self.java_name))
        return needs

    def states(self) -> dict[str, StateSpec]:
        return {"candidate": TEXT, "references": TEXT}

    def map(self, batch: Batch) -> dict[str, Tensor]:
        # JSON escapes control characters, so a list of references is one NUL-free string.
        refs = [json.dumps(list(r), ensure_ascii=False) for r in batch.references]
        return {"candidate": encode_texts(batch.candidates), "references": encode_texts(refs)}

    def finalize(self, state: dict[str, Tensor]) -> MetricResult:
        candidates = decode_texts(state["candidate"])
        references = [json.loads(r) for r in decode_texts(state["references"])]
        if not candidates:
            return MetricResult(self.info.name, math.nan, torch.zeros(0, dtype=torch.float64), state[INDEX])
        gts = {i: refs for i, refs in enumerate(references)}
        res = {i: [c] for i, c in enumerate(candidates)}
        if self.config.tokenize:
            gts, res = ptb_tokenize_pair(gts, res)
        if self.java_name:
            require_java(self.java_name)
        with java_output():
            score, scores, corpus_extras = self.score_corpus(gts, res)
        return MetricResult(
            name=self.info.name,
            score=float(score),
            scores=torch.as_tensor(np.asarray(scores, dtype=np.float64)),
            indices=state[INDEX],
            corpus_extras=corpus_extras,
        )

    @abc.abstractmethod
    def score_corpus(self, gts: dict[int, list[str]], res: dict[int, list[str]]) -> tuple[float, Any, dict]:
        """``(corpus score, per-item scores in id order, corpus extras)`` from pycocoevalcap."""


def _info(name: str, display: str, description: str, citation: str, paper: str, config: dict,
          score_range: tuple[float, float] | None = (0.0, 1.0)) -> MetricInfo:
    return MetricInfo(
        name=name,
        display_name=display,
        description=description,
        citation=citation,
        references="always",
        images="never",
        score_range=score_range,
        paper=paper,
        paper_config={"implementation": "pycocoevalcap", "tokenizer": "PTB (Stanford CoreNLP 3.4.1)", **config},
        text_input="ptb",
        codebase_urls=(PYCOCOEVALCAP,),
    )


class _Bleu(CocoMetric):
    order: ClassVar[int] = 4

    def score_corpus(self, gts, res):
        from pycocoevalcap.bleu.bleu import Bleu

        scores, per_item = Bleu(4).compute_score(gts, res, verbose=0)
        return scores[self.order - 1], per_item[self.order - 1], {}


def _bleu_info(n: int) -> MetricInfo:
    return _info(
        f"bleu{n}", f"BLEU-{n}",
        f"Corpus BLEU with n-grams up to {n} (Papineni et al., 2002) as pycocoevalcap computes it (closest "
        "reference length, PTB-tokenised text); per-sample scores are its sentence-level BLEU.",
        BLEU_CITATION, "https://aclanthology.org/P02-1040/", {"max_n": n, "reference_length": "closest"})


class Bleu1(_Bleu):
    order = 1
    info = _bleu_info(1)


class Bleu2(_Bleu):
    order = 2
    info = _bleu_info(2)


class Bleu3(_Bleu):
    order = 3
    info = _bleu_info(3)


class Bleu4(_Bleu):
    order = 4
    info = _bleu_info(4)


class Meteor(CocoMetric):
    info = _info(
        "meteor", "METEOR",
        "METEOR 1.5 (English, normalised) through pycocoevalcap's Java wrapper; the corpus score is METEOR's own "
        "aggregate over all segments, not the mean of the per-sample scores.",
        METEOR_CITATION, "https://aclanthology.org/W14-3348/", {"version": "1.5", "language": "en", "norm": True})
    java_name = "METEOR"

    def score_corpus(self, gts, res):
        score, scores = shared_meteor().compute_score(gts, res)
        return score, scores, {}


_meteor = None
_meteor_lock = threading.Lock()


def shared_meteor():
    """One pycocoevalcap METEOR scorer per process: its JVM takes seconds to load the paraphrase tables, so
    it is started once and reused (pycocoevalcap serialises calls with its own lock), and stopped at exit."""
    global _meteor
    from pycocoevalcap.meteor.meteor import Meteor as CocoMeteor

    with _meteor_lock:
        if _meteor is None or _meteor.meteor_p.poll() is not None:
            _meteor = CocoMeteor()
            atexit.register(_stop, _meteor.meteor_p)
        return _meteor


def _stop(process) -> None:
    # Closing stdin ends the JVM; pycocoevalcap itself would leave it to garbage collection.
    try:
        process.stdin.close()
        process.wait(timeout=30)
    except Exception:  # a JVM that does not exit on EOF
        process.kill()
        process.wait()
    for pipe in (process.stdout, process.stderr):
        pipe.close()


class RougeL(CocoMetric):
    info = _info(
        "rouge_l", "ROUGE-L",
        "ROUGE-L F-measure (longest common subsequence, beta = 1.2, best precision and recall over the "
        "references) as pycocoevalcap computes it; the corpus score is the mean.",
        ROUGE_CITATION, "https://aclanthology.org/W04-1013/", {"beta": 1.2})

    def score_corpus(self, gts, res):
        from pycocoevalcap.rouge.rouge import Rouge

        score, scores = Rouge().compute_score(gts, res)
        return score, scores, {}


class Cider(CocoMetric):
    info = _info(
        "cider", "CIDEr",
        "CIDEr-D as pycocoevalcap computes it: tf-idf weighted n-gram (1-4) cosine with clipping and a Gaussian "
        "length penalty, x10, idf over the references of the whole corpus; the corpus score is the mean.",
        CIDER_CITATION, "https://arxiv.org/abs/1411.5726", {"n": 4, "sigma": 6.0, "variant": "CIDEr-D"},
        score_range=(0.0, 10.0))
    Config = CiderConfig

    def score_corpus(self, gts, res):
        from pycocoevalcap.cider.cider import Cider as CocoCider

        score, scores = CocoCider(n=self.config.n, sigma=self.config.sigma).compute_score(gts, res)
        return score, scores, {}


def spice_jars() -> tuple[Path, ...]:
    """The Stanford CoreNLP 3.6.0 jars SPICE needs (pycocoevalcap downloads them on first use)."""
    import pycocoevalcap.spice.spice as spice

    lib = Path(spice.__file__).resolve().parent / "lib"
    return lib / "stanford-corenlp-3.6.0.jar", lib / "stanford-corenlp-3.6.0-models.jar"


class Spice(CocoMetric):
    info = _info(
        "spice", "SPICE",
        "SPICE F-score over scene-graph tuples (Anderson et al., 2016) through pycocoevalcap's Java SPICE 1.0; "
        "needs Stanford CoreNLP 3.6.0 jars next to pycocoevalcap's SPICE.",
        SPICE_CITATION, "https://arxiv.org/abs/1607.08822", {"version": "1.0"})
    java_name = "SPICE"

    def requirements(self) -> list[Requirement]:
        remedy = ("pycocoevalcap downloads Stanford CoreNLP 3.6.0 on first use (needs network): run "
                  "`python -c \"from pycocoevalcap.spice.spice import Spice; Spice()\"` once online, or copy the "
                  "jar from stanford-corenlp-full-2015-12-09.zip into that folder")
        return super().requirements() + [Requirement("file", str(jar), "SPICE (Stanford CoreNLP 3.6.0)", remedy)
                                         for jar in spice_jars()]

    def score_corpus(self, gts, res):
        from pycocoevalcap.spice.spice import Spice as CocoSpice

        _, items = CocoSpice().compute_score(gts, res)
        scores = np.array([float(item["All"]["f"]) for item in items], dtype=np.float64)
        invalid = int(np.isnan(scores).sum())
        valid = scores[~np.isnan(scores)]
        extras = {"n_invalid": float(invalid)} if invalid else {}
        return float(valid.mean()) if len(valid) else math.nan, scores, extras


METRICS = [Bleu1, Bleu2, Bleu3, Bleu4, Meteor, RougeL, Cider, Spice]
