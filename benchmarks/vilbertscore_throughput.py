"""ViLBERTScore throughput: the batched metric against a one-pair-at-a-time loop, in one run.

Both score the same corpus (images with several candidates each, five references per candidate) with the same
random ViLT (ViLT-B/32-shaped image side, a smaller transformer so the CPU run stays short). The loop encodes
the image, the candidate and the reference afresh for every candidate-reference pair and matches that pair
alone, as a straightforward port of the official code would. Prints pairs per second and the ratio, and checks
that both give the same scores.

    python benchmarks/vilbertscore_throughput.py [--images 8] [--candidates 3] [--model PATH] [--device cuda]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import capeval_plugins
from capeval_plugins.core.encoders.conditioned import ConditionedEncoder
from capeval_plugins.core.matching import greedy_prf
from capeval_plugins.testing.corpus import caption_corpus
from capeval_plugins.testing.text_encoders import bert_tokenizer


def build_vilt(path: Path, hidden: int = 256, layers: int = 6, image_size: int = 224, patch: int = 32) -> str:
    from transformers import ViltConfig, ViltImageProcessor, ViltModel, ViltProcessor

    tokenizer = bert_tokenizer(model_max_length=40)
    config = ViltConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                        num_attention_heads=4, vocab_size=len(tokenizer), max_position_embeddings=40,
                        image_size=image_size, patch_size=patch, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    ViltModel(config).save_pretrained(path)
    ViltProcessor(image_processor=ViltImageProcessor(size={"shortest_edge": image_size}, size_divisor=patch),
                  tokenizer=tokenizer).save_pretrained(path)
    return str(path)


def corpus(n_images: int, per_image: int, n_refs: int = 5):
    rng = np.random.default_rng(0)
    captions = caption_corpus()
    images = [Image.fromarray(rng.integers(0, 256, size=(240, 320, 3), dtype=np.uint8)) for _ in range(n_images)]
    sample_images, candidates, references = [], [], []
    for i, image in enumerate(images):
        refs = [captions[(7 * i + j) % len(captions)] for j in range(n_refs)]
        for k in range(per_image):
            sample_images.append(image)
            candidates.append(captions[(13 * i + 5 * k + 3) % len(captions)])
            references.append(refs)
    return sample_images, candidates, references


def one_pair_at_a_time(enc: ConditionedEncoder, images, candidates, references) -> list[float]:
    scores = []
    one = torch.zeros(1, dtype=torch.long)
    for image, cand, refs in zip(images, candidates, references):
        f_values = []
        for ref in refs:
            context = enc.encode_images([image])
            c = enc.embed([cand], one, context, batch_size=1)
            r = enc.embed([ref], one, context, batch_size=1)
            _, _, f = greedy_prf(c.embeddings, c.attention_mask & ~c.special,
                                 r.embeddings, r.attention_mask & ~r.special)
            f_values.append(f.item())
        scores.append(sum(f_values) / len(f_values))
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--candidates", type=int, default=3, help="candidates per image")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model", default=None, help="a ViLT or BLIP-ITM checkpoint (default: a random ViLT)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_vilt(Path(tmp) / "vilt")
        images, candidates, references = corpus(args.images, args.candidates)
        pairs = sum(len(r) for r in references)
        metric = capeval_plugins.load("vilbertscore", model=model, batch_size=args.batch_size, device=args.device)
        enc = metric.encoder
        metric(images[:2], candidates[:2], references[:2])  # warm-up (first-call allocations)

        start = time.perf_counter()
        batched = metric(images, candidates, references)
        t_batched = time.perf_counter() - start

        start = time.perf_counter()
        naive = one_pair_at_a_time(enc, images, candidates, references)
        t_naive = time.perf_counter() - start

    diff = float(np.max(np.abs(np.array(naive) - batched.scores.numpy())))
    print(f"corpus: {len(candidates)} candidates ({args.images} images x {args.candidates}), {pairs} "
          f"candidate-reference pairs, device {enc.device}, torch threads {torch.get_num_threads()}")
    print(f"batched metric (batch_size={args.batch_size}): {t_batched:8.2f} s  {pairs / t_batched:8.1f} pairs/s")
    print(f"one pair at a time:                {t_naive:8.2f} s  {pairs / t_naive:8.1f} pairs/s")
    print(f"speed-up: {t_naive / t_batched:.1f}x   max |score difference|: {diff:.2e}")


if __name__ == "__main__":
    main()
