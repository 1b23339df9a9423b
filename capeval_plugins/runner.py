"""The one place a corpus becomes a :class:`~capeval_plugins.contract.MetricResult`: a :class:`Session`.

Every entry point scores through a session: :func:`run` (``capeval score``, ``capeval bench``, the evaluate,
pycocoevalcap, lm-eval and lmms-eval adapters, and ``Metric.__call__`` through :func:`score`), the torchmetrics
adapter's ``update`` / ``forward`` / ``compute`` and MID's reference fit. So the checks, and their errors, are
the same everywhere:

1. **open**: what every metric needs from the machine (its models, Java, extras:
   :mod:`capeval_plugins.preflight`) and the local files its options name, before any work;
2. **validate** every caption, image (file header, array layout), reference list and list length, for every
   metric, before any model is loaded. Problems are reported together, each naming the sample's own index
   (the ``ids`` given, a caption file's row, else the position in the user's lists), never a position
   inside a batch or a shard. ``on_error="skip"`` scores the rest instead and records the skipped samples,
   with their reason, in the result; then every metric's ``check_corpus`` on the samples it will score
   (MID's Gaussian needs more pairs than dimensions): one :class:`InputError` before any model loads (a
   stream, which learns its corpus batch by batch, checks it at ``compute()``, before the result);
3. **feed** batches: images decoded once for all metrics of a pass, a batch too large to hold decoded mapped
   in pieces, a failing batch bisected to its failing samples;
4. **merge** (:func:`~capeval_plugins.contract.merge_states`, the one reduce: ``"cat"`` rows concatenated,
   ``"sum"`` statistics added; per batch, per rank, across ranks) and **finalize** (rows in index order,
   repeats checked, skipped samples back in place).

:func:`run` adds the corpus loop around a session: it **shards** the samples over torch.distributed ranks
(contiguous slices, an image's captions together), **batches** them (each metric at its own batch size; the
order of the batches of all metrics is :func:`schedule`), and **checkpoints** after every batch into a run
folder, so that the same call resumes where an interrupted one stopped and ends with the same result, bit for
bit, as an uninterrupted run (see :mod:`capeval_plugins.checkpoint`). :func:`stop_on_signals` turns
SIGINT/SIGTERM into a stop after the current batch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import sys
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from capeval_plugins import prefetch, preflight
from capeval_plugins.checkpoint import Progress, RunFolderError, RunStore, batch_digest
from capeval_plugins.contract import (ON_ERROR, Batch, CorpusSize, Metric, MetricResult, PackedTexts, StateSpec,
                                      content_digest, finalize_state, full_spec, map_batch, merge_states)
from capeval_plugins.digests import ContentDigests
from capeval_plugins.files import FileError
from capeval_plugins.inputs import (ImageSource, InputError, ProblemReport, Samples, _reason, image_batches,
                                    image_runs, to_batch, validate_samples)

Describe = Callable[[int], str]


class Interrupted(Exception):
    """A signal stopped the run after a finished batch; what was done is saved in the run folder."""


@dataclass
class Corpus:
    """A corpus as given: parallel lists, the ids that name its samples (default: positions) and how an
    error describes a sample (default ``"sample <id>"``; the CLI adds the caption file's line)."""

    candidates: Sequence[Any] | None
    images: Sequence[Any] | None = None
    references: Sequence[Any] | None = None
    group_ids: Sequence[Any] | None = None
    ids: Sequence[int] | None = None
    describe: Describe | None = None

    def name(self, index: int) -> str:
        return self.describe(index) if self.describe else f"sample {index}"

    def digest(self, contents: ContentDigests | None = None) -> str:
        """A fingerprint of the inputs (captions, references, groups, ids, and each image by its content:
        a file's bytes, given bytes or pixels), for checkpoints."""
        contents = contents if contents is not None else ContentDigests()
        h = hashlib.sha256()
        n = len(self.candidates) if self.candidates is not None else 0
        texts = [self.candidates, self.references, self.group_ids, self.ids]
        for i in range(n):
            row = [None if c is None else _plain(c[i]) for c in texts]
            row.append(None if self.images is None else _image_token(self.images[i], contents))
            h.update(json.dumps(row, sort_keys=True, default=str).encode())
        return h.hexdigest()


def _plain(value: Any) -> Any:
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.tolist()
    return value


def _image_token(value: Any, contents: ContentDigests) -> Any:
    """A JSON-able identity of one image as given, by content: a file by its path and bytes (hashed once per
    run), given bytes and pixels by their hash."""
    from PIL import Image

    if isinstance(value, (str, os.PathLike)):
        return contents.file(value)
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", hashlib.sha1(value).hexdigest()]
    if isinstance(value, Image.Image):
        return ["pil", value.mode, value.size, hashlib.sha1(value.tobytes()).hexdigest()]
    if isinstance(value, (np.ndarray, torch.Tensor)):
        arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
        return ["array", str(arr.dtype), list(arr.shape), hashlib.sha1(np.ascontiguousarray(arr).tobytes()).hexdigest()]
    if isinstance(value, dict):
        return {k: _image_token(v, contents) if k != "bytes" or v else None for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_image_token(v, contents) for v in value]
    return repr(value)


@dataclass
class RunOutcome:
    """Results by metric name (None on ranks other than ``gather_to``) and what the run did."""

    results: dict[str, MetricResult | None]
    batches_scored: int = 0
    batches_resumed: int = 0
    samples: int = 0
    run_id: str | None = None  # the run in the run folder, for :func:`finish`


@dataclass
class _Task:
    name: str
    metric: Metric
    samples: Samples  # this rank's share, in scoring order
    parts: list[Samples]  # its batches, in order (Session.batches)
    skipped: dict[int, str]  # left out by validation, over the whole corpus
    progress: Progress = field(default_factory=Progress)
    spec: dict[str, StateSpec] = field(default_factory=dict)

    @property
    def n_batches(self) -> int:
        return len(self.parts)

    def plan(self) -> list[str]:
        """The digest of every planned batch (its samples in order), checked against each saved record."""
        return [batch_digest(part.indices) for part in self.parts]

    def fraction_done(self) -> float:
        return 1.0 if not self.n_batches else self.progress.batches / self.n_batches


# ---------------------------------------------------------------------------------------------------------
# Validation


def policy(metric: Metric, on_error: str | None = None) -> str:
    how = on_error if on_error is not None else metric.config.on_error
    if how not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {how!r}")
    return how


def validate(metric: Metric, corpus: Corpus, on_error: str | None = None,
             checked: dict | None = None) -> tuple[Samples, dict[int, str]]:
    """The samples ``metric`` can score and the ones it skips (``{index: reason}``); with ``on_error="raise"``
    any problem raises one :class:`InputError` naming every bad sample (the first 20, then a count)."""
    samples, problems = _check(metric, corpus, checked)
    if problems and policy(metric, on_error) == "raise":
        raise problems.error(corpus.describe)
    return samples, problems.reasons()


def _check(metric: Metric, corpus: Corpus, checked: dict | None,
           shared: bool = False) -> tuple[Samples, ProblemReport]:
    """``shared``: the corpus serves several metrics, so inputs this one never uses are not its concern."""
    references = None if shared and metric.info.references == "never" else corpus.references
    return validate_samples(metric.info, corpus.images, corpus.candidates, references, corpus.group_ids,
                            corpus.ids, reader=metric.image_reader(), references_required=metric.references_required(),
                            checked=checked)


def corpus_size(samples: Samples) -> CorpusSize:
    """What :meth:`~capeval_plugins.contract.Metric.check_corpus` sees of the samples a metric will score."""
    refs = samples.references
    counts = tuple(len(r) for r in refs) if refs is not None else (0,) * len(samples)
    images = len({s.key for s in samples.images}) if samples.images is not None else None
    texts = len({r for group in refs for r in group}) if refs is not None else None
    return CorpusSize(counts, images, texts)


# What a stream (the torchmetrics adapter) keeps to check a corpus it learns batch by batch: per sample its id
# (to drop a padding sampler's repeats), its number of references, a digest of its image and of each reference
# text (zero-padded: digests are odd, never 0). Kept only for metrics that check their corpus.
SIZE_SPEC = {"_size_index": StateSpec("cat", torch.int64), "_size_references": StateSpec("cat", torch.int64),
             "_size_image": StateSpec("cat", torch.int64), "_size_texts": StateSpec("cat", torch.int64, (-1,))}


def checks_corpus(metric: Metric) -> bool:
    return type(metric).check_corpus is not Metric.check_corpus


def size_rows(samples: Samples) -> dict[str, Tensor]:
    """The :data:`SIZE_SPEC` rows of ``samples``. An image is known by its key, as :func:`corpus_size` counts
    it (a file by its path, an in-memory image by its object)."""
    n, refs = len(samples), samples.references
    odd = lambda *parts: content_digest(*parts) | 1  # noqa: E731
    images = [odd(repr(s.key)) for s in samples.images] if samples.images is not None else [0] * n
    texts = [[odd(r) for r in group] for group in refs] if refs is not None else [[] for _ in range(n)]
    width = max((len(t) for t in texts), default=0)
    return {"_size_index": torch.tensor(samples.indices, dtype=torch.int64),
            "_size_references": torch.tensor([len(t) for t in texts], dtype=torch.int64),
            "_size_image": torch.tensor(images, dtype=torch.int64),
            "_size_texts": torch.tensor([t + [0] * (width - len(t)) for t in texts], dtype=torch.int64).reshape(n, width)}


def size_of_rows(state: Mapping[str, Tensor]) -> CorpusSize:
    """The :class:`CorpusSize` of merged :data:`SIZE_SPEC` rows, each sample id counted once."""
    index = state["_size_index"].reshape(-1).cpu()
    order = torch.argsort(index, stable=True)
    keep = torch.ones(len(order), dtype=torch.bool)
    keep[1:] = index[order][1:] != index[order][:-1]
    rows = order[keep]
    counts = state["_size_references"].cpu()[rows]
    images = state["_size_image"].cpu()[rows]
    texts = state["_size_texts"].cpu()[rows]
    has_refs = bool(counts.any())
    return CorpusSize(tuple(counts.tolist()), len(torch.unique(images)) if bool(images.any()) else None,
                      len(torch.unique(texts[texts != 0])) if has_refs else None)


def check_paths(metric: Metric) -> None:
    """Options that name local files or folders (``Config.input_paths``) must exist: a typo fails here, not
    after a long load. Hub ids (``org/name``) are left to the loader."""
    from capeval_plugins.core.loading import local_path_problem

    for key in getattr(metric.config, "input_paths", ()):
        value = getattr(metric.config, key, None)
        problem = local_path_problem(value) if isinstance(value, str) and value else None
        if problem:
            raise InputError(f"{metric.info.name}: option {key}: {problem}")


# ---------------------------------------------------------------------------------------------------------
# Batching


IMAGE_CACHE_BYTES = 256 << 20  # decoded images kept for the other metrics of a pass
BATCH_IMAGE_BYTES = 128 << 20  # decoded pixels one map call holds at most (see image_pieces)


class ImageCache:
    """Decoded images shared by the batches and metrics of one pass, least recently used out first once they
    hold more than ``max_bytes`` (the latest image is always kept); an image that fails to decode fails once,
    for every metric. Images are kept as given, at full size: memory is bounded by the budgets, never by
    changing pixels."""

    def __init__(self, max_bytes: int = IMAGE_CACHE_BYTES) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.items: OrderedDict[Any, Any] = OrderedDict()
        self.sizes: dict[Any, int] = {}
        self.bytes = 0

    def load(self, source: ImageSource) -> Any:
        key = source.key
        if key in self.items:
            self.items.move_to_end(key)
        else:
            try:
                value = source.load()
            except InputError as err:
                value = err
            self.items[key] = value
            self.sizes[key] = image_bytes(value)
            self.bytes += self.sizes[key]
            while self.bytes > self.max_bytes and len(self.items) > 1:
                old, _ = self.items.popitem(last=False)
                self.bytes -= self.sizes.pop(old)
        value = self.items[key]
        if isinstance(value, InputError):
            raise value
        return value


def image_bytes(value: Any) -> int:
    """Memory held by a decoded image (or a video's frames)."""
    if isinstance(value, (list, tuple)):
        return sum(image_bytes(v) for v in value)
    if hasattr(value, "size") and hasattr(value, "getbands"):  # a PIL image
        return value.size[0] * value.size[1] * len(value.getbands())
    if isinstance(value, (Tensor, np.ndarray)):
        return int(value.nbytes) if isinstance(value, np.ndarray) else value.numel() * value.element_size()
    return 64


def image_cache(metrics: Sequence[Metric]) -> ImageCache:
    """The cache of a pass: an image is decoded once for all the pass's metrics that read pixels; with one
    such metric there is nothing to share, and only the latest image is kept."""
    readers = [m for m in metrics if m.info.images != "never" and m.image_reader() is None]
    return ImageCache(IMAGE_CACHE_BYTES if len(readers) > 1 else 0)


def image_pieces(part: Samples, max_bytes: int | None = None) -> list[Samples]:
    """``part`` as one piece, or, when its distinct images would take more than ``max_bytes`` decoded (sizes
    read from the headers), as consecutive pieces of whole images (all captions of an image in one piece)
    that each fit (an image larger than that alone): a batch of 12-megapixel photos is mapped a few photos at
    a time, at full size. A piece's scores are its samples' scores, whatever the other samples of the batch."""
    max_bytes = BATCH_IMAGE_BYTES if max_bytes is None else max_bytes
    if part.images is None:
        return [part]
    size = {s.key: s.decoded_bytes() for s in part.images}
    if sum(size.values()) <= max_bytes:
        return [part]
    piece_of: dict[Any, int] = {}
    pieces, held = 0, max_bytes + 1
    for key, nbytes in size.items():  # distinct images in order of first appearance
        if held + nbytes > max_bytes:
            pieces, held = pieces + 1, 0
        piece_of[key] = pieces - 1
        held += nbytes
    return [part.subset([p for p, s in enumerate(part.images) if piece_of[s.key] == k]) for k in range(pieces)]


def build_batch(part: Samples, cache: ImageCache, on_error: str,
                describe: Describe | None = None) -> tuple[Batch | None, dict[int, str]]:
    """The batch of ``part`` and the samples dropped because their image would not decode (``"skip"``); with
    ``"raise"`` such an image raises, naming its sample."""
    skipped: dict[int, str] = {}
    loaded: dict[Any, Any] = {}  # this batch's images, held by the batch whatever the cache evicts
    if part.images is not None:
        failed: dict[Any, str] = {}
        for source in {s.key: s for s in part.images}.values():
            try:
                loaded[source.key] = cache.load(source)
            except InputError as err:
                failed[source.key] = _reason(err, source.index)
        if failed:
            bad = [p for p, s in enumerate(part.images) if s.key in failed]
            if on_error == "raise":
                first = part.indices[bad[0]]
                name = describe(first) if describe else f"sample {first}"
                err = InputError(f"{name}: {failed[part.images[bad[0]].key]}")
                err.rank_specific = True  # found while scoring this rank's share, not by the shared validation
                raise err
            skipped = {part.indices[p]: failed[part.images[p].key] for p in bad}
            part = part.subset([p for p in range(len(part)) if p not in set(bad)])
    return (to_batch(part, lambda source: loaded[source.key]) if len(part) else None), skipped


# Failures that say nothing about a sample: not isolated by re-scoring smaller batches.
NOT_A_SAMPLE_FAULT = (MemoryError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))  # torch < 2.5


def map_part(metric: Metric, part: Samples, cache: ImageCache, on_error: str,
             describe: Describe | None = None) -> tuple[list[dict[str, Tensor]], dict[int, str]]:
    """Map the samples of one batch: the mapped states (one dict per batch actually scored) and the samples
    left out with their reasons. A sample whose image will not decode is handled by :func:`build_batch`; a
    failure while the metric scores the batch is isolated to its samples by scoring each half again
    (bisection: about log2(batch) extra calls per bad sample): under ``"skip"`` they are left out with the
    error as their reason, under ``"raise"`` the error names the first one by the user's own index. When no
    sample of a batch of several scores alone, the metric fails, not a sample: that error is raised. A batch
    whose images are too large to hold decoded at once is mapped in pieces of whole images
    (:func:`image_pieces`)."""
    outs, skipped = [], {}
    for piece in image_pieces(part):
        o, s = _map_piece(metric, piece, cache, on_error, describe, top=True)
        outs += o
        skipped.update(s)
    return outs, skipped


def _map_piece(metric: Metric, part: Samples, cache: ImageCache, on_error: str, describe: Describe | None,
               top: bool = False) -> tuple[list[dict[str, Tensor]], dict[int, str]]:
    batch, skipped = build_batch(part, cache, on_error, describe)
    if batch is None:
        return [], skipped
    try:
        return [map_batch(metric, batch)], skipped
    except NOT_A_SAMPLE_FAULT:
        raise
    except Exception as err:
        kept = part.subset([p for p, i in enumerate(part.indices) if i not in skipped]) if skipped else part
        outs, failed = _isolate(metric, kept, cache, on_error, describe, err)
        if top and not outs and len(kept) > 1:
            if hasattr(err, "add_note"):
                err.add_note(f"(while {metric.info.name} scored samples {min(kept.indices)}..{max(kept.indices)}: "
                             "each one fails alone too)")
            raise err
        return outs, {**skipped, **failed}


def _isolate(metric: Metric, part: Samples, cache: ImageCache, on_error: str, describe: Describe | None,
             err: Exception) -> tuple[list[dict[str, Tensor]], dict[int, str]]:
    if len(part) == 1:
        index = part.indices[0]
        name = describe(index) if describe else f"sample {index}"
        if isinstance(err, InputError):  # the metric found a problem of this sample's input
            reason = f"{' '.join(_reason(err, index).split())} ({metric.info.name}, found while scoring)"
        else:
            reason = f"{metric.info.name} failed while scoring it: {type(err).__name__}: {' '.join(str(err).split())}"
        if on_error == "skip":
            return [], {index: reason}
        if isinstance(err, InputError):
            raise InputError(f"{name}: {reason}") from err
        if hasattr(err, "add_note"):
            err.add_note(f"(while {metric.info.name} scored {name})")
        raise err
    half = len(part) // 2
    outs, skipped = [], {}
    for piece in (part.subset(range(half)), part.subset(range(half, len(part)))):
        o, s = _map_piece(metric, piece, cache, on_error, describe)
        outs += o
        skipped.update(s)
    return outs, skipped


# The package's own metrics: their row order is checked by the test suite (tests/test_resume_every_metric.py runs
# check_row_order on each), not at run time, where the probe's extra calls would break "each input encoded once".
OWN_METRICS = "capeval_plugins.metrics."


class RowOrderError(RuntimeError):
    """A metric's ``map`` returned its rows in another order than its batch's samples: every score would be
    filed under another sample."""


def check_row_order(metric: Metric, part: Samples, cache: ImageCache, strict: bool = False) -> None:
    """Map up to three samples of ``part`` (first, middle, last) and the same samples rotated by one: each
    ``"cat"`` state of the metric must come back rotated the same way (texts byte for byte, numbers to float32
    precision: padding may differ in the last bits), or the metric files scores under the wrong samples,
    which no shape check can see (a reversal, a sort). The same samples in both calls, so a row that depends
    on its batch's other samples (a group) sees the same ones. Run once per metric of a session: two small
    extra ``map`` calls; samples that fail to map are left to the batch. A session runs it on the first batch of
    every metric but the package's own (see :data:`OWN_METRICS`)."""
    picked = sorted({0, len(part) // 2, len(part) - 1})
    order = list(range(len(picked)))
    rotated = order[1:] + order[:1]
    try:
        batches = [build_batch(part.subset([picked[i] for i in o]), cache, "skip")[0] for o in (order, rotated)]
        if any(b is None or len(b) != len(order) for b in batches):
            return
        straight, turned = (map_batch(metric, b) for b in batches)
    except Exception:  # noqa: BLE001  (the batch itself reports it, per the policy)
        if strict:  # a test of the metric: nothing left unchecked
            raise
        return
    back = torch.tensor([rotated.index(i) for i in order])  # row of sample i in the rotated call
    for key, want in metric.states().items():
        if want.reduce != "cat":
            continue
        a, b = straight[key], turned[key]
        if want.text or isinstance(a, PackedTexts):
            rows = _text_rows(b)
            same = _text_rows(a) == [rows[j] for j in back.tolist()]
        else:
            a, b = a.detach().cpu().double(), b.detach().cpu().double()[back]
            same = a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True))
        if not same:
            raise RowOrderError(
                f"{metric.info.name}.map returned the rows of state {key!r} in another order than its batch's "
                "samples (the same samples mapped in another order did not move with them): rows must follow "
                "batch.candidates")


def _text_rows(value: Any) -> list[bytes]:
    return value.rows() if isinstance(value, PackedTexts) else PackedTexts.join([value]).rows()


# ---------------------------------------------------------------------------------------------------------
# Merging and finalizing


def finalize(metric: Metric, state: Mapping[str, Tensor], skipped: Mapping[int, str] | None = None,
             allowed_repeats: int | None = 0) -> MetricResult:
    """Finalize a merged state and put the skipped samples back (NaN, with their reasons). ``allowed_repeats``:
    how many sample ids may come twice (the same sample: a padding sampler's repeats, at most world size - 1;
    the runner shards without repeats: 0); more, or an id repeated with other content, is an error naming
    the ids (see :func:`~capeval_plugins.contract.canonical_state`)."""
    return finalize_state(metric, state, allowed_repeats).with_skipped(dict(skipped or {}))


# ---------------------------------------------------------------------------------------------------------
# The session


class Session:
    """One streaming pass of some metrics over samples that arrive in batches: the only corpus loop.

    ``Session(metrics)`` opens it: every metric's local paths and machine requirements are checked before any
    work. Then :meth:`validate` a corpus (or one batch of a stream) and :meth:`check_fits` the samples each
    metric will score, :meth:`feed` it batch by batch, :meth:`merge` what the batches (and the ranks) gave and
    :meth:`finalize`. :func:`run` drives one over a whole corpus with shards and checkpoints; the torchmetrics
    adapter over the batches of ``update()``; MID's ``fit_reference`` through :meth:`fold`. Images decoded for
    one metric are kept for the others of the session (:func:`image_cache`)."""

    def __init__(self, metrics: Mapping[str, Metric], *, on_error: str | None = None,
                 describe: Describe | None = None) -> None:
        if not metrics:
            raise ValueError("no metric to run")
        self.metrics = dict(metrics)
        self.on_error = on_error
        self.describe = describe
        for metric in self.metrics.values():
            policy(metric, on_error)
            check_paths(metric)
        preflight.check(self.metrics)  # models, Java, extras: before any work
        self.cache = image_cache(list(self.metrics.values()))
        self._specs: dict[str, dict[str, StateSpec]] = {}
        self._order_checked: set[str] = set()

    def policy(self, name: str) -> str:
        return policy(self.metrics[name], self.on_error)

    def validate(self, corpus: Corpus) -> dict[str, tuple[Samples, dict[int, str]]]:
        """Every metric's valid samples and the ones it skips (``{index: reason}``); the problems of every
        metric whose policy is ``"raise"``, reported together in one :class:`InputError`."""
        checked: dict = {}
        report, out = ProblemReport(), {}
        for name, metric in self.metrics.items():
            samples, problems = _check(metric, corpus, checked, shared=len(self.metrics) > 1)
            if problems and self.policy(name) == "raise":
                report.merge(problems)
            out[name] = (samples, problems.reasons())
        if report:
            raise report.error(corpus.describe or self.describe)
        return out

    def check_fits(self, sizes: Mapping[str, CorpusSize]) -> None:
        """Every metric's :meth:`~capeval_plugins.contract.Metric.check_corpus` on the samples it will score
        (the whole corpus: corpus statistics merge over ranks); the problems, one line each, raise one
        :class:`InputError`."""
        problems = []
        for name, size in sizes.items():
            problem = self.metrics[name].check_corpus(size)
            if problem is not None:
                problems.append(problem.message(name))
        if problems:
            raise InputError("; ".join(problems))

    def spec(self, name: str) -> dict[str, StateSpec]:
        """The metric's states with the contract's own (building them may load its model: only after the
        checks)."""
        if name not in self._specs:
            self._specs[name] = full_spec(self.metrics[name])
        return self._specs[name]

    def batches(self, name: str, samples: Samples) -> list[Samples]:
        """``samples`` in the metric's batches (not yet decoded), an image's captions together: a batch ends at
        an image boundary wherever the next image does not fit (:func:`~capeval_plugins.inputs.image_batches`)."""
        return [samples.subset(positions) for positions in image_batches(samples, self.metrics[name].config.batch_size)]

    def prefetch(self, name: str, part: Samples) -> prefetch.Prefetched | None:
        """What the prefetch thread prepares for a batch of ``name`` (see :mod:`capeval_plugins.prefetch`): its
        images decoded (those the cache does not hold), and the metric's own ``preprocess_images`` on them where
        it has one."""
        metric = self.metrics[name]
        if part.images is None or metric.image_reader() is not None:
            return None
        hooks = [metric.preprocess_images] if hasattr(metric, "preprocess_images") else []
        return prefetch.prepare(part.images, hooks, known=lambda key: key in self.cache.items)

    def feed(self, name: str, part: Samples, ready: prefetch.Prefetched | None = None,
             ) -> tuple[dict[str, Tensor] | None, dict[int, str]]:
        """Map one batch: its state (rows, and the batch's own sums; None when no sample was scored) and the
        samples left out while scoring it, with their reasons (see :func:`map_part`). ``ready``: its images as
        :meth:`prefetch` prepared them."""
        cache = self.cache if ready is None else prefetch.CacheView(self.cache, ready)
        if name not in self._order_checked and len(part) > 1:
            self._order_checked.add(name)
            if not type(self.metrics[name]).__module__.startswith(OWN_METRICS):  # ours: checked by the suite
                check_row_order(self.metrics[name], part, self.cache)
        outs, skipped = map_part(self.metrics[name], part, cache, self.policy(name), self.describe)
        if len(outs) > 1:  # mapped in pieces (images too large together, or a failure bisected)
            return merge_states(self.spec(name), outs), skipped
        return (outs[0] if outs else None), skipped

    def merge(self, name: str, parts: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
        """:func:`~capeval_plugins.contract.merge_states` of batch, stream or rank parts, in their order."""
        return merge_states(self.spec(name), parts)

    def finalize(self, name: str, state: Mapping[str, Tensor], skipped: Mapping[int, str] | None = None,
                 allowed_repeats: int | None = 0) -> MetricResult:
        return finalize(self.metrics[name], state, skipped, allowed_repeats)

    def fold(self, corpus: Corpus, progress: bool = False, desc: str | None = None) -> dict[str, dict[str, Tensor]]:
        """Every metric's merged state over ``corpus`` in this process, not finalized (e.g. a fit to save):
        validated, checked, fed batch by batch, merged."""
        valid = self.validate(corpus)
        self.check_fits({name: corpus_size(samples) for name, (samples, _) in valid.items()})
        return {name: self.merge(name, self._stream(name, samples, progress, desc)) for name, (samples, _) in valid.items()}

    def _stream(self, name: str, samples: Samples, progress: bool, desc: str | None) -> Iterator[dict[str, Tensor]]:
        """The state of every batch of ``samples``, one at a time (the merge adds sums as they come)."""
        bar = _bar(len(samples), desc or name) if progress else None
        try:
            for part in self.batches(name, samples):
                state, _ = self.feed(name, part)
                if bar is not None:
                    bar.update(len(part))
                if state is not None:
                    yield state
        finally:
            if bar is not None:
                bar.close()

    def release(self) -> None:
        for metric in self.metrics.values():
            metric.release_corpus()


def _bar(total: int, desc: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="sample", dynamic_ncols=True)


def schedule(batches: Mapping[str, int], done: Mapping[str, int] | None = None) -> list[tuple[str, int]]:
    """The order :func:`run` scores the batches of a pass in: ``(metric, batch)`` pairs, every metric's
    batches interleaved by the fraction of its work each one completes (ties in the metrics' order), so the
    metrics of a pass advance together. ``batches``: each metric's number of batches (on this rank);
    ``done``: how many each has finished already (a resumed run)."""
    done = done or {}
    names = list(batches)
    events = sorted(((k + 1) / batches[name], i, k) for i, name in enumerate(names)
                    for k in range(done.get(name, 0), batches[name]))
    return [(names[i], k) for _, i, k in events]


# ---------------------------------------------------------------------------------------------------------
# The run


def world(shard: bool) -> tuple[int, int]:
    if shard and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _shard(samples: Samples, rank: int, size: int) -> Samples:
    """This rank's contiguous slice of the image-grouped order, cut at the image boundary nearest to an even
    split, so that no image's work is done on two ranks."""
    order, runs = image_runs(samples)
    bounds = np.concatenate([[0], np.cumsum(runs, dtype=np.int64)])

    def cut(r: int) -> int:
        target = r * len(order) // size
        right = int(np.searchsorted(bounds, target))  # bounds[right - 1] < target <= bounds[right]
        left = max(right - 1, 0)
        return int(bounds[right] if bounds[right] - target < target - bounds[left] else bounds[left])

    return samples.subset(order[cut(rank):cut(rank + 1)])


def local_inputs(metrics: Iterable[Metric]) -> list[str]:
    """The local files and folders the metrics' options name (``Config.input_paths``: models, saved fits,
    feature folders): an output must not be one of them or lie inside one."""
    found = []
    for metric in metrics:
        for key in getattr(metric.config, "input_paths", ()):
            value = getattr(metric.config, key, None)
            if isinstance(value, str) and value and os.path.exists(os.path.expanduser(value)):
                found.append(os.path.expanduser(value))
    return found


# How samples are cut into shards and batches: part of a run's fingerprint, so that a run folder whose batches
# were cut otherwise (before batches ended at image boundaries) is refused with a word naming restart, never
# resumed against another plan.
BATCH_PLAN = "image-aligned"


def fingerprint(metrics: Mapping[str, Metric], corpus: Corpus, world_size: int, on_error: str | None) -> dict:
    """What a run folder is a run of: every metric with its options, the models and data files they name (by
    content: a local folder's files are hashed, a hub id resolves to its cached commit), the inputs (by
    content, see :meth:`Corpus.digest`), the world size and how batches are cut (:data:`BATCH_PLAN`)."""
    contents = ContentDigests()  # each file hashed once in this run
    described = {}
    for name, metric in metrics.items():
        options = {**dataclasses.asdict(metric.config), **contents.options(metric.config)}
        options["on_error"] = policy(metric, on_error)
        described[name] = {"metric": f"{type(metric).__module__}.{type(metric).__qualname__}", **options}
    return {"metrics": described, "inputs": corpus.digest(contents), "world_size": world_size, "batches": BATCH_PLAN}


def gather(obj: Any, size: int, dst: int | None) -> list[Any] | None:
    """``obj`` of every rank, in rank order, on every rank (``dst`` None) or on rank ``dst`` only (None elsewhere)."""
    if size == 1:
        return [obj]
    import torch.distributed as dist

    if dst is None:
        out: list[Any] = [None] * size
        dist.all_gather_object(out, obj)
        return out
    out = [None] * size if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def _open_store(run_dir: str | os.PathLike, fp: dict, restart: bool, rank: int, size: int) -> RunStore:
    """Rank 0 locks and checks (or clears) the folder first; every rank then learns the verdict and the run
    id. Rank 0 holds the lock until the run ends."""
    store = RunStore(run_dir, rank, size)
    verdict: tuple[str, str] | tuple[str, bytes] | None = None
    error: Exception | None = None
    if rank == 0:
        try:
            store.open(fp, restart)
            verdict = (store.run_id, store.key)
        except (InputError, FileError) as err:
            error, verdict = err, (str(err), getattr(err, "cli_message", str(err)))
    verdict = gather(verdict, size, None)[0]
    if error is not None:
        raise error
    if isinstance(verdict[1], str):
        raise _RankError(*verdict)
    store.attach(*verdict)  # the run's key too: ranks on other machines need not share the user's secret
    return store


class _RankError(RunFolderError):
    """A run-folder error found on one rank, raised on every rank with both its messages."""

    def __init__(self, python_message: str, cli_message: str) -> None:
        InputError.__init__(self, python_message)
        self.text = python_message
        self._cli = cli_message

    @property
    def cli_message(self) -> str:
        return self._cli


def _load_progress(tasks: list[_Task], store: RunStore, size: int) -> None:
    """Every task's saved progress, checked against the run and its batch plan; a damaged part on any rank
    stops every rank."""
    error, mine = None, None
    try:
        for task in tasks:
            task.progress = store.load(task.name, any(s.reduce == "sum" for s in task.spec.values()), task.plan())
    except (RunFolderError, FileError) as err:
        error, mine = err, (str(err), getattr(err, "cli_message", str(err)))
    errors = [e for e in gather(mine, size, None) if e is not None]
    if error is not None:
        raise error
    if errors:
        raise _RankError(*errors[0])


def run(
    metrics: Mapping[str, Metric],
    corpus: Corpus,
    *,
    on_error: str | None = None,
    run_dir: str | os.PathLike | None = None,
    restart: bool = False,
    progress: bool = False,
    shard: bool = False,
    gather_to: int | None = None,
    stop: Callable[[], bool] | None = None,
) -> RunOutcome:
    """Score ``corpus`` with every metric in one pass (one :class:`Session`).

    ``on_error`` overrides each metric's own policy. ``run_dir``: checkpoint there after every batch and
    resume from it (a folder of another run is refused; ``restart`` clears it). ``shard``: split the work over
    torch.distributed ranks when it is initialised. ``gather_to``: the rank that finalizes (None: every
    rank). ``stop``: polled after every batch; when it says so, raise :class:`Interrupted`."""
    session = Session(metrics, on_error=on_error, describe=corpus.describe)
    valid = session.validate(corpus)
    session.check_fits({name: corpus_size(samples) for name, (samples, _) in valid.items()})
    rank, size = world(shard)
    store = _open_store(run_dir, fingerprint(metrics, corpus, size, on_error), restart, rank, size) if run_dir else None
    tasks = []
    for name, metric in metrics.items():
        mine = _shard(valid[name][0], rank, size)
        tasks.append(_Task(name, metric, mine, session.batches(name, mine), valid[name][1]))
    try:
        return _run_tasks(session, tasks, corpus, store, run_dir, progress, rank, size, gather_to, stop)
    except (RunFolderError, FileError):  # a refusal changes nothing: the folder is left as it is
        raise
    except BaseException:
        # a run that started afresh and finished no batch leaves nothing to resume (one process: other ranks
        # may have saved some); a folder that held progress is never removed by a failure
        if store is not None and size == 1 and not store.had_progress and not any(t.progress.batches for t in tasks):
            store.remove()
        raise
    finally:
        if store is not None:
            store.close()


def _run_tasks(session: Session, tasks: list[_Task], corpus: Corpus, store: RunStore | None, run_dir: Any,
               progress: bool, rank: int, size: int, gather_to: int | None,
               stop: Callable[[], bool] | None) -> RunOutcome:
    for task in tasks:
        task.spec = session.spec(task.name)  # may load the model: only now, after validation
    if store is not None:
        _load_progress(tasks, store, size)
    resumed = sum(t.progress.batches for t in tasks)
    by_name = {t.name: t for t in tasks}
    events = schedule({t.name: t.n_batches for t in tasks}, {t.name: t.progress.batches for t in tasks})
    bar = _ProgressBar(tasks, progress and rank == 0)
    interrupted, scored = False, 0
    if isinstance(stop, StopFlag):
        stop.scoring = True  # a signal now stops after the batch at work
    try:
        for task in tasks:
            _prepare_corpus(task)
        # PREFETCH HOOK (capeval_plugins/prefetch.py): the next batch's images decoded and preprocessed while
        # this one is scored
        ahead = prefetch.Prefetcher(lambda event: session.prefetch(event[0], by_name[event[0]].parts[event[1]]))
        for n, ((name, k), ready) in enumerate(ahead.iterate(events), 1):
            _score_batch(session, by_name[name], k, store, ready)
            scored += 1
            bar.update(tasks)
            if stop is not None and n < len(events) and stop():
                interrupted = True
                break
    finally:
        if isinstance(stop, StopFlag):
            stop.scoring = False
        bar.close()
        session.release()
    counts = gather((interrupted, scored, resumed), size, None)  # every rank learns whether any stopped
    scored, resumed = sum(c[1] for c in counts), sum(c[2] for c in counts)
    if any(c[0] for c in counts):
        done, total = sum(t.progress.batches for t in tasks), sum(t.n_batches for t in tasks)
        where = f", saved in {run_dir}" if run_dir else ""
        raise Interrupted(f"interrupted after {done} of {total} batches{' on this rank' if size > 1 else ''}{where}")

    results: dict[str, MetricResult | None] = {}
    stage = _FinalizeBar(tasks, progress and rank == (gather_to or 0))
    for task in tasks:
        stage.start(task.name)
        # this rank's batches (their rows, then the running sums), then the ranks in order: one reduce
        mine = (session.merge(task.name, [*task.progress.rows, task.progress.sums or {}]), task.progress.skipped)
        parts = gather(mine, size, gather_to)
        if parts is None:
            results[task.name] = None
            continue
        skipped = dict(task.skipped)
        for _, part_skipped in parts:
            skipped.update(part_skipped)
        results[task.name] = session.finalize(task.name, session.merge(task.name, [p for p, _ in parts]), skipped)
    stage.close()
    n = len(corpus.candidates) if corpus.candidates is not None else 0
    return RunOutcome(results, scored, resumed, n, store.run_id if store is not None else None)


def _prepare_corpus(task: _Task) -> None:
    """The metric's whole-corpus hook, with the text of every sample of the pass (this rank's share), the
    batches already done included: what it prepares (e.g. BERTScore's texts embedded in chunks, longest first)
    must not depend on how far a resumed run had got, so that a resumed run ends with the same bits as an
    uninterrupted one. Skipped when every batch is done."""
    if task.progress.batches < task.n_batches:
        task.metric.prepare_corpus(to_batch(dataclasses.replace(task.samples, images=None)))


def _score_batch(session: Session, task: _Task, k: int, store: RunStore | None,
                 ready: prefetch.Prefetched | None = None) -> None:
    """Feed batch ``k`` of a task (with its images ``ready`` when prefetched), add it to the task's progress
    (rows kept per batch, sums running) and save it in the run folder."""
    part = task.parts[k]
    state, skipped = session.feed(task.name, part, ready)
    cat = [key for key, want in task.spec.items() if want.reduce == "cat"]
    sum_keys = [key for key, want in task.spec.items() if want.reduce == "sum"]
    if state is None:  # every sample skipped
        rows = {key: task.spec[key].empty() for key in cat}
        sums = {}
    else:
        rows = {key: state[key].cpu() for key in cat}
        sums = {key: state[key].cpu() for key in sum_keys}
    if sum_keys:  # the running total: the sums so far, then this batch's (an empty first batch starts at zero)
        task.progress.sums = merge_states({key: task.spec[key] for key in sum_keys},
                                          [task.progress.sums or {}, sums])
    task.progress.rows.append(rows)
    task.progress.skipped.update(skipped)
    task.progress.batches = k + 1
    if store is not None:
        store.save(task.name, k, rows, task.progress.sums, skipped, batch_digest(part.indices))


class _ProgressBar:
    """One progress bar for a pass over every metric: samples/s and ETA of the slowest metric."""

    def __init__(self, tasks: list[_Task], enabled: bool) -> None:
        self.total = max((len(t.samples) for t in tasks), default=0)
        self.bar = None
        if enabled and self.total:
            from tqdm.auto import tqdm

            desc = ", ".join(t.name for t in tasks)
            self.bar = tqdm(total=self.total, initial=self._position(tasks), desc=desc, unit="sample",
                            dynamic_ncols=True)

    def _position(self, tasks: list[_Task]) -> int:
        return int(min(t.fraction_done() for t in tasks) * self.total)

    def update(self, tasks: list[_Task]) -> None:
        if self.bar is not None:
            self.bar.update(self._position(tasks) - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _FinalizeBar:
    """After the batches, the corpus step of every metric (a corpus metric's whole computation, e.g. CIDEr's
    idf or METEOR's Java scorer, happens here): one bar over the metrics, naming the one at work."""

    def __init__(self, tasks: list[_Task], enabled: bool) -> None:
        self.bar = None
        self.started = False  # ours, not tqdm's postfix: a bar disabled by TQDM_DISABLE has none
        if enabled and tasks:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=len(tasks), desc="corpus scores", unit="metric", dynamic_ncols=True)

    def start(self, name: str) -> None:
        if self.bar is not None:
            if self.started:  # the previous metric is done
                self.bar.update(1)
            self.started = True
            self.bar.set_postfix_str(name, refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.bar.total - self.bar.n)
            self.bar.set_postfix_str("done", refresh=False)
            self.bar.close()


def score_many(metrics: Mapping[str, Metric], images: Sequence[Any] | None = None,
               candidates: Sequence[str] | None = None, references: Sequence[Any] | None = None, *,
               group_ids: Sequence[Any] | None = None, ids: Sequence[int] | None = None, on_error: str | None = None,
               run_dir: str | os.PathLike | None = None, restart: bool = False, progress: bool = False,
               shard: bool = False, describe: Describe | None = None) -> dict[str, MetricResult]:
    """Score one corpus with several metrics in one pass (images decoded once, shared backbones loaded
    once). With ``run_dir``, the folder is removed once the run is complete. ``describe(index)`` names a
    sample in errors (default ``"sample <index>"``)."""
    corpus = Corpus(candidates, images, references, group_ids, ids, describe)
    outcome = run(metrics, corpus, on_error=on_error, run_dir=run_dir, restart=restart, progress=progress,
                  shard=shard)
    if run_dir is not None:
        finish(run_dir, shard, outcome.run_id)
    return outcome.results  # type: ignore[return-value]


def score(metric: Metric, images: Sequence[Any] | None = None, candidates: Sequence[str] | None = None,
          references: Sequence[Any] | None = None, **kwargs: Any) -> MetricResult:
    """Score one corpus with one metric (see :func:`score_many` for the options)."""
    return score_many({metric.info.name: metric}, images, candidates, references, **kwargs)[metric.info.name]


def finish(run_dir: str | os.PathLike, shard: bool = False, run_id: str | None = None) -> None:
    """Remove what a finished run wrote in its folder (rank 0, once every rank is done with it): the files its
    manifest lists, the folder itself only if the run made it and nothing else is in it. ``run_id`` (from
    :class:`RunOutcome`): only if the folder still holds that run; a folder another run holds now is left."""
    rank, size = world(shard)
    if size > 1:
        torch.distributed.barrier()
    if rank == 0:
        RunStore(run_dir).remove(run_id)


class StopFlag:
    """What :func:`stop_on_signals` yields (pass it as ``run(stop=...)``): true once a stop was asked for.
    While the runner scores batches (``scoring``) a signal asks for a stop after the current batch; anywhere
    else (validation, digesting inputs, loading models, the corpus step) nothing would poll it, so a signal
    stops the process at once (KeyboardInterrupt), as does a second one."""

    def __init__(self) -> None:
        self.requested = False
        self.scoring = False

    def __call__(self) -> bool:
        return self.requested


@contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """SIGINT and SIGTERM ask the run to stop after the current batch, or at once outside the batches or
    when sent twice (see :class:`StopFlag`). Outside the main thread, signals are left alone."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum: int, frame: Any) -> None:
        if flag.requested or not flag.scoring:
            raise KeyboardInterrupt
        flag.requested = True
        print(f"capeval: {signal.Signals(signum).name}: stopping after the current batch", file=sys.stderr,
              flush=True)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
