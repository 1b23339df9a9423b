"""Samples named by the user's own ids: an id checked as one (text or an integer), and the layout of
captioning toolkits, where the predictions and the references are two files joined by id.

``capeval score --predictions preds.json --references refs.json`` reads::

    preds.json   [{"id": "img1", "caption": "a dog runs"}, ...]         or {"img1": "a dog runs", ...}
    refs.json    [{"id": "img1", "references": ["...", "..."], "image": "img1.jpg"}, ...]
                                                                        or {"img1": ["...", "..."], ...}

as a JSON document (an array of records, or an object keyed by id), JSON Lines, CSV, TSV or Parquet (records
with the same keys; ``image_id`` may name the id). ``image`` may be in either file (the same one where both
have it). Rows come in the predictions' order, each keeping its id. Ids match as text (``42`` and ``"42"`` are
one id: a JSON object's keys are always text). An id given twice in one file, a prediction without references
and references without a prediction are each refused in one line naming the first such id and the count.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from capeval_plugins.caption_files import (CaptionRecords, _read_text, caption_file_format, check_input,
                                           read_records, references_cell)
from capeval_plugins.core import jsonio
from capeval_plugins.inputs import InputError

ID_KEYS = ("id", "image_id")


def check_id(value: Any, at: str) -> str | int:
    """A sample id as given: text or an integer (an integral float, as Parquet or pandas write integers, is that
    integer); true / false, other numbers, lists and objects are refused naming ``at``."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InputError(f"{at}: id {json.dumps(value, default=str)[:40]} is not text or an integer")
    return value


def id_key(value: str | int) -> str:
    """What two ids are compared by: their text (a JSON object's keys are text, a JSON list's ids may not be)."""
    return str(value)


def _entries(path: str, what: str) -> list[tuple[str, dict[str, Any]]]:
    """``(where, record)`` of every entry of a predictions or references file: a JSON document (an array of
    records or an object keyed by id) or records (JSON Lines, CSV, TSV, Parquet)."""
    check_input(path, what)
    fmt = caption_file_format(path)
    if fmt == ".jsonl":
        text = _read_text(path)
        try:
            data = jsonio.loads(text)
        except jsonio.RepeatedKeyError as err:  # in a document: an id (or a record's key) given twice
            raise InputError(f"{path}: {err}") from None
        except json.JSONDecodeError:
            data = None  # JSON Lines
        except RecursionError:
            raise InputError(f"{path}: JSON nested too deep") from None
        if isinstance(data, dict):
            return [(f"{path}: key {key!r}", _keyed(key, value, what)) for key, value in data.items()]
        if isinstance(data, list):
            out = []
            for k, row in enumerate(data):
                if not isinstance(row, dict):
                    raise InputError(f"{path}: entry {k} is not an object (an array of records, or an object "
                                     "keyed by id)")
                out.append((f"{path}: entry {k}", row))
            return out
    unit = "row" if fmt == ".parquet" else "line"
    return [(f"{path}: {unit} {n}" if unit == "row" else f"{path}:{n}", row)
            for n, row in read_records(path, with_lines=True)]


def _keyed(key: str, value: Any, what: str) -> dict[str, Any]:
    """An entry of an object keyed by id: its value is the caption (predictions), the references, or a record."""
    if isinstance(value, dict):
        return {"id": key, **value}
    return {"id": key, ("caption" if what == "predictions file" else "references"): value}


def _id_of(row: dict[str, Any], at: str) -> str | int:
    for key in ID_KEYS:
        if key in row and row[key] is not None:
            return check_id(row[key], at)
    raise InputError(f"{at}: no id (keys: {', '.join(map(repr, row)) or 'none'}); each entry needs an 'id'")


def _by_id(path: str, what: str) -> dict[str, tuple[str, Any, dict[str, Any]]]:
    """``id text -> (where, id as given, record)``; an id given twice is refused."""
    out: dict[str, tuple[str, Any, dict[str, Any]]] = {}
    for at, row in _entries(path, what):
        given = _id_of(row, at)
        key = id_key(given)
        if key in out:
            raise InputError(f"{at}: id {json.dumps(given)} is given twice in the {what} (also {out[key][0]}); "
                             "each id names one sample")
        out[key] = (at, given, row)
    if not out:
        raise InputError(f"{path}: the {what} holds no entries")
    return out


def read_joined(predictions: str | os.PathLike, references: str | os.PathLike,
                images_dir: str | os.PathLike | None = None) -> CaptionRecords:
    """The predictions and references files joined by id (see the module docstring), in the predictions'
    order; images relative to ``images_dir`` (default: the folder of the file that names them)."""
    predictions, references = os.fspath(predictions), os.fspath(references)
    if images_dir is not None and not os.path.isdir(images_dir):
        raise InputError(f"images folder not found: {images_dir}")
    preds = _by_id(predictions, "predictions file")
    refs = _by_id(references, "references file")
    _check_sides(preds, refs, predictions, references)
    records = CaptionRecords(path=predictions, unit="entry", row_ids=[])
    for k, (key, (at, given, row)) in enumerate(preds.items()):
        ref_at, _, ref_row = refs[key]
        if "caption" not in row:
            raise InputError(f"{at}: id {json.dumps(given)} has no 'caption'")
        image, from_refs = _image(row, ref_row, at, ref_at)
        root = Path(images_dir) if images_dir is not None else Path(references if from_refs else predictions).parent
        records.images.append(str(root / image) if isinstance(image, str) and image else image)
        records.image_names.append(image)
        records.captions.append(row["caption"])
        records.references.append(references_cell(ref_row.get("references", ref_row.get("caption")), ref_at,
                                                  cell=caption_file_format(references) != ".jsonl"))
        records.groups.append(row.get("group"))
        records.row_ids.append(given)
        records.lines.append(k)
    return records


def _check_sides(preds: dict, refs: dict, predictions: str, references: str) -> None:
    for have, lack, one, other in ((preds, refs, predictions, references), (refs, preds, references, predictions)):
        missing = [key for key in have if key not in lack]
        if missing:
            at, given, _ = have[missing[0]]
            side = "prediction" if have is preds else "reference entry"
            raise InputError(f"{len(missing):,} {side} id(s) of {one} are not in {other} (first: "
                             f"{json.dumps(given)}, {at}); every id needs both a prediction and references")


def _image(row: dict, ref_row: dict, at: str, ref_at: str) -> tuple[Any, bool]:
    """The sample's image, and whether only the references file names it; two different names are refused."""
    mine, theirs = row.get("image"), ref_row.get("image")
    if mine is not None and theirs is not None and mine != theirs:
        raise InputError(f"{at}: image {mine!r}, but {ref_at} names {theirs!r} for the same id")
    return (mine, False) if mine is not None else (theirs, theirs is not None)
