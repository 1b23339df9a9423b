"""Peak memory of scoring large photos at full size: N twelve-megapixel JPEGs (default 16, 4000x3000, one
caption each) scored with CLIPScore at the default batch size, on a CLIP whose processor is the paper model's
(shorter side to 224, centre crop 224) with small random weights, so that what grows is the images. Every
image reaches the processor as it was given (no reduction as it is read); the runner bounds memory by mapping
a batch whose decoded images exceed ``session.BATCH_IMAGE_BYTES`` in pieces of whole images.

Two figures:

* in one child process, the peak resident memory above the phase's start (sampled every 2 ms) of
  ``capeval_plugins.load("clipscore")(paths, captions)`` and of the naive script a user would write (decode
  every photo, the processor on all of them, one forward pass), and their ratio;
* the peak resident memory (``ru_maxrss``, from ``wait4``) of a whole ``capeval score`` run in a child
  process, per tree (``--pythonpath``, repeatable, to compare checkouts).

    .venv/bin/python benchmarks/image_memory.py
    .venv/bin/python benchmarks/image_memory.py --images 40 --pythonpath /path/to/older/checkout --pythonpath .
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
CAPTION = "a woman in a naval uniform"


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
        rows.append({"image": name, "caption": CAPTION})
    captions = folder / "captions.jsonl"
    captions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return captions


def build_model(path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from capeval_plugins.testing.clip import build_clip

    build_clip(path, seed=0, image_size=224, patch_size=32)


# ------------------------------------------------------------------------------ in one process (the child)

def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakAbove:
    """Peak resident memory above the level at entry, sampled every 2 ms by a thread."""

    def __enter__(self) -> "PeakAbove":
        self.start = self.peak = resident_bytes()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self) -> None:
        while not self.done.wait(0.002):
            self.peak = max(self.peak, resident_bytes())

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, resident_bytes())

    @property
    def gb(self) -> float:
        return (self.peak - self.start) / 1024**3


def naive_scores(model_path: str, paths: list[str]) -> np.ndarray:
    """The script a user writes: every photo decoded, the processor on all of them, one forward pass."""
    import torch
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(model_path).eval(), CLIPProcessor.from_pretrained(model_path)
    photos = [Image.open(p).convert("RGB") for p in paths]
    with torch.inference_mode():
        pixels = processor.image_processor(images=photos, return_tensors="pt")["pixel_values"]
        image = model.get_image_features(pixel_values=pixels)
        text = model.get_text_features(**processor.tokenizer([f"A photo depicts {CAPTION}"] * len(paths),
                                                             padding=True, return_tensors="pt"))
    image, text = (getattr(x, "pooler_output", x) for x in (image, text))
    cos = torch.nn.functional.cosine_similarity(image, text)
    return (2.5 * cos.clamp(min=0)).numpy()


def same_process(model_path: str, folder: str) -> None:
    import capeval_plugins

    paths = sorted(str(p) for p in Path(folder).glob("photo*.jpg"))
    metric = capeval_plugins.load("clipscore", model=model_path)
    metric([Image.new("RGB", (8, 8))], ["warm up"])  # the model loaded before either phase
    naive_scores(model_path, paths[:1])
    with PeakAbove() as ours:
        got = metric(paths, [CAPTION] * len(paths)).scores.numpy()
    with PeakAbove() as naive:
        want = naive_scores(model_path, paths)
    print(f"same process, {len(paths)} photos: peak above start: capeval {ours.gb:.2f} GB, naive script "
          f"{naive.gb:.2f} GB, ratio {ours.gb / naive.gb:.2f}; largest score difference "
          f"{np.abs(got - want).max():.1e}")


# ------------------------------------------------------------------------------ the parent

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
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--width", type=int, default=4000)
    parser.add_argument("--height", type=int, default=3000)
    parser.add_argument("--pythonpath", action="append", default=None,
                        help="the tree(s) whose `capeval score` to measure (default: this one); repeat to compare")
    parser.add_argument("--same-process", nargs=2, metavar=("MODEL", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.same_process:
        return same_process(*args.same_process)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        captions = make_photos(tmp, args.images, args.width, args.height)
        build_model(tmp / "clip224")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        subprocess.run([sys.executable, __file__, "--same-process", str(tmp / "clip224"), str(tmp)], env=env,
                       check=True)
        for tree in args.pythonpath or [str(ROOT)]:
            peak = peak_of(tree, tmp / "clip224", captions)
            print(f"capeval score, {tree}: {args.images} images of {args.width}x{args.height}: peak RSS {peak:.2f} GB")


if __name__ == "__main__":
    main()
