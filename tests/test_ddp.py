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


# -- one reduce: every state kind merged across ranks by contract.merge_states, bit for bit --------------------

EVERY_TEXTS = [f"caption {'word ' * (i % 4)}number {i} {'x' * (3 * i % 7)}" for i in range(9)]
EVERY_SHARDS = {"uneven": {0: [0, 2, 4, 6, 8], 1: [1, 3, 5, 7]}, "empty_rank": {0: list(range(9)), 1: []}}
EVERY_GROUPS = [i // 3 for i in range(9)]  # groups that span ranks


def _root(text: str) -> float:
    return (len(text) + 0.1) ** 0.5


def _every_state_metric():
    """A toy metric with a state of every kind: float rows, ragged integer rows, texts, a ``"sum"`` whose bits
    depend on the order of its additions, and groups (its scores read every member of a group)."""
    from capeval_plugins.contract import (GROUP, INDEX, TEXT_STATE, Metric, MetricInfo, MetricResult, StateSpec,
                                          decode_texts, encode_texts)

    class EveryState(Metric):
        info = MetricInfo(name="every_state", display_name="EveryState", description="", citation="",
                          references="never", images="never", groups=True)

        def states(self):
            return {"root": StateSpec("cat", torch.float64), "codes": StateSpec("cat", torch.int64, (-1,)),
                    "text": TEXT_STATE, "total": StateSpec("sum", torch.float64, (2,))}

        def map(self, batch):
            root = torch.tensor([_root(c) for c in batch.candidates], dtype=torch.float64)
            width = max(len(c) for c in batch.candidates)
            codes = torch.tensor([[ord(ch) for ch in c] + [0] * (width - len(c)) for c in batch.candidates])
            total = torch.stack([(root * 1e8).sum(), (1.0 / root).sum()])
            return {"root": root, "codes": codes, "text": encode_texts(batch.candidates), "total": total}

        def finalize(self, state):
            root, groups = state["root"], state[GROUP]
            means = {int(g): root[groups == g].mean() for g in torch.unique(groups)}
            texts = decode_texts(state["text"])
            scores = torch.stack([root[i] - means[int(g)] + state["codes"][i].sum() * 1e-3 + len(texts[i])
                                  for i, g in enumerate(groups)])
            total = state["total"]
            return MetricResult(self.info.name, float(total[1]), scores, state[INDEX],
                                corpus_extras={"total0": float(total[0]), "total1": float(total[1])})

    return EveryState()


def _every_state_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from capeval_plugins.adapters.torchmetrics import CapevalMetric

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    got = {}
    for name, shards in EVERY_SHARDS.items():
        metric = CapevalMetric(metric=_every_state_metric())
        reductions = {type(fn).__name__ for fn in metric._reductions.values()}
        shard = shards[rank]
        for start in range(0, len(shard), 2):
            part = shard[start:start + 2]
            metric.update(captions=[EVERY_TEXTS[i] for i in part], ids=part, group_ids=[EVERY_GROUPS[i] for i in part])
        result = metric.compute_all()
        got[name] = {"score": result.score.hex(), "scores": [s.hex() for s in result.scores.tolist()],
                     "indices": result.indices.tolist(),
                     "extras": {k: v.hex() for k, v in result.corpus_extras.items()},
                     "reductions": sorted(reductions)}
    torch.save(got, f"{out}/every{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _sequential(values):
    total = 0.0
    for value in values:
        total += value
    return total


@pytest.mark.slow
def test_every_state_kind_merges_across_ranks_by_the_one_reduce(tmp_path):
    """DDP on 2 ranks (gloo), uneven shards and an empty rank: rows, ragged rows, texts and groups come back
    bit-equal to one process's stream; the ``"sum"`` is each rank's running total (its updates in order) added in
    rank order, bit for bit, as merge_states adds them (computed here with plain floats). torchmetrics' own
    "cat"/"sum" reductions are not used: every state is gathered as it is (None) or merged by RankMerge."""
    from capeval_plugins.adapters.torchmetrics import CapevalMetric

    one = CapevalMetric(metric=_every_state_metric())
    one.update(captions=EVERY_TEXTS, ids=list(range(9)), group_ids=EVERY_GROUPS)
    single = one.compute_all()
    spawn_ranks(_every_state_worker, (2, free_port(), str(tmp_path)))
    for name, shards in EVERY_SHARDS.items():
        expected = []
        for k in (0, 1):  # each rank: the total of each update (one batch of two), added in update order
            shard = shards[k]
            updates = [shard[s:s + 2] for s in range(0, len(shard), 2)]
            roots = [torch.tensor([_root(EVERY_TEXTS[i]) for i in u], dtype=torch.float64) for u in updates]
            expected.append([_sequential([float((r * 1e8).sum()) for r in roots]),
                             _sequential([float((1.0 / r).sum()) for r in roots])])
        totals = [expected[0][j] + expected[1][j] for j in (0, 1)]
        for rank in (0, 1):
            got = torch.load(tmp_path / f"every{rank}.pt")[name]
            assert got["reductions"] == ["NoneType", "RankMerge"], got["reductions"]
            assert got["indices"] == list(range(9)), name
            assert got["scores"] == [s.hex() for s in single.scores.tolist()], name  # rows, texts, groups
            assert got["extras"] == {"total0": totals[0].hex(), "total1": totals[1].hex()}, name
            assert got["score"] == totals[1].hex()


def _one_rank_stops_worker(rank: int, world: int, port: int, out: str) -> None:
    import json

    import torch.distributed as dist

    from capeval_plugins import runner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    texts = [f"caption number {i}" for i in range(12)]
    metric = capeval_plugins.load("cider", tokenize=False, batch_size=2)
    corpus = runner.Corpus(texts, None, [[t, "a reference"] for t in texts])
    try:
        runner.run({"cider": metric}, corpus, shard=True, stop=lambda: rank == 1)
        message = None
    except runner.Interrupted as err:
        message = str(err)
    dist.destroy_process_group()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(message, f)


@pytest.mark.slow
def test_a_stop_on_one_rank_is_named_on_every_rank(tmp_path):
    """SIGINT to one rank of torchrun: every rank stops, and rank 0, which alone prints, said only its own count
    ("3 of 3 batches on this rank": it had finished), never which rank was asked to stop."""
    import json

    spawn_ranks(_one_rank_stops_worker, (2, free_port(), str(tmp_path)))
    messages = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert "after 3 of 3 batches on this rank, rank 0 (rank 1 was asked to stop)" in messages[0], messages
    assert "after 1 of 3 batches on this rank, rank 1 (rank 1 was asked to stop)" in messages[1], messages
