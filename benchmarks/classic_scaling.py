"""The classic metrics' cost per row as the corpus grows: CPU seconds and peak memory of whole `capeval score` runs
from 1,000 to 200,000 rows (issue 55 item 3, issue 49 item 6).

Each size is a captions file scored by a process of its own, `capeval score -m ... --captions F --out O` (Python
start-up, imports, reading, the run, the PTB tokenizer's JVM, writing the scores); its CPU time is the kernel's
for the process and every descendant it waited for, its peak the largest resident set of any of them
(``wait4``). Sizes run interleaved over rounds (the order alternates); the best CPU and peak of the rounds are
kept. Printed per size: CPU s, CPU ms per row, the marginal CPU per row since the previous size, peak RSS MB and
the marginal memory per row (KB).

Two corpora, both built from Flickr8k-Expert's texts (``flickr8k.json`` under $CAPEVAL_BENCHDATA, default
../shared/benchdata):

* ``distinct`` (default): every row its own image with five references of its own and its own candidate: each
  text is one of the file's captions with the row's (or image's) number as a last word, so nothing repeats and
  the vocabulary grows with the rows, as in COCO-style corpora (the costly case: no row or text is merged);
* ``tiled``: Flickr8k-Expert's 16,992 rows (one per expert rating) repeated to the size, as a benchmark's rows
  repeat (at most 5,664 distinct rows).

    CAPEVAL_BENCHDATA=../shared/benchdata python benchmarks/classic_scaling.py
    CAPEVAL_BENCHDATA=../shared/benchdata python benchmarks/classic_scaling.py --corpus tiled --rows 16992 50000
    CAPEVAL_BENCHDATA=../shared/benchdata python benchmarks/classic_scaling.py -m bleu4 -m meteor -m rouge_l -m cider --rows 1000 10000

Python's bytecode is written and used as an installed package's is (PYTHONDONTWRITEBYTECODE is removed from the
children's environment: without bytecode every process compiles torch again, seconds of CPU that are no cost of
the metrics).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHDATA = Path(os.environ.get("CAPEVAL_BENCHDATA", ROOT.parent / "shared" / "benchdata"))
FLICKR = BENCHDATA / "flickr8k_expert" / "flickr8k.json"
DEFAULT_ROWS = (1_000, 10_000, 50_000, 100_000, 200_000)
DEFAULT_METRICS = ("bleu4", "rouge_l", "cider")


def flickr() -> tuple[list[tuple[str, list[str]]], list[str]]:
    """Flickr8k-Expert's rows (caption, references), one per expert rating, and every distinct text."""
    if not FLICKR.is_file():
        sys.exit(f"no Flickr8k-Expert at {FLICKR} (set CAPEVAL_BENCHDATA)")
    records = list(json.loads(FLICKR.read_text(encoding="utf-8")).values())
    rows = [(j["caption"], list(r["ground_truth"])) for r in records for j in r["human_judgement"]]
    texts = sorted({c for c, _ in rows} | {t for _, refs in rows for t in refs})
    return rows, texts


def corpus(kind: str, n: int, rows: list, texts: list[str]) -> list[tuple[str, list[str]]]:
    if kind == "tiled":
        return [rows[i % len(rows)] for i in range(n)]
    # distinct: row i is image i, five references and a candidate of its own (a text of the file, then the number)
    size = len(texts)
    return [(f"{texts[(i * 7919) % size]} {i}", [f"{texts[(i * 5 + j) * 104729 % size]} {i}" for j in range(5)])
            for i in range(n)]


def run(command: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(CPU s of the process and every descendant it waited for, wall s, peak RSS MB of the largest of them)."""
    start = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    error = child.stderr.read().decode(errors="replace")
    child.stderr.close()
    if status:
        sys.exit(f"{' '.join(command[:6])} ... failed ({status}): {error[-2000:]}")
    return usage.ru_utime + usage.ru_stime, wall, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS))
    parser.add_argument("--metric", "-m", action="append", help=f"default: {' '.join(DEFAULT_METRICS)}")
    parser.add_argument("--corpus", choices=("distinct", "tiled"), default="distinct")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    metrics = args.metric or list(DEFAULT_METRICS)
    rows, texts = flickr()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    sizes = sorted(args.rows)
    best: dict[int, list[float]] = {n: [float("inf"), float("inf"), float("inf")] for n in sizes}
    with tempfile.TemporaryDirectory(prefix="capeval-classic-scaling-") as folder:
        folder = Path(folder)
        env.setdefault("CAPEVAL_CACHE", str(folder / "cache"))  # METEOR's index: built once, by the warm-up
        files = {}
        for n in sizes:
            files[n] = folder / f"rows{n}.jsonl"
            files[n].write_text("".join(json.dumps({"caption": c, "references": r}) + "\n"
                                        for c, r in corpus(args.corpus, n, rows, texts)), encoding="utf-8")

        def command(n: int) -> list[str]:
            return [sys.executable, "-m", "capeval_plugins.cli", "score", *[a for m in metrics for a in ("-m", m)],
                    "--captions", str(files[n]), "--out", str(folder / f"scores{n}.jsonl"), "--quiet"]

        run(command(sizes[0]), env)  # warm-up: bytecode written, METEOR's index built
        print(f"{args.corpus} rows, {' '.join(metrics)}, {args.rounds} round(s); load average before: "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        for r in range(args.rounds):
            for n in (sizes if r % 2 == 0 else sizes[::-1]):
                (folder / f"scores{n}.jsonl").unlink(missing_ok=True)
                cpu, wall, peak = run(command(n), env)
                print(f"  round {r + 1}: {n:>7} rows  cpu {cpu:7.2f} s  wall {wall:7.2f} s  peak {peak:7.0f} MB",
                      flush=True)
                best[n] = [min(best[n][0], cpu), min(best[n][1], wall), min(best[n][2], peak)]
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("\n| rows | CPU s | CPU ms / row | marginal CPU ms / row | peak RSS MB | marginal KB / row |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    previous = None
    for n in sizes:
        cpu, _, peak = best[n]
        if previous is None:
            margin_cpu = margin_mem = "-"
        else:
            m, (c, _, p) = previous
            margin_cpu = f"{1000 * (cpu - c) / (n - m):.3f}"
            margin_mem = f"{1024 * (peak - p) / (n - m):.2f}"
        print(f"| {n:,} | {cpu:.2f} | {1000 * cpu / n:.3f} | {margin_cpu} | {peak:.0f} | {margin_mem} |")
        previous = (n, best[n])


if __name__ == "__main__":
    main()
