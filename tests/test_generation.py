"""Text-to-image generation: the on-disk cache (stand-in generator), folders of pre-generated images, a tiny
random Stable Diffusion 3 pipeline end to end, and DINO cycle similarity against plain computations."""
from __future__ import annotations

import functools
import json
import sys

import numpy as np
import pytest
import torch
from conftest import random_image
from PIL import Image

import capeval_plugins
from capeval_plugins.models import generation
from capeval_plugins.models.generation import CachedGenerator, FolderGenerator, MissingImageError, TextToImage
from capeval_plugins.files import CacheFolder
from capeval_plugins.inputs import InputError


class StandIn(TextToImage):
    """Deterministic images from (caption, seed); records every call."""

    def __init__(self, steps: int = 10):
        self.steps = steps
        self.calls: list[list[tuple[str, int]]] = []

    def identity(self):
        return {"generator": "stand-in", "steps": self.steps}

    def generate(self, captions, seeds):
        self.calls.append(list(zip(captions, seeds)))
        return [random_image(generation.caption_seed(c, s) % 10_000, size=(24, 24)) for c, s in zip(captions, seeds)]


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def read(path) -> Image.Image:
    with Image.open(path) as image:
        image.load()
        return image


def test_cache_returns_the_same_image_for_the_same_key_without_regenerating(tmp_path):
    inner = StandIn()
    first = CachedGenerator(inner, CacheFolder(tmp_path)).generate(["a dog", "a cat", "a dog"], [0, 0, 0])
    assert inner.calls == [[("a dog", 0), ("a cat", 0)]]  # a repeated key is drawn once
    assert np.array_equal(pixels(first[0]), pixels(first[2]))
    later_run = CachedGenerator(inner, CacheFolder(tmp_path))  # a new run, the same folder
    again = later_run.generate(["a cat", "a dog"], [0, 0])
    assert len(inner.calls) == 1 and (later_run.generated, later_run.reused) == (0, 2)
    assert np.array_equal(pixels(again[0]), pixels(first[1])) and np.array_equal(pixels(again[1]), pixels(first[0]))


def test_every_part_of_the_key_separates_cache_entries(tmp_path):
    inner = StandIn()
    cached = CachedGenerator(inner, CacheFolder(tmp_path))
    cached.generate(["a dog"], [0])
    cached.generate(["a dog"], [1])  # another seed
    cached.generate(["a dog."], [0])  # another caption
    CachedGenerator(StandIn(steps=20), CacheFolder(tmp_path)).generate(["a dog"], [0])  # another generator setting
    assert len(inner.calls) == 3 and cached.generated == 3
    assert len(list(tmp_path.rglob("*.png"))) == 4
    stored = read(next(tmp_path.rglob("*.png")))
    assert json.loads(stored.text["capeval-generation"])["identity"]["generator"] == "stand-in"


def test_a_truncated_cache_file_is_generated_again(tmp_path):
    inner = StandIn()
    cached = CachedGenerator(inner, CacheFolder(tmp_path))
    image = cached.generate(["a dog"], [0])[0]
    cached.path("a dog", 0).write_bytes(b"\x89PNG broken")
    again = cached.generate(["a dog"], [0])[0]
    assert len(inner.calls) == 2 and np.array_equal(pixels(image), pixels(again))


def write_folder(root, captions, index_name="index.jsonl"):
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, caption in enumerate(captions):
        random_image(500 + i, size=(20 + i, 20)).save(root / f"img{i}.png")
        rows.append({"caption": caption, "image": f"img{i}.png"})
    if index_name.endswith(".jsonl"):
        (root / index_name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif index_name.endswith(".csv"):
        (root / index_name).write_text("caption,image\n" + "".join(f'"{r["caption"]}",{r["image"]}\n' for r in rows))
    else:
        (root / index_name).write_text(json.dumps({r["caption"]: r["image"] for r in rows}))
    return root


@pytest.mark.parametrize("index_name", ["index.jsonl", "index.csv", "index.json"])
def test_folder_of_pregenerated_images(tmp_path, index_name):
    folder = FolderGenerator(write_folder(tmp_path / "gen", ["a dog, running", "a cat"], index_name))
    got = folder.generate(["a cat", "a dog, running", "a cat"], [0, 0, 5])
    assert np.array_equal(pixels(got[0]), pixels(read(tmp_path / "gen" / "img1.png")))
    assert np.array_equal(pixels(got[1]), pixels(read(tmp_path / "gen" / "img0.png")))
    with pytest.raises(MissingImageError, match="no generated image for 1 caption.*'a horse'"):
        folder.generate(["a cat", "a horse"], [0, 0])
    with pytest.raises(FileNotFoundError, match="no index"):
        FolderGenerator(tmp_path)


def test_missing_diffusers_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # makes `import diffusers` fail
    generator = generation.StableDiffusion3(str(tmp_path / "nowhere"), steps=1, height=32, width=32)
    with pytest.raises(ImportError, match=r"optional extra: pip install -e '\.\[diffusion\]'"):
        generator.generate(["a dog"], [0])


def test_generation_settings_are_checked():
    with pytest.raises(ValueError, match="divisible by 16"):
        generation.StableDiffusion3(height=100, width=64)
    with pytest.raises(ValueError, match="at least 1"):
        generation.StableDiffusion3(steps=0)


# A tiny random Stable Diffusion 3 pipeline built from diffusers and transformers classes, saved and loaded
# back through the same from_pretrained path as the real checkpoint.


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory) -> str:
    pytest.importorskip("diffusers")
    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3"))


def build_tiny_sd3(path) -> str:
    """The tiny pipeline saved into ``path`` (tests/test_whole_models.py damages copies of it)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel, T5Tokenizer

    from capeval_plugins.testing.clip import clip_tokenizer
    from capeval_plugins.testing.corpus import caption_corpus, train_unigram

    torch.manual_seed(0)
    clip_tok = clip_tokenizer()

    def clip_text():
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=77, projection_dim=32, hidden_act="gelu",
            eos_token_id=clip_tok.eos_token_id, bos_token_id=clip_tok.bos_token_id, pad_token_id=clip_tok.pad_token_id))

    t5_tok = T5Tokenizer(vocab=train_unigram(caption_corpus(), 400, ["<pad>", "</s>", "<unk>"]), extra_ids=0,
                         model_max_length=256)
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                 pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    # SD3 feeds the two CLIP projections (32 + 32) as pooled input and pads the CLIP token states to T5's width.
    transformer = SD3Transformer2DModel(sample_size=32, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
                                        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
                                        pooled_projection_dim=64, out_channels=4)
    vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                        latent_channels=4, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                                    text_encoder=clip_text(), tokenizer=clip_tok, text_encoder_2=clip_text(),
                                    tokenizer_2=clip_tok, text_encoder_3=t5, tokenizer_3=t5_tok)
    pipe.save_pretrained(path, safe_serialization=True)
    return str(path)


def test_tiny_sd3_is_seeded_and_independent_of_batching(tiny_sd3, tmp_path):
    sd3 = generation.StableDiffusion3(tiny_sd3, steps=2, height=32, width=32, batch_size=3, device="cpu")
    batch = sd3.generate(["a dog runs", "a cat sits", "a dog runs", "a man walks"], [0, 0, 1, 0])
    alone = sd3.generate(["a dog runs"], [0])[0]
    assert batch[0].size == (32, 32)
    # Same caption and seed in another batch: the same image. Not bit for bit: a batch of 3 and one of 1 run
    # float32 matmuls of other shapes, which a BLAS may round differently, and a rounding flips a pixel by at
    # most a level or two after the uint8 quantisation; another seed moves pixels by tens of levels.
    assert pixel_gap(batch[0], alone) <= 2
    assert pixel_gap(batch[0], batch[2]) > 20  # another seed: another image
    cached = CachedGenerator(sd3, CacheFolder(tmp_path))
    first = cached.generate(["a dog runs", "a cat sits"], [0, 0])
    again = CachedGenerator(sd3, CacheFolder(tmp_path)).generate(["a dog runs"], [0])
    assert pixel_gap(first[0], alone) <= 2
    assert np.array_equal(pixels(again[0]), pixels(first[0]))  # read back from the cache: exactly the file


def pixel_gap(a, b) -> int:
    return int(np.abs(pixels(a).astype(np.int16) - pixels(b).astype(np.int16)).max())


@functools.lru_cache(maxsize=None)
def plain_vit(path: str):
    from transformers import ViTImageProcessor, ViTModel

    return ViTModel.from_pretrained(path, add_pooling_layer=False).eval(), ViTImageProcessor.from_pretrained(path)


def torchvision_transform(image: Image.Image, size: int) -> torch.Tensor:
    """Redemption Score's dino_similarity.py transform written out from torchvision's rules: Resize(size) on a PIL
    image (shorter side to size, longer to int(size * long / short), PIL bilinear, no resize when the shorter
    side is already size), CenterCrop(size) (PIL crop at round((dim - size) / 2)), ToTensor, Normalize(0.5, 0.5)."""
    image = image.convert("RGB")
    width, height = image.size
    if width <= height:
        new = (size, int(size * height / width))
    else:
        new = (int(size * width / height), size)
    if new != image.size:
        image = image.resize(new, Image.BILINEAR)
    left, top = int(round((new[0] - size) / 2.0)), int(round((new[1] - size) / 2.0))
    crop = image.crop((left, top, left + size, top + size))
    chw = torch.from_numpy(np.array(crop, dtype=np.uint8)).permute(2, 0, 1).float().div(255)
    return (chw - torch.tensor(0.5).view(1, 1, 1)) / torch.tensor(0.5).view(1, 1, 1)


@torch.no_grad()
def plain_cls(path: str, images, preprocessing: str = "official") -> np.ndarray:
    """Unit [CLS] vectors of a DINO ViT straight from transformers, its input prepared as the official script
    does, or by the checkpoint's processor (the paper's 224 x 224 + ImageNet statistics)."""
    model, processor = plain_vit(path)
    if preprocessing == "official":
        pixel_values = torch.stack([torchvision_transform(im, model.config.image_size) for im in images])
    else:
        pixel_values = processor(images=images, return_tensors="pt")["pixel_values"]
    cls = model(pixel_values=pixel_values).last_hidden_state[:, 0].double().numpy()
    return cls / np.linalg.norm(cls, axis=1, keepdims=True)


@pytest.mark.parametrize("size", [(300, 225), (225, 300), (224, 500), (500, 375), (100, 80), (1000, 227),
                                  (229, 229), (224, 224)])
def test_official_dino_pixels_equal_the_torchvision_transform(size):
    from capeval_plugins.models.encoders.dino import official_pixels

    images = [random_image(3, size=size), random_image(4, size=size).convert("L"),
              random_image(5, size=size).convert("RGBA")]
    got = official_pixels(images, 224)
    want = torch.stack([torchvision_transform(im, 224) for im in images])
    assert got.shape == (3, 3, 224, 224) and got.dtype == torch.float32
    assert torch.equal(got, want)


CANDIDATES = ["a dog runs on the grass", "a cat sits", "a dog runs on the grass", "two children play"]
REFERENCES = [["a dog running", "a brown dog"], ["a cat on a sofa"], ["a dog running"], ["kids play", "a park"]]


@pytest.fixture(scope="module")
def tiny_dino(tiny_root) -> str:
    from capeval_plugins.testing import tiny_checkpoint

    return str(tiny_checkpoint("dino", root=tiny_root))


def test_dino_cycle_with_tiny_sd3_equals_a_plain_loop(tiny_sd3, tiny_dino, tmp_path):
    """End to end: images drawn by the diffusers pipeline called directly, DINO [CLS] from transformers."""
    from diffusers import StableDiffusion3Pipeline

    images = [random_image(i, size=(40, 36)) for i in (1, 2, 1, 3)]
    metric = capeval_plugins.load("dino_cycle", model=tiny_dino, generator=tiny_sd3, steps=2, image_size=32,
                                  cache_dir=str(tmp_path), device="cpu", batch_size=3)
    result = metric(images, CANDIDATES, REFERENCES)
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)

    @functools.lru_cache(maxsize=None)
    def draw(caption):
        return pipe(prompt=[caption], num_inference_steps=2, height=32, width=32, guidance_scale=7.0,
                    generator=[torch.Generator().manual_seed(0)]).images[0]

    for i, (image, cand, refs) in enumerate(zip(images, CANDIDATES, REFERENCES)):
        e_img, e_cand, e_ref = plain_cls(tiny_dino, [image, draw(cand), draw(refs[0])])
        s1, s2 = float(e_img @ e_cand), float(e_cand @ e_ref)
        assert result.extras["s1"][i].item() == pytest.approx(s1, abs=1e-5)
        assert result.extras["s2"][i].item() == pytest.approx(s2, abs=1e-5)
        assert result.scores[i].item() == pytest.approx((s1 + s2) / 2, abs=1e-5)
    assert len(list(tmp_path.rglob("*.png"))) == 6  # each distinct caption drawn once, then cached


def test_dino_cycle_from_a_folder_reference_choices_and_missing_images(tiny_dino, tmp_path):
    captions = list(dict.fromkeys(CANDIDATES + [r for refs in REFERENCES for r in refs]))
    folder = write_folder(tmp_path / "gen", captions)
    generated = {c: read(folder / f"img{i}.png").convert("RGB") for i, c in enumerate(captions)}
    images = [random_image(i, size=(40, 36)) for i in (1, 2, 1, 3)]
    for choice, reduce, how in (("first", lambda v: v[0], "official"), ("mean", np.mean, "official"),
                                ("max", np.max, "official"), ("first", lambda v: v[0], "paper")):
        result = capeval_plugins.load("dino_cycle", model=tiny_dino, generated_images=str(folder),
                                      reference_choice=choice, batch_size=2, preprocessing=how)(
            images, CANDIDATES, REFERENCES)
        for i, (image, cand, refs) in enumerate(zip(images, CANDIDATES, REFERENCES)):
            feats = plain_cls(tiny_dino, [image, generated[cand]] + [generated[r] for r in refs], how)
            s1 = float(feats[0] @ feats[1])
            s2 = float(reduce(np.array([feats[1] @ f for f in feats[2:]])))
            assert result.scores[i].item() == pytest.approx((s1 + s2) / 2, abs=1e-5), (choice, how, i)
    with pytest.raises(InputError, match="sample 1: .*no generated image for 1 caption.*'a cat sits'"):
        broken = write_folder(tmp_path / "partial", [c for c in captions if c != "a cat sits"])
        capeval_plugins.load("dino_cycle", model=tiny_dino, generated_images=str(broken))(images, CANDIDATES, REFERENCES)


def test_seed_per_caption_gives_each_caption_its_own_noise(tmp_path, tiny_dino):
    seeds = {generation.caption_seed(c, 0) for c in ("a dog", "a cat", "a man")}
    assert len(seeds) == 3 and generation.caption_seed("a dog", 0) == generation.caption_seed("a dog", 0)
    metric = capeval_plugins.load("dino_cycle", model=tiny_dino, seed=3, seed_per_caption=True)
    assert metric.seed("a dog") == generation.caption_seed("a dog", 3)
    assert capeval_plugins.load("dino_cycle", model=tiny_dino, seed=3).seed("a dog") == 3


def test_the_image_cache_keys_the_pipelines_weights_and_dtype(tiny_sd3, tmp_path):
    """A pipeline folder rebuilt with other weights, or run at another dtype, generates other images: the cache
    keyed only the path and settings, and served the old pipeline's images."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "sd3"
    shutil.copytree(tiny_sd3, folder)
    sd3 = generation.StableDiffusion3(str(folder), steps=2, height=32, width=32, device="cpu")
    before = CachedGenerator(sd3, CacheFolder(tmp_path / "cache")).identity()
    bf16 = generation.StableDiffusion3(str(folder), steps=2, height=32, width=32, device="cpu", dtype="bfloat16")
    assert CachedGenerator(bf16, CacheFolder(tmp_path / "cache")).identity() != before
    weights = next((folder / "transformer").glob("*.safetensors"))
    tensors = load_file(weights)
    save_file({k: v + 0.5 if v.is_floating_point() else v for k, v in tensors.items()}, weights)
    assert sd3.identity() != before  # the same generator object sees the new files
    assert generation.StableDiffusion3(str(folder), steps=2, height=32, width=32, device="cpu").identity() != before
