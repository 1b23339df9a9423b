"""Images as the user gives them, before any batch: :func:`image_source` validates one (a file's header, an
array's layout, dtype and range, a video's frames) without decoding its pixels and returns an
:class:`ImageSource`, which decodes it later, pixel for pixel, each mode by its own range (:func:`to_rgb`);
:func:`image_identity` is what makes two images the same one in any process. Within a process a source's
``key`` says it: the object itself for an image in memory (:class:`ObjectKey`, never its bare ``id()``, which a
freed object hands on), a file's real path with its stamp (size, modification and change times, inode: a file
written again is another image), the hash of encoded bytes. A metric that takes its images another way gives an
:class:`ImageReader`.

:class:`InputError` lives here, the lowest of the input modules; every caller imports it, and all of these
names, from :mod:`capeval_plugins.inputs`, which turns whole corpora into validated samples and batches.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
from PIL import Image, ImageFile

from capeval_plugins import files
from capeval_plugins.core.arrays import host, is_tensor
from capeval_plugins.digests import files_stamp


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
        """The decoded RGB image (or frames), pixel for pixel as given: every metric's processor takes the
        image the user gave, whichever entry point called it."""
        if self.reader is not None:
            return self.reader.load(self)
        if self.kind == "video":
            return [frame.load() for frame in self.value]
        try:
            return _decode(self.kind, self.value)
        except Exception as err:  # a corrupt file or buffer, or pixels out of range: name the sample, keep the cause
            where = f" {self.value}" if self.kind == "path" else ""
            raise InputError(f"sample {self.index}: cannot read image{where}: {pil_reason(err)}") from err

    def decoded_bytes(self) -> int:
        """Memory the decoded RGB image (or all frames) will take, from its size alone (a file's header, an
        array's shape), without decoding it; 0 when unknown (a metric's own reader, a header that does not
        decode: that image fails when it is loaded)."""
        if self.reader is not None:
            return 0
        if self.kind == "video":
            return sum(frame.decoded_bytes() for frame in self.value)
        if self.kind == "pil":
            width, height = self.value.size
        elif self.kind == "array":
            shape = tuple(self.value.shape)
            channels_first = _channels_first(shape, is_tensor(self.value))
            height, width = shape[1:] if channels_first else shape[:2]
        elif self.kind in ("path", "bytes"):
            try:
                with Image.open(self.value if self.kind == "path" else io.BytesIO(self.value)) as img:
                    width, height = img.size
            except Exception:  # noqa: BLE001  (the load reports it, for its sample)
                return 0
        else:
            return 0
        return 3 * int(width) * int(height)


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


class ObjectKey:
    """The key of an image given in memory: the object itself, compared by identity. It holds the object, so
    while a key is kept (an image cache outliving one ``update()`` call) no other object can take its ``id()``
    and be taken for it."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectKey) and other.obj is self.obj

    def __repr__(self) -> str:
        return f"<{type(self.obj).__name__} at {id(self.obj):#x}>"


def _in_memory(key: Any) -> bool:
    return key[0] == "obj" or (key[0] == "video" and any(_in_memory(frame) for frame in key[1]))


def image_source(image: Any, index: int, video_ok: bool = False, checked: dict | None = None) -> ImageSource:
    """Validate one image (or video) without decoding its pixels: a file must exist and its header must
    decode (checked once per file when ``checked`` is shared); an array needs a known layout, dtype and
    finite values in range."""
    if isinstance(image, (list, tuple)):
        if not video_ok:
            raise InputError(f"sample {index}: got a list of frames, but this metric scores single images")
        if not image:
            raise InputError(f"sample {index}: video has no frames")
        frames = tuple(image_source(frame, index, checked=checked) for frame in image)
        return ImageSource("video", frames, ("video", tuple(f.key for f in frames)), index)
    if image is None:
        raise InputError(f"sample {index}: image missing")
    if isinstance(image, Image.Image):
        problem = mode_problem(image.mode)
        if problem:
            raise InputError(f"sample {index}: {problem}")
        return ImageSource("pil", image, ("obj", ObjectKey(image)), index)
    if isinstance(image, (str, os.PathLike)):
        path = os.fspath(image)
        real = os.path.realpath(path)
        key = ("path", real, files_stamp(real))  # a file written again is another image
        if checked is None or key not in checked:
            problem = _file_problem(path)
            if checked is not None:
                checked[key] = problem
        else:
            problem = checked[key]
        if problem:
            raise InputError(f"sample {index}: {problem}")
        return ImageSource("path", path, key, index)
    if isinstance(image, dict):
        if image.get("bytes"):
            return image_source(bytes(image["bytes"]), index, checked=checked)
        if image.get("path"):
            return image_source(image["path"], index, checked=checked)
        raise InputError(f"sample {index}: image dict needs 'bytes' or 'path'")
    if isinstance(image, (bytes, bytearray)):
        data = bytes(image)
        problem = _header_problem(io.BytesIO(data))
        if problem:
            raise InputError(f"sample {index}: cannot read image bytes: {problem}")
        return ImageSource("bytes", data, ("bytes", hashlib.sha1(data).hexdigest()), index)
    if isinstance(image, np.ndarray) or is_tensor(image):
        check_array(image, index)
        return ImageSource("array", image, ("obj", ObjectKey(image)), index)
    raise InputError(f"sample {index}: unsupported image type {type(image).__name__}")


def _file_problem(path: str) -> str | None:
    kind = files.file_kind(path)
    if kind is None:
        return f"image file not found: {path}"
    if kind != "file":  # a FIFO would block the read, a device stream forever: refused unopened
        return f"{path} is a {kind}, not an image file"
    try:
        with files.open_input(path) as f:
            problem = _header_problem(f)
    except files.FileError as err:
        return str(err)
    except OSError as err:
        return f"cannot open image {path}: {err.strerror or err}"
    return f"cannot read image {path}: {problem}" if problem else None


def _header_problem(stream: Any) -> str | None:
    """Why the image header in ``stream`` does not decode, or None. Reads the header only, not the pixels."""
    try:
        with Image.open(stream) as img:
            width, height = img.size
            mode = img.mode
    except Exception as err:  # PIL raises many types for a bad header
        return pil_reason(err)
    if not (width > 0 and height > 0):
        return f"image has size {width}x{height}"
    return mode_problem(mode)


def check_array(image: Any, index: int) -> None:
    shape = tuple(image.shape)
    if len(shape) not in (2, 3):
        raise InputError(f"sample {index}: image array must be HW, CHW or HWC, got shape {shape}")
    if len(shape) == 3 and shape[0] not in _CHANNELS and shape[-1] not in _CHANNELS:
        raise InputError(f"sample {index}: cannot find the channel axis (1, 3 or 4) in shape {shape}")
    if 0 in shape:
        raise InputError(f"sample {index}: image array is empty (shape {shape})")
    is_torch = is_tensor(image)
    floating = image.is_floating_point() if is_torch else np.issubdtype(image.dtype, np.floating)
    if not floating and str(image.dtype) not in ("uint8", "torch.uint8"):
        raise InputError(f"sample {index}: image dtype must be uint8 or float, got {image.dtype}")
    if floating:
        finite = bool(image.isfinite().all()) if is_torch else bool(np.isfinite(image).all())
        if not finite:
            raise InputError(f"sample {index}: image array contains NaN or infinite values")
        low, high = (float(image.min()), float(image.max()))
        if not (0.0 <= low and high <= 1.0):
            raise InputError(
                f"sample {index}: float images must lie in [0, 1], got values in [{low:g}, {high:g}] "
                "(pass uint8, or divide by 255)"
            )


_strict_lock = threading.Lock()


@contextlib.contextmanager
def _strict_decoding() -> Iterator[None]:
    """PIL refusing truncated image data while we decode, whatever another library set: some set PIL's global
    ``ImageFile.LOAD_TRUNCATED_IMAGES = True`` when imported (the ``polos`` package does), which would score the
    missing part of a truncated file as grey instead of reporting the image as unreadable."""
    with _strict_lock:
        before = ImageFile.LOAD_TRUNCATED_IMAGES
        ImageFile.LOAD_TRUNCATED_IMAGES = False
        try:
            yield
        finally:
            ImageFile.LOAD_TRUNCATED_IMAGES = before


def _decode(kind: str, value: Any) -> Image.Image:
    if kind == "pil":
        return value if value.mode == "RGB" else to_rgb(value)
    if kind == "path":
        with files.open_input(value, "image file") as f, Image.open(f) as img, _strict_decoding():
            return to_rgb(img)
    if kind == "bytes":
        with Image.open(io.BytesIO(value)) as img, _strict_decoding():
            return to_rgb(img)
    return _array_to_pil(value)


SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


def mode_problem(mode: str) -> str | None:
    """Why an image of PIL ``mode`` cannot be scored, or None. A 32-bit integer image (``I``, e.g. an int32
    TIFF) has no defined white: scaling by its type's range would make it black, by 255 white. (16-bit
    images scale by 65535, float images must lie in [0, 1].)"""
    if mode in SIXTEEN_BIT_MODES or mode == "F" or not mode.startswith("I"):
        return None
    return (f"{mode} images are not supported ({'32-bit integer' if mode == 'I' else 'signed integer'} pixels "
            "have no defined range); save it as an 8- or 16-bit PNG, or pass a uint8 array")


def to_rgb(img: Image.Image) -> Image.Image:
    """An 8-bit RGB image, each mode scaled by its own range: 16-bit (``I;16``) by 65535, float (``F``, which
    must lie in [0, 1]) by 1; ``convert("RGB")`` would clip both to near white or black. Always a new image
    (the file ``img`` was opened from may be closed after)."""
    mode = img.mode
    problem = mode_problem(mode)
    if problem:
        raise InputError(problem)
    if mode in SIXTEEN_BIT_MODES:
        pixels = np.asarray(img).astype(np.float64) / 257.0  # 65535 -> 255 exactly
    elif mode == "F":
        pixels = np.asarray(img, dtype=np.float64)
        if not np.isfinite(pixels).all():
            raise InputError("float image (mode F) contains NaN or infinite values")
        low, high = float(pixels.min()), float(pixels.max())
        if low < 0.0 or high > 1.0:
            raise InputError(f"float image (mode F) must lie in [0, 1], got values in [{low:g}, {high:g}]; save it "
                             "as an 8- or 16-bit image, or scale it to [0, 1]")
        pixels = pixels * 255.0
    else:
        return img.convert("RGB")
    return Image.fromarray(np.round(pixels).astype(np.uint8), "L").convert("RGB")


def _channels_first(shape: Sequence[int], is_torch: bool) -> bool:
    """Whether a 3-d image array is CHW (a tensor whose both end axes could be channels is CHW, torch's
    convention; an array, HWC)."""
    return len(shape) == 3 and shape[0] in _CHANNELS and (shape[-1] not in _CHANNELS or is_torch)


def _array_to_pil(image: Any) -> Image.Image:
    is_torch = is_tensor(image)
    arr = host(image) if is_torch else np.asarray(image)
    if arr.ndim == 3:
        if _channels_first(arr.shape, is_torch):
            arr = np.moveaxis(arr, 0, -1)
        if arr.shape[-1] == 1:
            arr = arr[..., 0]
    if np.issubdtype(arr.dtype, np.floating):
        # in float64: float16's own x * 255 rounds to another 8-bit value for 4 % of the pixels
        arr = np.round(arr.astype(np.float64) * 255.0)
    arr = arr.astype(np.uint8)
    img = Image.fromarray(arr)
    return img.convert("RGB") if img.mode != "RGB" else img


_FILE_OBJECT = re.compile(r"\s*<_io\.\w+ name=[^>]*>")


def pil_reason(err: BaseException) -> str:
    """PIL's message without the file object it names (``<_io.BufferedReader name=3>``: a descriptor number, so
    the same bad image read another message in another process or rank)."""
    return _FILE_OBJECT.sub("", str(err)).strip() or type(err).__name__


def image_identity(key: Any, image: Any) -> bytes:
    """What makes two images the same one in any process: a file's resolved path (not its version, which
    another machine's copy of a dataset does not share), encoded bytes' hash, or for an image given in memory
    (known here only by object identity) its decoded pixels."""
    if _in_memory(key):
        return b"pixels:" + pixel_digest(image)
    return repr(_portable(key)).encode()


def _portable(key: Any) -> Any:
    """``key`` without the versions of its files (:func:`~capeval_plugins.digests.files_stamp`)."""
    if key[0] == "path":
        return key[:2]
    if key[0] == "video":
        return ("video", tuple(_portable(frame) for frame in key[1]))
    return key


def pixel_digest(image: Any) -> bytes:
    """The digest of an image given in memory (PIL, a numpy array or a tensor, or a video's frames) by its
    pixels, their type and shape: the same pixels in any batch or process give the same one, and an RGB PIL
    image the same as its (H, W, 3) uint8 array."""
    import xxhash

    h = xxhash.xxh3_128()
    for frame in image if isinstance(image, (list, tuple)) else [image]:
        if isinstance(frame, Image.Image) and frame.mode == "RGB":  # its bytes are the (H, W, 3) uint8 array's
            h.update(f"uint8{(frame.height, frame.width, 3)}".encode())
            h.update(frame.tobytes())
        elif isinstance(frame, Image.Image):
            h.update(f"{frame.mode}{frame.size}".encode())
            h.update(frame.tobytes())
        elif isinstance(frame, np.ndarray) or is_tensor(frame):
            arr = host(frame) if is_tensor(frame) else frame
            h.update(f"{arr.dtype}{arr.shape}".encode())
            h.update(np.ascontiguousarray(arr).tobytes())
        else:
            h.update(repr(frame).encode())
    return h.digest()
