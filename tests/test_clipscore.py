"""CLIPScore / RefCLIPScore against independent computations on a tiny random CLIP."""
from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
from conftest import CAPTIONS, REFERENCES, flickr8k_rows, random_image

import capeval_plugins
from capeval_plugins.testing.peers import TensorFeatures


def plain_clip(path: str):
    """The model and processor loaded directly through transformers, no capeval code."""
    from transformers import CLIPModel, CLIPProcessor

    return CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)


@torch.no_grad()
def plain_embed_text(model, processor, text: str) -> np.ndarray:
    tokens = processor.tokenizer([text], return_tensors="pt", truncation=True, max_length=77)
    out = model.text_model(**tokens).pooler_output
    feat = model.text_projection(out)[0].double().numpy()
    return feat / np.linalg.norm(feat)


@torch.no_grad()
def plain_embed_image(model, processor, image) -> np.ndarray:
    pixels = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    out = model.vision_model(pixel_values=pixels).pooler_output
    feat = model.visual_projection(out)[0].double().numpy()
    return feat / np.linalg.norm(feat)


def plain_clipscore(model, processor, image, caption, w=2.5):
    cos = float(plain_embed_image(model, processor, image) @ plain_embed_text(model, processor, "A photo depicts " + caption))
    return w * max(cos, 0.0)


def plain_refclipscore(model, processor, image, caption, refs, w=2.5):
    c = plain_clipscore(model, processor, image, caption, w)
    cand = plain_embed_text(model, processor, "A photo depicts " + caption)
    r = max(0.0, max(float(cand @ plain_embed_text(model, processor, "A photo depicts " + ref)) for ref in refs))
    return 0.0 if c + r == 0 else 2 * c * r / (c + r)


def test_clipscore_equals_a_plain_per_sample_loop(tiny_clip, images):
    model, processor = plain_clip(tiny_clip)
    result = capeval_plugins.load("clipscore", model=tiny_clip, preprocessing="transformers")(images, CAPTIONS)
    expected = [plain_clipscore(model, processor, img, cap) for img, cap in zip(images, CAPTIONS)]
    assert result.scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert result.score == pytest.approx(np.mean(expected), abs=1e-5)
    assert "refclipscore" not in result.extras  # no references, no reference extras


def test_refclipscore_equals_a_plain_loop(tiny_clip, images):
    model, processor = plain_clip(tiny_clip)
    expected = [plain_refclipscore(model, processor, *row) for row in zip(images, CAPTIONS, REFERENCES)]
    ref = capeval_plugins.load("refclipscore", model=tiny_clip, preprocessing="transformers")(images, CAPTIONS, REFERENCES)
    assert ref.scores.tolist() == pytest.approx(expected, abs=1e-5)
    both = capeval_plugins.load("clipscore", model=tiny_clip, reference_extras=True, preprocessing="transformers")(
        images, CAPTIONS, REFERENCES)
    assert both.extras["refclipscore"].tolist() == pytest.approx(expected, abs=1e-5)
    assert both.corpus_extras["mean_refclipscore"] == pytest.approx(np.mean(expected), abs=1e-5)


def test_reference_options_follow_their_definition(tiny_clip, images):
    model, processor = plain_clip(tiny_clip)
    result = capeval_plugins.load("clipscore", model=tiny_clip, prefix_references=False, clamp_reference=False,
                                  preprocessing="transformers",
                                  reference_extras=True)(images, CAPTIONS, REFERENCES)
    for i, (cap, refs) in enumerate(zip(CAPTIONS, REFERENCES)):
        cand = plain_embed_text(model, processor, "A photo depicts " + cap)
        best = max(float(cand @ plain_embed_text(model, processor, r)) for r in refs)
        assert result.extras["reference_similarity"][i].item() == pytest.approx(best, abs=1e-5)


def torchmetrics_loader(path: str):
    def load():
        model, processor = plain_clip(path)
        return TensorFeatures(model), processor

    return load


def as_tensors(images) -> list[torch.Tensor]:
    """uint8 (C, H, W) tensors, as torchmetrics takes images; one tensor per distinct image object."""
    made: dict[int, torch.Tensor] = {}
    for img in images:
        if id(img) not in made:
            made[id(img)] = torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous()
    return [made[id(img)] for img in images]


def test_agrees_with_torchmetrics_clipscore(tiny_clip, images):
    """torchmetrics scores 100 * cos without the prompt prefix per sample, and its corpus value is
    max(mean, 0) (it clamps after averaging; CLIP-S clamps each sample)."""
    from torchmetrics.functional.multimodal.clip_score import _clip_score_update
    from torchmetrics.multimodal.clip_score import CLIPScore as TMCLIPScore

    load = torchmetrics_loader(tiny_clip)
    tensors = as_tensors(images)
    theirs = TMCLIPScore(model_name_or_path=load)
    theirs.update(tensors, CAPTIONS)
    per_sample, _ = _clip_score_update(tensors, CAPTIONS, *load())
    ours = capeval_plugins.load("clipscore", model=tiny_clip, w=100.0, prefix="", preprocessing="transformers")(
        tensors, CAPTIONS)
    assert (100 * ours.extras["cosine"]).tolist() == pytest.approx(per_sample.tolist(), abs=1e-3)
    assert ours.scores.tolist() == pytest.approx(per_sample.clamp_min(0).tolist(), abs=1e-3)
    assert max(100 * ours.extras["cosine"].mean().item(), 0.0) == pytest.approx(float(theirs.compute()), abs=1e-3)


def test_agrees_with_torchmetrics_clipscore_on_flickr8k_expert_and_real_photos(tiny_clip, monkeypatch):
    """243 Flickr8k-Expert captions (12 words on average, several per image) of 40 crops of real photos,
    torchmetrics fed batches of 64 rows as a user would. Both take the same float32 features of unit
    length, whose cosine agrees to a few 1e-7 whatever the batching and padding: x100, 1e-4. The few captions
    over CLIP's 77 tokens are left out: torchmetrics cuts them without their end-of-text token, where CLIP
    pools, so there the two differ by definition."""
    import torchmetrics.multimodal.clip_score as tm
    from torchmetrics.multimodal.clip_score import CLIPScore as TMCLIPScore

    pairs, photos = flickr8k_rows(40)
    load = torchmetrics_loader(tiny_clip)
    fits = [len(ids) <= 77 for ids in load()[1].tokenizer(pairs.candidates)["input_ids"]]
    tensors = [t for t, ok in zip(as_tensors(photos), fits) if ok]
    captions = [c for c, ok in zip(pairs.candidates, fits) if ok]
    assert len(captions) >= 240 and len({id(t) for t in tensors}) == 40
    # torchmetrics keeps only the sum of its per-sample scores: record them as its update computes them
    per_sample, update = [], tm._clip_score_update
    monkeypatch.setattr(tm, "_clip_score_update", lambda *a: per_sample.append(update(*a)) or per_sample[-1])
    theirs = TMCLIPScore(model_name_or_path=load)
    for start in range(0, len(captions), 64):
        theirs.update(tensors[start:start + 64], captions[start:start + 64])
    per_sample = torch.cat([score for score, _ in per_sample]).double()
    ours = capeval_plugins.load("clipscore", model=tiny_clip, w=100.0, prefix="", batch_size=64,
                                preprocessing="transformers")(tensors, captions)
    cos100 = 100 * ours.extras["cosine"].double()
    assert cos100.tolist() == pytest.approx(per_sample.tolist(), abs=1e-4)
    assert float(cos100.std()) > 1.0  # the scores spread: agreement is not of near-constant values
    assert max(float(cos100.mean()), 0.0) == pytest.approx(float(theirs.compute()), abs=1e-4)


def test_independent_of_batch_size_and_order(tiny_clip):
    rng = random.Random(0)
    imgs = [random_image(i % 3) for i in range(10)]
    caps = [CAPTIONS[i % 4] + f" {i}" for i in range(10)]
    refs = [REFERENCES[i % 4] for i in range(10)]
    base = capeval_plugins.load("clipscore", model=tiny_clip, batch_size=64)(imgs, caps, refs)
    for batch_size in (1, 3, 7):
        other = capeval_plugins.load("clipscore", model=tiny_clip, batch_size=batch_size)(imgs, caps, refs)
        assert other.scores.tolist() == pytest.approx(base.scores.tolist(), abs=1e-5)
    order = list(range(10))
    rng.shuffle(order)
    shuffled = capeval_plugins.load("clipscore", model=tiny_clip, batch_size=4)(
        [imgs[i] for i in order], [caps[i] for i in order], [refs[i] for i in order])
    assert shuffled.scores.tolist() == pytest.approx([base.scores[i].item() for i in order], abs=1e-5)


def test_long_caption_truncated_keeping_end_of_text_and_warned_once(tiny_clip):
    from capeval_plugins.models.encoders import ClipEncoder, EncoderSpec

    enc = ClipEncoder.shared(EncoderSpec(tiny_clip))
    long = "a dog runs on the grass " * 40
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = enc.tokenize([long, "short"])
        enc.tokenize([long])
    messages = [str(w.message) for w in caught if "truncated" in str(w.message)]
    assert len(messages) == 1 and "1 caption(s)" in messages[0]
    ids = tokens["input_ids"][0]
    assert len(ids) == 77 and ids[-1].item() == enc.processor.tokenizer.eos_token_id


def test_the_same_model_is_loaded_once(tiny_clip):
    a = capeval_plugins.load("clipscore", model=tiny_clip)
    b = capeval_plugins.load("refclipscore", model=tiny_clip, w=1.0)
    assert a.encoder.clip.model is b.encoder.clip.model


def test_references_are_not_encoded_unless_their_extras_are_asked_for(tiny_clip, images, monkeypatch):
    """CLIPScore is reference-free: given references, it encodes only the candidates (and warns, naming the
    option), with the same scores; reference_extras=True encodes each distinct reference once."""
    from capeval_plugins.models.encoders import ClipEncoder

    seen: list[list[str]] = []
    original = ClipEncoder.tokenize

    def recording(self, texts):
        seen.append(list(texts))
        return original(self, texts)

    monkeypatch.setattr(ClipEncoder, "tokenize", recording)
    plain = capeval_plugins.load("clipscore", model=tiny_clip)(images, CAPTIONS)
    seen.clear()
    with pytest.warns(UserWarning, match="reference_extras=True"):
        given = capeval_plugins.load("clipscore", model=tiny_clip)(images, CAPTIONS, REFERENCES)
    assert sum(map(len, seen)) == len(set(CAPTIONS))
    assert "refclipscore" not in given.extras
    assert given.scores.tolist() == pytest.approx(plain.scores.tolist(), abs=1e-6)
    seen.clear()
    repeated = [REFERENCES[0]] * len(CAPTIONS)  # one image's references for each of its captions
    capeval_plugins.load("clipscore", model=tiny_clip, reference_extras=True)(images[:1] * len(CAPTIONS), CAPTIONS,
                                                                              repeated)
    texts = [t for call in seen for t in call]
    assert len(texts) == len(set(texts)) == len(set(CAPTIONS)) + len(set(REFERENCES[0]))


def test_text_chunks_sorted_by_length_equal_one_text_at_a_time(tiny_clip):
    """The text tower runs on chunks of similar length cut to their longest text: each embedding equals the
    text's own, alone (no padding), to float rounding; repeated texts come back in place."""
    from capeval_plugins.models.encoders import ClipEncoder, EncoderSpec
    from capeval_plugins.models.encoders import clip as clip_module

    enc = ClipEncoder.shared(EncoderSpec(tiny_clip))
    rng = random.Random(1)
    words = "a dog cat man runs on the grass near red ball water".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(40)]
    texts += texts[:5]
    alone = torch.cat([enc.encode_texts([t]) for t in texts])
    for tokens in (1, 100, 512, 1 << 16):  # one text a chunk .. all in one
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(clip_module.TEXT_CHUNK_TOKENS, "cpu", tokens)
            torch.testing.assert_close(enc.encode_texts(texts), alone, atol=2e-6, rtol=0)
    lengths = [9, 9, 7, 4, 4, 4, 1]
    chunks = clip_module.length_chunks(lengths, torch.arange(7), 18)
    assert [c.tolist() for c in chunks] == [[0, 1], [2, 3], [4, 5, 6]]


def test_int8_and_compile_change_a_model_of_their_own(tiny_clip, images, tmp_path):
    """quantize="int8" quantizes its own copy of the weights in place (no float copy kept beside the int8 one: the
    shared float model is not even loaded) and leaves the float model other metrics share as it was."""
    import shutil

    from capeval_plugins.resources import loading

    alone = shutil.copytree(tiny_clip, tmp_path / "clip")
    assert torch.isfinite(capeval_plugins.load("clipscore", model=str(alone), quantize="int8")(images, CAPTIONS).scores).all()
    assert not [key for key in loading._cache if key[0] == "model" and str(alone) in str(key)]
    plain = capeval_plugins.load("clipscore", model=tiny_clip)
    before = plain(images, CAPTIONS).scores
    int8 = capeval_plugins.load("clipscore", model=tiny_clip, quantize="int8")
    assert int8.encoder.clip.model is not plain.encoder.clip.model
    linears = [m for m in plain.encoder.clip.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.dtype == torch.float32 for m in linears)
    quantized = [m for m in int8.encoder.clip.model.modules() if "quantized" in type(m).__module__]
    assert quantized and not any(type(m) is torch.nn.Linear for m in int8.encoder.clip.model.modules())
    assert torch.isfinite(int8(images, CAPTIONS).scores).all()
    assert plain(images, CAPTIONS).scores.tolist() == before.tolist()


# --- long captions: the mean over sentences (CaptionEvalKit's --sentence-average) --------------------------------

LONG_CAPTIONS = [
    "A dog runs on the grass. It chases a red ball!  The sun is out?\nA child watches from the bench.",
    "Two children play in the park",
    "",
    "A red car.\n\n\nNext to a building... with tall windows. ",
    "   ",
]


def split_like_the_toolkit(caption: str) -> list[str]:
    """CaptionEvalKit's sentence splitter, written as a character scan (no regular expression): a cut at a
    whitespace run that follows '.', '!' or '?' (the whole run), or at a run of newlines anywhere; pieces stripped,
    empty ones dropped; the caption itself when nothing is left."""
    pieces, current, i = [], "", 0
    while i < len(caption):
        ch = caption[i]
        after_stop = i > 0 and caption[i - 1] in ".!?"
        if ch.isspace() and (after_stop or ch == "\n"):
            j = i
            while j < len(caption) and (caption[j].isspace() if after_stop else caption[j] == "\n"):
                j += 1
            pieces.append(current)
            current, i = "", j
            continue
        current += ch
        i += 1
    pieces.append(current)
    kept = [p.strip() for p in pieces if p.strip()]
    return kept or [caption]


def test_the_sentence_splitter_is_the_toolkits():
    from capeval_plugins.core.clip_score import split_sentences

    texts = LONG_CAPTIONS + CAPTIONS + ["Dr. Smith arrived.Then left", "Wow!!  Really?? yes.\tno", "a\nb \n c. d",
                                        "end.", "x\u00a0. y", "one. \u2003two"]
    for text in texts:
        assert split_sentences(text) == split_like_the_toolkit(text), text
    assert split_sentences("A dog. A cat!\nA bird") == ["A dog.", "A cat!", "A bird"]


def test_sentence_average_equals_a_plain_per_sentence_loop(tiny_clip):
    """Each candidate's score is the mean over its sentences of w * max(cos, 0), every sentence prefixed and
    encoded alone; computed here one sentence at a time through transformers, against the metric's one batched
    pass at two batch sizes. References are given and not used: the reference extras are left out."""
    model, processor = plain_clip(tiny_clip)
    pictures = [random_image(20 + i, size=(44 + 3 * i, 38)) for i in range(len(LONG_CAPTIONS))]
    expected = [np.mean([plain_clipscore(model, processor, img, s) for s in split_like_the_toolkit(cap)])
                for img, cap in zip(pictures, LONG_CAPTIONS)]
    refs = [["a dog."]] * len(LONG_CAPTIONS)
    for batch_size in (2, 16):
        result = capeval_plugins.load("clipscore", model=tiny_clip, sentence_average=True, batch_size=batch_size,
                                      preprocessing="transformers")(pictures, LONG_CAPTIONS, refs)
        assert result.scores.tolist() == pytest.approx(expected, abs=1e-5)
        assert "refclipscore" not in result.extras and "reference_similarity" not in result.extras
    whole = capeval_plugins.load("clipscore", model=tiny_clip, preprocessing="transformers")(pictures, LONG_CAPTIONS)
    assert whole.scores[1].item() == pytest.approx(expected[1], abs=1e-5)  # one sentence: the plain score
    assert not np.allclose(whole.scores.numpy()[[0, 3]], np.asarray(expected)[[0, 3]], atol=1e-4)


@pytest.mark.parametrize("name", ["refclipscore", "refpacscore", "refpacscore_pp"])
def test_reference_metrics_refuse_the_sentence_average(name):
    with pytest.raises(ValueError, match="sentence_average is defined for the image-text score only"):
        capeval_plugins.load(name, sentence_average=True)
