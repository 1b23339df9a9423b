"""METEOR's paraphrase index built once per machine: the build of a git revision (main by default) against the
working tree's, in one process, interleaved, on pycocoevalcap's real table (issue 55, item 3).

    python benchmarks/meteor_index_build.py                 # 3 rounds, the old build from `git show main:...`
    python benchmarks/meteor_index_build.py --old-ref HEAD~2 --rounds 5
    CAPEVAL_BENCHDATA=../shared/benchdata python benchmarks/meteor_index_build.py --whole-run 0   # all rows

``--whole-run ROWS`` measures instead what a machine's first run costs where users stand: ``capeval score`` with
BLEU-4, METEOR, ROUGE-L and CIDEr-D on the first ROWS rows of Flickr8k-Expert (0: all 16,992), whole processes
with their JVMs (CPU of the process tree, from the kernel), interleaved: the old revision's code (``git archive``
into a temporary folder) and the working tree's, each with a new, empty cache (the run builds the index), and the
working tree's with the index built beforehand (the steady state).

Each round builds the index of ``paraphrase-en.gz`` into a new, empty cache (``CAPEVAL_CACHE``) with each
module's ``index_for``: reading the .gz and its digest, gunzip, the arrays, the files written and synced through
capeval's file layer, the metadata signed, the index read back and every file's digest verified: the whole
one-time cost a machine's first METEOR run pays. The order alternates between rounds. Printed per round: CPU
seconds of this process (``time.process_time``: user and system), of which ``build_arrays`` alone (timed again
on the same decompressed table); then the medians, their ratio, and Python's traced peak memory of one whole
build each (``tracemalloc``, numpy's arrays included, in a pass of its own: tracing slows allocation).
Checked: both indexes' files are equal byte for byte (the format did not change) and select the same entries.

Before the rounds about 2 GB is allocated and touched once: on a virtual machine the first touch of memory the
guest has not used yet can cost several times the build's own work in system time, which would land on
whichever build runs first.
"""
from __future__ import annotations

import argparse
import gc
import gzip
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODULE = "capeval_plugins/resources/meteor_table.py"


def table_path() -> Path:
    spec = importlib.util.find_spec("pycocoevalcap")
    if spec is None:
        sys.exit("pycocoevalcap is not installed (its METEOR jar's table is the one measured)")
    return Path(list(spec.submodule_search_locations)[0]) / "meteor" / "data" / "paraphrase-en.gz"


def module_at(ref: str, folder: Path):
    """``meteor_table`` as it was at git revision ``ref``, imported under a name of its own."""
    source = subprocess.run(["git", "show", f"{ref}:{MODULE}"], cwd=ROOT, check=True, capture_output=True).stdout
    path = folder / "meteor_table_old.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("meteor_table_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def whole_build(module, table: Path, cache: Path):
    """``module.index_for(table)`` into the empty cache ``cache``: CPU seconds and the index."""
    os.environ["CAPEVAL_CACHE"] = str(cache)
    module._loaded.clear()
    gc.collect()
    start = time.process_time()
    index = module.index_for(table)
    seconds = time.process_time() - start
    assert index is not None, "the index was not built"
    return seconds, index


def arrays_only(module, data: bytes) -> float:
    gc.collect()
    start = time.process_time()
    module.build_arrays(data)
    return time.process_time() - start


def traced_peak(fn) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def index_files(cache: Path) -> dict[str, bytes]:
    root = cache / "meteor"
    return {str(p.relative_to(root).parts[-1]): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and p.parent != root and p.name != "meta.json"}


def whole_run(rows: int, rounds: int, old_ref: str) -> None:
    """Module docstring: ``capeval score``'s first run (the old revision's and the working tree's) and its
    steady state, interleaved."""
    import json
    import resource

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import peers

    cands, refs = peers.flickr_rows(None, False)
    if rows:
        cands, refs = cands[:rows], refs[:rows]
    with tempfile.TemporaryDirectory(prefix="meteor-first-run-") as folder:
        folder = Path(folder)
        old_tree = folder / "old"
        old_tree.mkdir()
        archive = subprocess.run(["git", "archive", old_ref], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive, check=True)
        captions = folder / "captions.jsonl"
        captions.write_text("".join(json.dumps({"caption": c, "references": r}) + "\n" for c, r in zip(cands, refs)),
                            encoding="utf-8")
        command = [sys.executable, "-m", "capeval_plugins.cli", "score", "--captions", str(captions),
                   "--out", str(folder / "scores.jsonl"), *[a for m in peers.COCO_METRICS for a in ("-m", m)]]
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},  # bytecode, as installed
               "CAPEVAL_QUIET": "1", "CAPEVAL_CACHE": str(folder / "built")}
        peers.run_process([sys.executable, "-c", peers.INDEX_SCRIPT], {**env, "PYTHONPATH": str(ROOT)})
        sides = {f"first run, old ({old_ref})": old_tree, "first run, new": ROOT, "steady state, new": ROOT}
        print(f"capeval score, {len(cands)} rows of Flickr8k-Expert, {', '.join(peers.COCO_METRICS)}; "
              f"load average {os.getloadavg()[0]:.1f}")
        cpu: dict[str, list[float]] = {side: [] for side in sides}
        for r in range(rounds):
            for k, side in enumerate(list(sides) if r % 2 == 0 else list(sides)[::-1]):
                cache = folder / ("built" if side.startswith("steady") else f"new-{r}-{k}")
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                # run from the tree itself: `python -m` puts the working folder first on sys.path
                subprocess.run(command, cwd=sides[side], env={**env, "CAPEVAL_CACHE": str(cache)}, check=True,
                               capture_output=True)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu[side].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            print(f"round {r + 1}: " + "; ".join(f"{side} {cpu[side][-1]:.2f}" for side in cpu)
                  + f" CPU-s; load average {os.getloadavg()[0]:.1f}")
        steady = cpu["steady state, new"]
        for side, values in cpu.items():
            extra = [a - b for a, b in zip(values, steady)]
            print(f"{side}: median {statistics.median(values):.2f} CPU-s"
                  + ("" if side.startswith("steady") else f", {statistics.median(extra):.2f} more than the steady "
                     f"state ({min(extra):.2f}-{max(extra):.2f} by round)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-ref", default="main", help="the git revision whose build is the baseline")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--whole-run", type=int, metavar="ROWS", default=None,
                        help="capeval score's first run against its steady state on ROWS rows (0: all; module docstring)")
    args = parser.parse_args()
    if args.whole_run is not None:
        whole_run(args.whole_run, args.rounds, args.old_ref)
        return
    os.environ["CAPEVAL_QUIET"] = "1"
    from capeval_plugins.resources import meteor_table as new

    table = table_path()
    if not table.is_file():
        sys.exit(f"no paraphrase table at {table} (install pycocoevalcap)")
    import numpy as np

    np.ones(2 << 30, dtype=np.uint8)  # touched once, then freed (module docstring)
    with tempfile.TemporaryDirectory(prefix="meteor-index-build-") as tmp:
        tmp = Path(tmp)
        old = module_at(args.old_ref, tmp)
        sides = {f"old ({args.old_ref})": old, "new (working tree)": new}
        data = gzip.decompress(table.read_bytes())
        print(f"table {table} ({table.stat().st_size / 1e6:.1f} MB, {len(data) / 1e6:.1f} MB decompressed); "
              f"load average {os.getloadavg()[0]:.1f}")
        whole = {name: [] for name in sides}
        arrays = {name: [] for name in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for name in order:
                cache = tmp / f"cache-{r}-{name.split()[0]}"
                seconds, index = whole_build(sides[name], table, cache)
                whole[name].append(seconds)
                arrays[name].append(arrays_only(sides[name], data))
                if r == 0:
                    files = index_files(cache)
                    if name == order[0]:
                        first_files, first_index = files, index
                    else:
                        assert files == first_files, "the two builds' index files differ"
                        grams = new.corpus_grams(["a dog runs on the grass", "two kids play football"], index.max_n)
                        assert np.array_equal(index.select(grams.hashes), first_index.select(grams.hashes))
            print(f"round {r + 1}: " + "; ".join(f"{name} {whole[name][-1]:.2f} CPU-s (build_arrays "
                                                 f"{arrays[name][-1]:.2f})" for name in sides)
                  + f"; load average {os.getloadavg()[0]:.1f}")
        print("index files equal byte for byte, same selection: yes")
        peaks = {}
        for name, module in sides.items():
            cache = tmp / f"cache-traced-{name.split()[0]}"
            peaks[name] = traced_peak(lambda: whole_build(module, table, cache))
        (old_name, new_name) = sides
        for name in sides:
            print(f"{name}: whole build median {statistics.median(whole[name]):.2f} CPU-s "
                  f"(range {min(whole[name]):.2f}-{max(whole[name]):.2f}), build_arrays median "
                  f"{statistics.median(arrays[name]):.2f}, traced peak {peaks[name]:.0f} MB")
        ratios = [o / n for o, n in zip(whole[old_name], whole[new_name])]
        print(f"new / old, whole build: {statistics.median(whole[new_name]) / statistics.median(whole[old_name]):.1%} "
              f"of the CPU ({statistics.median(ratios):.2f}x faster, {min(ratios):.2f}-{max(ratios):.2f} by round); "
              f"build_arrays: {statistics.median(arrays[new_name]) / statistics.median(arrays[old_name]):.1%}; "
              f"peak {peaks[new_name] / peaks[old_name]:.1%}")


if __name__ == "__main__":
    main()
