"""Precomputed region features (ViLBERT's image input): per-image files, read safely, and ViLBERT's box locations.

The layout is what ``script/extract_features.py`` of vilbert-multi-task (and of ViLBERTScore) writes: one file per
image, named after the image file's name up to its first dot, holding

- ``features`` (N, 2048): the detector's fc6 features of N regions (100 in the papers);
- ``bbox`` (or ``boxes``, the LMDB naming) (N, 4): x1, y1, x2, y2 in original-image pixels;
- ``image_width``/``image_w`` and ``image_height``/``image_h``: the original image size in pixels;
- ``num_boxes`` (optional here): regions with a non-zero detection score; ViLBERTScore ignores it and uses all N
  rows, and so does this module;
- anything else (``objects``, ``cls_prob``, ``image_id``) is ignored.

``.npy`` files are ``np.save`` of a dict, i.e. a pickle. They are read with an unpickler that only rebuilds numpy
arrays, numbers and strings and refuses anything else, so a feature file cannot run code. ``.npz`` files (plain
arrays, no pickle) are also accepted and can be checked from their headers alone.
"""
from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from capeval_plugins.core.npy import NPY_HEADER_ERRORS, npy_header
from capeval_plugins.resources.numpy_internals import pickled_numpy_global

DETECTOR_FEATURE_DIM = 2048  # fc6 of the ResNeXt-152 Faster R-CNN (Visual Genome) ViLBERT was trained on
SUFFIXES = (".npy", ".npz")
FIELDS = {
    "features": ("features",),
    "boxes": ("bbox", "boxes"),
    "width": ("image_width", "image_w"),
    "height": ("image_height", "image_h"),
}
NUM_BOXES = "num_boxes"
# Far above the 10-100 regions the detector keeps per image: every size is checked against it before numpy or
# the unpickler allocates anything, so a small crafted file cannot ask for gigabytes.
MAX_REGIONS = 4096
MAX_FILE_BYTES = 2 * MAX_REGIONS * (DETECTOR_FEATURE_DIM + 4) * 8 + (1 << 20)


class RegionFileError(ValueError):
    """A region-feature file that cannot be used (the caller adds which sample and image)."""


@dataclass
class RegionFeatures:
    """One image's regions: ``features`` (N, D) float32, ``boxes`` (N, 4) float32 x1 y1 x2 y2 in pixels, and the
    original image size."""

    features: np.ndarray
    boxes: np.ndarray
    width: float
    height: float

    def __len__(self) -> int:
        return self.features.shape[0]


def region_file_stems(name: str) -> list[str]:
    """Names a feature file of image ``name`` may have, without suffix: the extractor's (up to the first dot),
    then the name without its last suffix, then the name itself (an id without a suffix)."""
    base = os.path.basename(name)
    stems = [base.split(".")[0], os.path.splitext(base)[0], base]
    return [s for i, s in enumerate(stems) if s and s not in stems[:i]]


def find_region_file(folder: str | os.PathLike, name: str) -> tuple[Path | None, list[Path]]:
    """The feature file of image ``name`` in ``folder`` and every path looked at."""
    tried = []
    for stem in region_file_stems(name):
        for suffix in SUFFIXES:
            path = Path(folder) / f"{stem}{suffix}"
            tried.append(path)
            if path.is_file():
                return path, tried
    return None, tried


# --- safe reading ---------------------------------------------------------------------------------------------
class _ArraysOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = pickled_numpy_global(module, name)
        if found is not None:
            return found
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        if (module, name) == ("collections", "OrderedDict"):
            from collections import OrderedDict

            return OrderedDict
        raise pickle.UnpicklingError(
            f"refusing to unpickle {module}.{name}: a region file may hold only numpy arrays, numbers and strings"
        )


# What unpickling damaged bytes raises besides UnpicklingError: opcodes with out-of-range lengths and indices,
# truncated data, a memo or stack that does not hold what an opcode expects.
PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError, KeyError,
                 OverflowError, MemoryError, RecursionError, struct.error)


def _npy_header(stream: Any) -> tuple[tuple[int, ...], np.dtype]:
    try:
        return npy_header(stream)
    except ValueError as err:
        raise RegionFileError(str(err)) from None


def _read_npy_dict(path: Path) -> Mapping[str, Any]:
    if path.stat().st_size > MAX_FILE_BYTES:
        raise RegionFileError(f"{path}: {path.stat().st_size} bytes, more than {MAX_REGIONS} regions of features take")
    with open(path, "rb") as f:
        try:
            shape, dtype = _npy_header(f)
        except ValueError as err:
            raise RegionFileError(f"{path}: not a .npy file ({err})") from None
        if dtype != np.dtype(object) or shape != ():
            raise RegionFileError(f"{path}: holds a {dtype} array of shape {shape}, not a dict of features, boxes and "
                                  "image size (np.save of a dict, as the extraction script writes)")
        # the pickle from memory (the file is size-checked above): a damaged length then reads short instead of
        # making the file object allocate what it declares
        stream = io.BytesIO(f.read())
        try:
            value = _ArraysOnlyUnpickler(stream).load()
        except PICKLE_ERRORS as err:
            raise RegionFileError(f"{path}: cannot read the pickled dict ({type(err).__name__}: {err})") from None
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if not isinstance(value, Mapping):
        raise RegionFileError(f"{path}: holds a {type(value).__name__}, not a dict")
    return value


def _field(data: Mapping[str, Any], field: str, path: Path) -> Any:
    for key in FIELDS[field]:
        if key in data:
            return data[key]
    names = " or ".join(repr(k) for k in FIELDS[field])
    raise RegionFileError(f"{path}: no {names} (keys: {sorted(data)})")


def _array(value: Any, what: str, path: Path) -> np.ndarray:
    """``value`` when it is already an array: a list (which a pickle can make of a million references to one
    row) is never turned into one."""
    if not isinstance(value, np.ndarray):
        raise RegionFileError(f"{path}: {what} must be a numpy array, got a {type(value).__name__}")
    return value


def _positive_number(value: Any, what: str, path: Path) -> float:
    if not isinstance(value, (int, float, np.number, np.ndarray)) or isinstance(value, bool) or np.size(value) != 1:
        raise RegionFileError(f"{path}: {what} must be a number, got a {type(value).__name__}")
    arr = np.asarray(value)
    if arr.size != 1 or not np.issubdtype(arr.dtype, np.number):
        raise RegionFileError(f"{path}: {what} must be a number, got {value!r}")
    number = float(arr.reshape(()))
    if not np.isfinite(number) or number <= 0:
        raise RegionFileError(f"{path}: {what} must be positive, got {number}")
    return number


def _check_shapes(features: tuple[tuple[int, ...], np.dtype], boxes: tuple[tuple[int, ...], np.dtype],
                  feature_dim: int, path: Path) -> int:
    (f_shape, f_dtype), (b_shape, b_dtype) = features, boxes
    if len(f_shape) != 2 or f_shape[1] != feature_dim:
        raise RegionFileError(f"{path}: features have shape {f_shape}; expected (regions, {feature_dim}) (fc6 "
                              "features of the ResNeXt-152 Faster R-CNN trained on Visual Genome)")
    if not 1 <= f_shape[0] <= MAX_REGIONS:
        raise RegionFileError(f"{path}: {f_shape[0]} regions; expected 1 to {MAX_REGIONS}")
    if not np.issubdtype(f_dtype, np.floating):
        raise RegionFileError(f"{path}: features must be floating point, got {f_dtype}")
    if b_shape != (f_shape[0], 4) or not np.issubdtype(b_dtype, np.number):
        raise RegionFileError(f"{path}: boxes have shape {b_shape} ({b_dtype}); expected ({f_shape[0]}, 4) numbers, "
                              "one x1, y1, x2, y2 row per region")
    return f_shape[0]


def _check_num_boxes(data: Mapping[str, Any], n: int, path: Path) -> None:
    if NUM_BOXES not in data:
        return
    if not isinstance(data[NUM_BOXES], (int, np.integer, np.ndarray)) or np.size(data[NUM_BOXES]) != 1:
        raise RegionFileError(f"{path}: num_boxes must be an integer in 0..{n}")
    value = np.asarray(data[NUM_BOXES])
    if value.size != 1 or not np.issubdtype(value.dtype, np.integer) or not 0 <= int(value.reshape(())) <= n:
        raise RegionFileError(f"{path}: num_boxes must be an integer in 0..{n}, got {data[NUM_BOXES]!r}")


_SCALARS = (*FIELDS["width"], *FIELDS["height"], NUM_BOXES)


def _npz_checked(path: Path, feature_dim: int) -> tuple[list[str], int]:
    """The members of a region ``.npz`` to read (features, boxes and the scalars), each one's header checked
    against the shapes a region file has and against the bytes the member holds, before any is read."""
    try:
        with zipfile.ZipFile(path) as zf:
            members = {name[: -len(".npy")]: name for name in zf.namelist() if name.endswith(".npy")}
            headers = {}
            for key in (*FIELDS["features"], *FIELDS["boxes"], *_SCALARS):
                if key not in members or any(key in FIELDS[f] and key != _first(members, f) for f in FIELDS):
                    continue
                info = zf.getinfo(members[key])
                with zf.open(info) as member:
                    shape, dtype = _npy_header(member)
                    stored = info.file_size - member.tell()
                if dtype.hasobject or stored != int(np.prod(shape)) * dtype.itemsize:
                    raise RegionFileError(f"{path}: {key} declares {shape} {dtype} but holds {stored} bytes")
                if key in _SCALARS and int(np.prod(shape)) != 1:
                    raise RegionFileError(f"{path}: {key} must be one number, got shape {shape}")
                headers[key] = (shape, dtype)
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise RegionFileError(f"{path}: not a readable .npz file ({err})") from None
    for field in ("features", "boxes"):
        if _first(headers, field) is None:
            _field(members, field, path)  # raises, naming the missing field
    n = _check_shapes(headers[_first(headers, "features")], headers[_first(headers, "boxes")], feature_dim, path)
    return list(headers), n


def _first(found: Mapping[str, Any], field: str) -> str | None:
    return next((k for k in FIELDS[field] if k in found), None)


def _read_npz(path: Path, wanted: list[str]) -> dict[str, Any]:
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in wanted}
    except (zipfile.BadZipFile, OSError, EOFError, *NPY_HEADER_ERRORS) as err:
        raise RegionFileError(f"{path}: not a readable .npz file of plain arrays ({err})") from None


def check_region_file(path: str | os.PathLike, feature_dim: int = DETECTOR_FEATURE_DIM) -> None:
    """Raise :class:`RegionFileError` unless ``path`` is a usable region file. ``.npz`` files are checked from the
    array headers and the small scalars only; ``.npy`` dicts are a single pickle and are read whole."""
    path = Path(path)
    if path.suffix == ".npy":
        read_region_file(path, feature_dim)
        return
    wanted, n = _npz_checked(path, feature_dim)
    scalars = _read_npz(path, [k for k in wanted if k in _SCALARS])
    _positive_number(_field(scalars, "width", path), "the image width", path)
    _positive_number(_field(scalars, "height", path), "the image height", path)
    _check_num_boxes(scalars, n, path)


def read_region_file(path: str | os.PathLike, feature_dim: int = DETECTOR_FEATURE_DIM) -> RegionFeatures:
    """The regions of one image (``.npy`` dict or ``.npz``), checked; raises :class:`RegionFileError`."""
    path = Path(path)
    if path.suffix == ".npz":
        data = _read_npz(path, _npz_checked(path, feature_dim)[0])
    elif path.suffix == ".npy":
        data = _read_npy_dict(path)
    else:
        raise RegionFileError(f"{path}: expected a .npy or .npz file")
    features = _array(_field(data, "features", path), "features", path)
    boxes = _array(_field(data, "boxes", path), "boxes", path)
    n = _check_shapes((features.shape, features.dtype), (boxes.shape, boxes.dtype), feature_dim, path)
    width = _positive_number(_field(data, "width", path), "the image width", path)
    height = _positive_number(_field(data, "height", path), "the image height", path)
    _check_num_boxes(data, n, path)
    if not (np.isfinite(features).all() and np.isfinite(boxes).all()):
        raise RegionFileError(f"{path}: features or boxes contain NaN or infinite values")
    return RegionFeatures(features.astype(np.float32, copy=False), boxes.astype(np.float32, copy=False), width, height)


# --- ViLBERT's region inputs ----------------------------------------------------------------------------------
def box_locations(boxes: np.ndarray, width: float, height: float) -> np.ndarray:
    """ViLBERT's 5-d location of each box: x1/W, y1/H, x2/W, y2/H and the box area over the image area (pixel
    coordinates, no clipping, as the official data loaders)."""
    boxes = np.asarray(boxes, dtype=np.float64)
    area = (boxes[:, 3] - boxes[:, 1]) * (boxes[:, 2] - boxes[:, 0]) / (float(width) * float(height))
    scaled = boxes / np.array([width, height, width, height], dtype=np.float64)
    return np.concatenate([scaled, area[:, None]], axis=1).astype(np.float32)


GLOBAL_LOCATION = np.array([0.0, 0.0, 1.0, 1.0, 1.0], dtype=np.float32)


def with_global_region(regions: RegionFeatures) -> tuple[np.ndarray, np.ndarray]:
    """(features, locations) of ViLBERT's image input: the "global" region first (the mean of all region features,
    located at the whole image [0, 0, 1, 1, 1]), then every region: (N + 1, D) and (N + 1, 5), float32."""
    features = regions.features.astype(np.float32, copy=False)
    global_feature = features.sum(axis=0, dtype=np.float32) / np.float32(len(features))
    locations = box_locations(regions.boxes, regions.width, regions.height)
    return (np.concatenate([global_feature[None], features]), np.concatenate([GLOBAL_LOCATION[None], locations]))
