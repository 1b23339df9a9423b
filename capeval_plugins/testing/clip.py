"""Tiny CLIP (the architecture of openai/clip-vit-*): CLIPModel + CLIPProcessor."""
from __future__ import annotations

from pathlib import Path

from capeval_plugins.testing import builder
from capeval_plugins.testing.corpus import caption_corpus, train_bpe


def clip_image_processor(**kwargs):
    """``CLIPImageProcessor(**kwargs)``. Without torchvision, transformers falls back to the PIL backend (the
    same processing) and warns that torchvision is required; it is not here, so that one warning is muted."""
    import logging

    import transformers

    quiet = logging.getLogger("transformers.utils.import_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        cls = transformers.CLIPImageProcessor
    finally:
        quiet.setLevel(level)
    return cls(**kwargs)


def clip_tokenizer(model_max_length: int = 77):
    from transformers import CLIPTokenizer

    vocab, merges = train_bpe(
        caption_corpus(), 400, ["<|startoftext|>", "<|endoftext|>"], end_of_word_suffix="</w>", lowercase=True
    )
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


@builder("clip")
def build_clip(path: Path, seed: int, image_size: int = 32, patch_size: int = 8) -> None:
    import torch
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    tokenizer = clip_tokenizer()
    special = {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, **special),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=image_size, patch_size=patch_size),
        projection_dim=16,
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(path)
    size = {"shortest_edge": image_size}
    crop = {"height": image_size, "width": image_size}
    image_processor = clip_image_processor(size=size, crop_size=crop)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)


@builder("clip_vit_b32")
def build_clip_vit_b32(path: Path, seed: int) -> None:
    """Full-size ViT-B/32 CLIP (the CLIPScore paper's architecture) with random weights, about 600 MB:
    for benchmarks that need real compute, not for tests."""
    import torch
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    tokenizer = clip_tokenizer()
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(patch_size=32),
        projection_dim=512,
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(path)
    CLIPProcessor(image_processor=clip_image_processor(), tokenizer=tokenizer).save_pretrained(path)
