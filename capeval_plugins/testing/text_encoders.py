"""Tiny non-generative encoders: DINO ViT, BERT, DeBERTa (v1, v3), RoBERTa, XLM-R, MPNet, ViLT, BLIP (image-text matching)
and SigLIP."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from capeval_plugins.testing import builder
from capeval_plugins.testing.corpus import caption_corpus, train_gpt2_bpe, train_unigram, train_wordpiece_deterministic

_LAYERS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def bert_tokenizer(model_max_length: int = 512, extra_special: tuple[str, ...] = (), **kwargs):
    """Lower-cased WordPiece BertTokenizer ([PAD] = 0 as in bert-base-uncased); ``extra_special`` tokens are
    appended after the vocabulary (BLIP's [DEC] and [ENC])."""
    from tokenizers import AddedToken
    from transformers import BertTokenizer

    tokens = train_wordpiece_deterministic(caption_corpus(), 400, ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok = BertTokenizer(vocab={t: i for i, t in enumerate(tokens)}, model_max_length=model_max_length, **kwargs)
    if extra_special:
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in extra_special], special_tokens=True)
    return tok


@builder("dino")
def build_dino(path: Path, seed: int, image_size: int = 64, patch_size: int = 8) -> None:
    import torch
    from transformers import ViTConfig, ViTImageProcessor, ViTModel
    from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    config = ViTConfig(**_LAYERS, image_size=image_size, patch_size=patch_size)
    torch.manual_seed(seed)
    # facebook/dino-vitb8 ships no pooler; AutoModel adds a randomly initialised one on load, as it does there.
    ViTModel(config, add_pooling_layer=False).save_pretrained(path)
    # dino-vitb8 resizes to a square and normalises with the ImageNet statistics (not ViT's default 0.5s).
    ViTImageProcessor(size={"height": image_size, "width": image_size}, image_mean=IMAGENET_DEFAULT_MEAN,
                      image_std=IMAGENET_DEFAULT_STD).save_pretrained(path)


@builder("deberta_v3")
def build_deberta_v3(path: Path, seed: int) -> None:
    import torch
    from transformers import DebertaV2Config, DebertaV2Model, DebertaV2Tokenizer

    # deberta-v3's SentencePiece Unigram: [PAD], [CLS], [SEP], [UNK] = 0..3, [MASK] after the pieces.
    vocab = train_unigram(caption_corpus(), 400, ["[PAD]", "[CLS]", "[SEP]", "[UNK]"])
    tokenizer = DebertaV2Tokenizer(vocab=vocab + [("[MASK]", 0.0)], do_lower_case=False, split_by_punct=False,
                                   model_max_length=512)
    # microsoft/deberta-v3-large's attention: disentangled c2p/p2c with shared keys, log-bucketed relative
    # positions and no absolute position embeddings.
    config = DebertaV2Config(
        **_LAYERS, vocab_size=len(tokenizer), max_position_embeddings=512, type_vocab_size=0,
        relative_attention=True, position_buckets=256, max_relative_positions=-1, norm_rel_ebd="layer_norm",
        share_att_key=True, pos_att_type=["p2c", "c2p"], position_biased_input=False, layer_norm_eps=1e-7,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    DebertaV2Model(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@builder("roberta")
def build_roberta(path: Path, seed: int, masked_lm: bool = True) -> None:
    """roberta-large's layout (BERTScore's default English model): byte-level BPE RobertaTokenizer with <s>,
    <pad>, </s>, <unk> = 0..3 and <mask> last, and no added prefix space (bert_score asks for one per call).
    ``masked_lm=False``: the encoder alone, with its pooler (SimCSE-RoBERTa's layout, Polos's text model)."""
    import torch
    from transformers import RobertaConfig, RobertaForMaskedLM, RobertaModel, RobertaTokenizer

    vocab, merges = train_gpt2_bpe(caption_corpus(), 500, ["<s>", "<pad>", "</s>", "<unk>"])
    vocab["<mask>"] = len(vocab)
    tokenizer = RobertaTokenizer(vocab=vocab, merges=merges, model_max_length=512)
    # Positions start after the padding id (RoBERTa's offset of 2), hence 512 + 2 position embeddings.
    config = RobertaConfig(**_LAYERS, vocab_size=len(tokenizer), max_position_embeddings=514, type_vocab_size=1,
                           pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    # roberta-large is saved from its masked-LM model: an lm_head beside the encoder, and no pooler
    (RobertaForMaskedLM if masked_lm else RobertaModel)(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@builder("simcse_roberta")
def build_simcse_roberta(path: Path, seed: int) -> None:
    """princeton-nlp/sup-simcse-roberta-*'s layout (Polos's text model): RoBERTa's tokenizer and
    encoder, saved as the encoder alone with its pooler."""
    build_roberta(path, seed, masked_lm=False)


@builder("vilt")
def build_vilt(path: Path, seed: int, image_size: int = 32, patch_size: int = 8) -> None:
    import torch
    from transformers import ViltConfig, ViltForMaskedLM, ViltImageProcessor, ViltProcessor

    tokenizer = bert_tokenizer(model_max_length=40)  # ViLT's text positions stop at 40
    config = ViltConfig(**_LAYERS, vocab_size=len(tokenizer), max_position_embeddings=40, image_size=image_size,
                        patch_size=patch_size, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = ViltForMaskedLM(config)
    with torch.no_grad():  # transformers starts the patch positions at zero; a released (trained) ViLT's are not
        model.vilt.embeddings.position_embeddings.normal_(0.0, config.initializer_range)
    model.save_pretrained(path)
    # Shorter side to image_size, sides rounded down to whole patches; batches are padded with a pixel mask.
    image_processor = ViltImageProcessor(size={"shortest_edge": image_size}, size_divisor=patch_size)
    ViltProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)


def save_tiny_blip(model_class: Any, path: Path, seed: int, image_size: int, patch_size: int,
                   initializer_range: float) -> None:
    """A tiny BLIP of ``model_class`` (retrieval or captioning head) with its processor: Salesforce/blip-*'s
    layout, bert-base-uncased plus [DEC] (the BOS) and [ENC] after the vocabulary. BlipVisionConfig's default
    initializer_range (1e-10) makes a random vision tower whose output hardly depends on the image; the callers
    choose a wider one."""
    import torch
    from transformers import BlipConfig, BlipImageProcessor, BlipProcessor

    tokenizer = bert_tokenizer(extra_special=("[DEC]", "[ENC]"), bos_token="[DEC]")
    config = BlipConfig(
        text_config=dict(**_LAYERS, vocab_size=len(tokenizer), encoder_hidden_size=32, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                         sep_token_id=tokenizer.sep_token_id, eos_token_id=tokenizer.sep_token_id),
        vision_config=dict(**_LAYERS, image_size=image_size, patch_size=patch_size,
                           initializer_range=initializer_range),
        projection_dim=16, image_text_hidden_size=16,
    )
    torch.manual_seed(seed)
    model_class(config).save_pretrained(path)
    image_processor = BlipImageProcessor(size={"height": image_size, "width": image_size})
    BlipProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)


@builder("blip_itm")
def build_blip_itm(path: Path, seed: int, image_size: int = 32, patch_size: int = 8) -> None:
    from transformers import BlipForImageTextRetrieval

    save_tiny_blip(BlipForImageTextRetrieval, path, seed, image_size, patch_size, initializer_range=0.02)


@builder("siglip")
def build_siglip(path: Path, seed: int, image_size: int = 32, patch_size: int = 8) -> None:
    import torch
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel, SiglipProcessor, T5Tokenizer

    # SiglipTokenizer needs sentencepiece; T5Tokenizer is the same kind of tokenizer (SentencePiece Unigram,
    # <pad>, </s>, <unk> = 0, 1, 2, "</s>" appended) without it. SigLIP pads with </s> to 64 tokens and pools the
    # last position. Not reproduced: SiglipTokenizer's lower-casing and punctuation stripping.
    vocab = train_unigram(caption_corpus(), 400, ["<pad>", "</s>", "<unk>"])
    tokenizer = T5Tokenizer(vocab=vocab, pad_token="</s>", extra_ids=0, model_max_length=64)
    config = SiglipConfig(
        text_config=dict(**_LAYERS, vocab_size=len(tokenizer), max_position_embeddings=64, bos_token_id=None,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(**_LAYERS, image_size=image_size, patch_size=patch_size),
    )
    torch.manual_seed(seed)
    SiglipModel(config).save_pretrained(path)
    image_processor = SiglipImageProcessor(size={"height": image_size, "width": image_size})
    SiglipProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)


# --- more of bert_score's tokenizer families (tests/test_bertscore_families.py) ------------------------------


@builder("bert")
def build_bert(path: Path, seed: int) -> None:
    """bert-base-uncased's layout: WordPiece BertTokenizer ([PAD], [UNK], [CLS], [SEP], [MASK] = 0..4)."""
    import torch
    from transformers import BertConfig, BertModel

    tokenizer = bert_tokenizer()
    config = BertConfig(**_LAYERS, vocab_size=len(tokenizer), max_position_embeddings=512,
                        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@builder("deberta")
def build_deberta(path: Path, seed: int) -> None:
    """microsoft/deberta-large's layout (DeBERTa v1): GPT-2's byte-level BPE in a DebertaTokenizer with [PAD],
    [CLS], [SEP], [UNK] = 0..3 and [MASK] last; a byte-level BPE that bert_score gives no leading space."""
    import torch
    from transformers import DebertaConfig, DebertaModel, DebertaTokenizer

    vocab, merges = train_gpt2_bpe(caption_corpus(), 500, ["[PAD]", "[CLS]", "[SEP]", "[UNK]"])
    vocab["[MASK]"] = len(vocab)
    tokenizer = DebertaTokenizer(vocab=vocab, merges=merges, model_max_length=512)
    config = DebertaConfig(**_LAYERS, vocab_size=len(tokenizer), max_position_embeddings=512, type_vocab_size=0,
                           relative_attention=True, max_relative_positions=-1, pos_att_type=["c2p", "p2c"],
                           position_biased_input=False, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    DebertaModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@builder("mpnet")
def build_mpnet(path: Path, seed: int) -> None:
    """microsoft/mpnet-base's layout (all-mpnet-base-v2's): a WordPiece MPNetTokenizer whose [CLS]/[SEP] are
    <s> and </s>, <pad> = 1 and positions after the padding id, as RoBERTa's."""
    import torch
    from transformers import MPNetConfig, MPNetModel, MPNetTokenizer

    tokens = train_wordpiece_deterministic(caption_corpus(), 400, ["<s>", "<pad>", "</s>", "[UNK]"])
    tokenizer = MPNetTokenizer(vocab={t: i for i, t in enumerate([*tokens, "<mask>"])}, model_max_length=512)
    config = MPNetConfig(**_LAYERS, vocab_size=len(tokenizer), max_position_embeddings=514,
                         pad_token_id=tokenizer.pad_token_id, relative_attention_num_buckets=32)
    torch.manual_seed(seed)
    MPNetModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@builder("xlm_roberta")
def build_xlm_roberta(path: Path, seed: int) -> None:
    """xlm-roberta-large's layout: a SentencePiece Unigram XLMRobertaTokenizer (<s>, <pad>, </s>, <unk> = 0..3,
    <mask> last) before a RoBERTa encoder."""
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaForMaskedLM, XLMRobertaTokenizer

    vocab = train_unigram(caption_corpus(), 400, ["<s>", "<pad>", "</s>", "<unk>"])
    tokenizer = XLMRobertaTokenizer(vocab=vocab + [("<mask>", 0.0)], model_max_length=512)
    config = XLMRobertaConfig(**_LAYERS, vocab_size=len(tokenizer), max_position_embeddings=514, type_vocab_size=1,
                              pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    # saved from its masked-LM model, as the real one: an lm_head beside the encoder, and no pooler
    XLMRobertaForMaskedLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
