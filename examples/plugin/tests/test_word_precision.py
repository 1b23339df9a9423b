"""WordPrecision through the capeval metric test kit: one test per property a metric must have."""
import pytest

from capeval_plugins.testing import kit
from word_precision import WordPrecision


class TestWordPrecision(kit.MetricTests):
    factory = WordPrecision  # built with its tiny_recipe


def test_counts_words_found_in_the_references():
    result = WordPrecision()(None, ["A dog runs", "", "a CAT"], [["a dog sleeps"], ["a dog"], ["the cat"]])
    assert result.scores.tolist() == [2 / 3, 0.0, 0.5]
    assert result.score == pytest.approx(3 / 5)  # pooled: 3 of the 5 words
