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
    tokenizer class that takes them directly (CLIPTokenizer and friends). Deterministic: the trainer adds
    the alphabet (and its end-of-word forms) in hash order, so both are pinned, sorted, right after the
    special tokens, which fixes every id and so how ties between merges are broken."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    kwargs = {"end_of_word_suffix": end_of_word_suffix} if end_of_word_suffix else {}
    tok = Tokenizer(models.BPE(**kwargs))
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    alphabet = sorted(set(ALPHABET.lower() if lowercase else ALPHABET))
    pinned = alphabet + ([c + end_of_word_suffix for c in alphabet] if end_of_word_suffix else [])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens + pinned, initial_alphabet=alphabet,
        show_progress=False, **kwargs
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
        vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=list(ALPHABET), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    vocab = tok.get_vocab()
    return sorted(vocab, key=vocab.get)


def _train_bpe_model(corpus, vocab_size, special_tokens, pre_tokenizer, initial_alphabet):
    import json

    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=initial_alphabet, show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return tok.get_vocab(), merges


def train_metaspace_bpe(
    corpus: list[str], vocab_size: int, special_tokens: list[str]
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """SentencePiece-style BPE ("▁word" pieces, every digit its own piece, as Llama/Mistral split digits) for
    LlamaTokenizer, which applies the merges to the whole "▁"-joined text: no merge ever touches a digit, so
    "0.85" stays "0", ".", "8", "5" (a space before it is a lone "▁")."""
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True),
        pre_tokenizers.Digits(individual_digits=True),
    ])
    return _train_bpe_model(corpus, vocab_size, special_tokens, pre, list(ALPHABET) + ["▁"])


# Qwen2Tokenizer's pre-tokenisation regex (single digits, punctuation runs, spaces kept apart from digits).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def train_byte_level_bpe(
    corpus: list[str], vocab_size: int, special_tokens: list[str]
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE with Qwen2's pre-tokeniser (all 256 bytes in the vocabulary) for Qwen2Tokenizer."""
    from tokenizers import Regex, pre_tokenizers

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    return _train_bpe_model(corpus, vocab_size, special_tokens, pre, pre_tokenizers.ByteLevel.alphabet())


def train_gpt2_bpe(
    corpus: list[str], vocab_size: int, special_tokens: list[str]
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE with GPT-2's pre-tokeniser (words carry their leading space as "Ġ"), for RobertaTokenizer
    and GPT2Tokenizer."""
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return _train_bpe_model(corpus, vocab_size, special_tokens, pre, pre_tokenizers.ByteLevel.alphabet())


def train_wordpiece_deterministic(
    corpus: list[str], vocab_size: int, special_tokens: list[str], lowercase: bool = True
) -> list[str]:
    """``train_wordpiece``, but the same vocabulary on every call. The tokenizers trainer adds the "##"
    continuation forms of the alphabet in hash order, which changes their ids and so how ties between merges are
    broken; pinning the alphabet (both forms, sorted) as leading special tokens fixes every id."""
    alphabet = sorted(set(c.lower() if lowercase else c for c in ALPHABET))
    pinned = special_tokens + alphabet + ["##" + c for c in alphabet]
    return train_wordpiece(corpus, vocab_size, pinned, lowercase=lowercase)


def train_unigram(
    corpus: list[str], vocab_size: int, special_tokens: list[str], lowercase: bool = False
) -> list[tuple[str, float]]:
    """A small SentencePiece-style Unigram vocabulary, ``[(piece, log_prob), ...]`` ordered by id with the
    special tokens first (score 0), for Unigram tokenizer classes that take it directly (DebertaV2Tokenizer,
    T5Tokenizer). The tokenizers UnigramTrainer is not deterministic (its seed pieces come in hash order), so the
    pieces are those of a "▁word" BPE and each scores the log of its smoothed frequency in the corpus tokenized
    with them: the most likely segmentation is then close to the BPE one."""
    import math
    from collections import Counter

    from tokenizers import Tokenizer, models, pre_tokenizers

    texts = [c.lower() if lowercase else c for c in corpus]
    pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    vocab, merges = _train_bpe_model(texts, vocab_size - len(special_tokens), [], pre, list(ALPHABET) + ["▁"])
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre
    counts = Counter(piece for text in texts for piece in bpe.encode(text).tokens)
    total = sum(counts.values()) + len(vocab)
    pieces = sorted(vocab, key=vocab.get)
    return [(t, 0.0) for t in special_tokens] + [(p, math.log((counts[p] + 1) / total)) for p in pieces]
