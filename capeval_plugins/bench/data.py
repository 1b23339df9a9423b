"""What a benchmark reader returns: the rows a metric scores, and the human judgments of those rows.

A *rating* benchmark (Flickr8k, Composite, Nebula, Polaris, THumB) gives one human score per row and is
judged by correlation; a *pairwise* benchmark (Pascal-50S, FOIL, MCEval) gives pairs of rows and the one
humans preferred, and is judged by accuracy. Rows keep the image as the file names it (resolved against the
user's image folder only when a metric needs images), so text-only metrics run without any image.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from capeval_plugins.inputs import InputError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".avi", ".mov")


def clean(text: str) -> str:
    """Whitespace collapsed, as the CLIPScore / PAC-S evaluation code does to every caption."""
    return " ".join(str(text).split())


@dataclass
class Captions:
    """The rows to score, in benchmark order. ``images`` holds the image as the benchmark names it (a relative
    path or id), or an embedded ``{"bytes": ...}`` image; ``corpus`` says which rows a corpus-level metric
    scores together in one call (default: all rows)."""

    images: list[Any]
    candidates: list[str]
    references: list[list[str]] | None = None
    corpus: list[int] | None = None
    groups: list[int] | None = None  # group metrics (Soft-MSD) normalise within a group: one pair, not an image
    # video benchmarks scoring a part of a video: (start, end, duration) in seconds per row (ActivityNet-FOIL)
    segments: list[tuple[float, float, float] | None] | None = None

    def __post_init__(self) -> None:
        n = len(self.candidates)
        for name in ("images", "references", "corpus", "groups", "segments"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"{name} has {len(value)} rows for {n} candidates")

    def __len__(self) -> int:
        return len(self.candidates)

    def corpora(self) -> list[np.ndarray]:
        """Row indices of each corpus, in order of first appearance."""
        if self.corpus is None:
            return [np.arange(len(self))]
        ids = np.asarray(self.corpus)
        _, first = np.unique(ids, return_index=True)
        return [np.flatnonzero(ids == ids[i]) for i in sorted(first)]

    def image_keys(self) -> list[str]:
        """A stable name per row's image (embedded images by content hash), for grouping and resampling."""
        return [image_name(img) for img in self.images]


@dataclass
class Ratings:
    """A benchmark judged by correlation: one human score per row. ``targets`` holds several human columns
    when a benchmark correlates against each (FactVC's paragraph / sentence / word levels, VATEX-EVAL's three
    annotators); ``human`` is then the first. ``systems`` names the captioning model of each row (system-level
    correlation)."""

    captions: Captions
    human: np.ndarray
    categories: list[str] | None = None  # optional subsets with their own correlation (e.g. Composite)
    excluded: int = 0                    # rows the protocol dropped (e.g. candidates that are references)
    notes: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, np.ndarray] | None = None
    systems: list[str] | None = None

    def __post_init__(self) -> None:
        if self.targets:
            self.targets = {k: np.asarray(v, dtype=np.float64) for k, v in self.targets.items()}
            self.human = next(iter(self.targets.values()))
        self.human = np.asarray(self.human, dtype=np.float64)
        n = len(self.captions)
        for name, values in [("human", self.human), *((f"target {k}", v) for k, v in (self.targets or {}).items()),
                             ("systems", self.systems if self.systems is not None else [None] * n)]:
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} values for {n} rows")

    def human_columns(self) -> dict[str, np.ndarray]:
        """The human scores each correlation is computed against, by name (``{"human": ...}`` by default)."""
        return dict(self.targets) if self.targets else {"human": self.human}

    def units(self, by: str) -> np.ndarray:
        """Resampling unit of every row: the row itself, or its image."""
        return _units(by, len(self.captions), self.captions.image_keys())


@dataclass
class Pairs:
    """A benchmark judged by pairwise accuracy: pair ``i`` compares rows ``first[i]`` and ``second[i]``;
    ``label[i]`` is 0 when humans preferred the first, 1 when they preferred the second. ``human_tie`` marks
    pairs humans judged a tie (CapArena; their ``label`` is then meaningless); ``pair_systems`` names the two
    captioning models of each pair (model-level ranking)."""

    captions: Captions
    first: np.ndarray
    second: np.ndarray
    label: np.ndarray
    categories: list[str]
    excluded: int = 0
    notes: dict[str, Any] = field(default_factory=dict)
    human_tie: np.ndarray | None = None
    pair_systems: list[tuple[str, str]] | None = None
    # rows scored separately and judged together: each row's score is replaced by the mean over its unit before
    # pairs are compared (ActivityNet-FOIL: a video's score is the mean over its sentences); first / second
    # name one row of each unit
    row_units: np.ndarray | None = None
    # graded preferences (DOCENT): per judgment type, one 5-level label per pair, 0 = first much better,
    # 1 = first slightly better, 2 = equal, 3 = second slightly better, 4 = second much better
    graded: dict[str, np.ndarray] | None = None

    def __post_init__(self) -> None:
        if self.human_tie is not None:
            self.human_tie = np.asarray(self.human_tie, dtype=bool)
            if len(self.human_tie) != len(self.first):
                raise ValueError("human_tie must have one entry per pair")
        if self.pair_systems is not None and len(self.pair_systems) != len(self.first):
            raise ValueError("pair_systems must have one entry per pair")
        self.first = np.asarray(self.first, dtype=np.int64)
        self.second = np.asarray(self.second, dtype=np.int64)
        self.label = np.asarray(self.label, dtype=np.int64)
        n = len(self.first)
        if not (len(self.second) == len(self.label) == len(self.categories) == n):
            raise ValueError("first, second, label and categories must have one entry per pair")
        if n and not np.isin(self.label, (0, 1)).all():
            raise ValueError("labels must be 0 (first preferred) or 1 (second preferred)")

    def __len__(self) -> int:
        return len(self.first)

    def unit_scores(self, scores: np.ndarray) -> np.ndarray:
        """Per row: the mean score of its unit (NaN when any row of the unit has none); as given without units."""
        if self.row_units is None:
            return scores
        units = np.asarray(self.row_units, dtype=np.int64)
        total = np.bincount(units, weights=scores)
        return (total / np.bincount(units))[units]

    def units(self, by: str) -> np.ndarray:
        keys = self.captions.image_keys()
        return _units(by, len(self), [keys[i] for i in self.first])


def _units(by: str, n: int, image_keys: Sequence[str]) -> np.ndarray:
    if by == "row":
        return np.arange(n)
    if by == "image":
        return np.unique(np.asarray(image_keys, dtype=object).astype(str), return_inverse=True)[1].ravel()
    raise ValueError(f"resampling unit must be 'row' or 'image', got {by!r}")


def image_name(image: Any) -> str:
    if isinstance(image, dict) and image.get("bytes"):
        return "sha1:" + hashlib.sha1(image["bytes"]).hexdigest()
    if isinstance(image, dict):
        return str(image.get("path"))
    return str(image)


def resolve_images(images: Sequence[Any], root: str | os.PathLike | None, benchmark: str,
                   segments: Sequence[Any] | None = None, frames: int | None = None) -> list[Any]:
    """Image names -> files under ``root``. A name is tried as given, then by its file name alone, each also
    with a .jpg / .jpeg / .png (or a video) suffix when it has none (Nebula and Polaris name images by id);
    embedded images pass through. A name that is a folder is a video given as frames: its image files in
    numeric order, cut to the row's segment (frames ``start * n // duration`` to ``end * n // duration``, as
    EMScore's ActivityNet-FOIL code cuts them) and, with ``frames``, ``frames`` of them sampled uniformly
    (``linspace(0, n - 1, frames)``, EMScore's VATEX-EVAL sampling). Errors name the row and every path
    tried."""
    found: dict[str, Any] = {}
    out = []
    for row, image in enumerate(images):
        if isinstance(image, dict):
            out.append(image)
            continue
        name = str(image)
        if name not in found:
            found[name] = _find(name, root, row, benchmark)
        value = found[name]
        if isinstance(value, list):
            value = sample_frames(cut_segment(value, segments[row] if segments else None), frames)
        out.append(value)
    return out


def frame_files(folder: Path) -> list[str]:
    """A folder's frames in numeric order of their names (0.jpg, 1.jpg, ..., 10.jpg)."""
    files = [p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES]
    key = lambda p: (0, int(p.stem), "") if p.stem.isdigit() else (1, 0, p.name)  # noqa: E731
    return [str(p) for p in sorted(files, key=key)]


def cut_segment(frames: list[str], segment: Any) -> list[str]:
    if not segment:
        return frames
    start, end, duration = (float(v) for v in segment)
    n = len(frames)
    part = frames[int(start * n // duration): int(end * n // duration)]
    return part or frames[min(int(start * n // duration), n - 1):][:1]


def sample_frames(frames: list[str], count: int | None) -> list[str]:
    if count is None or len(frames) <= count:
        return frames
    return [frames[int(i)] for i in np.linspace(0, len(frames) - 1, count)]


def _find(name: str, root: str | os.PathLike | None, row: int, benchmark: str) -> Any:
    if root is None:
        raise InputError(f"{benchmark}: this metric scores images: pass the image folder (--images DIR)")
    base = Path(root)
    if not name.strip() or os.path.normpath(name) in (".", os.curdir) or Path(name).name in ("", ".", ".."):
        # base / "" is the images folder itself, whose frames were read as one video of every image
        raise InputError(f"{benchmark}: row {row}: image name {name!r} names no file")
    stems = [name, Path(name).name]
    tried = []
    for stem in dict.fromkeys(stems):
        folder = base / stem
        if folder.is_dir() and folder.resolve() != base.resolve():
            frames = frame_files(folder)
            if frames:
                return frames
        suffixed = Path(stem).suffix.lower() in IMAGE_SUFFIXES + VIDEO_SUFFIXES
        options = [stem] if suffixed else [stem, *(stem + s for s in IMAGE_SUFFIXES + VIDEO_SUFFIXES)]
        for option in options:
            path = base / option
            tried.append(str(path))
            if path.is_file():
                return str(path)
    raise InputError(f"{benchmark}: row {row}: image {name!r} not found (tried {', '.join(tried)})")
