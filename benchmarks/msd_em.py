"""MSD-Score's EM + KL step: the official per-pair float32 code and ours batched at several batch sizes, side by
side on the same inputs in one process; then the error of each against a float64 reference.

    python benchmarks/msd_em.py [--pairs 256] [--batch-sizes 1,8,64,256] [--em-dtypes mixed,float64,float32]
                                [--device cpu] [--threads N] [--chunk-mib 2] [--clock wall|cpu] [--repeats 5]
                                [--accuracy-pairs 64] [--em-update-effect]

Features have CLIP ViT-L/14's shapes (256 patches, 768 dimensions, 8-40 caption tokens) and a CLIP-like geometry
(:func:`clip_like`), one image per pair as in the paper's per-pair timing (8.39 ms per pair for EM + KL on an RTX
A6000, Table VII). Times cover both mixture fits (K_img = 3, K_txt = 2, kappa = 20, 20 EM iterations), the
bi-directional KL, the length weight and the fusion, and on our side the seeding the metric does for every batch
(each image's seed hashed from its preprocessed pixels, 3 x 224 x 224, each caption's from its token ids; the
official code draws from torch's global generator inside its loop, also timed); feature extraction is not
included.

Timing: every repeat times each configuration once, in turn (official, then ours), so a change of load on a
shared machine hits all of them alike; each line gives the median and the range over the repeats, and
``official / ours`` is the median of the per-repeat ratios with their range. ``--clock cpu`` times this process's
CPU time, with ``--threads 1`` the steadier figure on a busy machine. ``--chunk-mib`` sets how many rows' points
the EM works on at a time (``core.vmf.CHUNK_BYTES``, on a CPU; 0: the whole batch). Batch 1 is our code one pair at a
time; the last line checks that a pair's score does not depend on its batch.

Accuracy: KL_img->txt, KL_txt->img and MSD of (a) the official float32 code, (b) each ``--em-dtypes`` of ours,
against :func:`official_pair` run in float64 with our initial means and restart points and an exact
normalisation (the settings matched, so what is left is rounding).

``--em-update-effect``: the official COCO-CF script's EM (``em_update="coco-cf"``: no re-initialisation, weights
(N_k + 1e-8) / N) against the paper's on the same features, each image scored with its own caption and the next
image's: the differences in the KL terms and Soft-MSD, the pairwise decisions that change, and how many fits the
paper's EM re-initialised a component in (where the two EMs part).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from capeval_plugins.core import vmf
from capeval_plugins.metrics.msd import msd_components, pixel_seeds
from common import timed

K_IMAGE, K_TEXT, KAPPA, ITERATIONS, LAM, L0, TAU_L = 3, 2, 20.0, 20, 0.1, 20.0, 3.0


# ---------------------------------------------------------------------------------------------------------
# The official code, re-implemented from what it computes: SteinsGateSg/MSDScore,
# metrics/vMF_MSD_Score/calc.py, ``VMFMixture.fit`` / ``score_samples`` and ``calc_bi_kl``. One pair at a time,
# in float32 as it runs there: x / (|x| + 1e-6); initial means a random permutation's first K points; weights
# clamped at 1e-9 before their log and after the M-step, then renormalised; a component with mass below
# 1e-6 N restarts at a random point with weight 1 / N; every scoring re-normalises its points.
# ``init``, ``restarts`` and ``norm_eps`` exist only to match our settings in the accuracy comparison.


def official_unit(x: torch.Tensor, norm_eps: float) -> torch.Tensor:
    return x / (x.norm(dim=-1, keepdim=True) + norm_eps)


def official_fit(x: torch.Tensor, k: int, init: torch.Tensor | None = None, restarts: torch.Tensor | None = None,
                 norm_eps: float = 1e-6, eps: float = 1e-9, threshold: float = 1e-6):
    x = official_unit(x, norm_eps)
    n = len(x)
    if init is None:
        init = torch.randperm(n)[:k] if n >= k else torch.randint(0, n, (k,))
    means = official_unit(x[init], norm_eps)
    weights = torch.full((len(init),), 1.0 / len(init), dtype=x.dtype)
    for step in range(ITERATIONS):
        resp = torch.softmax(KAPPA * (x @ means.T) + weights.clamp_min(eps).log(), dim=1)
        mass = resp.sum(0)
        weights = (mass / n).clamp_min(eps)
        weights = weights / weights.sum()
        sums = resp.T @ x
        dead = mass < threshold * n
        if dead.any():  # a host synchronisation every step, as there
            sums[dead] = x[torch.randint(0, n, (int(dead.sum()),)) if restarts is None else restarts[step][dead]]
            weights[dead] = 1.0 / n
            weights = weights / weights.sum()
        means = official_unit(sums, norm_eps)
    return means, weights


def official_log_density(x: torch.Tensor, mixture, norm_eps: float = 1e-6, eps: float = 1e-9) -> torch.Tensor:
    means, weights = mixture
    return torch.logsumexp(KAPPA * (official_unit(x, norm_eps) @ means.T) + weights.clamp_min(eps).log(), dim=1)


def official_pair(image_global, patches, text_global, tokens, dtype=torch.float32, image_init=None,
                  text_init=None, image_restarts=None, text_restarts=None, norm_eps: float = 1e-6) -> dict:
    """MSD of one pair as the official code computes it (``calc_bi_kl``, then g - lambda D)."""
    patches, tokens = patches.to(dtype), tokens.to(dtype)
    p = official_fit(patches, K_IMAGE, image_init, image_restarts, norm_eps)
    q = official_fit(tokens, K_TEXT, text_init, text_restarts, norm_eps)
    kl_it = (official_log_density(patches, p, norm_eps) - official_log_density(patches, q, norm_eps)).mean()
    kl_ti = (official_log_density(tokens, q, norm_eps) - official_log_density(tokens, p, norm_eps)).mean()
    beta = 1.0 / (1.0 + math.exp((len(tokens) - L0) / TAU_L))
    divergence = beta * kl_it + (1.0 - beta) * kl_ti
    cosine = (image_global.to(dtype) @ text_global.to(dtype)).item()
    return {"kl_image_text": kl_it.item(), "kl_text_image": kl_ti.item(), "msd": cosine - LAM * divergence.item()}


def official_loop(data: dict, dtype: torch.dtype = torch.float32, norm_eps: float = 1e-6, **matched) -> list[dict]:
    """:func:`official_pair` for every pair; ``matched``: per-pair tensors (init and restart points)."""
    out = []
    for i in range(len(data["tokens"])):
        n = int(data["token_mask"][i].sum())
        out.append(official_pair(data["image_global"][i], data["patches"][i], data["text_global"][i],
                                 data["tokens"][i, :n], dtype, norm_eps=norm_eps,
                                 **{key: value[i] for key, value in matched.items()}))
    return out


# ---------------------------------------------------------------------------------------------------------
# Inputs and ours


def clip_like(pairs: int, patches: int, dim: int, device: str, seed: int = 0) -> dict:
    """Unit features with CLIP's shapes and a CLIP-like geometry: each modality has a common direction (the
    'modality gap': patch-token cosines near 0.1-0.3, within a modality 0.3-0.7); an image's patches show a few
    concepts, a caption's tokens mostly the image's concepts, some its own. Caption lengths 8-40 tokens."""
    g = torch.Generator().manual_seed(seed)

    def unit(*shape):
        return F.normalize(torch.randn(*shape, generator=g), dim=-1)

    image_axis, text_axis = unit(dim), unit(dim)
    text_axis = F.normalize(text_axis + 0.4 * image_axis, dim=0)
    concepts = unit(pairs, 6, dim)
    shown = torch.randint(0, 6, (pairs, patches), generator=g)
    local = F.normalize(0.6 * image_axis + 0.6 * concepts[torch.arange(pairs)[:, None], shown]
                        + 0.55 * unit(pairs, patches, dim), dim=-1)
    lengths = torch.randint(8, 41, (pairs,), generator=g)
    width = int(lengths.max())
    said = torch.where(torch.rand(pairs, width, 1, generator=g) < 0.8,
                       concepts[torch.arange(pairs)[:, None], torch.randint(0, 6, (pairs, width), generator=g)],
                       unit(pairs, width, dim))
    tokens = F.normalize(0.6 * text_axis + 0.45 * said + 0.6 * unit(pairs, width, dim), dim=-1)
    token_mask = torch.arange(width)[None, :] < lengths[:, None]
    ids = torch.randint(0, 49000, token_mask.shape, generator=g)
    # what the metric seeds each fit from: the image processor's pixels and the caption's token ids
    pixels = torch.randn(pairs, 3, 224, 224, generator=g)
    data = dict(image_global=F.normalize(local.mean(1) + 0.3 * unit(pairs, dim), dim=-1), patches=local,
                patch_mask=torch.ones(pairs, patches, dtype=torch.bool),
                text_global=F.normalize(tokens.mean(1) + 0.3 * unit(pairs, dim), dim=-1), tokens=tokens,
                token_mask=token_mask, pixels=pixels, ids=ids)
    return {k: v.to(device) for k, v in data.items()}


def seeds(data: dict) -> dict:
    """The metric's seeds of every pair: :func:`pixel_seeds` of the pixels, ``content_seeds`` of the token ids."""
    return {"image_seeds": pixel_seeds(data["pixels"]),
            "text_seeds": vmf.content_seeds(data["ids"], data["token_mask"])}


@torch.inference_mode()  # as MSDScore.map runs it (the official code: under no_grad, main())
def run(data: dict, rows: slice, em_dtype: str) -> dict:
    """MSD and its KL terms for the pairs in ``rows``, all at once, at the metric's ``em_dtype``, with the
    metric's seeding."""
    part = {k: v[rows] for k, v in data.items()}
    n = len(part["tokens"])
    # trim token padding to this batch's longest caption, as a real batch would be
    width = int(part["token_mask"].sum(1).max())
    dtype, product_dtype = vmf.PRECISIONS[em_dtype]
    return msd_components(
        part["image_global"], part["patches"], part["patch_mask"], part["text_global"],
        part["tokens"][:, :width], part["token_mask"][:, :width], torch.arange(n, device=part["tokens"].device),
        **seeds(part), k_image=K_IMAGE, k_text=K_TEXT,
        kappa=KAPPA, iterations=ITERATIONS, lam=LAM, length_l0=L0, length_tau=TAU_L, dtype=dtype,
        product_dtype=product_dtype)


def batched(data: dict, batch_size: int, em_dtype: str) -> torch.Tensor:
    n = len(data["tokens"])
    return torch.cat([run(data, slice(s, s + batch_size), em_dtype)["msd"] for s in range(0, n, batch_size)])


# ---------------------------------------------------------------------------------------------------------
# Timing


def interleaved(jobs: dict[str, Callable[[], object]], repeats: int, device: str, clock) -> dict[str, list[float]]:
    """Seconds of every job at every repeat, the jobs taking turns within each repeat."""
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(repeats):
        for name, job in jobs.items():
            times[name].append(timed(job, 1, device, clock)[0])
    return times


def spread(values: list[float], scale: float = 1.0) -> str:
    return (f"{statistics.median(values) * scale:8.3f} "
            f"[{min(values) * scale:.3f}-{max(values) * scale:.3f}]")


def report_speed(args, data: dict, clock) -> None:
    n = args.pairs
    jobs: dict[str, Callable[[], object]] = {"official": lambda: official_loop(data)}
    for em_dtype in args.em_dtypes:
        for size in args.batch_sizes:
            jobs[f"{em_dtype} batch {size}"] = lambda e=em_dtype, s=size: batched(data, s, e)
    times = interleaved(jobs, args.repeats, args.device, clock)
    print(f"{'':24s} ms/pair: median [min-max] of {args.repeats}   official / ours: median [min-max]")
    for name, values in times.items():
        line = f"{name:24s} {spread(values, 1e3 / n)}"
        if name != "official":
            ratios = [o / t for o, t in zip(times["official"], values)]
            line += f"   {spread(ratios)}"
        print(line)
    for em_dtype in args.em_dtypes:  # a pair's score must not depend on its batch
        alone, whole = batched(data, 1, em_dtype), batched(data, max(args.batch_sizes), em_dtype)
        print(f"{em_dtype}: max |MSD at batch {max(args.batch_sizes)} - MSD at batch 1| "
              f"{float((whole - alone).abs().max()):.1e}")


# ---------------------------------------------------------------------------------------------------------
# Accuracy


def matched_settings(data: dict) -> dict:
    """Our initial means and restart points, per pair, for :func:`official_loop`."""
    out = {}
    drawn = seeds(data)
    for side, mask, k in (("image", "patch_mask", K_IMAGE), ("text", "token_mask", K_TEXT)):
        row_seeds, mask = drawn[f"{side}_seeds"], data[mask]
        out[f"{side}_init"] = vmf.initial_positions(row_seeds, mask, k)
        out[f"{side}_restarts"] = vmf.restart_positions(row_seeds, mask, mask.sum(1), ITERATIONS, k)
    return out


def report_accuracy(args, data: dict) -> None:
    keys = ("kl_image_text", "kl_text_image", "msd")
    part = {k: v[:args.accuracy_pairs] for k, v in data.items()}
    matched = {**matched_settings(part), "norm_eps": 0.0}
    reference = official_loop(part, dtype=torch.float64, **matched)
    truth = {key: torch.tensor([r[key] for r in reference], dtype=torch.float64) for key in keys}

    def errors(values: dict) -> str:
        cells = []
        for key in keys:
            err = (torch.as_tensor(values[key], dtype=torch.float64).cpu() - truth[key]).abs()
            cells.append(f"{float(err.median()):.1e} / {float(err.max()):.1e}")
        return "   ".join(f"{c:>17s}" for c in cells)

    def table(rows: list[dict]) -> dict:
        return {key: [r[key] for r in rows] for key in keys}

    print(f"\nerror vs the float64 reference, {len(reference)} pairs, median / max |diff|:")
    print(f"{'':24s} {'KL img->txt':>17s}   {'KL txt->img':>17s}   {'MSD':>17s}")
    print(f"{'(a) official float32':24s} {errors(table(official_loop(part, dtype=torch.float32, **matched)))}")
    for em_dtype in args.em_dtypes:
        print(f"{'ours ' + em_dtype:24s} {errors(run(part, slice(None), em_dtype))}")
    # The official normaliser x / (|x| + 1e-6) is a definition, not rounding: its effect alone, in float64.
    own_eps = official_loop(part, dtype=torch.float64, **{**matched, "norm_eps": 1e-6})
    print(f"{'official +1e-6 in |x|':24s} {errors(table(own_eps))}   (float64: the definition, not rounding)")


# ---------------------------------------------------------------------------------------------------------
# The COCO-CF script's EM against the paper's


def em_update_effect(data: dict, update: str) -> dict:
    """Soft-MSD of every image with its own caption and with the next pair's caption (a wrong one), float64, one
    image mixture per image as coco_eval_cf.py fits it, the EM ``update`` ("restart" or "coco-cf")."""
    from capeval_plugins.metrics.msd import soft_msd_scores

    n = len(data["tokens"])
    other = torch.roll(torch.arange(n), -1)
    width = int(data["token_mask"].sum(1).max())
    tokens = torch.cat([data["tokens"], data["tokens"][other]])[:, :width]
    mask = torch.cat([data["token_mask"], data["token_mask"][other]])[:, :width]
    text_global = torch.cat([data["text_global"], data["text_global"][other]])
    image_index = torch.cat([torch.arange(n), torch.arange(n)])
    drawn = seeds(data)
    out = msd_components(
        data["image_global"], data["patches"], data["patch_mask"], text_global, tokens, mask, image_index,
        image_seeds=drawn["image_seeds"], text_seeds=torch.cat([drawn["text_seeds"], drawn["text_seeds"][other]]),
        k_image=3, k_text=2, kappa=KAPPA, iterations=ITERATIONS, lam=LAM, dtype=torch.float64, em_update=update)
    out["soft"] = soft_msd_scores(out["cosine"], out["bi_kl"], image_index, LAM, 0.2)
    return out


def report_em_update(data: dict) -> None:
    restart, coco = em_update_effect(data, "restart"), em_update_effect(data, "coco-cf")
    drawn = seeds(data)
    n = len(data["tokens"])
    print(f"\nCOCO-CF script's EM (no re-initialisation, w = (N_k + 1e-8) / N) against the paper's, {n} images, "
          "each with its caption and the next image's, float64:")
    for key in ("kl_image_text", "kl_text_image", "bi_kl", "soft"):
        diff = (coco[key] - restart[key]).abs()
        print(f"  {key:14s} |difference| median {float(diff.median()):.1e}  max {float(diff.max()):.1e}")
    flips = int(((coco["soft"][:n] > coco["soft"][n:]) != (restart["soft"][:n] > restart["soft"][n:])).sum())
    print(f"  pairwise decisions (own caption above the other) that differ: {flips} of {n}")
    for side, points, k in (("patches", "patches", K_IMAGE), ("tokens", "tokens", K_TEXT)):
        mask = data["patch_mask" if side == "patches" else "token_mask"]
        fit = vmf.fit_mixture(data[points], mask, n_components=k, kappa=KAPPA, iterations=ITERATIONS,
                              seeds=drawn["image_seeds" if side == "patches" else "text_seeds"], track=True)
        print(f"  fits of the {side} where the paper's EM re-initialised a component: "
              f"{int((fit.reinitialised.sum(1) > 0).sum())} of {n}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=256)
    parser.add_argument("--batch-sizes", default="1,8,64,256", type=lambda s: [int(v) for v in s.split(",")])
    parser.add_argument("--patches", type=int, default=256)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--em-dtypes", default="mixed", type=lambda s: s.split(","),
                        help=f"comma-separated, of {sorted(vmf.PRECISIONS)}; the metric's default is 'mixed'")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's; 1 on a shared machine)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--chunk-mib", type=float, help=f"EM chunk size in MiB (default {vmf.CHUNK_BYTES >> 20})")
    parser.add_argument("--accuracy-pairs", type=int, default=64, help="0: skip the accuracy comparison")
    parser.add_argument("--em-update-effect", action="store_true",
                        help="also: the COCO-CF script's EM against the paper's on the same features")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.chunk_mib is not None:
        vmf.CHUNK_BYTES = int(args.chunk_mib * 2 ** 20)
    torch.set_grad_enabled(False)
    data = clip_like(args.pairs, args.patches, args.dim, args.device)
    for em_dtype in args.em_dtypes:
        run(data, slice(0, 2), em_dtype)  # warm up
    official_loop({k: v[:2] for k, v in data.items()})
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"device={args.device} threads={torch.get_num_threads()} pairs={args.pairs} patches={args.patches} "
          f"dim={args.dim} tokens=8-40 K=({K_IMAGE},{K_TEXT}) kappa={KAPPA:g} iterations={ITERATIONS} "
          f"chunk={vmf.CHUNK_BYTES / 2 ** 20:g} MiB clock={args.clock}")
    report_speed(args, data, clock)
    for size in (1, 64):
        t_seed, _ = timed(lambda: seeds({k: v[:size] for k, v in data.items()}), 5, args.device, clock)
        print(f"of which seeding at batch {size} (pixels 3x224x224 and token ids): {t_seed * 1e3 / size:.3f} ms/pair")
    print("paper (RTX A6000, EM + KL): 8.39 ms/pair")
    if args.accuracy_pairs:
        report_accuracy(args, data)
    if args.em_update_effect:
        report_em_update({k: v.cpu() for k, v in data.items()})


if __name__ == "__main__":
    main()
