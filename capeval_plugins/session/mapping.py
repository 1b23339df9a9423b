"""One batch of one metric, mapped: its distinct images decoded once for every metric of the pass
(:class:`ImageCache`), a batch too large to hold decoded mapped in pieces of whole images (:func:`image_pieces`), a
failing batch bisected to its failing samples (:func:`map_part`), a metric's row order probed once
(:func:`check_row_order`), and a merged state finalized with the skipped samples back in place (:func:`finalize`).
The loop that feeds batches here is :mod:`capeval_plugins.session.loop`."""
from __future__ import annotations

import sys
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from capeval_plugins.contract import Batch, Metric, MetricResult, PackedTexts, finalize_state, map_batch
from capeval_plugins.core.arrays import host, is_tensor
from capeval_plugins.core.messages import ModelLoadError
from capeval_plugins.inputs import ImageSource, InputError, Samples, _reason, to_batch
from capeval_plugins.session.corpus import Describe

if TYPE_CHECKING:
    from torch import Tensor

IMAGE_CACHE_BYTES = 256 << 20  # decoded images kept for the other metrics of a pass
BATCH_IMAGE_BYTES = 128 << 20  # decoded pixels one map call holds at most (see image_pieces)


TEXT_BATCHES_KEPT = 16  # text-only batches kept for the other metrics of a pass (the same samples: one build)


class ImageCache:
    """Decoded images shared by the batches and metrics of one pass, least recently used out first once they
    hold more than ``max_bytes`` (the latest image is always kept); an image that fails to decode fails once,
    for every metric. Images are kept as given, at full size: memory is bounded by the budgets, never by
    changing pixels. The last text-only batches built (``texts``) are kept too: the metrics of a pass that read
    the same samples' texts (the classic metrics) share one batch, its content digests computed once."""

    def __init__(self, max_bytes: int = IMAGE_CACHE_BYTES) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.items: OrderedDict[Any, Any] = OrderedDict()
        self.sizes: dict[Any, int] = {}
        self.bytes = 0
        self.texts: OrderedDict[tuple, Batch] = OrderedDict()

    def text_batch(self, part: Samples) -> Batch:
        """The batch of ``part`` (no images), built once for every metric of the pass given the same samples."""
        refs = None if part.references is None else tuple(tuple(r) for r in part.references)
        key = (tuple(part.indices), tuple(part.candidates), refs,
               None if part.group_ids is None else tuple(part.group_ids))
        batch = self.texts.get(key)
        if batch is None:
            batch = self.texts[key] = to_batch(part)
            while len(self.texts) > TEXT_BATCHES_KEPT:
                self.texts.popitem(last=False)
        return batch

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
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if is_tensor(value):
        return value.numel() * value.element_size()
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
    if not len(part):
        return None, skipped
    if part.images is None and isinstance(cache, ImageCache):
        return cache.text_batch(part), skipped
    return to_batch(part, lambda source: loaded[source.key]), skipped


def not_a_sample_fault(err: BaseException) -> bool:
    """A failure that says nothing about a sample: not isolated by re-scoring smaller batches (a model that is not
    whole fails on its first batch and stops the run, whatever --on-error says: no sample is skipped for it)."""
    torch = sys.modules.get("torch")  # an out-of-memory tensor error needs torch imported
    oom = () if torch is None else (getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError,)  # < 2.5
    return isinstance(err, (MemoryError, ModelLoadError, *oom))


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
    except Exception as err:
        if not_a_sample_fault(err):
            raise
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
    back = np.array([rotated.index(i) for i in order], dtype=np.int64)  # row of sample i in the rotated call
    for key, want in metric.states().items():
        if want.reduce != "cat":
            continue
        a, b = straight[key], turned[key]
        if want.text or isinstance(a, PackedTexts):
            rows = _text_rows(b)
            same = _text_rows(a) == [rows[j] for j in back.tolist()]
        else:
            a, b = host(a).astype(np.float64), host(b).astype(np.float64)[back]
            same = a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True))
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


