"""What the runner's safety costs: validation (every image header read up front) and a checkpoint after every
batch, against scoring the same caption file without them, same metric, same batches, one process.

    python benchmarks/runner_overhead.py [--arch clip_vit_b32|clip] [--images 64] [--captions-per-image 5]

The baseline is the bare contract loop (batches of image files decoded as they come, ``map``, merge,
finalize), which is what the runner adds its checks and checkpoints to. Runs alternate (baseline, runner
without checkpoints, runner with checkpoints) and each keeps its best time, so a busy machine hurts all three
alike.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import capeval_plugins
from capeval_plugins import runner
from capeval_plugins.contract import finalize_state, full_spec, map_batch, merge_states
from capeval_plugins.inputs import ImageSource, Samples, iter_batches


def write_corpus(folder: Path, n_images: int, per_image: int, size: int = 224) -> tuple[list[str], list[str]]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n_images):
        path = folder / f"{i:05d}.jpg"
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path, quality=90)
        paths.append(str(path))
    words = "a dog cat man woman runs sits on the grass in park with red ball near water".split()
    captions = [" ".join(rng.choice(words, size=10)) for _ in range(n_images * per_image)]
    return [paths[i // per_image] for i in range(len(captions))], captions


def bare_loop(metric, images, captions):
    """The contract without the runner: no up-front checks (the files are only opened to decode them), no
    checkpoints."""
    sources = [ImageSource("path", p, ("path", os.path.realpath(p)), i) for i, p in enumerate(images)]
    samples = Samples(candidates=list(captions), indices=list(range(len(captions))), images=sources)
    parts = (map_batch(metric, batch) for batch in iter_batches(samples, metric.config.batch_size))
    return finalize_state(metric, merge_states(full_spec(metric), parts))


def with_runner(metric, images, captions, run_dir):
    corpus = runner.Corpus(captions, images)
    outcome = runner.run({"m": metric}, corpus, run_dir=run_dir)
    if run_dir is not None:
        runner.finish(run_dir)
    return outcome.results["m"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="CLIP checkpoint (default: a random one built here, see --arch)")
    parser.add_argument("--arch", choices=["clip", "clip_vit_b32"], default="clip_vit_b32",
                        help="random checkpoint to build when --model is not given (clip = tiny)")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--captions-per-image", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.model is None:
        from capeval_plugins.testing import tiny_checkpoint

        args.model = str(tiny_checkpoint(args.arch))
    torch.set_grad_enabled(False)
    work = Path(tempfile.mkdtemp(prefix="capeval-runner-bench-"))
    images, captions = write_corpus(work, args.images, args.captions_per_image)
    metric = capeval_plugins.load("clipscore", model=args.model, batch_size=args.batch_size)
    metric(images[:4], captions[:4])  # load and warm up
    variants = {
        "bare loop": lambda: bare_loop(metric, images, captions),
        "runner, no checkpoints": lambda: with_runner(metric, images, captions, None),
        "runner + checkpoints": lambda: with_runner(metric, images, captions, work / "run"),
    }
    best = {name: float("inf") for name in variants}
    results = {}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            results[name] = fn()
            best[name] = min(best[name], time.perf_counter() - start)
    for name, result in results.items():
        assert torch.equal(result.scores, results["bare loop"].scores), f"{name} scores differ from the bare loop"
    start = time.perf_counter()
    runner.validate(metric, runner.Corpus(captions, images))
    validation = time.perf_counter() - start
    n = len(captions)
    print(f"model={args.model} samples={n} images={args.images} batch_size={args.batch_size} "
          f"threads={torch.get_num_threads()} (scores identical in all three)")
    for name, seconds in best.items():
        extra = "" if name == "bare loop" else f"  overhead {100 * (seconds / best['bare loop'] - 1):+.2f} %"
        print(f"{name:24s} {seconds * 1e3 / n:8.3f} ms/sample{extra}")
    print(f"validation alone         {validation * 1e3 / n:8.3f} ms/sample ({args.images} image headers)")


if __name__ == "__main__":
    main()
