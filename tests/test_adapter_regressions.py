"""Adapter defects found in audit, each checked against the core (``capeval_plugins.load(name)(...)``) on the same
samples: a torchmetrics update() that fails while scoring leaves the metric as it was; forward with
``dist_sync_on_step=True`` returns the batch's score over every rank; ``merge_state`` of metrics updated without
ids keeps every sample; evaluate refuses text Arrow cannot store with the core's own message."""
from __future__ import annotations

import io

import pytest
import torch
from conftest import CAPTIONS, REFERENCES, free_port, random_image, spawn_ranks

import capeval_plugins
from capeval_plugins.inputs import InputError

pytest.importorskip("torchmetrics")
from capeval_plugins.torchmetrics import CIDEr, CLIPScore  # noqa: E402

TEXTS = ["a dog runs on the grass", "a cat sits on a mat", "two men play ball", "a red car on a road",
         "a dog lies on the grass", "three birds fly over a lake"]
TEXT_REFERENCES = [["a dog is running on grass", "the dog runs"], ["a cat on a mat"], ["two men playing with a ball"],
                   ["a car that is red", "a red car"], ["a dog lying in the grass"], ["birds flying above the water"]]


def cider_on(rows):
    """The core's CIDEr on the samples ``rows``, in that order."""
    return capeval_plugins.load("cider", tokenize=False)(None, [TEXTS[i] for i in rows],
                                                           [TEXT_REFERENCES[i] for i in rows])


def truncated_png(image) -> bytes:
    """A PNG cut in half: its header reads (validation passes), its pixels do not (scoring fails)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()[:len(buffer.getvalue()) // 2]


# -- torchmetrics: a failed update() -------------------------------------------------------------------------------

@pytest.mark.parametrize("step", ["update", "forward"])
def test_an_update_that_fails_while_scoring_can_be_given_again(tiny_clip, step):
    """The last image is a truncated PNG: the batch fails while scoring. Nothing of it may stay (its ids, its
    count), so the same batch with the image fixed is accepted and the corpus is the core's on both batches."""
    images = [random_image(i, size=(40 + i, 36)) for i in range(len(CAPTIONS))]
    metric = CLIPScore(model=tiny_clip)
    add = metric.update if step == "update" else metric
    add(images[:2], CAPTIONS[:2], ids=[0, 1])
    with pytest.raises(InputError, match="sample 3: cannot read image"):
        add(images[2:3] + [truncated_png(images[3])], CAPTIONS[2:], ids=[2, 3])
    add(images[2:], CAPTIONS[2:], ids=[2, 3])
    direct = capeval_plugins.load("clipscore", model=tiny_clip)(images, CAPTIONS)
    result = metric.compute_all()
    assert result.indices.tolist() == [0, 1, 2, 3]
    assert result.scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-6)
    assert result.score == pytest.approx(direct.score, abs=1e-6)


def test_an_update_that_fails_while_scoring_leaves_made_up_ids_as_they_were(monkeypatch):
    """Without ids, a failed update() numbers nothing: the next update without ids takes the positions it would have
    taken (2, 3), so the positions after them (4, 5) are still free for an update that gives them as ids."""
    metric = CIDEr(tokenize=False)
    metric.update(None, TEXTS[:2], TEXT_REFERENCES[:2])

    def fail(*args, **kwargs):
        raise RuntimeError("scoring failed")

    monkeypatch.setattr(metric._session, "run", fail)
    with pytest.raises(RuntimeError, match="scoring failed"):
        metric.update(None, TEXTS[2:4], TEXT_REFERENCES[2:4])
    monkeypatch.undo()
    metric.update(None, TEXTS[2:4], TEXT_REFERENCES[2:4])
    metric.update(None, TEXTS[4:], TEXT_REFERENCES[4:], ids=[4, 5])
    result, direct = metric.compute_all(), cider_on(range(6))
    assert result.indices.tolist() == list(range(6))
    assert result.scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-12)


# -- torchmetrics: merge_state ------------------------------------------------------------------------------------

@pytest.mark.parametrize("given", ["metric", "metric_state"])
def test_merge_state_without_ids_keeps_every_sample_in_order(given):
    """Each instance numbers its samples from 0 when no ids are given: merged, this metric's samples come first,
    then the other's, then what this metric is given next; the result is the core's on all of them in that order."""
    ours, theirs = CIDEr(tokenize=False), CIDEr(tokenize=False)
    ours.update(None, TEXTS[:2], TEXT_REFERENCES[:2])
    theirs.update(None, TEXTS[2:3], TEXT_REFERENCES[2:3])
    theirs.update(None, TEXTS[3:4], TEXT_REFERENCES[3:4])
    ours.merge_state(theirs if given == "metric" else theirs.metric_state)
    ours.update(None, TEXTS[4:], TEXT_REFERENCES[4:])
    result, direct = ours.compute_all(), cider_on(range(6))
    assert result.indices.tolist() == list(range(6))
    assert result.scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-12)
    assert result.score == pytest.approx(direct.score, abs=1e-12)
    assert theirs.compute_all().scores.tolist() == pytest.approx(cider_on([2, 3]).scores.tolist(), abs=1e-12)


def test_merge_state_refuses_an_id_given_to_both_and_keeps_its_state():
    ours, theirs = CIDEr(tokenize=False), CIDEr(tokenize=False)
    ours.update(None, TEXTS[:2], TEXT_REFERENCES[:2], ids=[0, 1])
    theirs.update(None, TEXTS[2:4], TEXT_REFERENCES[2:4], ids=[1, 2])
    with pytest.raises(InputError, match=r"merge_state\(\): sample id\(s\) 1 are in both states"):
        ours.merge_state(theirs)
    assert ours.compute_all().scores.tolist() == pytest.approx(cider_on([0, 1]).scores.tolist(), abs=1e-12)


# -- torchmetrics: forward with dist_sync_on_step=True under DDP ------------------------------------------------------

RANK_BATCHES = {0: [[0, 2], [4]], 1: [[1, 3], [5]]}  # each rank's ids, step by step


def _sync_on_step_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    metric = CIDEr(tokenize=False, dist_sync_on_step=True)
    steps = [float(metric(None, [TEXTS[i] for i in ids], [TEXT_REFERENCES[i] for i in ids], ids=ids))
             for ids in RANK_BATCHES[rank]]
    torch.save({"steps": steps, "score": float(metric.compute())}, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_forward_with_dist_sync_on_step_returns_the_score_of_every_ranks_batch(tmp_path):
    """Step k's value on every rank is the core's CIDEr on the union of the ranks' k-th batches."""
    spawn_ranks(_sync_on_step_worker, (2, free_port(), str(tmp_path)))
    union = [sorted(RANK_BATCHES[0][k] + RANK_BATCHES[1][k]) for k in range(2)]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["steps"] == pytest.approx([cider_on(ids).score for ids in union], abs=1e-12)
        assert got["score"] == pytest.approx(cider_on(range(6)).score, abs=1e-12)


# -- evaluate: text Arrow cannot store ------------------------------------------------------------------------------

def core_error(predictions, references) -> str:
    with pytest.raises(InputError) as err:
        capeval_plugins.load("cider")(None, predictions, references)
    return str(err.value)


@pytest.mark.parametrize("bad", [
    pytest.param({"prediction": "a \ud800 dog"}, id="surrogate-prediction"),
    pytest.param({"reference": ["a dog", "a \udc00 dog"]}, id="surrogate-reference"),
    pytest.param({"reference": "a \ud800"}, id="surrogate-single-reference"),
    pytest.param({"reference": ["a dog", 3]}, id="number-reference"),  # Arrow stored it as "3"
])
def test_evaluate_refuses_text_arrow_cannot_store_with_the_cores_message(bad):
    """The second add_batch's second sample (sample 3 over all batches) carries the bad text: the error is the core's
    on the whole corpus, before Arrow sees it, and nothing added before reaches the next compute()."""
    import evaluate

    predictions, references = list(TEXTS[:4]), [list(r) for r in TEXT_REFERENCES[:4]]
    predictions[3] = bad.get("prediction", predictions[3])
    references[3] = bad.get("reference", references[3])
    metric = evaluate.load("cider", tokenize=False)
    metric.add_batch(predictions=predictions[:2], references=references[:2])
    with pytest.raises(InputError) as err:
        metric.add_batch(predictions=predictions[2:], references=references[2:])
    assert str(err.value) == core_error(predictions, references)
    out = metric.compute(predictions=TEXTS[4:], references=TEXT_REFERENCES[4:])
    assert out["scores"] == pytest.approx(cider_on([4, 5]).scores.tolist(), abs=1e-12)


def test_evaluate_names_a_sample_by_its_id_and_leaves_what_arrow_stores_to_on_error():
    """With ids, the sample is named by its id, as the core names it; a NUL (which Arrow stores) is still skipped
    under on_error="skip", as the core skips it."""
    import evaluate

    predictions = ["a dog", "a \ud800 dog"]
    metric = evaluate.load("cider", tokenize=False)
    with pytest.raises(InputError) as err:
        metric.compute(predictions=predictions, references=REFERENCES[:2], ids=[7, 3])
    with pytest.raises(InputError) as core:
        capeval_plugins.load("cider")(None, predictions, REFERENCES[:2], ids=[7, 3])
    assert str(err.value) == str(core.value)
    skipping = evaluate.load("cider", tokenize=False, on_error="skip")
    with_nul = [TEXTS[0], "a \x00 cat", TEXTS[2]]
    out = skipping.compute(predictions=with_nul, references=TEXT_REFERENCES[:3])
    direct = capeval_plugins.load("cider", tokenize=False, on_error="skip")(None, with_nul, TEXT_REFERENCES[:3])
    assert list(out["skipped"]) == [1] and out["cider"] == pytest.approx(direct.score, abs=1e-12)
