"""The real tokenizers of the papers' LVLM judges, built from their public vocabulary files, and tiny random
LVLMs of the matching families around them (the real vocabulary size and special-token ids, random weights).

* Llama 2 SentencePiece (LLaVA-1.5, FLEUR's judge): Llama 2's ``tokenizer.model``;
* Mistral 7B SentencePiece (LLaVA-NeXT-Mistral-7B): ``tokenizer.model.v1`` (as ``mistral-common`` ships it);
* Qwen byte-level BPE (Qwen1.5 in LLaVA-NeXT-72B, DISCODE's default judge; Qwen2/2.5/3-VL, Rigel's backbone):
  ``qwen.tiktoken`` (one base64 token and its rank per line, as ``dashscope`` ships it), turned into the vocabulary
  and merges a transformers ``Qwen2Tokenizer`` takes.

SentencePiece models are read by transformers' own converter (``LlamaTokenizer`` from a ``tokenizer.model``:
needs ``sentencepiece`` and ``protobuf``). Every builder writes into the directory it is given; nothing is kept
in the package. A judge's reading of scores depends on how the real tokenizer splits "0.7", which the small
tokenizers of :mod:`.vision_language` only imitate.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

from capeval_plugins import files

from capeval_plugins.testing.clip import clip_image_processor
from capeval_plugins.testing.vision_language import LLAVA_15_TEMPLATE, MISTRAL_LLAVA_TEMPLATE  # noqa: F401 (re-exported)

# Qwen's special tokens after its 151,643 byte-level BPE tokens, in their real order (Qwen1.5 / Qwen2: the first
# three; Qwen2-VL adds the rest).
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_VL_SPECIAL = QWEN_SPECIAL + ["<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
                                  "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                                  "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]

# LLaVA-NeXT-72B's conversation (LLaVA-NeXT's "qwen_1_5", ChatML): a system turn (by default "You are a helpful
# assistant."), the image placeholder then the text in the user turn, the assistant's turn opened.
QWEN_LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Vocabulary sizes of the real checkpoints' embedding matrices (padded past the tokenizer).
LLAVA_VOCAB = 32064   # llava-hf/llava-1.5-*-hf, llava-hf/llava-v1.6-mistral-7b-hf: 32,000 + <image>, <pad>
QWEN_VOCAB = 152064   # Qwen1.5-72B (llava-hf/llava-next-72b-hf), Qwen2-VL-7B


# --- tokenizers ------------------------------------------------------------------------------------------------


def _into(path: str | Path):
    """A private staging folder whose files are moved into ``path`` (made if missing) when the block ends: a
    file of the user's already there is never overwritten (see :meth:`capeval_plugins.files.Claim.staging`)."""
    return files.Claim(path, "tiny-checkpoint").open().staging()


def sentencepiece_tokenizer(model_file: str | Path, path: str | Path, chat_template: str | None = None,
                            image_token: str | None = "<image>", pad_token: str | None = "<pad>"):
    """A SentencePiece ``tokenizer.model`` (Llama 2, Mistral 7B) as a transformers ``LlamaTokenizer`` saved in
    ``path``: BOS added, no EOS, the LLaVA checkpoints' ``<image>`` (32000) and ``<pad>`` (32001) after the
    32,000 pieces, left padding."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    with _into(path) as staged:
        with files.Folder.open(staged)[0] as folder:
            folder.write("tokenizer.model", files.read_input(model_file, "tokenizer.model"))
            folder.write("tokenizer_config.json", json.dumps({
                "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                "add_bos_token": True, "add_eos_token": False, "padding_side": "left"}).encode())
        tok = AutoTokenizer.from_pretrained(str(staged))
        if image_token:
            tok.add_tokens([AddedToken(image_token, special=True, normalized=False)], special_tokens=True)
        if pad_token:
            tok.add_special_tokens({"pad_token": pad_token})
        if chat_template:
            tok.chat_template = chat_template
        tok.save_pretrained(str(staged))
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, which byte-level BPE vocabularies are written in:
    the printable Latin-1 bytes stand for themselves, the others for the characters from U+0100 on."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_tiktoken(file: str | Path) -> dict[bytes, int]:
    """``qwen.tiktoken``: one ``base64(token) rank`` pair per line."""
    ranks = {}
    for line in Path(file).read_text(encoding="utf-8").splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def tiktoken_vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The byte-level BPE vocabulary and merges equivalent to tiktoken's ranks: tiktoken repeatedly joins the
    adjacent pair whose concatenation has the lowest rank, so every split of a token into two tokens is a
    merge, ordered by the rank of the token it makes (then by its parts' ranks)."""
    table = _bytes_to_unicode()
    texts = {token: "".join(table[x] for x in token) for token in ranks}
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left = ranks.get(token[:cut])
            if left is not None:
                right = ranks.get(token[cut:])
                if right is not None:
                    merges.append((rank, left, right, token[:cut], token[cut:]))
    merges.sort()
    return {texts[t]: r for t, r in ranks.items()}, [(texts[a], texts[b]) for *_, a, b in merges]


def qwen_tokenizer(tiktoken_file: str | Path, path: str | Path, special_tokens: list[str] = QWEN_SPECIAL,
                   chat_template: str | None = None, image_token: str | None = None):
    """Qwen's byte-level BPE (``qwen.tiktoken``) as a transformers ``Qwen2Tokenizer`` saved in ``path``: the
    special tokens right after the 151,643 BPE tokens in the order given (their real ids), EOS ``<|im_end|>``
    (the chat checkpoints'), padding ``<|endoftext|>``, no BOS; ``image_token`` (LLaVA-NeXT's ``<image>``) after
    them."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    ranks = read_tiktoken(tiktoken_file)
    vocab, merges = tiktoken_vocab_and_merges(ranks)
    added = special_tokens + ([image_token] if image_token else [])
    vocab.update({t: len(ranks) + i for i, t in enumerate(added)})
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>")
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in added], special_tokens=True)
    for i, t in enumerate(added):
        if tok.convert_tokens_to_ids(t) != len(ranks) + i:
            raise RuntimeError(f"{t} got id {tok.convert_tokens_to_ids(t)}, expected {len(ranks) + i}")
    if chat_template:
        tok.chat_template = chat_template
    with _into(path) as staged:
        tok.save_pretrained(str(staged))
    return tok


# --- tiny LVLMs around them ------------------------------------------------------------------------------------


def _tiny_text(model_type: str, vocab_size: int, tokenizer, **extra) -> dict:
    return dict(model_type=model_type, vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, **extra)


_VISION = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=2, image_size=32, patch_size=8, projection_dim=16)


def build_llava(path: str | Path, tokenizer, seed: int = 0) -> Path:
    """LLaVA-1.5 (llava-hf/llava-1.5-13b-hf's layout): a Llama text model with the real vocabulary size, one
    CLIP tile, the llava-hf chat template; ``tokenizer`` from :func:`sentencepiece_tokenizer`."""
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer.chat_template = LLAVA_15_TEMPLATE
    config = LlavaConfig(text_config=_tiny_text("llama", LLAVA_VOCAB, tokenizer), vision_config=_VISION,
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default", vision_feature_layer=-2, image_seq_length=16)
    torch.manual_seed(seed)
    with _into(path) as staged:
        LlavaForConditionalGeneration(config).save_pretrained(staged)
        image_processor = clip_image_processor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                       vision_feature_select_strategy="default", num_additional_image_tokens=1,
                       chat_template=LLAVA_15_TEMPLATE).save_pretrained(staged)
    return Path(path)


def build_llava_next(path: str | Path, tokenizer, text_model: str, vocab_size: int, chat_template: str,
                     seed: int = 0) -> Path:
    """LLaVA-NeXT around a real tokenizer: ``text_model`` "mistral" (llava-hf/llava-v1.6-mistral-7b-hf) or
    "qwen2" (llava-hf/llava-next-72b-hf, Qwen1.5), the vocabulary size of that checkpoint, any-resolution tiles."""
    import torch
    from transformers import (LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessor,
                              LlavaNextProcessor)

    tokenizer.chat_template = chat_template
    pinpoints = [[32 * h, 32 * w] for h, w in [(1, 2), (2, 1), (2, 2), (3, 1), (1, 3)]]
    extra = dict(sliding_window=None, rope_theta=1e6) if text_model == "mistral" else {}
    config = LlavaNextConfig(text_config=_tiny_text(text_model, vocab_size, tokenizer, **extra), vision_config=_VISION,
                             image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                             vision_feature_select_strategy="default", vision_feature_layer=-2,
                             image_grid_pinpoints=pinpoints, image_seq_length=16)
    torch.manual_seed(seed)
    with _into(path) as staged:
        LlavaNextForConditionalGeneration(config).save_pretrained(staged)
        image_processor = LlavaNextImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                                  image_grid_pinpoints=pinpoints)
        LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                           vision_feature_select_strategy="default", num_additional_image_tokens=1,
                           chat_template=chat_template).save_pretrained(staged)
    return Path(path)


