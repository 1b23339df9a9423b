"""torchmetrics under real torch.distributed (two gloo processes, one spawn for everything: each spawn costs
its processes' start and model loads). What only real collectives can show: uneven shards and an empty rank
gather every state (a ragged text state, ``"sum"`` statistics, rows of every dtype), a padding sampler's repeat
is dropped, ``metric(batch)`` without ids works validation after validation, and the results equal one
process's. The messages (repeated ids, ids given for other samples, rows refused without ids) are tested in
one process (test_contract.py, test_runner.py, test_torchmetrics_adapter.py)."""
from __future__ import annotations

import pytest
import torch
from conftest import CAPTIONS, REFERENCES, free_port, random_image, spawn_ranks

import capeval_plugins

N = 7
SHARDS = {
    # uneven shards, with the repeat a DistributedSampler adds to even them out
    "uneven": {0: [0, 2, 4, 6], 1: [1, 3, 5, 0]},
    # every sample on rank 0, nothing on rank 1
    "empty_rank": {0: list(range(N)), 1: []},
}
TEXTS = ["one", "two words", "three words here", "a much longer caption with many words", "x", "y z", "w"]
TEXT_SHARDS = {"uneven": {0: [0, 1, 2, 3, 4], 1: [5, 6, 0]}, "empty_rank": {0: list(range(7)), 1: []}}


def clip_corpus():
    images = [random_image(i % 4, size=(30 + 2 * i, 32)) for i in range(N)]
    captions = [CAPTIONS[i % 4] + f" ({i})" for i in range(N)]
    references = [REFERENCES[i % 4] for i in range(N)]
    return images, captions, references


def _updates(metric, shard, size, *lists):
    for start in range(0, len(shard), size):
        part = shard[start:start + size]
        metric.update(*[[values[i] for i in part] for values in lists], ids=part)


def _worker(rank: int, world: int, port: int, model: str, out: str) -> None:
    import sys
    from pathlib import Path

    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    from test_contract import CorpusText
    from test_mid import corpus as mid_corpus

    from capeval_plugins.adapters.torchmetrics import CapevalMetric
    from capeval_plugins.torchmetrics import MID, CLIPScore

    torch.set_num_threads(1)  # two workers on a small CI machine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    images, captions, references = clip_corpus()
    got: dict = {}
    for name, shards in SHARDS.items():
        metric = CLIPScore(model=model, batch_size=3, reference_extras=True)  # built inside the worker
        _updates(metric, shards[rank], 2, images, captions, references)
        result = metric.compute_all()
        got["clip", name] = {"score": result.score, "scores": result.scores.tolist(), "indices": result.indices.tolist(),
                             "refclipscore": result.extras["refclipscore"].tolist(),
                             "repeats": result.corpus_extras.get("n_repeats_dropped", 0.0)}
    # metric(batch) at every step of a non-shuffled sampler's share, no ids, compute() and reset() at the end of
    # each validation, as Lightning does with a logged metric; then a shuffled share: the corpus score stands,
    # per-sample rows are refused
    metric = CLIPScore(model=model, batch_size=3)
    mine = list(range(rank, N, world))
    for epoch in range(2):
        steps = [float(metric([images[i] for i in mine[s:s + 2]], [captions[i] for i in mine[s:s + 2]]))
                 for s in range(0, len(mine), 2)]
        got["forward", epoch] = {"steps": steps, "score": float(metric.compute())}
        metric.reset()
    shuffled = [[5, 0, 3, 6], [2, 4, 1]][rank]
    metric.update([images[i] for i in shuffled], [captions[i] for i in shuffled])
    got["no_ids"] = {"score": float(metric.compute())}
    try:
        metric.compute_all()
    except ValueError as err:
        got["no_ids"]["refused"] = str(err)
    for name, shards in TEXT_SHARDS.items():  # ragged text states, ranks with different numbers of batches
        metric = CapevalMetric(metric=CorpusText())
        _updates(metric, shards[rank], 2, [None] * len(TEXTS), TEXTS)
        result = metric.compute_all()
        got["text", name] = {"score": result.score, "scores": result.scores.tolist(), "indices": result.indices.tolist()}
    m_images, m_candidates, m_references = mid_corpus()
    mid_shard = [i for i in range(len(m_images)) if (i % 3 == 0) == bool(rank)]
    for per_sample in (True, False):  # "sum" statistics; per-sample feature rows or not
        metric = MID(model=model, batch_size=4, per_sample=per_sample)
        _updates(metric, mid_shard, 3, m_images, m_candidates, m_references)
        result = metric.compute_all()
        got["mid", per_sample] = {"score": result.score, "scores": result.scores.tolist(),
                                  "indices": result.indices.tolist()}
    torch.save(got, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_equal_one(tiny_clip, tmp_path):
    from test_contract import CorpusText
    from test_mid import corpus as mid_corpus

    images, captions, references = clip_corpus()
    clip = capeval_plugins.load("clipscore", model=tiny_clip, reference_extras=True)
    single = clip(images, captions, references)
    no_refs = clip(images, captions)
    steps = [clip([images[i] for i in part], [captions[i] for i in part]).score
             for rank in range(2) for part in (list(range(rank, N, 2))[:2], list(range(rank, N, 2))[2:])]
    text = CorpusText()(None, TEXTS)
    mid = {flag: capeval_plugins.load("mid", model=tiny_clip, per_sample=flag)(*mid_corpus()) for flag in (True, False)}
    spawn_ranks(_worker, (2, free_port(), tiny_clip, str(tmp_path)))
    tol = dict(abs=1e-5)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["clip", "uneven"]["repeats"] == 1.0  # the sampler's repeat: dropped and counted
        assert got["clip", "empty_rank"]["repeats"] == 0.0
        for name in SHARDS:
            assert got["clip", name]["indices"] == list(range(N)), name
            assert got["clip", name]["scores"] == pytest.approx(single.scores.tolist(), **tol), name
            assert got["clip", name]["refclipscore"] == pytest.approx(single.extras["refclipscore"].tolist(), **tol)
            assert got["clip", name]["score"] == pytest.approx(single.score, **tol), name
        for epoch in range(2):
            assert got["forward", epoch]["score"] == pytest.approx(no_refs.score, **tol), epoch
            assert got["forward", epoch]["steps"] == pytest.approx(steps[2 * rank:2 * rank + 2], **tol), epoch
        assert got["no_ids"]["score"] == pytest.approx(no_refs.score, **tol)
        assert "need ids=<dataset indices>" in got["no_ids"]["refused"]
        for name in TEXT_SHARDS:
            assert got["text", name]["indices"] == list(range(len(TEXTS))), name
            assert got["text", name]["scores"] == text.scores.tolist() and got["text", name]["score"] == text.score
        for flag in (True, False):  # sums added in another order: the last bits of a fit on few pairs
            assert got["mid", flag]["indices"] == mid[flag].indices.tolist()
            assert got["mid", flag]["scores"] == pytest.approx(mid[flag].scores.tolist(), rel=1e-4, abs=1e-4)
            assert got["mid", flag]["score"] == pytest.approx(mid[flag].score, rel=1e-4, abs=1e-4)
