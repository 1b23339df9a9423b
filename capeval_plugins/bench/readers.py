"""Readers for the public files of caption-evaluation benchmarks. Each docstring names the published format it
reads. Captions are whitespace-normalised (as the CLIPScore / PAC-S code does); every error names the file and
the record.

Why one module of ~830 lines: one short reader per benchmark format (a new benchmark adds one function), all on
the record helpers at the top; split, the readers would scatter over modules that share everything."""
from __future__ import annotations

import ast
import contextlib
import json
import math
from collections import defaultdict
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from capeval_plugins.bench.data import Captions, Pairs, Ratings, clean
from capeval_plugins.core import jsonio
from capeval_plugins.inputs import InputError

CANDIDATE_KEYS = ("mt", "cand", "candidate", "caption", "hyp")
REFERENCE_KEYS = ("refs", "references", "ground_truth")
HUMAN_KEYS = ("score", "human_score", "human", "rating")
IMAGE_KEYS = ("imgid", "img", "image", "image_path", "image_id")


# ---------------------------------------------------------------------------------------------- file access

# A caption or reference longer than this is not one (LongCap-Arena's and DOCENT's long descriptions are a few
# thousand characters): refused, before a tokenizer or an n-gram count meets it.
MAX_TEXT = 1 << 20
# The most records a file may hold while a benchmark is read: (rows, the benchmark's title), set by
# :func:`row_limit` from the benchmark's declaration (``Benchmark.max_rows``); None: any number.
_ROW_LIMIT: ContextVar[tuple[int, str] | None] = ContextVar("capeval_row_limit", default=None)


@contextlib.contextmanager
def row_limit(rows: int, what: str) -> Iterator[None]:
    """While the block runs, a file holding more than ``rows`` records is refused (a Parquet file before any
    row is decoded); ``what`` names the benchmark in the message."""
    token = _ROW_LIMIT.set((rows, what))
    try:
        yield
    finally:
        _ROW_LIMIT.reset(token)


def load_records(path: str | Path, what: str = "benchmark file") -> Any:
    """A JSON document, JSON Lines (a list of objects), CSV (a list of dicts) or Parquet (a list of dicts).
    ``what`` names the file in errors (the training and score readers read through here too). Parquet is decoded
    within bounds (:mod:`capeval_plugins.resources.parquet`); under :func:`row_limit`, a file with more records
    than the benchmark has by far is refused."""
    from capeval_plugins import files
    from capeval_plugins.resources import parquet
    from capeval_plugins.caption_files import check_input, read_table

    path = Path(path)
    check_input(path, what)  # a folder, a FIFO or a device is said as such, never opened
    limit = _ROW_LIMIT.get()
    suffix = path.suffix.lower()
    if suffix == ".csv":
        records = read_table(path)  # strict: a quote left open is an error naming its line, never merged rows
        _check_count(records, path, limit)
        return records
    try:
        data = files.read_input(path, what)
    except files.FileError as err:
        raise InputError(str(err)) from None
    if suffix == ".parquet":
        try:
            return parquet.read_rows(data, str(path), max_rows=limit[0] if limit else None,
                                     what=limit[1] if limit else "")
        except parquet.ParquetError as err:
            raise InputError(str(err)) from None
    try:
        text = jsonio.decode_text(data, str(path))
    except jsonio.JSONLinesError as err:
        raise InputError(str(err)) from None
    if suffix == ".jsonl":
        records = _json_lines(text, path)
    else:
        try:
            records = jsonio.loads(text)
        except json.JSONDecodeError:
            records = _json_lines(text, path)  # JSON Lines under a .json name (THumB's references)
    _check_count(records, path, limit)
    return records


def _check_count(records: Any, path: Path, limit: tuple[int, str] | None) -> None:
    """Refuse a file with more records (list items, or the entries one level into a JSON object) than the
    benchmark being read has by far."""
    if limit is None:
        return
    if isinstance(records, dict):
        count = sum(len(v) if isinstance(v, (list, dict)) else 1 for v in records.values())
    else:
        count = len(records) if isinstance(records, list) else 1
    if count > limit[0]:
        raise InputError(f"{path}: {count:,} records, more than {limit[1]} has by far (at most {limit[0]:,}); is it "
                         "the benchmark's file?")


def _json_lines(text: str, path: Path) -> list:
    """The one JSON Lines reader (:func:`capeval_plugins.core.jsonio.json_lines`, as ``capeval score``'s)."""
    try:
        return [row for _, row in jsonio.json_lines(text, str(path))]
    except jsonio.JSONLinesError as err:
        raise InputError(str(err)) from None


def pick(record: dict, keys: Sequence[str], what: str, where: str, required: bool = True) -> Any:
    for key in keys:
        if key in record and record[key] is not None:
            return record[key]
    if required:
        raise InputError(f"{where}: no {what} (looked for {', '.join(repr(k) for k in keys)})")
    return None


def as_list(value: Any, where: str) -> list[str]:
    """A list of references: a list, one string, or a list written as text (CSV cells: JSON or Python)."""
    if isinstance(value, str):
        written = value.strip()
        if len(written) > 16 * MAX_TEXT:
            raise InputError(f"{where}: the references are {len(written):,} characters long, more than any list of "
                             f"captions ({16 * MAX_TEXT:,} at most)")
        if written.startswith("["):
            for parse in (jsonio.loads, ast.literal_eval):
                try:
                    value = parse(written)
                    break
                except (ValueError, SyntaxError, RecursionError, MemoryError):
                    continue
            else:
                raise InputError(f"{where}: cannot read the list of references {written[:60]!r}")
        else:
            value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise InputError(f"{where}: references must be a list of strings")
    refs = [clean(text(v, "a reference", where)) for v in value if v.strip()]
    if not refs:
        raise InputError(f"{where}: no references")
    return refs


def as_score(value: Any, where: str, what: str = "human score") -> float:
    """A number, or a number written as text (CSV cells); ``true`` / ``false`` are refused, not read as 1 / 0."""
    if isinstance(value, bool):
        raise InputError(f"{where}: {what} {value!r} is not a number")
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits: no float holds it
        raise InputError(f"{where}: {what} {str(value)[:20]}... ({len(str(value))} digits) is too large for a "
                         "number") from None
    except (TypeError, ValueError) as err:
        raise InputError(f"{where}: {what} {value!r} is not a number") from err


def text(value: Any, what: str, where: str) -> str:
    """A caption or name that must be text: a number or a list is refused rather than turned into its repr, and
    so is text longer than :data:`MAX_TEXT` characters."""
    if not isinstance(value, str):
        raise InputError(f"{where}: {what} must be text, got {type(value).__name__} {str(value)[:60]!r}")
    if len(value) > MAX_TEXT:
        raise InputError(f"{where}: {what} is {len(value):,} characters long, more than any caption ({MAX_TEXT:,} at "
                         "most)")
    return value


def as_label(value: Any, where: str) -> int:
    """0 or 1 (index of the preferred caption); booleans and text are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value not in (0, 1):
        raise InputError(f"{where}: label must be 0 or 1 (index of the preferred caption), got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------------- rating benchmarks

def read_judgement_json(path: str | Path, candidates_in_references: str) -> Ratings:
    """Flickr8k-Expert, Flickr8k-CF (and Composite) in the CLIPScore / PAC-S json: ``{image_id: {"ground_truth":
    [references], "human_judgement": [{"image_id", "image_path", "caption", "rating"}, ...]}}`` (the files
    ``flickr8k.json`` and ``crowdflower_flickr8k.json`` built by CLIPScore's ``flickr8k_example/download.py``
    and shipped by PAC-S and FLEUR). One row per judgement, so an image-caption pair rated by three experts is
    three rows; NaN ratings are skipped.

    ``candidates_in_references`` is the protocol for a candidate that is also one of the image's references:
    ``"drop_rows"`` (Flickr8k-Expert, Composite: the SPICE / CLIPScore protocol drops those rows) or
    ``"drop_references"`` (Flickr8k-CF: CLIPScore keeps the row and removes every judged candidate of the image
    from its references)."""
    data = load_records(path)
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object of images (CLIPScore / PAC-S format)")
    images, candidates, references, human = [], [], [], []
    excluded = nan_ratings = 0
    for image_id, entry in data.items():
        where = f"{path}: image {image_id!r}"
        if not isinstance(entry, dict) or "human_judgement" not in entry:
            raise InputError(f"{where}: expected an object with 'ground_truth' and 'human_judgement'")
        refs = as_list(pick(entry, ("ground_truth", "references", "refs"), "references", where), where)
        judgements = entry["human_judgement"]
        if candidates_in_references == "drop_references":
            judged = {clean(j.get("caption", "")) for j in judgements if isinstance(j, dict)}
            refs = [r for r in refs if r not in judged]
            if not refs:
                raise InputError(f"{where}: no reference left once the judged candidates are removed")
        ref_set = set(refs)
        for k, judgement in enumerate(judgements):
            at = f"{where}: judgement {k}"
            if not isinstance(judgement, dict):
                raise InputError(f"{at}: expected an object")
            rating = as_score(pick(judgement, ("rating", "human", "score"), "rating", at), at)
            if math.isnan(rating):
                nan_ratings += 1
                continue
            caption = clean(text(pick(judgement, ("caption",), "caption", at), "caption", at))
            if candidates_in_references == "drop_rows" and caption in ref_set:
                excluded += 1
                continue
            images.append(judgement.get("image_path") or entry.get("image_path") or str(image_id))
            candidates.append(caption)
            references.append(refs)
            human.append(rating)
    notes = {"images": len(data), "nan_ratings": nan_ratings}
    return Ratings(Captions(images, candidates, references), np.array(human), excluded=excluded, notes=notes)


def read_composite(path: str | Path) -> Ratings:
    """Composite (Aditya et al., 2015) as the caption-metric code distributes it. Two published layouts:

    * the CLIPScore / PAC-S judgement json (see :func:`read_judgement_json`), built from the AMT files with the
      Flickr8k / Flickr30k / COCO references;
    * FLEUR's and EXPERT's ``composite.json``: ``{"flickr8k"|"flickr30k"|"coco": [{"image", "caption",
      "human"}, ...]}``, reference-free; rows may carry ``"refs"`` / ``"references"`` for reference-based
      metrics. The subset is kept as the row's category (a correlation is reported per subset too).

    Candidates that are one of their image's references are dropped (the CLIPScore protocol)."""
    data = load_records(path)
    if isinstance(data, dict) and data and all(isinstance(v, dict) for v in data.values()):
        return read_judgement_json(path, "drop_rows")
    if not (isinstance(data, dict) and all(isinstance(v, list) for v in data.values())):
        raise InputError(f"{path}: expected the CLIPScore judgement json or {{subset: [rows]}} (FLEUR / EXPERT)")
    images, candidates, references, human, categories = [], [], [], [], []
    excluded = 0
    has_refs = all(pick(r, REFERENCE_KEYS, "", "", required=False) is not None for rows in data.values() for r in rows)
    for subset, rows in data.items():
        for k, row in enumerate(rows):
            at = f"{path}: {subset}[{k}]"
            caption = clean(text(pick(row, ("caption", "candidate", "mt"), "caption", at), "caption", at))
            refs = as_list(pick(row, REFERENCE_KEYS, "references", at), at) if has_refs else None
            if refs is not None and caption in refs:
                excluded += 1
                continue
            images.append(pick(row, ("image", "image_path", "imgid"), "image", at))
            candidates.append(caption)
            references.append(refs)
            human.append(as_score(pick(row, ("human", "rating", "score"), "human score", at), at))
            categories.append(str(subset))
    captions = Captions(images, candidates, references if has_refs else None)
    return Ratings(captions, np.array(human), categories=categories, excluded=excluded,
                   notes={"references": has_refs})


def read_rated_rows(path: str | Path) -> Ratings:
    """One row per rated caption, the layout of Nebula and Polaris: a JSON list or JSON Lines of
    ``{"imgid", "mt", "refs", "score"}`` (EXPERT's ``nebula_test.json`` / ``polaris_test.json``), Polos's
    ``polaris_test.csv`` (columns ``mt``, ``refs`` as a list literal, ``score``, ``imgid``), or the Hugging Face
    Parquet files (``cand``, ``refs``, ``img`` with the image embedded, ``human_score``). Images named by id
    are looked up as ``<id>.jpg`` (or .png) under the image folder."""
    records = load_records(path)
    if isinstance(records, dict):
        records = next((v for v in records.values() if isinstance(v, list)), None)
    if not isinstance(records, list):
        raise InputError(f"{path}: expected a list of rows")
    images, candidates, references, human = [], [], [], []
    for k, row in enumerate(records):
        at = f"{path}: row {k}"
        if not isinstance(row, dict):
            raise InputError(f"{at}: expected an object")
        candidates.append(clean(text(pick(row, CANDIDATE_KEYS, "candidate caption", at), "candidate caption", at)))
        references.append(as_list(pick(row, REFERENCE_KEYS, "references", at), at))
        human.append(as_score(pick(row, HUMAN_KEYS, "human score", at), at))
        image = pick(row, IMAGE_KEYS, "image", at)
        images.append(image if isinstance(image, dict) else str(image))
    return Ratings(Captions(images, candidates, references), np.array(human))


def read_thumb(path: str | Path) -> Ratings:
    """THumB 1.0 on COCO (Kasai et al., 2022; github.com/jungokasai/THumB, ``mscoco/``): JSON Lines
    ``mscoco_THumB-1.0.jsonl`` with ``hyp``, ``image``, ``seg_id``, ``SYS`` and ``human_score`` per row, and the
    references as JSON Lines ``{seg_id, refs}`` in ``mscoco_references.json`` next to it. ``path`` is that
    folder or the ``.jsonl`` file."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    scores = path if path.is_file() else _one(folder, "*THumB*.jsonl", "THumB scores")
    ref_file = _one(folder, "*references*.json*", "THumB references")
    refs_by_seg = {}
    for k, row in enumerate(_rows(load_records(ref_file))):
        at = f"{ref_file}: row {k}"
        refs_by_seg[str(pick(row, ("seg_id",), "seg_id", at))] = as_list(pick(row, ("refs",), "refs", at), at)
    images, candidates, references, human, systems = [], [], [], [], []
    for k, row in enumerate(_rows(load_records(scores))):
        at = f"{scores}: row {k}"
        seg = str(pick(row, ("seg_id",), "seg_id", at))
        if seg not in refs_by_seg:
            raise InputError(f"{at}: no references for seg_id {seg} in {ref_file}")
        candidates.append(clean(text(pick(row, ("hyp",), "hyp", at), "hyp", at)))
        references.append(refs_by_seg[seg])
        human.append(as_score(pick(row, ("human_score",), "human_score", at), at))
        images.append(str(pick(row, ("image",), "image", at)))
        systems.append(str(row.get("SYS", "")))
    notes = {"systems": sorted(set(systems))}
    named = all(systems)  # the SYS column: system-level correlation over the captioning models
    return Ratings(Captions(images, candidates, references), np.array(human), notes=notes,
                   systems=systems if named else None)


def _rows(records: Any) -> list:
    """JSON Lines of one line parse as a single object."""
    return [records] if isinstance(records, dict) else records


def _one(folder: Path, pattern: str, what: str) -> Path:
    found = sorted(folder.glob(pattern))
    if not found:
        raise InputError(f"{what}: no file matching {pattern} in {folder}")
    return found[0]


# -------------------------------------------------------------------------------- pairwise benchmarks

def read_pairwise(path: str | Path, categories: Sequence[str] | None = None) -> Pairs:
    """Pairwise preferences: ``{category: [pair, ...]}``, a JSON list or JSON Lines of pairs. A pair is
    ``{"image", "captions": [A, B], "label": 0 | 1 (index of the caption humans preferred), "references":
    [...]}``; ``caption_a`` / ``caption_b`` may replace ``captions``, ``reference`` (one string) may replace
    ``references`` (optional: reference-free metrics need none), and in a flat list ``category`` or ``domain``
    names the pair's category. This is the Pascal-50S layout of FLEUR's and EXPERT's ``pascal_50s.json``
    (categories HC, HI, HM, MM) and the generic format for MCEval-style data (categories = visual domains)."""
    data = load_records(path)
    if isinstance(data, dict):
        groups = [(str(cat), rows) for cat, rows in data.items()]
    elif isinstance(data, list):
        by_cat: dict[str, list] = defaultdict(list)
        for row in data:
            by_cat[str(row.get("category", row.get("domain", "all"))) if isinstance(row, dict) else "all"].append(row)
        groups = list(by_cat.items())
    else:
        raise InputError(f"{path}: expected {{category: [pairs]}} or a list of pairs")
    if categories is not None:
        missing = sorted(set(categories) - {c for c, _ in groups})
        if missing:
            raise InputError(f"{path}: categories {missing} missing (expected {list(categories)})")
    rows = _PairRows()
    for category, pairs in groups:
        if not isinstance(pairs, list):
            raise InputError(f"{path}: category {category!r} must hold a list of pairs")
        for k, pair in enumerate(pairs):
            at = f"{path}: {category}[{k}]"
            if not isinstance(pair, dict):
                raise InputError(f"{at}: expected an object")
            captions = pair.get("captions") or pair.get("candidates")
            if captions is None and "caption_a" in pair:
                captions = [pair["caption_a"], pair.get("caption_b")]
            two = isinstance(captions, (list, tuple)) and len(captions) == 2
            if not two or not all(isinstance(c, str) for c in captions):
                raise InputError(f"{at}: needs two captions ('captions': [A, B])")
            label = as_label(pick(pair, ("label", "preferred"), "label", at), at)
            refs = pick(pair, ("references", "refs", "reference"), "references", at, required=False)
            refs = as_list(refs, at) if refs is not None else None
            image = pick(pair, ("image", "image_path", "imgid"), "image", at)
            rows.add(image, [clean(c) for c in captions], refs, label, category, corpus=0)
    return rows.build(path)


class _PairRows:
    """Accumulates pairs as two rows each; the two rows of a pair form one group (a group metric such as
    Soft-MSD normalises over the pair's two captions, as the SugarCrepe / COCO-CF scripts score them)."""

    def __init__(self) -> None:
        self.images, self.candidates, self.references, self.corpus, self.groups = [], [], [], [], []
        self.first, self.second, self.label, self.categories = [], [], [], []

    def add(self, image: Any, captions: Sequence[str], refs: list[str] | None, label: int, category: str,
            corpus: int, group: int | None = None) -> None:
        """``group``: the pair's group id (default: its index among every pair added; one given must be unique
        within its corpus)."""
        for caption in captions:
            self.images.append(image)
            self.candidates.append(caption)
            self.references.append(refs)
            self.corpus.append(corpus)
            self.groups.append(len(self.label) if group is None else group)
        self.first.append(len(self.candidates) - 2)
        self.second.append(len(self.candidates) - 1)
        self.label.append(label)
        self.categories.append(category)

    def build(self, path: Any, notes: dict | None = None) -> Pairs:
        has_refs = all(r is not None for r in self.references)
        if not has_refs and any(r is not None for r in self.references):
            raise InputError(f"{path}: some pairs have references and others not")
        captions = Captions(self.images, self.candidates, self.references if has_refs else None, self.corpus,
                            self.groups)
        return Pairs(captions, np.array(self.first, dtype=np.int64), np.array(self.second, dtype=np.int64),
                     np.array(self.label, dtype=np.int64), self.categories, notes=notes or {})


def read_foil(path: str | Path, settings: Iterable[tuple[str, int]] = (("1-ref", 1), ("4-ref", 4))) -> Pairs:
    """FOIL-COCO (Shekhar et al., 2017; foilunitn.github.io): ``foilv1.0_test_2017.json`` (COCO-style
    ``images`` and ``annotations`` with ``id``, ``image_id``, ``caption`` and ``foil``: an original caption and
    its foiled versions share one annotation ``id``) plus COCO's ``captions_val2014.json`` for references, next to
    it (``path`` is the FOIL file or the folder holding both).

    Protocol of CLIPScore (Hessel et al., 2021, Sec. 4.3) as Polos's code runs it: every (original, foil) pair is
    one pair whose preferred caption is the original; references are the image's COCO captions without the
    original, the first one ("1-ref") or the first four ("4-ref"), each setting scored as its own corpus."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    foil_file = path if path.is_file() else _one(folder, "foilv1.0_test*.json", "FOIL annotations")
    coco_file = _one(folder, "captions_val2014.json", "COCO val2014 captions (references for FOIL)")
    foil, coco = load_records(foil_file), load_records(coco_file)
    try:
        file_names = {img["id"]: img["file_name"] for img in foil["images"]}
        coco_refs: dict[Any, list[str]] = defaultdict(list)
        for ann in coco["annotations"]:
            coco_refs[ann["image_id"]].append(clean(text(ann["caption"], "caption", f"{coco_file}: {ann.get('id')}")))
        by_id: dict[Any, dict[str, list]] = defaultdict(lambda: {"orig": [], "foil": []})
        for ann in foil["annotations"]:
            if not isinstance(ann["foil"], bool):  # "false" as text would be truthy: a foil read as an original
                raise InputError(f"{foil_file}: annotation {ann.get('id')}: 'foil' must be true or false, "
                                 f"got {ann['foil']!r}")
            by_id[ann["id"]]["foil" if ann["foil"] else "orig"].append(ann)
    except (KeyError, TypeError) as err:
        raise InputError(f"{foil_file} / {coco_file}: not in the FOIL / COCO caption format ({err!r})") from err
    rows = _PairRows()
    skipped = 0
    for corpus, (setting, count) in enumerate(settings):
        for ann_id, group in by_id.items():
            if len(group["orig"]) != 1 or not group["foil"]:
                skipped += corpus == 0
                continue
            orig = group["orig"][0]
            original = clean(text(orig["caption"], "caption", f"{foil_file}: annotation {ann_id}"))
            refs = [r for r in coco_refs.get(orig["image_id"], []) if r != original][:count]
            if not refs:
                raise InputError(f"{foil_file}: annotation {ann_id}: image {orig['image_id']} has no other "
                                 "COCO caption")
            image = file_names.get(orig["image_id"], str(orig["image_id"]))
            for foiled in group["foil"]:
                foiled_caption = clean(text(foiled["caption"], "caption", f"{foil_file}: annotation {ann_id}"))
                rows.add(image, [original, foiled_caption], refs, 0, setting, corpus)
    return rows.build(foil_file, notes={"annotation_ids_skipped": skipped})


# --------------------------------------------------------------------------------- SugarCrepe (MSD-Score)

SUGARCREPE_SUBSETS = ("replace_obj", "replace_att", "replace_rel", "swap_obj", "swap_att", "add_obj", "add_att")


def read_counterfactual(path: str | Path) -> Pairs:
    """Counterfactual caption pairs (COCO-CF, whose files are not public): the layout of MSD-Score's official
    script ``coco_eval_cf.py``, a list of ``{"image_path", "caption", "negative_caption"}`` (or ``{"data": [...]}``,
    e.g. ``coco_cf_easy.json``), the image path relative to ``--images``; SugarCrepe's layout, ``{idx:
    {"filename", "caption", "negative_caption"}}``; one such file, or a folder of them (every ``*.json``, each a
    category: the file name); or the generic pairwise format (:func:`read_pairwise`)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise InputError(f"{path}: no .json files")
        return _counterfactual_files(path, files)
    data = load_records(path)
    if _script_items(data) is not None or (isinstance(data, dict) and data and all(
            isinstance(v, dict) and "negative_caption" in v for v in data.values())):
        return _counterfactual_files(path, [path])
    return read_pairwise(path)


def _script_items(data: Any) -> list | None:
    """The items of a file in coco_eval_cf.py's layout (a list, or a dict with a "data" list), else None."""
    items = data.get("data") if isinstance(data, dict) and isinstance(data.get("data"), list) else data
    if isinstance(items, list) and items and all(isinstance(i, dict) and "negative_caption" in i for i in items):
        return items
    return None


def _counterfactual_files(path: Path, files: Sequence[Path]) -> Pairs:
    """Each file in coco_eval_cf.py's layout is a corpus of its own whose pairs' group ids are their indices in the
    file, as the script numbers them (it runs once per file, and MSD-Score's COCO-CF preset draws from that
    index)."""
    rows = _PairRows()
    for number, file in enumerate(files, start=1):
        data = load_records(file)
        items = _script_items(data)
        if items is None:
            _sugarcrepe_rows(rows, file, data)
            continue
        for k, item in enumerate(items):
            at = f"{file}: item {k}"
            captions = [text(pick(item, (key,), key, at), key, at) for key in ("caption", "negative_caption")]
            image = text(pick(item, ("image_path", "filename"), "image_path", at), "image_path", at)
            rows.add(image, captions, None, 0, file.stem, corpus=number, group=k)
    return rows.build(path)


def read_sugarcrepe(path: str | Path) -> Pairs:
    """SugarCrepe (Hsieh et al., 2023; github.com/RAIVNLab/sugar-crepe, ``data/``): one JSON file per subset,
    ``{idx: {"filename": COCO val2017 image, "caption": positive, "negative_caption": negative}}``. ``path`` is
    the folder holding the seven files (each a category) or one of them. Every pair prefers the positive
    caption; there are no references."""
    path = Path(path)
    if path.is_dir():
        files = [path / f"{name}.json" for name in SUGARCREPE_SUBSETS]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InputError(f"{path}: SugarCrepe subsets missing: {', '.join(missing)}")
    else:
        files = [path]
    return _sugarcrepe_files(path, files)


def _sugarcrepe_files(path: Path, files: Sequence[Path]) -> Pairs:
    rows = _PairRows()
    for file in files:
        _sugarcrepe_rows(rows, file, load_records(file))
    return rows.build(path)


def _sugarcrepe_rows(rows: "_PairRows", file: Path, data: Any) -> None:
    if not isinstance(data, dict):
        raise InputError(f"{file}: expected {{idx: {{filename, caption, negative_caption}}}} (SugarCrepe)")
    for idx, item in data.items():
        at = f"{file}: item {idx!r}"
        if not isinstance(item, dict):
            raise InputError(f"{at}: expected an object")
        captions = [text(pick(item, (key,), key, at), key, at) for key in ("caption", "negative_caption")]
        image = text(pick(item, ("filename",), "filename", at), "filename", at)
        rows.add(image, captions, None, 0, file.stem, corpus=0)


# -------------------------------------------------------------------------------- FactVC (Liu and Wan, 2023)

FACTVC = {
    # the official correlation script's model order (rows are model-major) and each model's caption file
    "activitynet": {"MART": "mart_ae_test.json", "COOT": "coot_ae_test.json", "PDVC_gt": "pdvc_gt_ae_test.json",
                    "PDVC_pred": "pdvc_pred_ae_test.json", "Song": "song_ae_test.json",
                    "VLTinT": "vltint_ae_test.json"},
    "youcook2": {"VTrans": "vtrans_val.json", "MART": "mart_val.json", "COOT": "coot_val.json",
                 "COOT_100m": "coot_100m_val.json", "UniVL": "univl_val.json", "VLTinT": "vltint_val.json"},
}
FACTVC_REFERENCES = {"activitynet": ("gt_ae_test_1_para.json", "gt_ae_test_2_para.json"),
                     "youcook2": ("gt_val_para.json",)}


def factvc_text(text: str) -> str:
    """FactVC's normalisation: every character that is not a letter becomes a space, lower-cased, whitespace
    collapsed."""
    return " ".join("".join(c if ("a" <= c <= "z" or "A" <= c <= "Z") else " " for c in text).lower().split())


def hallucination_rates(sentences: Sequence[str], where: str) -> tuple[float, float]:
    """Share of sentences holding a ``[...]`` span and share of words inside spans, counted as FactVC's script
    does (full stops removed first; a span's words are those from its ``[`` up to its ``]``)."""
    flagged = span_words = total_words = 0
    for sentence in sentences:
        sentence = text(sentence, "sentence", where).replace(".", "").strip()
        opens = [i for i, c in enumerate(sentence) if c == "["]
        closes = [i for i, c in enumerate(sentence) if c == "]"]
        if len(opens) != len(closes):
            raise InputError(f"{where}: unbalanced [ ] in {sentence[:60]!r}")
        flagged += bool(opens)
        total_words += len(sentence.split())
        span_words += sum(len(sentence[lo:hi].split()) for lo, hi in zip(opens, closes))
    if not sentences or not total_words:
        raise InputError(f"{where}: no annotated words")
    return flagged / len(sentences), span_words / total_words


def read_factvc(path: str | Path, dataset: str) -> Ratings:
    """ActivityNet-Fact / YouCook2-Fact (FactVC; github.com/PKULiuHui/FactVC, ``data/<dataset>/``): the folder
    with ``factuality_annotation.json`` (``{vid: {model: {"paragraph_score", "sentences"}}}``, hallucinated
    spans in ``[...]``), ``vids.txt`` and the models' caption files (``{"results": {vid: [{"sentence"}]}}``)
    and references (``gt_*_para.json``), directly or under ``captions/``. Rows follow the official script:
    model-major over ``vids.txt``; candidate = the model's sentences joined, references = the ground-truth
    paragraph(s) (ActivityNet: two, the first repeated where a video has no second), both normalised by
    :func:`factvc_text`. Human columns: the paragraph score and the negated sentence- and word-level
    hallucination rates. A model whose caption file is absent (ActivityNet's two PDVC files are not public)
    uses the annotated sentences with the brackets removed, which are its captions."""
    folder = Path(path)
    if folder.is_file():
        folder = folder.parent
    annotation = load_records(folder / "factuality_annotation.json")
    vid_file = folder / "vids.txt"
    if not vid_file.is_file():
        raise InputError(f"{folder}: no vids.txt")
    vids = [line.strip() for line in vid_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    references = _factvc_references(folder, dataset, vids)
    images, candidates, refs, systems = [], [], [], []
    paragraph, sentence, word = [], [], []
    from_annotation = []
    for model, file_name in FACTVC[dataset].items():
        captions = _factvc_captions(folder, file_name)
        if captions is None:
            from_annotation.append(model)
        for vid in vids:
            at = f"{folder / 'factuality_annotation.json'}: {vid} / {model}"
            entry = annotation.get(vid, {}).get(model) if isinstance(annotation, dict) else None
            if not isinstance(entry, dict):
                raise InputError(f"{at}: no annotation")
            sentences = entry.get("sentences")
            if not isinstance(sentences, list):
                raise InputError(f"{at}: 'sentences' must be a list")
            rate_sentence, rate_word = hallucination_rates(sentences, at)
            if captions is not None:
                if vid not in captions:
                    raise InputError(f"{folder / file_name}: no captions for {vid}")
                paragraph_text = " ".join(text(s.get("sentence") if isinstance(s, dict) else None, "sentence", at
                                               ).strip() for s in captions[vid])
            else:
                paragraph_text = " ".join(sentences).replace("[", "").replace("]", "")
            images.append(vid)
            candidates.append(factvc_text(paragraph_text))
            refs.append(references[vid])
            systems.append(model)
            paragraph.append(as_score(pick(entry, ("paragraph_score",), "paragraph_score", at), at))
            sentence.append(-rate_sentence)
            word.append(-rate_word)
    targets = {"paragraph": paragraph, "sentence": sentence, "word": word}
    notes = {"videos": len(vids), "systems": list(FACTVC[dataset]), "captions_from_annotation": from_annotation}
    return Ratings(Captions(images, candidates, refs), np.array(paragraph), targets=targets, systems=systems,
                   notes=notes)


def _factvc_file(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / "captions" / name):
        if candidate.is_file():
            return candidate
    return None


def _factvc_captions(folder: Path, name: str) -> dict | None:
    file = _factvc_file(folder, name)
    if file is None:
        return None
    data = load_records(file)
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
        raise InputError(f"{file}: expected {{\"results\": {{vid: [{{\"sentence\": ...}}]}}}}")
    return data["results"]


def _factvc_references(folder: Path, dataset: str, vids: Sequence[str]) -> dict[str, list[str]]:
    files = [_factvc_file(folder, name) for name in FACTVC_REFERENCES[dataset]]
    if files[0] is None:
        raise InputError(f"{folder}: reference file {FACTVC_REFERENCES[dataset][0]} not found")
    tables = [load_records(f) for f in files if f is not None]
    out = {}
    for vid in vids:
        if vid not in tables[0]:
            raise InputError(f"{files[0]}: no reference for {vid}")
        first = factvc_text(text(tables[0][vid], "reference", f"{files[0]}: {vid}"))
        refs = [first]
        for table in tables[1:]:  # ActivityNet's second reference, or the first again where there is none
            refs.append(factvc_text(text(table[vid], "reference", vid)) if vid in table else first)
        out[vid] = refs
    return out


# ---------------------------------------------------------------------------------- VATEX-EVAL (EMScore)

def read_vatex_eval(path: str | Path) -> Ratings:
    """VATEX-EVAL (Shi et al., 2022) as JSON: ``{vid: {"vid", "cands": [6 candidates], "scores": 6 x 3
    annotator ratings (a list, or that list written as text), "refs": [[9 references]]}}`` (the conversion of
    EMScore's pickles kept by Video-Comprehension-Score, ``exp/data/vatex-eval/vid_cans_score_dict.json``).
    One row per candidate; the three annotators are three human columns (the protocol correlates against each
    and averages). ``--num-references`` keeps the first n references (EMScore reports 1 and 9)."""
    data = load_records(path)
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected {{vid: {{cands, scores, refs}}}} (VATEX-EVAL)")
    images, candidates, references = [], [], []
    columns: list[list[float]] = []
    for vid, entry in data.items():
        at = f"{path}: video {vid!r}"
        if not isinstance(entry, dict):
            raise InputError(f"{at}: expected an object")
        cands = pick(entry, ("cands",), "cands", at)
        scores = pick(entry, ("scores",), "scores", at)
        if isinstance(scores, str):
            try:
                scores = jsonio.loads(scores)
            except json.JSONDecodeError as err:
                raise InputError(f"{at}: cannot read scores {scores[:60]!r}") from err
        refs = pick(entry, ("refs", "references"), "refs", at)
        if isinstance(refs, list) and len(refs) == 1 and isinstance(refs[0], list):
            refs = refs[0]  # one list of references per video, nested once
        refs = as_list(refs, at)
        if not isinstance(cands, list) or not isinstance(scores, list) or len(cands) != len(scores):
            raise InputError(f"{at}: needs as many score rows as candidates")
        for k, (cand, row) in enumerate(zip(cands, scores)):
            where = f"{at}: candidate {k}"
            if not isinstance(row, list) or (columns and len(row) != len(columns)) or not row:
                raise InputError(f"{where}: expected one rating per annotator ({len(columns) or 'n'}), got {row!r}")
            if not columns:
                columns = [[] for _ in row]
            for column, value in zip(columns, row):
                column.append(as_score(value, where))
            images.append(str(pick(entry, ("vid",), "vid", at)) if "vid" in entry else str(vid))
            candidates.append(clean(text(cand, "candidate", where)))
            references.append(refs)
    targets = {f"annotator{i + 1}": values for i, values in enumerate(columns)}
    return Ratings(Captions(images, candidates, references), np.array(columns[0] if columns else []),
                   targets=targets, notes={"videos": len(data)})


# -------------------------------------------------------------------------------------- CapArena (MSD-Score)

def read_caparena(path: str | Path, keep_human: bool = False, tie_winners: Sequence[str] | None = None) -> Pairs:
    """CapArena's human annotations (Cheng et al., 2025; github.com/njucckevin/CapArena), the file its
    evaluation scripts read (``caparena_annots_eval.json``): a JSON list of battles ``{"img", "source1",
    "source2", "caption1", "caption2", "ref", "winner", "cluster"}``, ``winner`` the winning source (anything
    else a tie), ``cluster`` the difficulty level ("level 1" .. "level 4"). As the official scripts do, battles
    involving the ``human`` source are left out (counted in ``excluded``), unless ``keep_human``. ``tie_winners``
    (default: any) names the winners that are a tie; battles with any other non-source winner are left out
    (MSD-Score's script keeps the human source and only ``"tie"``). ``ref`` (the DOCCI description) is the
    pair's reference."""
    data = load_records(path)
    if not isinstance(data, list):
        raise InputError(f"{path}: expected a JSON list of battles (CapArena)")
    rows = _PairRows()
    ties, systems = [], []
    excluded = 0
    for k, item in enumerate(data):
        at = f"{path}: battle {k}"
        if not isinstance(item, dict):
            raise InputError(f"{at}: expected an object")
        sources = [text(pick(item, (key,), key, at), key, at) for key in ("source1", "source2")]
        if "human" in sources and not keep_human:
            excluded += 1
            continue
        captions = [clean(text(pick(item, (key,), key, at), key, at)) for key in ("caption1", "caption2")]
        winner = text(pick(item, ("winner",), "winner", at), "winner", at)
        if tie_winners is not None and winner not in sources and winner not in tie_winners:
            excluded += 1
            continue
        ref = item.get("ref")
        refs = as_list(ref, at) if ref is not None else None
        image = text(pick(item, ("img", "image"), "img", at), "img", at)
        cluster = text(pick(item, ("cluster",), "cluster", at), "cluster", at)
        rows.add(image, captions, refs, 1 if winner == sources[1] else 0, cluster, corpus=0)
        ties.append(winner not in sources)
        systems.append((sources[0], sources[1]))
    pairs = rows.build(path, notes={"human_ties": int(sum(ties))})
    pairs.excluded = excluded
    pairs.human_tie = np.array(ties, dtype=bool)
    pairs.pair_systems = systems
    return pairs


# ------------------------------------------------------------------------------ ActivityNet-FOIL (EMScore)

def segment_overlap(segment: Sequence[float], reference: Sequence[float]) -> float:
    """Share of a reference segment's whole seconds that the candidate segment covers (EMScore's rule: a
    reference is used when this exceeds 0.4)."""
    a, b = int(segment[0]), int(segment[1])
    c, d = int(reference[0]), int(reference[1])
    length = d - c + 1
    return max(0, min(b, d) - max(a, c) + 1) / length if length > 0 else 0.0


def read_activitynet_foil(path: str | Path) -> Pairs:
    """ActivityNet-FOIL (Shi et al., 2022; EMScore's ``ActivityNet-FOIL_demo.py`` storage folder): the right
    and foiled paragraphs ``final_right_video_sentences.json`` / ``final_foil_video_sentences.json``
    (``{"results": {vid: [{"sentence"}, ...]}}``, sentence i of both describing segment i), the candidates'
    segments ``anet_entities_test_1.json`` and the references ``anet_entities_test_2.json`` (``{vid:
    {"timestamps", "sentences", "duration"}}``). One row per sentence, its image the video cut to the
    sentence's segment; its references the test-2 sentences whose segment it overlaps by more than 40 % (all
    of them where none does). A video's score is the mean over its sentences (``row_units``); a pair is right
    when the right paragraph scores strictly higher than the foiled one."""
    folder = Path(path)
    folder = folder if folder.is_dir() else folder.parent
    right = _results(folder / "final_right_video_sentences.json")
    foil = _results(folder / "final_foil_video_sentences.json")
    segments_file, refs_file = folder / "anet_entities_test_1.json", folder / "anet_entities_test_2.json"
    segments, references = load_records(segments_file), load_records(refs_file)
    durations = {vid: v.get("duration") for table in (segments, references) for vid, v in table.items()
                 if isinstance(v, dict)}
    rows = _PairRows()
    units: list[int] = []
    spans: list[tuple[float, float, float]] = []
    skipped = 0
    for vid, sentences in right.items():
        if vid not in foil or vid not in segments:
            skipped += 1
            continue
        at = f"{folder}: video {vid}"
        foiled = foil[vid]
        if len(foiled) != len(sentences):
            raise InputError(f"{at}: {len(sentences)} right sentences but {len(foiled)} foiled ones")
        stamps = segments[vid].get("timestamps") if isinstance(segments[vid], dict) else None
        if not isinstance(stamps, list) or len(stamps) < len(sentences):
            raise InputError(f"{segments_file}: video {vid}: fewer timestamps than sentences")
        duration = as_score(durations.get(vid), f"{at}: duration")
        ref_entry = references.get(vid) if isinstance(references, dict) else None
        if not isinstance(ref_entry, dict):
            raise InputError(f"{refs_file}: no references for {vid}")
        ref_sentences = [clean(text(r, "reference", f"{refs_file}: {vid}")) for r in ref_entry["sentences"]]
        ref_stamps = ref_entry["timestamps"]
        for side, paragraph in ((0, sentences), (1, foiled)):
            unit = 2 * len(rows.label) + side
            for i, item in enumerate(paragraph):
                where = f"{at}: sentence {i}"
                sentence = clean(text(item.get("sentence") if isinstance(item, dict) else None, "sentence", where))
                used = [r for r, stamp in zip(ref_sentences, ref_stamps) if segment_overlap(stamps[i], stamp) > 0.4]
                rows.images.append(vid)
                rows.candidates.append(sentence)
                rows.references.append(used or ref_sentences)
                rows.corpus.append(0)
                rows.groups.append(unit)
                units.append(unit)
                spans.append((float(stamps[i][0]), float(stamps[i][1]), duration))
        first_row = len(units) - len(sentences) - len(foiled)
        rows.first.append(first_row)
        rows.second.append(first_row + len(sentences))
        rows.label.append(0)
        rows.categories.append("ActivityNet-FOIL")
    pairs = rows.build(folder, notes={"videos_skipped": skipped, "sentences": len(units)})
    pairs.captions.segments = spans
    _, dense = np.unique(np.array(units), return_inverse=True)
    pairs.row_units = dense.ravel()
    return pairs


def _results(path: Path) -> dict:
    data = load_records(path)
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
        raise InputError(f"{path}: expected {{\"results\": {{vid: [{{\"sentence\": ...}}]}}}}")
    return data["results"]


# ---------------------------------------------------------------------------------------- DOCENT (PoSh)

DOCENT_LABELS = ("1_much_better", "1_slightly_better", "equal", "2_slightly_better", "2_much_better")
DOCENT_JUDGMENTS = ("mistakes", "omissions", "overall_quality")


def read_docent(path: str | Path) -> Pairs:
    """DOCENT's coarse judgments (Ananthram et al., 2025; Hugging Face ``amitha/docent-eval-coarse``, split
    ``test``, as PoSh's ``evaluate_posh_coarse.py`` reads it): rows with ``uuid``, ``reference``, ``model1``,
    ``model2``, ``model1_generation``, ``model2_generation`` and, for each of ``mistakes``, ``omissions`` and
    ``overall_quality``, one of ``1_much_better``, ``1_slightly_better``, ``equal``, ``2_slightly_better``,
    ``2_much_better``. ``path`` is the split exported as Parquet, JSON Lines, CSV or a JSON list, or a folder of
    Parquet files (a dataset snapshot's ``data/``). The image is named by ``uuid`` (or the row's ``image``)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.rglob("test-*.parquet")) or sorted(path.rglob("*.parquet"))
        if not files:
            raise InputError(f"{path}: no Parquet files (DOCENT's coarse judgments)")
        records = [r for f in files for r in load_records(f)]
    else:
        records = load_records(path)
    if not isinstance(records, list):
        raise InputError(f"{path}: expected rows of DOCENT's coarse judgments")
    rows = _PairRows()
    graded: dict[str, list[int]] = {kind: [] for kind in DOCENT_JUDGMENTS}
    systems = []
    for k, row in enumerate(records):
        at = f"{path}: row {k}"
        if not isinstance(row, dict):
            raise InputError(f"{at}: expected an object")
        captions = [clean(text(pick(row, (key,), key, at), key, at))
                    for key in ("model1_generation", "model2_generation")]
        reference = clean(text(pick(row, ("reference",), "reference", at), "reference", at))
        image = row["image"] if isinstance(row.get("image"), dict) else text(pick(row, ("uuid",), "uuid", at),
                                                                               "uuid", at)
        for kind in DOCENT_JUDGMENTS:
            value = pick(row, (kind,), kind, at)
            if value not in DOCENT_LABELS:
                raise InputError(f"{at}: {kind} must be one of {', '.join(DOCENT_LABELS)}, got {value!r}")
            graded[kind].append(DOCENT_LABELS.index(value))
        rows.add(image, captions, [reference], 0, "DOCENT", corpus=0)
        systems.append((str(row.get("model1", "")), str(row.get("model2", ""))))
    pairs = rows.build(path)
    pairs.graded = {kind: np.array(values, dtype=np.int64) for kind, values in graded.items()}
    pairs.pair_systems = systems if all(a and b for a, b in systems) else None
    return pairs
