"""Helpers the benchmark scripts share (run them as ``python benchmarks/<script>.py``)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]


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


def random_llava15_realistic(lm_layers: int = 24, vision_layers: int = 2, seed: int = 0) -> str:
    """A random LLaVA-1.5 at a realistic prompt length: CLIP's 336 px tile in 14 px patches (576 image tokens,
    as llava-1.5), a language model with Qwen2-0.5B's shapes (hidden 896, 14 heads, 2 key/value heads, MLP 4864;
    ``lm_layers`` of them, 24 in Qwen2-0.5B: 0.44 B parameters without the embeddings) over the test tokenizer
    (32,064 embedding rows, like llava-v1.6-mistral), and a narrow vision tower (``vision_layers`` layers of width
    64: a real ViT-L/14 would add the same work per image to both sides of a comparison, and as much again per
    pair to a loop that encodes the image for every caption)."""
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    from capeval_plugins.testing import scratch_folder
    from capeval_plugins.testing.vision_language import (LLAVA_15_TEMPLATE, _padded, clip_image_processor,
                                                         mistral_tokenizer)

    path = Path(scratch_folder("capeval-bench-llava15-"))
    tokenizer = mistral_tokenizer()
    tokenizer.chat_template = LLAVA_15_TEMPLATE
    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=_padded(len(tokenizer)), hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=lm_layers, num_attention_heads=14,
                         num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=256,
                           num_hidden_layers=vision_layers, num_attention_heads=4, image_size=336, patch_size=14,
                           projection_dim=64),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default", vision_feature_layer=-2, image_seq_length=576,
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(path)
    image_processor = clip_image_processor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                   chat_template=LLAVA_15_TEMPLATE).save_pretrained(path)
    return str(path)


def process_env(threads: int) -> dict[str, str]:
    """The environment of a whole-process benchmark side: offline, quiet, ``threads`` torch threads, this checkout
    importable, and Python's bytecode caches written (an installed package has them)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1", OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return env


def run_process(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(wall s, CPU s of the process and every descendant it waited for, peak RSS GB) of one process, from the
    kernel (``wait4``)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = proc.stderr.read().decode(errors="replace")  # read first: a full pipe would block the child
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{cmd[:6]} failed ({proc.returncode}):\n{err[-3000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 2 ** 20


def interleaved_processes(commands: dict[str, Callable[[], list[str]]], env: dict[str, str], rounds: int,
                          before: Callable[[str], None] = lambda side: None, warm_up: bool = True) -> dict[str, list]:
    """Each side's (wall, CPU, peak GB) per round, after one untimed run of each (bytecode caches, page cache;
    ``warm_up=False`` leaves it out, where earlier runs made them); the sides' order alternates between rounds so a
    change of load hits them alike. ``before(side)`` runs ahead of each of its runs (e.g. removing the last
    output)."""
    sides = list(commands)
    for side in sides if warm_up else ():
        before(side)
        run_process(commands[side](), env)
    times: dict[str, list] = {side: [] for side in sides}
    for r in range(rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            before(side)
            times[side].append(run_process(commands[side](), env))
    return times


def report_processes(times: dict[str, list], notes: dict[str, str] | None = None) -> None:
    """Median [min-max] CPU s, median wall s and peak GB per side, and the first side's CPU over each other's
    (median and best rounds)."""
    import statistics

    notes = notes or {}
    sides = list(times)
    first = sides[0]
    print(f"  {'side':22s} {'CPU s median [min-max]':>26s} {'wall s':>8s} {'peak GB':>8s}   "
          f"{first} / side: CPU median, best")
    for side in sides:
        cpu = [c for _, c, _ in times[side]]
        line = (f"  {side:22s} {statistics.median(cpu):10.2f} [{min(cpu):6.2f}-{max(cpu):6.2f}] "
                f"{statistics.median(w for w, _, _ in times[side]):8.2f} {max(m for _, _, m in times[side]):8.2f}")
        if side != first:
            base = [c for _, c, _ in times[first]]
            line += f"   {statistics.median(base) / statistics.median(cpu):5.2f}x {min(base) / min(cpu):5.2f}x"
        print(line + (f"   {notes[side]}" if side in notes else ""), flush=True)
