"""torchmetrics' wrappers and collections around capeval metrics: Running gives the window's value (the metric on
the window's samples alone, through ``capeval_plugins.load``), a MetricCollection holds PAC-S beside PAC-S++ (each
its own class name), MinMaxMetric, MultitaskWrapper and metric arithmetic behave as with torchmetrics' own
metrics, and the wrappers that cannot hold a capeval metric (BootStrapper, ClasswiseWrapper) refuse in one line."""
from __future__ import annotations

import pytest
import torch
from conftest import random_image

import capeval_plugins

torchmetrics = pytest.importorskip("torchmetrics")
from torchmetrics import MetricCollection  # noqa: E402
from torchmetrics.wrappers import BootStrapper, ClasswiseWrapper, MinMaxMetric, MultitaskWrapper, Running  # noqa: E402

from capeval_plugins.torchmetrics import BLEU4, CIDEr, CLIPScore  # noqa: E402

CAPTIONS = ["a dog runs on the grass", "a cat sits on a mat", "two men play ball", "a red car on a road",
            "a dog lies on the grass", "three birds fly over a lake"]
REFERENCES = [["a dog is running on grass", "the dog runs"], ["a cat on a mat"], ["two men playing with a ball"],
              ["a car that is red", "a red car"], ["a dog lying in the grass"], ["birds flying above the water"]]
BATCHES = [(0, 2), (2, 4), (4, 6)]


def text_metric_on(rows):
    return capeval_plugins.load("cider", tokenize=False)(None, [CAPTIONS[i] for i in rows],
                                                           [REFERENCES[i] for i in rows]).score


@pytest.mark.parametrize("step", ["forward", "update"])
def test_running_cider_is_cider_of_the_window(step):
    """CIDEr's idf runs over the window's references: the window's value is CIDEr of its samples alone."""
    metric = Running(CIDEr(tokenize=False), window=2)
    for a, b in BATCHES:
        getattr(metric, step if step == "update" else "__call__")(None, CAPTIONS[a:b], REFERENCES[a:b])
    window = metric.compute()
    assert not torch.isnan(window)
    assert window.item() == pytest.approx(text_metric_on(range(2, 6)), abs=1e-12)
    assert window.item() != pytest.approx(text_metric_on(range(6)), abs=1e-3)  # not the whole history


def test_running_clipscore_is_the_mean_of_the_window(tiny_clip):
    images = [random_image(i, size=(30 + i, 28)) for i in range(6)]
    metric = Running(CLIPScore(model=tiny_clip), window=2)
    for a, b in BATCHES:
        metric(images[a:b], CAPTIONS[a:b])
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(images[2:], CAPTIONS[2:])
    assert metric.compute().item() == pytest.approx(direct.score, abs=1e-6)
    inner = metric.base_metric
    metric.reset()  # and again after a reset, with ids
    for a, b in BATCHES[:2]:
        metric.update(images[a:b], CAPTIONS[a:b], ids=list(range(a, b)))
    assert metric.compute().item() == pytest.approx(capeval_plugins.load("clipscore", model=tiny_clip)(
        images[:4], CAPTIONS[:4]).score, abs=1e-6)
    assert inner.update_count == 0  # Running resets its metric after each update


def test_a_collection_holds_variants_that_share_a_display_name(tiny_root):
    """PAC-S and PAC-S++ (and RefPAC-S, RefPAC-S++) once were all "PACS"/"RefPACS": a MetricCollection refused them
    ("two metrics both named PACS"). Each has its own class name, also in pycocoevalcap and in dir()."""
    import capeval_plugins.pycocoevalcap as coco
    import capeval_plugins.torchmetrics as tm
    from capeval_plugins.testing import tiny_checkpoint

    pacs, pp = str(tiny_checkpoint("pacs", root=tiny_root)), str(tiny_checkpoint("pacs_pp", root=tiny_root))
    collection = MetricCollection([tm.PACS(model=pacs), tm.PACSPlusPlus(model=pp), tm.RefPACS(model=pacs),
                                   tm.RefPACSPlusPlus(model=pp)])
    assert sorted(collection.keys()) == ["PACS", "PACSPlusPlus", "RefPACS", "RefPACSPlusPlus"]
    images = [random_image(i, size=(30 + i, 28)) for i in range(4)]
    collection.update(images, CAPTIONS[:4], REFERENCES[:4])
    values = collection.compute()
    for key, name, folder in (("PACS", "pacscore", pacs), ("PACSPlusPlus", "pacscore_pp", pp),
                              ("RefPACSPlusPlus", "refpacscore_pp", pp)):
        direct = capeval_plugins.load(name, model=folder)(images, CAPTIONS[:4], REFERENCES[:4])
        assert values[key].item() == pytest.approx(direct.score, abs=1e-6), key
    names = [n for n in dir(tm) if n.startswith(("PACS", "RefPACS"))]
    assert names == ["PACS", "PACSPlusPlus", "RefPACS", "RefPACSPlusPlus"]
    assert [getattr(coco, n)._capeval_name for n in ("PacS", "PacSPlusPlus", "RefPacS", "RefPacSPlusPlus")] == \
        ["pacscore", "pacscore_pp", "refpacscore", "refpacscore_pp"]


def test_a_collection_of_text_metrics_shares_states_and_gives_each_its_own_score():
    """torchmetrics merges metrics whose states are equal into one compute group (the classic metrics keep the same
    texts): each still finalizes its own score."""
    collection = MetricCollection([CIDEr(tokenize=False), BLEU4(tokenize=False)])
    for a, b in BATCHES:
        collection(None, CAPTIONS[a:b], REFERENCES[a:b])
    values = collection.compute()
    assert values["CIDEr"].item() == pytest.approx(text_metric_on(range(6)), abs=1e-12)
    bleu = capeval_plugins.load("bleu4", tokenize=False)(None, CAPTIONS, REFERENCES).score
    assert values["BLEU4"].item() == pytest.approx(bleu, abs=1e-12)
    collection.reset()
    collection.update(None, CAPTIONS[:4], REFERENCES[:4])
    assert collection.compute()["CIDEr"].item() == pytest.approx(text_metric_on(range(4)), abs=1e-12)


def test_min_max_multitask_and_arithmetic_behave_as_with_torchmetrics_own_metrics():
    minmax = MinMaxMetric(CIDEr(tokenize=False))
    steps = [minmax(None, CAPTIONS[a:b], REFERENCES[a:b])["raw"].item() for a, b in BATCHES]
    per_batch = [text_metric_on(range(a, b)) for a, b in BATCHES]
    assert steps == pytest.approx(per_batch, abs=1e-12)
    last = minmax.compute()
    assert last["max"].item() == pytest.approx(max(per_batch)) and last["min"].item() == pytest.approx(min(per_batch))
    summed = CIDEr(tokenize=False) + BLEU4(tokenize=False)
    summed.update(None, CAPTIONS, REFERENCES)
    bleu = capeval_plugins.load("bleu4", tokenize=False)(None, CAPTIONS, REFERENCES).score
    assert summed.compute().item() == pytest.approx(text_metric_on(range(6)) + bleu, abs=1e-12)


def test_multitask_passes_images_and_captions(tiny_clip):
    images = [random_image(i, size=(30 + i, 28)) for i in range(4)]
    tasks = MultitaskWrapper({"captioning": CLIPScore(model=tiny_clip)})
    tasks.update({"captioning": images}, {"captioning": CAPTIONS[:4]})
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(images, CAPTIONS[:4])
    assert tasks.compute()["captioning"].item() == pytest.approx(direct.score, abs=1e-6)


def test_bootstrapper_and_classwise_wrapper_refuse_in_one_line():
    with pytest.raises(TypeError, match=r"^CIDEr: torchmetrics' BootStrapper cannot wrap a capeval metric: it "
                                        r"resamples tensor inputs only") as err:
        BootStrapper(CIDEr(tokenize=False), num_bootstraps=3)
    assert "\n" not in str(err.value)
    wrapped = ClasswiseWrapper(CIDEr(tokenize=False))
    wrapped.update(None, CAPTIONS, REFERENCES)
    with pytest.raises(TypeError, match=r"^CIDEr: torchmetrics' ClasswiseWrapper cannot wrap a capeval metric"):
        wrapped.compute()
    metric = CIDEr(tokenize=False)  # a metric's own copies are unaffected
    metric.update(None, CAPTIONS, REFERENCES)
    assert metric.clone().compute().item() == pytest.approx(text_metric_on(range(6)), abs=1e-12)
