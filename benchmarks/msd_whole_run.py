"""Soft-MSD on COCO-CF-style pairs as a user runs it, whole processes side by side: `capeval score` against the
official script's loop (SteinsGateSg/MSDScore, metrics/vMF_MSD_Score/coco_eval_cf.py, written out here).

    python benchmarks/msd_whole_run.py                       # 32 pairs, the random ViT-B/32, 3 rounds
    python benchmarks/msd_whole_run.py --pairs 64 --rounds 5 --model PATH

Inputs, written once into a temporary folder: ``--pairs`` JPEG photos (distinct crops of the sample photographs,
500 px on the longer side), each with a faithful caption and a counterfactual one (Flickr8k-Expert's captions of
that image and of the next one when $CAPEVAL_BENCHDATA/flickr8k_expert/flickr8k.json is there, else the package's
synthetic corpus): the script's JSON (``[{"image_path", "caption", "negative_caption"}]``) and the same pairs as a
caption file (two rows a pair, ``group`` = the pair's index). The model is the random full-size ViT-B/32 CLIP (49
patches; the paper's ViT-L/14 has 256, where the EM weighs more) unless ``--model`` names one.

Sides, each one process per round:

  official         the script's loop: per pair, the image's features and its mixture (torch.randperm seeded
                   42 + 7 i), each caption's features and mixture (42 + 3 i + 123), its EM (no re-initialisation),
                   the bi-KL and the pair's Soft-MSD, float32, one pair at a time (its model under no_grad, as
                   there)
  capeval          ``capeval score -m soft_msd -o preset=coco-cf`` (the script's components, EM, draws and seed;
                   batches of 64 rows), ``--out`` a JSON Lines file
  capeval-pair     the same with ``--batch-size 2``: one pair a batch, as the script goes

CPU seconds of each process and every descendant it waited for (``wait4``), peak resident memory and wall time,
``--rounds`` rounds with the sides' order alternating, after one untimed run of each; then the largest
difference of each side's per-sample bi-KL and Soft-MSD from the official loop's (float32 rounding and the
script's +1e-6 in every norm: about 1e-6 relative). Torch threads are fixed (``--threads``, default 1).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
from pathlib import Path

from common import ROOT, interleaved_processes, process_env, report_processes

sys.path.insert(0, str(ROOT))
from capeval_plugins.testing import official_msd  # noqa: E402

BENCHDATA = Path(os.environ.get("CAPEVAL_BENCHDATA", ROOT.parent / "shared" / "benchdata"))
FLICKR = BENCHDATA / "flickr8k_expert" / "flickr8k.json"

# coco_eval_cf.py's loop, from what it computes (argv: model, data json, image folder, output json); its EM is the
# reference port the tests use (capeval_plugins/testing/official_msd.py), pasted in so that this side imports only
# torch and transformers, as the official code does.
OFFICIAL_EM = "\n\n".join(inspect.getsource(f) for f in (official_msd.official_unit, official_msd.official_fit,
                                                          official_msd.official_log_density))
OFFICIAL_SCRIPT = """
import json, sys
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import CLIPModel, CLIPProcessor

K_IMG, K_TXT, KAPPA, ITERATIONS, ALPHA, TAU, L0, TAU_L, SEED = 3, 2, 20.0, 20, 0.1, 0.2, 20.0, 3.0, 42


""" + OFFICIAL_EM + """
l2norm = official_unit


def pooled(out):
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class Mixture:
    def __init__(self, k, seed):
        self.k, self.seed = k, seed

    def fit(self, x):
        self.mixture = official_fit(x, self.k, self.seed, KAPPA, ITERATIONS)
        return self

    def score(self, x):
        return official_log_density(x, self.mixture, KAPPA)


@torch.no_grad()
def image_features(image):
    pixels = processor(images=image, return_tensors="pt").pixel_values
    patches = l2norm(model.visual_projection(model.vision_model(pixels).last_hidden_state[:, 1:])[0])
    return patches, l2norm(pooled(model.get_image_features(pixel_values=pixels))[0])


@torch.no_grad()
def text_features(text):
    tokens = processor(text=text, return_tensors="pt", padding=True, truncation=True)
    hidden = model.text_projection(model.text_model(**tokens).last_hidden_state)
    length = int(tokens.attention_mask.sum())
    tok = hidden[:, 1:length - 1] if length > 2 else hidden[:, :length]
    return l2norm(tok[0]), l2norm(pooled(model.get_text_features(**tokens))[0])


@torch.no_grad()
def bi_kl(patches, tok, image_mixture, seed):
    text_mixture = Mixture(K_TXT, seed + 123).fit(tok)
    kl_it = (image_mixture.score(patches) - text_mixture.score(patches)).mean()
    kl_ti = (text_mixture.score(tok) - image_mixture.score(tok)).mean()
    beta = 1.0 / (1.0 + np.exp((len(tok) - L0) / TAU_L))
    return float(beta * kl_it + (1.0 - beta) * kl_ti)


model_path, data_path, folder, out_path = sys.argv[1:5]
model = CLIPModel.from_pretrained(model_path).eval()
processor = CLIPProcessor.from_pretrained(model_path)
rows = {"bi_kl": [], "soft": []}
for i, item in enumerate(json.load(open(data_path))):
    image = Image.open(f"{folder}/{item['image_path']}").convert("RGB")
    patches, image_global = image_features(image)
    image_mixture = Mixture(K_IMG, SEED + i * 7).fit(patches)
    cos, div = [], []
    for caption in (item["caption"], item["negative_caption"]):
        tok, text_global = text_features(caption)
        cos.append(float(image_global @ text_global))
        div.append(bi_kl(patches, tok, image_mixture, SEED + i * 3))
    cos, div = torch.tensor(cos), torch.tensor(div)
    u = torch.clamp(2.0 * (1.0 - F.softmax(cos / TAU, dim=0).max()), 0.0, 1.0)
    rows["bi_kl"] += div.tolist()
    rows["soft"] += (cos - ALPHA * u * div).tolist()
json.dump(rows, open(out_path, "w"))
"""


def write_inputs(folder: Path, n_pairs: int) -> tuple[Path, Path]:
    """The photos, the script's JSON and the caption file of the same pairs."""
    from capeval_plugins.testing.realistic import flickr8k_expert_pairs, photo_crops

    if FLICKR.is_file():
        pairs = flickr8k_expert_pairs(FLICKR, n_pairs + 1)
        first: dict[int, str] = {}
        for k, caption in zip(pairs.image, pairs.candidates):
            first.setdefault(k, caption)
        captions = [first[k] for k in range(n_pairs + 1)]
    else:
        from capeval_plugins.testing import caption_corpus

        captions = list(dict.fromkeys(caption_corpus()))[:n_pairs + 1]
    items, lines = [], []
    for i, crop in enumerate(photo_crops(n_pairs)):
        name = f"photo_{i:04d}.jpg"
        crop.save(folder / name, quality=95)
        items.append({"image_path": name, "caption": captions[i], "negative_caption": captions[i + 1]})
        lines += [json.dumps({"image": name, "caption": c, "group": i}) for c in captions[i:i + 2]]
    script_data, caption_file = folder / "coco_cf.json", folder / "coco_cf.jsonl"
    script_data.write_text(json.dumps(items))
    caption_file.write_text("\n".join(lines) + "\n")
    return script_data, caption_file


def main() -> None:
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="CLIP checkpoint (default: a random full-size ViT-B/32 built here)")
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every side (OMP_NUM_THREADS)")
    args = parser.parse_args()
    env = process_env(args.threads)
    with tempfile.TemporaryDirectory(prefix="capeval-msd-run-") as tmp:
        folder = Path(tmp)
        (folder / "official.py").write_text(OFFICIAL_SCRIPT)
        model = args.model
        if model is None:
            from capeval_plugins.testing import build_tiny

            model = str(build_tiny("clip_vit_b32", folder / "clip_vit_b32"))
        script_data, caption_file = write_inputs(folder, args.pairs)
        outs = {side: folder / f"{side}.out" for side in ("official", "capeval", "capeval-pair")}

        def capeval(side: str, *extra: str) -> list[str]:
            return [sys.executable, "-m", "capeval_plugins.cli", "score", "-m", "soft_msd", "-o", "preset=coco-cf",
                    "--model", model, "--captions", str(caption_file), "--images", str(folder), "--out",
                    str(outs[side]), "--quiet", *extra]

        commands = {"official": lambda: [sys.executable, str(folder / "official.py"), model, str(script_data),
                                         str(folder), str(outs["official"])],
                    "capeval": lambda: capeval("capeval"),
                    "capeval-pair": lambda: capeval("capeval-pair", "--batch-size", "2")}
        times = interleaved_processes(commands, env, args.rounds, before=lambda s: outs[s].unlink(missing_ok=True))
        official = json.loads(outs["official"].read_text())
        notes = {}
        for side in ("capeval", "capeval-pair"):
            rows = [json.loads(line) for line in outs[side].read_text().splitlines()]
            bi_kl = np.abs(np.array([r["soft_msd.bi_kl"] for r in rows]) - official["bi_kl"]).max()
            soft = np.abs(np.array([r["soft_msd"] for r in rows]) - official["soft"]).max()
            notes[side] = f"max |bi-KL - official| {bi_kl:.1e}, |Soft-MSD - official| {soft:.1e}"
        print(f"model {model}; {args.pairs} pairs ({2 * args.pairs} captions), threads {args.threads}, {args.rounds} "
              f"rounds, {os.cpu_count()} cores, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
              f"bi-KL {min(official['bi_kl']):.2f}-{max(official['bi_kl']):.2f}")
        report_processes(times, notes)


if __name__ == "__main__":
    main()
