"""The classic COCO caption metrics: BLEU-1..4, METEOR, ROUGE-L, CIDEr and SPICE, with pycocoevalcap's numbers.

They are corpus metrics: CIDEr's idf runs over the references of every row and corpus BLEU pools n-gram
counts over the corpus (it is not the mean of sentence BLEU). So ``map`` keeps only the raw candidate and
reference texts, as ragged byte states (:func:`~capeval_plugins.contract.encode_texts`,
:func:`~capeval_plugins.contract.encode_text_lists`) that merge across batches and DDP ranks like any
tensor, and ``finalize`` scores the whole corpus at once, as ``COCOEvalCap.evaluate`` does: pycocoevalcap's
PTB tokenisation (Stanford PTBTokenizer, lowercased, punctuation dropped), then the scorer.

The work is done once per pass, not once per metric: the corpus is prepared (decoded, PTB-tokenised in one
Java call as pycocoevalcap's two calls tokenise it, identical rows merged, n-grams numbered) once and remembered
by the content of its states (:func:`prepared`), so the classic metrics of one pass share it. BLEU, ROUGE-L and CIDEr-D are
computed by :mod:`capeval_plugins.core.coco_text` (pycocoevalcap's arithmetic, bit for bit, vectorised);
METEOR and SPICE are the jars pycocoevalcap ships, METEOR through :mod:`capeval_plugins.resources.java`
(streamed requests, bounded waits). pycocoevalcap provides the jars; it is imported lazily.
"""
from __future__ import annotations

import abc
import importlib.util
import math
import os
import subprocess
import sys
import tempfile
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator, Sequence

import numpy as np
import xxhash

from capeval_plugins.contract import (INDEX, TEXT_STATE, Batch, Metric, MetricConfig, MetricInfo, MetricResult,
                                      PackedTexts, Requirement, StateSpec, bounded, decode_text_lists, decode_texts,
                                      encode_text_lists, encode_texts)
from capeval_plugins.resources import java
from capeval_plugins.core.coco_text import CocoCorpus, rows_from_ids
from capeval_plugins.resources.java import QUIET_ENV, require_java
from capeval_plugins.core.messages import MissingExtra, install_extra
from capeval_plugins.core.arrays import host

PYCOCOEVALCAP = "https://github.com/salaniz/pycocoevalcap"
TEXT = TEXT_STATE

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
    # n-gram orders 1..n; orders past the longest caption add zero terms and are not computed (core/coco_text.py)
    n: int = bounded(4, ge=1, le=1_000_000)
    # standard deviation of the Gaussian length penalty (CIDEr-D); sigma**2 must neither underflow to 0 nor
    # overflow to infinity (sigma 1e200: an OverflowError inside the scoring)
    sigma: float = bounded(6.0, ge=1e-150, le=1e150)


IMPLEMENTATIONS = ("pycocoevalcap", "nltk")


@dataclass
class BleuConfig(CocoConfig):
    # "pycocoevalcap" (COCOEvalCap's Bleu) or "nltk": NLTK's BLEU on lowercased NLTK word tokens, per sample
    # sentence_bleu with smoothing method1 and the corpus score corpus_bleu (Redemption Score's Table 2);
    # ``tokenize`` (PTB) does not apply to it.
    implementation: str = "pycocoevalcap"

    def __post_init__(self) -> None:
        _check_implementation(self.implementation)


@dataclass
class MeteorConfig(CocoConfig):
    # METEOR JVMs the distinct segments are spread over, then one EVAL over every segment's statistics; at most
    # one per CPU the process may use (resources/java.py bounded_jvms: a config travels between machines).
    jvms: int = bounded(1, ge=1)
    # The paraphrase table METEOR's JVM loads: "corpus", the entries the corpus can use (the same scores, a
    # fraction of a second to load; resources/meteor_table.py), or "full", the jar's own (6-7 s of CPU to load).
    paraphrases: str = "corpus"
    # "pycocoevalcap" (METEOR 1.5, Java) or "nltk": NLTK's meteor_score as Hugging Face evaluate's "meteor"
    # runs it (WordNet synonyms, alpha 0.9, beta 3, gamma 0.5, the best reference), the corpus score the mean
    # (Redemption Score's Table 2); ``tokenize``, ``jvms`` and ``paraphrases`` do not apply to it.
    implementation: str = "pycocoevalcap"

    def __post_init__(self) -> None:
        if self.paraphrases not in java.PARAPHRASES:
            raise ValueError(f"meteor: paraphrases must be one of {java.PARAPHRASES}, got {self.paraphrases!r}")
        _check_implementation(self.implementation)


def _check_implementation(value: str) -> None:
    if value not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {value!r}")


# --- NLTK's BLEU and METEOR (the implementation="nltk" readings) ----------------------------------------------


def nltk_tokens(texts: Sequence[str]) -> dict[str, list[str]]:
    """Each distinct text lowercased and split by NLTK's word tokenizer (``word_tokenize`` within a sentence;
    captions are one sentence, and its sentence splitter needs data NLTK downloads)."""
    from nltk.tokenize import NLTKWordTokenizer

    tokenizer = NLTKWordTokenizer()
    return {text: tokenizer.tokenize(text.lower()) for text in dict.fromkeys(texts)}


def nltk_bleu(candidates: Sequence[str], references: Sequence[Sequence[str]], order: int
              ) -> tuple[float, np.ndarray]:
    """(corpus_bleu, sentence_bleu per row with smoothing method1), uniform weights up to ``order``."""
    from nltk.translate.bleu_score import SmoothingFunction, corpus_bleu, sentence_bleu

    tokens = nltk_tokens(list(candidates) + [r for refs in references for r in refs])
    hyps = [tokens[c] for c in candidates]
    refs = [[tokens[r] for r in group] for group in references]
    weights = (1.0 / order,) * order
    smooth = SmoothingFunction().method1
    per_row: dict[tuple, float] = {}
    for c, group, hyp, ref in zip(candidates, references, hyps, refs):
        key = (c, tuple(group))
        if key not in per_row:
            per_row[key] = sentence_bleu(ref, hyp, weights, smoothing_function=smooth)
    scores = np.array([per_row[(c, tuple(g))] for c, g in zip(candidates, references)], dtype=np.float64)
    return float(corpus_bleu(refs, hyps, weights)), scores


def nltk_meteor(candidates: Sequence[str], references: Sequence[Sequence[str]]) -> tuple[float, np.ndarray]:
    """(mean, meteor_score per row against all its references), NLTK's defaults."""
    from nltk.corpus import wordnet
    from nltk.translate.meteor_score import meteor_score

    from capeval_plugins.inputs import InputError

    tokens = nltk_tokens(list(candidates) + [r for refs in references for r in refs])
    per_row: dict[tuple, float] = {}
    try:
        for c, group in zip(candidates, references):
            key = (c, tuple(group))
            if key not in per_row:
                per_row[key] = meteor_score([tokens[r] for r in group], tokens[c], wordnet=wordnet)
    except LookupError:
        raise InputError("meteor: implementation='nltk' needs NLTK's WordNet data: python -m nltk.downloader "
                         "wordnet") from None
    scores = np.array([per_row[(c, tuple(g))] for c, g in zip(candidates, references)], dtype=np.float64)
    return float(scores.mean()), scores


@contextmanager
def java_output() -> Iterator[None]:
    """Around a pycocoevalcap call that starts Java itself (SPICE): under ``CAPEVAL_QUIET=1`` the process's
    stderr (which the JVM inherits) goes to a temporary file for the call, and what Java said there is
    attached to an error raised meanwhile, so nothing is lost when it matters."""
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


def _pycocoevalcap_file(*parts: str) -> str:
    """A file shipped inside pycocoevalcap (its jars), found without importing its modules."""
    spec = importlib.util.find_spec("pycocoevalcap")
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtra("the classic COCO metrics' PTB tokenizer and jars", "pycocoevalcap", "pycocoevalcap")
    return str(Path(next(iter(spec.submodule_search_locations)), *parts))


PTB_KEPT = 200_000  # keys whose PTB tokens the process remembers (a validation loop's references, every epoch)
# A line's tokens depend on what follows it (ptb_sequences), so that is in its key: (line, blank lines between
# (0, 1 or 2: more are as 2), next line), or TAIL with a sequence's last lines.
_ptb_known: dict[tuple, Any] = {}
TAIL = "tail"


def _blank(line: str) -> bool:
    return not line.translate(java.PTB_LINE_BREAKS).strip()


def ptb_keys(lines: Sequence[str]) -> tuple[list[tuple | None], int]:
    """What each line's tokens depend on, as :func:`ptb_sequences` keys them: None for a line without a token
    (white space only); ``(line, blank lines before the next, next line)`` before the tail; and where the tail
    starts: the sequence's second-to-last line with a token, after which the end of the input is near enough to
    change tokens (its key is ``(TAIL, lines from there to the end)``)."""
    blank = {line: _blank(line) for line in set(lines)}
    full = [k for k, line in enumerate(lines) if not blank[line]]
    tail = full[-2] if len(full) >= 2 else full[0] if full else len(lines)
    keys: list[tuple | None] = [None] * len(lines)
    for a, b in zip(full, full[1:]):
        if a >= tail:
            break
        keys[a] = (lines[a], min(b - a - 1, 2), lines[b])
    return keys, tail


def ptb_sequences(sequences: Sequence[Sequence[str]]) -> list[list[str]]:
    """Each sequence's lines as pycocoevalcap's ``PTBTokenizer`` tokenises them in one call over that sequence
    (Stanford PTBTokenizer, ``-preserveLines -lowerCase``, from a file that ends with the last line; its
    punctuation tokens dropped), all in one JVM. A line's tokens depend on what follows it: the lexer splits the
    final period off an abbreviation ("etc.", "u.s.", "b.") when the next line starts a sentence ("A dog",
    "The"), or at the end of the input, and splits a final ":)" there. So a line is tokenised once per
    :func:`ptb_keys` key (the line and the next one, fed with it in one file), and each sequence's tail in a file
    of its own that ends as stock's does; the tokens are remembered by key, so they are stock's for the same
    sequence whatever was tokenised before. Line breaks inside a text become spaces (as pycocoevalcap does for
    "\\n"; the others would shift every later text onto the wrong row)."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PUNCTUATIONS

    plans = [ptb_keys(seq) for seq in sequences]
    stream: list[str] = []
    slots: dict[tuple, int] = {}
    tails: dict[tuple, tuple[str, ...]] = {}

    def new(key: tuple | None) -> bool:
        return key is not None and key not in _ptb_known and key not in slots

    for seq, (keys, tail) in zip(sequences, plans):
        full = [k for k in range(tail) if keys[k] is not None]
        for at, k in enumerate(full):
            key = keys[k]
            if not new(key):
                continue
            line, gap, following = key
            slots[key] = len(stream)
            stream.append(line)
            nxt = keys[full[at + 1]] if at + 1 < len(full) else None
            if not (gap == 0 and new(nxt) and nxt[0] == following):  # else the next line emitted is its context
                stream += [""] * gap + [following]
        ending = (TAIL, tuple(seq[tail:]))
        if tail < len(seq) and ending not in _ptb_known:
            tails[ending] = ending[1]
    punctuation = frozenset(PUNCTUATIONS)

    def cleaned(line: str) -> str:
        return " ".join(w for w in line.rstrip().split(" ") if w not in punctuation)

    texts = ["".join(line.translate(java.PTB_LINE_BREAKS) + "\n" for line in stream)] if stream else []
    texts += ["\n".join(line.translate(java.PTB_LINE_BREAKS) for line in lines) for lines in tails.values()]
    made = java.ptb_files(texts, _pycocoevalcap_file("tokenizer", "stanford-corenlp-3.4.1.jar")) if texts else []
    found: dict[tuple, Any] = {}
    if stream:
        out = made.pop(0)
        _check_line_count(out, len(stream), exact=True)
        found.update({key: cleaned(out[at]) for key, at in slots.items()})
    for ending, out in zip(tails, made):
        _check_line_count(out, len(ending[1]), exact=False)
        found[ending] = tuple(cleaned(t) for t in [*out, *[""] * (len(ending[1]) - len(out))][:len(ending[1])])
    remember_ptb(found)

    def tokens(key: tuple) -> Any:
        return found[key] if key in found else _ptb_known[key]

    result = []
    for seq, (keys, tail) in zip(sequences, plans):
        ending = tokens((TAIL, tuple(seq[tail:]))) if tail < len(seq) else ()
        result.append([*("" if key is None else tokens(key) for key in keys[:tail]), *ending])
    return result


def _check_line_count(out: list[str], sent: int, exact: bool) -> None:
    """The tokenizer writes a line per line it is given, each ended, but for the last line of a file that ends
    without one (a tail), which ends its output, or is missing when it holds no token: anything else would put
    tokens on the wrong rows."""
    ended = len(out) > 1 and out[-1] == ""
    made = len(out) - 1 if exact or ended else len(out)
    if (exact and not (ended and made == sent)) or not exact and not sent - 1 <= made <= sent:
        raise java.ExternalToolError(f"the PTB tokenizer returned {made} lines for {sent} captions")


def ptb_texts(texts: Sequence[str]) -> list[str]:
    """The PTB tokens of ``texts``, as one ``PTBTokenizer`` call over them in this order gives them
    (:func:`ptb_sequences`)."""
    return ptb_sequences([texts])[0]


def remember_ptb(tokens: dict[tuple, Any]) -> None:
    """Remember PTB tokens by :func:`ptb_keys` key (as :func:`ptb_sequences` gives them), so that the process
    does not tokenise them again: the jar and its options are fixed, and the key holds all of the input that can
    change them. At most :data:`PTB_KEPT` are kept: more than that are not remembered, fewer replace those
    remembered before them when together they would be more."""
    if len(tokens) > PTB_KEPT:
        return
    if len(_ptb_known) + len(tokens) > PTB_KEPT:
        _ptb_known.clear()
    _ptb_known.update(tokens)


def ptb_tokenize(*captions: dict[Any, list[str]]) -> Any:
    """pycocoevalcap's ``PTBTokenizer().tokenize`` of each ``{id: [captions]}`` (one call each, as stock makes
    them; :func:`ptb_sequences`), without its temporary file: one dict for one, a tuple for several."""
    tokens = ptb_sequences([[c for caps in texts.values() for c in caps] for texts in captions])
    out = []
    for texts, made in zip(captions, tokens):
        made = iter(made)
        out.append({key: [next(made) for _ in caps] for key, caps in texts.items()})
    return out[0] if len(out) == 1 else tuple(out)


# ---------------------------------------------------------------------------------------------- the corpus

_prepared: OrderedDict[str, CocoCorpus] = OrderedDict()
_prepared_lock = threading.Lock()
PREPARED_KEPT = 2  # corpora remembered: the metrics of one pass finalise the same one


def prepared(candidates: Any, references: Any, tokenize: bool) -> CocoCorpus:
    """The corpus of a COCO metric's state (decoded, PTB-tokenised if asked, rows merged, ready for every
    classic metric), built once and remembered by the content of the state: every classic metric of a pass
    finalises the same texts, so the tokenizer and the n-gram counts run once per pass, not once per
    metric. (A digest of the state's bytes is cheap; the texts themselves are not re-encoded.)"""
    digest = xxhash.xxh3_128()
    for state in (candidates, references):
        for tensor in (state.data, state.lengths) if isinstance(state, PackedTexts) else (state,):
            array = np.ascontiguousarray(host(tensor))
            digest.update(repr((array.shape, array.dtype.str)).encode())
            digest.update(memoryview(array).cast("B"))
    key = f"{digest.hexdigest()}:{bool(tokenize)}"
    with _prepared_lock:
        corpus = _prepared.get(key)
        if corpus is None:
            corpus = _corpus_of_state(candidates, references, tokenize)
            _prepared[key] = corpus
            while len(_prepared) > PREPARED_KEPT:
                _prepared.popitem(last=False)
        _prepared.move_to_end(key)
    return corpus


def _corpus_of_state(candidates: Any, references: Any, tokenize: bool) -> CocoCorpus:
    """The corpus of packed states: every distinct text decoded once, the rows as arrays of text ids (no Python
    object per row: the texts are split a block of rows at a time). PTB tokens are pycocoevalcap's loop's: its
    call over the references (row after row) and its call over the candidates (:func:`ptb_sequences`)."""
    ids: dict[bytes, int] = {}
    cand = _text_ids(_packed(candidates), ids, item_end=None)
    refs = _packed(references)
    _check_text_lists(refs)
    ref_ids = _text_ids(refs, ids, item_end=ITEM_END)
    ends = np.flatnonzero(refs.data == ITEM_END)  # where each reference ends
    per_row = np.diff(np.searchsorted(ends, _starts(refs)))  # references of each row
    texts = [t.decode("utf-8") for t in ids]
    del ids
    if tokenize:
        ref_tokens, cand_tokens = ptb_sequences([[texts[i] for i in ref_ids.tolist()],
                                                 [texts[i] for i in cand.tolist()]])
        numbers: dict[str, int] = {}
        cand = np.fromiter((numbers.setdefault(t, len(numbers)) for t in cand_tokens), np.int64, len(cand_tokens))
        ref_ids = np.fromiter((numbers.setdefault(t, len(numbers)) for t in ref_tokens), np.int64, len(ref_tokens))
        texts = list(numbers)
    offsets = np.zeros(len(per_row) + 1, dtype=np.int64)
    np.cumsum(per_row, out=offsets[1:])
    return CocoCorpus(rows_from_ids(texts, cand, ref_ids, offsets))


ITEM_END = 0xFF  # ends every text of a text-list state (contract.encode_text_lists)
BLOCK_BYTES = 1 << 22  # bytes of a state split into Python strings at a time


def _packed(state: Any) -> PackedTexts:
    return state if isinstance(state, PackedTexts) else PackedTexts.join([state])


def _starts(state: PackedTexts) -> np.ndarray:
    out = np.zeros(len(state) + 1, dtype=np.int64)
    np.cumsum(state.lengths, out=out[1:])
    return out


def _check_text_lists(state: PackedTexts) -> None:
    """A text-list row ends its last text with 0xFF (a state saved in another format does not)."""
    data, bounds = state.data, _starts(state)
    filled = np.flatnonzero(np.diff(bounds))
    if len(filled) and not bool((data[bounds[filled + 1] - 1] == ITEM_END).all()):
        raise ValueError("a text-list state row does not end its last text with 0xFF (saved in another format?)")


def _text_ids(state: PackedTexts, ids: dict[bytes, int], item_end: int | None) -> np.ndarray:
    """The id in ``ids`` (distinct texts as bytes, numbered as they first appear) of every text of ``state``:
    one per row (``item_end`` None), or every text ending in byte ``item_end``. A few MB of rows at a time."""
    data, bounds = state.data, _starts(state)
    out, row = [], 0
    while row < len(state):
        stop = max(int(np.searchsorted(bounds, bounds[row] + BLOCK_BYTES, side="right")) - 1, row + 1)
        stop = min(stop, len(state))
        chunk = data[bounds[row]:bounds[stop]]
        if item_end is None:  # rows hold no zero byte: mark each row's end with one
            marked = np.zeros(len(chunk) + stop - row, dtype=np.uint8)
            lengths = np.diff(bounds[row:stop + 1])
            keep = np.ones(len(marked), dtype=bool)
            keep[np.cumsum(lengths + 1) - 1] = False
            marked[keep] = chunk
            items = marked.tobytes().split(b"\x00")[:-1]
        else:
            items = chunk.tobytes().split(bytes([item_end]))[:-1]
        out.append(np.fromiter((ids.setdefault(item, len(ids)) for item in items), np.int64, len(items)))
        row = stop
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


_last_states: tuple[list, Any, dict[str, Any]] | None = None


def _text_states(candidates: list[str], references: Any) -> dict[str, Any]:
    """A batch's text states. The classic metrics of a pass map the same batch one after another, and get the
    same state objects (texts equal, compared one by one: the same strings compare at once), so a pass keeps
    one copy of its texts, not one per metric."""
    global _last_states
    last = _last_states
    if last is not None and last[0] == candidates and last[1] == references:
        return dict(last[2])
    states = {"candidate": encode_texts(candidates, packed=True),
              "references": encode_text_lists(references, packed=True)}
    _last_states = (list(candidates), [list(r) for r in references] if references is not None else None, states)
    return dict(states)


def forget_prepared() -> None:
    """Drop the remembered corpora, batch states and PTB tokens (a fresh run's cost, e.g. in benchmarks)."""
    global _last_states
    with _prepared_lock:
        _prepared.clear()
        _last_states = None
    _ptb_known.clear()


class CocoMetric(Metric):
    """A classic COCO metric over the whole corpus; subclasses implement ``score_corpus``."""

    Config = CocoConfig
    host_contract = True  # text states only, read as numpy: a run of the classic metrics imports no torch
    java_name: ClassVar[str] = ""  # set where the metric itself runs a jar (the preflight checks for Java)

    def requirements(self) -> list[Requirement]:
        needs = super().requirements()
        if self.config.tokenize or self.java_name:  # the jars are pycocoevalcap's (an extra)
            needs.append(Requirement("module", "pycocoevalcap", self.java_name or "PTB tokenisation",
                                     install_extra("pycocoevalcap")))
        if self.config.tokenize:
            needs.append(Requirement("java", "PTB tokenisation", remedy="pass tokenize=False for text that is "
                                     "already tokenised"))
        if self.java_name:
            needs.append(Requirement("java", self.java_name))
        return needs

    def states(self) -> dict[str, StateSpec]:
        return {"candidate": TEXT, "references": TEXT}

    def blank_references_allowed(self) -> bool:
        # text given as PTB tokens: a blank reference is what PTB made of "..." or of emoji only, and pycocoevalcap
        # scores it (it matches nothing; its length counts in BLEU's closest reference length)
        return not self.config.tokenize and getattr(self.config, "implementation", "pycocoevalcap") == "pycocoevalcap"

    def map(self, batch: Batch) -> dict[str, Any]:
        return _text_states(batch.candidates, batch.references)

    def finalize(self, state: dict[str, Any]) -> MetricResult:
        if not len(state[INDEX]):
            return MetricResult(self.info.name, math.nan, np.zeros(0, dtype=np.float64), state[INDEX])
        corpus = prepared(state["candidate"], state["references"], self.config.tokenize)
        score, scores, corpus_extras = self.score_corpus(corpus, state)
        return MetricResult(
            name=self.info.name,
            score=float(score),
            scores=np.asarray(scores, dtype=np.float64),
            indices=state[INDEX],
            corpus_extras=corpus_extras,
        )

    @abc.abstractmethod
    def score_corpus(self, corpus: CocoCorpus, state: dict[str, Any]) -> tuple[float, Any, dict]:
        """``(corpus score, per-row scores in row order, corpus extras)``."""


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


class NltkReading(CocoMetric):
    """A classic metric with an ``implementation="nltk"`` reading: no PTB tokenisation and no Java then, NLTK
    instead; ``score_nltk`` scores the decoded texts."""

    def requirements(self) -> list[Requirement]:
        if self.config.implementation != "nltk":
            return super().requirements()
        return [Requirement("module", "nltk", "option implementation='nltk'", install_extra("nltk"))]

    def finalize(self, state: dict[str, Any]) -> MetricResult:
        if self.config.implementation != "nltk" or not len(state[INDEX]):
            return super().finalize(state)
        score, scores = self.score_nltk(decode_texts(state["candidate"]), decode_text_lists(state["references"]))
        return MetricResult(self.info.name, score, np.asarray(scores, dtype=np.float64), state[INDEX])

    @abc.abstractmethod
    def score_nltk(self, candidates: list[str], references: list[list[str]]) -> tuple[float, np.ndarray]:
        """``(corpus score, per-row scores)`` by NLTK."""


class _Bleu(NltkReading):
    order: ClassVar[int] = 4
    Config = BleuConfig

    def score_corpus(self, corpus, state):
        scores, per_item = corpus.bleu(4)  # pycocoevalcap's Bleu(4): BLEU-n is its n-th order
        return scores[self.order - 1], per_item[:, self.order - 1], {}

    def score_nltk(self, candidates, references):
        return nltk_bleu(candidates, references, self.order)


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


class Meteor(NltkReading):
    info = _info(
        "meteor", "METEOR",
        "METEOR 1.5 (English, normalised), the jar pycocoevalcap ships, with its command line; the corpus score "
        "is METEOR's own aggregate over all segments, not the mean of the per-sample scores.",
        METEOR_CITATION, "https://aclanthology.org/W14-3348/", {"version": "1.5", "language": "en", "norm": True})
    Config = MeteorConfig
    java_name = "METEOR"

    def score_corpus(self, corpus, state):
        rows = corpus.rows

        def compute():
            try:
                return java.METEOR.score(meteor_jar(), rows.segments(), rows.inverse.tolist(), jvms=self.config.jvms,
                                         paraphrases=self.config.paraphrases)
            except java.ExternalToolError as err:
                if getattr(err, "segment", None) is not None:  # the unique row it failed on: name a sample of it
                    row = int(np.nonzero(rows.inverse == err.segment)[0][0])
                    where = f"while scoring sample {int(state[INDEX][row])}"
                    err.add_note(f"({where})")
                    err.cli_message = f"{getattr(err, 'cli_message', err.args[0])} ({where})"
                raise

        score, scores = corpus.remember(("meteor",), compute)
        return score, scores, {}

    def score_nltk(self, candidates, references):
        return nltk_meteor(candidates, references)


def meteor_jar() -> str:
    return _pycocoevalcap_file("meteor", "meteor-1.5.jar")


class RougeL(CocoMetric):
    info = _info(
        "rouge_l", "ROUGE-L",
        "ROUGE-L F-measure (longest common subsequence, beta = 1.2, best precision and recall over the "
        "references) as pycocoevalcap computes it; the corpus score is the mean.",
        ROUGE_CITATION, "https://aclanthology.org/W04-1013/", {"beta": 1.2})

    def score_corpus(self, corpus, state):
        score, scores = corpus.rouge_l()
        return score, scores, {}


class Cider(CocoMetric):
    info = _info(
        "cider", "CIDEr",
        "CIDEr-D as pycocoevalcap computes it: tf-idf weighted n-gram (1-4) cosine with clipping and a Gaussian "
        "length penalty, x10, idf over the references of the whole corpus; the corpus score is the mean.",
        CIDER_CITATION, "https://arxiv.org/abs/1411.5726", {"n": 4, "sigma": 6.0, "variant": "CIDEr-D"},
        score_range=(0.0, 10.0))
    Config = CiderConfig

    def score_corpus(self, corpus, state):
        score, scores = corpus.cider(self.config.n, self.config.sigma)
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

    def blank_references_allowed(self) -> bool:
        return False  # SPICE parses every reference itself (tokenize does not apply): a blank one is missing

    def requirements(self) -> list[Requirement]:
        remedy = ("pycocoevalcap downloads Stanford CoreNLP 3.6.0 on first use (needs network): run "
                  "`python -c \"from pycocoevalcap.spice.spice import Spice; Spice()\"` once online, or copy them "
                  "from stanford-corenlp-full-2015-12-09.zip into that folder")
        needs = super().requirements()
        if importlib.util.find_spec("pycocoevalcap") is None:  # said by the module requirement
            return needs
        return needs + [Requirement("file", str(jar), "SPICE (Stanford CoreNLP 3.6.0)", remedy) for jar in spice_jars()]

    def score_corpus(self, corpus, state):
        from pycocoevalcap.spice.spice import Spice as CocoSpice

        require_java("SPICE")
        unique = corpus.rows.segments()
        every = [unique[r] for r in corpus.rows.inverse.tolist()]
        gts, res = {i: refs for i, (_, refs) in enumerate(every)}, {i: [c] for i, (c, _) in enumerate(every)}
        with java_output():
            try:
                _, items = CocoSpice().compute_score(gts, res)
            except subprocess.CalledProcessError as err:  # its jar failed: say so in one line, exit 2
                raise java.ExternalToolError(f"SPICE (Java) failed (exit status {err.returncode})") from err
        scores = np.array([float(item["All"]["f"]) for item in items], dtype=np.float64)
        invalid = int(np.isnan(scores).sum())
        valid = scores[~np.isnan(scores)]
        extras = {"n_invalid": float(invalid)} if invalid else {}
        return float(valid.mean()) if len(valid) else math.nan, scores, extras


METRICS = [Bleu1, Bleu2, Bleu3, Bleu4, Meteor, RougeL, Cider, Spice]
