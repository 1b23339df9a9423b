"""``implementation="nltk"`` of bleu1-4 and meteor: NLTK's BLEU and METEOR as Redemption Score's Table 2 ran them
(its released code scores with Hugging Face evaluate's "meteor", i.e. NLTK), checked against NLTK called
directly, and against the paper's Table 2 on Flickr8k-Expert where the benchmark data (and, for METEOR, NLTK's
WordNet) are on the machine."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import BENCHDATA as DEFAULT_BENCHDATA

import capeval_plugins
from capeval_plugins.inputs import InputError

nltk = pytest.importorskip("nltk")
from nltk.tokenize import NLTKWordTokenizer  # noqa: E402
from nltk.translate.bleu_score import SmoothingFunction, corpus_bleu, sentence_bleu  # noqa: E402
from nltk.translate.meteor_score import meteor_score  # noqa: E402

BENCHDATA = Path(os.environ.get("CAPEVAL_BENCHDATA", DEFAULT_BENCHDATA))
FLICKR = BENCHDATA / "flickr8k_expert" / "flickr8k.json"

CANDIDATES = ["A dog runs on the grass.", "Two children play in a park", "a man riding a bike down the street",
              "A dog runs on the grass.", "Cats!"]
REFERENCES = [["A brown dog is running on the grass .", "A dog on a lawn."], ["Kids play in the park.",
              "Two kids playing outside"], ["A man rides his bicycle on a road.", "A cyclist in the street."],
              ["A brown dog is running on the grass .", "A dog on a lawn."], ["A cat sleeps on a sofa."]]


def words(text: str) -> list[str]:
    return NLTKWordTokenizer().tokenize(text.lower())


@pytest.mark.parametrize("order", [2, 4])
def test_nltk_bleu_is_nltk_sentence_and_corpus_bleu(order):
    metric = capeval_plugins.load(f"bleu{order}", implementation="nltk")
    assert not [r for r in metric.requirements() if r.kind == "java"]  # no PTB tokenisation, no Java
    result = metric(None, CANDIDATES, REFERENCES)
    weights = (1 / order,) * order
    refs = [[words(r) for r in group] for group in REFERENCES]
    hyps = [words(c) for c in CANDIDATES]
    expected = [sentence_bleu(r, h, weights, smoothing_function=SmoothingFunction().method1) for r, h in zip(refs, hyps)]
    assert result.scores.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert result.score == pytest.approx(corpus_bleu(refs, hyps, weights), rel=1e-12)
    default = capeval_plugins.load(f"bleu{order}", tokenize=False)(None, CANDIDATES, REFERENCES)
    assert not np.allclose(np.asarray(default.scores), np.asarray(result.scores))  # another reading
    with pytest.raises(ValueError, match="implementation"):
        capeval_plugins.load(f"bleu{order}", implementation="sacrebleu")


class NoSynonyms:
    """A WordNet with no synsets: METEOR matches exact words and stems only (no WordNet data needed)."""

    def synsets(self, *args, **kwargs):
        return []


def test_nltk_meteor_is_nltk_meteor_score_with_the_best_reference(monkeypatch):
    import nltk.corpus

    monkeypatch.setattr(nltk.corpus, "wordnet", NoSynonyms())
    result = capeval_plugins.load("meteor", implementation="nltk")(None, CANDIDATES, REFERENCES)
    expected = [meteor_score([words(r) for r in group], words(c), wordnet=NoSynonyms())
                for c, group in zip(CANDIDATES, REFERENCES)]
    assert result.scores.tolist() == pytest.approx(expected, rel=1e-12)
    assert result.score == pytest.approx(float(np.mean(expected)), rel=1e-12)
    # the best reference: never below the score against any single one
    for c, group, got in zip(CANDIDATES, REFERENCES, result.scores.tolist()):
        assert got >= max(meteor_score([words(r)], words(c), wordnet=NoSynonyms()) for r in group) - 1e-12


def test_nltk_meteor_without_wordnet_says_how_to_get_it(monkeypatch):
    import nltk.corpus

    class Missing:
        def synsets(self, *args, **kwargs):
            raise LookupError("Resource wordnet not found.")

    monkeypatch.setattr(nltk.corpus, "wordnet", Missing())
    with pytest.raises(InputError, match="WordNet data: python -m nltk.downloader wordnet"):
        capeval_plugins.load("meteor", implementation="nltk")(None, ["a puppy sprints"], [["a dog is running"]])


def has_wordnet() -> bool:
    try:
        nltk.corpus.wordnet.synsets("dog")
    except LookupError:
        return False
    return True


@pytest.mark.skipif(not FLICKR.is_file(), reason="../shared/benchdata is not on this machine")
@pytest.mark.parametrize("metric", ["bleu4", "meteor"])
def test_redemption_table2_on_flickr8k_expert(metric):
    """Table 2 of Redemption Score: BLEU-4 0.0465 (tau-c 33.5), METEOR 0.2441 (tau-c 35.85), Kendall tau-c over
    the per-rating rows (scipy), the value the corpus score."""
    if metric == "meteor" and not has_wordnet():
        pytest.skip("NLTK's WordNet data is not on this machine")
    from scipy.stats import kendalltau

    data = json.loads(FLICKR.read_text())
    rows = [(d["ground_truth"], j["caption"], j["rating"]) for d in data.values() for j in d["human_judgement"]]
    result = capeval_plugins.load(metric, implementation="nltk")(None, [c for _, c, _ in rows], [r for r, _, _ in rows])
    tau = 100 * kendalltau(np.asarray(result.scores), [h for *_, h in rows], variant="c")[0]
    value, published = {"bleu4": (0.0465, 33.5), "meteor": (0.2441, 35.85)}[metric]
    assert round(result.score, 4) == value and abs(tau - published) < 0.05
