"""The scoring path refuses what it cannot do before any model loads, and never loses or misfiles a sample:
corpus fits too small for their metric, repeated sample ids, and failures found only while scoring."""
from __future__ import annotations

import json
import subprocess

import pytest
from conftest import CAPTIONS, EXAMPLES, PYTHON, REFERENCES

import capeval_plugins
from capeval_plugins import runner
from capeval_plugins.inputs import InputError


def _no_model_loads(monkeypatch):
    from capeval_plugins.core import loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the corpus was checked")

    monkeypatch.setattr(loading, "load_model", refuse)


def test_mid_on_too_few_pairs_is_a_usage_error_before_the_model_loads(tiny_clip, images, monkeypatch):
    mid = capeval_plugins.load("mid", model=tiny_clip)  # tiny CLIP: D = 16, so the fit needs more than 32 pairs
    _no_model_loads(monkeypatch)
    with pytest.raises(InputError) as err:
        runner.score_many({"clipscore": capeval_plugins.load("clipscore", model=tiny_clip), "mid": mid},
                          images, CAPTIONS, REFERENCES)
    message = str(err.value)
    assert message.startswith("mid: ") and "\n" not in message
    assert "2D = 32" in message and "gives 8" in message  # 8 references over the 4 samples
    assert "covariance_eps=5e-4" in message and "-o mid.covariance_eps=5e-4" in message


def test_mid_with_one_reference_pair_names_the_saved_fit_not_an_eps(tiny_clip, images, monkeypatch):
    mid = capeval_plugins.load("mid", model=tiny_clip, covariance_eps=1e-3, fit_pairs="first_reference")
    _no_model_loads(monkeypatch)
    with pytest.raises(InputError, match=r"mid: its Gaussian fit needs at least 2 .* gives 1; .*reference_gaussian"):
        mid(images[:1], CAPTIONS[:1], REFERENCES[:1])


def test_mid_with_a_ridge_or_enough_pairs_passes_the_check(tiny_clip, images):
    from capeval_plugins.contract import CorpusSize

    assert capeval_plugins.load("mid", model=tiny_clip, covariance_eps=5e-4).check_corpus(CorpusSize((2,) * 4)) is None
    mid = capeval_plugins.load("mid", model=tiny_clip)
    assert mid.check_corpus(CorpusSize((1,) * 33)) is None
    assert mid.check_corpus(CorpusSize((1,) * 32)) is not None
    # the pairs of samples skipped by validation do not count
    result = capeval_plugins.load("mid", model=tiny_clip, covariance_eps=5e-4)(images, CAPTIONS, REFERENCES)
    assert result.corpus_extras["fit_pairs"] == 8.0


def test_cli_several_metrics_with_mid_on_the_example_exits_2_in_one_line(tiny_clip, tmp_path):
    cmd = [PYTHON, "-m", "capeval_plugins.cli", "score", "-m", "clipscore", "-m", "mid", "-m", "cider",
           "--model", tiny_clip, "--images", str(EXAMPLES / "images"), "--captions", str(EXAMPLES / "captions.jsonl"),
           "--out", str(tmp_path / "scores.jsonl")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("capeval: error:")]
    assert len(lines) == 1 and "mid:" in lines[0] and "-o mid.covariance_eps=" in lines[0]
    assert "Traceback" not in proc.stderr and "Loading weights" not in proc.stderr


def test_repeated_ids_are_an_error_naming_them(tiny_clip, images):
    clip_s = capeval_plugins.load("clipscore", model=tiny_clip)
    with pytest.raises(InputError, match=r"sample ids must be unique: 0 at positions 0, 1"):
        clip_s(images[:3], CAPTIONS[:3], ids=[0, 0, 1])
    with pytest.raises(InputError, match=r"7 at positions 1, 3"):
        runner.score_many({"clipscore": clip_s}, images, CAPTIONS, ids=[3, 7, 5, 7], on_error="skip")
    assert len(clip_s(images[:3], CAPTIONS[:3], ids=[9, 0, 4])) == 3
