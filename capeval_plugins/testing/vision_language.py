"""Tiny LVLMs (judges): LLaVA-1.5 (Llama + CLIP), LLaVA-NeXT (Mistral + CLIP) and Qwen2-VL / Qwen2.5-VL /
Qwen3-VL; and a tiny LLaMA causal LM (the frozen language model of MSD-Score's local aligner, LLaVA's
Vicuna/LLaMA family).

Each saves what ``AutoProcessor`` and ``AutoModelForImageTextToText`` load. Tokenizers split digits and keep
'.' whole, like the real ones, so a judge's "0.85" is the pieces "0", ".", "8", "5" and each digit has one id.
LLaVA-OneVision is not built: LlavaOnevisionProcessor requires a video processor, and video processors cannot
be constructed without torchvision.
"""
from __future__ import annotations

from pathlib import Path

from capeval_plugins.core.messages import install_extra
from capeval_plugins.testing import builder
from capeval_plugins.testing.clip import clip_image_processor
from capeval_plugins.testing.corpus import caption_corpus, train_byte_level_bpe, train_metaspace_bpe

# Real checkpoints pad the embedding matrix past the tokenizer (32064 > 32001 for llava-v1.6-mistral,
# 151936 > 151665 for Qwen): keep that, so code that assumes ``logits.shape[-1] == len(tokenizer)`` is caught.
_PAD_VOCAB_TO = 64


def _padded(n: int) -> int:
    return -(-n // _PAD_VOCAB_TO) * _PAD_VOCAB_TO


def _chat_corpus() -> list[str]:
    # The captions plus the words of the chat templates and of a judge's prompt, so these are whole tokens.
    return caption_corpus() + ["system", "user", "assistant", "You are a helpful assistant.", "[INST] [/INST]",
                               "Rate this caption from 0 to 1. Score:"] * 5


def _tiny_text(vocab_size: int, **extra) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, **extra)


# --- LLaVA-NeXT (llava-hf/llava-v1.6-mistral-7b-hf) -----------------------------------------------------------

# The chat template of llava-hf/llava-v1.6-mistral-7b-hf: images first, then text, inside [INST] ... [/INST].
MISTRAL_LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<<SYS>>\\n' + message['content'][0]['text'] + '\\n<</SYS>>\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}"
    "{{' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'][0]['text'] + '</s> '}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


def llama_tokenizer():
    """SentencePiece-style BPE in LlamaTokenizer: BOS added, no EOS, left padding with <unk> (as LLaMA and
    Vicuna checkpoints ship it)."""
    from transformers import LlamaTokenizer

    # Llama's layout: <unk>, <s>, </s>, then the 256 byte-fallback pieces <0x00>..<0xFF> (for "\n" and anything
    # else outside the trained alphabet), then the merges.
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    vocab, merges = train_metaspace_bpe(_chat_corpus(), 640, ["<unk>", "<s>", "</s>", *byte_pieces])
    return LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, pad_token="<unk>", padding_side="left")


@builder("llama")
def build_llama(path: Path, seed: int) -> None:
    """A 2-layer LlamaForCausalLM (hidden size 32) and its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = llama_tokenizer()
    config = LlamaConfig(**_tiny_text(_padded(len(tokenizer)), bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def mistral_tokenizer():
    """SentencePiece-style BPE in LlamaTokenizer (what llava-v1.6-mistral ships): BOS added, left padding with
    <unk>, and <image> as the last (added, special) token."""
    from tokenizers import AddedToken

    tok = llama_tokenizer()
    tok.add_tokens([AddedToken("<image>", special=True, normalized=False)], special_tokens=True)
    tok.chat_template = MISTRAL_LLAVA_TEMPLATE
    return tok


@builder("llava_next")
def build_llava_next(path: Path, seed: int, image_size: int = 32, patch_size: int = 8) -> None:
    import torch
    from transformers import (LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessor,
                              LlavaNextProcessor)

    tokenizer = mistral_tokenizer()
    # The real pinpoints ([[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]) scaled to image_size.
    pinpoints = [[image_size * h, image_size * w] for h, w in [(1, 2), (2, 1), (2, 2), (3, 1), (1, 3)]]
    config = LlavaNextConfig(
        text_config=dict(model_type="mistral", sliding_window=None, rope_theta=1e6, rms_norm_eps=1e-5, **_tiny_text(
            _padded(len(tokenizer)), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=image_size, patch_size=patch_size, projection_dim=16),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",  # drop CLIP's CLS token ...
        vision_feature_layer=-2,
        image_grid_pinpoints=pinpoints,
        image_seq_length=(image_size // patch_size) ** 2,
    )
    torch.manual_seed(seed)
    LlavaNextForConditionalGeneration(config).save_pretrained(path)
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
        image_grid_pinpoints=pinpoints,
    )
    LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,  # ... which the processor counts
        chat_template=MISTRAL_LLAVA_TEMPLATE,
    ).save_pretrained(path)


# --- LLaVA-1.5 (llava-hf/llava-1.5-13b-hf) -------------------------------------------------------------------------

# The chat template of llava-hf/llava-1.5-*-hf: a system turn is its bare text, then "USER: <image>\n{text} " and
# "ASSISTANT:", which is LLaVA's "llava_v1" conversation ("{system} USER: <image>\n{text} ASSISTANT:").
LLAVA_15_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}{% endfor %}"
    "{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


@builder("llava")
def build_llava(path: Path, seed: int, image_size: int = 32, patch_size: int = 8) -> None:
    """LLaVA-1.5: one CLIP tile (resize the shorter side, centre crop), a Llama text model, the llava-hf
    template and a SentencePiece-style tokenizer with BOS."""
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = mistral_tokenizer()
    tokenizer.chat_template = LLAVA_15_TEMPLATE
    config = LlavaConfig(
        text_config=dict(model_type="llama", **_tiny_text(
            _padded(len(tokenizer)), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=image_size, patch_size=patch_size, projection_dim=16),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_seq_length=(image_size // patch_size) ** 2,
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(path)
    image_processor = clip_image_processor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                   chat_template=LLAVA_15_TEMPLATE).save_pretrained(path)


# --- Qwen2-VL / Qwen2.5-VL / Qwen3-VL ---------------------------------------------------------------------------

# ChatML with Qwen's vision markers. Qwen2-VL and Qwen2.5-VL insert a default system prompt, Qwen3-VL does not.
_QWEN_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}__DEFAULT_SYSTEM__{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_VL_TEMPLATE = _QWEN_TEMPLATE.replace(
    "__DEFAULT_SYSTEM__", "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
)
QWEN3_VL_TEMPLATE = _QWEN_TEMPLATE.replace("__DEFAULT_SYSTEM__", "")

QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


def qwen_tokenizer(chat_template: str = QWEN2_VL_TEMPLATE):
    """Byte-level BPE in Qwen2Tokenizer with Qwen's special tokens after the regular vocabulary (in the real
    order), EOS <|im_end|> as in the Instruct checkpoints, pad <|endoftext|>."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = train_byte_level_bpe(_chat_corpus(), 640, [])
    vocab.update({t: len(vocab) + i for i, t in enumerate(QWEN_SPECIAL_TOKENS)})
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         unk_token=None)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS], special_tokens=True)
    tok.chat_template = chat_template
    return tok


def _qwen_config(kind: str, tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    special = dict(bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    vocab_size = _padded(len(tokenizer))
    # M-RoPE splits the head's rotary half (head_dim 8 -> 4) between time, height and width.
    if kind == "qwen2_vl":
        text = _tiny_text(vocab_size, rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 1],
                                                           rope_theta=1e6), **special)
        vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14)
        return Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    if kind == "qwen2_5_vl":
        text = _tiny_text(vocab_size, rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 1],
                                                           rope_theta=1e6), **special)
        # Window attention over 2x2 merged patches in block 0, full attention in the last block (as 7, 15, ...).
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=14,
                      window_size=56, fullatt_block_indexes=[1])
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    text = _tiny_text(vocab_size, head_dim=8, rope_parameters=dict(
        rope_type="default", mrope_section=[2, 1, 1], mrope_interleaved=True, rope_theta=5e6), **special)
    # A 4x4 learned position grid (the real one is 48x48), interpolated to each image; deepstack from block 0.
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=16,
                  num_position_embeddings=16, deepstack_visual_indexes=[0])
    return Qwen3VLConfig(text_config=text, vision_config=vision, **ids)


_QWEN_PROCESSORS = {
    "qwen2_vl": ("Qwen2VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen3_vl": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
}


def _build_qwen(kind: str, path: Path, seed: int) -> None:
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2VLImageProcessor
    from transformers.utils import is_torchvision_available

    template = QWEN3_VL_TEMPLATE if kind == "qwen3_vl" else QWEN2_VL_TEMPLATE
    tokenizer = qwen_tokenizer(template)
    config = _qwen_config(kind, tokenizer)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(path)
    # Images of 2x2 to 4x4 merged tokens (Qwen2-VL's real min_pixels is also 4 merged patches).
    patch = config.vision_config.patch_size
    factor = patch * 2
    sizes = dict(patch_size=patch, temporal_patch_size=2, merge_size=2,
                 size={"shortest_edge": 4 * factor**2, "longest_edge": 16 * factor**2})
    image_processor = Qwen2VLImageProcessor(**sizes)
    # Saved on their own first: without torchvision these are all that can be, and they load with AutoTokenizer,
    # AutoImageProcessor and AutoModelForImageTextToText.
    tokenizer.save_pretrained(path)
    image_processor.save_pretrained(path)
    if not is_torchvision_available():
        raise RuntimeError(
            f"{kind}: the processor needs a video processor, which requires torchvision (not installed: "
            f"{install_extra('qwen')}); saved the model, tokenizer (with chat template) and image processor to "
            f"{path}, but no processor"
        )
    import transformers

    processor_class, video_processor_class = _QWEN_PROCESSORS[kind]
    video_processor = getattr(transformers, video_processor_class)(**sizes)
    getattr(transformers, processor_class)(image_processor=image_processor, tokenizer=tokenizer,
                                           video_processor=video_processor,
                                           chat_template=template).save_pretrained(path)


@builder("qwen2_vl")
def build_qwen2_vl(path: Path, seed: int) -> None:
    _build_qwen("qwen2_vl", path, seed)


@builder("qwen2_5_vl")
def build_qwen2_5_vl(path: Path, seed: int) -> None:
    _build_qwen("qwen2_5_vl", path, seed)


@builder("qwen3_vl")
def build_qwen3_vl(path: Path, seed: int) -> None:
    _build_qwen("qwen3_vl", path, seed)
