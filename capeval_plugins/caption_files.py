"""The caption file format shared by ``capeval score`` and the shipped lm-eval task, and score output.

A caption file is JSON Lines (any suffix but the ones below), CSV (``.csv``), TSV (``.tsv``) or Parquet
(``.parquet``), with one record per sample::

    {"image": "dog.png", "caption": "A dog runs on the grass.", "references": ["...", "..."]}

``image`` is relative to the images folder (or absolute); ``references`` (a list, or one string) is needed
only by reference-based metrics; ``group`` (optional) names the group of a candidate for group metrics;
``caption`` is the candidate to score (not needed by the lm-eval task, which generates it).

In CSV and TSV files (first line: the column names) the ``references`` cell holds a JSON list
(``["a dog on grass", "a brown dog"]``); a cell that does not start with ``[`` is one reference, and an
empty cell none. In Parquet, ``references`` is a list column (a string column is read like a CSV cell).
Every form gives the same records as the JSON Lines file; a cell that is neither is refused by its line. CSV
and TSV are parsed strictly, one record per line (a quote left open, or a line break inside a cell, is
refused by its line: captions with line breaks go in JSON Lines or Parquet).
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

from capeval_plugins import files
from capeval_plugins.contract import MetricResult, extra_values
from capeval_plugins.core import jsonio
from capeval_plugins.core.messages import install_extra
from capeval_plugins.inputs import InputError


@dataclass
class CaptionRecords:
    images: list[str | None] = field(default_factory=list)
    captions: list[str | None] = field(default_factory=list)
    references: list[list[str] | None] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # each record's line in the file (1-based; Parquet: row)
    image_names: list[Any] = field(default_factory=list)  # each record's image as the file writes it
    ids: list[Any] | None = None  # each record's image id, where the file has one (a COCO results file)
    row_ids: list[Any] | None = None  # each record's own ``id``, where the input gives ids (kept in the output)
    path: str = ""
    unit: str = "line"  # "row" for Parquet

    def __len__(self) -> int:
        return len(self.captions)

    def describe(self, index: int) -> str:
        """How an error names record ``index``: ``sample 250 (captions.jsonl line 251)``."""
        line = self.lines[index] if 0 <= index < len(self.lines) else None
        if line is None:
            return f"sample {index}"
        return f"sample {index} ({os.path.basename(self.path)} {self.unit} {line})"


TABLE_DELIMITERS = {".csv": ",", ".tsv": "\t"}


def caption_file_format(path: str | os.PathLike) -> str:
    """``.csv``, ``.tsv`` and ``.parquet`` by suffix; anything else is JSON Lines."""
    suffix = Path(path).suffix.lower()
    return suffix if suffix in (".csv", ".tsv", ".parquet") else ".jsonl"


def read_records(path: str | os.PathLike, with_lines: bool = False) -> list[dict[str, Any]]:
    """The records of a JSON Lines, CSV, TSV or Parquet file (by suffix), values as stored (a CSV cell is a
    string; a Parquet null is left out); errors name the file and line. With ``with_lines``, each record
    comes as ``(line number, record)`` (for Parquet, its row number from 0)."""
    path = os.fspath(path)
    check_input(path, "caption file")
    fmt = caption_file_format(path)
    if fmt == ".parquet":
        rows = _parquet_rows(path)
    elif fmt in TABLE_DELIMITERS:
        rows = _table_rows(path, _read_text(path), TABLE_DELIMITERS[fmt])
    else:
        rows = _json_lines(path)
    return rows if with_lines else [row for _, row in rows]


def check_input(path: str | os.PathLike, what: str) -> None:
    """An input file named on the command line, refused in one line when it is missing or is a folder, a FIFO or
    a device (said as such; looked at with ``stat`` only, so a FIFO never blocks)."""
    try:
        files.check_input(path, what)
    except files.FileError as err:
        raise InputError(str(err)) from None


def _read_text(path: str) -> str:
    """The file as text (UTF-8, a leading byte-order mark dropped); invalid UTF-8 is refused by its line."""
    try:
        data = files.read_input(path, "caption file")
    except files.FileError as err:
        raise InputError(str(err)) from None
    try:
        return jsonio.decode_text(data, path)
    except jsonio.JSONLinesError as err:
        raise InputError(str(err)) from None


def _json_lines(path: str) -> list[tuple[int, dict[str, Any]]]:
    text = _read_text(path)
    try:
        rows = jsonio.json_lines(text, path)  # the one JSON Lines reader (bench and --scores too)
        for lineno, row in rows:
            if not isinstance(row, dict):
                raise InputError(f"{path}:{lineno}: expected a JSON object")
    except (jsonio.JSONLinesError, InputError) as err:
        known = other_format(path, text)
        raise InputError(f"{err}; {known}" if known else str(err)) from None
    if len(rows) == 1 and "annotations" in rows[0][1] and "caption" not in rows[0][1]:  # a COCO file on one line
        known = other_format(path, text)
        if known:
            raise InputError(f"{path}:{rows[0][0]}: one record, without a caption; {known}")
    return rows


def other_format(path: str, text: str) -> str | None:
    """What a caption file that is not JSON Lines is, when it is a format users of these tools have, and how to
    pass it; None otherwise."""
    try:
        data = jsonio.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        if all("image_id" in r and "caption" in r for r in data):
            return (f"{path} is a COCO results file ([{{\"image_id\", \"caption\"}}]): pass it with --captions and "
                    "its annotation file with --annotations (e.g. captions_val2014.json: references from its "
                    "captions, images from its file_name under --images)")
        return (f"{path} is a JSON array of records; a caption file has one JSON object per line (JSON Lines): "
                "write each record on its own line")
    if isinstance(data, dict) and "annotations" in data:
        return (f"{path} is a COCO annotation file (references, not candidates): pass it with --annotations, and "
                "the captions to score (a COCO results file [{\"image_id\", \"caption\"}]) with --captions")
    first = next((line for line in text.split("\n") if line.strip()), "")
    try:
        jsonio.loads(first)
        first_is_json = True
    except json.JSONDecodeError:
        first_is_json = False
    if data is None and not first_is_json and not first.lstrip().startswith(("{", "[")):
        return (f"{path} is plain text, not JSON Lines: for one candidate caption per line (bert-score's files) "
                "pass it with -c FILE and the references with -r FILE [FILE ...] (line i of each file for "
                "candidate i); or write a caption file, one JSON object per line")
    return None


def _table_rows(path: str, text: str, delimiter: str) -> list[tuple[int, dict[str, Any]]]:
    """CSV/TSV rows keyed by the header, each with the line it starts on (cells are strings). Parsed
    strictly: a quote left open, text after a closing quote, or a record that runs over several lines (a
    newline inside a quoted cell: with a quote left open it would swallow the rows after it) is an error
    naming the line, never rows silently merged into one."""
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    kind = "tab" if delimiter == "\t" else "comma"
    rows, header, start = [], None, 1
    try:
        for cells in reader:
            if reader.line_num != start:
                raise InputError(
                    f"{path}:{start}: a quoted cell runs from line {start} to line {reader.line_num} (a quote left "
                    "open, or a line break inside a cell); close the quote, or write captions with line breaks "
                    "as JSON Lines")
            if header is None:
                header = cells
                if len(set(header)) != len(header):
                    raise InputError(f"{path}:1: a column name appears twice in the header: {header}")
            elif any(cell.strip() for cell in cells):
                if len(cells) > len(header):
                    raise InputError(f"{path}:{start}: {len(cells)} cells but {len(header)} columns in the header "
                                     f"(a {kind} inside an unquoted cell?)")
                rows.append((start, dict(zip(header, cells))))
            start = reader.line_num + 1
    except csv.Error as err:
        raise InputError(f"{path}:{start}: {err} (a quote left open?)") from None
    return rows


def read_table(path: str | os.PathLike, delimiter: str = ",") -> list[dict[str, Any]]:
    """The rows of a CSV (or, with ``delimiter="\\t"``, TSV) file, parsed strictly (see :func:`_table_rows`):
    every reader of a table in the package goes through here."""
    path = os.fspath(path)
    return [row for _, row in _table_rows(path, _read_text(path), delimiter)]


def _parquet_rows(path: str) -> list[tuple[int, dict[str, Any]]]:
    """The rows of a Parquet caption file, decoded within bounds (:mod:`capeval_plugins.resources.parquet`)."""
    from capeval_plugins.resources import parquet

    try:
        rows = parquet.read_rows(files.read_input(path, "caption file"), path)
    except (parquet.ParquetError, files.FileError) as err:
        raise InputError(str(err)) from None
    return [(k, {key: value for key, value in row.items() if value is not None}) for k, row in enumerate(rows)]


def references_cell(value: Any, at: str, cell: bool = True) -> list[Any] | None:
    """One record's ``references`` as a list (or None when absent). ``cell``: the value comes from a table
    (CSV, TSV, Parquet), where a JSON list written as text is decoded and an empty cell is no references;
    a cell that starts like a list but is not a JSON list is refused (``at`` names the line). Any other
    string is one reference."""
    if value is None or (cell and isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        if not cell or not value.lstrip().startswith("["):
            return [value]
        try:
            value = jsonio.loads(value)
        except json.JSONDecodeError:
            raise InputError(f"{at}: references must be a JSON list of strings, e.g. [\"a dog\", \"a brown dog\"] "
                             f"(double quotes; write it with json.dumps), got {_clip(value)}") from None
    if isinstance(value, tuple) or type(value).__name__ == "ndarray":
        value = list(value)
    if not isinstance(value, list):
        raise InputError(f"{at}: references must be a list of strings or one string, got {type(value).__name__}")
    return value


def _clip(text: str, width: int = 60) -> str:
    return repr(text if len(text) <= width else text[:width] + "...")


CAPTION_KEYS = ("image", "caption", "references", "group", "id")
# Names other tools give our keys: such a key is not read, and saying so beats a silent miss.
KEY_ALIASES = {"img": "image", "image_path": "image", "image_file": "image", "file_name": "image", "filename": "image",
               "path": "image", "images": "image", "text": "caption", "candidate": "caption", "captions": "caption",
               "prediction": "caption", "hypothesis": "caption", "sentence": "caption", "refs": "references",
               "reference": "references", "gts": "references", "ground_truth": "references", "groups": "group"}


def key_guess(key: str) -> str | None:
    """The caption-file key that ``key`` probably means (``refs`` -> ``references``, ``Caption`` ->
    ``caption``, ``refrences`` -> ``references``), or None."""
    norm = str(key).strip().lower().replace("-", "_").replace(" ", "_")
    if norm in CAPTION_KEYS:
        return norm
    if norm in KEY_ALIASES:
        return KEY_ALIASES[norm]
    close = difflib.get_close_matches(norm, CAPTION_KEYS, n=1, cutoff=0.8)
    return close[0] if close else None


def check_keys(path: str | os.PathLike, keys: Sequence[str], need_caption: bool = True) -> None:
    """A file none of whose records has a ``caption`` (when captions are needed) is refused, naming the keys it
    has and the ones expected; keys that are not read but look like ours are warned about."""
    guesses = {k: g for k in keys if k not in CAPTION_KEYS and (g := key_guess(k)) and g not in keys}
    expected = "a caption file's keys are " + ", ".join(repr(k) for k in CAPTION_KEYS)
    renames = ", ".join(f"{k!r} -> {g!r}" for k, g in guesses.items())
    if need_caption and keys and "caption" not in keys:
        raise InputError(f"{path}: no record has a 'caption' (keys: {', '.join(map(repr, keys))}); {expected}"
                         + (f"; rename {renames}" if renames else ""))
    if guesses:
        warnings.warn(f"{path}: {'key' if len(guesses) == 1 else 'keys'} {', '.join(map(repr, guesses))} not read "
                      f"({expected}): rename {renames}", stacklevel=3)


def read_captions(path: str | os.PathLike, images_dir: str | os.PathLike | None = None,
                  need_caption: bool = True) -> CaptionRecords:
    """Read a caption file (JSON Lines, CSV, TSV or Parquet: see the module docstring); errors name the
    line. A given ``images_dir`` must be a folder. Keys are checked (:func:`check_keys`): no record with a
    ``caption`` (when ``need_caption``) is an error, a key that looks like one of ours a warning."""
    if images_dir is not None and not os.path.isdir(images_dir):
        raise InputError(f"images folder not found: {images_dir}" if not os.path.exists(images_dir)
                         else f"--images {images_dir} is not a folder")
    records = CaptionRecords(path=os.fspath(path))
    fmt = caption_file_format(path)
    if fmt == ".parquet":
        records.unit = "row"
    table = fmt != ".jsonl"
    root = Path(images_dir) if images_dir is not None else Path(path).parent
    rows = read_records(path, with_lines=True)
    check_keys(path, list(dict.fromkeys(k for _, row in rows for k in row)), need_caption)
    for lineno, row in rows:
        at = f"{path}:{lineno}" if records.unit == "line" else f"{path}: row {lineno}"
        image = row.get("image")
        records.images.append(str(root / image) if isinstance(image, str) and image else image)
        records.image_names.append(image)
        records.captions.append(row.get("caption"))
        records.references.append(references_cell(row.get("references"), at, cell=table))
        group = row.get("group")
        records.groups.append(None if table and group == "" else group)
        records.lines.append(lineno)
    if any(row.get("id") is not None for _, row in rows):  # every input id kept in the output (None: none given)
        from capeval_plugins.caption_ids import check_id

        records.row_ids = [None if row.get("id") is None else check_id(row["id"], f"{path}:{n}") for n, row in rows]
    return records


def no_image_found(records: CaptionRecords, images_dir: str | os.PathLike | None) -> str | None:
    """One line when not one of the image files the records name by a relative path exists: then the folder
    they were looked up in is the mistake (``--images`` forgotten, or the wrong folder), not each sample, so the
    line names that folder and the option. None when any is found (a few missing files are each sample's own
    problem, listed by row) or when the records name no image by a relative path."""
    named = [(name, path) for name, path in zip(records.image_names, records.images)
             if isinstance(name, str) and name and not os.path.isabs(name) and isinstance(path, str)]
    if not named or any(os.path.exists(path) for _, path in named):
        return None
    count = len(dict.fromkeys(name for name, _ in named))
    folder = os.fspath(images_dir) if images_dir is not None else (os.path.dirname(records.path) or ".")
    source = os.path.basename(records.path)
    where = (f"in the folder --images {folder}" if images_dir is not None else
             f"in {folder}, the caption file's folder (where relative image paths are looked up without --images)")
    return (f"none of the {count} image files {source} names (e.g. {named[0][0]}) is {where}: give the folder "
            "that holds them with --images DIR")


def read_coco_results(results: str | os.PathLike, annotations: str | os.PathLike,
                      images_dir: str | os.PathLike | None = None) -> CaptionRecords:
    """A COCO results file (``[{"image_id", "caption"}, ...]``, what pycocotools' ``loadRes`` reads) scored
    against a COCO annotation file (``captions_val2014.json``): one record per result, its references the
    annotation's captions of its image, its image the annotation's ``file_name`` under ``images_dir`` (default:
    the results file's folder).

    Image ids match as pycocotools matches them, by value: ``"42"`` is not ``42`` (a string id where the
    annotation file has numbers is refused, naming the mismatch). An id the annotation file does not have is
    refused (``loadRes``: "Results do not correspond to current coco set"), and so is an image given two
    results: pycocoevalcap's scorers assert one caption per image (``assert(len(hypo) == 1)``)."""
    if images_dir is not None and not os.path.isdir(images_dir):
        raise InputError(f"images folder not found: {images_dir}")
    results, annotations = os.fspath(results), os.fspath(annotations)
    found = _json_file(results, "results file")
    gt = _json_file(annotations, "annotation file")
    if not isinstance(found, list):
        raise InputError(other_format(results, json.dumps(found)) if isinstance(found, dict) and "annotations" in found
                         else f"{results}: a COCO results file is a JSON array of {{\"image_id\", \"caption\"}} "
                         f"objects, not {_json_kind(found)}")
    for k, row in enumerate(found):
        if not isinstance(row, dict) or "image_id" not in row or "caption" not in row:
            raise InputError(f"{results}: entry {k} is not an {{\"image_id\", \"caption\"}} object (a COCO results "
                             "file is a JSON array of them)")
    if not isinstance(gt, dict) or not isinstance(gt.get("annotations"), list):
        raise InputError(f"{annotations}: a COCO annotation file is a JSON object with \"images\" and "
                         "\"annotations\" (as captions_val2014.json)")
    names, refs = {}, {}
    for k, image in enumerate(gt.get("images") or []):
        if not isinstance(image, dict) or "id" not in image:
            raise InputError(f"{annotations}: images entry {k} has no id")
        key = _coco_id(image["id"], f"{annotations}: images entry {k}")
        if key in names and names[key] != image.get("file_name"):  # which one an image metric reads is unknown
            raise InputError(f"{annotations}: images entry {k} gives image id {image['id']!r} again, with another "
                             f"file_name ({names[key]!r}, then {image.get('file_name')!r})")
        names[key] = image.get("file_name")
    for k, ann in enumerate(gt["annotations"]):
        if not isinstance(ann, dict) or "image_id" not in ann or not isinstance(ann.get("caption"), str):
            raise InputError(f"{annotations}: annotations entry {k} needs an image_id and a caption string")
        refs.setdefault(_coco_id(ann["image_id"], f"{annotations}: annotations entry {k}"), []).append(ann["caption"])
    keys = [_coco_id(row["image_id"], f"{results}: entry {k}") for k, row in enumerate(found)]
    _check_result_ids(results, annotations, keys, {**names, **refs})
    root = Path(images_dir) if images_dir is not None else Path(results).parent
    records = CaptionRecords(path=results, unit="entry", ids=[])
    for k, (row, key) in enumerate(zip(found, keys)):
        name = names.get(key)
        records.images.append(str(root / name) if isinstance(name, str) and name else None)
        records.image_names.append(name)
        records.ids.append(row["image_id"])
        records.captions.append(row["caption"])
        records.references.append(list(refs[key]) if key in refs else None)
        records.groups.append(None)
        records.lines.append(k)
    return records


def _json_kind(value: Any) -> str:
    kinds = {dict: "an object", str: "a string", bool: "true or false", type(None): "null"}
    return kinds.get(type(value), "a number")


def _coco_id(value: Any, at: str) -> Any:
    """An image id as pycocotools compares it (by value, in a set): a number or a string, never true / false."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InputError(f"{at}: image id {json.dumps(value)[:40]} is not a number or a string")
    return value


def _check_result_ids(results: str, annotations: str, keys: Sequence[Any], known: Mapping[Any, Any]) -> None:
    """Every result's image id is one of the annotation file's, by value (as ``loadRes`` asserts), and no image
    has two results."""
    for k, key in enumerate(keys):
        if key in known:
            continue
        other = _other_type(key)
        if other is not None and other in known:
            raise InputError(f"{results}: entry {k}: image id {json.dumps(key)} is {_json_kind(key)}, and "
                             f"{annotations} has {_json_kind(other)} {json.dumps(other)}: pycocotools matches ids by "
                             "value (\"42\" is not 42), so write the ids as the annotation file does")
        missing = sum(key not in known for key in keys)
        raise InputError(f"{results}: {missing} image id(s) are not in {annotations} (first: {json.dumps(key)} in "
                         f"entry {k}); is it the annotation file of the same split?")
    first: dict[Any, int] = {}
    for k, key in enumerate(keys):
        if key in first:
            raise InputError(f"{results}: image id {json.dumps(key)} has two results (entries {first[key]} and {k}); a "
                             "COCO results file holds one caption per image (pycocoevalcap's scorers assert one)")
        first[key] = k


def _other_type(key: Any) -> Any:
    """``key`` written the other way: the number a string of digits names, or a number's digits as a string."""
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            return None
    return str(int(key)) if isinstance(key, float) and key.is_integer() else str(key)


def _json_file(path: str, what: str) -> Any:
    check_input(path, what)
    try:
        return jsonio.loads(_read_text(path))
    except json.JSONDecodeError as err:
        raise InputError(f"{path}: not valid JSON ({err})") from None


def read_text_pairs(candidates: str | os.PathLike, references: Sequence[str | os.PathLike] = ()) -> CaptionRecords:
    """bert-score's plain-text files: one candidate per line in ``candidates``, and in each of ``references``
    one reference per line, line i for candidate i (several files: several references per candidate). Lines
    end at ``\n`` (``\r\n`` too) and are stripped, as bert-score reads them; an empty line is an empty
    caption (scored). No images: text metrics only."""
    cands = _text_lines(os.fspath(candidates), "candidate file (-c)")
    ref_files = [os.fspath(r) for r in references]
    columns = [_text_lines(r, "references file (-r)") for r in ref_files]
    for path, lines in zip(ref_files, columns):
        if len(lines) != len(cands):
            raise InputError(f"{path} has {len(lines)} lines but {candidates} has {len(cands)}: line i of each "
                             "references file is a reference of candidate i")
    records = CaptionRecords(path=os.fspath(candidates))
    for i, caption in enumerate(cands):
        records.images.append(None)
        records.image_names.append(None)
        records.captions.append(caption)
        records.references.append([col[i] for col in columns] if columns else None)
        records.groups.append(None)
        records.lines.append(i + 1)
    return records


def _text_lines(path: str, what: str) -> list[str]:
    check_input(path, what)
    # line ends as bert-score's open() reads them (universal newlines: \r\n, \r, \n; not str.splitlines, which
    # also splits on U+2028 and the like): a file with old-Mac \r ends was one merged sample
    text = _read_text(path).replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    if lines and lines[-1] == "":  # the newline that ends the last line
        lines.pop()
    return [line.strip() for line in lines]


def load_caption_docs(path: str | os.PathLike, images_dir: str | os.PathLike | None, limit: int | None = None) -> list[dict]:
    """Documents for the lm-eval caption task: ``image_path`` and ``references`` per line (and ``input_id``, the
    line's ``id`` as text, where the file gives ids). ``limit``: the
    first ``limit`` documents (a positive integer; None for all)."""
    limit = _limit(limit)
    records = read_captions(path, images_dir, need_caption=False)  # the task generates the captions
    docs = []
    for i, (image, refs) in enumerate(zip(records.images, records.references)):
        if not isinstance(image, str) or not os.path.isfile(image):
            raise InputError(f"{records.describe(i)}: image file not found: {image}")
        for j, ref in enumerate(refs or []):
            if not isinstance(ref, str):
                raise InputError(f"{records.describe(i)}: reference {j} must be a string, got {type(ref).__name__}")
        doc = {"id": i, "image_path": image, "references": refs or []}
        if records.row_ids is not None:  # the file's own ids, kept in lm-eval's logged samples (text: one column type)
            doc["input_id"] = None if records.row_ids[i] is None else str(records.row_ids[i])
        docs.append(doc)
    return docs if limit is None else docs[:limit]


def _limit(limit: Any) -> int | None:
    """``--metadata``'s ``limit``: a positive integer (or its digits as a string), or None."""
    if limit is None:
        return None
    if isinstance(limit, str) and limit.strip().isdigit():
        limit = int(limit)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InputError(f"limit must be a positive integer, got {limit!r}")
    return limit


# ---------------------------------------------------------------------------------------------------------
# Output: one row per sample, strict JSON.

OUTPUT_FORMATS = (".jsonl", ".json", ".csv", ".parquet")


def output_format(path: str | os.PathLike) -> str:
    """``.json`` (one JSON array), ``.csv`` and ``.parquet`` by suffix; anything else is JSON Lines."""
    suffix = Path(path).suffix.lower()
    return suffix if suffix in (".json", ".csv", ".parquet") else ".jsonl"


def json_safe(value: Any) -> Any:
    """NaN and infinities as None (strict JSON has neither), recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def score_table(results: Mapping[str, MetricResult], records: CaptionRecords | None = None,
                metrics: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per sample in index order: ``index``, the sample's own ``id`` (where the input gives ids), its
    ``image_id`` (a COCO results file), ``image``
    (as the input file writes it) and ``caption`` when ``records`` (the input) is given, then ``<metric>`` and
    ``<metric>.<extra>`` for every metric, and ``error`` (the reasons) where a metric skipped the sample. An
    extra that repeats on every row the column it is named after (RefCLIPScore's ``clipscore`` extra beside
    CLIPScore's own column, Soft-MSD's ``cosine`` beside MSD-Score's) is left out, and so is an extra a metric of
    ``metrics`` (``{name: metric}``) declares a score alias (BERTScore's ``f1``: :attr:`Metric.score_aliases`)
    (:func:`drop_repeated_columns`). NaN is None."""
    rows: dict[int, dict[str, Any]] = {}
    errors: dict[int, list[str]] = {}
    for name, result in results.items():
        columns = {f"{name}.{k}": extra_values(v) for k, v in result.extras.items()}
        for j, (index, score) in enumerate(zip(result.indices.tolist(), result.scores.tolist())):
            row = rows.setdefault(int(index), {"index": int(index)})
            row[name] = score
            row.update({k: col[j] for k, col in columns.items()})
            if int(index) in result.skipped:
                errors.setdefault(int(index), []).append(f"{name}: {result.skipped[int(index)]}")
    aliases = {f"{name}.{alias}" for name, metric in (metrics or {}).items()
               for alias in getattr(metric, "score_aliases", ())}
    repeated = drop_repeated_columns(list(rows.values()), aliases)
    with_images = records is not None and any(name is not None for name in records.image_names)  # once, not per row
    table = []
    for index in sorted(rows):
        row = {"index": index, **_input_columns(records, index, with_images),
               **{k: v for k, v in json_safe(rows[index]).items() if k != "index" and k not in repeated}}
        if index in errors:
            row["error"] = "; ".join(errors[index])
        table.append(row)
    return table


def _input_columns(records: CaptionRecords | None, index: int, with_images: bool) -> dict[str, Any]:
    if records is None or not 0 <= index < len(records):
        return {}
    out: dict[str, Any] = {}
    if records.row_ids is not None:
        out["id"] = records.row_ids[index]
    if records.ids is not None:
        out["image_id"] = records.ids[index]
    if with_images:
        out["image"] = records.image_names[index]
    out["caption"] = records.captions[index]
    return json_safe(out)


def drop_repeated_columns(rows: Sequence[Mapping[str, Any]], aliases: Collection[str] = ()) -> set[str]:
    """The extra columns that repeat, on every row, a column they are named after: ``m.e`` where ``e`` is
    another metric ``e`` of the run (CLIPScore's ``refclipscore`` beside RefCLIPScore's own column), or an
    earlier metric's ``n.e`` (RefCLIPScore's ``cosine`` beside CLIPScore's), or ``m.e`` in ``aliases`` equal to
    ``m`` itself (BERTScore's ``f1``). A metric's own columns are never compared with each other otherwise: its
    precision and recall stay even where they equal its score on every row (a caption equal to its reference),
    Redemption Score's ``dino_normalized`` stays beside its ``dino_raw``, and score columns always stay."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k != "index" and k not in columns]
    values = {c: tuple(_same(row.get(c)) for row in rows) for c in columns}
    metrics = [c for c in columns if "." not in c]
    repeated = set()
    for column in columns:
        metric, dot, extra = column.partition(".")
        if not dot:
            continue
        named = [extra] if extra in metrics and extra != metric else []
        earlier = [f"{n}.{extra}" for n in metrics[:metrics.index(metric)] if f"{n}.{extra}" in values] \
            if metric in metrics else []
        for other in [*named, *earlier, *([metric] if column in aliases else [])]:
            if other in values and other not in repeated and values[other] == values[column]:
                repeated.add(column)
                break
    return repeated


def _same(value: Any) -> Any:
    """A value as a hashable key: NaN equals NaN (a sample skipped by both columns), lists as tuples."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, list):
        return tuple(_same(v) for v in value)
    return value


def check_writable(path: str | os.PathLike, inputs: Sequence[Any] = (), what: str = "--out") -> str:
    """Fail now, not after hours of scoring, if ``path`` cannot or must not be written (see
    :func:`capeval_plugins.files.check_output`: a folder, a link, one of the ``inputs`` or inside an input
    folder such as a model's), or if its format cannot be produced. Returns ``"file"`` or ``"stream"``."""
    try:
        kind = files.check_output(path, inputs, what)
    except files.FileError as err:
        raise InputError(str(err)) from None
    if output_format(path) == ".parquet":
        try:
            import pyarrow  # noqa: F401  (checked now, used when writing)
        except ImportError:
            raise InputError(f"writing .parquet needs pyarrow: {install_extra('parquet')}") from None
    return kind


def write_table(path: str | os.PathLike, table: list[dict[str, Any]], inputs: Sequence[Any] = (),
                what: str = "--out") -> None:
    """Write rows (from :func:`score_table`) as JSON Lines, a JSON array (``.json``), CSV or Parquet by
    suffix, through :func:`capeval_plugins.files.write_output`: a file is replaced whole (two runs writing one
    path leave one whole output, never a mix), a stream (``/dev/stdout``) written through."""
    columns: list[str] = []
    for row in table:
        columns += [k for k in row if k not in columns]
    fmt = output_format(path)
    files.write_output(path, lambda f: _write_rows(f, fmt, table, columns), inputs, what)


def _write_rows(f: Any, fmt: str, table: list[dict[str, Any]], columns: list[str]) -> None:
    if fmt == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        # every column of every row (``error`` may first appear in a later row)
        pq.write_table(pa.Table.from_pydict({c: [row.get(c) for row in table] for c in columns}), f)
        return
    text = io.TextIOWrapper(f, encoding="utf-8", newline="" if fmt == ".csv" else None, write_through=True)
    if fmt == ".csv":
        writer = csv.DictWriter(text, fieldnames=columns or ["index"])
        writer.writeheader()
        for row in table:
            writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})
    elif fmt == ".json":
        text.write("[\n" + ",\n".join(json.dumps(row, allow_nan=False) for row in table) + "\n]\n")
    else:
        for row in table:
            text.write(json.dumps(row, allow_nan=False) + "\n")
    text.flush()
    text.detach()  # the caller closes the file


def write_scores(path: str | os.PathLike, result: MetricResult) -> None:
    """One metric's per-sample scores (see :func:`write_table`)."""
    write_table(path, score_table({result.name: result}))
