"""Per-sample scores computed elsewhere (a released per-sample output, another toolkit, a cluster run) read
back onto a benchmark's rows, and a benchmark run's own per-sample scores written out in the same format.

A score file holds one row per scored input, as JSON Lines, a JSON list, CSV or Parquet, with ``score`` and
the key of its benchmark row, one of:

- ``row``, the benchmark row number (what ``--save-scores`` writes, because a group or corpus metric can give
  one caption two scores: Soft-MSD in two SugarCrepe pairs); ``image`` and ``caption``, where given, are checked
  against the row, the image by any of the names below;
- ``image`` and ``caption`` (whitespace-normalised), the image as the benchmark file names it (its path), or
  else by its file name alone (``1000268201.jpg`` for ``Flicker8k_Dataset/1000268201.jpg``; an absolute path
  of the user's own machine matches so too), or else by that name without its suffix (``0001.jpg`` for
  Nebula's ``0001``). A short name that names two of the benchmark's images is refused in one line: key such a
  file by path or row. ``category`` is matched too when the file has that column
  (FOIL's 1-ref and 4-ref settings score one caption twice).

Which key matched is reported (``matched_by``). Every other numeric column is a per-sample extra
(``--extras``). Every benchmark row must find its score, else the error says how many did not and shows one.
A smoke pass's first rows of a benchmark (``notes["first_rows_of"]``, ``capeval reproduce --limit``) take a
row-keyed file of the whole benchmark: its rows past the cut are left out.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from capeval_plugins.bench.data import Pairs, Ratings, clean, image_name
from capeval_plugins.bench.readers import as_score
from capeval_plugins.inputs import InputError

RESERVED = ("image", "caption", "score", "category", "row")


def row_categories(data: Ratings | Pairs) -> list[str] | None:
    """The category of each row (a pair's category for both its rows), or None."""
    if isinstance(data, Pairs):
        out = [""] * len(data.captions)
        for first, second, category in zip(data.first.tolist(), data.second.tolist(), data.categories):
            out[first] = out[second] = str(category)
        return out
    return None if data.categories is None else [str(c) for c in data.categories]


def _number(value: Any, where: str, what: str = "score") -> float:
    """A score: a number or numeric text; empty / null is NaN (no score: the row is left out and counted, as
    a metric's invalid sample); a boolean is refused, and so are NaN and infinities written as numbers, which
    would be dropped like missing scores without a word: write null for no score."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return math.nan
    number = as_score(value, where, what)
    if not math.isfinite(number):
        raise NonFinite(f"{where}: {what} {value!r} is not a finite number; write null (or leave the cell empty) "
                        "for a row without a score")
    return number


class NonFinite(InputError):
    """A score written as NaN or an infinity."""


def _text(value: Any, what: str, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InputError(f"{where}: {what} must be text, got {type(value).__name__} {str(value)[:60]!r}")
    return str(value)


def _has_row(row: dict) -> bool:
    return "row" in row and row["row"] is not None and str(row["row"]).strip() != ""


def read_score_rows(path: str | os.PathLike) -> list[dict]:
    from capeval_plugins.bench.readers import load_records

    records = load_records(path, "score file")
    if isinstance(records, dict):
        records = [records]
    if not isinstance(records, list) or not records:
        raise InputError(f"{path}: expected rows with score and row, or image, caption and score (JSON Lines, CSV or "
                         "Parquet)")
    by_row = all(isinstance(row, dict) and _has_row(row) for row in records)
    for k, row in enumerate(records):
        if not isinstance(row, dict):
            raise InputError(f"{path}: row {k}: expected an object with score and row, or image, caption and score")
        missing = [c for c in (("score",) if by_row else ("image", "caption", "score")) if c not in row]
        if missing:
            raise InputError(f"{path}: row {k}: no {', '.join(missing)} column (columns: {sorted(row)}); a score "
                             "file keys each score by 'row' (the benchmark row) or by 'image' and 'caption'")
    return records


@dataclass
class Matched:
    """A score file's scores and numeric extras per benchmark row, and the key that matched them: ``row``,
    ``image path`` or ``image file name``."""

    scores: np.ndarray
    extras: dict[str, np.ndarray]
    matched_by: str


def match_scores(path: str | os.PathLike, data: Ratings | Pairs) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per benchmark row: the file's score and its numeric extra columns (NaN where a row has none)."""
    matched = match_score_file(path, data)
    return matched.scores, matched.extras


def match_score_file(path: str | os.PathLike, data: Ratings | Pairs) -> Matched:
    """:func:`match_scores`, with the key that matched (see the module docstring)."""
    rows = read_score_rows(path)
    captions = data.captions
    images = [image_name(img) for img in captions.images]
    cands = [clean(c) for c in captions.candidates]
    if all(_has_row(r) for r in rows):
        found, how = _by_row(path, rows, images, cands, data.notes.get("first_rows_of", len(images))), "row"
    else:
        categories = row_categories(data)
        found, how = _by_key(path, rows, images, cands, categories), "image path"
        for label, short in IMAGE_KEYS:  # shorter keys, while rows are left without a score
            if all(k is not None for k in found):
                break
            _check_short_names(path, rows, images, short, label)
            by_name = _by_key(path, rows, [short(name) for name in images], cands, categories, short)
            if sum(k is not None for k in by_name) > sum(k is not None for k in found):
                found, how = by_name, label
    missing = [i for i, k in enumerate(found) if k is None]
    if missing:
        i = missing[0]
        raise InputError(f"{path}: {len(missing):,} of {len(found):,} benchmark rows have no score, e.g. row {i}: "
                         f"image {images[i]!r}, caption {cands[i]!r} (matched by {how})")
    scores = np.array([_number(rows[k]["score"], f"{path}: row {k}") for k in found], dtype=np.float64)
    extras = {}
    for column in rows[0]:
        if column in RESERVED:
            continue
        try:
            extras[column] = np.array([_number(rows[k].get(column), f"{path}: row {k}", column) for k in found])
        except NonFinite:
            raise
        except InputError:
            continue  # a text column (an id, a model name) is no extra
    return Matched(scores, extras, how)


def _file_name(image: str) -> str:
    return os.path.basename(image)


def _stem(image: str) -> str:
    return os.path.splitext(os.path.basename(image))[0]


# Shorter keys of an image, tried in turn after its path: its file name (a benchmark's "Flicker8k_Dataset/1.jpg"
# for a file's "1.jpg" or "/home/me/1.jpg"), then its name without suffix (Nebula's "0001" for "0001.jpg").
IMAGE_KEYS = (("image file name", _file_name), ("image name without suffix", _stem))


def _check_short_names(path, rows: Sequence[dict], images: list[str], short, label: str) -> None:
    """A short name the score file uses that names two of the benchmark's images is refused: its scores could
    land on the wrong image."""
    paths_of: dict[str, set[str]] = {}
    for image in images:
        paths_of.setdefault(short(image), set()).add(image)
    for k, row in enumerate(rows):
        name = short(_text(row["image"], "image", f"{path}: row {k}"))
        if len(paths_of.get(name, ())) > 1:
            two = sorted(paths_of[name])[:2]
            raise InputError(f"{path}: row {k}: {label} {name!r} names {len(paths_of[name])} benchmark images "
                             f"({two[0]!r}, {two[1]!r}, ...); key the scores by the image path or by 'row'")


def _by_row(path, rows: Sequence[dict], images: list[str], cands: list[str], whole: int) -> list[int | None]:
    """``whole``: the rows of the whole benchmark, of which ``images`` may be the first (a smoke pass)."""
    found: list[int | None] = [None] * len(images)
    for k, row in enumerate(rows):
        where = f"{path}: row {k}"
        index = _row_number(row["row"], where)
        if not 0 <= index < max(whole, len(images)):
            raise InputError(f"{where}: row {index} is outside the benchmark's {whole:,} rows")
        if index >= len(images):
            continue  # a row the smoke pass does not run
        _check_row(row, index, images, cands, where)
        if found[index] is not None:  # the later one would silently win
            raise InputError(f"{where}: benchmark row {index} is given twice (also in row {found[index]}); a score "
                             "file holds one score per benchmark row")
        found[index] = k
    return found


def _check_row(row: dict, index: int, images: list[str], cands: list[str], where: str) -> None:
    """The image and caption a row-keyed line gives, where it has them, are its benchmark row's: the image by
    its path or a shorter name, as :func:`match_score_file` matches a file without rows."""
    image = _text(row["image"], "image", where) if "image" in row else images[index]
    caption = clean(_text(row["caption"], "caption", where)) if "caption" in row else cands[index]
    if not _same_image(image, images[index]) or caption != cands[index]:
        raise InputError(f"{where}: benchmark row {index} is image {images[index]!r}, caption "
                         f"{cands[index]!r}, not {image!r}, {caption!r} (a file for another benchmark?)")


def _same_image(given: str, image: str) -> bool:
    return given == image or any(short(given) == short(image) for _, short in IMAGE_KEYS)


def _row_number(value: Any, where: str) -> int:
    """A row number: an integer, an integral float (Parquet / pandas) or digits (CSV)."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise InputError(f"{where}: 'row' must be a benchmark row number, got {value!r}")


def _by_key(path, rows: Sequence[dict], images: list[str], cands: list[str],
            categories: list[str] | None, short=None) -> list[int | None]:
    use_category = categories is not None and all("category" in r for r in rows)
    table: dict[tuple, int] = {}
    for k, row in enumerate(rows):
        where = f"{path}: row {k}"
        image = _text(row["image"], "image", where)
        key = (short(image) if short else image, clean(_text(row["caption"], "caption", where)))
        if use_category:
            key += (str(row["category"]),)
        if key in table:
            a, b = _number(rows[table[key]]["score"], where), _number(row["score"], where)
            if not (a == b or (math.isnan(a) and math.isnan(b))):
                raise InputError(f"{where}: image {key[0]!r}, caption {key[1]!r} has two different scores "
                                 f"({a} and {b}); add a 'row' (benchmark row) or 'category' column")
            continue
        table[key] = k
    out = []
    for i, (image, caption) in enumerate(zip(images, cands)):
        key = (image, caption) + ((categories[i],) if use_category else ())
        out.append(table.get(key))
    return out


def write_scores(path: str | os.PathLike, data: Ratings | Pairs, scores: np.ndarray,
                 extras: Mapping[str, np.ndarray] | None = None, inputs: Sequence[Any] = ()) -> Path:
    """One JSON line per benchmark row: ``row``, ``image``, ``caption``, ``category`` (where the benchmark has
    categories), ``score`` and the per-sample extras; NaN is written as null. ``inputs``: files of the run
    it must not replace (see :func:`capeval_plugins.files.check_output`)."""
    from capeval_plugins import files
    from capeval_plugins.caption_files import write_table

    path = Path(path)
    files.Folder.open(path.parent, create=True)[0].close()
    categories = row_categories(data)
    columns = {k: np.asarray(v, dtype=np.float64) for k, v in (extras or {}).items()}
    rows = []
    for i, (image, caption) in enumerate(zip(data.captions.images, data.captions.candidates)):
        record: dict[str, Any] = {"row": i, "image": image_name(image), "caption": caption}
        if categories is not None:
            record["category"] = categories[i]
        record["score"] = _finite(scores[i])
        record.update({k: _finite(v[i]) for k, v in columns.items()})
        rows.append(record)
    write_table(path, rows, inputs, "--save-scores")  # whole, under a temporary name no other writer uses
    return path


def _finite(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def parse_score_args(values: Sequence[str]) -> dict[str, str]:
    """``NAME=FILE`` strings -> ``{name: file}``; a name given twice is refused."""
    out: dict[str, str] = {}
    for value in values:
        name, sep, file = value.partition("=")
        name, file = name.strip(), file.strip()
        if not sep or not name or not file:
            raise InputError(f"--scores expects NAME=FILE, got {value!r}")
        if name in out:
            raise InputError(f"--scores: {name!r} given twice")
        out[name] = file
    return out

