"""Memory of the text states of a corpus with one long caption: the classic metrics keep every caption and
reference for finalize (CIDEr's idf, METEOR's corpus EVAL), merged across batches and processes.

Two figures, in one process on the same rows (default: 16,992 rows of 10 words, as many as Flickr8k-Expert,
and one caption of 200,000 bytes, say a file mis-split into one field):

* the merged state: bytes and seconds of the zero-padded merge (every row padded to the longest, the naive
  layout a ragged tensor gives) against the packed one (``TEXT_STATE``: each row's bytes back to back), with
  the batches as the runner makes them (1024 rows, the classic metrics' batch size);
* the peak resident memory of ``capeval score -m bleu4 -m cider`` on that corpus and on the same corpus
  without the long caption, each in a child process (``ru_maxrss``).

    .venv/bin/python benchmarks/long_caption_memory.py
    .venv/bin/python benchmarks/long_caption_memory.py --rows 5000 --long-bytes 1000000
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from capeval_plugins.contract import TEXT_STATE, StateSpec, decode_texts, encode_texts
from capeval_plugins.testing import scratch_folder

WORDS = "a dog cat runs on the grass in the park red car man sits bench under tree two children play".split()


def corpus(rows: int, long_bytes: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(rows)]
    if long_bytes:
        words = []
        while sum(len(w) + 1 for w in words) < long_bytes:
            words.append(rng.choice(WORDS))
        texts[7] = " ".join(words)
    return texts


def merged(spec: StateSpec, texts: list[str], batch: int, packed: bool) -> tuple[float, int, object]:
    start = time.perf_counter()
    blocks = [encode_texts(texts[i:i + batch], packed=packed) for i in range(0, len(texts), batch)]
    state = spec.cat(blocks)
    seconds = time.perf_counter() - start
    size = state.data.numel() + 8 * state.lengths.numel() if hasattr(state, "lengths") else state.numel()
    return seconds, size, state


def peak_rss_kb(captions: Path) -> int:
    out = captions.with_suffix(".scores.jsonl")
    command = [sys.executable, "-m", "capeval_plugins.cli", "score", "-m", "bleu4", "-m", "cider", "-o",
               "tokenize=false", "--captions", str(captions), "--out", str(out), "--quiet"]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"capeval score failed on {captions}")
    return usage.ru_maxrss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16_992)
    parser.add_argument("--long-bytes", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--no-cli", action="store_true", help="only the in-process merge")
    args = parser.parse_args()
    torch.set_num_threads(1)

    report: dict = {"rows": args.rows}
    if not args.no_cli:  # first: a child's peak RSS counts what this process holds when it forks
        folder = scratch_folder("capeval-long-caption-")
        for name, long_bytes in (("without", 0), ("with", args.long_bytes)):
            path = folder / f"{name}.jsonl"
            refs = corpus(args.rows, 0, seed=1)
            path.write_text("".join(json.dumps({"caption": c, "references": [r]}) + "\n"
                                    for c, r in zip(corpus(args.rows, long_bytes), refs)))
            report[f"capeval_score_peak_rss_mb_{name}_long_caption"] = round(peak_rss_kb(path) / 1024)

    texts = corpus(args.rows, args.long_bytes)
    padded_s, padded_bytes, padded = merged(StateSpec("cat", torch.uint8, (-1,)), texts, args.batch, False)
    packed_s, packed_bytes, packed = merged(TEXT_STATE, texts, args.batch, True)
    assert decode_texts(packed) == decode_texts(padded) == texts
    report.update({"long_bytes": len(texts[7].encode()), "total_text_bytes": sum(len(t.encode()) for t in texts),
                   "merge_padded": {"bytes": padded_bytes, "seconds": round(padded_s, 3)},
                   "merge_packed": {"bytes": packed_bytes, "seconds": round(packed_s, 3)},
                   "memory_ratio": round(padded_bytes / packed_bytes, 1), "time_ratio": round(padded_s / packed_s, 1)})
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
