"""Peak memory of `capeval score` on large photos: the run's peak resident memory (ru_maxrss of the child) for
N twelve-megapixel JPEGs at the default batch size, scored with CLIPScore on a CLIP whose processor is the
paper model's (resize the shorter side to 224, centre crop 224; small random weights, so memory is the
images'). Run it once with this tree and once with another (``--pythonpath``) to compare.

    .venv/bin/python benchmarks/image_memory.py --images 40
    .venv/bin/python benchmarks/image_memory.py --images 40 --pythonpath /path/to/older/checkout
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent


def make_photos(folder: Path, n: int, width: int, height: int) -> Path:
    """``n`` distinct 12 MP JPEGs (Grace Hopper, shifted and with noise) and a caption file."""
    from matplotlib import cbook

    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as img:
        base = np.asarray(img.convert("RGB").resize((width, height), Image.BICUBIC)).astype(np.int16)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        pixels = np.roll(base, 37 * i, axis=1) + rng.integers(-8, 9, base.shape, dtype=np.int16)
        name = f"photo{i:03d}.jpg"
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / name, quality=90)
        rows.append({"image": name, "caption": "a woman in a naval uniform"})
    captions = folder / "captions.jsonl"
    captions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return captions


def build_model(path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from capeval_plugins.testing.clip import build_clip

    build_clip(path, seed=0, image_size=224, patch_size=32)


def peak_of(pythonpath: str, model: Path, captions: Path) -> float:
    """Peak resident memory (GB) of one `capeval score` run in a child process (its own rusage, from wait4)."""
    env = {**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryFile() as err:
        child = subprocess.Popen([sys.executable, "-m", "capeval_plugins.cli", "score", "-m", "clipscore", "--model",
                                  str(model), "--captions", str(captions), "--quiet"], env=env,
                                 stdout=subprocess.DEVNULL, stderr=err, cwd=captions.parent)  # cwd: not sys.path[0]
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            err.seek(0)
            raise SystemExit(err.read().decode()[-3000:])
    return usage.ru_maxrss / 1024**2  # kB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=40)
    parser.add_argument("--width", type=int, default=4000)
    parser.add_argument("--height", type=int, default=3000)
    parser.add_argument("--pythonpath", action="append", default=None,
                        help="the tree(s) to measure (default: this one); repeat to compare")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        captions = make_photos(tmp, args.images, args.width, args.height)
        build_model(tmp / "clip224")
        for tree in args.pythonpath or [str(ROOT)]:
            peak = peak_of(tree, tmp / "clip224", captions)
            print(f"{tree}: {args.images} images of {args.width}x{args.height}: peak RSS {peak:.2f} GB")


if __name__ == "__main__":
    main()
