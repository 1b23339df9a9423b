"""``capeval bench`` with several metrics: one pass over the images, against a run per metric and an older checkout.

    .venv/bin/python benchmarks/bench_one_pass.py --data ../shared/benchdata/flickr8k_expert/flickr8k.json \\
        [--images 1000] [--rounds 2] [--pythonpath /path/to/older/checkout ...]

Flickr8k-Expert's texts (the file a user has; its photographs are not public here) with stand-in photographs:
each of its images is a distinct crop of the photos scikit-image and matplotlib ship
(:func:`capeval_plugins.testing.realistic.photo_crops`, 500 px on the longer side as Flickr8k's, JPEG), named as
the file names it. ``--images N`` keeps the file's first N images and their ratings. Three metrics on tiny random
checkpoints of their real architectures, built here: CLIPScore on a CLIP, PAC-S on a converted PAC-S CLIP, Polos
on its CLIP and RoBERTa. Measured as a user runs them, whole processes (``python -m capeval_plugins.cli bench``,
the score cache off, no bootstrap), CPU seconds of each process (its rusage from ``wait4``) and wall seconds,
configurations interleaved over ``--rounds``, best of the rounds:

* ``one pass``: ``capeval bench flickr8k-expert --metric clipscore --metric pacscore --metric polos`` (this tree);
* ``three runs``: the same command once per metric, the three processes summed;
* every ``--pythonpath`` tree's one command (e.g. a checkout from before the one pass, whose bench scored each
  metric in chunks with a new session each: every image decoded and preprocessed once per metric and chunk).

Each configuration's per-row scores (``--save-scores``) are compared with the one pass's: they must agree (the
same pixels and texts reach each model; batches are cut alike).
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

ROOT = Path(__file__).resolve().parent.parent
METRICS = ("clipscore", "pacscore", "polos")
CHECKPOINTS = {"clipscore": "clip", "pacscore": "pacs", "polos": "polos"}


def write_inputs(data: Path, images: int, folder: Path) -> tuple[Path, int, int]:
    """The first ``images`` images of the file and their ratings, and a stand-in photo per image."""
    from capeval_plugins.testing.realistic import photo_crops

    entries = json.loads(data.read_text())
    kept = dict(list(entries.items())[:images])
    subset = folder / "flickr8k.json"
    subset.write_text(json.dumps(kept))
    (folder / "images").mkdir()
    names = sorted({Path(j["image_path"]).name for entry in kept.values() for j in entry["human_judgement"]})
    for name, crop in zip(names, photo_crops(len(names), seed=0, long_side=500)):
        crop.save(folder / "images" / name, quality=90)
    ratings = sum(len(entry["human_judgement"]) for entry in kept.values())
    return subset, len(names), ratings


def build_models(folder: Path) -> dict[str, str]:
    from capeval_plugins.testing import tiny_checkpoint

    return {metric: str(tiny_checkpoint(kind, root=folder)) for metric, kind in CHECKPOINTS.items()}


def bench_command(data: Path, folder: Path, metrics: tuple[str, ...], models: dict[str, str], out: Path) -> list[str]:
    command = [sys.executable, "-m", "capeval_plugins.cli", "bench", "flickr8k-expert", "--data", str(data),
               "--images", str(folder / "images"), "--no-cache", "--bootstrap", "0", "--quiet",
               "--save-scores", str(out)]
    for metric in metrics:
        command += ["--metric", metric, "--option", f"{metric}.model={models[metric]}"]
    return command


def measured(command: list[str], pythonpath: str, cwd: Path) -> tuple[float, float]:
    """CPU seconds (user + system, from wait4) and wall seconds of one process."""
    env = {**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    with tempfile.TemporaryFile() as err:
        began = time.perf_counter()
        child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=cwd)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - began
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise SystemExit(f"{' '.join(command)} failed:\n{err.read().decode()[-3000:]}")
    return usage.ru_utime + usage.ru_stime, wall


def scores_of(folder: Path) -> dict[str, list]:
    return {path.stem: [json.loads(line)["score"] for line in path.read_text().splitlines()]
            for path in sorted(folder.glob("*.jsonl"))}


def largest_difference(a: dict[str, list], b: dict[str, list]) -> float:
    worst = 0.0
    for metric, values in a.items():
        for x, y in zip(values, b[metric], strict=True):
            if (x is None) != (y is None):
                return float("inf")
            if x is not None:
                worst = max(worst, abs(x - y))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "benchdata" / "flickr8k_expert" /
                        "flickr8k.json", help="Flickr8k-Expert's flickr8k.json")
    parser.add_argument("--images", type=int, default=1000, help="keep the file's first N images (1000: all)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pythonpath", action="append", default=[],
                        help="another tree whose one command to measure too (repeatable)")
    args = parser.parse_args()
    if not args.data.is_file():
        raise SystemExit(f"no Flickr8k-Expert file at {args.data}: pass --data PATH")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data, n_images, n_ratings = write_inputs(args.data, args.images, tmp)
        models = build_models(tmp / "models")
        configs = {"one pass": [(str(ROOT), METRICS)], "three runs": [(str(ROOT), (m,)) for m in METRICS]}
        for tree in args.pythonpath:
            configs[f"one command, {tree}"] = [(tree, METRICS)]
        best: dict[str, tuple[float, float]] = {}
        saved: dict[str, dict[str, list]] = {}
        for _ in range(args.rounds):
            for name, runs in configs.items():
                cpu = wall = 0.0
                out = tmp / "scores" / name.replace(" ", "_").replace("/", "_").replace(",", "")
                for tree, metrics in runs:
                    c, w = measured(bench_command(data, tmp, metrics, models, out), tree, tmp)
                    cpu, wall = cpu + c, wall + w
                saved[name] = scores_of(out)
                old = best.get(name, (float("inf"), float("inf")))
                best[name] = (min(old[0], cpu), min(old[1], wall))
        print(f"capeval bench flickr8k-expert, {n_images} stand-in images (500 px JPEG), {n_ratings} ratings, "
              f"metrics {', '.join(METRICS)} on tiny random checkpoints; best of {args.rounds} interleaved rounds")
        base = best["one pass"][0]
        for name, (cpu, wall) in best.items():
            diff = largest_difference(saved["one pass"], saved[name])
            print(f"  {name:<40} {cpu:8.1f} CPU s {wall:8.1f} s wall   {cpu / base:5.2f}x the one pass's CPU   "
                  f"largest score difference {diff:.1e}")


if __name__ == "__main__":
    main()
