"""The caption file format shared by ``capeval score`` and the shipped lm-eval task, and score output.

One JSON object per line::

    {"image": "dog.png", "caption": "A dog runs on the grass.", "references": ["...", "..."]}

``image`` is relative to the images folder (or absolute); ``references`` (a list, or one string) is needed
only by reference-based metrics; ``group`` (optional) names the group of a candidate for group metrics;
``caption`` is the candidate to score (not needed by the lm-eval task, which generates it).
"""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capeval_plugins.contract import MetricResult
from capeval_plugins.inputs import InputError


@dataclass
class CaptionRecords:
    images: list[str | None] = field(default_factory=list)
    captions: list[str | None] = field(default_factory=list)
    references: list[list[str] | None] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.captions)


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSON Lines file (or CSV, by suffix); errors name the file and line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InputError(f"file not found: {path}")
    with open(path, encoding="utf-8", newline="") as f:
        if path.endswith(".csv"):
            return list(csv.DictReader(f))
        rows = []
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:{lineno}: not valid JSON: {err}") from err
            if not isinstance(row, dict):
                raise InputError(f"{path}:{lineno}: expected a JSON object")
            rows.append(row)
        return rows


def read_captions(path: str | os.PathLike, images_dir: str | os.PathLike | None = None) -> CaptionRecords:
    """Read a caption file; errors name the line."""
    records = CaptionRecords()
    root = Path(images_dir) if images_dir is not None else Path(path).parent
    for row in read_records(path):
        image = row.get("image")
        records.images.append(str(root / image) if image is not None else None)
        records.captions.append(row.get("caption"))
        refs = row.get("references")
        records.references.append([refs] if isinstance(refs, str) else refs)
        records.groups.append(row.get("group"))
    return records


def load_caption_docs(path: str | os.PathLike, images_dir: str | os.PathLike | None, limit: int | None = None) -> list[dict]:
    """Documents for the lm-eval caption task: ``image_path`` and ``references`` per line."""
    records = read_captions(path, images_dir)
    docs = []
    for i, (image, refs) in enumerate(zip(records.images, records.references)):
        if image is None or not os.path.isfile(image):
            raise InputError(f"{path}: line {i + 1}: image file not found: {image}")
        docs.append({"id": i, "image_path": image, "references": refs or []})
    return docs[:limit] if limit else docs


def write_scores(path: str | os.PathLike, result: MetricResult) -> None:
    """One line per sample in input order with ``index``, ``score`` and the per-sample extras; the format
    follows the suffix (``.csv``, else JSON Lines)."""
    rows = result.rows()
    if str(path).endswith(".csv"):
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["index", "score"])
            writer.writeheader()
            for row in rows:
                writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})
        return
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
