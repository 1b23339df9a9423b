"""CLIPScore as a user runs it, whole processes side by side: `capeval score` against a torchmetrics script.

    python benchmarks/clipscore_whole_run.py                          # 32 images x 5 captions and x 1, 3 rounds
    python benchmarks/clipscore_whole_run.py --captions-per-image 5 --rounds 5 --sides torchmetrics capeval
    python benchmarks/clipscore_whole_run.py --sides capeval capeval-bf16 capeval-int8   # the faster numerics

Inputs, written once into a temporary folder: ``--images`` JPEG photos (distinct crops of scikit-image's and
matplotlib's sample photographs, 500 px on the longer side like Flickr's) and a caption file of
``--captions-per-image`` captions per image with the image's 5 references (Flickr8k-Expert's captions of the first
images when $CAPEVAL_BENCHDATA/flickr8k_expert/flickr8k.json is there, else the package's synthetic caption
corpus), as a caption file with references usually comes. The model is the random full-size ViT-B/32 CLIP (the
CLIPScore paper's architecture, built here, about 500 MB) unless ``--model`` names one.

Sides, each one process per round (Python start-up, imports, the model load, reading and decoding the images,
scoring, writing the output):

  torchmetrics   a script as a torchmetrics user writes it: each image file decoded once, torchmetrics 1.9's
                 ``CLIPScore`` updated with ``--batch-size`` rows at a time (one image tensor per row), its
                 per-sample 100 cos recorded as it computes them (its model wrapped only to unwrap transformers
                 5's output objects)
  capeval        ``capeval score -m clipscore -o w=100 -o prefix= -o preprocessing=transformers`` (torchmetrics'
                 definition: 100 cos, no prompt, the checkpoint's processor) on the caption file, ``--out`` a JSON Lines file (a resumable run: its run folder,
                 checkpoints and fingerprint included)
  capeval-bf16, capeval-int8, capeval-compile
                 the same with ``--dtype bfloat16``, ``-o quantize=int8``, ``-o compile=true``

CPU seconds of each process and every descendant it waited for (``wait4``), its peak resident memory, and its wall
time; ``--rounds`` rounds, the sides' order alternating, after one untimed run of each (it writes Python's
bytecode caches, as any installed package has them). Printed: the median and min-max of each side, the ratio of
the medians and of the best rounds against the first side, and the largest difference of each side's 100 cos
from the first side's (captions over 77 tokens excluded: torchmetrics cuts them without their end-of-text token).
Torch threads are fixed for every side (``--threads``, default 1: CPU time is then the steadier figure on a shared
machine).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from common import ROOT, interleaved_processes, process_env, report_processes

sys.path.insert(0, str(ROOT))
BENCHDATA = Path(os.environ.get("CAPEVAL_BENCHDATA", ROOT.parent / "shared" / "benchdata"))
FLICKR = BENCHDATA / "flickr8k_expert" / "flickr8k.json"
CAPEVAL_SIDES = {"capeval": [], "capeval-bf16": ["--dtype", "bfloat16"], "capeval-int8": ["-o", "quantize=int8"],
                 "capeval-compile": ["-o", "compile=true"]}
SIDES = ("torchmetrics", *CAPEVAL_SIDES)

# A torchmetrics user's script: argv = model, caption file, image folder, batch size, output JSON.
TORCHMETRICS_SCRIPT = """
import json, sys
import numpy as np
import torch
import torchmetrics.multimodal.clip_score as module
from PIL import Image
from torchmetrics.multimodal.clip_score import CLIPScore
from transformers import CLIPModel, CLIPProcessor

from capeval_plugins.testing.peers import TensorFeatures

model, captions, folder, batch_size, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
rows = [json.loads(line) for line in open(captions, encoding="utf-8")]
metric = CLIPScore(model_name_or_path=lambda: (TensorFeatures(CLIPModel.from_pretrained(model).eval()),
                                               CLIPProcessor.from_pretrained(model)))
seen, update = [], module._clip_score_update


def recorded(*args, **kwargs):  # its per-sample 100 cos (CLIPScore keeps only their sum)
    score, n = update(*args, **kwargs)
    seen.append(score.detach().double())
    return score, n


module._clip_score_update = recorded
decoded = {}


def image(name):
    if name not in decoded:
        with Image.open(f"{folder}/{name}") as img:
            decoded[name] = torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).contiguous()
    return decoded[name]


for start in range(0, len(rows), batch_size):
    part = rows[start:start + batch_size]
    metric.update([image(r["image"]) for r in part], [r["caption"] for r in part])
json.dump({"score": float(metric.compute()), "cos100": torch.cat(seen).tolist()}, open(out, "w"))
"""


def write_inputs(folder: Path, n_images: int, per_image: int) -> tuple[Path, list[str]]:
    """The photos and the caption file (with references); returns the caption file and the captions."""
    from capeval_plugins.testing.realistic import flickr8k_expert_pairs, photo_crops

    if FLICKR.is_file():
        pairs = flickr8k_expert_pairs(FLICKR, n_images)
        own: dict[int, tuple[list[str], list[str]]] = {}
        for k, caption, refs in zip(pairs.image, pairs.candidates, pairs.references):
            own.setdefault(k, ([], refs))[0].append(caption)
        captions = {k: list(dict.fromkeys(c + r))[:per_image] for k, (c, r) in own.items()}
        references = {k: r for k, (_, r) in own.items()}
    else:
        from capeval_plugins.testing import caption_corpus

        corpus = list(dict.fromkeys(caption_corpus()))
        take = lambda k, n, at: [corpus[(k * 11 + at + j) % len(corpus)] for j in range(n)]  # noqa: E731
        captions = {k: take(k, per_image, 0) for k in range(n_images)}
        references = {k: take(k, 5, per_image) for k in range(n_images)}
    lines = []
    for k, crop in enumerate(photo_crops(n_images)):
        name = f"photo_{k:04d}.jpg"
        crop.save(folder / name, quality=95)
        lines += [json.dumps({"image": name, "caption": c, "references": references[k]}) for c in captions[k]]
    path = folder / f"captions_{per_image}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, [json.loads(line)["caption"] for line in lines]


def command(side: str, args, model: str, captions: Path, folder: Path, out: Path) -> list[str]:
    if side == "torchmetrics":
        return [sys.executable, str(folder / "torchmetrics_clipscore.py"), model, str(captions), str(folder),
                str(args.batch_size), str(out)]
    return [sys.executable, "-m", "capeval_plugins.cli", "score", "-m", "clipscore", "-o", "w=100", "-o", "prefix=",
            "-o", "preprocessing=transformers", "--model", model, "--captions", str(captions), "--images", str(folder), "--batch-size",
            str(args.batch_size), "--out", str(out), "--quiet", *CAPEVAL_SIDES[side]]


def cos100(side: str, out: Path):
    import numpy as np

    if side == "torchmetrics":
        return np.array(json.loads(out.read_text())["cos100"])
    return np.array([100 * json.loads(line)["clipscore.cosine"] for line in out.read_text().splitlines()])


def measure(args, model: str, folder: Path, per_image: int, env: dict[str, str]) -> None:
    import numpy as np

    captions, texts = write_inputs(folder, args.images, per_image)
    outs = {side: folder / f"{side}_{per_image}.out" for side in args.sides}
    commands = {side: (lambda side=side: command(side, args, model, captions, folder, outs[side]))
                for side in args.sides}
    times = interleaved_processes(commands, env, args.rounds, before=lambda side: outs[side].unlink(missing_ok=True))
    first = args.sides[0]
    print(f"\n{args.images} images x {per_image} captions = {len(texts)} rows (5 references each in the file), "
          f"batch {args.batch_size}, threads {args.threads}, {args.rounds} rounds, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    values = {side: cos100(side, outs[side]) for side in args.sides}
    long = long_captions(model, texts)
    notes = {side: f"max |100 cos - {first}'s| {np.abs(values[side] - values[first])[~long].max():.1e}"
             for side in args.sides[1:]}
    report_processes(times, notes)
    if long.any():
        print(f"  ({int(long.sum())} captions over 77 tokens left out of the comparison)")


def long_captions(model: str, texts: list[str]):
    import numpy as np
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return np.array([len(ids) > 77 for ids in tokenizer(texts)["input_ids"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="CLIP checkpoint (default: a random full-size ViT-B/32 built here)")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--captions-per-image", type=int, nargs="+", default=[5, 1])
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=["torchmetrics", "capeval"],
                        help="processes to compare, the first being the baseline of the ratios")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every side (OMP_NUM_THREADS)")
    args = parser.parse_args()
    env = process_env(args.threads)
    with tempfile.TemporaryDirectory(prefix="capeval-clipscore-run-") as tmp:
        folder = Path(tmp)
        (folder / "torchmetrics_clipscore.py").write_text(TORCHMETRICS_SCRIPT)
        model = args.model
        if model is None:
            from capeval_plugins.testing import build_tiny

            model = str(build_tiny("clip_vit_b32", folder / "clip_vit_b32"))
        print(f"model {model}; {os.cpu_count()} cores")
        for per_image in args.captions_per_image:
            measure(args, model, folder, per_image, env)


if __name__ == "__main__":
    main()
