"""The cost of a first `capeval reproduce` pass on the benchmark files present here, against one `capeval bench`
process per (metric, benchmark) pair (how a per-pair toolkit runs them: a process, a model load and a data read
per pair), and of a second pass (every score from the cache).

    CAPEVAL_BENCHDATA=../shared/benchdata python benchmarks/reproduce_first_pass.py

Every side is a whole process (Python start-up, imports, reading the files, the JVMs of the classic metrics),
downloads off (the pairs that need weights, images or a GPU are planned and reported "not runnable here"); CPU
time is the kernel's for the process and every descendant it waited for. The first pass gets a new, empty score
cache; the per-pair processes run without one (`--no-cache`), so they compute everything too. Every figure of
the per-pair runs is compared with the reproduce pass's.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = {"flickr8k-expert": "flickr8k_expert/flickr8k.json", "nebula": "nebula/nebula_test.json",
         "pascal50s": "pascal50s/pascal_50s.json", "vatex-eval": "vatex_eval/vid_cans_score_dict.json",
         "activitynet-fact": "factvc/activitynet", "youcook2-fact": "factvc/youcook2", "thumb": "thumb",
         "sugarcrepe": "sugarcrepe"}


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """Wall and CPU seconds (the process and its waited-for descendants) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchdata", default=os.environ.get("CAPEVAL_BENCHDATA", str(ROOT.parent / "shared" /
                                                                                       "benchdata")))
    args = parser.parse_args()
    data = [f"{b}={Path(args.benchdata) / f}" for b, f in FILES.items() if (Path(args.benchdata) / f).exists()]
    if not data:
        sys.exit(f"no benchmark file under {args.benchdata}")
    capeval = [sys.executable, "-m", "capeval_plugins.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        cache, out = Path(tmp) / "scores.sqlite", Path(tmp) / "reproduce.json"
        command = [*capeval, "reproduce", "--quiet", "--cache", str(cache), "--json", str(out),
                   *[a for d in data for a in ("--data", d)]]
        first = timed(command, env)
        report = json.loads(out.read_text())
        second = timed(command, env)
        ran = [r for r in report["rows"] if r["measured"] is not None]
        pairs = sorted({(r["metric"], r["benchmark"]) for r in ran})
        local = dict(d.split("=", 1) for d in data)
        per_pair_wall = per_pair_cpu = 0.0
        worst = 0.0
        for metric, bench in pairs:
            json_out = Path(tmp) / f"{metric}-{bench}.json"
            wall, cpu, _ = timed([*capeval, "bench", bench, "--data", local[bench], "--metric", metric,
                                  "--bootstrap", "0", "--no-cache", "--quiet", "--json", str(json_out)], env)
            per_pair_wall, per_pair_cpu = per_pair_wall + wall, per_pair_cpu + cpu
            result = json.loads(json_out.read_text())["results"][metric]
            stats = {**result, **{f"category:{c}": v["accuracy"] for c, v in result.get("categories", {}).items()
                                  if isinstance(v, dict) and "accuracy" in v}}
            for row in ran:
                if (row["metric"], row["benchmark"]) == (metric, bench) and row["statistic"] in stats:
                    worst = max(worst, abs(stats[row["statistic"]] - row["measured"]))
    print(f"benchmarks: {', '.join(d.split('=')[0] for d in data)}")
    print(f"pairs run: {len(pairs)} ({len(ran)} published figures); summary: {report['summary']}")
    for setting, run in report["runs"].items():
        print(f"  {setting}: {run['rows']} rows, {run['seconds']:.1f} s, {', '.join(run['metrics'])}")
    print(f"{'':34s} {'wall s':>8s} {'CPU s':>8s}")
    print(f"{'capeval reproduce, first pass':34s} {first[0]:8.1f} {first[1]:8.1f}")
    print(f"{'capeval reproduce, second pass':34s} {second[0]:8.1f} {second[1]:8.1f}")
    print(f"{'one capeval bench per pair':34s} {per_pair_wall:8.1f} {per_pair_cpu:8.1f}")
    print(f"ratio per-pair / first pass: wall {per_pair_wall / first[0]:.2f}, CPU {per_pair_cpu / first[1]:.2f}")
    print(f"largest |difference| between the two: {worst:.2e} (reproduce's JSON keeps 4 decimals)")


if __name__ == "__main__":
    main()
