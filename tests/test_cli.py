"""`capeval` command line: list, score (single process and torchrun), output formats, errors."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import EXAMPLES, PYTHON, free_port, run

import capeval_plugins
from capeval_plugins.caption_files import read_captions

CAPEVAL = str(Path(PYTHON).parent / "capeval")


def direct(model):
    records = read_captions(EXAMPLES / "captions.jsonl", EXAMPLES / "images")
    return capeval_plugins.load("clipscore", model=model)(records.images, records.captions, records.references)


def test_list_names_every_metric_and_its_source():
    out = run([CAPEVAL, "list"]).stdout
    assert "clipscore" in out and "refclipscore" in out and "capeval-plugins:builtin" in out
    rows = json.loads(run([CAPEVAL, "list", "--json"]).stdout)
    clip = next(r for r in rows if r["name"] == "clipscore")
    assert clip["references"] == "optional" and clip["images"] == "always"


def test_score_writes_one_line_per_sample_in_input_order(tiny_clip, tmp_path):
    out = tmp_path / "scores.jsonl"
    proc = run([CAPEVAL, "score", "--metric", "clipscore", "--model", tiny_clip, "--captions",
                str(EXAMPLES / "captions.jsonl"), "--images", str(EXAMPLES / "images"), "--out", str(out),
                "--batch-size", "2", "--quiet"])
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    expected = direct(tiny_clip)
    assert [r["index"] for r in rows] == list(range(len(expected)))
    assert [r["score"] for r in rows] == pytest.approx(expected.scores.tolist(), abs=1e-5)
    assert [r["refclipscore"] for r in rows] == pytest.approx(expected.extras["refclipscore"].tolist(), abs=1e-5)
    assert summary["score"] == pytest.approx(expected.score, abs=1e-5) and summary["n"] == len(expected)


def test_score_csv_and_options(tiny_clip, tmp_path):
    out = tmp_path / "scores.csv"
    run([CAPEVAL, "score", "--metric", "clipscore", "--model", tiny_clip, "--captions",
         str(EXAMPLES / "captions.jsonl"), "--images", str(EXAMPLES / "images"), "--out", str(out),
         "-o", "w=1.0", "-o", "prefix_references=false", "--quiet"])
    rows = list(csv.DictReader(out.open()))
    records = read_captions(EXAMPLES / "captions.jsonl", EXAMPLES / "images")
    expected = capeval_plugins.load("clipscore", model=tiny_clip, w=1.0, prefix_references=False)(
        records.images, records.captions, records.references)
    assert [float(r["score"]) for r in rows] == pytest.approx(expected.scores.tolist(), abs=1e-5)


def test_errors_are_one_line_and_name_the_problem(tiny_clip, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"image": "red_ball.png", "caption": "ok"}\n{"image": "nope.png", "caption": "x"}\n')
    import subprocess

    proc = subprocess.run([CAPEVAL, "score", "--metric", "clipscore", "--model", tiny_clip, "--captions",
                           str(bad), "--images", str(EXAMPLES / "images"), "--quiet"], capture_output=True, text=True)
    assert proc.returncode == 2 and "sample 1: image file not found" in proc.stderr
    proc = subprocess.run([CAPEVAL, "score", "--metric", "clipscor", "--captions", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "did you mean" in proc.stderr



@pytest.mark.slow
def test_torchrun_two_ranks_equals_one_process(tiny_clip, tmp_path):
    out = tmp_path / "ddp.jsonl"
    torchrun = str(Path(PYTHON).parent / "torchrun")
    run([torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "capeval_plugins.cli",
         "score", "--metric", "clipscore", "--model", tiny_clip, "--captions", str(EXAMPLES / "captions.jsonl"),
         "--images", str(EXAMPLES / "images"), "--out", str(out), "--quiet"], timeout=600)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    expected = direct(tiny_clip)
    assert [r["index"] for r in rows] == list(range(len(expected)))
    assert [r["score"] for r in rows] == pytest.approx(expected.scores.tolist(), abs=1e-5)


def test_tiny_builds_a_loadable_checkpoint(tmp_path):
    path = run([CAPEVAL, "tiny", "clip", str(tmp_path / "clip")]).stdout.strip().splitlines()[-1]
    assert (Path(path) / "model.safetensors").is_file() and (Path(path) / "config.json").is_file()
