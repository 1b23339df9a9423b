"""Issue 49, items 4 and 6 (data side): every input file named on the command line that is not a regular file
(a FIFO, /dev/zero, a folder) is said as such in one line, without ever opening it (a FIFO would block); a COCO
results file that is a JSON object says what it is ("capeval: error: None" before); COCO image ids match as
pycocotools matches them and an image with two results is refused (pycocoevalcap's scorers assert one)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from capeval_plugins.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def cli(args, capsys):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.err


def one_line_error(code: int, err: str) -> str:
    assert code == 2 and err.count("\n") == 1 and err.startswith("capeval: error: "), err
    return err.strip()


@pytest.fixture
def specials(tmp_path):
    """A FIFO, a character device and a folder, each under a name that would otherwise be read."""
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.txt"
    folder.mkdir()
    return {"FIFO": fifo, "character device": Path("/dev/zero"), "folder": folder}


def plain_files(tmp_path):
    (tmp_path / "cands.txt").write_text("a dog runs\n")
    (tmp_path / "refs.txt").write_text("a dog running\n")
    (tmp_path / "scores.jsonl").write_text(json.dumps({"image": "0", "caption": "a dog", "score": 1}) + "\n")
    (tmp_path / "nebula.json").write_text(json.dumps([{"imgid": "0", "mt": "a dog", "refs": ["a dog"], "score": 0.5},
                                                      {"imgid": "1", "mt": "a cat", "refs": ["a dog"], "score": 0.1}]))
    return tmp_path


def commands(tmp_path, special):
    """Every command-line argument that names a file to read, given ``special`` in its place."""
    base = plain_files(tmp_path)
    bench = ["bench", "nebula", "--bootstrap", "0", "--no-cache", "--quiet"]
    return {
        "-c": ["score", "-m", "bleu1", "-c", special, "-r", base / "refs.txt", "--quiet"],
        "-r": ["score", "-m", "bleu1", "-c", base / "cands.txt", "-r", special, "--quiet"],
        "--captions": ["score", "-m", "bleu1", "--captions", special, "--quiet"],
        "--annotations": ["score", "-m", "bleu1", "--captions", base / "scores.jsonl", "--annotations", special,
                          "--quiet"],
        "--data": [*bench, "--data", special, "--metric", "bleu1"],
        "--scores": [*bench, "--data", base / "nebula.json", "--scores", f"s={special}"],
        "--labels": [*bench, "--data", base / "nebula.json", "--metric", "bleu1", "--labels", special],
    }


@pytest.mark.parametrize("option", ["-c", "-r", "--captions", "--annotations", "--data", "--scores", "--labels"])
@pytest.mark.parametrize("kind", ["FIFO", "character device", "folder"])
def test_an_input_that_is_not_a_file_is_said_as_such(tmp_path, capsys, specials, option, kind):
    """`-c` given a FIFO, /dev/zero or a folder said "file not found"; now each entry point says what is there."""
    if option in ("--data", "--labels") and kind == "folder":
        pytest.skip("a folder is what --data and --labels take for files kept together")
    line = one_line_error(*cli(commands(tmp_path, specials[kind])[option], capsys))
    assert f"is a {kind}, not a regular file" in line and "not found" not in line, line


def test_a_fifo_never_blocks_a_run(tmp_path, monkeypatch):
    """Nothing writes into the FIFO: a reader that opened it would wait for ever. Proved by what the run does,
    not by a time limit a busy machine could reach: every open of the FIFO is watched (a blocking one, or a file
    object made on it, fails at once instead of hanging)."""
    from conftest import capeval_in_process
    from test_hostile_inputs import SpecialFileWatch

    fifo = tmp_path / "cands.txt"
    os.mkfifo(fifo)
    (tmp_path / "refs.txt").write_text("a dog\n")
    watch = SpecialFileWatch(str(fifo), monkeypatch)
    done = capeval_in_process(["score", "-m", "bleu1", "-c", fifo, "-r", tmp_path / "refs.txt", "--quiet"])
    monkeypatch.undo()
    assert all(flags & os.O_NONBLOCK for flags in watch.opened)
    assert done.returncode == 2 and "is a FIFO" in done.stderr, done.stderr


# ------------------------------------------------------------------------------------------------- COCO files

def coco_files(tmp_path, results):
    annotations = {"images": [{"id": 42, "file_name": "a.jpg"}, {"id": 43, "file_name": "b.jpg"}],
                   "annotations": [{"image_id": 42, "id": 1, "caption": "a dog runs"},
                                   {"image_id": 43, "id": 2, "caption": "a cat sleeps"}]}
    (tmp_path / "ann.json").write_text(json.dumps(annotations))
    (tmp_path / "res.json").write_text(json.dumps(results))
    return ["score", "-m", "bleu1", "-o", "tokenize=false", "--captions", tmp_path / "res.json", "--annotations",
            tmp_path / "ann.json", "--quiet"]


@pytest.mark.parametrize("results, words", [
    ({"image_id": 42, "caption": "a dog"}, "a JSON array of {\"image_id\", \"caption\"} objects, not an object"),
    ({"42": "a dog"}, "not an object"),
    ("a dog", "not a string"),
    ([{"image_id": 42, "caption": "a dog"}, ["x"]], "entry 1 is not an {\"image_id\", \"caption\"} object"),
    ([{"image_id": "42", "caption": "a dog"}], "image id \"42\" is a string, and"),
    ([{"image_id": 42.0, "caption": "a dog"}, {"image_id": 42, "caption": "a cat"}], "image id 42 has two results"),
    ([{"image_id": 42, "caption": "a dog"}, {"image_id": 42, "caption": "a dog"}], "(entries 0 and 1)"),
    ([{"image_id": True, "caption": "a dog"}], "image id true is not a number or a string"),
    ([{"image_id": 44, "caption": "a dog"}], "1 image id(s) are not in"),
])
def test_a_coco_results_file_that_pycocotools_would_refuse_is_one_line(tmp_path, capsys, results, words):
    line = one_line_error(*cli(coco_files(tmp_path, results), capsys))
    assert words in line and "None" not in line, line


def test_a_coco_results_file_by_the_book_scores_each_image_once(tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    args = coco_files(tmp_path, [{"image_id": 43, "caption": "a cat sleeps"}, {"image_id": 42, "caption": "a dog"}])
    code, err = cli([*args, "--out", out], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["image_id"] for r in rows] == [43, 42] and rows[0]["bleu1"] == pytest.approx(1.0)
