"""What `capeval` tells a user: help text that is true, no spurious warnings (one progress bar under torchrun:
tests/test_cli.py, beside its other torchrun checks)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import EXAMPLES, PYTHON, capeval_in_process, run

from capeval_plugins import cli
from capeval_plugins.caption_files import read_captions

CAPEVAL = str(Path(PYTHON).parent / "capeval")


def score_help() -> str:
    parser = cli.build_parser()
    score = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "score")[1]
    return score.format_help()


def test_the_help_example_line_number_is_the_one_an_error_prints(tmp_path):
    """`sample 250` of a caption file is on line 251 (sample 0 is on line 1)."""
    text = score_help()
    sample, line = map(int, re.search(r"sample (\d+) \(captions\.jsonl\s+line (\d+)\)", text).groups())
    path = tmp_path / "captions.jsonl"
    path.write_text("".join(json.dumps({"image": "a.png", "caption": f"c{i}"}) + "\n" for i in range(sample + 1)))
    assert read_captions(path).describe(sample) == f"sample {sample} (captions.jsonl line {line})"


def test_every_score_option_has_help():
    parser = cli.build_parser()
    score = parser._subparsers._group_actions[0].choices["score"]
    for action in score._actions:
        assert action.help, f"{action.option_strings} has no help text"
    text = score_help()
    for flag in ("--batch-size", "--device", "--dtype"):
        assert re.search(rf"{flag} \w+\s+\S", text), flag


def test_tiny_clip_does_not_warn_about_torchvision(tmp_path):
    proc = run([CAPEVAL, "tiny", "clip", str(tmp_path / "clip")], env={"TRANSFORMERS_VERBOSITY": "warning"})
    assert "torchvision" not in proc.stderr


def test_quiet_in_process_leaves_the_callers_environment_as_it_was(tiny_clip, monkeypatch, capsys):
    """`main([... "--quiet"])` called in a process (a notebook, a test) silences the libraries for that call only:
    afterwards no TQDM_DISABLE / CAPEVAL_QUIET is left to silence the caller or the programs it starts."""
    for key in cli.QUIET_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # a caller's own setting is put back as it was
    assert cli.main(["score", "-m", "clipscore", "--model", tiny_clip, "--quiet",
                     "--captions", str(EXAMPLES / "captions.jsonl"), "--images", str(EXAMPLES / "images")]) == 0
    capsys.readouterr()
    import os

    assert "TQDM_DISABLE" not in os.environ and "CAPEVAL_QUIET" not in os.environ
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"


def test_a_rank_other_than_0_reports_its_typed_error_in_one_line(monkeypatch, capsys):
    """Under torchrun each rank reaches the error branch: one that is not rank 0 reports an error only it can have
    found (here an unknown metric name, not an input problem every rank shares) and exits 2, not a traceback."""
    monkeypatch.setenv("RANK", "1")
    code = cli.main(["score", "-m", "no_such_metric", "--captions", str(EXAMPLES / "captions.jsonl"),
                     "--images", str(EXAMPLES / "images")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("capeval: error:") and "no_such_metric" in err and len(err.strip().splitlines()) == 1


def test_the_packages_warnings_are_one_line_on_the_command_line(tmp_path):
    """Python's format printed the warning's file and line and the source line of the call after it."""
    captions = tmp_path / "typo.jsonl"
    captions.write_text('{"caption": "a dog", "refrences": ["a dog runs"]}\n')
    proc = capeval_in_process(["score", "-m", "bleu1", "-o", "tokenize=false", "--captions", str(captions)])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("capeval: error: bleu1 needs references")
    assert lines[0].startswith("capeval: warning: ") and "rename 'refrences' -> 'references'" in lines[0]
    assert "UserWarning" not in proc.stderr and "read_captions(" not in proc.stderr
