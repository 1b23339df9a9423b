"""Property-based tests (hypothesis) for what hostile and unlucky input reaches: the caption-file readers (every
row comes back, or the file is refused by its line: never rows merged or lost) and the run folder (any
interleaving of interruptions, damage, planted files and links, and resumes: nothing outside the folder
changes, and a run that completes gives the uninterrupted result). Derandomized: CI sees the same examples
every time; the budget keeps the file within about a minute."""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import StopAfter
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from capeval_plugins import runner
from capeval_plugins.caption_files import read_captions, read_records
from capeval_plugins.checkpoint import LOCK, MANIFEST, RunFolderError
from capeval_plugins.contract import INDEX, Metric, MetricInfo, MetricResult, StateSpec
from capeval_plugins.files import FileError
from capeval_plugins.inputs import InputError

READERS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow])
FOLDERS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Text as users and attackers write it: separators, quotes, line breaks of every kind, JSON-looking brackets,
# a byte-order mark, non-Latin scripts and characters outside the BMP.
TRICKY = st.sampled_from([",", "\t", '"', "'", "\n", "\r", "\r\n", "[", "]", "\\", " ", "\ufeff", "\u2028", "\x85",
                          "é", "字", "🚀", "a", "b", "0"])
CELL = st.lists(st.one_of(TRICKY, st.text(max_size=3)), max_size=8).map("".join)
NAME = st.text(alphabet="abcxyz0123 ,\"'\té字", min_size=1, max_size=8).filter(lambda s: s.strip())
ROW = st.fixed_dictionaries({"image": NAME, "caption": CELL, "references": st.lists(CELL, max_size=3)})


def _write(path: Path, data: str | bytes) -> Path:
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def _table_text(rows, delimiter: str) -> str:
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=["image", "caption", "references"], delimiter=delimiter)
    writer.writeheader()
    for row in rows:
        writer.writerow({**row, "references": json.dumps(row["references"], ensure_ascii=False)})
    return buffer.getvalue()


@READERS
@given(rows=st.lists(ROW, min_size=1, max_size=6), fmt=st.sampled_from([".csv", ".tsv", ".jsonl"]))
def test_every_row_comes_back_or_the_file_is_refused(rows, fmt):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if fmt == ".jsonl":
            path = _write(root / "caps.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        else:
            path = _write(root / f"caps{fmt}", _table_text(rows, "," if fmt == ".csv" else "\t"))
        breaks = fmt != ".jsonl" and any(c in value for r in rows for value in (r["image"], r["caption"],
                                                                                json.dumps(r["references"]))
                                         for c in "\r\n")
        try:
            records = read_captions(path, root)
        except InputError as err:
            event("refused")
            assert breaks, f"refused a file it must read: {err}"  # only a line break inside a cell is refused
            assert f"caps{fmt}:" in str(err)
            return
        assert not breaks, "a cell with a line break was read (it could have swallowed rows)"
        assert records.images == [str(root / r["image"]) for r in rows]
        assert records.captions == [r["caption"] for r in rows]
        assert records.references == [r["references"] for r in rows]


@READERS
@given(text=st.lists(st.sampled_from(["a", "b", ",", "\t", '"', "\n", "\r", " ", "[", "]", "é"]), max_size=60)
       .map("".join), fmt=st.sampled_from([".csv", ".tsv"]))
def test_a_table_of_any_text_is_read_line_by_line_or_refused(text, fmt):
    """No row ever spans lines: what is read is exactly what each physical line parses to on its own, and
    every line after the header that holds something is a row."""
    delimiter = "," if fmt == ".csv" else "\t"
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp) / f"t{fmt}", "h1" + delimiter + "h2\n" + text)
        try:
            rows = read_records(path, with_lines=True)
        except InputError as err:
            event("refused")
            assert f"t{fmt}:" in str(err)
            return
        event(f"read {len(rows)} rows")
    lines = [line.rstrip("\r\n") for line in io.StringIO("h1" + delimiter + "h2\n" + text, newline="").readlines()]
    expected = []
    for number, line in enumerate(lines[1:], 2):
        cells = next(csv.reader([line], delimiter=delimiter, strict=True), [])
        if any(cell.strip() for cell in cells):
            expected.append((number, dict(zip(["h1", "h2"], cells))))
    assert rows == expected


@READERS
@given(text=st.lists(st.sampled_from(['{"a": 1}', '{"b": "x\\ny"}', "[1]", "{", '"', "\n", "\r", " ", "\u2028",
                                      '{"c": "\u2028"}']), max_size=12).map("".join))
def test_json_lines_of_any_text_are_read_line_by_line_or_refused(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp) / "t.jsonl", text)
        try:
            rows = read_records(path, with_lines=True)
        except InputError as err:
            assert "t.jsonl:" in str(err)
            return
    expected = [(n, json.loads(line)) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    assert rows == expected


@READERS
@given(rows=st.lists(ROW, min_size=1, max_size=6))
def test_parquet_gives_back_every_row(rows):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        table = pa.table({k: [r[k] for r in rows] for k in ("image", "caption", "references")})
        pq.write_table(table, root / "caps.parquet")
        records = read_captions(root / "caps.parquet", root)
    assert records.captions == [r["caption"] for r in rows]
    assert records.references == [r["references"] for r in rows]


# ---------------------------------------------------------------------------------------------------------
# The run folder


class Letters(Metric):
    """A text metric with both kinds of state (per-sample rows and running sums), no model: the run folder's
    machinery at full speed."""

    info = MetricInfo(name="letters", display_name="Letters", description="", citation="", references="never",
                      images="never")

    def states(self):
        return {"per": StateSpec("cat", torch.float64), "total": StateSpec("sum", torch.float64, (2,))}

    def map(self, batch):
        per = torch.tensor([sum(map(ord, c)) % 97 + len(c) / 7 for c in batch.candidates], dtype=torch.float64)
        return {"per": per, "total": torch.stack([per.sum(), torch.tensor(float(len(per)), dtype=torch.float64)])}

    def finalize(self, state):
        total = state["total"]
        return MetricResult(self.info.name, float(total[0] / total[1]), state["per"], state[INDEX])


CANDIDATES = [f"caption {k} " + "x" * k for k in range(14)]
PART = "rank-0-of-1"
PLANT_AT = [LOCK, MANIFEST, MANIFEST + ".tmp", "run.json", "run.json.tmp", PART, f"{PART}/letters.log",
            f"{PART}/letters.sums", f"{PART}/letters.sums.tmp", "notes.txt", f"{PART}/notes.txt"]
STATE = [MANIFEST, "run.json", f"{PART}/letters.log", f"{PART}/letters.sums"]

ACTION = st.one_of(
    st.tuples(st.just("interrupt"), st.integers(1, 7)),
    st.tuples(st.just("resume"), st.just(0)),
    st.tuples(st.just("restart"), st.just(0)),
    st.tuples(st.just("plant"), st.tuples(st.sampled_from(PLANT_AT),
                                          st.sampled_from(["link-file", "link-dir", "hard-link", "file", "fifo"]))),
    st.tuples(st.just("flip"), st.tuples(st.sampled_from(STATE), st.floats(0, 1))),
    st.tuples(st.just("tear"), st.tuples(st.sampled_from(STATE), st.floats(0, 1))),
)



def _snapshot(root: Path) -> dict[str, tuple]:
    """Everything outside the run folder, by kind and content (links by target)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if "run" in path.relative_to(root).parts[:1]:
            continue
        if path.is_symlink():
            out[str(path)] = ("link", os.readlink(path))
        elif path.is_file():
            out[str(path)] = ("file", path.read_bytes())
        elif path.is_dir():
            out[str(path)] = ("dir",)
        else:
            out[str(path)] = ("other",)
    return out


def _plant(run: Path, name: str, kind: str, victims: Path) -> None:
    target = run / name
    if not target.parent.is_dir():
        return
    if target.is_dir() and not target.is_symlink():
        shutil.move(str(target), str(victims / f"moved-{len(list(victims.iterdir()))}"))
    elif os.path.lexists(target):  # a file, a link, a FIFO planted before
        target.unlink()
    if kind == "link-file":
        target.symlink_to(victims / "victim.txt")
    elif kind == "link-dir":
        target.symlink_to(victims / "folder")
    elif kind == "hard-link":
        os.link(victims / "victim.txt", target)
    elif kind == "file":
        target.write_bytes(b"planted")
    else:
        os.mkfifo(target)


def _damage(run: Path, name: str, where: float, flip: bool) -> None:
    path = run / name
    if path.is_symlink() or not path.is_file() or not path.stat().st_size or path.stat().st_nlink > 1:
        return  # damage to the package's own files only (a planted hard link is the victim's)
    data = bytearray(path.read_bytes())
    at = min(int(where * len(data)), len(data) - 1)
    if flip:
        data[at] ^= 0x40
    else:
        del data[at:]
    path.write_bytes(bytes(data))


@FOLDERS
@given(actions=st.lists(ACTION, min_size=1, max_size=7))
def test_any_interleaving_of_interruption_damage_planting_and_resume_stays_inside_the_run_folder(actions):
    corpus = runner.Corpus(CANDIDATES)
    metric = {"letters": Letters(batch_size=2)}
    whole = runner.run(metric, corpus).results["letters"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        victims = root / "victims"
        (victims / "folder").mkdir(parents=True)
        (victims / "victim.txt").write_bytes(b"the user's file")
        (victims / "folder" / "inside.txt").write_bytes(b"the user's folder")
        run = root / "run"
        for what, arg in [*actions, ("resume", 0)]:
            before = _snapshot(root)
            if what == "plant":
                _plant(run, *arg, victims)
            elif what in ("flip", "tear"):
                _damage(run, *arg, flip=what == "flip")
            else:
                stop = StopAfter(arg) if what == "interrupt" else None
                try:
                    outcome = runner.run(metric, corpus, run_dir=run, restart=what == "restart", stop=stop)
                except (runner.Interrupted, RunFolderError, FileError) as err:
                    event(f"{what}: {type(err).__name__}")
                else:
                    event(f"{what}: completed")
                    result = outcome.results["letters"]
                    assert torch.equal(result.scores, whole.scores) and result.score == whole.score
                    runner.finish(run, run_id=outcome.run_id)
                assert _snapshot(root) == before, what
                assert (victims / "victim.txt").read_bytes() == b"the user's file"
                assert (victims / "folder" / "inside.txt").read_bytes() == b"the user's folder"
                assert sorted(p.name for p in (victims / "folder").iterdir()) == ["inside.txt"]


# --- packed text states --------------------------------------------------------------------------------------

TEXT = st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=12)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(texts=st.lists(TEXT, max_size=12), cuts=st.lists(st.integers(0, 12), max_size=4),
       picks=st.lists(st.integers(0, 11), max_size=15), lists=st.booleans())
def test_packed_text_states_equal_the_padded_ones_however_batched_and_selected(texts, cuts, picks, lists):
    """Texts of any characters (but NUL), split into batches anywhere (some empty), some batches packed and some
    padded, merged and then rows selected in any order with repeats: the same texts as the padded merge."""
    from capeval_plugins.contract import TEXT_STATE, decode_text_lists, decode_texts, encode_text_lists, encode_texts

    values = [[t, t[::-1]] if i % 2 else [t] for i, t in enumerate(texts)] if lists else texts
    encode, decode = (encode_text_lists, decode_text_lists) if lists else (encode_texts, decode_texts)
    bounds = sorted({0, len(values), *[min(c, len(values)) for c in cuts]})
    batches = [values[a:b] for a, b in zip(bounds, bounds[1:])] + [[]]
    blocks = [encode(batch, packed=bool(k % 2)) for k, batch in enumerate(batches)]
    merged = TEXT_STATE.cat(blocks)
    assert decode(merged) == values
    assert np.array_equal(merged.padded(), StateSpec("cat", np.uint8, (-1,)).cat([encode(values)]))
    rows = torch.tensor([p for p in picks if p < len(values)], dtype=torch.int64)
    assert decode(merged.select(rows)) == [values[i] for i in rows.tolist()]
