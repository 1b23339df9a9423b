"""Safetensors files checked before anything reads them: one header validator for every reader in the package
(model folders before ``from_pretrained``, trained checkpoints, training state, feature caches, run records).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON, then the tensors' bytes. The
``safetensors`` library checks most of it, but its errors are tracebacks of its own type, and a crafted header
(a length of 2**63, offsets past the end, a shape whose size disagrees with its bytes) is found only when a
tensor is read, sometimes after a large allocation. :func:`header_problem` checks everything the header
declares against the file's size, without reading the tensors, and :func:`check_file` / :func:`check_bytes`
turn a problem into one line (:class:`TensorFileError`) naming the file.
"""
from __future__ import annotations

import json
import math
import os
import stat
from typing import Any, Mapping

from capeval_plugins.core.messages import DataError

MAX_HEADER = 100_000_000  # the safetensors library's own limit on the JSON header
# bits per element of every dtype the format defines (sub-byte floats pack whole tensors into whole bytes)
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
              "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64, "C64": 64,
              "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
# the dtypes safetensors' torch loader reads (0.8: the sub-byte floats and F8_E8M0 are a KeyError inside it)
TORCH_DTYPES = frozenset(DTYPE_BITS) - {"F4", "F6_E2M3", "F6_E3M2", "F8_E8M0"}


class TensorFileError(DataError):
    """A safetensors file whose header is damaged or crafted: one line naming the file (exit code 2)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(value: str) -> bool:
    """Whether ``value`` is text the safetensors library can take: JSON's ``\\ud800`` escapes decode to lone
    surrogates, which are not Unicode scalar values."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _fits_64_bits(shape: list[int]) -> bool:
    """Whether every dimension and each running product of them fits an unsigned 64-bit size, as the library
    multiplies them (a dimension of 2**64 beside a 0 is no tensor it can read)."""
    size = 1
    for dim in shape:
        size *= dim
        if dim >= 2**64 or size >= 2**64:
            return False
    return True


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the name {key!r} appears twice")
        out[key] = value
    return out


def parse_header(head: bytes) -> dict[str, Any]:
    """The JSON header as a dict (ValueError when it is not UTF-8 JSON of an object, or repeats a name)."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the header is not UTF-8") from None
    if not text.lstrip().startswith("{"):
        raise ValueError("the header is not a JSON object")
    try:
        parsed = json.loads(text, object_pairs_hook=_no_duplicates)
    except (RecursionError, json.JSONDecodeError) as err:
        raise ValueError(f"the header is not valid JSON ({str(err).splitlines()[0]})") from None
    if not isinstance(parsed, dict):
        raise ValueError("the header is not a JSON object")
    return parsed


def entries_problem(header: Mapping[str, Any], data_size: int) -> str | None:
    """Why the tensors a parsed header declares do not fit the ``data_size`` bytes after it, or None: every
    entry a known dtype, a shape of non-negative integers, offsets inside the data whose length is exactly
    what the shape and dtype need, and the entries tiling the data with no gap, overlap or trailing byte."""
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        return "__metadata__ must map strings to strings"
    if metadata is not None and not all(_text(k) and _text(v) for k, v in metadata.items()):
        return "__metadata__ holds a string that is not valid Unicode (a lone surrogate escape)"
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not _text(name):
            return f"tensor name {name!r} is not valid Unicode (a lone surrogate escape)"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            return f"tensor {name!r} is not an object of dtype, shape and data_offsets"
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_BITS:
            return f"tensor {name!r} has an unknown dtype {dtype!r}"
        if dtype not in TORCH_DTYPES:
            return f"tensor {name!r} has dtype {dtype!r}, which torch's safetensors loader does not read"
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            return f"tensor {name!r} has a shape that is not a list of non-negative integers: {shape!r}"
        if not _fits_64_bits(shape):
            return f"tensor {name!r} has a shape {shape} whose size overflows 64 bits"
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_size):
            return f"tensor {name!r} has data offsets {offsets!r} outside its {data_size} bytes of data"
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
            return (f"tensor {name!r} of shape {shape} ({dtype}) needs {bits / 8:g} bytes but its offsets give "
                    f"{offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for start, stop, name in sorted(spans):
        if start != end:
            return (f"tensor {name!r} starts at byte {start}, not {end}: the data has "
                    f"{'overlapping tensors' if start < end else 'a gap'}")
        end = stop
    if end != data_size:
        return f"the tensors end at byte {end} of {data_size} bytes of data"
    return None


def header_problem(prefix: bytes, file_size: int) -> tuple[str | None, int]:
    """Why a safetensors file of ``file_size`` bytes starting with ``prefix`` (at least its 8-byte length and
    header, when the file has them) is not a valid one, or None; and the header length read."""
    if file_size < 8 or len(prefix) < 8:
        return f"{file_size} bytes is too short for a safetensors file", 0
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER:
        return f"its header claims {n} bytes (more than the format's {MAX_HEADER})", n
    if 8 + n > file_size:
        return f"its header claims {n} bytes but the file has {file_size}", n
    if len(prefix) < 8 + n:
        return "its header was not read whole", n
    try:
        header = parse_header(prefix[8 : 8 + n])
    except ValueError as err:
        return str(err), n
    return entries_problem(header, file_size - 8 - n), n


def check_bytes(data: bytes | memoryview, what: str) -> None:
    """Raise :class:`TensorFileError` unless ``data`` is a whole, consistent safetensors file."""
    problem, _ = header_problem(bytes(data[: 8 + min(MAX_HEADER, _declared(data))]), len(data))
    if problem:
        raise TensorFileError(f"{what} is not a valid safetensors file: {problem}")


def _declared(data: bytes | memoryview) -> int:
    return int.from_bytes(bytes(data[:8]), "little") if len(data) >= 8 else 0


def check_file(path: str | os.PathLike, what: str | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Raise :class:`TensorFileError` unless the regular file ``path`` is a consistent safetensors file; reads
    the 8-byte length and the header only (never the tensors). Returns each tensor's dtype and shape."""
    name = what or os.fspath(path)
    with _open_regular(path, name) as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        n = _declared(prefix)
        if len(prefix) == 8 and n <= MAX_HEADER and 8 + n <= size:
            prefix += f.read(n)
    problem, n = header_problem(prefix, size)
    if problem:
        raise TensorFileError(f"{name} is not a valid safetensors file: {problem}")
    header = parse_header(prefix[8 : 8 + n])
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}


def _open_regular(path: str | os.PathLike, name: str) -> Any:
    """``path`` opened for reading if it is a regular file: opened non-blocking and its type checked on the
    descriptor, so a FIFO or a device planted in a model folder cannot block or stream forever."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise TensorFileError(f"{name} cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise TensorFileError(f"{name} is not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


# the dtypes numpy holds (no bfloat16 nor the 8-bit and sub-byte floats)
NUMPY_DTYPES = frozenset(DTYPE_BITS) - {"BF16", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"}


def load_bytes(data: bytes, what: str, arrays: bool = False) -> dict[str, Any]:
    """The tensors of safetensors ``data``, its header checked first (:func:`check_bytes`); with ``arrays``, as
    numpy arrays when numpy holds every dtype (no torch imported), else as tensors."""
    check_bytes(data, what)
    if arrays:
        header = parse_header(bytes(data[8 : 8 + _declared(data)]))
        if all(entry["dtype"] in NUMPY_DTYPES for name, entry in header.items() if name != "__metadata__"):
            from safetensors.numpy import load as load_arrays

            return load_arrays(bytes(data))
    from safetensors.torch import load

    return load(data)


def load_file(path: str | os.PathLike, what: str | None = None) -> dict[str, Any]:
    """The tensors of the safetensors file ``path`` (on the CPU), read once into memory and its header checked
    (:func:`load_bytes`). Not mapped: safetensors' own ``load_file`` maps the file, so a file rewritten in place
    later (a training run saving over it, a copy in progress) would change tensors already checked and in use."""
    name = what or os.fspath(path)
    with _open_regular(path, name) as f:
        data = f.read()
    return load_bytes(data, name)
