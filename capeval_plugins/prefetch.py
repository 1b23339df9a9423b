"""Decode and preprocess the next batch's images while the model runs on this one.

Where the model is fast (a GPU), decoding JPEGs and the processor's resizing become the bottleneck of an image
metric; on a CPU they are a few percent of the time, and the same cores do both. :class:`Prefetcher` runs that
work for batch ``n + 1`` in one background thread while the caller scores batch ``n`` (PIL's decoders, numpy
and torch release the GIL for most of it), for every metric of a pass that reads pixels:

* **decoding**: the next batch's distinct images are decoded (:meth:`~capeval_plugins.inputs.ImageSource.load`,
  the same call the batch would make) and handed to the batch when it is built (:meth:`Prefetcher.loader`), so
  the pixels are the ones it would have decoded itself; an image that fails to decode fails the same way, when
  its batch is built;
* **preprocessing**: a metric that can prepare its model inputs from the images alone says so with a
  ``preprocess_images(images)`` method (CLIP-family encoders: the image processor's ``pixel_values``, kept by
  content in the encoder's :mod:`~capeval_plugins.core.shared_results`, so the model reads exactly what the
  processor gives); it is called in the same thread on the decoded images.

By default it runs only where there is something to overlap (a GPU, or CPUs beyond torch's threads: on a CPU
whose cores torch already uses, the thread only competes with the model); ``CAPEVAL_PREFETCH=1`` / ``0`` force
it. Memory is bounded: at most one batch ahead, and only when its decoded images fit :data:`MAX_BYTES` (sizes read
from the headers); a larger batch is decoded when it is built, as without prefetching. Nothing here changes a
pixel or a number: a sample's inputs are the same objects' values whether or not they were prefetched.

The session's hook is its one loop (``Session.run``, capeval_plugins/session/loop.py): ``for item, loader in prefetcher.iterate(events)``.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Sequence

MAX_BYTES = 128 << 20  # decoded pixels held for the next batch at most (the runner's batch budget)
ENV = "CAPEVAL_PREFETCH"  # "1": always, "0": never, unset or "auto": see enabled()


def enabled() -> bool:
    """Whether to prefetch: ``CAPEVAL_PREFETCH=1`` / ``0`` say so; by default only where the thread has
    something to overlap with, a GPU, or CPUs beyond torch's threads (on a CPU whose cores torch already uses,
    the thread only competes with the model: 0.87x wall on the 2-core development machine,
    benchmarks/README.md)."""
    value = os.environ.get(ENV, "auto")
    if value in ("0", "1"):
        return value == "1"
    import torch

    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - no affinity on this platform
        cpus = os.cpu_count() or 1
    return torch.cuda.is_available() or cpus > torch.get_num_threads()


class Prefetched:
    """What was prepared for one batch: its decoded images by source key (or the error decoding raised)."""

    def __init__(self, images: dict[Any, Any]) -> None:
        self.images = images

    def load(self, source: Any, fallback: Callable[[Any], Any]) -> Any:
        """The decoded image of ``source`` when prefetched (raising what decoding raised), else ``fallback``."""
        if source.key not in self.images:
            return fallback(source)
        value = self.images[source.key]
        if isinstance(value, BaseException):
            raise value
        return value


class CacheView:
    """The runner's image cache as one batch sees it: its prefetched images go through the cache (stored there
    as if decoded now, so the other metrics of the pass share them as before), the others are decoded by it."""

    def __init__(self, cache: Any, prefetched: Prefetched) -> None:
        self.cache = cache
        self.prefetched = prefetched

    def load(self, source: Any) -> Any:
        if source.key in self.prefetched.images:
            return self.cache.load(_Decoded(source, self.prefetched.images[source.key]))
        return self.cache.load(source)


class _Decoded:
    """An image source whose decoding already happened (its result, or the error it raised)."""

    def __init__(self, source: Any, value: Any) -> None:
        self.source, self.value, self.key = source, value, source.key

    def load(self) -> Any:
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)


def prepare(sources: Sequence[Any], preprocessors: Sequence[Callable[[list], Any]],
            max_bytes: int = MAX_BYTES, known: Callable[[Any], bool] = lambda key: False) -> Prefetched:
    """Decode the distinct ``sources`` (image sources of one batch) when they fit ``max_bytes``, then run each
    preprocessor on the decoded images (a preprocessor's failure is left for the batch to meet again).
    ``known(key)``: an image the cache holds already is not decoded again (nor preprocessed here)."""
    distinct = {s.key: s for s in sources if not known(s.key)}
    try:
        total = sum(s.decoded_bytes() for s in distinct.values())
    except Exception:  # noqa: BLE001 - an unreadable header: the batch finds out itself
        return Prefetched({})
    if total > max_bytes:
        return Prefetched({})
    images: dict[Any, Any] = {}
    for key, source in distinct.items():
        try:
            images[key] = source.load()
        except Exception as err:  # noqa: BLE001 - raised again where the batch would have raised it
            images[key] = err
    good = [v for v in images.values() if not isinstance(v, BaseException)]
    for preprocess in preprocessors:
        try:
            preprocess(good)
        except Exception:  # noqa: BLE001 - the metric meets it again, in its own call, and reports it there
            pass
    return Prefetched(images)


class Prefetcher:
    """Prepares the item after the current one in a background thread (see the module)."""

    def __init__(self, work: Callable[[Any], Prefetched | None]) -> None:
        self.work = work

    def iterate(self, items: Iterable[Any], images: bool = True) -> Iterator[tuple[Any, Prefetched | None]]:
        """Each item with what was prepared for it (None when nothing was), the next one being prepared
        meanwhile. Without prefetching (:func:`enabled`), or without ``images`` to decode, it yields
        ``(item, None)``."""
        items = list(items)
        if not images or len(items) < 2 or not enabled():
            for item in items:
                yield item, None
            return
        with ThreadPoolExecutor(1, thread_name_prefix="capeval-prefetch") as pool:
            pending: Future | None = pool.submit(self.work, items[0])
            for n, item in enumerate(items):
                ready, pending = pending, (pool.submit(self.work, items[n + 1]) if n + 1 < len(items) else None)
                try:
                    prepared = ready.result()
                except Exception:  # noqa: BLE001 - the batch decodes for itself
                    prepared = None
                yield item, prepared
            if pending is not None:
                pending.cancel()
