"""torchmetrics: states from the contract, DDP sync (uneven, empty rank, repeats), Lightning validation."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import CAPTIONS, REFERENCES, free_port, random_image

import capeval_plugins
from capeval_plugins.torchmetrics import CLIPScore, RefCLIPScore


def test_batches_equal_one_call(tiny_clip, images):
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(images, CAPTIONS, REFERENCES)
    metric = CLIPScore(model=tiny_clip)
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



N = 7
SHARDS = {
    # uneven shards, with the repeat a DistributedSampler adds to even them out
    "uneven": {0: [0, 2, 4, 6], 1: [1, 3, 5, 0]},
    # every sample on rank 0, nothing on rank 1
    "empty_rank": {0: list(range(N)), 1: []},
}


def _corpus():
    images = [random_image(i % 4, size=(30 + 2 * i, 32)) for i in range(N)]
    captions = [CAPTIONS[i % 4] + f" ({i})" for i in range(N)]
    references = [REFERENCES[i % 4] for i in range(N)]
    return images, captions, references


def _ddp_worker(rank: int, world: int, port: int, model: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    images, captions, references = _corpus()
    results = {}
    for name, shards in SHARDS.items():
        metric = CLIPScore(model=model, batch_size=3)  # built inside the worker
        mine = shards[rank]
        for start in range(0, len(mine), 2):
            part = mine[start:start + 2]
            metric.update([images[i] for i in part], [captions[i] for i in part], [references[i] for i in part], ids=part)
        result = metric.compute_all()
        results[name] = {"score": result.score, "scores": result.scores.tolist(), "indices": result.indices.tolist(),
                         "refclipscore": result.extras["refclipscore"].tolist(),
                         "repeats": result.corpus_extras.get("n_repeats_dropped", 0.0)}
    # No ids, a shuffled split: the corpus score stands, per-sample rows are refused.
    metric = CLIPScore(model=model, batch_size=3)
    mine = [[5, 0, 3, 6], [2, 4, 1]][rank]
    metric.update([images[i] for i in mine], [captions[i] for i in mine])
    corpus_score = float(metric.compute())
    try:
        metric.compute_all()
        refused = ""
    except ValueError as err:
        refused = str(err)
    results_no_ids = {"score": corpus_score, "refused": refused}
    torch.save({"by_name": results, "no_ids": results_no_ids}, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_process_ddp_equals_single_process(tiny_clip, tmp_path):
    import torch.multiprocessing as mp

    images, captions, references = _corpus()
    single = capeval_plugins.load("clipscore", model=tiny_clip)(images, captions, references)
    mp.spawn(_ddp_worker, args=(2, free_port(), tiny_clip, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["by_name"]["uneven"]["repeats"] == 1.0  # the sampler's repeat: dropped and counted
        assert saved["by_name"]["empty_rank"]["repeats"] == 0.0
        assert saved["no_ids"]["score"] == pytest.approx(single.score, abs=1e-5)
        assert "need ids=<dataset indices>" in saved["no_ids"]["refused"]
        for name, got in saved["by_name"].items():
            assert got["indices"] == list(range(N)), name
            assert got["scores"] == pytest.approx(single.scores.tolist(), abs=1e-5), name
            assert got["refclipscore"] == pytest.approx(single.extras["refclipscore"].tolist(), abs=1e-5), name
            assert got["score"] == pytest.approx(single.score, abs=1e-5), name


@pytest.mark.slow
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
    assert metric._update_count == 0  # reset by Lightning
    for result in (metric.compute_all(), metric.last_result, *module.epoch_results):
        assert result.indices.tolist() == list(range(N))
        assert result.scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-5)
        assert result.score == pytest.approx(logged[-1]["val/clipscore"], abs=1e-6)  # logged as float32
    assert metric.compute_all() is module.epoch_results[-1] is not module.epoch_results[0]
    metric.update(_corpus()[0][:2], _corpus()[1][:2], ids=[0, 1])  # a new update: the state, not the kept result
    assert len(metric.compute_all()) == 2


TEXTS = ["one", "two words", "three words here", "a much longer caption with many words", "x", "y z", "w"]


def _ragged_worker(rank: int, world: int, port: int, out: str) -> None:
    """Ragged text states: ranks with different numbers of batches of different widths, one rank empty."""
    import sys

    import torch.distributed as dist

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_contract import CorpusText

    from capeval_plugins.adapters.torchmetrics import CapevalMetric

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for name, shards in {"uneven": {0: [0, 1, 2, 3, 4], 1: [5, 6, 0]}, "empty_rank": {0: list(range(7)), 1: []}}.items():
        metric = CapevalMetric(metric=CorpusText())
        mine = shards[rank]
        for start in range(0, len(mine), 2):
            part = mine[start:start + 2]
            metric.update(captions=[TEXTS[i] for i in part], ids=part)
        result = metric.compute_all()
        results[name] = {"score": result.score, "scores": result.scores.tolist(), "indices": result.indices.tolist()}
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_ragged_text_states(tmp_path):
    import torch.multiprocessing as mp

    from test_contract import CorpusText

    single = CorpusText()(None, TEXTS)
    mp.spawn(_ragged_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        for name, got in torch.load(tmp_path / f"rank{rank}.pt").items():
            assert got["indices"] == list(range(len(TEXTS))), name
            assert got["scores"] == single.scores.tolist() and got["score"] == single.score, name
