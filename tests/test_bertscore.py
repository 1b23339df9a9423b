"""BERTScore against the bert_score package (0.3.13) run side by side on the same tiny DeBERTa-v3 checkpoint.

bert_score runs unchanged on transformers 5 for DeBERTa-v2/v3 checkpoints (no shim needed). It is given
num_layers explicitly because its layer table only knows hub ids, not a local path. bert_score runs batched (its
default batch_size=64) against our default ``matching="bert_score_batched"``, and one pair per batch against
``matching="per_pair"``; the real-model comparisons are in test_real_weights.py."""
from __future__ import annotations

import importlib
import json
import random

import pytest
import torch
from conftest import PYTHON, free_port, run, spawn_ranks

import capeval_plugins

bert_score = pytest.importorskip("bert_score")

CANDIDATES = [
    "A dog runs on the grass.",
    "  Two children play in the park!  ",
    "a red car next to a building",
    "An old man sits on a bench under a tree.",
    "A dog runs.",
]
# Different numbers of references; one reference shared by two samples (idf counts it twice, as bert_score).
REFERENCES = [
    ["A dog running on grass.", "A brown dog plays outside."],
    ["Kids playing in a park."],
    ["A car parked by a building.", "A red car.", "A vehicle on a street."],
    ["A man sitting on a bench.", "An elderly man rests under a tree."],
    ["A dog running on grass.", "A dog in a field.", "Grass.", "A happy dog runs fast.", "The dog is outside."],
]
LAST_LAYER = 2  # the tiny checkpoint has two blocks


@pytest.fixture(scope="session")
def tiny_deberta(tiny_root) -> str:
    from capeval_plugins.testing import tiny_checkpoint

    return str(tiny_checkpoint("deberta_v3", root=tiny_root))


def close(got, expected, atol):
    torch.testing.assert_close(got.double(), expected.double(), atol=atol, rtol=0)


def theirs(path, cands, refs, num_layers=LAST_LAYER, **kwargs):
    kwargs.setdefault("nthreads", 0)
    kwargs.setdefault("batch_size", 64)
    p, r, f = bert_score.score(cands, refs, model_type=path, num_layers=num_layers, **kwargs)
    return torch.stack([p, r, f], -1).double()


def ours(path, cands, refs, **config):
    result = capeval_plugins.load("bertscore", model=path, **config)(None, cands, refs)
    return torch.stack([result.extras["precision"], result.extras["recall"], result.scores], -1), result


@pytest.mark.parametrize("idf", [False, True])
@pytest.mark.parametrize("several", [False, True], ids=["one-reference", "several-references"])
def test_equals_bert_score(tiny_deberta, idf, several):
    refs = REFERENCES if several else [r[:1] for r in REFERENCES]
    expected = theirs(tiny_deberta, CANDIDATES, refs, idf=idf)
    got, result = ours(tiny_deberta, CANDIDATES, refs, idf=idf)
    close(got, expected, 1e-5)
    assert result.extras["f1"].tolist() == result.scores.tolist()
    assert result.score == pytest.approx(expected[:, 2].mean().item(), abs=1e-5)


@pytest.mark.parametrize("idf", [False, True])
@pytest.mark.parametrize("pair_batch", [64, 3, 1])
def test_both_matchings_equal_bert_score_at_its_batch_size(tiny_deberta, idf, pair_batch):
    """bert_score_batched equals bert_score at the same batch_size (set here through pair_batch_size, so the
    runner's own batching differs); per_pair equals bert_score one pair per batch, whatever our batch size."""
    batched = theirs(tiny_deberta, CANDIDATES, REFERENCES, idf=idf, batch_size=pair_batch)
    got, _ = ours(tiny_deberta, CANDIDATES, REFERENCES, idf=idf, pair_batch_size=pair_batch, batch_size=2)
    close(got, batched, 1e-5)
    single = theirs(tiny_deberta, CANDIDATES, REFERENCES, idf=idf, batch_size=1)
    got, _ = ours(tiny_deberta, CANDIDATES, REFERENCES, idf=idf, matching="per_pair", batch_size=pair_batch)
    close(got, single, 1e-5)


def test_bert_score_in_batches_differs_only_by_its_zero_padding(tiny_deberta):
    """bert_score pads a batch of pairs and multiplies the similarities by the padding mask, so padding has
    cosine 0: a token whose cosines are all negative gets 0 when the other side is padded in that batch, and
    the result depends on the batch. Here its batched output is reproduced from per-pair best similarities
    with exactly that floor, and no other change (an independent computation of what the option does)."""
    from capeval_plugins.models.encoders.common import EncoderSpec
    from capeval_plugins.models.encoders.text import TextEncoder
    from capeval_plugins.core.matching import best_similarities, f_measure, weighted_mean

    cands = [c for c, refs in zip(CANDIDATES, REFERENCES) for _ in refs]
    refs = [r for rs in REFERENCES for r in rs]
    batched = theirs(tiny_deberta, cands, refs, batch_size=64)
    assert not torch.allclose(batched, theirs(tiny_deberta, cands, refs, batch_size=1), atol=1e-4)  # it shows here
    enc = TextEncoder.shared(EncoderSpec(tiny_deberta))
    c, r = enc.embed(cands), enc.embed(refs)
    cand_best, ref_best = best_similarities(c.embeddings, c.attention_mask, r.embeddings, r.attention_mask)
    ref_padded = r.attention_mask.sum(1) < r.attention_mask.shape[1]
    cand_padded = c.attention_mask.sum(1) < c.attention_mask.shape[1]
    cand_best = torch.where(ref_padded[:, None], cand_best.clamp_min(0), cand_best)
    ref_best = torch.where(cand_padded[:, None], ref_best.clamp_min(0), ref_best)
    p = weighted_mean(cand_best, c.attention_mask & ~c.special)
    rec = weighted_mean(ref_best, r.attention_mask & ~r.special)
    close(torch.stack([p, rec, f_measure(p, rec)], -1), batched, 1e-5)


def test_other_layer_equals_bert_score(tiny_deberta):
    expected = theirs(tiny_deberta, CANDIDATES, REFERENCES, num_layers=1)
    got, _ = ours(tiny_deberta, CANDIDATES, REFERENCES, num_layers=1)
    close(got, expected, 1e-5)
    # the card's other spellings, refused by the option's bound (>= 1) before: -1 = the last block, 0 = the
    # embeddings (bert_score's own num_layers=0 fails inside transformers 5's DeBERTa; hidden_state_at reads it)
    close(ours(tiny_deberta, CANDIDATES, REFERENCES, num_layers=-1)[0],
          ours(tiny_deberta, CANDIDATES, REFERENCES, num_layers=LAST_LAYER)[0], 0)
    embeddings = ours(tiny_deberta, CANDIDATES, REFERENCES, num_layers=0)[0]
    assert torch.isfinite(embeddings).all() and not torch.allclose(embeddings.double(), got.double(), atol=1e-3)


def test_idf_references_equal_bert_scores_idf_dict(tiny_deberta):
    from bert_score.utils import get_idf_dict
    from transformers import AutoTokenizer

    corpus = ["A dog on the grass.", "A man and a dog.", "Children in a park.", "A red car."] * 2 + ["A tree."]
    idf_dict = get_idf_dict(corpus, AutoTokenizer.from_pretrained(tiny_deberta), nthreads=0)
    expected = theirs(tiny_deberta, CANDIDATES, REFERENCES, idf=idf_dict)
    got, _ = ours(tiny_deberta, CANDIDATES, REFERENCES, idf=True, idf_references=corpus)
    close(got, expected, 1e-5)


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_rescaling_with_a_baseline_file_equals_bert_score(tiny_deberta, tmp_path):
    path = tmp_path / "baseline.tsv"
    path.write_text("LAYER,P,R,F\n0,0.10,0.20,0.30\n1,0.35,0.40,0.45\n2,0.50,0.55,0.60\n")
    expected = theirs(tiny_deberta, CANDIDATES, REFERENCES, rescale_with_baseline=True, baseline_path=str(path),
                      lang="en")
    got, _ = ours(tiny_deberta, CANDIDATES, REFERENCES, rescale_with_baseline=True, baseline_path=str(path))
    close(got, expected, 1e-5)


def test_mean_over_references_equals_the_mean_of_single_reference_scores(tiny_deberta):
    flat_cands = [c for c, refs in zip(CANDIDATES, REFERENCES) for _ in refs]
    flat_refs = [r for refs in REFERENCES for r in refs]
    single = theirs(tiny_deberta, flat_cands, flat_refs)
    got, _ = ours(tiny_deberta, CANDIDATES, REFERENCES, multi_reference="mean")  # bert_score_batched: same pairs
    close(got, _mean_by_sample(single), 1e-5)
    single = theirs(tiny_deberta, flat_cands, flat_refs, batch_size=1)
    got, _ = ours(tiny_deberta, CANDIDATES, REFERENCES, multi_reference="mean", matching="per_pair")
    close(got, _mean_by_sample(single), 1e-5)


def _mean_by_sample(flat):
    rows, start = [], 0
    for refs in REFERENCES:
        rows.append(flat[start : start + len(refs)].mean(0))
        start += len(refs)
    return torch.stack(rows)


def test_per_pair_is_independent_of_batch_size_and_order(tiny_deberta):
    idf = True  # the harder case: the weights come from every batch's references
    base, _ = ours(tiny_deberta, CANDIDATES, REFERENCES, idf=idf, matching="per_pair")
    for batch_size in (1, 3):
        # idf is counted over the whole corpus at finalize, whatever the batching.
        other, _ = ours(tiny_deberta, CANDIDATES, REFERENCES, idf=idf, batch_size=batch_size, matching="per_pair")
        close(other, base, 1e-6)
    order = list(range(len(CANDIDATES)))
    random.Random(0).shuffle(order)
    shuffled, _ = ours(tiny_deberta, [CANDIDATES[i] for i in order], [REFERENCES[i] for i in order], idf=idf,
                       batch_size=2, matching="per_pair")
    close(shuffled, base[order], 1e-6)


def test_bert_score_batched_depends_only_on_the_pair_batches(tiny_deberta):
    """The runner's batching, a streaming adapter's updates and the corpus cache change nothing: only the
    pairs' order and pair_batch_size do (as in bert_score)."""
    from capeval_plugins.adapters.torchmetrics import CapevalMetric

    base, _ = ours(tiny_deberta, CANDIDATES, REFERENCES, idf=True, pair_batch_size=3)
    for batch_size in (1, 2, 64):
        other, _ = ours(tiny_deberta, CANDIDATES, REFERENCES, idf=True, pair_batch_size=3, batch_size=batch_size)
        close(other, base, 1e-6)
    streamed = CapevalMetric(metric=capeval_plugins.load("bertscore", model=tiny_deberta, idf=True, pair_batch_size=3))
    for start, stop in ((0, 2), (2, 3), (3, 5)):  # updates that embed their own texts (no corpus hook)
        streamed.update(None, CANDIDATES[start:stop], REFERENCES[start:stop])
    out = streamed.compute_all()
    close(torch.stack([out.extras["precision"], out.extras["recall"], out.scores], -1), base, 1e-6)


TRUNCATION_WARNINGS = """
import json, sys, warnings
import capeval_plugins
long = "a dog runs on the grass near a tree " * 80
cands, refs = [long, "a dog"], [["a dog on grass"], [long]]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    metric = capeval_plugins.load("bertscore", model=sys.argv[1])
    metric(None, cands, refs)
    metric(None, cands, refs)
    capeval_plugins.load("bertscore", model=sys.argv[1], matching="per_pair")(None, cands, refs)
print(json.dumps([str(w.message) for w in caught if "truncated" in str(w.message)]))
"""


def test_long_text_truncated_like_bert_score_and_warned_once(tiny_deberta):
    long = "a dog runs on the grass near a tree " * 80  # far beyond 512 tokens
    cands, refs = [long, "a dog"], [["a dog on grass"], [long]]
    expected = theirs(tiny_deberta, cands, refs, batch_size=1)
    result = capeval_plugins.load("bertscore", model=tiny_deberta, matching="per_pair")(None, cands, refs)
    got = torch.stack([result.extras["precision"], result.extras["recall"], result.scores], -1)
    close(got, expected, 1e-5)
    # Said once per process: in a fresh one (this one's earlier tests may have said it already), three scorings of
    # texts past the limit by two metrics on one model say it exactly once.
    said = json.loads(run([PYTHON, "-c", TRUNCATION_WARNINGS, tiny_deberta]).stdout.splitlines()[-1])
    assert len(said) == 1 and "truncated" in said[0], said


@pytest.mark.parametrize("idf", [False, True])
def test_an_empty_corpus_finalizes_to_nothing(tiny_deberta, idf):
    from capeval_plugins.contract import finalize_state, full_spec, merge_states

    metric = capeval_plugins.load("bertscore", model=tiny_deberta, idf=idf)
    result = finalize_state(metric, merge_states(full_spec(metric), []))
    assert len(result) == 0 and len(result.extras["precision"]) == 0


def test_default_layers_are_bert_scores():
    from bert_score.utils import model2layers

    from capeval_plugins.models.encoders.text import BERT_SCORE_LAYERS, bert_score_layer

    assert all(model2layers[name] == layer for name, layer in BERT_SCORE_LAYERS.items())
    assert bert_score_layer("microsoft/deberta-v3-large") == 12
    assert bert_score_layer("FacebookAI/roberta-large") == 17
    assert bert_score_layer("/some/local/path") is None


def test_bad_options_are_refused(tiny_deberta):
    with pytest.raises(ValueError, match="multi_reference"):
        capeval_plugins.load("bertscore", model=tiny_deberta, multi_reference="min")
    with pytest.raises(ValueError, match="idf=True"):
        capeval_plugins.load("bertscore", model=tiny_deberta, idf_references=["a dog"])
    with pytest.raises(ValueError, match="rescale_with_baseline=True"):  # it was accepted and changed nothing
        capeval_plugins.load("bertscore", model=tiny_deberta, baseline_path="baseline.tsv")
    metric = capeval_plugins.load("bertscore", model=tiny_deberta, rescale_with_baseline=True)
    with pytest.raises(FileNotFoundError, match="baseline_path"):
        metric(None, CANDIDATES[:1], REFERENCES[:1])
    with pytest.raises(ValueError, match="layer 7"):
        capeval_plugins.load("bertscore", model=tiny_deberta, num_layers=7)(None, CANDIDATES[:1], REFERENCES[:1])


def test_evaluate_takes_bert_scores_compute_options(tiny_deberta):
    """``evaluate.load("capeval/bertscore").compute(..., model_type=, num_layers=, idf=, batch_size=, lang=)``:
    evaluate's own ``bertscore`` arguments (bert_score's), giving bert_score's numbers."""
    import evaluate

    metric = evaluate.load("capeval/bertscore")
    out = metric.compute(predictions=CANDIDATES, references=REFERENCES, lang="en", model_type=tiny_deberta,
                         num_layers=LAST_LAYER, idf=True, batch_size=3, verbose=False, nthreads=4)
    expected = theirs(tiny_deberta, CANDIDATES, REFERENCES, idf=True, batch_size=3)
    close(torch.tensor([out["precision"], out["recall"], out["f1"]]).T, expected, 1e-5)
    with pytest.raises(ValueError, match="all_layers=True"):
        metric.compute(predictions=CANDIDATES, references=REFERENCES, model_type=tiny_deberta, all_layers=True)
    loaded = evaluate.load("capeval/bertscore", model=tiny_deberta)  # lang does not override a model named at load
    again = loaded.compute(predictions=CANDIDATES, references=REFERENCES, lang="en", idf=True, batch_size=3)
    assert again["f1"] == pytest.approx(out["f1"], abs=1e-9)


def test_evaluate_sees_it_only_as_capeval_bertscore():
    pytest.importorskip("evaluate")
    from capeval_plugins.adapters.hf_evaluate import evaluate_names

    names = evaluate_names()
    assert names.get("capeval/bertscore") == "bertscore" and "bertscore" not in names



def _ddp_worker(rank: int, world: int, port: int, model: str, out: str) -> None:
    import torch.distributed as dist

    from capeval_plugins.torchmetrics import BERTScore

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # Uneven shards with the repeat a DistributedSampler adds; rank 1 has fewer references per sample.
    shards = {0: [0, 2, 4], 1: [1, 3, 0]}
    metric = BERTScore(model=model, idf=True, batch_size=2)  # built inside the worker
    mine = shards[rank]
    metric.update(None, [CANDIDATES[i] for i in mine], [REFERENCES[i] for i in mine], ids=mine)
    result = metric.compute_all()
    torch.save({"indices": result.indices.tolist(), "scores": result.scores.tolist(),
                "precision": result.extras["precision"].tolist()}, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_process_ddp_with_corpus_idf_equals_single_process(tiny_deberta, tmp_path):
    single = capeval_plugins.load("bertscore", model=tiny_deberta, idf=True)(None, CANDIDATES, REFERENCES)
    spawn_ranks(_ddp_worker, (2, free_port(), tiny_deberta, str(tmp_path)))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["indices"] == list(range(len(CANDIDATES)))
        assert got["scores"] == pytest.approx(single.scores.tolist(), abs=1e-6)
        assert got["precision"] == pytest.approx(single.extras["precision"].tolist(), abs=1e-6)


# --- RoBERTa: bert_score with its prefix space restored -------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_roberta(tiny_root) -> str:
    from capeval_plugins.testing import tiny_checkpoint

    return str(tiny_checkpoint("roberta", root=tiny_root))


def test_roberta_larges_layout_scores_as_the_same_encoder_saved_with_a_pooler(tiny_roberta, tmp_path):
    """roberta-large (and xlm-roberta-*, mpnet-base) is saved from its masked-LM model: an lm_head, no pooler.
    BERTScore reads a layer's hidden states, so that checkpoint is whole for it: it scores as the same encoder
    saved with a pooler would, while a tensor of the encoder itself missing is still refused."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, RobertaModel

    from capeval_plugins.resources.wholeness import ModelLoadError

    masked = load_file(f"{tiny_roberta}/model.safetensors")
    assert not any("pooler" in k for k in masked) and any(k.startswith("lm_head.") for k in masked)
    encoder = {k.removeprefix("roberta."): v for k, v in masked.items() if k.startswith("roberta.")}
    pooled = tmp_path / "pooled"
    shutil.copytree(tiny_roberta, pooled)
    RobertaModel(AutoConfig.from_pretrained(tiny_roberta)).save_pretrained(pooled)  # a pooler of its own
    save_file({**load_file(f"{pooled}/model.safetensors"), **encoder}, f"{pooled}/model.safetensors",
              metadata={"format": "pt"})
    got, _ = ours(tiny_roberta, CANDIDATES, REFERENCES)
    expected, _ = ours(str(pooled), CANDIDATES, REFERENCES)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_roberta, damaged)
    save_file({k: v for k, v in masked.items() if not k.endswith("encoder.layer.1.output.dense.weight")},
              f"{damaged}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"encoder\.layer\.1\.output\.dense\.weight"):
        ours(str(damaged), CANDIDATES, REFERENCES)


def restore_prefix_space(monkeypatch) -> None:
    """bert_score 0.3.13 asks RoBERTa/GPT-2 tokenizers for a leading space per call (``encode(...,
    add_prefix_space=True)``), which transformers 5 ignores: build its tokenizer with the space instead, as
    bert_score meant (and made its rescaling baselines)."""
    from transformers import AutoTokenizer

    def tokenizer(model_type, use_fast=False):
        return AutoTokenizer.from_pretrained(model_type, add_prefix_space=True)

    # bert_score.score is also the name of the function the package exports; patch the module's global
    monkeypatch.setattr(importlib.import_module("bert_score.score"), "get_tokenizer", tokenizer)


@pytest.mark.parametrize("idf", [False, True])
def test_roberta_equals_bert_score_with_its_prefix_space_restored(tiny_roberta, idf, monkeypatch):
    as_installed = theirs(tiny_roberta, CANDIDATES, REFERENCES, idf=idf)  # transformers 5 drops the space here
    restore_prefix_space(monkeypatch)
    expected = theirs(tiny_roberta, CANDIDATES, REFERENCES, idf=idf)
    got, _ = ours(tiny_roberta, CANDIDATES, REFERENCES, idf=idf)
    close(got, expected, 1e-5)
    assert (got - as_installed).abs().max() > 1e-3  # without the space bert_score disagrees: the test sees it


def test_roberta_texts_get_the_leading_space(tiny_roberta):
    from transformers import AutoTokenizer

    from capeval_plugins.models.encoders.common import EncoderSpec
    from capeval_plugins.models.encoders.text import TextEncoder

    enc = TextEncoder.shared(EncoderSpec(tiny_roberta))
    spaced = AutoTokenizer.from_pretrained(tiny_roberta, add_prefix_space=True)
    bare = AutoTokenizer.from_pretrained(tiny_roberta)
    text = "  A dog runs on the grass. "
    assert enc.prefix_space and enc.tokenize([text]) == [spaced.encode(text.strip())]
    assert spaced.encode(text.strip()) != bare.encode(text.strip())


def test_the_runner_embeds_each_distinct_text_of_the_corpus_once(tiny_deberta, monkeypatch):
    """The runner's prepare_corpus hook: one length-sorted pass over the corpus's distinct texts, then batches
    only gather; the cache is dropped after the pass. Same result as batches embedding their own texts."""
    from capeval_plugins.models.encoders.text import TextEncoder

    calls = {"packed": [], "batch": 0}
    packed, per_batch = TextEncoder.embed_packed, TextEncoder.embed

    def counting_packed(self, texts, batch_size=64):
        calls["packed"].append(list(texts))
        return packed(self, texts, batch_size)

    def counting_batch(self, texts, batch_size=64):
        calls["batch"] += 1
        return per_batch(self, texts, batch_size)

    monkeypatch.setattr(TextEncoder, "embed_packed", counting_packed)
    monkeypatch.setattr(TextEncoder, "embed", counting_batch)
    metric = capeval_plugins.load("bertscore", model=tiny_deberta, batch_size=2, matching="per_pair")
    result = metric(None, CANDIDATES, REFERENCES)
    assert len(calls["packed"]) == 1 and calls["batch"] == 0
    assert set(calls["packed"][0]) == set(CANDIDATES) | {r for refs in REFERENCES for r in refs}
    assert metric._corpus is None  # released after the pass
    from capeval_plugins.adapters.torchmetrics import CapevalMetric

    tm = CapevalMetric(metric=metric)
    for start in range(0, len(CANDIDATES), 2):  # each update is a pass of the same loop: its own texts, once
        tm.update(None, CANDIDATES[start:start + 2], REFERENCES[start:start + 2])
    streamed = tm.compute_all()
    assert calls["batch"] == 0 and len(calls["packed"]) == 1 + 3
    assert set(calls["packed"][1]) == set(CANDIDATES[:2]) | {r for refs in REFERENCES[:2] for r in refs}
    close(streamed.scores, result.scores, 1e-6)
    close(streamed.extras["precision"], result.extras["precision"], 1e-6)


# --- an empty caption is an answer: bert_score's number ------------------------------------------------------

EMPTY_CANDIDATES = ["", "A dog runs.", "   ", "a red car next to a building", "\t\n"]


def restore_empty_encoding(monkeypatch) -> None:
    """bert_score encodes an empty text as ``tokenizer.build_inputs_with_special_tokens([])``, which transformers 5
    tokenizers no longer have (it raises AttributeError): give it what that returned, the special tokens alone."""
    utils = importlib.import_module("bert_score.utils")
    original = utils.sent_encode

    def sent_encode(tokenizer, sent):
        if sent.strip() == "":
            return tokenizer("", add_special_tokens=True)["input_ids"]
        return original(tokenizer, sent)

    monkeypatch.setattr(utils, "sent_encode", sent_encode)


@pytest.mark.parametrize("idf", [False, True])
@pytest.mark.parametrize("encoder", ["deberta", "roberta"])
def test_an_empty_caption_scores_as_bert_score(tiny_deberta, tiny_roberta, encoder, idf, monkeypatch, capfd):
    """bert_score encodes an empty or blank caption as its special tokens alone and sets its raw P and R to 0
    (so F to 0), whatever the model; ours gives the same three numbers and the other samples theirs."""
    path = tiny_deberta if encoder == "deberta" else tiny_roberta
    if encoder == "roberta":
        restore_prefix_space(monkeypatch)
    restore_empty_encoding(monkeypatch)
    refs = [r[:2] for r in REFERENCES]
    expected = theirs(path, EMPTY_CANDIDATES, refs, idf=idf)
    assert "Empty candidate sentence detected" in capfd.readouterr().err  # bert_score's own empty case is hit
    got, result = ours(path, EMPTY_CANDIDATES, refs, idf=idf)
    close(got, expected, 1e-5)
    assert got[[0, 2, 4]].abs().max() == 0 and torch.isfinite(result.scores).all()


def test_a_tokenizer_without_a_length_is_held_to_the_models_positions(tiny_roberta, tmp_path, monkeypatch):
    """A tokenizer_config.json without model_max_length (transformers' "no limit" sentinel) let a RoBERTa text of
    more than 512 tokens index past the 514-row position table (its positions start at 2): a traceback. It is
    held to the positions the model has, which is what bert_score does with the same model's 512-token tokenizer."""
    import shutil

    copy = tmp_path / "roberta"
    shutil.copytree(tiny_roberta, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    assert config.pop("model_max_length") == 512
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    long = "a dog runs on the grass near a tree " * 80
    cands, refs = [long, "a dog"], [["a dog on grass"], [long]]
    restore_prefix_space(monkeypatch)  # bert_score's own reading of RoBERTa (see above)
    expected = theirs(tiny_roberta, cands, refs, batch_size=1)
    result = capeval_plugins.load("bertscore", model=str(copy), matching="per_pair")(None, cands, refs)
    close(torch.stack([result.extras["precision"], result.extras["recall"], result.scores], -1), expected, 1e-5)


@pytest.mark.parametrize("length", [0, -5])
def test_a_tokenizer_length_too_short_for_any_text_is_one_line(tiny_roberta, tmp_path, length):
    import shutil

    from capeval_plugins.resources.loading import ModelLoadError, clear_cache

    copy = tmp_path / "roberta"
    shutil.copytree(tiny_roberta, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": length}))
    clear_cache()
    with pytest.raises(ModelLoadError, match=f"model_max_length is {length}"):
        capeval_plugins.load("bertscore", model=str(copy))(None, ["a dog"], [["a dog"]])


def test_a_layer_the_model_lacks_is_a_users_error(tiny_roberta):
    """num_layers past the model's depth is known only once the model loads: an input error (one line, exit 2 on
    the command line), not a ValueError that the command line reports as a bug."""
    from capeval_plugins.inputs import InputError

    with pytest.raises(InputError, match="layer 99 does not exist"):
        capeval_plugins.load("bertscore", model=tiny_roberta, num_layers=99)(None, ["a dog"], [["a dog"]])
