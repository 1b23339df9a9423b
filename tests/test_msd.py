"""MSD-Score and Soft-MSD on tiny random CLIP and SigLIP checkpoints, against a plain per-sample pipeline
(features straight from transformers, the numpy EM of test_vmf, the formulas written out)."""
from __future__ import annotations

import functools
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CAPTIONS, free_port, random_image, spawn_ranks
from PIL import Image
from test_vmf import (adaptive_log_density, coco_cf_log_density, gaussian_log_density, plain_fit, plain_fit_adaptive,
                      plain_fit_coco_cf, plain_fit_gaussian, plain_log_density)

import capeval_plugins
from capeval_plugins.core import vmf
from capeval_plugins.inputs import InputError, image_group_ids, image_source
from capeval_plugins.metrics.msd import pixel_seeds, soft_msd_gate
from capeval_plugins.testing.official_msd import official_pair

# Three images with 3, 1 and 2 candidates.
IMAGE_OF = [0, 0, 0, 1, 2, 2]
CANDIDATES = [CAPTIONS[0], CAPTIONS[1], "a dog on the grass next to a red car", CAPTIONS[3], CAPTIONS[2],
              "two children and an old man"]


@pytest.fixture(scope="session")
def tiny_siglip(tiny_root) -> str:
    from capeval_plugins.testing import tiny_checkpoint

    return str(tiny_checkpoint("siglip", root=tiny_root))


@pytest.fixture(scope="session")
def pictures() -> list[Image.Image]:
    return [random_image(10 + i, size=(40 + 6 * i, 36)) for i in range(3)]


@pytest.fixture(scope="session")
def picture_files(tmp_path_factory, pictures) -> list[str]:
    folder = tmp_path_factory.mktemp("msd_images")
    paths = []
    for i, img in enumerate(pictures):
        paths.append(str(folder / f"{i}.png"))
        img.save(paths[-1])
    return paths


def corpus(pictures):
    return [pictures[i] for i in IMAGE_OF], list(CANDIDATES)


# ---------------------------------------------------------------------------------------------------------
# The plain pipeline.


def unit(x: torch.Tensor) -> np.ndarray:
    x = x.double().numpy()
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@functools.lru_cache(maxsize=None)
def plain_model(path: str):
    """The model and processor loaded directly through transformers, no capeval code."""
    import json

    from transformers import AutoModel, AutoProcessor, BlipForImageTextRetrieval

    with open(Path(path) / "config.json") as f:
        blip = "BlipForImageTextRetrieval" in json.load(f).get("architectures", [])
    loader = BlipForImageTextRetrieval if blip else AutoModel
    return loader.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)


@torch.no_grad()
def plain_features(path: str, image, caption: str, post_layernorm: bool = False, siglip_head: bool = False) -> dict:
    """Global and local features of one pair, computed from transformers directly, plus the seeds of the
    plain EM (from the pixels and the content token ids, no padding anywhere)."""
    model, processor = plain_model(path)
    pixels = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    vision = model.vision_model(pixel_values=pixels)
    siglip = model.config.model_type == "siglip"
    blip = hasattr(model, "text_encoder")
    if blip:  # the official BLIP script: vision_proj / text_proj, class tokens pooled, [CLS] / [SEP] dropped
        projected = model.vision_proj(vision.last_hidden_state[0])
        image_global, patches = projected[0], projected[1:]
        tokens = processor.tokenizer([caption], truncation=True, return_tensors="pt")
        text = model.text_proj(model.text_encoder(**tokens).last_hidden_state[0])
        keep = torch.zeros_like(tokens["input_ids"][0], dtype=torch.bool)
        keep[1:-1] = True
        text_global, token_feats = text[0], text[keep]
    elif siglip:
        hidden = vision.last_hidden_state
        tokens = processor.tokenizer([caption], padding="max_length", max_length=64, truncation=True,
                                     return_tensors="pt")
        text = model.text_model(**tokens)
        keep = tokens["input_ids"][0] != processor.tokenizer.eos_token_id
        if siglip_head:  # the attention-pooling head looking at one patch at a time
            patches = torch.cat([model.vision_model.head(hidden[:, n:n + 1]) for n in range(hidden.shape[1])])
            token_feats = model.text_model.head(text.last_hidden_state[0, keep])
        else:  # the official SigLIP script: raw last hidden states
            patches, token_feats = hidden[0], text.last_hidden_state[0, keep]
        image_global = vision.pooler_output[0]
        text_global = text.pooler_output[0]
    else:
        hidden = vision.last_hidden_state[0, 1:]
        if post_layernorm:
            hidden = model.vision_model.post_layernorm(hidden)
        patches = model.visual_projection(hidden)
        image_global = model.get_image_features(pixel_values=pixels).pooler_output[0]
        tokens = processor.tokenizer([caption], truncation=True, max_length=77, return_tensors="pt")
        text = model.text_model(**tokens)
        keep = torch.zeros_like(tokens["input_ids"][0], dtype=torch.bool)
        keep[1:-1] = True  # drop BOS and EOS
        if not keep.any():  # the official CLIP scripts: a caption of nothing keeps BOS and EOS
            keep[:] = True
        token_feats = model.text_projection(text.last_hidden_state[0, keep])
        text_global = model.get_text_features(**tokens).pooler_output[0]
    ids = tokens["input_ids"][0, keep]
    return {
        "patches": unit(patches), "tokens": unit(token_feats),
        "image_global": unit(image_global), "text_global": unit(text_global),
        "image_seed": int(pixel_seeds(pixels)[0]), "text_seed": int(vmf.content_seeds(ids[None])[0]),
    }


def plain_mixtures(em: str, kappa: float, iterations: int, sigma: float = 0.1):
    """(fit, log_density) of one of the EMs of test_vmf: "restart" (the paper), "coco-cf", "gaussian",
    "adaptive"."""
    if em == "coco-cf":
        return (lambda x, k, seed: plain_fit_coco_cf(x, k, kappa, iterations, seed),
                lambda x, mixture: coco_cf_log_density(x, *mixture, kappa))
    if em == "gaussian":
        return (lambda x, k, seed: plain_fit_gaussian(x, k, sigma, iterations, seed),
                lambda x, mixture: gaussian_log_density(x, *mixture, sigma))
    if em == "adaptive":
        return (lambda x, k, seed: plain_fit_adaptive(x, k, kappa, iterations, seed),
                lambda x, mixture: adaptive_log_density(x, *mixture))
    return (lambda x, k, seed: plain_fit(x, k, kappa, iterations, seed)[:2],
            lambda x, mixture: plain_log_density(x, *mixture, kappa))


def plain_msd(f: dict, k_image=3, k_text=2, kappa=20.0, iterations=20, lam=0.1, l0=20.0, tau_l=3.0,
              pooling="model", em="restart", direction="length", sigma=0.1) -> dict:
    fit, log_density = plain_mixtures(em, kappa, iterations, sigma)
    p = fit(f["patches"], k_image, f["image_seed"])
    q = fit(f["tokens"], k_text, f["text_seed"])
    kl_it = np.mean(log_density(f["patches"], p) - log_density(f["patches"], q))
    kl_ti = np.mean(log_density(f["tokens"], q) - log_density(f["tokens"], p))
    length = len(f["tokens"])
    beta = {"image_to_text": 1.0, "text_to_image": 0.0}.get(direction, 1.0 / (1.0 + np.exp((length - l0) / tau_l)))
    divergence = beta * kl_it + (1 - beta) * kl_ti
    if pooling == "mean":
        gi, gt = f["patches"].mean(0), f["tokens"].mean(0)
        g = float(gi @ gt / np.linalg.norm(gi) / np.linalg.norm(gt))
    else:
        g = float(f["image_global"] @ f["text_global"])
    return {"cosine": g, "kl_image_text": kl_it, "kl_text_image": kl_ti, "beta": beta, "bi_kl": divergence,
            "n_tokens": length, "msd": g - lam * divergence}


def plain_soft_msd(rows: list[dict], groups: list[int], lam=0.1, tau=0.2) -> list[float]:
    out = []
    for row, group in zip(rows, groups):
        members = [r["cosine"] for r, g in zip(rows, groups) if g == group]
        m = len(members)
        p = np.exp(np.array(members) / tau)
        p /= p.sum()
        u = 1.0 if m == 1 else min(max(m / (m - 1) * (1 - p.max()), 0.0), 1.0)
        out.append(row["cosine"] - lam * u * row["bi_kl"])
    return out


@pytest.fixture(scope="module")
def plain_rows(tiny_clip, pictures):
    images, captions = corpus(pictures)
    return [plain_msd(plain_features(tiny_clip, img, cap)) for img, cap in zip(images, captions)]


# ---------------------------------------------------------------------------------------------------------
# MSD


@pytest.fixture(scope="session")
def tiny_blip(tiny_root) -> str:
    from capeval_plugins.testing import tiny_checkpoint

    return str(tiny_checkpoint("blip_itm", root=tiny_root))


@pytest.mark.parametrize("kind", ["clip", "siglip", "siglip_head", "blip_itm"])
def test_msd_equals_the_plain_pipeline(kind, tiny_clip, tiny_siglip, tiny_blip, pictures, plain_rows):
    path = {"clip": tiny_clip, "blip_itm": tiny_blip}.get(kind, tiny_siglip)
    options = {"siglip_features": "head"} if kind == "siglip_head" else {}
    images, captions = corpus(pictures)
    result = capeval_plugins.load("msd_score", model=path, **options)(images, captions)
    rows = plain_rows if kind == "clip" else [
        plain_msd(plain_features(path, i, c, siglip_head=kind == "siglip_head")) for i, c in zip(images, captions)]
    for key in ("cosine", "kl_image_text", "kl_text_image", "beta", "bi_kl", "n_tokens"):
        assert result.extras[key].tolist() == pytest.approx([r[key] for r in rows], abs=1e-5), key
    assert result.scores.tolist() == pytest.approx([r["msd"] for r in rows], abs=1e-5)
    assert result.score == pytest.approx(np.mean([r["msd"] for r in rows]), abs=1e-5)
    assert torch.isfinite(result.scores).all()


def test_options_follow_their_definition(tiny_clip, pictures):
    images, captions = corpus(pictures)
    images, captions = images[:2], captions[:2]
    options = dict(setting="long", kappa=8.0, em_iterations=7, lam=0.3, length_l0=5.0, length_tau=2.0,
                   global_pooling="mean", patch_layernorm=True)
    result = capeval_plugins.load("msd_score", model=tiny_clip, **options)(images, captions)
    for i, (img, cap) in enumerate(zip(images, captions)):
        row = plain_msd(plain_features(tiny_clip, img, cap, post_layernorm=True), k_image=5, k_text=3, kappa=8.0,
                        iterations=7, lam=0.3, l0=5.0, tau_l=2.0, pooling="mean")
        assert result.scores[i].item() == pytest.approx(row["msd"], abs=1e-5)
        assert result.extras["cosine"][i].item() == pytest.approx(row["cosine"], abs=1e-5)
    explicit = capeval_plugins.load("msd_score", model=tiny_clip, **{**options, "setting": "short"}, k_image=5,
                                    k_text=3)(images, captions)
    assert explicit.scores.tolist() == pytest.approx(result.scores.tolist(), abs=1e-12)
    # The SugarCrepe scripts' preset: 4 image and 2 text components; an explicit size still wins.
    sugarcrepe = capeval_plugins.load("soft_msd", model=tiny_clip, preset="sugarcrepe")(images, captions)
    for i, (img, cap) in enumerate(zip(images, captions)):
        row = plain_msd(plain_features(tiny_clip, img, cap), k_image=4, k_text=2)
        assert sugarcrepe.extras["msd"][i].item() == pytest.approx(row["msd"], abs=1e-5)
    assert capeval_plugins.load("msd_score", model=tiny_clip, preset="sugarcrepe", k_image=2).mixture_sizes == (2, 2)
    other_seed = capeval_plugins.load("msd_score", model=tiny_clip, seed=5, **options)(images, captions)
    assert torch.isfinite(other_seed.scores).all()


@pytest.mark.parametrize("em", ["coco-cf", "gaussian", "adaptive"])
def test_em_variants_equal_the_plain_pipeline(em, tiny_clip, pictures):
    """The official COCO-CF script's EM (preset="coco-cf": 3 / 2 components too) and Table II's ablations."""
    images, captions = corpus(pictures)
    images, captions = images[:3], captions[:3]
    # (the COCO-CF script's own starting draws are compared with it in test_coco_cf_preset_equals_the_official_loop)
    options = {"coco-cf": {"preset": "coco-cf", "draws": "content", "seed": 0},
               "gaussian": {"mixture": "gaussian", "gaussian_sigma": 0.3},
               "adaptive": {"kappa_mode": "adaptive"}}[em]
    metric = capeval_plugins.load("msd_score", model=tiny_clip, em_dtype="float64", **options)
    assert metric.config.em_update == ("coco-cf" if em == "coco-cf" else "restart")
    result = metric(images, captions)
    for i, (img, cap) in enumerate(zip(images, captions)):
        row = plain_msd(plain_features(tiny_clip, img, cap), em=em, sigma=0.3)
        # The features agree to float32 rounding (~1e-7 relative); adaptive kappas (~1e3-1e6 here) make KLs of
        # hundreds out of them, so the comparison is relative.
        for key in ("kl_image_text", "kl_text_image", "bi_kl"):
            assert result.extras[key][i].item() == pytest.approx(row[key], rel=1e-6, abs=1e-6), key
        assert result.scores[i].item() == pytest.approx(row["msd"], rel=1e-6, abs=1e-6)
    # an explicit em_update wins over the preset's
    assert capeval_plugins.load("msd_score", model=tiny_clip, preset="coco-cf",
                                em_update="restart").config.em_update == "restart"


def test_kl_direction_and_score_terms_follow_their_definition(tiny_clip, pictures):
    """Tables X / XI: D from one KL direction; Tables VI / X: g alone or -D alone as the score."""
    images, captions = corpus(pictures)
    base = capeval_plugins.load("soft_msd", model=tiny_clip)(images, captions)
    kl_it, kl_ti = base.extras["kl_image_text"], base.extras["kl_text_image"]
    for direction, divergence in (("image_to_text", kl_it), ("text_to_image", kl_ti)):
        one = capeval_plugins.load("msd_score", model=tiny_clip, kl_direction=direction)(images, captions)
        assert one.extras["bi_kl"].tolist() == pytest.approx(divergence.tolist(), abs=1e-12)
        assert one.scores.tolist() == pytest.approx((base.extras["cosine"] - 0.1 * divergence).tolist(), abs=1e-12)
    cosine = capeval_plugins.load("soft_msd", model=tiny_clip, score_terms="global")(images, captions)
    assert cosine.scores.tolist() == pytest.approx(base.extras["cosine"].tolist(), abs=1e-12)
    local = capeval_plugins.load("soft_msd", model=tiny_clip, score_terms="local")(images, captions)
    assert local.scores.tolist() == pytest.approx((-base.extras["bi_kl"]).tolist(), abs=1e-12)
    assert local.extras["msd"].tolist() == pytest.approx((-base.extras["bi_kl"]).tolist(), abs=1e-12)


def test_a_caption_without_content_tokens_scores_on_its_boundary_tokens(tiny_clip, tiny_siglip, pictures):
    """As the official CLIP scripts do (BOS and EOS when nothing else is left), a number, never NaN; the other
    captions of its batch are untouched."""
    from capeval_plugins.contract import Batch

    metric = capeval_plugins.load("msd_score", model=tiny_clip, em_dtype="float64")
    batch = Batch(candidates=["", CAPTIONS[0]], indices=torch.tensor([0, 1]), images=[pictures[0]],
                  image_index=torch.tensor([0, 0]))
    state = metric.map(batch)
    row = plain_msd(plain_features(tiny_clip, pictures[0], ""))
    assert state["n_tokens"][0].item() == 2 == row["n_tokens"]
    for key in ("cosine", "kl_image_text", "kl_text_image", "bi_kl"):
        assert state[key][0].item() == pytest.approx(row[key], abs=1e-6), key
    alone = metric.map(Batch(candidates=[CAPTIONS[0]], indices=torch.tensor([1]), images=[pictures[0]],
                             image_index=torch.tensor([0])))
    for key in ("cosine", "bi_kl", "n_tokens"):  # float32 text features padded differently: ~1e-8
        assert state[key][1].item() == pytest.approx(alone[key][0].item(), abs=1e-6), key
    siglip = capeval_plugins.load("soft_msd", model=tiny_siglip).map(batch)
    assert all(torch.isfinite(v).all() for v in siglip.values())


@pytest.mark.parametrize("bad", [{"setting": "medium"}, {"k_image": 0}, {"preset": "winoground"},
                                 {"siglip_features": "pooled"}, {"kappa": 0.0}, {"global_pooling": "max"},
                                 {"long_captions": "chunk"}, {"em_dtype": "float16"}, {"tau": -1.0},
                                 {"em_update": "never"}, {"mixture": "student"}, {"kappa_mode": "learned"},
                                 {"kl_direction": "both"}, {"score_terms": "neither"}, {"gaussian_sigma": 0.0},
                                 {"mixture": "gaussian", "kappa_mode": "adaptive"},
                                 # a setting only sizes the mixtures, which these presets fix: it changed nothing
                                 {"setting": "long", "preset": "sugarcrepe"}, {"setting": "long", "preset": "coco-cf"}])
def test_bad_options_are_refused(tiny_clip, bad):
    with pytest.raises(ValueError):
        capeval_plugins.load("soft_msd", model=tiny_clip, **bad)


def test_global_features_equal_the_existing_encoder_methods(tiny_clip, tiny_siglip, pictures):
    from capeval_plugins.models.encoders import ClipEncoder, EncoderSpec

    for path in (tiny_clip, tiny_siglip):
        enc = ClipEncoder.shared(EncoderSpec(path))
        image = enc.encode_image_patches(enc.pixel_values(pictures), siglip_features="head")
        assert torch.allclose(image.pooled, enc.encode_images(pictures), atol=1e-6)
        text = enc.encode_text_tokens(CANDIDATES, siglip_features="head")
        assert torch.allclose(text.pooled, enc.encode_texts(CANDIDATES), atol=1e-6)
        assert torch.allclose(text.local.norm(dim=-1), torch.ones(text.local.shape[:2]), atol=1e-5)


def test_score_independent_of_batching_and_order(tiny_clip, pictures):
    images, captions = corpus(pictures)
    base = capeval_plugins.load("soft_msd", model=tiny_clip)(images, captions)
    for batch_size in (1, 2, 4):
        other = capeval_plugins.load("soft_msd", model=tiny_clip, batch_size=batch_size)(images, captions)
        assert other.scores.tolist() == pytest.approx(base.scores.tolist(), abs=1e-6)
    order = list(range(len(captions)))
    random.Random(0).shuffle(order)
    shuffled = capeval_plugins.load("soft_msd", model=tiny_clip, batch_size=4)(
        [images[i] for i in order], [captions[i] for i in order])
    assert shuffled.scores.tolist() == pytest.approx([base.scores[i].item() for i in order], abs=1e-6)


def test_long_captions_truncated_with_a_warning_or_refused(tiny_root, pictures):
    from capeval_plugins.testing import tiny_checkpoint

    path = str(tiny_checkpoint("clip", root=tiny_root, seed=7))  # its own model: the warning is once per model
    long = "a dog runs on the grass " * 30
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = capeval_plugins.load("msd_score", model=path)(pictures[:2], [long, "a cat"])
    assert any("truncated" in str(w.message) for w in caught)
    assert result.extras["n_tokens"][0].item() == 75 and torch.isfinite(result.scores).all()
    with pytest.raises(InputError, match="sample 1: caption has"):
        capeval_plugins.load("msd_score", model=path, long_captions="error")(pictures[:2], ["a cat", long])


def test_diagnostics_decompose_both_kl_terms(tiny_clip, pictures, tmp_path):
    from capeval_plugins.diagnostics import render_patch_map

    images, captions = corpus(pictures)
    result = capeval_plugins.load("msd_score", model=tiny_clip, diagnostics=True, batch_size=4)(images, captions)
    ex = result.extras
    assert ex["patch_contributions"].shape == (6, 16)
    assert ex["patch_contributions"].sum(1).tolist() == pytest.approx(ex["kl_image_text"].tolist(), abs=1e-9)
    assert ex["token_contributions"].nansum(1).tolist() == pytest.approx(ex["kl_text_image"].tolist(), abs=1e-9)
    assert ex["token_contributions_on_patches"].sum(1).tolist() == pytest.approx(ex["kl_text_image"].tolist(), abs=1e-9)
    n_tokens = ex["n_tokens"].long()
    for i, n in enumerate(n_tokens.tolist()):
        row = ex["token_contributions"][i]
        assert torch.isfinite(row[:n]).all() and torch.isnan(row[n:]).all()
    plain = plain_features(tiny_clip, images[0], captions[0])
    q = plain_fit(plain["tokens"], 2, 20.0, 20, plain["text_seed"])[:2]
    p = plain_fit(plain["patches"], 3, 20.0, 20, plain["image_seed"])[:2]
    terms = (plain_log_density(plain["tokens"], *q, 20.0) - plain_log_density(plain["tokens"], *p, 20.0)) / n_tokens[0]
    assert ex["token_contributions"][0, :n_tokens[0]].tolist() == pytest.approx(terms.tolist(), abs=1e-5)

    out = tmp_path / "map.png"
    picture = render_patch_map(images[0], ex["patch_contributions"][0], path=out)
    with Image.open(out) as png:
        assert png.format == "PNG" and png.size == picture.size == (224, 224)  # centre square, enlarged
    wide = render_patch_map(np.zeros((30, 60, 3), dtype=np.uint8), np.arange(16.0), crop="full", min_size=30)
    assert wide.size == (60, 30)
    with pytest.raises(ValueError, match="square grid"):
        render_patch_map(images[0], np.arange(15.0))


# ---------------------------------------------------------------------------------------------------------
# Soft-MSD


def test_soft_msd_equals_the_formulas(tiny_clip, pictures, plain_rows):
    images, captions = corpus(pictures)
    result = capeval_plugins.load("soft_msd", model=tiny_clip)(images, captions)
    assert result.scores.tolist() == pytest.approx(plain_soft_msd(plain_rows, IMAGE_OF), abs=1e-5)
    assert result.extras["group_size"].tolist() == [3, 3, 3, 1, 2, 2]
    assert result.extras["msd"].tolist() == pytest.approx([r["msd"] for r in plain_rows], abs=1e-5)


def test_soft_msd_with_one_candidate_is_msd(tiny_clip, pictures):
    images, captions = corpus(pictures)
    msd = capeval_plugins.load("msd_score", model=tiny_clip)(images, captions)
    alone = capeval_plugins.load("soft_msd", model=tiny_clip)(images, captions, group_ids=list(range(6)))
    assert alone.scores.tolist() == pytest.approx(msd.scores.tolist(), abs=1e-12)
    assert (alone.extras["uncertainty"] == 1).all()
    one_each = capeval_plugins.load("soft_msd", model=tiny_clip)(pictures, CANDIDATES[:3])
    assert one_each.scores.tolist() == pytest.approx(
        capeval_plugins.load("msd_score", model=tiny_clip)(pictures, CANDIDATES[:3]).scores.tolist(), abs=1e-12)


def test_soft_msd_gate_is_invariant_to_candidate_order():
    rng = np.random.default_rng(0)
    cosine = torch.tensor(rng.uniform(-0.2, 0.4, 9))
    groups = torch.tensor([4, 4, 9, 4, 9, 1, -1, -1, 9])
    u, size = soft_msd_gate(cosine, groups)
    assert size.tolist() == [3, 3, 3, 3, 3, 1, 1, 1, 3] and u[5] == u[6] == u[7] == 1
    perm = torch.tensor(rng.permutation(9))
    u_perm, _ = soft_msd_gate(cosine[perm], groups[perm])
    assert u_perm.tolist() == pytest.approx(u[perm].tolist(), abs=1e-15)
    # two candidates: u = 1 - 2 |sigmoid(delta / tau) - 1/2|
    u2, _ = soft_msd_gate(torch.tensor([0.30, 0.25], dtype=torch.float64), torch.tensor([0, 0]))
    p = 1 / (1 + np.exp(-0.05 / 0.2))
    assert u2.tolist() == pytest.approx([1 - 2 * abs(p - 0.5)] * 2, abs=1e-12)


def test_image_group_ids_are_stable_in_every_form(picture_files, pictures):
    sources = [image_source(p, i) for i, p in enumerate(picture_files + picture_files[:1])]
    first = image_group_ids(sources)
    assert first[0] == first[3] and len(set(first)) == 3 and all(0 <= g < 2 ** 63 for g in first)
    assert image_group_ids(sources) == first  # another call (or process) gives the same ids
    data = Path(picture_files[1]).read_bytes()
    assert image_group_ids([image_source(data, 0)]) == image_group_ids([image_source({"bytes": data}, 0)])
    # an image in memory is known by its pixels: the same group in any call, copy or form
    copy = pictures[0].copy()
    memory = [image_source(pictures[0], 0), image_source(copy, 1), image_source(np.asarray(pictures[0]), 2),
              image_source(pictures[1], 3)]
    ids = image_group_ids(memory)
    assert ids[0] == ids[1] == ids[2] and ids[3] != ids[0]
    assert image_group_ids([image_source(pictures[0], 7)]) == ids[:1]
    clip = [image_source([pictures[0], pictures[1]], 0, video_ok=True), image_source([copy, pictures[1]], 1,
                                                                                      video_ok=True)]
    assert len(set(image_group_ids(clip))) == 1 and image_group_ids(clip)[0] not in ids


def test_group_ids_given_as_names_are_the_same_group_in_every_call():
    from capeval_plugins.inputs import NAMED_GROUPS, check_group_ids, is_name_group

    first = check_group_ids(["a.jpg", "b.jpg", "a.jpg", ("x", 1), -5, 7, None], 7)
    assert first[0] == first[2] != first[1] and first[4:] == [-1, 7, None]  # no group; an index; by image
    assert all(is_name_group(g) for g in first[:4]) and not is_name_group(7)
    again = check_group_ids(["b.jpg", ("x", 1), "7"], 3)
    assert again[:2] == [first[1], first[3]] and again[2] != 7  # "7" is a name, not the integer 7
    assert check_group_ids(np.array([3, 0, 3]), 3) == [3, 0, 3]
    big = check_group_ids([NAMED_GROUPS], 1)  # an integer this large is a name too: no id is ambiguous
    assert is_name_group(big[0]) and big != [NAMED_GROUPS] and big == check_group_ids([NAMED_GROUPS], 1)
    for bad in ([1.5], [object()], [("a", 2.0)]):
        with pytest.raises(InputError, match="group id at position 0 must be an integer, a name"):
            check_group_ids(bad, 1)
    for bad in (3, torch.tensor(1), {0: 1}, "ab", np.zeros((1, 1))):  # one id, or a dict's keys, are no ids
        with pytest.raises(InputError, match="one id per caption"):
            check_group_ids(bad, 1)


def test_evaluate_reads_group_ids_as_the_core_does(tiny_clip, picture_files):
    """Names failed in Arrow with a traceback, and floats were cast to integers (0.7 as 0) and scored."""
    import evaluate

    from capeval_plugins.inputs import InputError

    files = [picture_files[i] for i in IMAGE_OF]
    names = [f"{g}.jpg" for g in IMAGE_OF]
    direct = capeval_plugins.load("soft_msd", model=tiny_clip)(files, CANDIDATES, group_ids=names)
    module = evaluate.load("soft_msd", model=tiny_clip)
    got = module.compute(predictions=CANDIDATES, images=files, group_ids=names)
    assert got["scores"] == pytest.approx(direct.scores.tolist(), abs=1e-6)
    with pytest.raises(InputError, match="must be an integer, a name"):
        module.compute(predictions=CANDIDATES, images=files, group_ids=[0.2, 0.7, 1.2, 1.7, 2.2, 2.7])


def test_coco_cf_draws_refuse_made_up_ids_in_a_stream(tiny_clip, picture_files):
    """Draws seeded by the pair's index: ids the torchmetrics adapter makes up continue across reset(), so the
    same epoch drew anew each time; with ids (or integer group ids) every epoch equals a direct call."""
    from capeval_plugins.inputs import InputError
    from capeval_plugins.torchmetrics import MSDScore

    files = [picture_files[i] for i in IMAGE_OF]
    direct = capeval_plugins.load("msd_score", model=tiny_clip, preset="coco-cf")(files, CANDIDATES)
    metric = MSDScore(model=tiny_clip, preset="coco-cf")
    for group_ids in (None, ["a"] * 6, [-1] * 6):
        with pytest.raises(InputError, match="draws='coco-cf' seeds each fit by its pair's index"):
            metric.update(files, CANDIDATES, group_ids=group_ids)
    for _ in range(2):  # two epochs
        metric.update(files, CANDIDATES, ids=list(range(6)))
        assert metric.compute_all().scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-6)
        metric.reset()
    pairs = [0, 0, 1, 1, 2, 2]
    paired = capeval_plugins.load("msd_score", model=tiny_clip, preset="coco-cf")(files, CANDIDATES, group_ids=pairs)
    for _ in range(2):
        metric.update(files, CANDIDATES, group_ids=pairs)
        assert metric.compute_all().scores.tolist() == pytest.approx(paired.scores.tolist(), abs=1e-6)
        metric.reset()
    plain = MSDScore(model=tiny_clip)  # content-seeded draws: made-up ids are fine
    plain.update(files, CANDIDATES)
    assert len(plain.compute_all().scores) == 6


def test_samples_without_a_group_id_are_grouped_by_image_beside_those_with_one(tiny_clip, picture_files):
    """An evaluate ``add_batch`` without group ids beside one with them: the first batch's samples group by
    their images, as they would alone, not all together (the adapter's "no group" filler was once one group)."""
    import evaluate

    files = [picture_files[i] for i in IMAGE_OF]
    alone = capeval_plugins.load("soft_msd", model=tiny_clip)(files[3:], CANDIDATES[3:])
    module = evaluate.load("capeval/soft_msd", model=tiny_clip)
    module.add_batch(predictions=CANDIDATES[:3], images=files[:3], group_ids=[0, 0, 0])
    module.add_batch(predictions=CANDIDATES[3:], images=files[3:])
    mixed = module.compute()
    assert mixed["group_size"] == [3, 3, 3, 1, 2, 2]
    assert mixed["scores"][3:] == pytest.approx(alone.scores.tolist(), abs=1e-6)


def test_torchmetrics_groups_across_batches(tiny_clip, picture_files, pictures):
    from capeval_plugins.torchmetrics import SoftMSD

    files = [picture_files[i] for i in IMAGE_OF]
    direct = capeval_plugins.load("soft_msd", model=tiny_clip)(files, CANDIDATES)
    metric = SoftMSD(model=tiny_clip, batch_size=2)
    for part in ([0, 3], [1, 4], [2, 5]):  # every batch splits an image's candidates
        metric.update([files[i] for i in part], [CANDIDATES[i] for i in part], ids=part)
    result = metric.compute_all()
    assert result.extras["group_size"].tolist() == [3, 3, 3, 1, 2, 2]
    assert result.scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-6)
    # in-memory images group across batches too: with explicit group ids, and by their pixels without them
    # (each batch given its own copies, as a data loader makes them)
    images = [pictures[i] for i in IMAGE_OF]
    names = [f"COCO_{g:012d}.jpg" for g in IMAGE_OF]  # names: numbered per call, they grouped image 0 with 1
    for group_ids in (IMAGE_OF, None, names):
        metric = SoftMSD(model=tiny_clip)
        for part in ([0, 3], [1, 2, 4, 5]):
            metric.update([images[i].copy() for i in part], [CANDIDATES[i] for i in part], ids=part,
                          group_ids=None if group_ids is None else [group_ids[i] for i in part])
        result = metric.compute_all()
        assert result.extras["group_size"].tolist() == [3, 3, 3, 1, 2, 2]
        assert result.scores.tolist() == pytest.approx(direct.scores.tolist(), abs=1e-6)


def test_pycocoevalcap_scorer_equals_a_direct_call(tiny_clip, picture_files):
    from capeval_plugins.pycocoevalcap import ImageResolver, SoftMsd

    resolver = ImageResolver("/", mapping=dict(enumerate(picture_files)))
    res = {i: [c] for i, c in enumerate(CANDIDATES[:3])}
    score, per_item = SoftMsd(resolver, model=tiny_clip).compute_score({i: ["unused"] for i in res}, res)
    direct = capeval_plugins.load("soft_msd", model=tiny_clip)(picture_files, CANDIDATES[:3])
    assert list(per_item) == pytest.approx(direct.scores.tolist(), abs=1e-6)
    assert score == pytest.approx(direct.score, abs=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Soft-MSD across two DDP ranks

SHARDS = {
    "interleaved": {0: [0, 2, 4], 1: [1, 3, 5]},  # image 0's candidates on both ranks
    "uneven_with_repeat": {0: [0, 1, 5, 3], 1: [2, 4, 0]},
}



def _ddp_worker(rank: int, world: int, port: int, model: str, files: list[str], out: str) -> None:
    import torch.distributed as dist

    from capeval_plugins.torchmetrics import SoftMSD

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for name, shards in SHARDS.items():
        metric = SoftMSD(model=model, batch_size=2)  # built inside the worker
        mine = shards[rank]
        for start in range(0, len(mine), 2):
            part = mine[start:start + 2]
            metric.update([files[IMAGE_OF[i]] for i in part], [CANDIDATES[i] for i in part], ids=part)
        result = metric.compute_all()
        results[name] = {"scores": result.scores.tolist(), "indices": result.indices.tolist(),
                         "group_size": result.extras["group_size"].tolist()}
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_equal_one_call(tiny_clip, picture_files, tmp_path):
    files = [picture_files[i] for i in IMAGE_OF]
    single = capeval_plugins.load("soft_msd", model=tiny_clip)(files, CANDIDATES)
    spawn_ranks(_ddp_worker, (2, free_port(), tiny_clip, picture_files, str(tmp_path)))
    for rank in range(2):
        for name, got in torch.load(tmp_path / f"rank{rank}.pt").items():
            assert got["indices"] == list(range(6)), name
            assert got["group_size"] == [3, 3, 3, 1, 2, 2], name
            assert got["scores"] == pytest.approx(single.scores.tolist(), abs=1e-6), name


def test_sugarcrepe_bench_runs_msd_with_the_official_scripts_preset():
    from capeval_plugins.bench.benchmarks import metric_options
    from capeval_plugins.metrics.msd import PRESETS

    added = metric_options("sugarcrepe", ["msd_score", "soft_msd", "cider"], [])
    assert added == ["msd_score.preset=sugarcrepe", "soft_msd.preset=sugarcrepe"]
    assert PRESETS["sugarcrepe"] == {"k_image": 4, "k_text": 2}
    assert metric_options("sugarcrepe", ["msd_score"], ["msd_score.preset=paper"]) == ["msd_score.preset=paper"]
    assert metric_options("flickr8k-expert", ["msd_score"], []) == []


def test_coco_cf_bench_runs_msd_with_its_official_script():
    """coco_eval_cf.py: 3 image and 2 text components (not SugarCrepe's 4) and its own EM."""
    from capeval_plugins.bench.benchmarks import metric_options
    from capeval_plugins.metrics.msd import PRESETS

    added = metric_options("coco-cf", ["msd_score", "soft_msd"], [])
    assert added == ["msd_score.preset=coco-cf", "soft_msd.preset=coco-cf"]
    assert PRESETS["coco-cf"] == {"k_image": 3, "k_text": 2, "em_update": "coco-cf", "draws": "coco-cf", "seed": 42}


def test_coco_cf_preset_equals_the_official_loop(tiny_clip, pictures):
    """preset="coco-cf" gives coco_eval_cf.py's per-sample values with its seed (42): its starting draws
    (torch.randperm of a generator seeded from the pair's index), its EM and its Soft-MSD over the pair; an image
    in two pairs is fitted once per pair, as there; a pair's values do not depend on the batch. The remaining
    differences are the script's float32 rounding and its +1e-6 in every norm, each about 1e-6 relative (2e-5 on
    the KLs near 14 of this tiny CLIP). The content-hash draws (draws="content") start elsewhere (1.6 apart)."""
    model, processor = plain_model(tiny_clip)
    pairs = [(0, CANDIDATES[0], CANDIDATES[2]), (1, CANDIDATES[3], CANDIDATES[1]), (0, CANDIDATES[5], CANDIDATES[4]),
             (2, CANDIDATES[4], CANDIDATES[0])]
    images = [pictures[k] for k, _, _ in pairs for _ in range(2)]
    captions = [c for _, pos, neg in pairs for c in (pos, neg)]
    groups = [i for i in range(len(pairs)) for _ in range(2)]
    official = [official_pair(model, processor, pictures[k], [pos, neg], i, 42) for i, (k, pos, neg) in enumerate(pairs)]
    expected = {key: np.array([v for row in official for v in row[key]]) for key in ("bi_kl", "cosine", "soft")}
    assert np.ptp(expected["bi_kl"]) > 0.01  # the KLs differ between captions: a real comparison
    metric = capeval_plugins.load("soft_msd", model=tiny_clip, preset="coco-cf")
    assert (metric.config.draws, metric.config.seed) == ("coco-cf", 42)
    for batch_size in (64, 1, 3):
        metric.config.batch_size = batch_size
        ours = metric(images, captions, group_ids=groups)
        np.testing.assert_allclose(ours.extras["bi_kl"].numpy(), expected["bi_kl"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ours.scores.numpy(), expected["soft"], rtol=0, atol=1e-5)
    hashed = capeval_plugins.load("soft_msd", model=tiny_clip, preset="coco-cf", draws="content")(
        images, captions, group_ids=groups)
    assert np.abs(hashed.extras["bi_kl"].numpy() - expected["bi_kl"]).max() > 1e-3


def test_soft_msd_coco_cf_draws_are_seeded_by_the_sample_when_no_group_is_given(tiny_clip, pictures):
    """The COCO-CF seeds are seed + 7 i with i the given group id, else the sample's id. Soft-MSD's groups made from
    the images were taken as i: hashes salted per call for images in memory, so one corpus scored three times gave
    three different results. With no groups given its draws are MSD-Score's (the same i), run after run."""
    import capeval_plugins

    images, captions = corpus(pictures)
    soft = [capeval_plugins.load("soft_msd", model=tiny_clip, draws="coco-cf")(images, captions) for _ in range(3)]
    assert all(torch.equal(soft[0].scores, other.scores) for other in soft[1:])
    plain = capeval_plugins.load("msd_score", model=tiny_clip, draws="coco-cf")(images, captions)
    for key in ("kl_image_text", "kl_text_image"):
        torch.testing.assert_close(soft[0].extras[key], plain.extras[key], rtol=0, atol=1e-9)


def test_an_images_pixels_are_hashed_once_for_all_its_candidates(pictures, monkeypatch):
    from capeval_plugins import image_sources
    from capeval_plugins.inputs import image_group_ids, image_source

    hashed = []
    digest = image_sources.pixel_digest
    monkeypatch.setattr(image_sources, "pixel_digest", lambda image: hashed.append(1) or digest(image))
    sources = [image_source(pictures[k % 2], k) for k in range(10)]  # two images, five candidates each
    ids = image_group_ids(sources)
    assert len(set(ids)) == 2 and len(hashed) == 2
