"""Reading caption files: JSON Lines, CSV, TSV and Parquet give the same records and the same scores; what
cannot be read is refused by its line, in one line, without a traceback."""
from __future__ import annotations

import csv
import json

import pytest
from conftest import EXAMPLES

from capeval_plugins import cli
from capeval_plugins.caption_files import load_caption_docs, read_captions, read_records
from capeval_plugins.inputs import InputError

ROWS = [
    {"image": "red_ball.png", "caption": "A red ball lies on the green grass.",
     "references": ["A red ball on a lawn.", "A small red ball sitting on grass."]},
    {"image": "red_ball.png", "caption": "A dog on grass.", "references": ["a dog on grass", "a brown dog"]},
    {"image": "blue_car.png", "caption": "A blue car parked on a grey road.",
     "references": ["A blue car on the road.", "A toy car, blue, with black wheels."]},
    {"image": "green_tree.png", "caption": "A tree, \"green\"; tall", "references": ["A green tree.\tTall one"]},
    {"image": "yellow_sun.png", "caption": "The yellow sun in a blue sky.", "references": "One reference only."},
    {"image": "yellow_sun.png", "caption": "A sun\nover two lines.", "references": ["A bright sun.", "The sun."]},
]


ONE_LINE = [r for r in ROWS if "\n" not in r["caption"]]  # a line break in a CSV/TSV cell is refused


def write_jsonl(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_table(path, rows=ONE_LINE, delimiter=","):
    """The documented CSV/TSV form: a JSON list in the references cell (one string stays a plain cell)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["image", "caption", "references"], delimiter=delimiter)
        writer.writeheader()
        for r in rows:
            refs = r["references"]
            writer.writerow({**r, "references": refs if isinstance(refs, str) else json.dumps(refs)})
    return path


def write_parquet(path, rows=ROWS, as_text=False):
    """The documented Parquet form: a list column (``as_text``: a string column of JSON lists, as a CSV)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    refs = [[r["references"]] if isinstance(r["references"], str) else r["references"] for r in rows]
    if as_text:
        refs = [json.dumps(x) for x in refs]
    table = pa.table({"image": [r["image"] for r in rows], "caption": [r["caption"] for r in rows],
                      "references": refs})
    pq.write_table(table, path)
    return path


def every_format(tmp_path):
    files = {"jsonl": write_jsonl(tmp_path / "caps.jsonl", ONE_LINE),
             "csv": write_table(tmp_path / "caps.csv", ONE_LINE),
             "tsv": write_table(tmp_path / "caps.tsv", ONE_LINE, delimiter="\t")}
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return files
    files["parquet"] = write_parquet(tmp_path / "caps.parquet", ONE_LINE)
    files["parquet_text"] = write_parquet(tmp_path / "caps_text.parquet", ONE_LINE, as_text=True)
    return files


def test_a_line_break_in_a_csv_cell_is_refused_naming_its_line_and_json_lines_keeps_it(tmp_path):
    for delimiter, name in ((",", "caps.csv"), ("\t", "caps.tsv")):
        path = write_table(tmp_path / name, ROWS, delimiter=delimiter)
        with pytest.raises(InputError, match=f"{name}:7: a quoted cell runs from line 7 to line 8.*JSON Lines"):
            read_captions(path, EXAMPLES / "images")
    assert read_captions(write_jsonl(tmp_path / "caps.jsonl"), EXAMPLES / "images").captions[5] == "A sun\nover two lines."


def test_every_format_reads_the_same_records(tmp_path):
    files = every_format(tmp_path)
    expected = read_captions(files["jsonl"], EXAMPLES / "images")
    assert expected.references[1] == ["a dog on grass", "a brown dog"]
    assert expected.references[4] == ["One reference only."]
    for name, path in files.items():
        got = read_captions(path, EXAMPLES / "images")
        assert got.images == expected.images, name
        assert got.captions == expected.captions, name
        assert got.references == expected.references, name


def test_pyarrow_is_in_what_the_suite_installs():
    """CI installs the `all` and `test` extras: the Parquet cases must run there, not skip."""
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("pyarrow") for dep in extras["parquet"])
    assert any("parquet" in dep for dep in extras["all"])


def summary_of(capsys, captions, *extra):
    code = cli.main(["score", "-m", "bleu1", "-m", "rouge_l", "-o", "tokenize=false", "--captions", str(captions),
                     "--images", str(EXAMPLES / "images"), "--quiet", *extra])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out.strip().splitlines()[-1])


def test_every_format_gives_the_scores_of_json_lines(tmp_path, capsys):
    """The issue's case: a CSV references cell holding a JSON list was one string (CIDEr 0.264 -> 0.025)."""
    files = every_format(tmp_path)
    expected = summary_of(capsys, files.pop("jsonl"))
    # a JSON list read as one reference string would give a different BLEU-1 (the independent check)
    one_string = [{**r, "references": json.dumps(r["references"])} for r in ROWS]
    wrong = summary_of(capsys, write_jsonl(tmp_path / "wrong.jsonl", one_string))
    assert abs(wrong["metrics"]["bleu1"]["score"] - expected["metrics"]["bleu1"]["score"]) > 0.05
    for name, path in files.items():
        got = summary_of(capsys, path)
        for metric in ("bleu1", "rouge_l"):
            assert got["metrics"][metric]["score"] == pytest.approx(expected["metrics"][metric]["score"],
                                                                    rel=1e-12), name


@pytest.mark.parametrize("cell", ["['a dog', 'a cat']", '["a dog", "a cat"', "[1, 2"])
def test_a_references_cell_that_is_not_a_json_list_is_refused_by_its_line(tmp_path, capsys, cell):
    path = tmp_path / "caps.csv"
    path.write_text('image,caption,references\nred_ball.png,A ball.,"[""a ball""]"\n'
                    f'blue_car.png,A car.,"{cell.replace(chr(34), chr(34) * 2)}"\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"caps\.csv:3: references must be a JSON list"):
        read_captions(path, EXAMPLES / "images")
    code = cli.main(["score", "-m", "bleu1", "--captions", str(path), "--images", str(EXAMPLES / "images"),
                     "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "caps.csv:3" in err


def test_csv_line_numbers_name_the_file_line_and_a_multi_line_cell_is_refused_by_its_first(tmp_path):
    path = write_table(tmp_path / "caps.csv", ONE_LINE)
    records = read_captions(path, EXAMPLES / "images")
    assert records.lines == [2, 3, 4, 5, 6]  # the header on line 1
    assert records.describe(4) == "sample 4 (caps.csv line 6)"
    rows = ROWS[:5] + [{**ROWS[0], "caption": "x\ny"}, ROWS[1]]
    with pytest.raises(InputError, match="multi.csv:7: a quoted cell runs from line 7 to line 8"):
        read_captions(write_table(tmp_path / "multi.csv", rows), EXAMPLES / "images")


def test_parquet_rows_are_named_by_row(tmp_path):
    path = write_parquet(tmp_path / "caps.parquet")
    assert read_captions(path, EXAMPLES / "images").describe(2) == "sample 2 (caps.parquet row 2)"


def test_an_empty_references_cell_is_no_references_and_a_csv_with_a_bom_reads(tmp_path):
    path = tmp_path / "caps.csv"
    path.write_bytes("\ufeffimage,caption,references,group\nred_ball.png,A ball.,,\n".encode("utf-8"))
    records = read_captions(path, EXAMPLES / "images")
    assert records.images == [str(EXAMPLES / "images" / "red_ball.png")]  # not a "\ufeffimage" column
    assert records.references == [None] and records.groups == [None]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".tsv"])
def test_invalid_utf8_is_refused_with_its_line(tmp_path, capsys, suffix):
    path = tmp_path / f"caps{suffix}"
    good = write_jsonl(tmp_path / "g.jsonl") if suffix == ".jsonl" else write_table(
        tmp_path / f"g{suffix}", delimiter="\t" if suffix == ".tsv" else ",")
    lines = good.read_bytes().split(b"\n")
    lines[2] = lines[2][:5] + b"\xff" + lines[2][5:]
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(InputError, match=rf"caps\{suffix}:3: not valid UTF-8"):
        read_records(path)
    code = cli.main(["score", "-m", "bleu1", "--captions", str(path), "--images", str(EXAMPLES / "images"),
                     "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and ":3:" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_json_string_holding_a_line_separator_stays_one_record(tmp_path):
    path = tmp_path / "caps.jsonl"
    path.write_text(json.dumps({"image": "red_ball.png", "caption": "A ball\u2028on grass."}, ensure_ascii=False)
                    + "\n", encoding="utf-8")
    assert read_captions(path, EXAMPLES / "images").captions == ["A ball\u2028on grass."]


def test_a_missing_images_folder_is_one_line(tmp_path, capsys):
    code = cli.main(["score", "-m", "clipscore", "--captions", str(EXAMPLES / "captions.jsonl"),
                     "--images", str(tmp_path / "nope"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "images folder not found" in err


@pytest.mark.parametrize("limit, expected", [(None, 5), (2, 2), ("3", 3)])
def test_lm_eval_docs_limit(tmp_path, limit, expected):
    docs = load_caption_docs(write_table(tmp_path / "caps.csv"), EXAMPLES / "images", limit)
    assert len(docs) == expected
    assert docs[1]["references"] == ["a dog on grass", "a brown dog"]


@pytest.mark.parametrize("limit", [0, -1, "all", 2.5, True])
def test_lm_eval_docs_refuse_a_limit_that_is_not_a_count(tmp_path, limit):
    """0 used to mean "everything" silently (a falsy limit)."""
    with pytest.raises(InputError, match="limit must be a positive integer"):
        load_caption_docs(write_jsonl(tmp_path / "caps.jsonl"), EXAMPLES / "images", limit)


def test_lm_eval_docs_refuse_references_that_are_not_strings(tmp_path):
    rows = [dict(ROWS[0]), {**ROWS[1], "references": [1, 2]}]
    with pytest.raises(InputError, match=r"sample 1 \(caps\.jsonl line 2\): reference 0 must be a string"):
        load_caption_docs(write_jsonl(tmp_path / "caps.jsonl", rows), EXAMPLES / "images")


def test_lm_eval_metadata_paths_must_be_strings(tmp_path):
    from capeval_plugins.lm_eval_tasks.utils import load_captions

    with pytest.raises(ValueError, match="'images' must be a path"):
        load_captions(str(write_jsonl(tmp_path / "caps.jsonl")), images=["a", "b"])
    docs = load_captions(str(write_table(tmp_path / "caps.csv")), images=str(EXAMPLES / "images"), limit="2")
    assert len(docs["test"]) == 2 and docs["test"][1]["references"] == ["a dog on grass", "a brown dog"]


def test_keys_of_other_tools_are_named_not_silently_ignored(tmp_path, capsys):
    """``img``/``text``/``refs`` (another tool's names): no caption is found, so the file is refused naming the
    expected keys and the renames; with a caption present, a key that looks like ours and is not read is a
    warning (references silently missing would change what reference-based metrics score)."""
    ours = [{"img": r["image"], "text": r["caption"], "refs": r["references"]} for r in ROWS]
    path = write_jsonl(tmp_path / "theirs.jsonl", ours)
    with pytest.raises(InputError) as err:
        read_captions(path)
    message = str(err.value)
    assert "no record has a 'caption' (keys: 'img', 'text', 'refs')" in message
    assert "a caption file's keys are 'image', 'caption', 'references', 'group', 'id'" in message
    assert "rename 'img' -> 'image', 'text' -> 'caption', 'refs' -> 'references'" in message
    assert cli.main(["score", "-m", "bleu4", "--captions", str(path), "--quiet"]) == 2
    assert capsys.readouterr().err.count("\n") == 1

    mixed = [{"image": r["image"], "caption": r["caption"], "refs": r["references"], "human": 3} for r in ONE_LINE]
    csv_path = tmp_path / "mixed.csv"
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(mixed[0]))
        writer.writeheader()
        writer.writerows({**r, "refs": json.dumps(r["refs"])} for r in mixed)
    for path in (write_jsonl(tmp_path / "mixed.jsonl", mixed), csv_path):
        with pytest.warns(UserWarning, match="key 'refs' not read .* rename 'refs' -> 'references'"):
            records = read_captions(path)
        assert records.references == [None] * len(ONE_LINE) and records.captions == [r["caption"] for r in ONE_LINE]

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # our keys, a key of the user's own and a rating: nothing to say
        read_captions(write_jsonl(tmp_path / "fine.jsonl", [{**r, "human": 3, "id": 1} for r in ROWS]))
        (tmp_path / "x.png").write_bytes(b"")  # the lm-eval task's documents: no caption (it generates them)
        load_caption_docs(write_jsonl(tmp_path / "docs.jsonl", [{"image": "x.png", "references": ["a"]}]), tmp_path)


def test_a_row_without_a_caption_says_so():
    from capeval_plugins.inputs import caption_problem

    assert caption_problem(None) == "caption missing"


def test_one_json_lines_reader_for_captions_bench_scores_and_indexes(tmp_path):
    """A valid JSON Lines file (a byte-order mark, CRLF line ends, U+2028, U+0085, U+2029, \\f and \\v inside
    captions) reads the same through ``capeval score``'s caption reader, the benchmark and ``--scores`` readers
    and the generated-image index: one reader, lines cut at \\n only."""
    import json

    from capeval_plugins.bench.readers import load_records
    from capeval_plugins.bench.scorefiles import read_score_rows
    from capeval_plugins.models.generation import read_index

    captions = ["a dog\u2028runs", "a cat\u0085sleeps", "two\u2029birds", "a\x0cb\x0bc", "plain"]
    rows = [{"image": f"{i}.png", "caption": c, "score": 0.5 + i} for i, c in enumerate(captions)]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows).encode())
    assert read_captions(path).captions == captions
    assert load_records(path) == rows
    assert read_score_rows(path) == rows
    assert read_index(path) == {c: f"{i}.png" for i, c in enumerate(captions)}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n{not json\n")
    for reader in (read_captions, load_records, read_score_rows):
        with pytest.raises(InputError, match="bad.jsonl:2: not valid JSON"):
            reader(bad)
