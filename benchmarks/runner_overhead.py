"""What the runner's safety costs: validation (every image header read up front) and a checkpoint after every
batch, against scoring the same caption file without them, same metric, same batches, one process.

    python benchmarks/runner_overhead.py [--arch clip_vit_b32|clip] [--images 64] [--captions-per-image 5]

It also times the run's fingerprint on its own: every image file and every file of the model folder hashed
once per run (what a resume is checked against), as a share of scoring the corpus.

The baseline is the bare contract loop (batches of image files decoded as they come, ``map``, merge,
finalize), which is what the runner adds its checks and checkpoints to. The three variants (baseline, runner
without checkpoints, runner with checkpoints) run in a shuffled order in every round, and each reports its
median wall time and median CPU time (``time.process_time``, all threads of this process), so drift and other
load on the machine hurt all three alike. Single runs of a few seconds vary by several per cent on a 2-core
machine: use ``--repeats 7`` or more for a figure at the 1 % level.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import capeval_plugins
from capeval_plugins import runner
from capeval_plugins.contract import finalize_state, full_spec, map_batch, merge_states
from capeval_plugins.inputs import ImageSource, Samples, iter_batches
from capeval_plugins.testing import scratch_folder


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


def checkpoint_write_seconds(metric, images, captions, folder, repeats: int = 20) -> float:
    """Median time to save one batch's rows the way the runner does after every batch (append + fsync)."""
    from capeval_plugins.checkpoint import RunStore
    from capeval_plugins.contract import full_spec, map_batch

    size = metric.config.batch_size
    samples = Samples(candidates=list(captions[:size]), indices=list(range(size)),
                      images=[ImageSource("path", p, ("path", p), i) for i, p in enumerate(images[:size])])
    rows = {k: v for k, v in map_batch(metric, next(iter_batches(samples, size))).items()
            if full_spec(metric)[k].reduce == "cat"}
    store = RunStore(folder)
    store.attach("overhead")  # the run key of a run id, as every rank gets it from rank 0
    times = []
    for k in range(repeats):
        start = time.perf_counter()
        store.save("m", k, rows, None, {})
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fingerprint_seconds(metric, images, captions, repeats: int = 3) -> float:
    """Median time of a run's fingerprint: every image file and every file of the model folder hashed (the
    content digests a resume is checked against), once per run as the runner does it."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.fingerprint({"m": metric}, runner.Corpus(captions, images), 1, None)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def folder_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if os.path.isdir(path) else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="CLIP checkpoint (default: a random one built here, see --arch)")
    parser.add_argument("--arch", choices=["clip", "clip_vit_b32"], default="clip_vit_b32",
                        help="random checkpoint to build when --model is not given (clip = tiny)")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--captions-per-image", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.model is None:
        from capeval_plugins.testing import tiny_checkpoint

        args.model = str(tiny_checkpoint(args.arch))
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    work = scratch_folder("capeval-runner-bench-")
    images, captions = write_corpus(work, args.images, args.captions_per_image)
    metric = capeval_plugins.load("clipscore", model=args.model, batch_size=args.batch_size)
    metric(images[:4], captions[:4])  # load and warm up
    variants = {
        "bare loop": lambda: bare_loop(metric, images, captions),
        "runner, no checkpoints": lambda: with_runner(metric, images, captions, None),
        "runner + checkpoints": lambda: with_runner(metric, images, captions, work / "run"),
    }
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    results = {}
    order = list(variants)
    for _ in range(args.repeats):
        random.shuffle(order)
        for name in order:
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            results[name] = variants[name]()
            wall[name].append(time.perf_counter() - start_wall)
            cpu[name].append(time.process_time() - start_cpu)
    for name, result in results.items():
        assert torch.equal(result.scores, results["bare loop"].scores), f"{name} scores differ from the bare loop"
    start = time.perf_counter()
    runner.validate(metric, runner.Corpus(captions, images))
    validation = time.perf_counter() - start
    write = checkpoint_write_seconds(metric, images, captions, work / "writes")
    hashing = fingerprint_seconds(metric, images, captions)
    n = len(captions)
    print(f"model={args.model} samples={n} images={args.images} batch_size={args.batch_size} "
          f"threads={torch.get_num_threads()} repeats={args.repeats} (scores identical in all three; medians)")
    base_wall, base_cpu = statistics.median(wall["bare loop"]), statistics.median(cpu["bare loop"])
    for name in variants:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        extra = "" if name == "bare loop" else (f"  overhead wall {100 * (w / base_wall - 1):+.2f} %, "
                                                f"cpu {100 * (c / base_cpu - 1):+.2f} %")
        print(f"{name:24s} {w * 1e3 / n:8.3f} ms/sample wall, {c * 1e3 / n:8.3f} ms/sample cpu{extra}")
    per_batch = statistics.median(wall["bare loop"]) * metric.config.batch_size / n
    print(f"checkpoint write         {write * 1e3:8.3f} ms/batch = {100 * write / per_batch:.2f} % of a batch's "
          f"{per_batch * 1e3:.0f} ms (rows appended and fsynced)")
    print(f"validation alone         {validation * 1e3 / n:8.3f} ms/sample ({args.images} image headers)")
    scoring = statistics.median(wall["bare loop"])
    print(f"fingerprint (hashing)    {hashing * 1e3:8.1f} ms per run = {100 * hashing / scoring:.2f} % of scoring "
          f"{n} samples ({scoring:.2f} s); {args.images} images + model folder "
          f"({folder_bytes(args.model) / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
