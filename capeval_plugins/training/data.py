"""Human-judgment training data: per sample an image or a video (its frames), a candidate caption, its
references (possibly none) and a human score, averaged over the sample's raters and normalised to [0, 1].

Readers:

* ``"rows"`` (the generic format): a JSON list, JSON Lines, CSV or Parquet file with one row per rated
  caption (or per rating: rows of the same visual, candidate and references are averaged). Keys, the first
  present being used:

  - the visual: ``frames`` (a list of frame files: a video), ``video`` / ``video_path`` / ``frames_dir`` (a
    folder of frame images: a video), or ``image`` / ``image_path`` / ``img`` / ``imgid`` / ``image_id`` (a
    file, an id looked up as ``<id>.jpg|.jpeg|.png``, or an embedded ``{"bytes": ...}`` image); relative
    paths are under the images folder;
  - the candidate: ``candidate`` / ``cand`` / ``caption`` / ``mt`` / ``hyp``;
  - references (optional): ``references`` / ``refs`` / ``ground_truth`` (a list, one string, or a list
    written as text);
  - the score: ``score`` / ``human_score`` / ``human`` / ``rating``, or a list of ratings under ``scores`` /
    ``ratings`` / ``judgments`` / ``human_scores`` (averaged).

  This covers Polaris / Nebula / Spica-style rows (``imgid, mt, refs, score``) and video judgments with
  frame folders (Vid-Lepus-style rows).
* Every rating benchmark that ``capeval bench`` reads (``flickr8k-expert``, ``flickr8k-cf``, ``composite``,
  ``nebula``, ``polaris``, ``thumb``), through its reader; one row per rating is averaged per caption.

Video files are not decoded here (that needs a video backend): extract frames into a folder first.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from capeval_plugins.core import jsonio
from capeval_plugins.inputs import ImageSource, InputError, Samples, image_source

FRAMES_KEYS = ("frames",)
VIDEO_DIR_KEYS = ("video", "video_path", "frames_dir")
IMAGE_KEYS = ("image", "image_path", "img", "imgid", "image_id")
CANDIDATE_KEYS = ("candidate", "cand", "caption", "mt", "hyp")
REFERENCE_KEYS = ("references", "refs", "ground_truth")
SCORE_KEYS = ("score", "human_score", "human", "rating")
SCORE_LIST_KEYS = ("scores", "ratings", "judgments", "human_scores")
FRAME_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".gif")
REFERENCE_USES = ("auto", "ignore", "both")


@dataclass
class JudgmentSet:
    """Validated training samples (``samples.references`` holds a list per sample, empty for none) and their
    human scores on [0, 1] (``scores``, float64), each the mean of ``raters`` ratings."""

    samples: Samples
    scores: np.ndarray
    raters: np.ndarray

    def __post_init__(self) -> None:
        self.scores = np.asarray(self.scores, dtype=np.float64)
        self.raters = np.asarray(self.raters, dtype=np.int64)
        if not (len(self.samples) == len(self.scores) == len(self.raters)):
            raise ValueError("samples, scores and raters differ in length")
        bad = np.flatnonzero(~np.isfinite(self.scores) | (self.scores < -1e-9) | (self.scores > 1 + 1e-9))
        if len(bad):
            raise InputError(f"sample {int(bad[0])}: human score {self.scores[bad[0]]!r} is not in [0, 1] after "
                             "normalisation (check the score range)")
        self.samples.indices = list(range(len(self.samples)))

    def __len__(self) -> int:
        return len(self.samples)

    def subset(self, positions: Sequence[int]) -> "JudgmentSet":
        positions = [int(p) for p in positions]
        return JudgmentSet(self.samples.subset(positions), self.scores[positions], self.raters[positions])

    def visual_keys(self) -> list[str]:
        return [repr(src.key) for src in self.samples.images]

    def split(self, fraction: float, seed: int = 0) -> tuple["JudgmentSet", "JudgmentSet"]:
        """(train, validation): a seeded share ``fraction`` of the distinct visuals (all their captions) held
        out, so no image is in both."""
        if not 0 < fraction < 1:
            raise ValueError(f"validation fraction must be in (0, 1), got {fraction}")
        keys = self.visual_keys()
        distinct = sorted(set(keys))
        rng = np.random.default_rng(seed)
        held = set(rng.permutation(len(distinct))[: max(1, round(fraction * len(distinct)))].tolist())
        held_keys = {distinct[i] for i in held}
        val = [i for i, k in enumerate(keys) if k in held_keys]
        train = [i for i, k in enumerate(keys) if k not in held_keys]
        if not train:
            raise InputError("nothing left to train on after holding out the validation share")
        return self.subset(train), self.subset(val)

    def with_references(self, use: str) -> "JudgmentSet":
        """``"auto"``: as read; ``"ignore"``: every sample reference-free; ``"both"``: every sample with
        references twice, once with them and once without (one checkpoint for both settings)."""
        if use not in REFERENCE_USES:
            raise ValueError(f"references use must be one of {REFERENCE_USES}, got {use!r}")
        if use == "auto":
            return self
        refs = self.samples.references
        free = Samples(list(self.samples.candidates), list(self.samples.indices), list(self.samples.images),
                       [[] for _ in refs])
        if use == "ignore":
            return JudgmentSet(free, self.scores, self.raters)
        with_refs = [i for i, r in enumerate(refs) if r]
        extra = self.subset(with_refs).samples
        merged = Samples(free.candidates + extra.candidates, list(range(len(free) + len(extra))),
                         free.images + extra.images, free.references + extra.references)
        return JudgmentSet(merged, np.concatenate([self.scores, self.scores[with_refs]]),
                           np.concatenate([self.raters, self.raters[with_refs]]))

    def fingerprint(self) -> str:
        """A digest of everything a backbone pass reads: visuals (file identity, or content), candidates and
        references, in order."""
        h = hashlib.sha256()
        for src, cand, refs in zip(self.samples.images, self.samples.candidates, self.samples.references):
            h.update(json.dumps([visual_digest(src), cand, refs]).encode())
        return h.hexdigest()


def visual_digest(src: ImageSource) -> Any:
    """A stable identity of an image or video: path, size, modification and change times and inode for files
    (a file rewritten with its old time kept is another), a content hash for in-memory images and bytes."""
    if src.kind == "video":
        return [visual_digest(frame) for frame in src.value]
    if src.kind == "path":
        stat = os.stat(src.value)
        return ["path", os.path.realpath(src.value), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
    if src.kind == "bytes":
        return list(src.key)
    image = src.load()
    return ["pixels", image.size, image.mode, hashlib.sha256(image.tobytes()).hexdigest()]


def from_lists(visuals: Sequence[Any], candidates: Sequence[str], scores: Sequence[float],
               references: Sequence[Sequence[str] | None] | None = None,
               score_range: tuple[float, float] = (0.0, 1.0), raters: Sequence[int] | None = None) -> JudgmentSet:
    """A judgment set from Python lists (images or lists of frames as ``capeval_plugins`` accepts them);
    scores on ``score_range`` are mapped linearly to [0, 1]."""
    n = len(candidates)
    if not (len(visuals) == len(scores) == n) or (references is not None and len(references) != n):
        raise InputError("visuals, candidates, scores (and references) must have one entry per sample")
    sources = [image_source(v, i, video_ok=True) for i, v in enumerate(visuals)]
    cands = []
    for i, c in enumerate(candidates):
        if not isinstance(c, str) or not c.strip():
            raise InputError(f"sample {i}: the candidate caption is missing or empty")
        cands.append(c)
    refs = [list(r or []) for r in (references or [None] * n)]
    lo, hi = score_range
    if not hi > lo:
        raise ValueError(f"score range must be (low, high) with low < high, got {score_range}")
    normalised = (np.asarray(scores, dtype=np.float64) - lo) / (hi - lo)
    count = np.ones(n, dtype=np.int64) if raters is None else np.asarray(raters)
    return JudgmentSet(Samples(cands, list(range(n)), sources, refs), normalised, count)


def read_judgments(path: str | os.PathLike, *, format: str = "rows", images: str | os.PathLike | None = None,
                   score_range: tuple[float, float] = (0.0, 1.0), num_frames: int | None = None,
                   average: bool = True) -> JudgmentSet:
    """Read a human-judgment file (see the module docstring). ``images``: the folder relative image and
    frame paths are under (default: the file's folder). ``score_range``: the scale of the file's scores
    (e.g. ``(1, 5)``), mapped to [0, 1]. ``num_frames``: frames taken (uniformly) from a frame folder.
    ``average``: average the ratings of identical (visual, candidate, references) rows."""
    if format == "rows":
        visuals, candidates, references, ratings = _read_rows(Path(path), images, num_frames)
        _check_range(path, ratings, score_range)  # by the file's row, before rows are merged
    else:
        visuals, candidates, references, ratings = _read_benchmark(format, Path(path), images)
    if average:
        visuals, candidates, references, ratings = _average(visuals, candidates, references, ratings)
    means = [float(np.mean(r)) for r in ratings]
    return from_lists(visuals, candidates, means, references, score_range, [len(r) for r in ratings])


def _check_range(path: str | os.PathLike, ratings: Sequence[Sequence[float]], score_range: tuple[float, float]) -> None:
    """A rating outside ``score_range``, named by its row and as written (after the rows of one sample are
    merged, only the merged sample's normalised mean could be named)."""
    lo, hi = score_range
    slack = 1e-9 * abs(hi - lo)
    for row, values in enumerate(ratings):
        outside = [v for v in values if not lo - slack <= v <= hi + slack]
        if outside and hi > lo:
            raise InputError(f"{path}: row {row}: human score {outside[0]:g} is outside the score range [{lo:g}, {hi:g}]")


def reader_formats() -> list[str]:
    from capeval_plugins.bench.benchmarks import BENCHMARKS

    return ["rows"] + [name for name, b in BENCHMARKS.items() if b.protocol.kind == "correlation"]


def _read_rows(path: Path, images: str | os.PathLike | None, num_frames: int | None):
    from capeval_plugins.bench.readers import as_list, load_records, pick

    records = load_records(path, "training file")
    if isinstance(records, dict):
        records = next((v for v in records.values() if isinstance(v, list)), None)
    if not isinstance(records, list):
        raise InputError(f"{path}: expected a list of rows (JSON list, JSON Lines, CSV or Parquet)")
    root = Path(images) if images is not None else path.parent
    visuals, candidates, references, ratings = [], [], [], []
    for k, row in enumerate(records):
        at = f"{path}: row {k}"
        if not isinstance(row, dict):
            raise InputError(f"{at}: expected an object")
        visuals.append(_visual(row, root, num_frames, at))
        candidate = pick(row, CANDIDATE_KEYS, "candidate caption", at)
        if not isinstance(candidate, str):  # str() would score "5" or "['a', 'b']" as a caption
            raise InputError(f"{at}: the candidate caption must be a string, got {type(candidate).__name__}")
        candidates.append(" ".join(candidate.split()))
        refs = pick(row, REFERENCE_KEYS, "references", at, required=False)
        references.append(as_list(refs, at) if refs not in (None, "", []) else [])
        ratings.append(_ratings(row, at))
    return visuals, candidates, references, ratings


def _score(value: Any, at: str) -> float:
    from capeval_plugins.bench.readers import as_score

    if isinstance(value, bool):  # float(True) is 1.0: a flag, not a rating
        raise InputError(f"{at}: human score {value!r} is not a number")
    return as_score(value, at)


def _ratings(row: dict, at: str) -> list[float]:
    from capeval_plugins.bench.readers import pick

    listed = pick(row, SCORE_LIST_KEYS, "", at, required=False)
    if listed is not None:
        if isinstance(listed, str):
            listed = json_cell(listed, at, "ratings")
        values = [_score(v, at) for v in (listed if isinstance(listed, (list, tuple)) else [listed])]
    else:
        values = [_score(pick(row, SCORE_KEYS, "human score", at), at)]
    if not values or any(math.isnan(v) for v in values):
        raise InputError(f"{at}: no valid human score")
    return values


def json_cell(text: str, at: str, what: str) -> Any:
    """A list written as JSON text in a CSV cell (or a string column), refused by its row when it is not."""
    try:
        return jsonio.loads(text)
    except json.JSONDecodeError:
        raise InputError(f"{at}: {what} must be a list (a JSON list in a CSV cell), got {text[:60]!r}") from None


def _visual(row: dict, root: Path, num_frames: int | None, at: str) -> Any:
    from capeval_plugins.bench.data import resolve_images
    from capeval_plugins.bench.readers import pick

    frames = pick(row, FRAMES_KEYS, "", at, required=False)
    if frames is not None:
        if isinstance(frames, str):
            frames = json_cell(frames, at, "frames")
        if not isinstance(frames, (list, tuple)) or not frames:
            raise InputError(f"{at}: 'frames' must be a non-empty list of frame files")
        return _subsample([_under(root, f, at) for f in frames], num_frames)
    folder = pick(row, VIDEO_DIR_KEYS, "", at, required=False)
    if folder is not None:
        return _subsample(frame_files(_under(root, folder, at, folder=True), at), num_frames)
    image = pick(row, IMAGE_KEYS, "image, frames or video", at)
    if isinstance(image, dict):
        return image
    try:
        return resolve_images([str(image)], root, str(at))[0]
    except InputError as err:  # the same lookup as capeval bench (id -> <id>.jpg, ...), named by this row
        raise InputError(f"{at}: image {image!r} not found under {root}") from err


def _under(root: Path, name: Any, at: str, folder: bool = False) -> str:
    path = Path(str(name))
    path = path if path.is_absolute() else root / path
    if folder and path.suffix.lower() in VIDEO_SUFFIXES:
        raise InputError(f"{at}: {path} is a video file; video files are not decoded here. Extract frames into a "
                         f"folder first (e.g. ffmpeg -i {path.name} -vf fps=2 frames/%04d.jpg) and name the folder")
    if (folder and not path.is_dir()) or (not folder and not path.is_file()):
        raise InputError(f"{at}: {'frame folder' if folder else 'frame file'} not found: {path}")
    return str(path)


def frame_files(folder: str | os.PathLike, at: str = "") -> list[str]:
    """The image files of a frame folder, in name order."""
    files = sorted(str(p) for p in Path(folder).iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
    if not files:
        raise InputError(f"{at or folder}: no frame images ({', '.join(FRAME_SUFFIXES)}) in {folder}")
    return files


def _subsample(frames: list[str], num_frames: int | None) -> list[str]:
    """``num_frames`` frames spread evenly over the video (first and last included), or all of them."""
    if num_frames is None or len(frames) <= num_frames:
        return frames
    if num_frames < 1:
        raise ValueError(f"num_frames must be at least 1, got {num_frames}")
    picks = np.linspace(0, len(frames) - 1, num_frames).round().astype(int)
    return [frames[i] for i in picks]


def _read_benchmark(name: str, path: Path, images: str | os.PathLike | None):
    from capeval_plugins.bench.benchmarks import load_benchmark
    from capeval_plugins.bench.data import Ratings, resolve_images

    if name not in reader_formats():
        raise ValueError(f"unknown judgment format {name!r}; choose one of {reader_formats()}")
    if not path.exists():  # the benchmark readers would call it a benchmark file
        raise InputError(f"training file not found: {path} (format {name})")
    data = load_benchmark(name, path)
    if not isinstance(data, Ratings):
        raise InputError(f"{name} is a pairwise benchmark, not human scores")
    caps = data.captions
    root = images if images is not None else path.parent if path.is_file() else path
    visuals = resolve_images(caps.images, root, name)
    refs = caps.references or [[] for _ in caps.candidates]
    return visuals, list(caps.candidates), [list(r or []) for r in refs], [[float(h)] for h in data.human]


def _average(visuals, candidates, references, ratings):
    """Rows of the same visual, candidate and references merged, their ratings pooled (first-seen order)."""
    from capeval_plugins.bench.data import image_name

    merged: dict[str, int] = {}
    out_v, out_c, out_r, out_s = [], [], [], []
    for v, c, r, s in zip(visuals, candidates, references, ratings):
        key = json.dumps([v if isinstance(v, (str, list)) else image_name(v), c, r])
        if key in merged:
            out_s[merged[key]] = out_s[merged[key]] + list(s)
            continue
        merged[key] = len(out_c)
        out_v.append(v), out_c.append(c), out_r.append(r), out_s.append(list(s))
    return out_v, out_c, out_r, out_s
