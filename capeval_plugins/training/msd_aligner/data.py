"""Image-caption pairs for training the MSD aligner, from a local folder.

:func:`read_captions` reads a JSON list, JSON Lines, CSV or Parquet file of records, one image-caption pair
each:

* LLaVA's feature-alignment format (CC3M-595K ``chat.json``, LCS-558K ``blip_laion_cc_sbu_558k.json``):
  ``{"id", "image", "conversations": [{"from": "human", "value": "<instruction>\\n<image>"},
  {"from": "gpt", "value": <caption>}]}``. The caption is the first ``gpt`` turn; the instruction is dropped,
  as LLaVA's "plain" pre-training template drops it.
* Plain pairs: ``{"image": ..., "caption": ...}`` (also ``text`` or ``candidate`` for the caption).

``image`` is a path relative to the images folder (default: the file's folder), e.g. ``GCC_train_000000000.jpg``
for CC3M-595K's ``images.zip`` unpacked.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from capeval_plugins.inputs import InputError, Samples, image_source
from capeval_plugins.training.data import visual_digest

CAPTION_KEYS = ("caption", "text", "candidate")
ANSWER_ROLES = ("gpt", "assistant")


@dataclass
class CaptionSet:
    """Validated image-caption pairs (``samples.candidates`` are the captions)."""

    samples: Samples

    def __post_init__(self) -> None:
        self.samples.indices = list(range(len(self.samples)))

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def captions(self) -> list[str]:
        return self.samples.candidates

    def subset(self, positions: Sequence[int]) -> "CaptionSet":
        return CaptionSet(self.samples.subset([int(p) for p in positions]))

    def fingerprint(self) -> str:
        """A digest of the images (file identity, or content) and captions, in order."""
        h = hashlib.sha256()
        for src, caption in zip(self.samples.images, self.samples.candidates):
            h.update(json.dumps([visual_digest(src), caption]).encode())
        return h.hexdigest()


def from_lists(images: Sequence[Any], captions: Sequence[str]) -> CaptionSet:
    """Pairs from Python lists (images as ``capeval_plugins`` accepts them: paths, PIL images, arrays, bytes)."""
    if len(images) != len(captions):
        raise InputError(f"{len(images)} images but {len(captions)} captions")
    sources = [image_source(image, i) for i, image in enumerate(images)]
    for i, caption in enumerate(captions):
        if not isinstance(caption, str) or not caption.strip():
            raise InputError(f"sample {i}: the caption is missing or empty")
    return CaptionSet(Samples(list(captions), list(range(len(captions))), sources))


def caption_of(row: dict, at: str) -> str:
    """The caption of one record: the answer turn of a LLaVA conversation, else a caption field."""
    from capeval_plugins.bench.readers import pick

    turns = row.get("conversations")
    if isinstance(turns, str):  # a CSV cell or string column: the turns as JSON text
        from capeval_plugins.training.data import json_cell

        turns = json_cell(turns, at, "'conversations'")
    if turns is not None:
        if not isinstance(turns, list):
            raise InputError(f"{at}: 'conversations' must be a list of turns")
        for turn in turns:
            if isinstance(turn, dict) and turn.get("from") in ANSWER_ROLES and isinstance(turn.get("value"), str):
                return turn["value"]
        raise InputError(f"{at}: no {' or '.join(ANSWER_ROLES)} turn (the caption) in 'conversations'")
    caption = pick(row, CAPTION_KEYS, "caption", at)
    if not isinstance(caption, str):
        raise InputError(f"{at}: the caption must be a string, got {type(caption).__name__}")
    return caption


def read_captions(path: str | os.PathLike, *, images: str | os.PathLike | None = None,
                  limit: int | None = None) -> CaptionSet:
    """Read a caption file (see the module docstring). ``images``: the folder image paths are relative to
    (default: the file's folder); ``limit``: the first ``limit`` records only."""
    from capeval_plugins.bench.readers import load_records

    path = Path(path)
    records = load_records(path, "training caption file")
    if isinstance(records, dict):
        records = next((v for v in records.values() if isinstance(v, list)), None)
    if not isinstance(records, list):
        raise InputError(f"{path}: expected a list of records (JSON list, JSON Lines, CSV or Parquet)")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InputError(f"limit must be a positive number of records, got {limit!r}")  # [:-1] drops the last
        records = records[:limit]
    root = Path(images) if images is not None else path.parent
    files, captions = [], []
    for k, row in enumerate(records):
        at = f"{path}: record {k}"
        if not isinstance(row, dict):
            raise InputError(f"{at}: expected an object")
        image = row.get("image")
        if not isinstance(image, str) or not image:
            raise InputError(f"{at}: 'image' (a file name under the images folder) is missing")
        file = Path(image) if Path(image).is_absolute() else root / image
        if not file.is_file():
            raise InputError(f"{at}: image not found: {file}")
        files.append(str(file))
        captions.append(caption_of(row, at))
    if not files:
        raise InputError(f"{path}: no records")
    return from_lists(files, captions)
