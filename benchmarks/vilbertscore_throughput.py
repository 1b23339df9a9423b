"""ViLBERTScore throughput: the batched metric against a one-pair-at-a-time loop, in one run, per backbone.

Both score the same corpus (images with several candidates each, five references per candidate) with the same
random model. The loop encodes the image, the candidate and the reference afresh for every candidate-reference
pair and matches that pair alone, as a direct port of the official code would (the official script re-runs the
whole two-stream model for every caption against every image); its region features are loaded beforehand, the
metric's are read and checked from the feature folder inside its timing. A second baseline batches as the official
script does (``--batch-size`` samples per call, each with its own copy of the image: the candidates in one pass,
then each reference slot in one pass, regions re-embedded every pass, no reuse across the candidates of an
image). Prints pairs per second, the ratios and the largest score difference (they must agree).

- ``vilbert`` (the paper's backbone): a random ViLBERT on 100 regions of 2048-d features per image (fake feature
  files in the extraction script's layout); ``--full`` gives it the released bert_base_6layer_6conect shape
  (about 1 GB of weights), otherwise a smaller model (text width 256, 6 text, 3 visual and 3 co-attention layers)
  keeps the CPU run short. The metric embeds each image's regions once per batch and matches all pairs in one call.
- ``vilt``: a random ViLT (ViLT-B/32 image side, 6 layers of width 256); each image's patches are drawn once.

    python benchmarks/vilbertscore_throughput.py [--backbone vilbert|vilt|both] [--images 8] [--candidates 3]
        [--full] [--model PATH] [--device cuda]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import capeval_plugins
from capeval_plugins.models.encoders.conditioned import ConditionedEncoder
from capeval_plugins.core.matching import greedy_prf
from capeval_plugins.testing.corpus import caption_corpus
from capeval_plugins.testing.text_encoders import bert_tokenizer

SMALL_VILBERT = {"hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4, "intermediate_size": 1024,
                 "v_hidden_size": 256, "v_num_hidden_layers": 3, "v_num_attention_heads": 4,
                 "v_intermediate_size": 256, "bi_hidden_size": 256, "bi_num_attention_heads": 4,
                 "v_biattention_id": [0, 1, 2], "t_biattention_id": [3, 4, 5], "max_position_embeddings": 512}
FULL_VILBERT = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
                "v_hidden_size": 1024, "v_num_hidden_layers": 6, "v_num_attention_heads": 8,
                "v_intermediate_size": 1024, "bi_hidden_size": 1024, "bi_num_attention_heads": 8,
                "v_biattention_id": [0, 1, 2, 3, 4, 5], "t_biattention_id": [6, 7, 8, 9, 10, 11],
                "max_position_embeddings": 512}


def build_vilt(path: Path, hidden: int = 256, layers: int = 6, image_size: int = 224, patch: int = 32) -> str:
    from transformers import ViltConfig, ViltImageProcessor, ViltModel, ViltProcessor

    tokenizer = bert_tokenizer(model_max_length=40)
    config = ViltConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                        num_attention_heads=4, vocab_size=len(tokenizer), max_position_embeddings=40,
                        image_size=image_size, patch_size=patch, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    ViltModel(config).save_pretrained(path)
    ViltProcessor(image_processor=ViltImageProcessor(size={"shortest_edge": image_size}, size_divisor=patch),
                  tokenizer=tokenizer).save_pretrained(path)
    return str(path)


def build_vilbert(path: Path, full: bool) -> str:
    from capeval_plugins.testing.vilbert import tiny_vilbert

    tokenizer = bert_tokenizer()
    model, _ = tiny_vilbert(0, len(tokenizer), config=FULL_VILBERT if full else SMALL_VILBERT)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def corpus(n_images: int, per_image: int, n_refs: int = 5):
    """Image names, candidates and references, COCO-like: several candidates per image, 5 references each."""
    captions = caption_corpus()
    names, candidates, references = [], [], []
    for i in range(n_images):
        refs = [captions[(7 * i + j) % len(captions)] for j in range(n_refs)]
        for k in range(per_image):
            names.append(f"image{i:04d}.jpg")
            candidates.append(captions[(13 * i + 5 * k + 3) % len(captions)])
            references.append(refs)
    return names, candidates, references


def one_pair_at_a_time(enc: ConditionedEncoder, images, candidates, references) -> list[float]:
    scores = []
    one = torch.zeros(1, dtype=torch.long)
    for image, cand, refs in zip(images, candidates, references):
        f_values = []
        for ref in refs:
            context = enc.encode_images([image])
            c = enc.embed([cand], one, context, batch_size=1)
            r = enc.embed([ref], one, context, batch_size=1)
            _, _, f = greedy_prf(c.embeddings, c.attention_mask & ~c.special,
                                 r.embeddings, r.attention_mask & ~r.special)
            f_values.append(f.item())
        scores.append(sum(f_values) / len(f_values))
    return scores


def official_batching(enc: ConditionedEncoder, images, candidates, references, batch_size: int) -> list[float]:
    """The official script's structure: ``batch_size`` samples per call, each with its own copy of the image; the
    candidates in one pass, then each reference slot in one pass, each pass re-embedding the regions; P, R, F per
    reference slot, averaged. No reuse across the candidates of one image."""
    scores = []
    for start in range(0, len(candidates), batch_size):
        chunk = slice(start, start + batch_size)
        cands, refs = candidates[chunk], references[chunk]
        rows = torch.arange(len(cands))
        cand = enc.embed(cands, rows, enc.encode_images(images[chunk]), batch_size=batch_size)
        f_sum = torch.zeros(len(cands), dtype=torch.float64)
        for j in range(len(refs[0])):
            ref = enc.embed([r[j] for r in refs], rows, enc.encode_images(images[chunk]), batch_size=batch_size)
            f_sum += greedy_prf(cand.embeddings, cand.attention_mask & ~cand.special,
                                ref.embeddings, ref.attention_mask & ~ref.special)[2].cpu()
        scores += (f_sum / len(refs[0])).tolist()
    return scores


def compare(label: str, metric, metric_images, loop_images, candidates, references, batch_size: int) -> None:
    enc = metric.encoder
    metric(metric_images[:2], candidates[:2], references[:2])  # warm-up (first-call allocations)
    pairs = sum(len(r) for r in references)

    start = time.perf_counter()
    batched = metric(metric_images, candidates, references)
    t_batched = time.perf_counter() - start

    start = time.perf_counter()
    official = official_batching(enc, loop_images, candidates, references, batch_size)
    t_official = time.perf_counter() - start

    start = time.perf_counter()
    naive = one_pair_at_a_time(enc, loop_images, candidates, references)
    t_naive = time.perf_counter() - start

    diff = max(float(np.max(np.abs(np.array(x) - batched.scores.numpy()))) for x in (naive, official))
    print(f"[{label}] {len(candidates)} candidates ({len(set(map(str, metric_images)))} images), {pairs} "
          f"candidate-reference pairs, device {enc.device}, torch threads {torch.get_num_threads()}")
    for name, seconds in ((f"batched metric (batch_size={batch_size})", t_batched),
                          ("official script's batching", t_official), ("one pair at a time", t_naive)):
        ratio = "" if seconds is t_batched else f"  (metric {seconds / t_batched:.1f}x faster)"
        print(f"  {name + ':':<34}{seconds:8.2f} s  {pairs / seconds:8.2f} pairs/s{ratio}")
    print(f"  max |score difference|: {diff:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", choices=["vilbert", "vilt", "both"], default="both")
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--candidates", type=int, default=3, help="candidates per image")
    parser.add_argument("--regions", type=int, default=100, help="ViLBERT: detector regions per image")
    parser.add_argument("--full", action="store_true", help="ViLBERT: the released bert_base_6layer_6conect size")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model", default=None, help="a checkpoint of the (single) chosen backbone")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model and args.backbone == "both":
        parser.error("--model needs --backbone vilbert or vilt")

    names, candidates, references = corpus(args.images, args.candidates)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.backbone in ("vilbert", "both"):
            from capeval_plugins.testing.vilbert import write_region_features

            model = args.model or build_vilbert(tmp / "vilbert", args.full)
            features = tmp / "features"
            write_region_features(features, sorted(set(names)), boxes=args.regions)
            metric = capeval_plugins.load("vilbertscore", model=model, features=str(features),
                                          batch_size=args.batch_size, device=args.device)
            reader = metric.image_reader()
            loaded = {n: reader.load(reader.source(n, 0)) for n in set(names)}
            compare("vilbert" + (" full" if args.full else ""), metric, names, [loaded[n] for n in names],
                    candidates, references, args.batch_size)
        if args.backbone in ("vilt", "both"):
            model = args.model or build_vilt(tmp / "vilt")
            rng = np.random.default_rng(0)
            pixels = {n: Image.fromarray(rng.integers(0, 256, size=(240, 320, 3), dtype=np.uint8))
                      for n in sorted(set(names))}
            images = [pixels[n] for n in names]
            metric = capeval_plugins.load("vilbertscore", model=model, batch_size=args.batch_size, device=args.device)
            compare("vilt", metric, images, images, candidates, references, args.batch_size)


if __name__ == "__main__":
    main()
