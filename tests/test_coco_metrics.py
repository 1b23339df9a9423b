"""The classic COCO metrics through the contract equal pycocoevalcap run directly on the same inputs (every per-item
and corpus value to 1e-12 relative: BLEU, ROUGE-L and CIDEr-D repeat its arithmetic, METEOR is its jar), whatever
the batching or sharding; the Java tools are bounded child processes that fail clearly, never hang."""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import BENCHDATA, HANG_GUARD, PYTHON, flickr8k_pairs, free_port, has_java, spawn_ranks

import capeval_plugins
from capeval_plugins.resources import java
from capeval_plugins.core.messages import ExternalToolError
from capeval_plugins.inputs import InputError
from capeval_plugins.preflight import RequirementError

needs_java = pytest.mark.skipif(not has_java(), reason="pycocoevalcap's PTB tokenizer and METEOR need Java")
WORDS = "a dog man woman red blue ball runs sits on the grass near two kids play in park street car old".split()
CLASSIC = ("bleu1", "bleu2", "bleu3", "bleu4", "meteor", "rouge_l", "cider")
FAKE_METEOR = Path(__file__).parent / "helpers" / "fake_meteor.py"


def corpus(n: int = 40, seed: int = 0):
    """Captions with case, punctuation and duplicates, 1-5 references each."""
    rng = random.Random(seed)
    sentence = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 11)))  # noqa: E731
    cands = [sentence().capitalize() + rng.choice([".", "!", "", " ,"]) for _ in range(n)]
    refs = [[sentence() + rng.choice([".", ""]) for _ in range(rng.randint(1, 5))] for _ in range(n)]
    cands[3] = cands[1]  # a repeated candidate
    refs[5] = [cands[5]]   # a candidate equal to its only reference
    return cands, refs


PIECES = ["a", "dog", "Dog's", "can't", '"quoted"', "'single'", "``", "(paren)", "[b]", "café", "naïve", "中文",
          "日本語", "😀", "👍🏽", "e-mail", "3.5", "U.S.", "...", "--", "!", "?", ";", ",", "|||", "||", "&", "<tag>",
          "#tag", "$5", "50%", "\t", "\u3000", "\xa0", "\x1c", "Ω", "ß", "İ", "ﬁ", "x\u0301", "/", "~", "http://x.y/z"]


def unicode_corpus(n: int, seed: int, pieces=PIECES):
    """Captions of words, unicode (CJK, emoji, combining marks, odd spaces) and punctuation, repeated rows."""
    rng = random.Random(seed)
    text = lambda: " ".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) + " x"  # noqa: E731
    cands = [text() for _ in range(n)]
    refs = [[text() for _ in range(rng.randint(1, 5))] for _ in range(n)]
    for i in range(0, n, 7):
        cands[i], refs[i] = cands[i // 2], list(refs[i // 2])
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


def assert_equal_to_1e12(ours, theirs, what=""):
    ours, theirs = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    assert ours.shape == theirs.shape, what
    worst = np.abs(ours - theirs) / np.maximum(np.abs(theirs), np.finfo(float).tiny)
    assert np.all(np.abs(ours - theirs) <= 1e-12 * np.abs(theirs)), f"{what}: relative difference {worst.max():.1e}"


def pycocoevalcap_all(cands, refs, meteor, tokenize=True) -> dict[str, tuple]:
    """Every classic metric by pycocoevalcap on the same rows: {name: (corpus, per-item)}."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    bleu, bleu_items = direct(Bleu(4), cands, refs, tokenize)
    out = {f"bleu{n}": (bleu[n - 1], bleu_items[n - 1]) for n in range(1, 5)}
    for name, scorer in (("meteor", meteor), ("rouge_l", Rouge()), ("cider", Cider())):
        out[name] = direct(scorer, cands, refs, tokenize)
    return out


def assert_all_equal_pycocoevalcap(cands, refs, meteor, tokenize=True, **load):
    from capeval_plugins import runner

    ours = runner.score_many({n: capeval_plugins.load(n, tokenize=tokenize, **load) for n in CLASSIC}, None,
                             cands, refs)
    theirs = pycocoevalcap_all(cands, refs, meteor, tokenize)
    for name in CLASSIC:
        assert_equal_to_1e12(ours[name].score, theirs[name][0], f"{name} corpus")
        assert_equal_to_1e12(np.asarray(ours[name].scores), theirs[name][1], f"{name} per item")
    return ours


@needs_java
def test_bleu_rouge_cider_equal_pycocoevalcap_run_directly_through_batches():
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    cands, refs = corpus()
    bleu, bleu_items = direct(Bleu(4), cands, refs)
    for n in range(1, 5):
        ours = capeval_plugins.load(f"bleu{n}", batch_size=7)(None, cands, refs)
        assert_equal_to_1e12(ours.score, bleu[n - 1])
        assert_equal_to_1e12(np.asarray(ours.scores), bleu_items[n - 1])
        # corpus BLEU pools n-gram counts: it is not the mean of sentence BLEU
        assert not math.isclose(ours.score, float(ours.scores.mean()), rel_tol=1e-3)
    for name, scorer in (("rouge_l", Rouge()), ("cider", Cider())):
        score, items = direct(scorer, cands, refs)
        ours = capeval_plugins.load(name, batch_size=5)(None, cands, refs)
        assert_equal_to_1e12(ours.score, score, name)
        assert_equal_to_1e12(np.asarray(ours.scores), items, name)


@needs_java
def test_meteor_equals_pycocoevalcap_and_its_corpus_score_is_its_own_aggregate(coco_meteor):
    """(pycocoevalcap's METEOR loads the jar's full paraphrase table; ours the entries the corpus can use.)"""
    cands, refs = corpus(12, seed=1)
    cands[7], refs[7] = refs[2][0], [refs[2][0]]  # a perfect one-chunk match: METEOR's sum leaves its chunk out
    java.METEOR.reset()
    ours = capeval_plugins.load("meteor", batch_size=5)(None, cands, refs)
    assert java.METEOR.used == "corpus"
    score, items = direct(coco_meteor, cands, refs)
    assert_equal_to_1e12(ours.score, score)
    assert_equal_to_1e12(np.asarray(ours.scores), items)
    assert not math.isclose(score, float(np.mean(items)), rel_tol=1e-6)


def flickr8k_rows(n_images: int):
    """Flickr8k-Expert as the benchmark scores it: one row per expert rating (each caption three times)."""
    pairs = flickr8k_pairs(n_images)  # skips without the data
    from conftest import FLICKR8K_EXPERT

    records = list(json.loads(FLICKR8K_EXPERT.read_text()).values())[:n_images]
    rows = [(j["caption"], list(r["ground_truth"])) for r in records for j in r["human_judgement"]]
    assert len({c for c, _ in rows}) == len(set(pairs.candidates))
    return [c for c, _ in rows], [r for _, r in rows]


@needs_java
def test_every_classic_metric_equals_pycocoevalcap_on_flickr8k_expert_rows(coco_meteor):
    """Real captions (every row of 40 Flickr8k-Expert images, three per caption as the benchmark scores them):
    every per-item and corpus value of BLEU-1..4, METEOR, ROUGE-L and CIDEr-D to 1e-12 of pycocoevalcap's
    (benchmarks/peers.py finds all 16,992 rows bit-equal)."""
    cands, refs = flickr8k_rows(40)
    assert len(cands) > 600 and len(set(cands)) < len(cands)
    java.METEOR.reset()
    ours = assert_all_equal_pycocoevalcap(cands, refs, coco_meteor)
    assert java.METEOR.used == "corpus"
    assert 0 < ours["bleu4"].score < ours["bleu1"].score < 1 and ours["cider"].scores.std() > 0.1


VATEX = Path(os.environ.get("CAPEVAL_BENCHDATA", BENCHDATA)) / "vatex_eval" / "vid_cans_score_dict.json"


@needs_java
def test_every_classic_metric_equals_pycocoevalcap_on_vatex_eval_nine_references(coco_meteor):
    if not VATEX.is_file():
        pytest.skip(f"VATEX-EVAL is not at {VATEX} (set CAPEVAL_BENCHDATA)")
    videos = list(json.loads(VATEX.read_text()).values())[:30]
    cands = [c for v in videos for c in v["cands"]]
    refs = [list(v["refs"][0]) for v in videos for _ in v["cands"]]
    assert {len(r) for r in refs} == {9} and len(cands) == 180
    java.METEOR.reset()
    assert_all_equal_pycocoevalcap(cands, refs, coco_meteor)
    assert java.METEOR.used == "corpus"


@needs_java
@pytest.mark.parametrize("seed", [0, 1])
def test_every_classic_metric_equals_pycocoevalcap_on_random_unicode_captions(seed, coco_meteor):
    """PTB tokenisation of distinct texts in one call (stdin) gives pycocoevalcap's tokens (a temporary file per
    dict), and every metric its numbers, on captions of CJK, emoji, combining marks, odd spaces, quotes, pipes."""
    cands, refs = unicode_corpus(60, seed)
    assert_all_equal_pycocoevalcap(cands, refs, coco_meteor)
    assert java.METEOR.used == "full"  # characters outside what the cut table's argument covers


@needs_java
def test_untokenised_text_equals_pycocoevalcap_given_the_same_text(coco_meteor):
    """tokenize=False takes the text as given, as pycocoevalcap's scorers do (double spaces and tabs included:
    ROUGE-L splits on single spaces). Not here: "|||" and line breaks, which pycocoevalcap cannot pass to
    METEOR (see the next tests)."""
    pieces = [p for p in PIECES if "|||" not in p] + ["  ", "\t"]
    cands, refs = unicode_corpus(40, seed=3, pieces=pieces)
    assert_all_equal_pycocoevalcap(cands, refs, coco_meteor, tokenize=False)


@needs_java
def test_meteor_takes_the_full_paraphrase_table_for_references_with_its_placeholder_word(coco_meteor):
    """METEOR's normaliser turns "DOTMULTI" (also written with dots inside) into dots, joining what was around
    it ("dogDOTMULTIs" reads "dog.s"): references holding it get the full paraphrase table; candidates may hold
    it (a paraphrase match needs a phrase of a reference). The jar's own scores either way."""
    from capeval_plugins.resources import meteor_table
    from capeval_plugins.metrics.coco import meteor_jar

    cands = ["a dogDOTMULTIs run", "two D.O.T.M.U.L.T.I. cats", "a dog runs"]
    refs = [["dogs run on grass"], ["two cats sit"], ["a dog is running"]]
    for text in cands[:2]:
        assert meteor_table.phrases(meteor_jar(), [text], ["a dog"]).reason.endswith("placeholder DOTMULTI")
        assert meteor_table.phrases(meteor_jar(), ["a dog"], [text]).index is not None
    java.METEOR.reset()
    for cands, refs, table in ((cands, refs, "corpus"), ([r[0] for r in refs], [[c] for c in cands], "full")):
        ours = capeval_plugins.load("meteor", tokenize=False)(None, cands, refs)
        assert java.METEOR.used == table and (table == "corpus" or "DOTMULTI" in java.METEOR.full_reason)
        score, items = direct(coco_meteor, cands, refs, tokenize=False)
        assert_equal_to_1e12(ours.score, score)
        assert_equal_to_1e12(np.asarray(ours.scores), items)
    # the option: the jar's own table for any corpus
    full = capeval_plugins.load("meteor", tokenize=False, paraphrases="full")(None, cands[2:], refs[2:])
    assert java.METEOR.used == "full" and java.METEOR.table is None
    assert_equal_to_1e12(np.asarray(full.scores), items[2:])


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
    assert not np.allclose(np.asarray(alone.scores), np.asarray(single.scores)[:5])


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


@needs_java
@pytest.mark.parametrize("empty", ["", "\U0001f436", "\u200b", "...", "\x01", " "])
def test_a_caption_that_tokenises_to_nothing_scores_like_stocks_wherever_it_falls(empty):
    """The last line the tokenizer is sent may hold no token (an empty caption, emoji only, the newest caption
    of a validation loop whose references it already knows): every caption gets stock's tokens, each on its own."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    from capeval_plugins.metrics import coco

    texts = ["A dog runs.", empty, "Two cats!", empty]
    stock = [PTBTokenizer().tokenize({0: [{"caption": t}]})[0][0] for t in texts]
    for order in (texts, texts[::-1], [empty], [empty, empty]):
        coco.forget_prepared()
        assert coco.ptb_texts(order) == [stock[texts.index(t)] for t in order]
    coco.forget_prepared()
    refs = [["a dog on grass", "a brown dog"], ["a cat on a sofa"]]
    cider = capeval_plugins.load("cider")
    cider(None, ["a dog", "a cat"], refs)  # the references known: only the new captions go to the tokenizer
    assert cider(None, ["a dog", empty], refs).scores[1].item() == 0.0


def test_missing_java_is_a_clear_error(monkeypatch):
    from capeval_plugins.metrics import coco

    coco.forget_prepared()
    java.METEOR.stop()  # a JVM already running proves nothing
    monkeypatch.setattr(java.shutil, "which", lambda name: None)
    with pytest.raises(RequirementError, match="Java runtime.*tokenize=False"):  # before anything is scored
        capeval_plugins.load("bleu4")(None, ["a dog"], [["a dog runs"]])
    with pytest.raises(RequirementError, match=r"meteor \(METEOR\) need a Java runtime"):  # before anything is scored
        capeval_plugins.load("meteor", tokenize=False)(None, ["a dog"], [["a dog runs"]])
    with pytest.raises(ExternalToolError, match="METEOR needs a Java runtime"):  # past the preflight, still clear
        java.require_java("METEOR")


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
    cands, refs = corpus(25, seed=3)
    single = capeval_plugins.load("cider", tokenize=False)(None, cands, refs)
    spawn_ranks(_ddp_worker, (2, free_port(), str(tmp_path)))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["indices"] == list(range(25))
        assert got["scores"] == pytest.approx(single.scores.tolist(), rel=1e-12)
        assert got["score"] == pytest.approx(single.score, rel=1e-12)


@needs_java
def test_one_pass_prepares_the_corpus_once_and_as_each_metric_alone_would(monkeypatch):
    """The classic metrics of a pass share one PTB call, one check of the inputs and one n-gram count (the
    prepared corpus is found again by the content of their states), and give what each gives alone."""
    from capeval_plugins import inputs, runner
    from capeval_plugins.metrics import coco

    cands, refs = corpus(30, seed=5)
    coco.forget_prepared()
    calls, checked = [], []
    ptb, caption_problem = java.ptb_files, inputs.caption_problem
    monkeypatch.setattr(java, "ptb_files", lambda texts, jar: calls.append(sum(t.count("\n") for t in texts))
                        or ptb(texts, jar))
    monkeypatch.setattr(inputs, "caption_problem", lambda c: checked.append(c) or caption_problem(c))
    names = ("bleu1", "bleu4", "rouge_l", "cider")
    results = runner.score_many({n: capeval_plugins.load(n) for n in names}, None, cands, refs)
    assert len(calls) == 1  # was two per metric
    lines = [[r for rs in refs for r in rs], cands]  # pycocoevalcap's two calls: each line in its context once
    keys = len({key for seq in lines for key in coco.ptb_keys(seq)[0] if key is not None})
    assert keys <= calls[0] <= 2 * keys + 8
    assert len(checked) == len(cands)  # was once per metric
    for name in names:  # the same numbers as each metric on its own
        coco.forget_prepared()
        alone = capeval_plugins.load(name)(None, cands, refs)
        assert_equal_to_1e12(results[name].score, alone.score, name)
        assert_equal_to_1e12(np.asarray(results[name].scores), np.asarray(alone.scores), name)


@needs_java
def test_meteor_reads_pipes_in_a_reference_as_words_not_as_a_separator():
    """METEOR's protocol splits a request at every "|||": a reference holding it became two references, and a
    candidate matching one half scored 1.0. Pipes are spaced out, which METEOR's normaliser reads as the same
    words, so untokenised text scores as its PTB-tokenised form does (PTB splits the pipes too)."""
    meteor = capeval_plugins.load("meteor", tokenize=False)
    cands, refs = ["a cat runs on the grass"], [["a dog sits ||| a cat runs on the grass"]]
    piped = meteor(None, cands, refs)
    spaced = meteor(None, cands, [["a dog sits | | | a cat runs on the grass"]])
    assert piped.score == spaced.score < 0.9
    tokenized = capeval_plugins.load("meteor")(None, cands, refs)
    assert tokenized.score == piped.score
    # the candidate side too, and runs of any length
    assert meteor(None, ["a cat |||| runs"], [["a cat | | | | runs"]]).score == \
        meteor(None, ["a cat | | | | runs"], [["a cat | | | | runs"]]).score


@needs_java
def test_meteor_line_breaks_inside_untokenised_text_keep_every_row_its_own():
    """A line break inside a caption ended METEOR's request early and shifted every later answer onto the
    wrong row; it reads as a space."""
    meteor = capeval_plugins.load("meteor", tokenize=False)
    cands, refs = ["a dog\nruns", "a cat\rsits", "two birds"], [["a dog runs"], ["a cat sits"], ["two birds fly"]]
    broken = meteor(None, cands, refs)
    spaced = meteor(None, [c.replace("\n", " ").replace("\r", " ") for c in cands], refs)
    assert broken.scores.tolist() == spaced.scores.tolist() and broken.score == spaced.score


@pytest.fixture
def fake_meteor(monkeypatch):
    """METEOR's protocol spoken by tests/helpers/fake_meteor.py: `fake_meteor("die", "trigger")`."""
    java.METEOR.stop()

    def use(mode: str, trigger: str = "never matches") -> None:
        java.METEOR.stop()
        monkeypatch.setattr(java, "meteor_command", lambda jar: [PYTHON, str(FAKE_METEOR), mode, trigger])

    yield use
    java.METEOR.stop()


SEGMENTS = [("a dog runs", ["a dog", "dogs"]), ("a cat", ["a cat sits"]), ("a dog runs", ["a dog", "dogs"]),
            ("poison here", ["x"]), ("two birds", ["birds"])]


def test_a_dying_java_tool_is_a_clear_error_at_once_naming_the_segment(fake_meteor):
    fake_meteor("die", "poison")
    with pytest.raises(ExternalToolError) as info:
        java.METEOR.score("meteor.jar", SEGMENTS)
    assert "ended before answering (exit status 1)" in str(info.value)
    assert "OutOfMemoryError" in info.value.cli_message and "\n" not in info.value.cli_message
    assert info.value.segment == 3
    assert java.METEOR.jvms == []  # stopped: the next call starts a fresh one


def test_a_silent_java_tool_is_given_up_after_the_timeout(fake_meteor, monkeypatch):
    fake_meteor("hang", "poison")
    java.METEOR.score("meteor.jar", SEGMENTS[:2])  # started and answering
    monkeypatch.setenv(java.TIMEOUT_ENV, "1")
    child = java.METEOR.jvms[0].child
    with pytest.raises(ExternalToolError, match=f"no answer for 1 s.*{java.TIMEOUT_ENV}"):
        java.METEOR.score("meteor.jar", SEGMENTS)
    assert child.proc.poll() is not None  # killed, not left behind


def test_an_answer_out_of_protocol_is_an_error_not_a_misaligned_score(fake_meteor):
    fake_meteor("garbage", "poison")
    with pytest.raises(ExternalToolError, match="answered 'Error: specify"):
        java.METEOR.score("meteor.jar", SEGMENTS)
    fake_meteor("ok")
    assert len(java.METEOR.score("meteor.jar", SEGMENTS)[1]) == len(SEGMENTS)  # a fresh one works


def test_segments_spread_over_several_jvms_give_one_jvms_answers(fake_meteor, monkeypatch):
    """Repeated segments are scored once, spread over the JVMs, and counted per row in the one EVAL."""
    monkeypatch.setattr(java, "max_jvms", lambda: 8)  # whatever this machine's CPUs
    fake_meteor("ok")
    rows = [0, 1, 2, 3, 4, 0, 4]
    one = java.METEOR.score("meteor.jar", SEGMENTS, rows)
    three = java.METEOR.score("meteor.jar", SEGMENTS, rows, jvms=3)
    assert len(java.METEOR.jvms) == 3 and one == three
    # the fake's per-row score is a function of its request alone; the corpus its sum over every row
    expected = [len(h) + 0.5 + len(r) for h, r in (SEGMENTS[k] for k in rows)]
    assert one[1] == pytest.approx(expected) and one[0] == pytest.approx(sum(expected))
    fake_meteor("die", "birds")
    with pytest.raises(ExternalToolError) as info:  # a failure in one JVM stops them all, at once
        java.METEOR.score("meteor.jar", SEGMENTS, rows, jvms=3)
    assert info.value.segment == 4 and java.METEOR.jvms == []


@pytest.mark.slow
@needs_java
def test_a_megabyte_caption_ends_the_run_with_exit_2_not_a_hang(tmp_path):
    """METEOR's JVM runs out of memory on a 1 MB caption: the command ends with exit 2 and one line naming the
    sample (pycocoevalcap's wrapper waited forever, its lock held, and hung again at exit)."""
    rng = random.Random(0)
    huge = " ".join(rng.choice(WORDS) for _ in range(200_000))
    captions = tmp_path / "captions.jsonl"
    rows = [("a dog runs", ["a dog running"]), (huge, ["a dog on the grass"]), ("a cat", ["a cat sits"])]
    captions.write_text("".join(json.dumps({"caption": c, "references": r}) + "\n" for c, r in rows))
    out = subprocess.run([PYTHON, "-m", "capeval_plugins.cli", "score", "-m", "meteor", "--captions", str(captions),
                          "--out", str(tmp_path / "scores.jsonl"), "--quiet"], capture_output=True, text=True,
                         timeout=HANG_GUARD)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "METEOR (Java)" in lines[0] and "sample 1" in lines[0], out.stderr


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
    loud = subprocess.run(base + ["--out", str(tmp_path / "a.jsonl")], capture_output=True, text=True, timeout=HANG_GUARD)
    assert loud.returncode == 0, loud.stderr
    assert loud.stderr.count("PTBTokenizer tokenized") == 1  # once for the pass (was 6 lines)
    assert "corpus scores" in loud.stderr and "cider" in loud.stderr
    quiet = subprocess.run(base + ["--out", str(tmp_path / "b.jsonl"), "--quiet"], capture_output=True, text=True,
                           timeout=HANG_GUARD)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr.strip() == ""


def test_ptb_tokens_are_remembered_so_a_line_meets_the_tokenizer_once(monkeypatch):
    """A validation loop's references come back every epoch: the same lines in the same order start no tokenizer
    the second time, and give the tokens the first gave (and a fresh process gives)."""
    from capeval_plugins.metrics import coco

    coco.forget_prepared()
    calls = []
    ptb = java.ptb_files
    monkeypatch.setattr(java, "ptb_files", lambda texts, jar: calls.append(list(texts)) or ptb(texts, jar))
    lines = ["A dog runs.", "Two cats!", "A dog runs."]
    first = coco.ptb_texts(lines)
    assert len(calls) == 1 and coco.ptb_texts(lines) == first == ["a dog runs", "two cats", "a dog runs"]
    assert len(calls) == 1 and coco.ptb_texts([]) == []
    coco.forget_prepared()
    assert coco.ptb_texts(lines) == first and len(calls) == 2
    monkeypatch.setattr(coco, "PTB_KEPT", 2)  # the memory stays within its bound, every line still tokenised
    coco.forget_prepared()
    assert coco.ptb_texts(["a b", "c d", "e f"]) == ["a b", "c d", "e f"] and len(coco._ptb_known) <= 2


# Lines whose tokens depend on the line after them in one tokenizer call: Stanford's lexer splits the final
# period off an abbreviation when the next line starts a sentence ("A ..."), and off some ("etc.") at the end
NEIGHBOURS = ["a sign with the letter b.", "A dog plays in a field.", "the man etc.", "a dog runs .", "the u.s.",
              "", "A cat sleeps.", "a b.", "The", ":)", "Mr.", "\U0001f436", "  "]


@needs_java
def test_ptb_tokens_are_stocks_for_the_same_sequence_whatever_came_before():
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    from capeval_plugins.metrics import coco

    orders = [NEIGHBOURS, NEIGHBOURS[::-1], NEIGHBOURS[2:] + NEIGHBOURS[:2], [NEIGHBOURS[0]], NEIGHBOURS[:2],
              [NEIGHBOURS[2], ""], [NEIGHBOURS[4], "", "", NEIGHBOURS[1]], [NEIGHBOURS[2], NEIGHBOURS[1]],
              ["a b.", "The"], ["a b.", "The", "x"], ["a b.", "Mr."], [":)"], ["etc.", ":)"], [":)", "a dog"],
              ["a b.", "", "", "", "The", "  "], ["\U0001f436"], ["", ""]]
    stock = []
    for order in orders:
        made = PTBTokenizer().tokenize({i: [{"caption": t}] for i, t in enumerate(order)})
        stock.append([made[i][0] for i in range(len(order))])
    assert stock[3] != stock[4][:1] and stock[8][0] != stock[9][0]  # the tokens do depend on the neighbours
    assert stock[11] != stock[13][:1]  # and on the end of the input
    coco.forget_prepared()
    for order, expected in zip(orders, stock):  # one after another: what came before changes nothing
        assert coco.ptb_texts(order) == expected, order
    coco.forget_prepared()
    for order, expected in reversed(list(zip(orders, stock))):
        assert coco.ptb_texts(order) == expected, order


@needs_java
def test_classic_scores_do_not_depend_on_what_the_process_scored_before():
    """Scores equal pycocoevalcap's loop on the same corpus, in a fresh process or after another corpus."""
    from capeval_plugins.metrics import coco

    cands = ["a sign with the letter b.", "A dog plays in a field."]
    refs = [["a sign with the letter b"], ["a dog playing in a field"]]
    stock = stock_loop(cands, refs)
    coco.forget_prepared()
    alone = capeval_plugins.load("bleu4")(None, cands[:1], refs[:1]).scores.tolist()
    both = capeval_plugins.load("bleu4")(None, cands, refs).scores.tolist()
    again = capeval_plugins.load("bleu4")(None, cands[:1], refs[:1]).scores.tolist()
    close = dict(rel=1e-12, abs=1e-15)  # (the same float operations; the tolerance only absorbs a foreign BLAS)
    assert again == alone and alone == pytest.approx(stock_loop(cands[:1], refs[:1])["bleu4"], **close)
    assert both == pytest.approx(stock["bleu4"], **close)
    assert alone[0] != pytest.approx(both[0], abs=1e-3)  # (stock's tokens of the first depend on the second)
    for name in ("cider", "rouge_l"):
        assert capeval_plugins.load(name)(None, cands, refs).scores.tolist() == pytest.approx(stock[name], **close)
        assert capeval_plugins.load(name)(None, cands[::-1], refs[::-1]).scores.tolist() == pytest.approx(
            stock_loop(cands[::-1], refs[::-1])[name], **close)


def stock_loop(cands: list[str], refs: list[list[str]]) -> dict[str, list[float]]:
    """pycocoevalcap's own loop: PTB on the references, then on the candidates, then each scorer."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    tokenizer = PTBTokenizer()
    gts = tokenizer.tokenize({i: [{"caption": r} for r in rs] for i, rs in enumerate(refs)})
    res = tokenizer.tokenize({i: [{"caption": c}] for i, c in enumerate(cands)})
    return {"bleu4": [float(x) for x in Bleu(4).compute_score(gts, res, verbose=0)[1][3]],
            "cider": [float(x) for x in Cider().compute_score(gts, res)[1]],
            "rouge_l": [float(x) for x in Rouge().compute_score(gts, res)[1]]}


def test_a_run_of_blank_captions_costs_a_line_each():
    """Each blank line's key held the rest of the run: a captioner answering "" for 16,000 rows cost seconds and
    the tokenizer millions of lines."""
    import time

    from capeval_plugins.metrics import coco

    lines = [""] * 16_000 + ["a dog", "a cat"] + [" "] * 16_000
    start = time.process_time()
    keys, tail = coco.ptb_keys(lines)
    assert time.process_time() - start < 1.0  # (about 0.01 s; quadratic, it took 2.5 s)
    assert keys[:16_000] == [None] * 16_000 and tail == 16_000
