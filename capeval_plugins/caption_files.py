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
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from capeval_plugins.contract import MetricResult
from capeval_plugins.inputs import InputError


@dataclass
class CaptionRecords:
    images: list[str | None] = field(default_factory=list)
    captions: list[str | None] = field(default_factory=list)
    references: list[list[str] | None] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # each record's line in the file (1-based)
    path: str = ""

    def __len__(self) -> int:
        return len(self.captions)

    def describe(self, index: int) -> str:
        """How an error names record ``index``: ``sample 250 (captions.jsonl line 252)``."""
        line = self.lines[index] if 0 <= index < len(self.lines) else None
        return f"sample {index} ({os.path.basename(self.path)} line {line})" if line else f"sample {index}"


def read_records(path: str | os.PathLike, with_lines: bool = False) -> list[dict[str, Any]]:
    """The records of a JSON Lines file (or CSV, by suffix); errors name the file and line. With
    ``with_lines``, each record comes as ``(line number, record)``."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InputError(f"file not found: {path}")
    with open(path, encoding="utf-8", newline="") as f:
        if path.endswith(".csv"):
            rows = [(n + 2, row) for n, row in enumerate(csv.DictReader(f))]
            return rows if with_lines else [row for _, row in rows]
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
            rows.append((lineno, row))
        return rows if with_lines else [row for _, row in rows]


def read_captions(path: str | os.PathLike, images_dir: str | os.PathLike | None = None) -> CaptionRecords:
    """Read a caption file; errors name the line."""
    records = CaptionRecords(path=os.fspath(path))
    root = Path(images_dir) if images_dir is not None else Path(path).parent
    for lineno, row in read_records(path, with_lines=True):
        image = row.get("image")
        records.images.append(str(root / image) if isinstance(image, str) and image else image)
        records.captions.append(row.get("caption"))
        refs = row.get("references")
        records.references.append([refs] if isinstance(refs, str) else refs)
        records.groups.append(row.get("group"))
        records.lines.append(lineno)
    return records


def load_caption_docs(path: str | os.PathLike, images_dir: str | os.PathLike | None, limit: int | None = None) -> list[dict]:
    """Documents for the lm-eval caption task: ``image_path`` and ``references`` per line."""
    records = read_captions(path, images_dir)
    docs = []
    for i, (image, refs) in enumerate(zip(records.images, records.references)):
        if image is None or not os.path.isfile(image):
            raise InputError(f"{records.describe(i)}: image file not found: {image}")
        docs.append({"id": i, "image_path": image, "references": refs or []})
    return docs[:limit] if limit else docs


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


def score_table(results: Mapping[str, MetricResult]) -> list[dict[str, Any]]:
    """One row per sample in index order: ``index``, then ``<metric>`` and ``<metric>.<extra>`` for every
    metric, and ``error`` (the reasons) where a metric skipped the sample. NaN is None."""
    rows: dict[int, dict[str, Any]] = {}
    errors: dict[int, list[str]] = {}
    for name, result in results.items():
        columns = {f"{name}.{k}": v.tolist() for k, v in result.extras.items()}
        for j, (index, score) in enumerate(zip(result.indices.tolist(), result.scores.tolist())):
            row = rows.setdefault(int(index), {"index": int(index)})
            row[name] = score
            row.update({k: col[j] for k, col in columns.items()})
            if int(index) in result.skipped:
                errors.setdefault(int(index), []).append(f"{name}: {result.skipped[int(index)]}")
    table = []
    for index in sorted(rows):
        row = json_safe(rows[index])
        if index in errors:
            row["error"] = "; ".join(errors[index])
        table.append(row)
    return table


def check_writable(path: str | os.PathLike, inputs: Sequence[str | os.PathLike | None] = ()) -> None:
    """Fail now, not after hours of scoring, if ``path`` cannot be written (or its format not produced), or if
    it is one of the ``inputs`` (the caption file: writing the scores would destroy it)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"--out {path} is a folder; give a file name (.jsonl, .json, .csv or .parquet)")
    for given in inputs:
        if given is not None and _same_file(path, Path(given)):
            raise InputError(f"--out {path} is an input of this run ({given}); give another file name")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"cannot write {path}: folder {folder} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".capeval-", delete=True):
            pass
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(path)
    except OSError:
        raise InputError(f"cannot write {path}: permission denied") from None
    if output_format(path) == ".parquet":
        try:
            import pyarrow  # noqa: F401  (checked now, used when writing)
        except ImportError:
            raise InputError("writing .parquet needs pyarrow: pip install 'capeval-plugins[parquet]'") from None


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


def write_table(path: str | os.PathLike, table: list[dict[str, Any]]) -> None:
    """Write rows (from :func:`score_table`) as JSON Lines, a JSON array (``.json``), CSV or Parquet by
    suffix, atomically: into a temporary file of a name no other writer uses, then renamed over ``path``, so
    two runs writing one path leave one whole output, never a mix."""
    path = Path(path)
    columns: list[str] = []
    for row in table:
        columns += [k for k in row if k not in columns]
    fd, name = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        os.close(fd)
        _write_rows(tmp, output_format(path), table, columns)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as an ordinary new file (mkstemp makes it private)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_rows(tmp: Path, fmt: str, table: list[dict[str, Any]], columns: list[str]) -> None:
    if fmt == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        # every column of every row (``error`` may first appear in a later row)
        pq.write_table(pa.Table.from_pydict({c: [row.get(c) for row in table] for c in columns}), tmp)
        return
    with open(tmp, "w", newline="" if fmt == ".csv" else None, encoding="utf-8") as f:
        if fmt == ".csv":
            writer = csv.DictWriter(f, fieldnames=columns or ["index"])
            writer.writeheader()
            for row in table:
                writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})
        elif fmt == ".json":
            f.write("[\n" + ",\n".join(json.dumps(row, allow_nan=False) for row in table) + "\n]\n")
        else:
            for row in table:
                f.write(json.dumps(row, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_scores(path: str | os.PathLike, result: MetricResult) -> None:
    """One metric's per-sample scores (see :func:`write_table`)."""
    write_table(path, score_table({result.name: result}))
