"""ViLBERTScore on tiny ViLT and BLIP-ITM checkpoints, against a plain per-pair computation written directly
with transformers (each image-caption pair encoded alone, tokens matched by a loop over token pairs)."""
from __future__ import annotations

import functools
import json
import math
import random

import pytest
import torch
from conftest import PYTHON, random_image, run
from test_matching import plain_prf

import capeval_plugins
from capeval_plugins.inputs import InputError

CAPTIONS = ["A dog runs on the grass.", "Two children play in the park!", "A red car next to a building"]
FIVE_REFERENCES = [
    ["A dog running on grass.", "A brown dog plays outside.", "A dog.", "The dog runs fast on a field.", "Grass."],
    ["Kids playing in a park.", "Two kids.", "Children outside.", "A park with children playing.", "Play time."],
    ["A car parked by a building.", "A red car.", "A vehicle on a street.", "A car.", "A building and a car."],
]


@pytest.fixture(scope="session")
def tiny_vilt(tiny_root) -> str:
    from capeval_plugins.testing import tiny_checkpoint

    return str(tiny_checkpoint("vilt", root=tiny_root))


@pytest.fixture(scope="session")
def tiny_blip(tiny_root) -> str:
    from capeval_plugins.testing import tiny_checkpoint

    return str(tiny_checkpoint("blip_itm", root=tiny_root))


@pytest.fixture
def three_images():
    return [random_image(10 + i, size=(40 + 8 * i, 36 + 4 * i)) for i in range(3)]


# --- plain computation: one image-caption pair at a time, straight through transformers -------------------------
@functools.lru_cache(maxsize=None)
def plain_load(path: str, kind: str):
    from transformers import BlipForImageTextRetrieval, BlipProcessor, ViltModel, ViltProcessor

    if kind == "vilt":
        return ViltModel.from_pretrained(path).eval(), ViltProcessor.from_pretrained(path)
    return BlipForImageTextRetrieval.from_pretrained(path).eval(), BlipProcessor.from_pretrained(path)


@torch.no_grad()
def plain_vilt_tokens(path: str, image, caption: str, layer: int, final_norm: bool) -> list[list[float]]:
    model, processor = plain_load(path, "vilt")
    inputs = processor(images=image, text=caption, return_tensors="pt")
    # All patches are kept (max_image_length=-1): ViLT's random patch order does not change the text tokens.
    out = model(**inputs, output_hidden_states=True)
    n_text = inputs["input_ids"].shape[1]
    hidden = out.hidden_states[layer][0, :n_text]
    if final_norm:
        hidden = model.layernorm(hidden)
    return hidden[1:-1].tolist()  # without [CLS] and [SEP]


@torch.no_grad()
def plain_blip_tokens(path: str, image, caption: str, layer: int) -> list[list[float]]:
    model, processor = plain_load(path, "blip")
    inputs = processor(images=image, text=caption, return_tensors="pt")
    image_embeds = model.vision_model(pixel_values=inputs["pixel_values"]).last_hidden_state
    out = model.text_encoder(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                             encoder_hidden_states=image_embeds, output_hidden_states=True)
    return out.hidden_states[layer][0, 1:-1].tolist()


def plain_vilbertscore(tokens_of, image, caption, refs, how="mean"):
    cand = tokens_of(image, caption)
    per_ref = []
    for ref in refs:
        ref_tokens = tokens_of(image, ref)
        per_ref.append(plain_prf(cand, ref_tokens, [True] * len(cand), [True] * len(ref_tokens),
                                 [1.0] * len(cand), [1.0] * len(ref_tokens)))
    reduce = (lambda xs: sum(xs) / len(xs)) if how == "mean" else max
    return tuple(reduce([prf[k] for prf in per_ref]) for k in range(3))


def prf_rows(result) -> list[tuple[float, float, float]]:
    return list(zip(result.extras["precision"].tolist(), result.extras["recall"].tolist(), result.scores.tolist()))


@pytest.mark.parametrize("layer,final_norm", [(-1, True), (1, True), (1, False)])
@pytest.mark.parametrize("n_refs", [1, 5])
def test_vilt_equals_a_plain_per_pair_computation(tiny_vilt, three_images, layer, final_norm, n_refs):
    refs = [r[:n_refs] for r in FIVE_REFERENCES]
    result = capeval_plugins.load("vilbertscore", model=tiny_vilt, layer=layer, final_norm=final_norm)(
        three_images, CAPTIONS, refs)
    index = layer if layer >= 0 else 2  # the tiny ViLT has two blocks
    tokens_of = lambda img, text: plain_vilt_tokens(tiny_vilt, img, text, index, final_norm)  # noqa: E731
    for got, image, caption, sample_refs in zip(prf_rows(result), three_images, CAPTIONS, refs):
        assert got == pytest.approx(plain_vilbertscore(tokens_of, image, caption, sample_refs), abs=1e-5)
    assert result.extras["f1"].tolist() == result.scores.tolist()


@pytest.mark.parametrize("how", ["mean", "max"])
def test_blip_equals_a_plain_per_pair_computation(tiny_blip, three_images, how):
    result = capeval_plugins.load("vilbertscore", model=tiny_blip, multi_reference=how)(
        three_images, CAPTIONS, FIVE_REFERENCES)
    tokens_of = lambda img, text: plain_blip_tokens(tiny_blip, img, text, 2)  # noqa: E731
    for got, image, caption, refs in zip(prf_rows(result), three_images, CAPTIONS, FIVE_REFERENCES):
        assert got == pytest.approx(plain_vilbertscore(tokens_of, image, caption, refs, how), abs=1e-5)


@pytest.mark.parametrize("kind", ["vilt", "blip"])
def test_token_embeddings_change_when_the_image_changes(kind, tiny_vilt, tiny_blip, three_images):
    from capeval_plugins.models.encoders.common import EncoderSpec
    from capeval_plugins.models.encoders.conditioned import ConditionedEncoder

    path = tiny_vilt if kind == "vilt" else tiny_blip
    enc = ConditionedEncoder.shared(EncoderSpec(path))
    context = enc.encode_images(three_images[:2])
    emb = enc.embed(["a dog runs on the grass", "a dog runs on the grass"], torch.tensor([0, 1]), context)
    text = emb.attention_mask[0] & ~emb.special[0]
    assert (emb.embeddings[0][text] - emb.embeddings[1][text]).abs().max() > 1e-3
    # ... and so does the score of the same caption against the same reference.
    metric = capeval_plugins.load("vilbertscore", model=path)
    scores = metric(three_images[:2], ["a dog runs"] * 2, [["a brown dog on grass"]] * 2).scores
    assert abs(scores[0].item() - scores[1].item()) > 1e-6


@pytest.mark.parametrize("max_image_patches", [-1, 5])
def test_independent_of_batch_size_and_order(tiny_vilt, max_image_patches):
    """With 5 of 16-20 patches kept, each image's seeded draw decides the score: batching must not change it."""
    imgs = [random_image(i % 3, size=(40 + 8 * (i % 3), 36)) for i in range(7)]
    caps = [CAPTIONS[i % 3] + f" {i}" for i in range(7)]
    refs = [FIVE_REFERENCES[i % 3][: 1 + i % 5] for i in range(7)]
    load = lambda **kw: capeval_plugins.load("vilbertscore", model=tiny_vilt,  # noqa: E731
                                             max_image_patches=max_image_patches, **kw)
    base = load(batch_size=64)(imgs, caps, refs)
    for batch_size in (1, 3):
        other = load(batch_size=batch_size)(imgs, caps, refs)
        assert prf_rows(other) == [pytest.approx(row, abs=1e-5) for row in prf_rows(base)]
    order = list(range(7))
    random.Random(0).shuffle(order)
    shuffled = load(batch_size=4)([imgs[i] for i in order], [caps[i] for i in order], [refs[i] for i in order])
    assert shuffled.scores.tolist() == pytest.approx([base.scores[i].item() for i in order], abs=1e-5)


def test_patch_sampling_is_seeded_and_leaves_the_global_random_state_alone(tiny_vilt, three_images):
    def run(seed):
        metric = capeval_plugins.load("vilbertscore", model=tiny_vilt, max_image_patches=5, seed=seed)
        return metric(three_images, CAPTIONS, FIVE_REFERENCES).scores

    state = torch.get_rng_state()
    first, again, other = run(0), run(0), run(1)
    assert torch.equal(torch.get_rng_state(), state)
    assert first.tolist() == again.tolist()
    assert (first - other).abs().max() > 1e-6  # a different draw of 5 patches gives a different score


def test_references_mean_and_max_follow_single_reference_scores(tiny_vilt, three_images):
    single = [
        capeval_plugins.load("vilbertscore", model=tiny_vilt)(three_images, CAPTIONS, [[r[j]] for r in FIVE_REFERENCES])
        for j in range(5)
    ]
    per_ref = torch.stack([s.scores for s in single], -1)
    mean = capeval_plugins.load("vilbertscore", model=tiny_vilt)(three_images, CAPTIONS, FIVE_REFERENCES)
    best = capeval_plugins.load("vilbertscore", model=tiny_vilt, multi_reference="max")(
        three_images, CAPTIONS, FIVE_REFERENCES)
    assert mean.scores.tolist() == pytest.approx(per_ref.mean(-1).tolist(), abs=1e-6)
    assert best.scores.tolist() == pytest.approx(per_ref.max(-1).values.tolist(), abs=1e-6)
    assert mean.corpus_extras["mean_precision"] == pytest.approx(mean.extras["precision"].mean().item())


def test_each_distinct_image_is_encoded_once(tiny_vilt, three_images, monkeypatch):
    from capeval_plugins.models.encoders.conditioned import ViltConditioned

    seen = []
    original = ViltConditioned.encode_images

    def counting(self, images):
        seen.append(len(images))
        return original(self, images)

    monkeypatch.setattr(ViltConditioned, "encode_images", counting)
    imgs = [three_images[i % 3] for i in range(9)]
    capeval_plugins.load("vilbertscore", model=tiny_vilt)(imgs, [f"a caption {i}" for i in range(9)], [["a ref"]] * 9)
    assert seen == [3]


TRUNCATION_WARNINGS = """
import json, sys, warnings
from PIL import Image
import capeval_plugins
from capeval_plugins.models.encoders.common import EncoderSpec
from capeval_plugins.models.encoders.conditioned import ConditionedEncoder
long = "a dog runs on the grass " * 20
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ConditionedEncoder.shared(EncoderSpec(sys.argv[1])).tokenize([long, "short"])
    capeval_plugins.load("vilbertscore", model=sys.argv[1])([Image.new("RGB", (32, 32), (90, 40, 10))], [long], [[long]])
print(json.dumps([str(w.message) for w in caught if "truncated" in str(w.message)]))
"""


def test_long_caption_truncated_to_the_text_limit_and_warned_once(tiny_vilt, three_images):
    from capeval_plugins.models.encoders.common import EncoderSpec
    from capeval_plugins.models.encoders.conditioned import ConditionedEncoder

    enc = ConditionedEncoder.shared(EncoderSpec(tiny_vilt))
    long = "a dog runs on the grass " * 20
    ids, _ = enc.tokenize([long, "short"])
    result = capeval_plugins.load("vilbertscore", model=tiny_vilt)(three_images[:1], [long], [[long]])
    assert len(ids[0]) == 40 and ids[0][-1] == enc.tokenizer.sep_token_id
    assert result.scores[0].item() == pytest.approx(1.0, abs=1e-5)  # identical texts match themselves
    # Said once per process: in a fresh one (this one's earlier tests may have said it already), the encoder's
    # tokenizer and the metric, each meeting the long caption, say it exactly once.
    said = json.loads(run([PYTHON, "-c", TRUNCATION_WARNINGS, tiny_vilt]).stdout.splitlines()[-1])
    assert len(said) == 1 and "truncated" in said[0], said


def test_an_image_too_elongated_for_vilts_resize_is_its_samples_problem(tiny_vilt, three_images, tmp_path):
    """ViLT's processor rounds a 2100 x 100 image's shorter side down to 0 and raises: that sample is refused in
    one line naming it (a chained traceback before), or skipped, the others scored as alone."""
    from PIL import Image

    Image.new("RGB", (2100, 100), (20, 200, 20)).save(tmp_path / "banner.png")
    images = [three_images[0], tmp_path / "banner.png", three_images[1]]
    captions, refs = ["a cat", "a green banner", "a dog"], [["a cat"], ["a banner"], ["a dog"]]
    with pytest.raises(InputError, match=r"sample 1: .*2100 x 100 image, too elongated") as raised:
        capeval_plugins.load("vilbertscore", model=tiny_vilt)(images, captions, refs)
    assert len(str(raised.value).splitlines()) == 1
    skipped = capeval_plugins.load("vilbertscore", model=tiny_vilt, on_error="skip")(images, captions, refs)
    alone = capeval_plugins.load("vilbertscore", model=tiny_vilt)(images[::2], captions[::2], refs[::2])
    assert list(skipped.skipped) == [1] and math.isnan(skipped.scores[1])
    assert skipped.scores[[0, 2]].tolist() == pytest.approx(alone.scores.tolist(), abs=1e-6)


def test_unsupported_model_is_refused(tiny_root, three_images):
    from capeval_plugins.testing import tiny_checkpoint

    metric = capeval_plugins.load("vilbertscore", model=str(tiny_checkpoint("deberta_v3", root=tiny_root)))
    with pytest.raises(ValueError, match="ViLT"):
        metric(three_images[:1], ["a dog"], [["a dog"]])
    with pytest.raises(ValueError, match="multi_reference"):
        capeval_plugins.load("vilbertscore", multi_reference="median")
