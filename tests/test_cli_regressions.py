"""Regressions found by an audit of the command line, each through ``capeval`` as a user runs it: the user's
secret named as an output, and the folders ``--run-dir`` makes above the run folder."""
from __future__ import annotations

import json
import os

import pytest
from conftest import cli, has_java, one_line

from capeval_plugins import files

needs_java = pytest.mark.skipif(not has_java(), reason="bleu4 tokenizes with the PTB tokenizer (Java)")


@pytest.fixture
def key_folder(tmp_path, monkeypatch):
    folder = tmp_path / "config"
    monkeypatch.setenv("CAPEVAL_CONFIG_DIR", str(folder))
    files.secret()
    return folder


@pytest.fixture
def captions(tmp_path):
    rows = [{"caption": "a dog runs on the grass", "references": ["a dog is running", "the dog runs on grass"]},
            {"caption": "a cat sits", "references": ["a cat is sitting", "one cat sits down"]}]
    path = tmp_path / "captions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_secret_key_is_refused_as_every_command_s_output(key_folder, captions, tmp_path, capsys):
    """``capeval score --out $CAPEVAL_CONFIG_DIR/secret.key`` replaced the key, and every resumable run after
    it was refused; now refused in one line, as itself, through a link to its folder and as a hard link."""
    key = key_folder / files.SECRET_FILE
    saved = key.read_bytes()
    (tmp_path / "via").symlink_to(key_folder)
    os.link(key, tmp_path / "hard.key")
    (tmp_path / "scores.jsonl").write_text('{"a": 0.1, "b": 0.2, "human": 1}\n{"a": 0.2, "b": 0.1, "human": 2}\n')
    (tmp_path / "results.json").write_text('{"x": 1.0}')
    for out in (key, tmp_path / "via" / files.SECRET_FILE, tmp_path / "hard.key"):
        for args in (["score", "-m", "bleu4", "--captions", captions, "--out", out, "--quiet"],
                     ["calibrate", "--scores", tmp_path / "scores.jsonl", "--components", "a,b", "--out", out],
                     ["verify", tmp_path / "results.json", "--expected", '{"x": 1}', "--json", out]):
            code, _, err = cli(args, capsys)
            assert code == 2 and one_line(err) and "is your secret key" in err, (args, err)
    assert key.read_bytes() == saved and (tmp_path / "hard.key").read_bytes() == saved


@needs_java
def test_a_resumable_run_still_runs_after_the_key_was_named_as_out(key_folder, captions, tmp_path, capsys):
    code, _, err = cli(["score", "-m", "bleu4", "--captions", captions, "--out", key_folder / files.SECRET_FILE],
                       capsys)
    assert code == 2, err
    code, out, err = cli(["score", "-m", "bleu4", "--captions", captions, "--out", tmp_path / "o.jsonl", "--quiet"],
                         capsys)
    assert code == 0 and len((tmp_path / "o.jsonl").read_text().splitlines()) == 2, err


@needs_java
def test_a_finished_run_leaves_no_folder_it_made_above_the_run_folder(captions, tmp_path, capsys):
    """``--run-dir newdir/sub`` with newdir missing left an empty newdir/ behind; a folder that was there
    before stays, with what it holds."""
    (tmp_path / "existing").mkdir()
    for run_dir in (tmp_path / "newdir" / "a" / "sub", tmp_path / "existing" / "made" / "sub"):
        code, _, err = cli(["score", "-m", "bleu4", "--captions", captions, "--out", tmp_path / "o.jsonl",
                            "--run-dir", run_dir, "--quiet"], capsys)
        assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["captions.jsonl", "existing", "o.jsonl"]
    assert list((tmp_path / "existing").iterdir()) == []
