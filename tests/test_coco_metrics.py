"""The classic COCO metrics through the contract equal pycocoevalcap run directly on the same inputs, whatever
the batching or sharding, and fail clearly without Java or SPICE's jars."""
from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import flickr8k_pairs, free_port, has_java

import capeval_plugins
from capeval_plugins.inputs import InputError

needs_java = pytest.mark.skipif(not has_java(), reason="pycocoevalcap's PTB tokenizer and METEOR need Java")
WORDS = "a dog man woman red blue ball runs sits on the grass near two kids play in park street car old".split()


def corpus(n: int = 40, seed: int = 0):
    """Captions with case, punctuation and duplicates, 1-5 references each."""
    rng = random.Random(seed)
    sentence = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 11)))  # noqa: E731
    cands = [sentence().capitalize() + rng.choice([".", "!", "", " ,"]) for _ in range(n)]
    refs = [[sentence() + rng.choice([".", ""]) for _ in range(rng.randint(1, 5))] for _ in range(n)]
    cands[3] = cands[1]  # a repeated candidate
    refs[5] = [cands[5]]   # a candidate equal to its only reference
    return cands, refs


def direct(scorer, cands, refs, tokenize=True):
    """pycocoevalcap exactly as COCOEvalCap runs it: PTB-tokenise gts and res, then the scorer."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    gts = {i: [{"caption": r} for r in rs] for i, rs in enumerate(refs)}
    res = {i: [{"caption": c}] for i, c in enumerate(cands)}
    if tokenize:
        gts, res = PTBTokenizer().tokenize(gts), PTBTokenizer().tokenize(res)
    else:
        gts = {i: [x["caption"] for x in v] for i, v in gts.items()}
        res = {i: [x["caption"] for x in v] for i, v in res.items()}
    if type(scorer).__name__ == "Bleu":
        return scorer.compute_score(gts, res, verbose=0)
    return scorer.compute_score(gts, res)


@needs_java
def test_bleu_rouge_cider_equal_pycocoevalcap_run_directly_through_batches():
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    cands, refs = corpus()
    bleu, bleu_items = direct(Bleu(4), cands, refs)
    for n in range(1, 5):
        ours = capeval_plugins.load(f"bleu{n}", batch_size=7)(None, cands, refs)
        assert ours.score == pytest.approx(bleu[n - 1], rel=1e-12)
        assert ours.scores.tolist() == pytest.approx(bleu_items[n - 1], rel=1e-12)
        # corpus BLEU pools n-gram counts: it is not the mean of sentence BLEU
        assert not math.isclose(ours.score, float(ours.scores.mean()), rel_tol=1e-3)
    for name, scorer in (("rouge_l", Rouge()), ("cider", Cider())):
        score, items = direct(scorer, cands, refs)
        ours = capeval_plugins.load(name, batch_size=5)(None, cands, refs)
        assert ours.score == pytest.approx(score, rel=1e-12), name
        assert ours.scores.tolist() == pytest.approx(list(items), rel=1e-12), name


@pytest.mark.slow  # METEOR's JVM takes seconds to start
@needs_java
def test_meteor_equals_pycocoevalcap_and_its_corpus_score_is_its_own_aggregate():
    from capeval_plugins.metrics.coco import shared_meteor

    cands, refs = corpus(12, seed=1)
    ours = capeval_plugins.load("meteor", batch_size=5)(None, cands, refs)
    # pycocoevalcap's own scorer object (the one JVM of this process: starting another costs seconds)
    score, items = direct(shared_meteor(), cands, refs)
    assert ours.score == pytest.approx(score, abs=1e-12)
    assert ours.scores.tolist() == pytest.approx(items, abs=1e-12)


@needs_java
def test_bleu_rouge_cider_equal_pycocoevalcap_on_flickr8k_expert():
    """Real captions (the 375 distinct pairs of 60 Flickr8k-Expert images, 5 references each: mixed case,
    punctuation, hyphens, a vocabulary of over 600 words): the same pycocoevalcap code on the same PTB tokens
    in the same order, so equal (benchmarks/peers.py finds every score bit-equal on all 5,664 pairs)."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    from capeval_plugins import runner

    pairs = flickr8k_pairs(60)
    cands, refs = pairs.candidates, pairs.references
    assert len(cands) == 375 and len({w for r in refs for t in r for w in t.lower().split()}) > 600
    bleu, bleu_items = direct(Bleu(4), cands, refs)
    results = runner.score_many({n: capeval_plugins.load(n) for n in ("bleu1", "bleu4", "rouge_l", "cider")},
                                None, cands, refs)
    for name, n in (("bleu1", 1), ("bleu4", 4)):
        assert results[name].score == pytest.approx(bleu[n - 1], rel=1e-12)
        assert results[name].scores.tolist() == pytest.approx(bleu_items[n - 1], rel=1e-12, abs=1e-15)
    for name, scorer in (("rouge_l", Rouge()), ("cider", Cider())):
        score, items = direct(scorer, cands, refs)
        assert results[name].score == pytest.approx(score, rel=1e-12), name
        assert results[name].scores.tolist() == pytest.approx(list(items), rel=1e-12, abs=1e-15), name
    assert 0 < results["bleu4"].score < results["bleu1"].score < 1 and results["cider"].scores.std() > 0.1


@pytest.mark.slow  # METEOR's JVM takes seconds to start
@needs_java
def test_meteor_equals_pycocoevalcap_on_flickr8k_expert():
    from capeval_plugins.metrics.coco import shared_meteor

    pairs = flickr8k_pairs(20)
    ours = capeval_plugins.load("meteor")(None, pairs.candidates, pairs.references)
    score, items = direct(shared_meteor(), pairs.candidates, pairs.references)
    assert len(items) == len(pairs.candidates) > 100
    assert ours.score == pytest.approx(score, abs=1e-12)
    assert ours.scores.tolist() == pytest.approx(items, abs=1e-12)


def closest_ref_length(refs: list[list[str]], length: int) -> int:
    return min((len(r) for r in refs), key=lambda r: (abs(r - length), r))


def test_corpus_bleu1_equals_a_hand_computation_on_tokenised_text():
    """Independent of pycocoevalcap: clipped unigram matches pooled over the corpus, closest-length penalty."""
    cands, refs = corpus(30, seed=2)
    toks = [c.lower().replace(".", "").replace("!", "").replace(",", "").split() for c in cands]
    ref_toks = [[r.lower().replace(".", "").split() for r in rs] for rs in refs]
    matches = guess = ref_len = 0
    for hyp, rs in zip(toks, ref_toks):
        counts = Counter(hyp)
        best = Counter()
        for r in rs:
            best |= Counter(r)
        matches += sum(min(c, best[w]) for w, c in counts.items())
        guess += len(hyp)
        ref_len += closest_ref_length(rs, len(hyp))
    expected = matches / guess * (math.exp(1 - ref_len / guess) if guess < ref_len else 1.0)
    texts = [" ".join(t) for t in toks]
    ref_texts = [[" ".join(r) for r in rs] for rs in ref_toks]
    ours = capeval_plugins.load("bleu1", tokenize=False, batch_size=4)(None, texts, ref_texts)
    assert ours.score == pytest.approx(expected, rel=1e-6)


def test_cider_idf_is_over_the_whole_corpus_whatever_the_batches():
    """torchmetrics updates of uneven sizes and out of order, and one call: the same corpus CIDEr."""
    from capeval_plugins.torchmetrics import CIDEr

    cands, refs = corpus(25, seed=3)
    single = capeval_plugins.load("cider", tokenize=False)(None, cands, refs)
    metric = CIDEr(tokenize=False, batch_size=3)
    for part in ([0, 1, 2, 4, 5, 6], [7, 8], [9, 3], list(range(10, 25))):
        metric.update(None, [cands[i] for i in part], [refs[i] for i in part], ids=part)
    got = metric.compute_all()
    assert got.indices.tolist() == list(range(25))
    assert got.scores.tolist() == pytest.approx(single.scores.tolist(), rel=1e-12)
    assert got.score == pytest.approx(single.score, rel=1e-12)
    # idf really is corpus-wide: the first five samples scored alone get other scores
    alone = capeval_plugins.load("cider", tokenize=False)(None, cands[:5], refs[:5])
    assert not np.allclose(alone.scores.numpy(), single.scores.numpy()[:5])


def test_references_required_images_ignored_and_empty_corpus():
    cider = capeval_plugins.load("cider", tokenize=False)
    with pytest.raises(InputError, match="needs references"):
        cider(None, ["a dog"])
    assert cider.info.images == "never" and cider.info.text_input == "ptb"
    assert math.isnan(cider.finalize({"candidate": torch.zeros(0, 0, dtype=torch.uint8),
                                      "references": torch.zeros(0, 0, dtype=torch.uint8),
                                      "index": torch.zeros(0, dtype=torch.int64)}).score)


@needs_java
def test_ptb_tokenisation_keeps_line_breaks_inside_captions_aligned():
    from capeval_plugins.metrics.coco import ptb_tokenize

    out = ptb_tokenize({0: ["A dog\rruns.", "Two\ncats"], 1: ["A  red\u2028ball!"]})
    assert out == {0: ["a dog runs", "two cats"], 1: ["a red ball"]}


def test_missing_java_is_a_clear_error(monkeypatch):
    import capeval_plugins.metrics.coco as coco

    monkeypatch.setattr(coco.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="Java runtime.*tokenize=False"):
        capeval_plugins.load("bleu4")(None, ["a dog"], [["a dog runs"]])
    with pytest.raises(RuntimeError, match=r"meteor \(METEOR\) need a Java runtime"):  # before anything is scored
        capeval_plugins.load("meteor", tokenize=False)(None, ["a dog"], [["a dog runs"]])


def test_spice_without_its_jars_is_a_clear_error():
    from capeval_plugins.metrics.coco import spice_jars

    if all(p.is_file() for p in spice_jars()):
        pytest.skip("SPICE's Stanford CoreNLP jars are installed here")
    with pytest.raises(RuntimeError, match="Stanford CoreNLP 3.6.0"):  # checked before anything is scored
        capeval_plugins.load("spice")(None, ["a dog"], [["a dog runs"]])


def test_registered_with_the_names_scripts_rely_on():
    names = {m.name for m in capeval_plugins.list_metrics()}
    assert {"bleu1", "bleu2", "bleu3", "bleu4", "meteor", "rouge_l", "cider", "spice"} <= names



def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from capeval_plugins.torchmetrics import CIDEr

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cands, refs = corpus(25, seed=3)
    mine = list(range(rank, 25, world)) + ([0] if rank == 1 else [])  # uneven shards and a repeated sample
    metric = CIDEr(tokenize=False, batch_size=4)
    for start in range(0, len(mine), 5):
        part = mine[start:start + 5]
        metric.update(None, [cands[i] for i in part], [refs[i] for i in part], ids=part)
    result = metric.compute_all()
    torch.save({"score": result.score, "scores": result.scores.tolist(), "indices": result.indices.tolist()},
               f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_ranks_give_the_single_process_corpus_cider(tmp_path):
    import torch.multiprocessing as mp

    cands, refs = corpus(25, seed=3)
    single = capeval_plugins.load("cider", tokenize=False)(None, cands, refs)
    mp.spawn(_ddp_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["indices"] == list(range(25))
        assert got["scores"] == pytest.approx(single.scores.tolist(), rel=1e-12)
        assert got["score"] == pytest.approx(single.score, rel=1e-12)


@needs_java
def test_one_pass_of_classic_metrics_tokenises_once_and_as_each_alone_would(monkeypatch):
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    from capeval_plugins import runner
    from capeval_plugins.metrics import coco

    cands, refs = corpus(30, seed=5)
    # the joint call gives what two separate calls give
    gts, res = {i: r for i, r in enumerate(refs)}, {i: [c] for i, c in enumerate(cands)}
    assert coco.ptb_tokenize_pair(gts, res) == (coco.ptb_tokenize(gts), coco.ptb_tokenize(res))
    coco._ptb_cache.clear()
    calls = []
    original = PTBTokenizer.tokenize
    monkeypatch.setattr(PTBTokenizer, "tokenize", lambda self, texts: calls.append(1) or original(self, texts))
    names = ("bleu1", "bleu4", "rouge_l", "cider")
    results = runner.score_many({n: capeval_plugins.load(n) for n in names}, None, cands, refs)
    assert len(calls) == 1  # was two per metric
    for name in names:  # the same numbers as each metric on its own
        coco._ptb_cache.clear()
        alone = capeval_plugins.load(name)(None, cands, refs)
        assert results[name].score == pytest.approx(alone.score, rel=1e-12)
        assert results[name].scores.tolist() == pytest.approx(alone.scores.tolist(), rel=1e-12)


@needs_java
def test_quiet_keeps_java_silent_and_progress_covers_the_corpus_step(tmp_path):
    import json
    import subprocess

    from conftest import PYTHON

    captions = tmp_path / "captions.jsonl"
    cands, refs = corpus(8, seed=2)
    captions.write_text("".join(json.dumps({"caption": c, "references": r}) + "\n" for c, r in zip(cands, refs)))
    base = [PYTHON, "-m", "capeval_plugins.cli", "score", "-m", "bleu4", "-m", "cider", "-m", "rouge_l",
            "--captions", str(captions)]
    loud = subprocess.run(base + ["--out", str(tmp_path / "a.jsonl")], capture_output=True, text=True, timeout=300)
    assert loud.returncode == 0, loud.stderr
    assert loud.stderr.count("PTBTokenizer tokenized") == 1  # once for the pass (was 6 lines)
    assert "corpus scores" in loud.stderr and "cider" in loud.stderr
    quiet = subprocess.run(base + ["--out", str(tmp_path / "b.jsonl"), "--quiet"], capture_output=True, text=True,
                           timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr.strip() == ""
