"""DINO similarity of cycle-generated images (the perceptual component of Redemption Score, Dahal et al.).

A text-to-image model (Stable Diffusion 3) draws one image from the candidate caption and one from the
reference; DINO ViT-B/8 [CLS] embeddings (L2-normalised; images prepared as the official dino_similarity.py
does by default) then give
    s1 = <e(I), e(I_cand)>,  s2 = <e(I_cand), e(I_ref)>,  DINO_sim = (s1 + s2) / 2.
Generated images are cached on disk under (model, caption, seed, steps, size, guidance) and reused by later
runs; a folder of images generated earlier can replace the generator.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from capeval_plugins.contract import Batch, MetricInfo, ModelConfig, PointwiseMetric, Requirement, bounded
from capeval_plugins.core.bounds import MAX_SEED
from capeval_plugins.resources import loading
from capeval_plugins.core.messages import install_extra
from capeval_plugins.models.encoders import EncoderSpec
from capeval_plugins.models.encoders.dino import PREPROCESSINGS, DinoEncoder
from capeval_plugins.models.generation import (
                                               SD3_MODEL,
                                               CachedGenerator,
                                               FolderGenerator,
                                               MissingImageError,
                                               StableDiffusion3,
                                               TextToImage,
                                               caption_seed,
                                               default_cache_dir,
                                               )

CITATION = """@article{dahal2025redemption,
  title   = {Redemption Score: An Evaluation Framework to Rank Image Captions While Redeeming Image Semantics
             and Language Pragmatics},
  author  = {Dahal, Ashim and Ghimire, Ankit and Murad, Saydul Akbar and Rahimi, Nick},
  journal = {arXiv preprint arXiv:2505.16180},
  year    = {2025}
}"""

REFERENCE_CHOICES = ("first", "mean", "max")


@dataclass
class DinoCycleConfig(ModelConfig):
    model: str = "facebook/dino-vitb8"
    # Text-to-image model (a diffusers Stable Diffusion 3 pipeline: hub id or local path).
    generator: str = SD3_MODEL
    # A folder of images generated earlier (with an index mapping captions to files): replaces the generator.
    generated_images: str | None = None
    cache: bool = True
    cache_dir: str | None = None
    steps: int = bounded(40, ge=1, le=1000)
    # The paper does not give the generation size or guidance; SD3's own defaults.
    image_size: int = bounded(1024, ge=1, le=4096)
    guidance_scale: float = bounded(7.0, ge=0)
    seed: int = bounded(0, ge=0, le=MAX_SEED)
    # False: every image starts from the same seeded noise; True: the seed is derived from the caption too.
    seed_per_caption: bool = False
    generator_batch_size: int = bounded(4, ge=1, le=1024)
    # float16 on GPUs, float32 on CPU unless set.
    generator_dtype: str | None = None
    generator_revision: str | None = None
    # The paper generates one reference image per sample; with several references: the first, or s2
    # averaged / maximised over all of them.
    reference_choice: str = "first"
    # DINO's input: "official" = Redemption Score's dino_similarity.py (shorter side to 224, centre crop,
    # mean / std 0.5); "paper" = the paper's text (224 x 224, ImageNet statistics: the checkpoint's processor).
    preprocessing: str = "official"
    input_paths: ClassVar[tuple[str, ...]] = ("model", "generator", "generated_images")

    def __post_init__(self) -> None:
        if self.preprocessing not in PREPROCESSINGS:
            raise ValueError(f"preprocessing must be one of {PREPROCESSINGS}, got {self.preprocessing!r}")
        if self.reference_choice not in REFERENCE_CHOICES:
            raise ValueError(f"reference_choice must be one of {REFERENCE_CHOICES}, got {self.reference_choice!r}")
        unused = [name for name in GENERATION if getattr(self, name) != _DEFAULTS[name]] if self.generated_images else []
        if unused:  # a folder of images made earlier replaces the generator: these would change nothing
            raise ValueError(f"{', '.join(unused)}: options of the generator, which generated_images replaces (the "
                             f"images are read from {self.generated_images}); drop them, or generate instead")
        if self.cache_dir is not None and not self.cache:
            raise ValueError("cache_dir is where generated images are cached, and cache=False caches none")


# The options of the generator, which a folder of generated images replaces.
GENERATION = ("generator", "cache", "cache_dir", "steps", "image_size", "guidance_scale", "seed", "seed_per_caption",
              "generator_batch_size", "generator_dtype", "generator_revision")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DinoCycleConfig) if f.name in GENERATION}


def build_generator(cfg: DinoCycleConfig) -> TextToImage:
    """The configured generator: a folder of images, or SD3 (cached on disk unless ``cache`` is off)."""
    if cfg.generated_images:
        return FolderGenerator(cfg.generated_images)
    sd3 = StableDiffusion3(
        cfg.generator, steps=cfg.steps, height=cfg.image_size, width=cfg.image_size,
        guidance_scale=cfg.guidance_scale, batch_size=cfg.generator_batch_size, device=cfg.device,
        dtype=cfg.generator_dtype, revision=cfg.generator_revision, local_files_only=cfg.local_files_only,
    )
    if not cfg.cache:
        return sd3
    from capeval_plugins.files import CacheFolder

    return CachedGenerator(sd3, CacheFolder(cfg.cache_dir or default_cache_dir()))


def segment_reduce(values: Tensor, segments: Tensor, n: int, how: str) -> Tensor:
    """Per-segment mean or max (segments 0..n-1, each non-empty)."""
    if how == "max":
        out = torch.full((n,), float("-inf"), dtype=values.dtype, device=values.device)
        return out.scatter_reduce(0, segments, values, reduce="amax", include_self=True)
    total = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, segments, values)
    count = torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, segments, torch.ones_like(values))
    return total / count


class DinoCycle(PointwiseMetric):
    info = MetricInfo(
        name="dino_cycle",
        display_name="DINO-Cycle",
        description=(
            "Perceptual agreement of cycle-generated images: Stable Diffusion 3 draws the candidate and the "
            "reference caption, and DINO ViT-B/8 compares them with the image, (s1 + s2) / 2."
        ),
        citation=CITATION,
        references="always",
        images="always",
        score_range=(-1.0, 1.0),
        paper="https://arxiv.org/abs/2505.16180",
        paper_config={"model": "facebook/dino-vitb8", "generator": SD3_MODEL, "steps": 40},
    )
    Config = DinoCycleConfig
    extra_names: ClassVar[tuple[str, ...]] = ("s1", "s2")
    mean_extras: ClassVar[tuple[str, ...]] = ("s1", "s2")

    @property
    def encoder(self) -> DinoEncoder:
        return DinoEncoder.shared(EncoderSpec.from_config(self.config))

    def requirements(self) -> list[Requirement]:
        """DINO, and the generator (with diffusers) unless images drawn earlier replace it."""
        cfg = self.config
        needs = super().requirements()
        if not cfg.generated_images:
            needs += [Requirement("model", cfg.generator, "option generator",
                                  "alternatively, pass generated_images=<a folder of images drawn earlier>",
                                  cfg.generator_revision, cfg.local_files_only),
                      Requirement("module", "diffusers", "option generator (Stable Diffusion 3)",
                                  install_extra("diffusion"))]
        return needs

    @property
    def generator(self) -> TextToImage:
        cfg = self.config
        key = ("dino_cycle.generator", cfg.generated_images, cfg.generator, cfg.cache, cfg.cache_dir, cfg.steps,
               cfg.image_size, cfg.guidance_scale, cfg.generator_batch_size, cfg.device, cfg.generator_dtype,
               cfg.generator_revision, cfg.local_files_only)
        return loading.shared(key, lambda: build_generator(cfg))

    def seed(self, caption: str) -> int:
        cfg = self.config
        return caption_seed(caption, cfg.seed) if cfg.seed_per_caption else cfg.seed

    def reference_pairs(self, batch: Batch) -> tuple[list[str], list[int]]:
        texts, owner = [], []
        for i, refs in enumerate(batch.references):
            chosen = refs[:1] if self.config.reference_choice == "first" else refs
            texts += chosen
            owner += [i] * len(chosen)
        return texts, owner

    def generate(self, batch: Batch, captions: list[str]) -> list:
        try:
            return self.generator.generate(captions, [self.seed(c) for c in captions])
        except MissingImageError as err:
            from capeval_plugins.inputs import InputError

            missing = set(err.captions)
            samples = [int(batch.indices[i]) for i, c in enumerate(batch.candidates) if c in missing]
            samples += [int(batch.indices[i]) for i, refs in enumerate(batch.references) if missing & set(refs)]
            raise InputError(f"sample {min(samples)}: {err}") from err

    def score(self, batch: Batch) -> dict[str, Tensor]:
        enc, n = self.encoder, len(batch)
        ref_texts, owner = self.reference_pairs(batch)
        prompts = list(dict.fromkeys(list(batch.candidates) + ref_texts))  # each distinct caption drawn once
        row = {c: i for i, c in enumerate(prompts)}
        how = self.config.preprocessing
        generated = enc.encode_images(self.generate(batch, prompts), preprocessing=how).double()
        originals = enc.encode_images(batch.images, preprocessing=how).double()[batch.image_index.to(enc.device)]
        cand = generated[torch.tensor([row[c] for c in batch.candidates], device=enc.device)]
        refs = generated[torch.tensor([row[r] for r in ref_texts], device=enc.device)]
        owner_t = torch.tensor(owner, device=enc.device)
        s1 = (originals * cand).sum(-1)
        s2 = segment_reduce((cand[owner_t] * refs).sum(-1), owner_t, n, self.config.reference_choice)
        return {"score": (s1 + s2) / 2, "s1": s1, "s2": s2}


METRICS = [DinoCycle]
