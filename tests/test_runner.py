"""The runner: validation before any model loads, several metrics in one pass, skip policy, checkpoints and
resume, and the adapters that go through it (torchmetrics, evaluate, pycocoevalcap)."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from conftest import CAPTIONS, REFERENCES, has_java, random_image

import capeval_plugins
from capeval_plugins import runner
from capeval_plugins.checkpoint import RunStore, decode_records, encode_record
from capeval_plugins.contract import MetricResult
from capeval_plugins.resources import loading
from capeval_plugins.inputs import InputError

N = 40


@pytest.fixture
def corpus():
    """N samples over N // 2 distinct images (two captions each), distinct references."""
    images = [random_image(i // 2, size=(30 + (i // 2) % 5, 28)) for i in range(N)]
    images = [images[2 * (i // 2)] for i in range(N)]  # the same object for an image's two captions
    captions = [f"{CAPTIONS[i % 4]} ({i})" for i in range(N)]
    references = [[f"{r} ({i // 2})" for r in REFERENCES[i % 4]] for i in range(N)]
    return images, captions, references


def count_loads(monkeypatch):
    calls = []
    original = loading.load_model

    def counting(loader, name, **kwargs):
        calls.append(name)
        return original(loader, name, **kwargs)

    monkeypatch.setattr(loading, "load_model", counting)
    loading.clear_cache()
    return calls


def test_two_metrics_in_one_pass_equal_single_runs_and_load_the_backbone_once(tiny_clip, corpus, monkeypatch):
    images, captions, references = corpus
    calls = count_loads(monkeypatch)
    metrics = {"clipscore": capeval_plugins.load("clipscore", model=tiny_clip, batch_size=6),
               "mid": capeval_plugins.load("mid", model=tiny_clip, batch_size=16)}
    together = runner.score_many(metrics, images, captions, references)
    assert calls == [tiny_clip]  # one CLIP for both
    for name, metric in metrics.items():
        alone = metric(images, captions, references)
        assert torch.equal(together[name].scores, alone.scores), name  # same batches: the same bits
        assert together[name].score == alone.score


def test_validation_reports_every_problem_before_any_model_loads(tiny_clip, corpus, monkeypatch):
    images, captions, references = corpus
    images = list(images)
    images[7] = "/no/such/image.png"
    captions = list(captions)
    captions[30] = None
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    metric = capeval_plugins.load("clipscore", model=tiny_clip)
    with pytest.raises(InputError) as err:
        runner.run({"clipscore": metric}, runner.Corpus(captions, images, references, ids=list(range(1000, 1000 + N))))
    assert "sample 1007: image file not found" in str(err.value) and "sample 1030: caption missing" in str(err.value)


def test_skip_keeps_every_other_score_identical_to_a_run_without_the_bad_samples(tiny_clip, corpus, tmp_path):
    images, captions, references = corpus
    bad_file = tmp_path / "bad.png"
    bad_file.write_bytes(b"not an image")
    images, captions, references = list(images), list(captions), [list(r) for r in references]
    images[3] = str(bad_file)
    references[11] = []
    # CLIPScore reads no references (an empty list is not its fault); MID fits on them
    for name, bad in (("clipscore", (3,)), ("mid", (3, 11))):
        keep = [i for i in range(N) if i not in bad]
        metric = capeval_plugins.load(name, model=tiny_clip, batch_size=8)
        skipped = metric(images, captions, references, on_error="skip")
        without = metric([images[i] for i in keep], [captions[i] for i in keep], [references[i] for i in keep], ids=keep)
        assert skipped.indices.tolist() == list(range(N))
        assert torch.equal(skipped.scores[keep], without.scores), name
        assert all(math.isnan(skipped.scores[i]) for i in bad) and not skipped.scores[keep].isnan().any()
        assert skipped.score == without.score and skipped.corpus_extras["n_skipped"] == len(bad)
        assert "cannot read image" in skipped.skipped[3]
        assert skipped.skipped.get(11) == ("empty list of references" if 11 in bad else None)
        with pytest.raises(InputError, match="2 samples cannot be scored" if len(bad) == 2 else "sample 3: cannot read"):
            metric(images, captions, references)


@pytest.mark.parametrize("pil_lenient", [False, True], ids=["pil-default", "pil-told-to-load-truncated-images"])
def test_an_image_that_fails_to_decode_mid_run_is_skipped_or_named(tiny_clip, corpus, tmp_path, monkeypatch,
                                                                   pil_lenient):
    from PIL import Image, ImageFile

    # another library may have told PIL to fill truncated files with grey (polos does, on import): still refused
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", pil_lenient)

    images, captions, _ = corpus
    good = tmp_path / "good.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(good)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.read_bytes()[:300])  # its header passes validation; its pixels do not decode
    images = list(images)
    images[9] = str(truncated)
    metric = capeval_plugins.load("clipscore", model=tiny_clip, batch_size=4)
    with pytest.raises(InputError, match="sample 9: cannot read image .*truncated.png"):
        metric(images, captions)
    result = metric(images, captions, on_error="skip")
    keep = [i for i in range(N) if i != 9]
    assert math.isnan(result.scores[9]) and "cannot read image" in result.skipped[9]
    assert result.scores[keep].tolist() == pytest.approx(metric([images[i] for i in keep], [captions[i] for i in keep],
                                                                ids=keep).scores.tolist(), abs=1e-6)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is pil_lenient  # the caller's setting is left as it was


class StopAfter:
    """A stop flag that rises after ``n`` batches of the run have been scored."""

    def __init__(self, n):
        self.n, self.seen = n, 0

    def __call__(self):
        self.seen += 1
        return self.seen >= self.n


def _records(run_dir, log):
    store = RunStore(run_dir)
    store.attach(store.current_run())
    return decode_records(log.read_bytes(), store.key)[0]


def test_an_interrupted_run_resumes_to_the_same_bits_and_scores_only_the_rest(tiny_clip, corpus, tmp_path, monkeypatch):
    images, captions, references = corpus
    metrics = lambda: {"clipscore": capeval_plugins.load("clipscore", model=tiny_clip, batch_size=4),  # noqa: E731
                       "mid": capeval_plugins.load("mid", model=tiny_clip, batch_size=8)}
    data = runner.Corpus(captions, images, references)
    whole = runner.run(metrics(), data).results
    mapped = []
    for name in ("clipscore", "mid"):
        cls = type(metrics()[name])
        original = cls.map
        monkeypatch.setattr(cls, "map", lambda self, batch, _o=original, _n=name: mapped.append(_n) or _o(self, batch))
    run_dir = tmp_path / "run"
    with pytest.raises(runner.Interrupted, match="interrupted after 6 of 15 batches"):
        runner.run(metrics(), data, run_dir=run_dir, stop=StopAfter(6))
    assert len(mapped) == 6
    # a torn last record (a crash mid-write) is dropped and its batch scored again
    log = run_dir / "rank-0-of-1" / "clipscore.log"
    n_records = len(_records(run_dir, log))
    with open(log, "ab") as f:  # the first half of a record as a crash mid-append leaves it
        f.write(encode_record({"batch": 99}, {}, b"k" * 32)[:30])
    mapped.clear()
    outcome = runner.run(metrics(), data, run_dir=run_dir)
    assert outcome.batches_resumed == 6 and outcome.batches_scored == 9 and len(mapped) == 9
    assert n_records < 10
    for name, result in outcome.results.items():
        assert torch.equal(result.scores, whole[name].scores), name
        assert result.extras.keys() == whole[name].extras.keys()
        assert all(torch.equal(result.extras[k], whole[name].extras[k]) for k in result.extras)
        assert result.corpus_extras == whole[name].corpus_extras


def test_a_resumed_run_prepares_the_whole_corpus_as_an_uninterrupted_one(corpus, tmp_path, monkeypatch):
    """What a metric prepares for the pass (BERTScore: every text embedded in chunks, longest first) must not
    depend on how far an interrupted run got: the resumed run's ``prepare_corpus`` sees the same samples."""
    from capeval_plugins.metrics.coco import CocoMetric

    images, captions, references = corpus
    prepared = []
    monkeypatch.setattr(CocoMetric, "prepare_corpus", lambda self, batch: prepared.append(list(batch.candidates)),
                        raising=False)
    metric = lambda: {"bleu1": capeval_plugins.load("bleu1", batch_size=8, tokenize=False)}  # noqa: E731
    data = runner.Corpus(captions, None, references)
    runner.run(metric(), data)
    with pytest.raises(runner.Interrupted):
        runner.run(metric(), data, run_dir=tmp_path / "run", stop=StopAfter(2))
    runner.run(metric(), data, run_dir=tmp_path / "run")
    assert len(prepared) == 3 and prepared[0] == prepared[1] == prepared[2]


def test_a_run_folder_of_another_run_is_refused(tiny_clip, corpus, tmp_path):
    images, captions, references = corpus
    data = runner.Corpus(captions, images, references)
    metric = capeval_plugins.load("clipscore", model=tiny_clip, batch_size=4)
    with pytest.raises(runner.Interrupted):
        runner.run({"clipscore": metric}, data, run_dir=tmp_path / "run", stop=StopAfter(1))
    other = capeval_plugins.load("clipscore", model=tiny_clip, batch_size=4, w=1.0)
    with pytest.raises(InputError, match="clipscore options w"):
        runner.run({"clipscore": other}, data, run_dir=tmp_path / "run")
    changed = runner.Corpus(captions[:-1] + ["another caption"], images, references)
    with pytest.raises(InputError, match="inputs differ"):
        runner.run({"clipscore": metric}, changed, run_dir=tmp_path / "run")
    assert runner.run({"clipscore": other}, data, run_dir=tmp_path / "run", restart=True).batches_resumed == 0


def test_a_run_folder_whose_batches_were_cut_otherwise_is_refused_not_resumed(corpus, tmp_path, monkeypatch):
    """A run folder made before batches ended at image boundaries holds batches of another plan: refused with
    the word to restart, never resumed against the new plan."""
    images, captions, references = corpus
    data = runner.Corpus(captions, None, references)
    metric = lambda: {"bleu1": capeval_plugins.load("bleu1", batch_size=8, tokenize=False)}  # noqa: E731
    with monkeypatch.context() as patch:
        patch.setattr(runner, "BATCH_PLAN", "fixed-size")
        with pytest.raises(runner.Interrupted):
            runner.run(metric(), data, run_dir=tmp_path / "run", stop=StopAfter(1))
    with pytest.raises(InputError, match="batches differ"):
        runner.run(metric(), data, run_dir=tmp_path / "run")
    assert runner.run(metric(), data, run_dir=tmp_path / "run", restart=True).batches_resumed == 0


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shards_cut_at_the_image_boundary_nearest_an_even_split(world):
    from capeval_plugins.inputs import group_by_image, prepare_samples
    from capeval_plugins.metrics.clipscore import CLIPScore

    rng = np.random.default_rng(world)
    distinct = [np.full((2, 2, 3), k, dtype=np.uint8) for k in range(15)]
    owner = np.repeat(np.arange(15), rng.integers(1, 8, 15))
    rng.shuffle(owner)
    samples = prepare_samples(CLIPScore.info, [distinct[k] for k in owner], [f"c{i}" for i in range(len(owner))])
    shards = [runner._shard(samples, rank, world) for rank in range(world)]
    assert [i for s in shards for i in s.indices] == [samples.indices[p] for p in group_by_image(samples)]
    keys = [{src.key for src in s.images} for s in shards]
    assert all(not (a & b) for i, a in enumerate(keys) for b in keys[i + 1:])  # no image on two ranks
    largest = max(np.bincount(owner))
    for rank, shard in enumerate(shards):  # each within an image of an even split
        assert abs(len(shard) - len(samples) / world) <= largest + 1


def test_with_skipped_puts_samples_back_in_order():
    result = MetricResult("m", 0.5, torch.tensor([0.1, 0.3], dtype=torch.float64), torch.tensor([0, 2]),
                          extras={"k": torch.tensor([1, 3])}, corpus_extras={"x": 1.0})
    full = result.with_skipped({1: "bad", 3: "worse"})
    assert full.indices.tolist() == [0, 1, 2, 3]
    assert [None if math.isnan(v) else v for v in full.scores.tolist()] == [0.1, None, 0.3, None]
    assert full.extras["k"].dtype == torch.float64 and math.isnan(full.extras["k"][1])
    assert full.corpus_extras == {"x": 1.0, "n_skipped": 2.0} and full.score == 0.5
    rows = full.rows()
    assert rows[1]["error"] == "bad" and "error" not in rows[0]
    assert full.to_dict()["skipped"] == {1: "bad", 3: "worse"}


def test_options_are_typed_and_routed():
    from capeval_plugins import options, registry

    classes = {n: registry.get(n).cls for n in ("clipscore", "bleu4", "mid")}
    routed = options.route(classes, {"model": "m", "batch_size": "3"}, {"mid": {"covariance_eps": "1e-3",
                                                                               "reference_gaussian": "none"}},
                           parse=True)
    assert routed["clipscore"] == {"model": "m", "batch_size": 3} and routed["bleu4"] == {"batch_size": 3}
    assert routed["mid"] == {"model": "m", "batch_size": 3, "covariance_eps": 1e-3, "reference_gaussian": None}
    with pytest.raises(options.OptionError, match="clipscore: option w expects a float, got 'abc'"):
        options.route(classes, {"w": "abc"}, {}, parse=True)
    with pytest.raises(options.OptionError, match="no selected metric takes option 'w'"):
        options.route({"bleu4": classes["bleu4"]}, {"w": "2"}, {}, parse=True)
    assert options.route(classes, {}, {"clipscore": {"prefix_references": "false"}},
                         parse=True)["clipscore"] == {"prefix_references": False}


# ---------------------------------------------------------------------------------------------------------
# The adapters through the runner


def test_torchmetrics_errors_name_the_ids_before_any_model_loads(tiny_clip, corpus, monkeypatch, tmp_path):
    from capeval_plugins.torchmetrics import CLIPScore

    images, captions, _ = corpus
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG not really")
    metric = CLIPScore(model=tiny_clip)
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    batch = list(images[:4])
    batch[0], batch[2] = str(corrupt), "/missing.png"
    with pytest.raises(InputError) as err:
        metric.update(batch, captions[:4], ids=[250, 251, 252, 253])
    assert "sample 250: cannot read image" in str(err.value) and "sample 252: image file not found" in str(err.value)


def test_torchmetrics_without_ids_under_ddp_warns_once_and_refuses_per_sample_rows(tiny_clip, corpus, monkeypatch):
    from capeval_plugins.adapters import torchmetrics as tm_adapter
    from capeval_plugins.core import messages
    from capeval_plugins.torchmetrics import CLIPScore

    images, captions, _ = corpus
    monkeypatch.setattr(tm_adapter, "_world", lambda: (0, 2))
    monkeypatch.setattr(messages, "_warned", set())
    metric = CLIPScore(model=tiny_clip, on_error="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metric.update(images[:2], captions[:2])
        metric.update(images[2:4], ["", captions[3]])
    said = [str(w.message) for w in caught if "without ids" in str(w.message)]
    assert len(said) == 1 and "pass ids=" in said[0]
    assert not math.isnan(float(metric.compute()))  # the corpus score stands
    with pytest.raises(ValueError, match="per-sample results under torch.distributed need ids="):
        metric.compute_all()  # rows filed under guessed ids would be wrong for a shuffled sampler


def test_evaluate_names_a_non_string_prediction(tiny_clip, images):
    import evaluate

    metric = evaluate.load("clipscore", model=tiny_clip)
    with pytest.raises(InputError, match="sample 2: caption must be a string, got int"):
        metric.compute(images=images[:3], predictions=["a", "b", 7])
    metric.add_batch(images=images[:2], predictions=["a", "b"])
    with pytest.raises(InputError, match="sample 3: caption missing"):
        metric.add_batch(images=images[2:], predictions=["c", None])


@pytest.mark.java
@pytest.mark.skipif(not has_java(), reason="pycocoevalcap's PTB tokenizer needs Java")
def test_cocoevalcap_mixes_image_and_text_metrics_and_says_when_spice_cannot_run(tiny_clip, tmp_path, monkeypatch):
    from pycocotools.coco import COCO
    from test_pycocoevalcap_adapter import coco_files

    from capeval_plugins.adapters import pycocoevalcap as adapter
    from capeval_plugins.core import messages
    from capeval_plugins.pycocoevalcap import COCOEvalCap, ImageResolver

    gt, res, files, captions = coco_files(tmp_path)
    coco = COCO(str(gt))
    coco_res = coco.loadRes(str(res))
    resolver = ImageResolver.from_coco(tmp_path, coco)
    for name in files.values():
        random_image(len(name)).save(tmp_path / name)
    monkeypatch.setattr(adapter, "spice_available", lambda: False)
    monkeypatch.setattr(messages, "_warned", set())
    with pytest.warns(UserWarning, match="SPICE was not run"):
        ours = COCOEvalCap(coco, coco_res, metrics={"clipscore": {"w": 1.0}, "bleu4": {"tokenize": False}},
                           resolver=resolver, model=tiny_clip)
        ours.evaluate()
    assert math.isnan(ours.eval["SPICE"]) and "CoreNLP" in ours.unavailable["SPICE"]
    stock = COCOEvalCap(coco, coco_res, spice=False)  # the stock scorers alone
    stock.evaluate()
    assert ours.eval["Bleu_4"] == pytest.approx(stock.eval["Bleu_4"], abs=1e-9)  # ours, under stock's key, agrees
    ids = list(coco.getImgIds())
    direct = capeval_plugins.load("clipscore", model=tiny_clip, w=1.0)(
        [tmp_path / files[i] for i in ids], [captions[i] for i in ids],
        [[a["caption"] for a in coco.imgToAnns[i]] for i in ids])
    assert ours.eval["CLIPScore"] == pytest.approx(direct.score, abs=1e-6)
    with pytest.raises(InputError, match="no selected metric takes option 'w'"):
        COCOEvalCap(coco, coco_res, metrics=["bleu4"], w=1.0)
