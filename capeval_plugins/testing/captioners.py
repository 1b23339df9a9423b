"""Tiny image-to-text captioners (``capeval caption``'s tests): BLIP's captioning head."""
from __future__ import annotations

from pathlib import Path

from capeval_plugins.testing import builder
from capeval_plugins.testing.text_encoders import _LAYERS, bert_tokenizer


@builder("blip_caption")
def build_blip_caption(path: Path, seed: int, image_size: int = 32, patch_size: int = 8) -> None:
    """Salesforce/blip-image-captioning-*'s architecture (``BlipForConditionalGeneration``): a ViT and a BERT
    decoder with [DEC] as its BOS, as the ITM checkpoint's text side."""
    import torch
    from transformers import BlipConfig, BlipForConditionalGeneration, BlipImageProcessor, BlipProcessor

    tokenizer = bert_tokenizer(extra_special=("[DEC]", "[ENC]"), bos_token="[DEC]")
    config = BlipConfig(
        text_config=dict(**_LAYERS, vocab_size=len(tokenizer), encoder_hidden_size=32, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                         sep_token_id=tokenizer.sep_token_id, eos_token_id=tokenizer.sep_token_id),
        # a wider initialisation than BLIP's default 1e-10, so the captions depend on the image
        vision_config=dict(**_LAYERS, image_size=image_size, patch_size=patch_size, initializer_range=0.5),
        projection_dim=16, image_text_hidden_size=16,
    )
    torch.manual_seed(seed)
    BlipForConditionalGeneration(config).save_pretrained(path)
    image_processor = BlipImageProcessor(size={"height": image_size, "width": image_size})
    BlipProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)
