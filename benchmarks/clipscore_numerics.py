"""CLIPScore at one caption per image: what the faster numerics options buy and what they change.

    python benchmarks/clipscore_numerics.py [--model PATH] [--images 64] [--configs float32,bf16,int8,compile]

On a CPU, CLIPScore with one caption per image does the same forward passes as torchmetrics' (one image and one
text per row), so at the same numerics parity is the limit (``peers.py``). What is left is the numerics
themselves, each an option of the metric: ``dtype="bfloat16"``, ``quantize="int8"`` (the Linear layers' weights
in int8, dynamic int8 activations) and ``compile=True`` (``torch.compile`` of both towers). Each configuration
scores the same photos (``capeval_plugins.testing.realistic``, one caption each) through ``capeval_plugins.load``
in the same process, interleaved over ``--repeats`` rounds; printed: CPU seconds (median, model load and the
first, compiling call excluded), the speed-up over float32 and the largest difference of the per-sample
CLIPScore (w = 2.5) from float32's. Also the wall-clock effect of the runner's prefetch (decode and preprocess
the next batch meanwhile: ``CAPEVAL_PREFETCH=0`` against the default). Default model: the random full-size
ViT-B/32 (``capeval tiny clip_vit_b32``); random weights, so the score differences say how far the numerics
move a cosine of this model, not a correlation with humans.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import capeval_plugins
from capeval_plugins import runner
from capeval_plugins.testing import tiny_checkpoint
from capeval_plugins.testing.realistic import photo_crops

CONFIGS = {"float32": {}, "bf16": {"dtype": "bfloat16"}, "int8": {"quantize": "int8"}, "compile": {"compile": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="CLIP checkpoint (default: the random full-size ViT-B/32; 'clip': the tiny one)")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--configs", default="float32,bf16,int8,compile")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    model = str(tiny_checkpoint(args.model or "clip_vit_b32")) if args.model in (None, "clip") else args.model
    images = photo_crops(args.images)
    captions = [f"a photograph of a scene, number {k}" for k in range(args.images)]
    names = args.configs.split(",")
    metrics = {name: capeval_plugins.load("clipscore", model=model, batch_size=args.batch_size, **CONFIGS[name])
               for name in names}
    scores, times = {}, {name: [] for name in names}
    for name in names:  # load, and compile, outside the timed calls
        scores[name] = runner.score(metrics[name], images, captions).scores
    for r in range(args.repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            start = time.process_time()
            runner.score(metrics[name], images, captions)
            times[name].append(time.process_time() - start)
    base = statistics.median(times[names[0]])
    print(f"model={model} images={args.images} (one caption each) batch_size={args.batch_size} "
          f"threads={torch.get_num_threads()}; CPU s, median of {args.repeats}")
    for name in names:
        t = statistics.median(times[name])
        diff = (scores[name] - scores[names[0]]).abs().max().item()
        print(f"  {name:8s} {t:7.2f} s  {base / t:5.2f}x {names[0]}   max |CLIPScore - {names[0]}| {diff:.1e}")
    walls = {"0": [], "1": []}
    for r in range(args.repeats):
        for flag in (("0", "1") if r % 2 == 0 else ("1", "0")):
            os.environ["CAPEVAL_PREFETCH"] = flag
            metrics[names[0]].encoder.pixels.clear()
            start = time.perf_counter()
            runner.score(metrics[names[0]], images, captions)
            walls[flag].append(time.perf_counter() - start)
    off, on = statistics.median(walls["0"]), statistics.median(walls["1"])
    print(f"prefetch ({names[0]}): wall {off:.2f} s without, {on:.2f} s with ({off / on:.2f}x)")


if __name__ == "__main__":
    main()
