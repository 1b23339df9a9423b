"""The last results of a shared model, so that metrics putting the same question to it run it once.

Metrics of one pass already share each loaded model (:func:`capeval_plugins.resources.loading.shared`: one object per
checkpoint and options). When two of them also ask that model the same thing (FLEUR and DISCODE on one judge:
the same prompts about the same images; CLIPScore and RefCLIPScore: the same images and texts), the second gets
the first's result: the runner hands every metric the same batches in turn (batch ``k`` of each metric, one
after the other), so the few results kept here are the ones asked for next.

A result is found again only by the *content* of everything that decides it (texts, options, and each image's
pixels: a digest of the decoded bytes, a tenth of a millisecond for a photo), never by object identity, so a
different input can never get a stale answer; a value of a kind it cannot digest is simply not remembered.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable

import numpy as np
import torch
import xxhash

KEPT = 2  # results per model: the batch every metric of a pass scores in turn (and one more)


class _Unknown(Exception):
    pass


def _feed(h: "xxhash.xxh3_128", value: Any) -> None:
    """Add ``value`` to the digest ``h``, its type included; raise _Unknown for a kind not handled."""
    if value is None or isinstance(value, (bool, int, float, str)):
        h.update(f"{type(value).__name__}:{value!r};".encode("utf-8", "surrogatepass"))
    elif isinstance(value, bytes):
        h.update(b"bytes:%d;" % len(value) + value)
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__}[{len(value)}](".encode())
        for item in value:
            _feed(h, item)
        h.update(b")")
    elif isinstance(value, dict):
        h.update(f"dict[{len(value)}](".encode())
        for key in sorted(value, key=repr):
            _feed(h, key)
            _feed(h, value[key])
        h.update(b")")
    elif isinstance(value, torch.Tensor):
        _feed_array(h, value.detach().cpu().contiguous().numpy() if value.dtype != torch.bfloat16
                    else value.detach().cpu().float().contiguous().numpy(), "tensor")
    elif isinstance(value, np.ndarray):
        _feed_array(h, np.ascontiguousarray(value), "array")
    elif hasattr(value, "getbands") and hasattr(value, "tobytes"):  # a PIL image: its mode, size and pixels
        h.update(f"image:{value.mode}:{value.size};".encode())
        h.update(value.tobytes())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        h.update(f"{type(value).__qualname__}(".encode())
        for f in dataclasses.fields(value):
            _feed(h, f.name)
            _feed(h, getattr(value, f.name))
        h.update(b")")
    else:
        raise _Unknown(type(value).__name__)


def _feed_array(h: "xxhash.xxh3_128", array: np.ndarray, kind: str) -> None:
    if array.dtype == object:
        raise _Unknown("object array")
    h.update(f"{kind}:{array.dtype.str}:{array.shape};".encode())
    h.update(memoryview(array).cast("B") if array.size else b"")


def digest(*parts: Any) -> str | None:
    """A digest of ``parts`` by content, or None when one of them is of a kind this module does not digest."""
    h = xxhash.xxh3_128()
    try:
        for part in parts:
            _feed(h, part)
    except _Unknown:
        return None
    return h.hexdigest()


class Results:
    """The last :data:`KEPT` results of one shared model's call, by a digest of its inputs."""

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self.items: OrderedDict[Hashable, Any] = OrderedDict()
        self.lock = threading.Lock()
        self.hits = 0  # results handed out again (tests, benchmarks)

    def get(self, key: Hashable | None, compute: Callable[[], Any],
            serves: Callable[[Any], bool] = lambda result: True) -> Any:
        """The remembered result for ``key`` when there is one and ``serves`` accepts it, else ``compute()``
        (remembered). ``key`` None: computed, not remembered."""
        if key is None:
            return compute()
        with self.lock:
            found = self.items.get(key)
            if found is not None and serves(found):
                self.items.move_to_end(key)
                self.hits += 1
                return found
        result = compute()
        with self.lock:
            self.items[key] = result
            self.items.move_to_end(key)
            while len(self.items) > self.kept:
                self.items.popitem(last=False)
        return result

    def clear(self) -> None:
        with self.lock:
            self.items.clear()
