"""MSD-Score's EM + KL step: batched over pairs vs a one-pair-at-a-time loop, same inputs, one process.

    python benchmarks/msd_em.py [--pairs 256] [--batch-sizes 1,8,64,256] [--dtype float64] [--device cpu]
                                [--threads N] [--chunk-mib 12] [--clock wall|cpu]

Features are random unit vectors shaped like CLIP ViT-L/14's (256 patches, 768 dimensions, 8-40 caption
tokens), one image per pair as in the paper's per-pair timing (the paper reports 8.39 ms per pair for EM + KL on
an RTX A6000, Table VII). Times cover both mixture fits (K_img = 3, K_txt = 2, kappa = 20, 20 EM iterations),
the bi-directional KL, the length weight and the fusion; feature extraction is not included. The loop and the
batched runs call the same functions (the loop one pair at a time), so the agreement column checks that batching
changes nothing; ``tests/test_vmf.py`` checks both against an independent per-sample EM. ``--chunk-mib`` sets how
many rows' points the EM works on at a time (``core.vmf.CHUNK_BYTES``; 0: the whole batch). ``--clock cpu``
times the process's CPU time instead of wall time: with ``--threads 1`` on a busy shared machine it is the
steadier figure.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from capeval_plugins.core import vmf
from capeval_plugins.core.vmf import content_seeds
from capeval_plugins.metrics.msd import msd_components, pixel_seeds
from common import timed


def workload(pairs: int, patches: int, dim: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    image_global = F.normalize(torch.randn(pairs, dim, generator=g), dim=-1)
    text_global = F.normalize(torch.randn(pairs, dim, generator=g), dim=-1)
    local_patches = F.normalize(torch.randn(pairs, patches, dim, generator=g), dim=-1)
    lengths = torch.randint(8, 41, (pairs,), generator=g)
    tokens = F.normalize(torch.randn(pairs, int(lengths.max()), dim, generator=g), dim=-1)
    token_mask = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
    patch_mask = torch.ones(pairs, patches, dtype=torch.bool)
    ids = torch.randint(0, 49000, token_mask.shape, generator=g)
    # Seeds come from the pixels and token ids in the metric; made here once, outside the timed EM + KL.
    data = dict(image_global=image_global, patches=local_patches, patch_mask=patch_mask, text_global=text_global,
                tokens=tokens, token_mask=token_mask, image_seeds=content_seeds(local_patches),
                text_seeds=content_seeds(ids, token_mask))
    return {k: v.to(device) for k, v in data.items()}


def run(data: dict, rows: slice, dtype: torch.dtype) -> torch.Tensor:
    """MSD for the pairs in ``rows``, all at once."""
    part = {k: v[rows] for k, v in data.items()}
    n = len(part["tokens"])
    # trim token padding to this batch's longest caption, as a real batch would be
    width = int(part["token_mask"].sum(1).max())
    out = msd_components(
        part["image_global"], part["patches"], part["patch_mask"], part["text_global"],
        part["tokens"][:, :width], part["token_mask"][:, :width], torch.arange(n, device=part["tokens"].device),
        image_seeds=part["image_seeds"], text_seeds=part["text_seeds"], dtype=dtype,
    )
    return out["msd"]


def batched(data: dict, batch_size: int, dtype: torch.dtype) -> torch.Tensor:
    n = len(data["tokens"])
    return torch.cat([run(data, slice(s, s + batch_size), dtype) for s in range(0, n, batch_size)])


def per_pair(data: dict, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([run(data, slice(i, i + 1), dtype) for i in range(len(data["tokens"]))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=256)
    parser.add_argument("--batch-sizes", default="1,8,64,256")
    parser.add_argument("--patches", type=int, default=256)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's; 1 on a shared machine)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--chunk-mib", type=float, help=f"EM chunk size in MiB (default {vmf.CHUNK_BYTES >> 20})")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.chunk_mib is not None:
        vmf.CHUNK_BYTES = int(args.chunk_mib * 2 ** 20)
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype)
    data = workload(args.pairs, args.patches, args.dim, args.device)
    run(data, slice(0, 2), dtype)  # warm up
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    t_loop, reference = timed(lambda: per_pair(data, dtype), args.repeats, args.device, clock)
    n = args.pairs
    print(f"device={args.device} threads={torch.get_num_threads()} dtype={args.dtype} pairs={n} "
          f"patches={args.patches} dim={args.dim} tokens=8-40 K=(3,2) kappa=20 iterations=20 "
          f"chunk={vmf.CHUNK_BYTES / 2 ** 20:g} MiB clock={args.clock}")
    print(f"per-pair loop:        {t_loop * 1e3 / n:8.3f} ms/pair")
    for size in (int(s) for s in args.batch_sizes.split(",")):
        t, scores = timed(lambda: batched(data, size, dtype), args.repeats, args.device, clock)
        diff = float((scores - reference).abs().max())
        print(f"batched, batch {size:5d}: {t * 1e3 / n:8.3f} ms/pair  speed-up {t_loop / t:6.2f}x  "
              f"max |diff| vs loop {diff:.1e}")
    pixels = torch.rand(64, 3, 224, 224, device=args.device)
    t_seed, _ = timed(lambda: pixel_seeds(pixels), args.repeats, args.device, clock)
    print(f"seed from an image's pixels (3x224x224, not in the figures above): {t_seed * 1e3 / 64:.3f} ms/image")
    print("paper (RTX A6000, EM + KL): 8.39 ms/pair")


if __name__ == "__main__":
    main()
