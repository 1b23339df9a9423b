"""The scoring path refuses what it cannot do before any model loads, and never loses or misfiles a sample:
corpus fits too small for their metric, repeated sample ids, and failures found only while scoring."""
from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import CAPTIONS, EXAMPLES, REFERENCES, capeval_in_process

import capeval_plugins
from capeval_plugins import runner
from capeval_plugins.contract import Metric, MetricInfo, MetricResult, StateSpec
from capeval_plugins.inputs import InputError


def _no_model_loads(monkeypatch):
    from capeval_plugins.resources import loading

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
    cmd = ["score", "-m", "clipscore", "-m", "mid", "-m", "cider", "--model", tiny_clip, "--images",
           str(EXAMPLES / "images"), "--captions", str(EXAMPLES / "captions.jsonl"),
           "--out", str(tmp_path / "scores.jsonl")]
    proc = capeval_in_process(cmd)
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


# --- failures found while scoring ------------------------------------------------------------------------

class Fragile(Metric):
    """Caption length as its score, a summed total; fails on any batch holding a caption with "boom"."""

    info = MetricInfo(name="fragile", display_name="Fragile", description="test", citation="",
                      references="never", images="never")
    calls = 0

    def states(self):
        return {"length": StateSpec("cat"), "total": StateSpec("sum")}

    def map(self, batch):
        type(self).calls += 1
        if any("boom" in c for c in batch.candidates):
            raise TypeError("cannot take this caption")
        length = torch.tensor([float(len(c)) for c in batch.candidates], dtype=torch.float64)
        return {"length": length, "total": length.sum()}

    def finalize(self, state):
        return MetricResult("fragile", float(state["total"]), state["length"], state["index"])


TEXTS = [f"caption number {i}" + ("!" * i) for i in range(11)]


@pytest.mark.parametrize("bad", [[3], [0, 7, 8], [10]])
def test_a_sample_failing_while_scoring_is_skipped_alone(bad):
    texts = [t + " boom" if i in bad else t for i, t in enumerate(TEXTS)]
    ids = [100 + i for i in range(len(texts))]
    Fragile.calls = 0
    got = Fragile(batch_size=4)(None, texts, ids=ids, on_error="skip")
    assert sorted(got.skipped) == [100 + i for i in bad]
    assert all("fragile failed while scoring it: TypeError: cannot take this caption" in r for r in got.skipped.values())
    good = [i for i in range(len(texts)) if i not in bad]
    expected = Fragile(batch_size=4)(None, [texts[i] for i in good], ids=[ids[i] for i in good])
    assert got.score == pytest.approx(expected.score, rel=1e-12)  # the summed state left the bad samples out
    assert got.scores[[i for i in good]].tolist() == pytest.approx(expected.scores.tolist(), rel=1e-12)
    assert torch.isnan(got.scores[bad]).all()


def test_a_sample_failing_while_scoring_raises_naming_the_users_index():
    texts = list(TEXTS)
    texts[5] += " boom"
    with pytest.raises(TypeError) as err:
        runner.score(Fragile(batch_size=4), None, texts, ids=[50 + i for i in range(11)],
                     describe=lambda i: f"sample {i} (captions.jsonl line {i + 2})")
    assert "(while fragile scored sample 55 (captions.jsonl line 57))" in "\n".join(err.value.__notes__)


def test_a_metric_failing_on_every_sample_is_not_skipped_sample_by_sample():
    texts = [t + " boom" for t in TEXTS]
    with pytest.raises(TypeError) as err:
        Fragile(batch_size=4)(None, texts, on_error="skip")
    assert "each one fails alone too" in "\n".join(err.value.__notes__)


def test_torchmetrics_update_isolates_a_failing_sample():
    from capeval_plugins.adapters.torchmetrics import CapevalMetric

    metric = CapevalMetric(Fragile(batch_size=4, on_error="skip"))
    metric.update(None, TEXTS[:4], ids=[0, 1, 2, 3])
    metric.update(None, [TEXTS[4], TEXTS[5] + " boom", TEXTS[6]], ids=[4, 5, 6])
    result = metric.compute_all()
    assert list(result.skipped) == [5]
    assert result.score == pytest.approx(sum(len(TEXTS[i]) for i in (0, 1, 2, 3, 4, 6)))


@pytest.mark.parametrize("text,what", [("a dog \ud800 runs", "lone surrogate"), ("a dog\x00 runs", "NUL character")])
def test_unencodable_text_is_refused_up_front_by_its_index(text, what):
    cider = capeval_plugins.load("cider", tokenize=False)
    refs = [["a dog runs"], ["a cat sits"], ["a car"]]
    with pytest.raises(InputError, match=f"sample 1: caption contains a {what}"):
        cider(None, ["a dog", text, "a car"], refs)
    with pytest.raises(InputError, match=f"sample 2: reference 1 contains a {what}"):
        cider(None, ["a dog", "a cat", "a car"], [refs[0], refs[1], ["a car", text]])
    got = cider(None, ["a dog", text, "a car"], refs, on_error="skip")
    assert list(got.skipped) == [1] and what in got.skipped[1]


def test_cli_skip_covers_a_surrogate_caption_and_a_caption_of_special_tokens(tiny_clip, tmp_path):
    rows = [json.loads(line) for line in (EXAMPLES / "captions.jsonl").read_text().splitlines()]
    rows[1]["caption"] = "\ud800"
    rows[3]["caption"] = "<|endoftext|>"
    captions = tmp_path / "captions.jsonl"
    captions.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json.dumps writes the surrogate escaped
    out = tmp_path / "scores.jsonl"
    cmd = ["score", "-m", "clipscore", "-m", "msd_score", "-m", "bleu4", "--model", tiny_clip, "--images",
           str(EXAMPLES / "images"), "--captions", str(captions), "--out", str(out), "--on-error", "skip", "--quiet"]
    proc = capeval_in_process(cmd)
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert "lone surrogate" in got[1]["error"]
    # a caption of special tokens only: MSD-Score scores it on its boundary tokens, as the official scripts do
    assert math.isfinite(got[3]["msd_score"])
    assert all("error" not in got[i] for i in (0, 2, 3, 4, 5))


def test_mid_with_too_few_distinct_images_is_refused_before_loading(tiny_clip, monkeypatch):
    from conftest import random_image

    four = [random_image(i) for i in range(4)]
    images = [four[i % 4] for i in range(40)]  # 40 pairs, but only 4 distinct images for D = 16
    captions = [f"caption {i}" for i in range(40)]
    references = [[f"reference {i}"] for i in range(40)]
    mid = capeval_plugins.load("mid", model=tiny_clip)
    _no_model_loads(monkeypatch)
    with pytest.raises(InputError, match=r"mid: .*more distinct images than the D = 16 .* the corpus has 4; .*"
                                         r"covariance_eps=5e-4"):
        mid(images, captions, references)
