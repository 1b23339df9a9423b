"""CLIPScore: batched with image reuse vs a one-pair-at-a-time loop, same model and inputs, one process.

    python benchmarks/clipscore_throughput.py [--model PATH_OR_ID] [--images 64] [--captions-per-image 5]
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from PIL import Image

import capeval_plugins
from capeval_plugins.models.encoders import ClipEncoder
from common import timed


def corpus(n_images: int, per_image: int, size: int = 224):
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n_images)]
    words = "a dog cat man woman runs sits on the grass in park with red ball near water".split()
    captions = [" ".join(rng.choice(words, size=10)) for _ in range(n_images * per_image)]
    return [images[i // per_image] for i in range(n_images * per_image)], captions


def naive_loop(encoder: ClipEncoder, images, captions, w=2.5):
    """What a simple script does: one image and one caption per forward pass."""
    out = []
    for image, caption in zip(images, captions):
        img = encoder.encode_images([image])[0].double()
        txt = encoder.encode_texts(["A photo depicts " + caption])[0].double()
        out.append(w * max(float(img @ txt), 0.0))
    return out



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="CLIP checkpoint (default: a random one built here, see --arch)")
    parser.add_argument("--arch", choices=["clip", "clip_vit_b32"], default="clip_vit_b32",
                        help="random checkpoint to build when --model is not given (clip = tiny)")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--captions-per-image", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.model is None:
        from capeval_plugins.testing import tiny_checkpoint

        args.model = str(tiny_checkpoint(args.arch))
    torch.set_grad_enabled(False)
    images, captions = corpus(args.images, args.captions_per_image)
    metric = capeval_plugins.load("clipscore", model=args.model, batch_size=args.batch_size)
    encoder = metric.encoder
    metric(images[:4], captions[:4])  # warm up
    t_batched, result = timed(lambda: metric(images, captions), args.repeats)
    t_naive, naive = timed(lambda: naive_loop(encoder, images, captions), args.repeats)
    n = len(captions)
    assert np.allclose(result.scores.numpy(), naive, atol=1e-5), "batched and naive scores differ"
    print(f"model={args.model} pairs={n} images={args.images} captions/image={args.captions_per_image} "
          f"batch_size={args.batch_size} threads={torch.get_num_threads()}")
    print(f"batched+reuse: {t_batched * 1e3 / n:.3f} ms/pair  ({n / t_batched:.1f} pairs/s)")
    print(f"naive loop:    {t_naive * 1e3 / n:.3f} ms/pair  ({n / t_naive:.1f} pairs/s)")
    print(f"speed-up: {t_naive / t_batched:.1f}x")


if __name__ == "__main__":
    main()
