"""A small synthetic human-judgment set with a learnable rule, for smoke tests, benchmarks and trying the
training pipeline end to end without data.

Each image (a noisy flat colour) has two candidates. A candidate is a random scene ("a dog runs in the park")
followed by eight quality words in random order, 2k of them "good" and the rest "bad"; its human score is
k / 4 on [0, 1] (k = 0..4). The score is spread over many tokens of equal number in every caption, so a
backbone whose attention mixes them carries it to the score position, where LoRA can learn to read it; the
images carry no signal. ``video=True`` gives each sample a few frames instead of one image.
"""
from __future__ import annotations

import numpy as np
from PIL import Image

from capeval_plugins.training.data import JudgmentSet, from_lists

GOOD, BAD, WORDS = "good", "bad", 8
SUBJECTS = ("a dog", "a cat", "a man", "a woman", "a bird")
VERBS = ("runs", "sits", "jumps", "plays", "walks")
PLACES = ("on the grass", "in the park", "near the water", "on a bench", "in the snow")
COLOURS = ((200, 30, 30), (30, 180, 40), (30, 40, 200), (220, 210, 30), (240, 240, 240))


def _picture(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    colour = np.array(COLOURS[int(rng.integers(len(COLOURS)))], dtype=np.float64)
    noise = rng.normal(0.0, 20.0, (size[1], size[0], 3))
    return Image.fromarray(np.clip(colour + noise, 0, 255).astype(np.uint8))


def synthetic_judgments(n: int, seed: int = 0, *, video: bool = False, frames: int = 3,
                        references: bool = False, size: tuple[int, int] = (40, 32)) -> JudgmentSet:
    """``n`` rated captions over ``ceil(n / 2)`` images (or videos of ``frames`` frames); seeded."""
    rng = np.random.default_rng(seed)
    visuals, candidates, scores, refs = [], [], [], []
    for i in range(n):
        if i % 2 == 0:
            visual = [_picture(rng, size) for _ in range(frames)] if video else _picture(rng, size)
        quality = int(rng.integers(5))
        scene = " ".join(options[int(rng.integers(len(options)))] for options in (SUBJECTS, VERBS, PLACES))
        words = rng.permutation([GOOD] * (2 * quality) + [BAD] * (WORDS - 2 * quality))
        visuals.append(visual)
        candidates.append(f"{scene}, {' '.join(words)}")
        scores.append(quality / 4)
        refs.append([scene])
    return from_lists(visuals, candidates, scores, refs if references else None)
