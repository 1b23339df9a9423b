"""``capeval calibrate``: fusion weights that maximise Kendall tau with human ratings, from a score file.

The score file is what ``capeval score --metric redemption_score --out scores.jsonl`` writes (one row per
sample with ``index`` and the per-sample components, named ``redemption_score.mid_normalized``, ...), or any
JSON Lines / CSV file with one column per component. A component is found by its column name, or as the one
column ``<metric>.<name>``. Human ratings are a column of the same file or of a second file (``--ratings``),
matched by ``index`` when both files have it, else by line order::

    capeval calibrate --scores scores.jsonl --ratings flickr8k_expert.jsonl --rating-key human
    {"weights": {"redemption_score.mid_normalized": 0.84, ...}, "correlation": 0.5643, ...,
     "options": ["redemption_score.mid_weight=0.84", ...]}

``options`` (when the components are Redemption Score's) can be passed straight back to
``capeval score --metric redemption_score -o ...``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from typing import Any

from capeval_plugins.core.bounds import cli_number

DEFAULT_COMPONENTS = ("mid_normalized", "dino_normalized", "bertscore_normalized")


def read_rows(path: str) -> list[dict[str, Any]]:
    """Records of a JSON Lines or CSV (by suffix) file."""
    from capeval_plugins.caption_files import read_records

    return read_records(path)


def column(rows: list[dict], key: str, path: str) -> list[float]:
    """The numbers of column ``key``, by bench's rule (:func:`~capeval_plugins.bench.readers.as_score`): a
    boolean is refused, not read as 1 / 0; and text is a number only in a CSV or TSV file, where every cell is
    text (a quoted ``"0.5"`` in JSON Lines is a mistake to say, not a number to guess)."""
    from capeval_plugins.bench.readers import as_score
    from capeval_plugins.caption_files import TABLE_DELIMITERS, caption_file_format
    from capeval_plugins.inputs import InputError

    cells_are_text = caption_file_format(path) in TABLE_DELIMITERS
    values = []
    for i, row in enumerate(rows):
        where = f"{path}: row {i + 1}"
        if key not in row or row[key] in (None, ""):
            raise InputError(f"{where} has no {key!r} (columns: {sorted(row)})")
        if isinstance(row[key], str) and not cells_are_text:
            raise InputError(f"{where}: {key!r} {row[key]!r} is text, not a number (write it without quotes)")
        value = as_score(row[key], where, repr(key))
        if not math.isfinite(value):
            raise InputError(f"{where}: {key!r} is not finite: {row[key]!r}")
        values.append(value)
    return values


def align(scores: list[dict], ratings: list[dict], scores_path: str, ratings_path: str) -> list[dict]:
    """Rating rows in the order of the score rows: by ``index`` when both files carry it, else by line."""
    from capeval_plugins.inputs import InputError

    if has_index(scores) and has_index(ratings):
        score_indices, rating_indices = sample_indices(scores, scores_path), sample_indices(ratings, ratings_path)
        by_index = dict(zip(rating_indices, ratings))
        missing = [i for i in score_indices if i not in by_index]
        if missing:
            raise InputError(f"{ratings_path}: no rating for sample index {missing[0]} ({len(missing)} missing)")
        return [by_index[i] for i in score_indices]
    if len(scores) != len(ratings):
        raise InputError(f"{scores_path} has {len(scores)} rows but {ratings_path} has {len(ratings)} (and no "
                         "'index' column in both to match them by)")
    return ratings


def has_index(rows: list[dict]) -> bool:
    return any(row.get("index") not in (None, "") for row in rows)


def sample_indices(rows: list[dict], path: str) -> list[int]:
    """The ``index`` column as sample indices. An index is a whole number from 0 (text only in a CSV or TSV file,
    as :func:`column` reads numbers), on every row, once: a truncated 0.5, or one index on two rows, would pair a
    rating with another sample's scores."""
    from capeval_plugins.caption_files import TABLE_DELIMITERS, caption_file_format
    from capeval_plugins.inputs import InputError, repeated_ids

    for k, row in enumerate(rows):
        if row.get("index") in (None, ""):
            raise InputError(f"{path}: row {k + 1} has no 'index' (other rows have one)")
    cells_are_text = caption_file_format(path) in TABLE_DELIMITERS
    indices = [sample_index(row["index"], f"{path}: row {k + 1}", cells_are_text) for k, row in enumerate(rows)]
    repeated = repeated_ids(indices)
    if repeated:
        rows_of = [str(k + 1) for k, i in enumerate(indices) if i == repeated[0]]
        more = f" ({len(repeated)} indices repeated)" if len(repeated) > 1 else ""
        raise InputError(f"{path}: index {repeated[0]} is given twice (rows {', '.join(rows_of)}){more}; give each "
                         "sample one row")
    return indices


def sample_index(value: Any, where: str, cells_are_text: bool) -> int:
    """One ``index`` cell as an integer: an int, an integral float (as pandas and Parquet write integers), or in
    a CSV or TSV file the digits of one; anything else (``true``, ``0.5``, ``"0a"``) refused naming the row."""
    from capeval_plugins.inputs import InputError

    if cells_are_text and isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{where}: index {json.dumps(value, default=str)[:40]} is not a sample index (a whole "
                         "number from 0)")
    return value


def component_column(rows: list[dict], name: str, path: str) -> str:
    """The column of component ``name``: ``name`` itself, else the one column named ``<metric>.<name>`` (what
    ``capeval score`` writes: ``redemption_score.mid_normalized``)."""
    from capeval_plugins.inputs import InputError

    columns = dict.fromkeys(key for row in rows for key in row)
    if name in columns:
        return name
    prefixed = [key for key in columns if key.endswith(f".{name}")]
    if len(prefixed) == 1:
        return prefixed[0]
    if prefixed:
        raise InputError(f"{path}: several columns end in {name!r} ({', '.join(prefixed)}); name one in --components")
    raise InputError(f"{path}: no column {name!r} (columns: {sorted(columns)})")


def weight_options(weights: dict[str, float]) -> list[str]:
    """Options of the metric whose components were fused, one per weight: ``mid_normalized`` ->
    ``mid_weight=...`` (Redemption Score's), ``redemption_score.mid_normalized`` ->
    ``redemption_score.mid_weight=...`` (``-o`` takes both); none unless every component has a weight option.
    Each weight is written exactly, so the options sum to 1 as the weights do and the metric accepts them back."""
    from capeval_plugins import registry
    from capeval_plugins.metrics.redemption import RedemptionConfig

    options = []
    for column, weight in weights.items():
        metric, _, name = column.rpartition(".")
        try:
            config = registry.get(metric).cls.Config if metric else RedemptionConfig
        except KeyError:
            return []
        base = name.removesuffix("_normalized").removesuffix("_raw")
        if f"{base}_weight" not in {f.name for f in dataclasses.fields(config)}:
            return []
        # repr: the shortest text that reads back as this very float (:g kept 6 digits: three weights of 1/3 read
        # back as 0.333333 summed to 0.999999, which the metric refuses as not summing to 1)
        options.append(f"{metric + '.' if metric else ''}{base}_weight={float(weight)!r}")
    return options


def cmd_calibrate(args: argparse.Namespace) -> int:
    from capeval_plugins import files
    from capeval_plugins.core.fusion import calibrate
    from capeval_plugins.inputs import InputError

    inputs = [args.scores, args.ratings]
    if args.out:  # before the grid search: not a link, not the score or ratings file
        files.check_output(args.out, inputs)
    rows = read_rows(args.scores)
    if not rows:
        raise InputError(f"{args.scores}: no rows")
    rating_rows = align(rows, read_rows(args.ratings), args.scores, args.ratings) if args.ratings else rows
    names = [component_column(rows, c.strip(), args.scores) for c in args.components.split(",") if c.strip()]
    components = {name: column(rows, name, args.scores) for name in names}
    ratings = column(rating_rows, args.rating_key, args.ratings or args.scores)
    try:
        result = calibrate(components, ratings, step=args.step, variant=args.variant)
    except ValueError as err:
        raise InputError(str(err)) from err
    report = {**result.as_dict(), "options": weight_options(result.weights)}
    text = json.dumps(report, indent=None if args.compact else 2)
    if args.out:
        files.write_output(args.out, (text + "\n").encode(), inputs)
    print(text)
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="fusion weights maximising Kendall tau with human ratings (Redemption Score's calibration)",
        description="Fusion weights that maximise Kendall tau with human ratings, by an exhaustive simplex grid "
                    "search (Redemption Score's calibration), from a file of per-sample component scores.",
    )
    p.add_argument("--scores", required=True, help="per-sample component scores (JSON Lines, or CSV by suffix)")
    p.add_argument("--ratings", help="human ratings file (default: a column of --scores)")
    p.add_argument("--rating-key", dest="rating_key", default="human", help="column holding the human rating")
    p.add_argument("--components", default=",".join(DEFAULT_COMPONENTS),
                   help="comma-separated component columns to fuse (default: Redemption Score's normalised parts)")
    p.add_argument("--step", type=cli_number(float, gt=0, le=1), default=0.02,
                   help="simplex grid step (default 0.02, as the paper)")
    p.add_argument("--variant", choices=["c", "b"], default="c", help="Kendall tau variant (default c)")
    p.add_argument("--out", help="also write the result (JSON) here")
    p.add_argument("--compact", action="store_true", help="one-line JSON")
    p.set_defaults(func=cmd_calibrate)
