"""A small synthetic caption set whose captions describe their images: a coloured shape on a grey ground,
captioned "a <colour> <shape>". For tests, benchmarks and trying the aligner pipeline end to end without data.
"""
from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from capeval_plugins.training.msd_aligner.data import CaptionSet, from_lists

COLOURS = {"red": (220, 30, 30), "green": (30, 190, 40), "blue": (30, 50, 220), "yellow": (230, 220, 30)}
SHAPES = ("circle", "square", "triangle")


def shape_image(colour: str, shape: str, rng: np.random.Generator, size: int = 32) -> Image.Image:
    """One ``shape`` in ``colour`` at a random place and size on a noisy grey ground."""
    ground = np.clip(128 + rng.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(ground)
    radius = int(rng.integers(size // 4, size // 3 + 1))
    cx, cy = (int(v) for v in rng.integers(radius, size - radius, 2))
    box = (cx - radius, cy - radius, cx + radius, cy + radius)
    draw = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)], fill=fill)
    return image


def synthetic_captions(n: int, seed: int = 0, size: int = 32) -> CaptionSet:
    """``n`` pairs cycling through every (colour, shape), each image drawn afresh; seeded."""
    rng = np.random.default_rng(seed)
    kinds = [(c, s) for c in COLOURS for s in SHAPES]
    images, captions = [], []
    for i in range(n):
        colour, shape = kinds[i % len(kinds)]
        images.append(shape_image(colour, shape, rng, size))
        captions.append(f"a {colour} {shape}")
    return from_lists(images, captions)
