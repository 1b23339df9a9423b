"""Helpers the benchmark scripts share (run them as ``python benchmarks/<script>.py``)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable


def timed(fn: Callable[[], Any], repeats: int, device: str = "cpu",
          clock: Callable[[], float] = time.perf_counter) -> tuple[float, Any]:
    """Best time of ``repeats`` calls (seconds; wall time, or ``time.process_time`` for the CPU time of this process,
    which other load on a shared machine disturbs less) and the last result; waits for CUDA work to finish."""
    import torch

    def sync() -> None:
        if str(device).startswith("cuda"):
            torch.cuda.synchronize()

    best, result = float("inf"), None
    for _ in range(repeats):
        sync()
        start = clock()
        result = fn()
        sync()
        best = min(best, clock() - start)
    return best, result


def random_llava_next(image_size: int = 32) -> str:
    """A random LLaVA-NeXT checkpoint: the tiny test one (32 px tiles) or one with larger tiles (longer
    prompts, more realistic sequence lengths)."""
    from capeval_plugins.testing import scratch_folder, tiny_checkpoint
    from capeval_plugins.testing.vision_language import build_llava_next

    if image_size == 32:
        return str(tiny_checkpoint("llava_next"))
    path = str(scratch_folder("capeval-bench-llava-"))
    build_llava_next(Path(path), 0, image_size=image_size)
    return path
