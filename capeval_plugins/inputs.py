"""Turning user input into validated batches, in one place.

Images may be PIL images, file paths, ``{"bytes"|"path": ...}`` dicts (the ``datasets.Image`` format),
numpy arrays or torch tensors (CHW or HWC, uint8 or float in [0, 1]); a video is a list of such frames.
Captions are strings; references a list of strings per sample (a single string is one reference).
Every error names the sample index and what is wrong. Image files are checked up front and decoded lazily,
batch by batch, so a corpus of paths never sits decoded in memory.
"""
from __future__ import annotations

import hashlib
import io
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from PIL import Image

from capeval_plugins.contract import Batch, MetricInfo

_CHANNELS = (1, 3, 4)


class InputError(ValueError):
    """A user input that cannot be scored, with the sample it concerns."""


@dataclass(frozen=True)
class ImageSource:
    """One image (or video) as given, validated but not yet decoded. ``key`` identifies the same image
    given twice (same file, same object, same bytes) so its work is done once. ``reader`` is set when a
    metric reads its images its own way (see :class:`ImageReader`)."""

    kind: str
    value: Any
    key: Any
    index: int
    reader: "ImageReader | None" = field(default=None, compare=False, repr=False)

    def load(self) -> Any:
        if self.reader is not None:
            return self.reader.load(self)
        if self.kind == "video":
            return [frame.load() for frame in self.value]
        try:
            return _decode(self.kind, self.value)
        except InputError:
            raise
        except Exception as err:  # a corrupt file or buffer: name the sample, keep the cause
            where = f" {self.value}" if self.kind == "path" else ""
            raise InputError(f"sample {self.index}: cannot read image{where}: {err}") from err


class ImageReader:
    """How a metric takes its images when they are not pixels (e.g. ids of precomputed region features).

    A metric returns one from ``Metric.image_reader()``. ``source`` validates one image as given, up front and
    without loading it, and returns an :class:`ImageSource` with ``reader=self`` (errors are
    :class:`InputError` naming ``index``); ``load`` is called once per distinct image when its batch is
    built, and what it returns is what ``Batch.images`` holds."""

    def source(self, image: Any, index: int) -> ImageSource:
        raise NotImplementedError

    def load(self, source: ImageSource) -> Any:
        raise NotImplementedError


@dataclass
class Samples:
    """A validated corpus (or shard of one), before batching."""

    candidates: list[str]
    indices: list[int]
    images: list[ImageSource] | None = None
    references: list[list[str]] | None = None
    group_ids: list[int] | None = None

    def __len__(self) -> int:
        return len(self.candidates)

    def subset(self, positions: Sequence[int]) -> "Samples":
        pick = lambda xs: None if xs is None else [xs[p] for p in positions]  # noqa: E731
        return Samples(
            candidates=pick(self.candidates),
            indices=pick(self.indices),
            images=pick(self.images),
            references=pick(self.references),
            group_ids=pick(self.group_ids),
        )


def prepare_samples(
    info: MetricInfo,
    images: Sequence[Any] | None,
    candidates: Sequence[str] | None,
    references: Sequence[Any] | None = None,
    group_ids: Sequence[Any] | None = None,
    indices: Sequence[int] | None = None,
    reader: ImageReader | None = None,
) -> Samples:
    """Validate everything a metric needs and nothing it does not. Raises :class:`InputError`.

    A group metric (``info.groups``) given no ``group_ids`` groups the candidates of each image
    (:func:`image_group_ids`). ``reader`` (from ``Metric.image_reader()``) replaces the pixel-image
    validation and loading."""
    cands = check_captions(candidates)
    n = len(cands)
    samples = Samples(
        candidates=cands,
        indices=check_indices(indices, n),
        images=check_images(info, images, n, reader),
        references=check_references(info, references, n),
        group_ids=check_group_ids(group_ids, n),
    )
    if samples.group_ids is None and info.groups and samples.images is not None:
        samples.group_ids = image_group_ids(samples.images)
    return samples


def check_captions(candidates: Any) -> list[str]:
    if candidates is None:
        raise InputError("no candidate captions given")
    if isinstance(candidates, (str, bytes)):
        raise InputError("candidates must be a sequence of strings, got a single string")
    if isinstance(candidates, np.ndarray):
        candidates = candidates.tolist()
    out = []
    for i, caption in enumerate(candidates):
        if not isinstance(caption, str):
            raise InputError(f"sample {i}: caption must be a string, got {type(caption).__name__}")
        if not caption.strip():
            raise InputError(f"sample {i}: caption is empty")
        out.append(caption)
    return out


def check_indices(indices: Sequence[int] | None, n: int) -> list[int]:
    if indices is None:
        return list(range(n))
    values = indices.tolist() if isinstance(indices, (torch.Tensor, np.ndarray)) else list(indices)
    if len(values) != n:
        raise InputError(f"got {len(values)} sample ids for {n} captions")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise InputError(f"sample {i}: sample id must be a non-negative integer, got {v!r}")
    return [int(v) for v in values]


def check_group_ids(group_ids: Sequence[Any] | None, n: int) -> list[int] | None:
    """Group ids as non-negative ints; other hashables (e.g. image file names) are numbered in order of
    first appearance, which is only meaningful within one call."""
    if group_ids is None:
        return None
    values = group_ids.tolist() if isinstance(group_ids, (torch.Tensor, np.ndarray)) else list(group_ids)
    if len(values) != n:
        raise InputError(f"got {len(values)} group ids for {n} captions")
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 for v in values):
        return [int(v) for v in values]
    numbering: dict[Any, int] = {}
    try:
        return [numbering.setdefault(v, len(numbering)) for v in values]
    except TypeError as err:
        raise InputError(f"group ids must be integers or hashable: {err}") from err


def image_group_ids(sources: Sequence[ImageSource]) -> list[int]:
    """One group per image: a non-negative 63-bit hash of the image's key. A file path (resolved) or the bytes
    of an encoded image give the same id in every call, batch and process, so candidates of one image split
    across ``update()`` calls or DDP ranks still form one group. An in-memory image (PIL image, array, tensor)
    is known only by object identity, so its candidates group only within one call (its ids are salted per
    call so they never collide with another call's); pass ``group_ids``, paths or bytes to group across calls."""
    salt = os.urandom(8).hex()
    return [_stable_id(src.key, salt) for src in sources]


def _in_memory(key: Any) -> bool:
    return key[0] == "obj" or (key[0] == "video" and any(_in_memory(frame) for frame in key[1]))


def _stable_id(key: Any, salt: str) -> int:
    text = f"{salt}:{key!r}" if _in_memory(key) else repr(key)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def check_references(info: MetricInfo, references: Sequence[Any] | None, n: int) -> list[list[str]] | None:
    if references is None:
        if info.references == "always":
            raise InputError(f"{info.name} needs references (a list of reference captions per sample)")
        return None
    if info.references == "never":
        warnings.warn(f"{info.name} does not use references; they are ignored", stacklevel=3)
        return None
    if isinstance(references, (str, bytes)):
        raise InputError("references must be a sequence with one entry (a list of strings) per sample")
    references = list(references)
    if len(references) != n:
        raise InputError(f"got references for {len(references)} samples but {n} captions")
    out = []
    for i, refs in enumerate(references):
        if refs is None:
            raise InputError(f"sample {i}: references missing")
        refs = [refs] if isinstance(refs, str) else list(refs)
        if not refs:
            raise InputError(f"sample {i}: empty list of references")
        for j, ref in enumerate(refs):
            if not isinstance(ref, str):
                raise InputError(f"sample {i}: reference {j} must be a string, got {type(ref).__name__}")
            if not ref.strip():
                raise InputError(f"sample {i}: reference {j} is empty")
        out.append(refs)
    return out


def check_images(
    info: MetricInfo, images: Sequence[Any] | None, n: int, reader: ImageReader | None = None
) -> list[ImageSource] | None:
    if info.images == "never":
        return None
    if images is None:
        if info.images == "always":
            raise InputError(f"{info.name} needs an image for every caption")
        return None
    if isinstance(images, (str, bytes, os.PathLike, Image.Image)):
        raise InputError("images must be a sequence with one image per caption, got a single image")
    if isinstance(images, torch.Tensor) and images.ndim == 4:
        images = list(images)  # a (N, C, H, W) or (N, H, W, C) stack
    elif isinstance(images, np.ndarray) and images.ndim == 4:
        images = list(images)
    images = list(images)
    if len(images) != n:
        raise InputError(f"got {len(images)} images for {n} captions")
    if reader is not None:
        return [reader.source(img, i) for i, img in enumerate(images)]
    return [image_source(img, i, video_ok=info.video) for i, img in enumerate(images)]


def image_source(image: Any, index: int, video_ok: bool = False) -> ImageSource:
    """Validate one image (or video) without decoding it."""
    if isinstance(image, (list, tuple)):
        if not video_ok:
            raise InputError(f"sample {index}: got a list of frames, but this metric scores single images")
        if not image:
            raise InputError(f"sample {index}: video has no frames")
        frames = tuple(image_source(frame, index) for frame in image)
        return ImageSource("video", frames, ("video", tuple(f.key for f in frames)), index)
    if image is None:
        raise InputError(f"sample {index}: image missing")
    if isinstance(image, Image.Image):
        return ImageSource("pil", image, ("obj", id(image)), index)
    if isinstance(image, (str, os.PathLike)):
        path = os.fspath(image)
        if not os.path.isfile(path):
            raise InputError(f"sample {index}: image file not found: {path}")
        return ImageSource("path", path, ("path", os.path.realpath(path)), index)
    if isinstance(image, dict):
        if image.get("bytes"):
            data = image["bytes"]
            return ImageSource("bytes", data, ("bytes", hashlib.sha1(data).hexdigest()), index)
        if image.get("path"):
            return image_source(image["path"], index)
        raise InputError(f"sample {index}: image dict needs 'bytes' or 'path'")
    if isinstance(image, bytes):
        return ImageSource("bytes", image, ("bytes", hashlib.sha1(image).hexdigest()), index)
    if isinstance(image, (np.ndarray, torch.Tensor)):
        check_array(image, index)
        return ImageSource("array", image, ("obj", id(image)), index)
    raise InputError(f"sample {index}: unsupported image type {type(image).__name__}")


def check_array(image: np.ndarray | torch.Tensor, index: int) -> None:
    shape = tuple(image.shape)
    if len(shape) not in (2, 3):
        raise InputError(f"sample {index}: image array must be HW, CHW or HWC, got shape {shape}")
    if len(shape) == 3 and shape[0] not in _CHANNELS and shape[-1] not in _CHANNELS:
        raise InputError(f"sample {index}: cannot find the channel axis (1, 3 or 4) in shape {shape}")
    is_torch = isinstance(image, torch.Tensor)
    floating = image.is_floating_point() if is_torch else np.issubdtype(image.dtype, np.floating)
    if not floating and image.dtype not in (np.uint8, torch.uint8):
        raise InputError(f"sample {index}: image dtype must be uint8 or float, got {image.dtype}")
    size = image.numel() if is_torch else image.size
    if floating and size:
        low, high = (float(image.min()), float(image.max()))
        if not (0.0 <= low and high <= 1.0):  # also catches NaN
            raise InputError(
                f"sample {index}: float images must lie in [0, 1], got values in [{low:g}, {high:g}] "
                "(pass uint8, or divide by 255)"
            )


def _decode(kind: str, value: Any) -> Image.Image:
    if kind == "pil":
        return value.convert("RGB") if value.mode != "RGB" else value
    if kind == "path":
        with Image.open(value) as img:
            return img.convert("RGB")
    if kind == "bytes":
        with Image.open(io.BytesIO(value)) as img:
            return img.convert("RGB")
    return _array_to_pil(value)


def _array_to_pil(image: np.ndarray | torch.Tensor) -> Image.Image:
    is_torch = isinstance(image, torch.Tensor)
    arr = image.detach().cpu().numpy() if is_torch else np.asarray(image)
    if arr.ndim == 3:
        channels_first = arr.shape[0] in _CHANNELS and (arr.shape[-1] not in _CHANNELS or is_torch)
        if channels_first:
            arr = np.moveaxis(arr, 0, -1)
        if arr.shape[-1] == 1:
            arr = arr[..., 0]
    if np.issubdtype(arr.dtype, np.floating):
        arr = np.round(arr * 255.0)
    arr = arr.astype(np.uint8)
    img = Image.fromarray(arr)
    return img.convert("RGB") if img.mode != "RGB" else img


def group_by_image(samples: Samples) -> list[int]:
    """Positions reordered so that captions of the same image are adjacent (first appearance order), so a
    batch holds all of an image's candidates and encodes the image once."""
    if samples.images is None:
        return list(range(len(samples)))
    first: dict[Any, int] = {}
    rank = [first.setdefault(src.key, len(first)) for src in samples.images]
    return sorted(range(len(samples)), key=lambda p: rank[p])


def to_batch(samples: Samples) -> Batch:
    """Decode the distinct images of ``samples`` once each and build a :class:`Batch`."""
    images = image_index = None
    if samples.images is not None:
        rows: dict[Any, int] = {}
        unique: list[ImageSource] = []
        index = []
        for src in samples.images:
            if src.key not in rows:
                rows[src.key] = len(unique)
                unique.append(src)
            index.append(rows[src.key])
        images = [src.load() for src in unique]
        image_index = torch.tensor(index, dtype=torch.int64)
    groups = None if samples.group_ids is None else torch.tensor(samples.group_ids, dtype=torch.int64)
    return Batch(
        candidates=list(samples.candidates),
        indices=torch.tensor(samples.indices, dtype=torch.int64),
        images=images,
        image_index=image_index,
        references=samples.references,
        group_ids=groups,
    )


def iter_batches(
    samples: Samples, batch_size: int, *, progress: bool = False, desc: str | None = None
) -> Iterator[Batch]:
    """Batches of at most ``batch_size`` samples, candidates of one image kept together where they fit."""
    if batch_size < 1:
        raise InputError(f"batch_size must be at least 1, got {batch_size}")
    order = group_by_image(samples)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(samples), desc=desc, unit="sample")
    try:
        for start in range(0, len(order), batch_size):
            chunk = samples.subset(order[start : start + batch_size])
            yield to_batch(chunk)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
