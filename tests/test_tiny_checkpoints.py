"""The tiny checkpoints of capeval_plugins.testing: they build, load back through the Auto classes, run, and are
deterministic for a seed."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from PIL import Image  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers.utils import is_torchvision_available  # noqa: E402

from capeval_plugins.testing import build_tiny, kinds  # noqa: E402

QWEN = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
LVLMS = ["llava_next", *QWEN]
ENCODERS = ["clip", "dino", "deberta_v3", "roberta", "vilt", "blip_itm", "siglip", "vilbert", "vilbert_pretrained"]
CAPTIONERS = ["blip_caption", "vit_gpt2_caption"]  # capeval caption's (tests/test_captioning.py runs them)
ALL = ENCODERS + LVLMS + ["llava"] + CAPTIONERS
CAPTION = "A dog runs on the grass."
needs_torchvision = pytest.mark.skipif(not is_torchvision_available(), reason="the Qwen processors need torchvision")


def _build(kind, path, seed=0):
    """Without torchvision the Qwen builders save model, tokenizer and image processor, then raise."""
    if kind in QWEN and not is_torchvision_available():
        with pytest.raises(RuntimeError, match="requires torchvision"):
            build_tiny(kind, path, seed)
        return path
    return build_tiny(kind, path, seed)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = _build(kind, tmp_path_factory.mktemp(kind))
        return cache[kind]

    return get


def _image(w=40, h=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())


def _load(auto, path, **kwargs):
    return auto.from_pretrained(path, use_safetensors=True, **kwargs).eval()


def test_kinds():
    assert set(ALL) <= set(kinds())
    assert "llava_onevision" not in kinds()  # its processor cannot be built without torchvision


@pytest.mark.parametrize("kind", ALL)
def test_deterministic_small_and_safetensors(kind, built, tmp_path):
    path = built(kind)
    files = {p.name for p in path.iterdir()}
    assert "model.safetensors" in files and "pytorch_model.bin" not in files
    size = sum(p.stat().st_size for p in path.iterdir())
    assert 100_000 <= size <= 2_000_000, size
    weights = load_file(path / "model.safetensors")
    same = load_file(_build(kind, tmp_path / "same", seed=0) / "model.safetensors")
    other = load_file(_build(kind, tmp_path / "other", seed=1) / "model.safetensors")
    assert weights.keys() == same.keys() == other.keys()
    assert all(torch.equal(weights[k], same[k]) for k in weights)
    assert any(not torch.equal(weights[k], other[k]) for k in weights)
    if kind == "clip":
        return  # see test_clip_tokenizer_deterministic
    for name in ("tokenizer.json", "tokenizer_config.json"):  # trained tokenizers are deterministic too
        if name in files:
            assert (path / name).read_text() == (tmp_path / "same" / name).read_text()


def test_clip_tokenizer_deterministic(tmp_path):
    first, second = build_tiny("clip", tmp_path / "a"), build_tiny("clip", tmp_path / "b")
    assert (first / "tokenizer.json").read_text() == (second / "tokenizer.json").read_text()


# --- encoders ------------------------------------------------------------------------------------------------


def test_clip(built):
    from transformers import AutoModel, AutoProcessor

    path = built("clip")
    processor, model = AutoProcessor.from_pretrained(path), _load(AutoModel, path)
    # The text tower pools at eos_token_id: it must be the tokenizer's end-of-text id.
    assert model.config.text_config.eos_token_id == processor.tokenizer.eos_token_id
    inputs = processor(images=[_image()], text=[CAPTION, "a cat"], padding=True, return_tensors="pt")
    last = inputs.attention_mask.sum(1) - 1  # CLIP pads with end-of-text too
    assert (inputs.input_ids[torch.arange(2), last] == processor.tokenizer.eos_token_id).all()
    with torch.no_grad():
        out = model(**inputs)
    assert out.logits_per_image.shape == (1, 2) and out.text_embeds.shape == (2, 16)


def test_dino(built):
    from transformers import AutoImageProcessor, AutoModel

    path = built("dino")
    processor = AutoImageProcessor.from_pretrained(path)
    model = _load(AutoModel, path, attn_implementation="eager")  # eager: attention maps are returned
    with torch.no_grad():
        out = model(**processor(images=[_image(), _image(20, 50)], return_tensors="pt"), output_attentions=True)
    assert type(model).__name__ == "ViTModel" and model.config.patch_size == 8
    assert out.last_hidden_state.shape == (2, 1 + 64, 32)  # CLS + 8x8 patches
    assert len(out.attentions) == 2 and out.attentions[-1].shape == (2, 2, 65, 65)


def test_deberta_v3(built):
    from transformers import AutoModel, AutoTokenizer

    path = built("deberta_v3")
    tokenizer, model = AutoTokenizer.from_pretrained(path), _load(AutoModel, path)
    assert type(tokenizer).__name__ == "DebertaV2Tokenizer" and type(model).__name__ == "DebertaV2Model"
    special = [tokenizer.pad_token_id, tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.unk_token_id]
    assert special == [0, 1, 2, 3]
    inputs = tokenizer([CAPTION, "a cat"], padding=True, return_tensors="pt")
    assert inputs.input_ids[0, 0] == tokenizer.cls_token_id and tokenizer.unk_token_id not in inputs.input_ids
    with torch.no_grad():
        out = model(**inputs)
    assert out.last_hidden_state.shape == (*inputs.input_ids.shape, 32)


def test_roberta(built):
    from transformers import AutoModel, AutoTokenizer

    path = built("roberta")
    tokenizer, model = AutoTokenizer.from_pretrained(path), _load(AutoModel, path)
    assert type(tokenizer).__name__ == "RobertaTokenizer" and type(model).__name__ == "RobertaModel"
    special = [tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id]
    assert special == [0, 1, 2, 3] and tokenizer.mask_token_id == len(tokenizer) - 1
    # byte-level BPE: words after a space carry "Ġ"; the first word gets one only with add_prefix_space
    assert tokenizer.tokenize(CAPTION)[:2] == ["A", "Ġdog"]
    spaced = AutoTokenizer.from_pretrained(path, add_prefix_space=True)
    assert spaced.tokenize("dog runs")[0] == "Ġdog"
    inputs = tokenizer([CAPTION, "a cat"], padding=True, return_tensors="pt")
    assert tokenizer.unk_token_id not in inputs.input_ids
    with torch.no_grad():
        out = model(**inputs)
    assert out.last_hidden_state.shape == (*inputs.input_ids.shape, 32)


def test_llava_1_5(built):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = built("llava")
    processor, model = AutoProcessor.from_pretrained(path), _load(AutoModelForImageTextToText, path)
    system = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    prompt = processor.apply_chat_template([system, *_messages("Rate it.")], add_generation_prompt=True)
    assert prompt == "Be brief. USER: <image>\nRate it. ASSISTANT:"  # LLaVA's llava_v1 conversation
    inputs = processor(images=[_image()], text=[prompt], return_tensors="pt")
    assert (inputs.input_ids == model.config.image_token_id).sum() == model.config.image_seq_length
    with torch.no_grad():
        out = model(**inputs)
    assert out.logits.shape == (1, inputs.input_ids.shape[1], model.config.text_config.vocab_size)


def test_vilt(built):
    from transformers import AutoModel, AutoProcessor, ViltForMaskedLM

    path = built("vilt")
    processor = AutoProcessor.from_pretrained(path)
    inputs = processor(images=[_image(), _image(20, 50)], text=[CAPTION, "a cat"], padding=True, return_tensors="pt")
    assert type(processor.tokenizer).__name__ == "BertTokenizer" and "pixel_mask" in inputs
    with torch.no_grad():
        out = _load(AutoModel, path)(**inputs)
        logits = _load(ViltForMaskedLM, path)(**inputs).logits
    assert out.pooler_output.shape == (2, 32) and out.last_hidden_state.shape[0] == 2
    assert logits.shape == (*inputs.input_ids.shape, len(processor.tokenizer))


def test_blip_itm(built):
    from transformers import AutoProcessor, BlipForImageTextRetrieval

    path = built("blip_itm")
    processor, model = AutoProcessor.from_pretrained(path), _load(BlipForImageTextRetrieval, path)
    assert processor.tokenizer.bos_token == "[DEC]" and "[ENC]" in processor.tokenizer.get_vocab()
    inputs = processor(images=[_image(), _image(20, 50)], text=[CAPTION, "a cat"], padding=True, return_tensors="pt")
    with torch.no_grad():
        itm = model(**inputs).itm_score
        cosine = model(**inputs, use_itm_head=False).itm_score
    assert itm.shape == (2, 2) and cosine.shape == (2, 2)


def test_siglip(built):
    from transformers import AutoModel, AutoProcessor, AutoTokenizer

    path = built("siglip")
    processor, model = AutoProcessor.from_pretrained(path), _load(AutoModel, path)
    assert type(processor).__name__ == "SiglipProcessor" and type(model).__name__ == "SiglipModel"
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == model.config.text_config.eos_token_id
    inputs = processor(images=[_image()], text=[CAPTION, "a cat"], padding="max_length", return_tensors="pt")
    assert inputs.input_ids.shape == (2, 64) and tokenizer.unk_token_id not in inputs.input_ids
    with torch.no_grad():
        out = model(**inputs)
    assert out.logits_per_image.shape == (1, 2) and out.image_embeds.shape == (1, 32)


# --- LVLMs ---------------------------------------------------------------------------------------------------

DIGITS = [str(d) for d in range(10)]


def _messages(text):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


PROMPTS = ["Rate it.", "Rate this caption from 0 to 1: " + CAPTION]
IMAGES = [(40, 24), (30, 90)]  # different sizes: different numbers of image tokens


def _lvlm_inputs(kind, path):
    """(tokenizer, left-padded batch of two prompts with an image each), through the processor where it exists;
    for Qwen without torchvision, the processor's work by hand with the image processor and tokenizer."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    images = [_image(w, h, seed=i) for i, (w, h) in enumerate(IMAGES)]
    if kind not in QWEN or is_torchvision_available():
        processor = AutoProcessor.from_pretrained(path)
        texts = [processor.apply_chat_template(_messages(p), add_generation_prompt=True) for p in PROMPTS]
        processor.tokenizer.padding_side = "left"
        return processor.tokenizer, processor(images=images, text=texts, padding=True, return_tensors="pt")
    tokenizer, image_processor = AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)
    pixels = image_processor(images=images, return_tensors="pt")
    counts = (pixels.image_grid_thw.prod(-1) // image_processor.merge_size**2).tolist()
    texts = [tokenizer.apply_chat_template(_messages(p), add_generation_prompt=True, tokenize=False) for p in PROMPTS]
    texts = [t.replace("<|image_pad|>", "<|image_pad|>" * n) for t, n in zip(texts, counts)]
    tokenizer.padding_side = "left"
    inputs = tokenizer(texts, padding=True, return_tensors="pt")
    inputs["mm_token_type_ids"] = (inputs.input_ids == tokenizer.convert_tokens_to_ids("<|image_pad|>")).int()
    inputs.update(pixels)
    return tokenizer, inputs


@pytest.mark.parametrize("kind", LVLMS)
def test_lvlm_digit_tokens(kind, built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built(kind))
    vocab = tokenizer.get_vocab()
    # '0'..'9' and '.' are tokens, and no other token holds a digit (Llama's "<0x30>" byte pieces aside).
    assert all(t in vocab for t in [*DIGITS, "."])
    with_digits = [t for t in vocab if set(t) & set("0123456789") and not t.startswith("<0x")]
    assert sorted(with_digits) == DIGITS
    assert len({tokenizer.convert_tokens_to_ids(d) for d in DIGITS}) == 10
    prompt = tokenizer.apply_chat_template(_messages("Rate it."), add_generation_prompt=True, tokenize=False)
    for text in ["0.85", " 0.85", prompt + "0.85", prompt + " 0.85"]:
        pieces = tokenizer.tokenize(text)
        assert pieces[-4:] == ["0", ".", "8", "5"], (text, pieces)
        if text in ("0.85", " 0.85"):
            assert pieces[:-4] in ([], ["▁"], ["Ġ"]), pieces


@pytest.mark.parametrize("kind", LVLMS)
def test_lvlm_chat_template(kind, built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built(kind))
    prompt = tokenizer.apply_chat_template(_messages("Rate it."), add_generation_prompt=True, tokenize=False)
    if kind == "llava_next":
        assert prompt == "[INST] <image>\nRate it. [/INST]"
    else:
        assert prompt.endswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Rate it.<|im_end|>\n"
                               "<|im_start|>assistant\n")
        assert prompt.startswith("<|im_start|>system\n") == (kind != "qwen3_vl")
    ids = tokenizer.apply_chat_template(_messages("Rate it."), add_generation_prompt=True, tokenize=True)
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids["input_ids"]


@pytest.mark.parametrize("kind", LVLMS)
def test_lvlm_forward_generate_and_digit_softmax(kind, built):
    from transformers import AutoModelForImageTextToText

    path = built(kind)
    model = _load(AutoModelForImageTextToText, path)
    tokenizer, inputs = _lvlm_inputs(kind, path)
    image_tokens = (inputs.input_ids == model.config.image_token_id).sum(1)
    assert image_tokens[0] != image_tokens[1]  # two image sizes ...
    assert (inputs.attention_mask[:, 0] == 0).any() and (inputs.attention_mask[:, -1] == 1).all()  # ... left-padded
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    assert out.logits.shape == (*inputs.input_ids.shape, model.config.text_config.vocab_size)
    assert model.config.text_config.vocab_size >= len(tokenizer)

    # The digit distribution a judge reads from the logits is the one the LM head gives the last hidden state.
    digit_ids = tokenizer.convert_tokens_to_ids(DIGITS)
    h = out.hidden_states[-1][:, -1]
    direct = torch.softmax(h @ model.lm_head.weight[digit_ids].T, -1)
    torch.testing.assert_close(torch.softmax(out.logits[:, -1, digit_ids], -1), direct, atol=1e-5, rtol=1e-5)

    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert generated.shape[0] == 2 and 1 <= generated.shape[1] - inputs.input_ids.shape[1] <= 3
    assert torch.equal(generated[:, : inputs.input_ids.shape[1]], inputs.input_ids)


def test_llava_next_processor_agrees_with_config(built):
    from transformers import AutoConfig, AutoProcessor

    path = built("llava_next")
    processor, config = AutoProcessor.from_pretrained(path), AutoConfig.from_pretrained(path)
    assert processor.patch_size == config.vision_config.patch_size
    assert processor.vision_feature_select_strategy == config.vision_feature_select_strategy == "default"
    assert processor.num_additional_image_tokens == 1  # CLIP's CLS
    assert processor.image_processor.image_grid_pinpoints == config.image_grid_pinpoints
    assert processor.image_token_id == config.image_token_id
    assert processor.tokenizer("a").input_ids[0] == processor.tokenizer.bos_token_id == config.text_config.bos_token_id


@pytest.mark.parametrize("kind", QWEN)
def test_qwen_config_agrees_with_tokenizer_and_image_processor(kind, built):
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    path = built(kind)
    config, tokenizer = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert config.text_config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    image_processor = AutoImageProcessor.from_pretrained(path)
    assert image_processor.patch_size == config.vision_config.patch_size
    assert image_processor.merge_size == config.vision_config.spatial_merge_size


@needs_torchvision
@pytest.mark.parametrize("kind", QWEN)
def test_qwen_processor(kind, built):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(built(kind))
    text = processor.apply_chat_template(_messages("Rate it."), add_generation_prompt=True)
    inputs = processor(images=[_image()], text=text, return_tensors="pt")
    assert "mm_token_type_ids" in inputs and "image_grid_thw" in inputs


def test_default_root_is_removed_when_the_process_exits_and_a_forked_child_leaves_it(tmp_path):
    """Checkpoints built without a root live in a scratch folder of the process that made it: gone after that
    process exits (a test run leaves nothing in /tmp), untouched when a forked child exits first."""
    import os
    import subprocess
    import sys

    code = ("import os, sys\n"
            "from capeval_plugins.testing import tiny_checkpoint\n"
            "path = tiny_checkpoint('clip')\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    sys.exit(0)\n"  # runs the child's exit handlers, unlike os._exit
            "os.waitpid(pid, 0)\n"
            "print(path, os.path.isdir(path))\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    path, alive_after_child = out.stdout.split()
    assert path.startswith(str(tmp_path)) and alive_after_child == "True"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("capeval-")] == []  # torch keeps its own caches
