"""Tiny image-to-text captioners (``capeval caption``'s tests): BLIP's captioning head, and a
VisionEncoderDecoder (ViT encoder, GPT-2 decoder: the nlpconnect/vit-gpt2-image-captioning layout)."""
from __future__ import annotations

from pathlib import Path

from capeval_plugins.testing import builder
from capeval_plugins.testing.text_encoders import _LAYERS, save_tiny_blip


@builder("blip_caption")
def build_blip_caption(path: Path, seed: int, image_size: int = 32, patch_size: int = 8) -> None:
    """Salesforce/blip-image-captioning-*'s architecture (``BlipForConditionalGeneration``): a ViT and a BERT
    decoder with [DEC] as its BOS, as the ITM checkpoint's text side."""
    from transformers import BlipForConditionalGeneration

    # a wider initialisation than the ITM checkpoint's, so the captions depend on the image
    save_tiny_blip(BlipForConditionalGeneration, path, seed, image_size, patch_size, initializer_range=0.5)


@builder("vit_gpt2_caption")
def build_vit_gpt2_caption(path: Path, seed: int, image_size: int = 32, patch_size: int = 8) -> None:
    """A ViT encoder and a GPT-2 decoder with cross-attention, saved with a ViT image processor and a GPT-2
    tokenizer and no joint processor (as nlpconnect/vit-gpt2-image-captioning)."""
    import json
    import tempfile

    import torch
    from transformers import (GPT2Config, GPT2Tokenizer, ViTConfig, ViTImageProcessor, VisionEncoderDecoderConfig,
                              VisionEncoderDecoderModel)

    from capeval_plugins.testing.corpus import caption_corpus, train_gpt2_bpe

    vocab, merges = train_gpt2_bpe(caption_corpus(), 300, ["<|endoftext|>"])
    with tempfile.TemporaryDirectory() as scratch:
        Path(scratch, "vocab.json").write_text(json.dumps(vocab))
        Path(scratch, "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
        tokenizer = GPT2Tokenizer(str(Path(scratch, "vocab.json")), str(Path(scratch, "merges.txt")))
    encoder = ViTConfig(**_LAYERS, image_size=image_size, patch_size=patch_size)
    decoder = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=len(tokenizer), add_cross_attention=True,
                         is_decoder=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id = tokenizer.bos_token_id
    config.pad_token_id = config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    VisionEncoderDecoderModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    ViTImageProcessor(size={"height": image_size, "width": image_size}).save_pretrained(path)
