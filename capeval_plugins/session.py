"""A :class:`Session`: one streaming pass of some metrics over samples that arrive in batches, the only
corpus loop. Every entry point scores through one: :func:`capeval_plugins.runner.run` (``capeval score``,
``capeval bench``, the evaluate, pycocoevalcap, lm-eval and lmms-eval adapters, and ``Metric.__call__``), the
torchmetrics adapter's ``update`` / ``forward`` / ``compute`` and MID's reference fit. So the checks, and their
errors, are the same everywhere:

1. **open**: what every metric needs from the machine (its models, Java, extras:
   :mod:`capeval_plugins.preflight`) and the local files its options name, before any work;
2. **validate** every caption, image (file header, array layout), reference list and list length, for every
   metric, before any model is loaded. Problems are reported together, each naming the sample's own index
   (the ``ids`` given, a caption file's row, else the position in the user's lists), never a position
   inside a batch or a shard. ``on_error="skip"`` scores the rest instead and records the skipped samples,
   with their reason, in the result; then every metric's ``check_corpus`` on the samples it will score
   (MID's Gaussian needs more pairs than dimensions): one :class:`InputError` before any model loads (a
   stream, which learns its corpus batch by batch, checks it at ``compute()``, before the result);
3. **feed** batches (:meth:`Session.batches`: an image's captions together, a batch ending at an image
   boundary wherever the next image does not fit): images decoded once for all metrics of a pass, a batch
   too large to hold decoded mapped in pieces, a failing batch bisected to its failing samples;
4. **merge** (:func:`~capeval_plugins.contract.merge_states`, the one reduce: ``"cat"`` rows concatenated,
   ``"sum"`` statistics added; per batch, per rank, across ranks) and **finalize** (rows in index order,
   repeats checked, skipped samples back in place).

The corpus loop around a session (shards, the order of the batches, checkpoints) is
:mod:`capeval_plugins.runner`.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from capeval_plugins import prefetch, preflight
from capeval_plugins.contract import (ON_ERROR, Batch, CorpusSize, Metric, MetricResult, PackedTexts, StateSpec,
                                      content_digest, finalize_state, full_spec, map_batch, merge_states)
from capeval_plugins.resources.wholeness import ModelLoadError
from capeval_plugins.digests import ContentDigests
from capeval_plugins.inputs import (ImageSource, InputError, ProblemReport, Samples, _reason, image_batches,
                                    to_batch, validate_samples)

Describe = Callable[[int], str]


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
    from capeval_plugins.resources.loading import local_path_problem

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


# Failures that say nothing about a sample: not isolated by re-scoring smaller batches (a model that is not whole
# fails on its first batch and stops the run, whatever --on-error says: no sample is skipped for it).
NOT_A_SAMPLE_FAULT = (MemoryError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),  # torch < 2.5
                      ModelLoadError)


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
    :meth:`finalize`. :func:`~capeval_plugins.runner.run` drives one over a whole corpus with shards and
    checkpoints; the torchmetrics adapter over the batches of ``update()``; MID's ``fit_reference`` through
    :meth:`fold`. Images decoded for one metric are kept for the others of the session (:func:`image_cache`)."""

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
