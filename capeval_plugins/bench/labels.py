"""Human judgments from another source (``capeval bench --labels FILE``): the same rows, judged by another
release of the labels.

A benchmark's public file is not always the label set a paper scored. FLEUR's released Pascal-50S run carries
its own per-pair labels, which differ from the public ``pascal_50s.json`` on 35 of the 4,000 pairs; the papers
that report Nebula after its annotation fix replace each test row's score by the mean of the corrected rows
with the same image and caption. A label set replaces the benchmark file's judgments where it names the same
row, and says how many it matched and changed; the rows it does not name keep the file's judgments.

Formats (read by :func:`read_labels`):

* pairwise: records with the image, the two captions (``captions: [A, B]`` or ``caption_a`` / ``caption_b``)
  and ``label`` (0 or 1, the preferred caption), optionally ``category``; a ``{category: [pairs]}`` document
  (the ``pascal_50s.json`` layout); or FLEUR's released result texts (``results/fleur_pascal_HC.txt``, or the
  folder holding them, whose texts without labels are skipped: blocks of ``image file :``, ``label :`` and two
  ``caption :`` lines; the category is the file name's last ``_`` part);
* ratings: records with the image (``image``, ``imgid``, ``image_path``), the caption (``caption``, ``mt``,
  ``cand``) and a score (``score``, ``human_score``, ``rating``); several records of one image and caption are
  averaged. JSON, JSON Lines, CSV or Parquet; a folder is read whole (every record file and result text in
  it), so several files of one label set (e.g. the corrected Nebula scores split over train / val / test) are
  averaged together.

Images are matched by file name without folder or extension, captions after collapsing whitespace.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath
from typing import Any

import numpy as np

from capeval_plugins.bench.data import Pairs, Ratings, clean, image_name
from capeval_plugins.inputs import InputError

IMAGE_KEYS = ("image", "imgid", "image_path", "img", "file_name")
CAPTION_KEYS = ("caption", "mt", "cand", "candidate")
SCORE_KEYS = ("score", "human_score", "rating")
RECORD_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")


@dataclass
class LabelSet:
    """Pair labels by ``(category or None, image, caption A, caption B)`` and rating lists by ``(image,
    caption)``; ``source`` is where they were read."""

    source: str
    pairs: dict[tuple, int] = field(default_factory=dict)
    ratings: dict[tuple[str, str], list[float]] = field(default_factory=dict)


def image_key(image: Any) -> str:
    """An image as labels name it: the file name without folder or extension (``VOC2012/JPEGImages/x.jpg``
    and ``x`` are the same image)."""
    name = image_name(image) if isinstance(image, dict) else str(image)
    return PurePath(name.replace("\\", "/")).stem


def read_labels(path: str | Path) -> LabelSet:
    """The label set in ``path`` (see the module docstring for the formats)."""
    path = Path(path)
    labels = LabelSet(str(path))
    if path.is_dir():
        for file in sorted(path.iterdir()):
            if file.suffix.lower() == ".txt":  # result texts without labels (rating benchmarks) are skipped
                if any(line.startswith("label :") for line in _text(file).splitlines()):
                    _read_result_text(file, labels)
            elif file.suffix.lower() in RECORD_SUFFIXES:
                _read_records(file, labels)
        if not labels.pairs and not labels.ratings:
            raise InputError(f"{path}: no labels (FLEUR-style result texts with 'label :' lines, or record files "
                             f"{', '.join(RECORD_SUFFIXES)})")
        return labels
    if path.suffix.lower() == ".txt":
        _read_result_text(path, labels)
    else:
        _read_records(path, labels)
    if not labels.pairs and not labels.ratings:
        raise InputError(f"{path}: no labels (records need an image, captions and a label, or a caption and a score)")
    return labels


def _read_records(path: Path, labels: LabelSet) -> None:
    from capeval_plugins.bench.readers import load_records

    data = load_records(path, "label file")
    if isinstance(data, dict):
        records = [dict(r, category=str(cat)) if isinstance(r, dict) else r
                   for cat, rows in data.items() if isinstance(rows, list) for r in rows]
    elif isinstance(data, list):
        records = data
    else:
        raise InputError(f"{path}: expected records or {{category: [pairs]}}")
    for k, record in enumerate(records):
        _add_record(record, labels, f"{path}: record {k}")


def _read_result_text(path: Path, labels: LabelSet) -> None:
    """FLEUR's released result texts: ``image file : X`` (or ``image : X``), ``label : N``, two ``caption :``."""
    category = path.stem.rsplit("_", 1)[-1]
    blocks: list[dict] = []
    for n, line in enumerate(_text(path).splitlines(), 1):
        head, sep, value = line.partition(" :")
        head, value = head.strip(), value.strip()
        if not sep:
            continue
        if head in ("image file", "image"):
            blocks.append({"image": value, "label": None, "captions": [], "line": n})
        elif blocks and head == "label":
            if value not in ("0", "1"):
                raise InputError(f"{path}: line {n}: label must be 0 or 1, got {value!r}")
            blocks[-1]["label"] = int(value)
        elif blocks and head == "caption":
            blocks[-1]["captions"].append(value)
    if not blocks:
        raise InputError(f"{path}: no 'image file :' blocks (FLEUR's result format)")
    for block in blocks:
        if block["label"] is None or len(block["captions"]) != 2:
            raise InputError(f"{path}: line {block['line']}: a pair needs a label and two captions")
        _add_pair(labels, category, block["image"], block["captions"], block["label"])


def _text(path: Path) -> str:
    """A result text (regular files only: a FIFO or a device in a label folder is refused, never opened)."""
    from capeval_plugins import files
    from capeval_plugins.core import jsonio

    try:
        return jsonio.decode_text(files.read_input(path, "label file"), str(path))
    except (files.FileError, jsonio.JSONLinesError) as err:
        raise InputError(str(err)) from None


def _pick(record: dict, keys: tuple[str, ...]) -> Any:
    return next((record[k] for k in keys if record.get(k) not in (None, "")), None)


def _add_record(record: Any, labels: LabelSet, at: str) -> None:
    if not isinstance(record, dict):
        raise InputError(f"{at}: expected an object")
    image = _pick(record, IMAGE_KEYS)
    if image is None:
        raise InputError(f"{at}: no image ({', '.join(IMAGE_KEYS)})")
    captions = record.get("captions") or record.get("candidates")
    if captions is None and "caption_a" in record:
        captions = [record["caption_a"], record.get("caption_b")]
    if captions is not None:
        label = record.get("label")
        if isinstance(label, bool) or label not in (0, 1) or len(captions) != 2:
            raise InputError(f"{at}: a pair needs two captions and label 0 or 1, got {label!r}")
        _add_pair(labels, record.get("category"), image, captions, int(label))
        return
    caption, score = _pick(record, CAPTION_KEYS), _pick(record, SCORE_KEYS)
    if caption is None or score is None:
        raise InputError(f"{at}: expected two captions and a label, or a caption and a score")
    try:
        value = float(score)
    except (TypeError, ValueError):
        raise InputError(f"{at}: score {score!r} is not a number") from None
    if isinstance(score, bool) or not np.isfinite(value):
        raise InputError(f"{at}: score {score!r} is not a finite number")
    labels.ratings.setdefault((image_key(image), clean(caption)), []).append(value)


def _add_pair(labels: LabelSet, category: Any, image: Any, captions: list, label: int) -> None:
    key = (None if category is None else str(category), image_key(image), clean(captions[0]), clean(captions[1]))
    if labels.pairs.setdefault(key, label) != label:
        raise InputError(f"{labels.source}: two labels for one pair ({key[1]}: {key[2]!r} / {key[3]!r})")


def apply_labels(data: Ratings | Pairs, labels: LabelSet, scale: tuple[float, float] | None = None,
                 benchmark: str = "the benchmark") -> tuple[Ratings | Pairs, dict[str, Any]]:
    """``data`` with its judgments replaced where ``labels`` names the row, and a summary ``{"path", "matched",
    "changed", "unmatched"}`` (pairs or rows). Nothing matched is an error (the wrong file). ``scale``: the
    benchmark's human scale; a score of a matched row outside it is refused, each score before any is averaged
    (-1e9 and +1e9 average to a score inside it)."""
    if isinstance(data, Pairs):
        new, matched = _relabel_pairs(data, labels)
        changed = int((new.label != data.label).sum())
        total = len(data)
    else:
        new, matched = _rescore_rows(data, labels, scale, benchmark)
        changed = int((new.human != data.human).sum())
        total = len(data.captions)
    if not matched:
        raise InputError(f"{labels.source}: no row of the benchmark is in this label set")
    summary = {"path": labels.source, "matched": matched, "changed": changed, "unmatched": total - matched}
    return new, summary


def _relabel_pairs(data: Pairs, labels: LabelSet) -> tuple[Pairs, int]:
    if data.graded is not None or data.human_tie is not None:
        raise InputError("--labels replaces 0/1 preferences: this benchmark's judgments are graded or have ties")
    if not labels.pairs:
        raise InputError(f"{labels.source}: holds ratings, not pair labels")
    by_pair: dict[tuple, list[int]] = defaultdict(list)
    for (category, image, a, b), label in labels.pairs.items():
        by_pair[(image, a, b)].append(label)
    caps = data.captions
    new_labels, matched = data.label.copy(), 0
    for i in range(len(data)):
        image, a, b = image_key(caps.images[data.first[i]]), caps.candidates[data.first[i]], caps.candidates[data.second[i]]
        found = labels.pairs.get((data.categories[i], image, a, b))
        if found is None:
            uncategorised = labels.pairs.get((None, image, a, b))
            others = by_pair.get((image, a, b), [])
            found = uncategorised if uncategorised is not None else (others[0] if len(set(others)) == 1 else None)
        if found is not None:
            new_labels[i] = found
            matched += 1
    return replace(data, label=new_labels), matched


def _rescore_rows(data: Ratings, labels: LabelSet, scale: tuple[float, float] | None = None,
                  benchmark: str = "the benchmark") -> tuple[Ratings, int]:
    if data.targets and len(data.targets) > 1:
        raise InputError("--labels replaces one human score per row: this benchmark has several human columns")
    if not labels.ratings:
        raise InputError(f"{labels.source}: holds pair labels, not ratings")
    caps = data.captions
    human, matched = data.human.copy(), 0
    for i in range(len(caps)):
        key = (image_key(caps.images[i]), caps.candidates[i])
        values = labels.ratings.get(key)
        if values:
            outside = [v for v in values if scale is not None and not scale[0] <= v <= scale[1]]
            if outside:
                raise InputError(f"{labels.source}: the score {outside[0]!r} of image {key[0]!r}, caption "
                                 f"{key[1][:60]!r} is outside {benchmark}'s scale [{scale[0]:g}, {scale[1]:g}]; "
                                 "such a score would move every correlation")
            human[i] = float(np.mean(values))
            matched += 1
    return replace(data, human=human, targets=None), matched
