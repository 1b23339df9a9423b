"""MSD aligner training: one epoch with the vision-feature cache against one without; same models, data and
settings, one process.

    python benchmarks/msd_aligner_cache.py [--vision tiny|b32|PATH] [--llm PATH] [--pairs 64] [--batch-size 16]
                                           [--threads N]

* ``no cache``: every step runs the frozen CLIP vision tower on its images, then the projector, the contrastive
  term and the reconstruction through the frozen LLM;
* ``cache``: the vision features were extracted once before training (its one-off cost is printed); every step
  reads them from the shards on disk.

Both epochs run :func:`train_aligner` end to end (fresh output folders). Default models: the tiny random CLIP and
LLaMA of the tests; ``--vision b32`` builds a full-size random ViT-B/32 CLIP (about 600 MB, 224 px images), where
the vision tower costs what it costs in real training. The ratio grows with the vision tower's share of a step:
with a 7B LLM on a GPU the reconstruction dominates, and the cache mainly saves the image decoding and the tower.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from capeval_plugins.testing import scratch_folder, tiny_checkpoint
from capeval_plugins.models.msd_aligner.model import AlignerSettings
from capeval_plugins.training.msd_aligner.synthetic import synthetic_captions
from capeval_plugins.training.msd_aligner.train import AlignerConfig, train_aligner


def vision_model(choice: str) -> tuple[str, int]:
    """(checkpoint, image size) for ``--vision``."""
    if choice == "tiny":
        return str(tiny_checkpoint("clip")), 32
    if choice == "b32":
        return str(tiny_checkpoint("clip_vit_b32")), 224
    return choice, 224


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vision", default="tiny", help="tiny (default), b32 (random full-size ViT-B/32) or a path")
    parser.add_argument("--llm", help="causal LM checkpoint (default: the tiny random LLaMA)")
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's; 1 on a shared machine)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    vision, size = vision_model(args.vision)
    llm = args.llm or str(tiny_checkpoint("llama"))
    settings = AlignerSettings(vision_model=vision, llm=llm)
    data = synthetic_captions(args.pairs, seed=0, size=size)
    config = AlignerConfig(epochs=1, batch_size=args.batch_size, micro_batch_size=args.batch_size)
    root = scratch_folder("capeval-bench-aligner-")
    runs = iter(range(10 ** 6))

    def epoch(cache: Path | None) -> float:
        start = time.perf_counter()
        train_aligner(root / f"run{next(runs)}", data, settings=settings, config=config, device=args.device,
                      cache_dir=cache, progress=False)
        return time.perf_counter() - start

    epoch(None)  # loads the models (shared afterwards) and warms up
    start = time.perf_counter()
    epoch(root / "cache")  # extraction, then an epoch on the cache
    t_first = time.perf_counter() - start
    t_plain = min(epoch(None) for _ in range(args.repeats))
    t_cached = min(epoch(root / "cache") for _ in range(args.repeats))
    t_extract = t_first - t_cached
    print(f"vision={vision} llm={llm} device={args.device or ('cuda' if torch.cuda.is_available() else 'cpu')} "
          f"threads={torch.get_num_threads()}")
    print(f"one epoch: pairs={args.pairs} image size={size} batch={args.batch_size} "
          f"steps={-(-args.pairs // args.batch_size)}; best of {args.repeats}")
    print(f"  no cache (vision tower every step): {t_plain:8.3f} s/epoch")
    print(f"  cache:                              {t_cached:8.3f} s/epoch  {t_plain / t_cached:6.2f}x faster")
    print(f"  one-off extraction into the cache:  {t_extract:8.3f} s "
          f"(pays for itself after {t_extract / max(t_plain - t_cached, 1e-12):.2f} epochs)")


if __name__ == "__main__":
    main()
