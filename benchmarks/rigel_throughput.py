"""Rigel: inference throughput of the batched one-pass scorer against a one-sample loop, and the time of a
phase-1 epoch with and without the hidden-state cache; same model and inputs, one process.

    python benchmarks/rigel_throughput.py [--model PATH_OR_ID] [--images 16] [--captions-per-image 4]

Inference (the paper's prompt, a random scoring head on the backbone's hidden size):

* ``loop``: for each sample, the chat template and processor, one forward pass of the model, the head on the
  last hidden state, the expectation over 1..5, as a direct script would;
* ``batched``: :class:`RigelModel` as the ``rigel`` metric calls it (left-padded chunks, each image and the
  prompt up to the caption run once per chunk for all of its captions, only the suffixes per sample).

Phase 1 epoch (the paper's batch of 64 and optimiser):

* ``no cache``: every batch of the epoch runs the frozen backbone on its samples, then one head step;
* ``cache``: the backbone ran once before training (its one-off cost is printed), the epoch reads hidden
  states from the cache.

Default model: the tiny random LLaVA-NeXT of the tests (``--image-size`` larger than 32 builds one with more
image tokens per prompt).
"""
from __future__ import annotations

import argparse
import time

import torch

from capeval_plugins.core import heads
from capeval_plugins.models.lvlm import JudgeSpec, LVLMJudge
from capeval_plugins.inputs import iter_batches, to_batch
from capeval_plugins.training.data import from_lists
from capeval_plugins.training.features import extract_features
from capeval_plugins.models.rigel import RigelModel, RigelSettings, hidden_size_of
from capeval_plugins.training.phase1 import Phase1Config, new_head
from capeval_plugins.training.state import chunks, epoch_order
from capeval_plugins.training.synthetic import synthetic_judgments
from common import random_llava_next, timed



def one_sample_loop(model: RigelModel, visuals, index, candidates) -> torch.Tensor:
    """Processor, forward pass and head one sample at a time."""
    judge = model.judge
    prompts = model.instructions(visuals, index, candidates)
    scores = []
    for g, prompt in zip(index, prompts):
        chat = judge.chat(prompt)
        enc = judge.processor(text=[chat], images=[visuals[g]], return_tensors="pt").to(judge.device)
        with judge._capture_hidden() as seen:
            judge.model(**enc, logits_to_keep=1)
        probs = torch.softmax(model.head(seen[-1]).double(), -1)
        scores.append(heads.label_expectation(probs).cpu())
    return torch.cat(scores)


def batched(model: RigelModel, data, batch_size: int) -> torch.Tensor:
    out = torch.empty(len(data), dtype=torch.float64)
    for batch in iter_batches(data.samples, batch_size):
        probs = model.probabilities(batch.images, batch.image_index, batch.candidates, batch_size=batch_size)
        out[batch.indices] = heads.label_expectation(probs)
    return out


def epoch_without_cache(model: RigelModel, data, head, opt, config: Phase1Config, batch_size: int) -> None:
    for rows in chunks(epoch_order(len(data), config.seed, 0), config.batch_size):
        batch = to_batch(data.samples.subset(rows))
        with torch.inference_mode():
            out = model.states(batch.images, batch.image_index, batch.candidates, batch_size=batch_size)
        hidden, teacher = out.hidden.clone().float().cpu(), out.label_logprobs.clone().float().cpu()
        step(head, opt, hidden, teacher)


def epoch_with_cache(features, head, opt, config: Phase1Config) -> None:
    for rows in chunks(epoch_order(len(features), config.seed, 0), config.batch_size):
        step(head, opt, features.hidden[rows], features.teacher[rows])


def step(head, opt, hidden, teacher) -> None:
    loss = heads.distillation_loss(head(hidden), teacher, 1.0).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="LVLM checkpoint (default: a random LLaVA-NeXT built here)")
    parser.add_argument("--image-size", type=int, default=32, help="tile size of the random LLaVA-NeXT (32 = tiny)")
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--captions-per-image", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per backbone chunk")
    parser.add_argument("--train-samples", type=int, default=256, help="phase-1 epoch size")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model_path = args.model or random_llava_next(args.image_size)
    judge = LVLMJudge.shared(JudgeSpec(model_path, device=args.device, dtype=args.dtype))
    settings = RigelSettings(base_model=model_path, hidden_size=hidden_size_of(judge))
    head = new_head(settings, 0).to(judge.device)
    model = RigelModel(judge, head, settings)

    # inference: the same (image, caption) pairs both ways
    n = args.images * args.captions_per_image
    captions = synthetic_judgments(n, seed=0).samples.candidates
    uniq = [src.load() for src in synthetic_judgments(2 * args.images, seed=1).samples.images[::2]]
    index = [i // args.captions_per_image for i in range(n)]
    data = from_lists([uniq[g] for g in index], captions, [0.5] * n)
    batched(model, data, args.batch_size)  # warm up
    with torch.inference_mode():
        t_batch, fast = timed(lambda: batched(model, data, args.batch_size), args.repeats)
        t_loop, slow = timed(lambda: one_sample_loop(model, uniq, index, data.samples.candidates), args.repeats)
    enc = judge.processor(text=[judge.chat(model.instructions(uniq, index[:1], data.samples.candidates[:1])[0])],
                          images=[uniq[0]], return_tensors="pt")
    print(f"model={model_path} device={judge.device} dtype={next(judge.model.parameters()).dtype} "
          f"threads={torch.get_num_threads()}")
    print(f"inference: samples={n} images={len(uniq)} captions/image={args.captions_per_image} "
          f"batch_size={args.batch_size} prompt tokens={enc['input_ids'].shape[1]}; best of {args.repeats}")
    print(f"  one-sample loop: {t_loop * 1e3 / n:8.2f} ms/sample ({n / t_loop:8.1f} samples/s)")
    print(f"  batched:         {t_batch * 1e3 / n:8.2f} ms/sample ({n / t_batch:8.1f} samples/s)  "
          f"{t_loop / t_batch:5.1f}x the loop")
    print(f"  agreement: max |expected label batched - loop| = {(fast - slow).abs().max().item():.2e}")

    # phase 1: one epoch with and without the hidden-state cache
    config = Phase1Config()
    train = synthetic_judgments(args.train_samples, seed=1)
    start = time.perf_counter()
    features = extract_features(model, train, None, batch_size=args.batch_size, progress=False)
    t_extract = time.perf_counter() - start

    def run(with_cache: bool) -> None:
        fresh = new_head(settings, 0).to(judge.device)
        opt = torch.optim.Adam(fresh.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
        if with_cache:
            epoch_with_cache(features, fresh, opt, config)
        else:
            epoch_without_cache(model, train, fresh, opt, config, args.batch_size)

    t_cached, _ = timed(lambda: run(True), args.repeats)
    t_uncached, _ = timed(lambda: run(False), args.repeats)
    print(f"phase 1 epoch: samples={len(train)} batch={config.batch_size} head={settings.head_hidden}; "
          f"best of {args.repeats}")
    print(f"  no cache (backbone every batch): {t_uncached:8.3f} s/epoch")
    print(f"  cache:                           {t_cached:8.3f} s/epoch  {t_uncached / t_cached:7.1f}x faster")
    print(f"  one-off extraction into the cache: {t_extract:.3f} s "
          f"(pays for itself after {t_extract / max(t_uncached - t_cached, 1e-12):.2f} epochs)")


if __name__ == "__main__":
    main()
