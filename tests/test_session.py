"""One session is the only corpus loop: every entry point validates, checks the corpus, maps, merges and
finalizes through it, so a corpus a metric cannot be fitted on gives the same error everywhere, and the
contract's promises (rows in batch order, metrics callable whatever was imported) hold for every caller."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import CAPTIONS, HANG_GUARD, PYTHON, REFERENCES, random_image

import capeval_plugins
from capeval_plugins import runner
from capeval_plugins.contract import INDEX, MetricInfo, MetricResult, PointwiseMetric, merge_states
from capeval_plugins.resources import loading
from capeval_plugins.inputs import InputError


def four_samples():
    images = [random_image(i, size=(30 + i, 28)) for i in range(4)]
    return images, list(CAPTIONS), [list(r) for r in REFERENCES]


def no_model_loads(monkeypatch):
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))


MID_TOO_FEW = r"^mid: its Gaussian fit on .* needs more \(image, reference\) pairs than the 2D = 32 joint dimensions"


def test_mid_on_four_samples_is_the_same_error_through_every_entry_point(tiny_clip, monkeypatch, tmp_path):
    """``load()``, the runner, evaluate, pycocoevalcap, lm-eval and the reference fit refuse before any model
    loads; torchmetrics, which learns its corpus batch by batch, refuses at compute() with the same error."""
    import evaluate

    from capeval_plugins.adapters.lm_eval import CaptionItem, aggregate
    from capeval_plugins.pycocoevalcap import ImageResolver, Mid
    from capeval_plugins.torchmetrics import MID

    images, captions, references = four_samples()
    errors = {}

    def caught(name, call):
        with pytest.raises(InputError) as err:
            call()
        errors[name] = str(err.value)

    tm = MID(model=tiny_clip)  # the model loads here (its states' size) and at the first update
    tm.update(images, captions, references, ids=[0, 1, 2, 3])
    caught("torchmetrics", tm.compute)
    no_model_loads(monkeypatch)
    caught("load", lambda: capeval_plugins.load("mid", model=tiny_clip)(images, captions, references))
    caught("runner", lambda: runner.score_many({"mid": capeval_plugins.load("mid", model=tiny_clip)}, images,
                                               captions, references))
    caught("evaluate", lambda: evaluate.load("mid", model=tiny_clip).compute(
        images=images, predictions=captions, references=references))
    caught("lm-eval", lambda: aggregate("mid", [CaptionItem(i, c, r) for i, c, r in zip(images, captions, references)],
                                        model=tiny_clip))
    caught("fit_reference", lambda: capeval_plugins.load("mid", model=tiny_clip).fit_reference(images, references))
    for i, image in enumerate(images):
        image.save(tmp_path / f"{i}.png")
    resolver = ImageResolver(tmp_path, pattern="{id}.png")
    caught("pycocoevalcap", lambda: Mid(resolver, model=tiny_clip).compute_score(
        {i: references[i] for i in range(4)}, {i: [captions[i]] for i in range(4)}))
    differ = {name: msg for name, msg in errors.items() if msg != errors["load"]}
    assert not differ, (errors["load"], differ)
    assert __import__("re").match(MID_TOO_FEW, errors["load"]), errors["load"]


def test_mid_on_four_samples_on_the_command_line_is_that_line(tiny_clip, tmp_path):
    images, captions, references = four_samples()
    rows = []
    for i, (img, cap, refs) in enumerate(zip(images, captions, references)):
        img.save(tmp_path / f"{i}.png")
        rows.append({"image": f"{i}.png", "caption": cap, "references": refs})
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([PYTHON, "-m", "capeval_plugins.cli", "score", "-m", "mid", "--model", tiny_clip,
                           "--captions", str(tmp_path / "c.jsonl"), "--images", str(tmp_path), "--quiet"],
                          capture_output=True, text=True, timeout=HANG_GUARD)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    with pytest.raises(InputError) as err:
        capeval_plugins.load("mid", model=tiny_clip)(images, captions, references)
    assert lines[0] == f"capeval: error: {err.value}"


class Reversed(PointwiseMetric):
    """A plugin whose map returns its rows backwards."""

    info = MetricInfo(name="reversed_length", display_name="Reversed", description="d", citation="c",
                      references="never", images="never")

    def score(self, batch):
        n = torch.tensor([float(len(c)) for c in batch.candidates], dtype=torch.float64)
        return {"score": n.flip(0)}


def test_a_metric_returning_its_rows_in_another_order_fails_loudly():
    from capeval_plugins.torchmetrics import CapevalMetric

    with pytest.raises(runner.RowOrderError, match=r"reversed_length.map returned the rows of state 'score' in "
                                                   r"another order"):
        Reversed()(None, ["a", "bb", "ccc"])
    metric = CapevalMetric(metric=Reversed())
    with pytest.raises(runner.RowOrderError):
        metric.update(captions=["a", "bb", "ccc"], ids=[0, 1, 2])


def test_a_metric_class_is_callable_whatever_was_imported_first():
    """A plugin imports only the contract; calling its metric scores through the runner all the same."""
    code = (
        "import torch\n"
        "from capeval_plugins.contract import MetricInfo, PointwiseMetric\n"
        "class Length(PointwiseMetric):\n"
        "    info = MetricInfo(name='length', display_name='L', description='d', citation='c',\n"
        "                      references='never', images='never')\n"
        "    def score(self, batch):\n"
        "        return {'score': torch.tensor([float(len(c)) for c in batch.candidates], dtype=torch.float64)}\n"
        "import sys\n"
        "assert 'capeval_plugins.runner' not in sys.modules\n"
        "print(Length()(None, ['a', 'bbb']).score)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD)
    assert out.returncode == 0 and out.stdout.strip() == "2.0", out.stderr[-2000:]


def test_one_reduce_gives_the_same_bits_however_a_rank_keeps_its_batches():
    """A rank's batches merged at once, or kept the run-folder way (rows per batch, a running sum) and merged
    then, are the same bits; ranks merge their totals in rank order. All of it is contract.merge_states."""
    from capeval_plugins.contract import StateSpec

    spec = {"r": StateSpec("cat", torch.float64, (2,)), "s": StateSpec("sum", torch.float64, (3,)),
            INDEX: StateSpec("cat", torch.int64)}
    gen = torch.Generator().manual_seed(0)
    parts = [{"r": torch.randn(k, 2, generator=gen, dtype=torch.float64), "s": torch.randn(3, generator=gen,
             dtype=torch.float64), INDEX: torch.arange(k)} for k in (3, 1, 4, 2)]
    whole = merge_states(spec, parts)
    sums = {"s": spec["s"]}
    running = {}
    for part in parts:
        running = merge_states(sums, [running, {"s": part["s"]}])
    rows = [{k: p[k] for k in ("r", INDEX)} for p in parts]
    kept = merge_states(spec, [*rows, running])
    assert all(torch.equal(whole[k], kept[k]) for k in spec)
    ranks = merge_states(spec, [merge_states(spec, parts[:2]), merge_states(spec, parts[2:])])
    assert torch.equal(ranks["r"], whole["r"])
    assert torch.equal(ranks["s"], (parts[0]["s"] + parts[1]["s"]) + (parts[2]["s"] + parts[3]["s"]))
    with pytest.raises(KeyError, match="not declared"):
        merge_states(spec, [{"other": torch.zeros(1)}])


def test_the_batch_plan_is_the_runner_order():
    plan = runner.schedule({"a": 2, "b": 4})
    assert plan == [("b", 0), ("a", 0), ("b", 1), ("b", 2), ("a", 1), ("b", 3)]
    assert runner.schedule({"a": 2, "b": 4}, {"a": 1, "b": 2}) == [("b", 2), ("a", 1), ("b", 3)]


def test_mid_reference_fit_streams_through_the_session(tiny_clip, tmp_path):
    """fit_reference's sums equal the fit the scoring pass makes on the same pairs (one loop, one reduce)."""
    from capeval_plugins.metrics.mid import FIT

    n = 20
    images = [random_image(i, size=(30 + i % 5, 28)) for i in range(n)]
    references = [[f"{REFERENCES[i % 4][0]} {i}", f"a second reference {i}"] for i in range(n)]
    mid = capeval_plugins.load("mid", model=tiny_clip, batch_size=7, covariance_eps=1e-3)
    sums = mid.fit_reference(images, references, save_to=str(tmp_path / "fit.npz"))
    session = runner.Session({"mid": mid})
    state = session.fold(runner.Corpus([f"c {i}" for i in range(n)], images, references))["mid"].state
    for key, name in FIT.items():
        assert torch.allclose(sums[key], state[name], rtol=1e-10, atol=1e-10), key
    assert sums["count"].item() == 2 * n
    later = capeval_plugins.load("mid", model=tiny_clip, reference_gaussian=str(tmp_path / "fit.npz"))
    assert isinstance(later(images[:2], ["a", "b"]), MetricResult)


def test_mid_reference_fit_reports_the_samples_it_skips(tiny_clip, tmp_path):
    """``on_error="skip"`` with 2 unreadable images of 60 (one refused by its header at validation, one whose
    pixels fail to decode while its batch is built): the fit is the fit of the other 58 pairs, and the two are
    said in a warning and recorded (the returned sums' ``skipped``, the saved fit's header), as the runner
    records skipped samples in a result."""
    from capeval_plugins.core.gaussian import sums_from_bytes

    n, bad = 60, (7, 41)
    paths, references = [], []
    for i in range(n):
        path = tmp_path / f"{i}.png"
        random_image(i, size=(30 + i % 5, 28)).save(path)
        paths.append(str(path))
        references.append([f"{REFERENCES[i % 4][0]} {i}"])
    (tmp_path / "7.png").write_bytes(b"\x89PNG not really")  # refused by its header
    (tmp_path / "41.png").write_bytes((tmp_path / "40.png").read_bytes()[:300])  # header fine, pixels truncated
    mid = capeval_plugins.load("mid", model=tiny_clip, batch_size=16)
    with pytest.warns(UserWarning, match=r"mid: fit_reference left out 2 of 60 samples \(sample 7: .*; sample 41: "
                                         r".*\): the Gaussian is fitted on the other 58"):
        sums = mid.fit_reference(paths, references, save_to=str(tmp_path / "fit.npz"), on_error="skip")
    assert sorted(sums.skipped) == list(bad)
    assert "cannot read image" in sums.skipped[41]
    good = [i for i in range(n) if i not in bad]
    alone = mid.fit_reference([paths[i] for i in good], [references[i] for i in good])
    assert alone.skipped == {}
    for key in ("count", "sum", "outer"):
        assert torch.allclose(sums[key], alone[key], rtol=1e-10, atol=1e-10), key
    saved = sums_from_bytes((tmp_path / "fit.npz").read_bytes())
    assert saved.metadata["n_skipped"] == 2
    with pytest.raises(InputError, match="sample 7"):  # the default policy refuses, naming the sample
        mid.fit_reference(paths, references)
