"""MID's reference fit: streaming sums (count, sum z, sum z z^T in float64) vs keeping every feature, as the
corpus grows. Fit time, peak memory and the bytes a DDP sync moves, with ratios; synthetic unit-norm
features of CLIP ViT-L/14's size (D = 768), so no model is needed. Then the whole state of the ``mid`` metric
(its declared states plus the contract's index and group rows) with and without per-sample scores, and the
bytes one DDP sync of it moves, as N grows.

    python benchmarks/mid_streaming.py [--sizes 2048 8192 32768] [--dim 768] [--batch 1024]

Each (method, N) runs in a fresh process so its peak resident memory is its own.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time


def feature_batch(start: int, size: int, dim: int):
    """Deterministic unit-norm (image, text) features sharing a latent, one batch at a time."""
    import torch

    gen = torch.Generator().manual_seed(start)
    latent = torch.randn(size, dim // 4, generator=gen)
    mix_x = torch.randn(dim // 4, dim, generator=torch.Generator().manual_seed(-1))
    mix_y = torch.randn(dim // 4, dim, generator=torch.Generator().manual_seed(-2))
    x = latent @ mix_x + 0.3 * torch.randn(size, dim, generator=gen) + 1.0
    y = latent @ mix_y + 0.3 * torch.randn(size, dim, generator=gen) - 1.0
    return torch.nn.functional.normalize(x, dim=-1), torch.nn.functional.normalize(y, dim=-1)


def streaming_fit(n: int, dim: int, batch: int) -> tuple[float, int]:
    """Sums per batch, merged; then the Gaussian. Returns (seconds in the fit, state bytes)."""
    from capeval_plugins.core import gaussian

    sums, spent = gaussian.empty_sums(2 * dim), 0.0
    for start in range(0, n, batch):
        x, y = feature_batch(start, min(batch, n - start), dim)
        t0 = time.perf_counter()
        sums = gaussian.merge_sums(sums, gaussian.joint_sums(x, y))
        spent += time.perf_counter() - t0
    t0 = time.perf_counter()
    gaussian.JointGaussian.from_sums(sums, dim)
    spent += time.perf_counter() - t0
    return spent, sum(v.nbytes for v in sums.values())


def keep_all_fit(n: int, dim: int, batch: int) -> tuple[float, int]:
    """Every feature kept in float64 (as the official MID does), concatenated, then mean and covariance."""
    import torch

    from capeval_plugins.core import gaussian

    kept, spent = [], 0.0
    for start in range(0, n, batch):
        x, y = feature_batch(start, min(batch, n - start), dim)
        t0 = time.perf_counter()
        kept.append(torch.cat([x, y], dim=1).double())
        spent += time.perf_counter() - t0
    t0 = time.perf_counter()
    z = torch.cat(kept)
    state_bytes = z.nbytes
    del kept
    mean = z.mean(dim=0)
    centred = z - mean
    cov = centred.T @ centred / (len(z) - 1)
    gaussian.JointGaussian(mean, cov, dim, len(z))
    spent += time.perf_counter() - t0
    return spent, state_bytes


def measure(method: str, n: int, dim: int, batch: int, out) -> None:
    import torch

    from capeval_plugins.core import gaussian  # noqa: F401  (imports out of the measured peak)

    feature_batch(0, batch, dim)  # warm up allocations of one batch, as both methods need
    torch.zeros(1).double()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds, state = (streaming_fit if method == "streaming" else keep_all_fit)(n, dim, batch)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base  # KiB on Linux
    out.put((seconds, peak * 1024, state))


def run(method: str, n: int, dim: int, batch: int) -> tuple[float, int, int]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=measure, args=(method, n, dim, batch, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def mib(b: float) -> str:
    return f"{b / 2**20:9.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--dim", type=int, default=768, help="feature size (CLIP ViT-L/14: 768)")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--world", type=int, default=2, help="DDP ranks for the sync estimate")
    args = parser.parse_args()
    d = args.dim
    print(f"MID reference fit, D = {d} (joint 2D = {2 * d}), batches of {args.batch}")
    print(f"{'N':>7} | {'streaming time':>14} {'peak':>13} {'state':>13} | {'keep-all time':>13} {'peak':>13} "
          f"{'state':>13} | time x  peak x")
    for n in args.sizes:
        s_time, s_peak, s_state = run("streaming", n, d, args.batch)
        k_time, k_peak, k_state = run("keep_all", n, d, args.batch)
        print(f"{n:>7} | {s_time:13.3f}s {mib(s_peak)} {mib(s_state)} | {k_time:12.3f}s {mib(k_peak)} {mib(k_state)} | "
              f"{k_time / s_time:5.2f}  {k_peak / max(s_peak, 1):6.2f}")
    # A torchmetrics / capeval DDP sync: "sum" states are all-reduced (every rank sends its D^2 statistics);
    # kept features are all-gathered (every rank receives every other rank's rows). Candidate features, kept
    # per sample by both approaches (float32, 2D per sample), are listed apart.
    sums = 8 * (1 + 2 * d + 4 * d * d)
    print(f"\nBytes moved per rank by one DDP sync of the reference fit ({args.world} ranks, ring all-reduce "
          "~2x the buffer; all-gather receives (world-1)/world of the rows):")
    print(f"{'N':>7} | {'streaming sums':>16} | {'keep-all features':>18} | ratio | candidate rows (both)")
    for n in args.sizes:
        gathered = 8 * 2 * d * n * (args.world - 1) / args.world
        reduced = 2 * sums * (args.world - 1) / args.world
        candidates = 4 * 2 * d * n * (args.world - 1) / args.world
        print(f"{n:>7} | {mib(reduced):>16} | {mib(gathered):>18} | {gathered / reduced:5.2f} | {mib(candidates)}")
    state_table(args.sizes + [10 * args.sizes[-1]], d, args.world)


def metric_state(per_sample: bool, dim: int) -> tuple[int, int, int, int]:
    """The ``mid`` metric's full state (contract index and group rows included): bytes of its "sum" states,
    bytes per sample of its "cat" states, and how many of each kind. Read from the metric's own declared
    states (``full_spec``); a saved fit of the right size stands in for the CLIP model."""
    import math
    import tempfile

    import torch

    import capeval_plugins
    from capeval_plugins.contract import full_spec
    from capeval_plugins.core import gaussian

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/fit.npz"
        with open(path, "wb") as f:
            f.write(gaussian.sums_to_bytes(gaussian.empty_sums(2 * dim), dim))
        metric = capeval_plugins.load("mid", reference_gaussian=path, per_sample=per_sample)
        spec = full_spec(metric)
    size = lambda s: math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size()  # noqa: E731
    sums = [size(s) for s in spec.values() if s.reduce == "sum"]
    rows = [size(s) for s in spec.values() if s.reduce == "cat"]
    return sum(sums), sum(rows), len(sums), len(rows)


def state_table(sizes: list[int], dim: int, world: int) -> None:
    """MID's state and one DDP sync of it, per_sample=True vs False, as N grows."""
    print(f"\nThe mid metric's whole state at D = {dim} and one DDP sync of it ({world} ranks): \"sum\" states are "
          "all-reduced (ring, ~2x the buffer sent per rank), \"cat\" rows all-gathered (each rank receives "
          "(world-1)/world of them)")
    shapes = {flag: metric_state(flag, dim) for flag in (True, False)}
    for flag, (sums, rows, n_sums, n_rows) in shapes.items():
        print(f"  per_sample={flag}: {n_sums} sum states, {mib(sums).strip()}; {n_rows} row states, {rows} bytes "
              "per sample")
    print(f"{'N':>7} | {'state, per_sample=True':>22} {'False':>12} | {'sync, per_sample=True':>21} {'False':>12} | "
          "state ratio")
    share = (world - 1) / world
    for n in sizes:
        state = {flag: sums + n * rows for flag, (sums, rows, _, _) in shapes.items()}
        sync = {flag: 2 * sums * share + n * rows * share for flag, (sums, rows, _, _) in shapes.items()}
        print(f"{n:>7} | {mib(state[True]):>22} {mib(state[False]):>12} | {mib(sync[True]):>21} {mib(sync[False]):>12} | "
              f"{state[True] / state[False]:6.2f}")


if __name__ == "__main__":
    main()
