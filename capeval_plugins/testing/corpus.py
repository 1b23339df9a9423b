"""A synthetic caption corpus and tokenizer training for tiny checkpoints (no hub access needed)."""
from __future__ import annotations

import random
import string

SUBJECTS = ["a dog", "a cat", "a man", "a woman", "two children", "a boy", "a girl", "a horse", "a bird",
            "three people", "a player", "a surfer", "an old man", "a young woman", "a group of friends"]
VERBS = ["runs", "sits", "jumps", "stands", "plays", "walks", "rides", "looks", "sleeps", "swims", "eats"]
PLACES = ["on the grass", "in the park", "on a street", "near the water", "in a kitchen", "on the beach",
          "in the snow", "under a tree", "next to a car", "on a bench", "in front of a building"]
EXTRAS = ["with a red ball", "holding a blue umbrella", "wearing a black hat", "while it rains", "at night",
          "during a game", "with a small white dog", "in bright sunlight", ""]

# Every printable ASCII character on its own and inside a word, so a trained vocabulary covers them all
# (digits and '.' matter: LVLM judges write scores such as "0.85").
ALPHABET = string.ascii_letters + string.digits + string.punctuation


def caption_corpus(n: int = 400, seed: int = 0) -> list[str]:
    """``n`` caption-like sentences plus lines that cover the printable ASCII alphabet."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        parts = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(PLACES), rng.choice(EXTRAS)]
        lines.append(" ".join(p for p in parts if p).capitalize() + rng.choice([".", "", "!"]))
    lines.append(" ".join(ALPHABET))
    lines.append("".join(ALPHABET))
    lines += [f"Score: 0.{d}{e}" for d in range(10) for e in range(10)]
    lines += ["1.0", "0.0", "Rating: 5", "A B C D E"]
    return lines


def train_bpe(
    corpus: list[str],
    vocab_size: int,
    special_tokens: list[str],
    end_of_word_suffix: str | None = None,
    lowercase: bool = False,
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A small BPE over whitespace/punctuation pre-tokens; returns (vocab, merges) for a transformers
    tokenizer class that takes them directly (CLIPTokenizer and friends)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    kwargs = {"end_of_word_suffix": end_of_word_suffix} if end_of_word_suffix else {}
    tok = Tokenizer(models.BPE(**kwargs))
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=list(ALPHABET), **kwargs
    )
    tok.train_from_iterator([c.lower() if lowercase else c for c in corpus], trainer)
    import json

    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return tok.get_vocab(), merges


def train_wordpiece(corpus: list[str], vocab_size: int, special_tokens: list[str], lowercase: bool = True) -> list[str]:
    """A small WordPiece vocabulary (ordered by id) for BERT-style tokenizers."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=list(ALPHABET)
    )
    tok.train_from_iterator(corpus, trainer)
    vocab = tok.get_vocab()
    return sorted(vocab, key=vocab.get)
