"""torchmetrics: states from the contract, ids, forward, dtype, plot, Lightning validation (DDP: test_ddp.py)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import CAPTIONS, REFERENCES, random_image

import capeval_plugins
from capeval_plugins.torchmetrics import CLIPScore, RefCLIPScore


def test_batches_equal_one_call(tiny_clip, images):
    direct = capeval_plugins.load("clipscore", model=tiny_clip, reference_extras=True)(images, CAPTIONS, REFERENCES)
    metric = CLIPScore(model=tiny_clip, reference_extras=True)
    metric.update(images[:1], CAPTIONS[:1], REFERENCES[:1])
    metric.update(images[1:], CAPTIONS[1:], REFERENCES[1:])
    value = metric.compute()
    assert value.ndim == 0 and value.item() == pytest.approx(direct.score, abs=1e-6)
    result = metric.compute_all()
    assert result.scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-6)
    assert result.extras["refclipscore"].tolist() == pytest.approx(direct.extras["refclipscore"].tolist(), abs=1e-6)
    metric.reset()
    metric.update(images[:2], CAPTIONS[:2])
    assert len(metric.compute_all()) == 2


def test_backbone_outside_module_tree_and_shared(tiny_clip):
    a = CLIPScore(model=tiny_clip)
    b = RefCLIPScore(model=tiny_clip)
    assert list(a.state_dict()) == [] and list(a.parameters()) == []
    assert a.capeval_metric.encoder.model is b.capeval_metric.encoder.model
    clone = a.clone()
    assert clone.capeval_metric is a.capeval_metric
    assert copy.deepcopy(a).capeval_metric is a.capeval_metric


def test_ids_restore_order_and_a_repeat_in_one_process_is_refused(tiny_clip, images):
    from capeval_plugins.inputs import InputError

    direct = capeval_plugins.load("clipscore", model=tiny_clip)(images, CAPTIONS)
    metric = CLIPScore(model=tiny_clip)
    metric.update([images[3], images[1]], [CAPTIONS[3], CAPTIONS[1]], ids=[3, 1])
    with pytest.raises(InputError, match=r"sample id\(s\) 3 already given in an earlier update"):
        metric.update([images[0], images[2], images[3]], [CAPTIONS[0], CAPTIONS[2], CAPTIONS[3]], ids=[0, 2, 3])
    metric.update([images[0], images[2]], [CAPTIONS[0], CAPTIONS[2]], ids=[0, 2])
    result = metric.compute_all()
    assert result.indices.tolist() == [0, 1, 2, 3]
    assert result.scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-6)
    assert "n_repeats_dropped" not in result.corpus_extras
    metric.reset()  # a new epoch may give the same ids again
    metric.update([images[3]], [CAPTIONS[3]], ids=[3])
    assert metric.compute_all().indices.tolist() == [3]


def test_repeated_ids_within_one_update_are_refused_naming_them(tiny_clip, images):
    from capeval_plugins.inputs import InputError

    metric = CLIPScore(model=tiny_clip)
    with pytest.raises(InputError, match=r"unique: 0 at positions 0, 1"):
        metric.update(images[:3], CAPTIONS[:3], ids=[0, 0, 1])




def test_forward_without_ids_gives_what_update_gives_epoch_after_epoch(tiny_clip, images):
    """The torchmetrics habit: ``value = metric(batch)`` at every step, ``compute()`` and ``reset()`` at the end
    of each epoch; no ids. Each step returns the batch's own score, compute() the corpus's, as update() would."""
    load = lambda: capeval_plugins.load("clipscore", model=tiny_clip)  # noqa: E731
    direct = load()(images, CAPTIONS, REFERENCES)
    metric = CLIPScore(model=tiny_clip)
    for _ in range(2):
        steps = [metric(images[i:i + 2], CAPTIONS[i:i + 2], REFERENCES[i:i + 2]) for i in (0, 2)]
        for i, step in zip((0, 2), steps):
            alone = load()(images[i:i + 2], CAPTIONS[i:i + 2], REFERENCES[i:i + 2])
            assert step.item() == pytest.approx(alone.score, abs=1e-6)
        assert metric.compute().item() == pytest.approx(direct.score, abs=1e-6)
        result = metric.compute_all()
        assert result.indices.tolist() == [0, 1, 2, 3]
        assert result.scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-6)
        metric.reset()


def test_set_dtype_casts_scores_never_ids(tiny_clip, images):
    """float16 holds integers exactly only up to 2048: ids above it would collide if they were cast."""
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(images, CAPTIONS)
    metric = CLIPScore(model=tiny_clip)
    metric.update(images[:2], CAPTIONS[:2], ids=[4097, 4098])
    metric.set_dtype(torch.float16)
    metric.update(images[2:], CAPTIONS[2:], ids=[4099, 4100])
    assert all(v.dtype == torch.int64 for v in metric.index)
    result = metric.compute_all()
    assert result.indices.tolist() == [4097, 4098, 4099, 4100]
    assert result.scores.tolist() == pytest.approx(direct.scores.tolist(), abs=5e-3)  # float16 scores


def test_plot_draws_within_the_score_range_as_torchmetrics_metrics_do(tiny_clip, images):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    metric = CLIPScore(model=tiny_clip)
    assert (CLIPScore.plot_lower_bound, CLIPScore.plot_upper_bound) == (0.0, 2.5)  # MetricInfo.score_range
    values = [metric(images[i:i + 2], CAPTIONS[i:i + 2]) for i in (0, 2)]
    fig, ax = metric.plot(values)
    low, high = ax.get_ylim()
    assert low < 0.0 and high > 2.5  # the bounds with torchmetrics' margin
    assert [float(y) for y in ax.get_lines()[0].get_ydata()] == pytest.approx([v.item() for v in values])
    fig, ax = metric.plot()  # compute()'s value
    assert float(ax.get_lines()[0].get_ydata()[0]) == pytest.approx(metric.compute().item())
    import matplotlib.pyplot as plt

    plt.close("all")


N = 7
def _corpus():
    images = [random_image(i % 4, size=(30 + 2 * i, 32)) for i in range(N)]
    captions = [CAPTIONS[i % 4] + f" ({i})" for i in range(N)]
    references = [REFERENCES[i % 4] for i in range(N)]
    return images, captions, references


def _lightning_validate(tiny_clip, tmp_path, epochs=1):
    """A real ``Trainer.validate`` over a shuffled loader, ``epochs`` times; the module logs CLIPScore and keeps
    ``compute_all()`` at each epoch end. Returns the module, what was logged, and the direct result."""
    lightning = pytest.importorskip("lightning")

    images, captions, references = _corpus()
    tensors = [torch.from_numpy(np.array(img)).permute(2, 0, 1) for img in images]

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            return {"image": tensors[i], "caption": captions[i], "id": i}

    def collate(rows):
        return {"images": [r["image"] for r in rows], "captions": [r["caption"] for r in rows],
                "ids": [r["id"] for r in rows]}

    class Captioner(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.clip_s = CLIPScore(model=tiny_clip, batch_size=4)
            self.epoch_results = []

        def validation_step(self, batch, batch_idx):
            self.clip_s.update(batch["images"], batch["captions"], ids=batch["ids"])
            self.log("val/clipscore", self.clip_s, on_epoch=True, batch_size=len(batch["ids"]))

        def on_validation_epoch_end(self):
            self.epoch_results.append(self.clip_s.compute_all())

    trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    loader = torch.utils.data.DataLoader(Data(), batch_size=3, collate_fn=collate, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    module = Captioner()
    logged = [trainer.validate(module, dataloaders=loader, verbose=False)[0] for _ in range(epochs)]
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(tensors, captions)
    return module, logged, direct


def test_lightning_validation_logs_the_corpus_score(tiny_clip, tmp_path):
    _, logged, direct = _lightning_validate(tiny_clip, tmp_path)
    assert logged[0]["val/clipscore"] == pytest.approx(direct.score, abs=1e-5)


def test_per_sample_scores_of_a_lightning_validation_are_kept_after_it(tiny_clip, tmp_path):
    """Lightning computes a logged metric at the epoch's end and resets it at once: the result computed then is
    what ``compute_all()`` (and ``last_result``) give after ``Trainer.validate``, per sample in id order, and
    what ``compute_all()`` gives in ``on_validation_epoch_end``; a new epoch's replaces it."""
    module, logged, direct = _lightning_validate(tiny_clip, tmp_path, epochs=2)
    metric = module.clip_s
    assert metric.update_count == 0  # reset by Lightning
    for result in (metric.compute_all(), metric.last_result, *module.epoch_results):
        assert result.indices.tolist() == list(range(N))
        assert result.scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-5)
        assert result.score == pytest.approx(logged[-1]["val/clipscore"], abs=1e-6)  # logged as float32
    assert metric.compute_all() is module.epoch_results[-1] is not module.epoch_results[0]
    metric.update(_corpus()[0][:2], _corpus()[1][:2], ids=[0, 1])  # a new update: the state, not the kept result
    assert len(metric.compute_all()) == 2


def test_a_padding_repeat_in_a_metric_of_summed_statistics_is_refused_not_counted(tiny_clip):
    """A DistributedSampler's padding repeats a sample on another rank. Per-sample rows drop it, but MID's summed
    fit statistics counted it twice, and the number came with a warning only (3 ranks, 40 samples: per-sample PMI
    off by up to 3.2). The two ranks' states are merged here as the adapter merges them after its gather."""
    from test_mid import corpus as mid_corpus

    from capeval_plugins.contract import RepeatedSamples, finalize_state, full_spec, map_batch, merge_states
    from capeval_plugins.inputs import to_batch, validate_samples

    images, candidates, references = mid_corpus()
    metric = capeval_plugins.load("mid", model=tiny_clip)
    rows = list(range(len(candidates)))
    parts = [map_batch(metric, to_batch(validate_samples(metric.info, [images[i] for i in share],
                                                         [candidates[i] for i in share],
                                                         [references[i] for i in share], indices=share)[0]))
             for share in (rows, [0])]  # rank 1 repeats sample 0
    merged = merge_states(full_spec(metric), parts)
    with pytest.raises(RepeatedSamples, match="summed statistics count them"):
        finalize_state(metric, merged, allowed_repeats=1)
    assert finalize_state(metric, merge_states(full_spec(metric), parts[:1]), allowed_repeats=1).scores.numel() == 40


# ---------------------------------------------------------------------------------------------------------
# Sequences a long training session makes: each number equals a direct call on the same samples

SESSION_CAPTIONS = ["a dog runs on the grass", "two cats sleep", "a red car on a road", "a man rides a bike",
                    "children play in a park", "a bird on a branch"]
SESSION_REFS = [["a dog running on grass"], ["two cats sleeping"], ["a red car parked on a road"],
                ["a man riding a bicycle"], ["kids playing in a park"], ["a small bird sits on a branch"]]
BATCHES = [[0, 1], [2, 3], [4, 5]]


def _direct(name: str, rows=range(6)):
    rows = list(rows)
    return capeval_plugins.load(name, tokenize=False)(None, [SESSION_CAPTIONS[i] for i in rows],
                                                      [SESSION_REFS[i] for i in rows])


def _batch(rows):
    return None, [SESSION_CAPTIONS[i] for i in rows], [SESSION_REFS[i] for i in rows]


def test_a_collection_forward_after_update_epochs_counts_each_sample_once():
    """Compute groups share list states: appending in place added every sample to the other members too."""
    from torchmetrics import MetricCollection

    from capeval_plugins.torchmetrics import BLEU4, CIDEr

    collection = MetricCollection({"cider": CIDEr(tokenize=False), "bleu": BLEU4(tokenize=False)})
    for rows in BATCHES + BATCHES:  # an epoch of update(), twice over (new ids each time)
        collection.update(*_batch(rows))
    collection.reset()
    for rows in BATCHES:  # then an epoch of forward(), as a training_step logs
        collection(*_batch(rows))
    got = collection.compute()
    assert float(got["cider"]) == pytest.approx(_direct("cider").score, abs=1e-12)
    assert float(got["bleu"]) == pytest.approx(_direct("bleu4").score, abs=1e-12)
    assert len(collection["cider"].compute_all().scores) == 6


def test_merge_state_is_seen_by_compute_and_compute_all():
    from capeval_plugins.torchmetrics import CIDEr

    first, second = CIDEr(tokenize=False), CIDEr(tokenize=False)
    first.update(*_batch([0, 1, 2]))
    first.compute()
    second.update(*_batch([3, 4, 5]), ids=[3, 4, 5])
    first.merge_state(second)  # compute() kept the value of the first half
    assert float(first.compute()) == pytest.approx(_direct("cider").score, abs=1e-12)
    last = CIDEr(tokenize=False)
    last.update(*_batch([0, 1, 2]))
    last.compute()
    last.reset()  # Lightning's end of epoch: compute_all() gives that epoch ...
    assert last.compute_all().indices.tolist() == [0, 1, 2]
    other = CIDEr(tokenize=False)
    other.update(*_batch([3, 4, 5]), ids=[3, 4, 5])
    last.merge_state(other)  # ... until samples come in, by update() or merge_state()
    result = last.compute_all()
    assert result.indices.tolist() == [3, 4, 5]
    assert result.score == pytest.approx(_direct("cider", [3, 4, 5]).score, abs=1e-12)


def test_a_state_dict_resumed_without_ids_continues_the_made_up_ids():
    from capeval_plugins.torchmetrics import CIDEr

    before = CIDEr(tokenize=False)
    before.persistent(True)
    before.update(*_batch([0, 1, 2]))
    after = CIDEr(tokenize=False)
    after.persistent(True)
    after.load_state_dict(before.state_dict())
    after.update(*_batch([3, 4, 5]))
    assert float(after.compute()) == pytest.approx(_direct("cider").score, abs=1e-12)
