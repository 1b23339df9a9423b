"""LVLM judges at the papers' scale on one GPU: FLEUR and DISCODE on a LLaVA-NeXT with the real 7B shapes,
Rigel on a Qwen3-VL-2B-shaped model, random weights built on the device from configs (nothing downloaded).

    python benchmarks/lvlm_gpu.py                      # one GPU, bfloat16
    python benchmarks/lvlm_gpu.py --tiny               # the same code on CPU with tiny configs (a smoke run)

The models are built directly on the device in the benchmark's dtype (``from_config`` under ``torch.device``),
so the 15 GB of a 7B model never pass through CPU memory. Tokenizers are the tiny trained ones of
``capeval_plugins.testing`` (the vocabulary size, and so the LM head, is the real one); image processors have
the real tile sizes and grid pinpoints, so prompts carry the real number of image tokens (2,340 for a 640x480
image on LLaVA-NeXT). Random weights write no valid score: every answer runs to the token budget
(``--max-new-tokens``), the worst case for decoding, in the batched judge and in the loop alike.

On a COCO-like workload (``--captions-per-image`` captions per image, 640x480 images):

* FLEUR and DISCODE (closed form) samples/s through the metrics (``capeval_plugins.load``, the batched judge
  with each image's prefix run once per chunk) at each of ``--batch-sizes``, with the peak GPU memory of each
  batch size, against a one-pair-at-a-time ``generate`` loop like the official FLEUR script (processor,
  ``model.generate``, smoothing per pair) on the same model and inputs;
* the prefill (vision tower, shared prefixes, the captions' suffixes: :meth:`LVLMJudge.prompt_end`) of one
  chunk of the largest batch size: its FLOPs counted by ``torch.utils.flop_counter``, its time, and the
  fraction of the GPU's dense bf16 peak that makes (H100 SXM / H200: 989 TFLOP/s; ``--peak-tflops``);
* the share of the score heads (``FLEUR.head`` + ``DISCODE.head`` on the judge's output) in the time;
* Rigel (the paper's scorer: one forward pass per sample, a scoring head on the final hidden state) on the
  Qwen3-VL-2B-shaped model, samples/s batched against a per-sample loop. Qwen-VL processors need torchvision
  (``pip install -e '.[qwen]'``); without it this part says so and is left out.
"""
from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch
from PIL import Image

import capeval_plugins
from capeval_plugins.core import heads
from capeval_plugins.resources import loading
from capeval_plugins.models.lvlm import SCALES, JudgeSpec, LVLMJudge, fleur_instruction
from common import timed
from lvlm_throughput import naive_loop

DECIMAL = SCALES["0.0-1.0"]
NAME = "random-llava-next-mistral-7b"  # what the metrics are told: the judge registered under it is ours
# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, by a substring of torch.cuda.get_device_name().
PEAKS = {"H200": 989.4, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.4, "A100": 312.0, "L40S": 362.0,
         "A10G": 70.0, "L4": 121.0}

# llava-hf/llava-v1.6-mistral-7b-hf: Mistral-7B text model, CLIP ViT-L/14-336 vision tower, 5 grid pinpoints.
LLAVA_7B = dict(
    text=dict(model_type="mistral", vocab_size=32064, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rope_theta=1e6,
              rms_norm_eps=1e-5, sliding_window=None),
    vision=dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu"),
    tile=336, patch=14)
LLAVA_TINY = dict(
    text=dict(model_type="mistral", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1e6,
              rms_norm_eps=1e-5, sliding_window=None),
    vision=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, image_size=32, patch_size=8, projection_dim=16),
    tile=32, patch=8)
# Qwen/Qwen3-VL-2B-Instruct.
QWEN3_VL_2B = dict(
    text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
              num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
              rms_norm_eps=1e-6, tie_word_embeddings=True,
              rope_parameters=dict(rope_type="default", mrope_section=[24, 20, 20], mrope_interleaved=True,
                                   rope_theta=5e6)),
    vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048, patch_size=16,
                spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                deepstack_visual_indexes=[5, 11, 17]),
    tie_word_embeddings=True)
QWEN3_VL_TINY = dict(
    text=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
              rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 1], mrope_interleaved=True,
                                   rope_theta=5e6)),
    vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=16,
                num_position_embeddings=16, deepstack_visual_indexes=[0]),
    tie_word_embeddings=False)


def on_device(config, device: torch.device, dtype: torch.dtype):
    """A randomly initialised model built where it will run, in its dtype (never materialised elsewhere)."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def llava_next_judge(shapes: dict, device: torch.device, dtype: torch.dtype) -> LVLMJudge:
    from transformers import LlavaNextConfig, LlavaNextImageProcessor, LlavaNextProcessor

    from capeval_plugins.testing.vision_language import MISTRAL_LLAVA_TEMPLATE, mistral_tokenizer

    tokenizer = mistral_tokenizer()
    tile, patch = shapes["tile"], shapes["patch"]
    pinpoints = [[tile * h, tile * w] for h, w in [(1, 2), (2, 1), (2, 2), (3, 1), (1, 3)]]
    text = dict(shapes["text"], vocab_size=max(shapes["text"]["vocab_size"], len(tokenizer)),
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    config = LlavaNextConfig(text_config=text, vision_config=shapes["vision"],
                             image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                             vision_feature_select_strategy="default", vision_feature_layer=-2,
                             image_grid_pinpoints=pinpoints, image_seq_length=(tile // patch) ** 2,
                             tie_word_embeddings=False)
    image_processor = LlavaNextImageProcessor(size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
                                              image_grid_pinpoints=pinpoints)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=MISTRAL_LLAVA_TEMPLATE)
    return LVLMJudge(on_device(config, device, dtype), processor)


def qwen3_vl_judge(shapes: dict, device: torch.device, dtype: torch.dtype) -> LVLMJudge:
    import transformers
    from transformers import Qwen2VLImageProcessor, Qwen3VLConfig

    from capeval_plugins.testing.vision_language import QWEN3_VL_TEMPLATE, qwen_tokenizer

    tokenizer = qwen_tokenizer(QWEN3_VL_TEMPLATE)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    text = dict(shapes["text"], vocab_size=max(shapes["text"]["vocab_size"], len(tokenizer)),
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = Qwen3VLConfig(text_config=text, vision_config=shapes["vision"],
                           tie_word_embeddings=shapes["tie_word_embeddings"], **ids)
    patch = shapes["vision"]["patch_size"]
    sizes = dict(patch_size=patch, temporal_patch_size=2, merge_size=2,
                 size={"shortest_edge": 4 * (2 * patch) ** 2, "longest_edge": 16384 * (2 * patch) ** 2})
    processor = transformers.Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes), tokenizer=tokenizer,
        video_processor=transformers.Qwen3VLVideoProcessor(**sizes), chat_template=QWEN3_VL_TEMPLATE)
    return LVLMJudge(on_device(config, device, dtype), processor)


def corpus(n_images: int, per_image: int, size: tuple[int, int]):
    """Random images (``size`` = width, height) and ``per_image`` random captions each."""
    rng = np.random.default_rng(0)
    w, h = size
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(n_images)]
    words = "a dog cat man woman runs sits on the grass in park with red ball near water".split()
    captions = [" ".join(rng.choice(words, size=int(rng.integers(6, 16)))) for _ in range(n_images * per_image)]
    return images, [i // per_image for i in range(len(captions))], captions


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> str:
    return f"{torch.cuda.max_memory_allocated(device) / 2**30:6.1f} GiB" if device.type == "cuda" else "n/a (CPU)"


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given is not None or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAKS.items() if key in name), None)


def metric_on(name: str, judge: LVLMJudge, args, batch_size: int):
    """``capeval_plugins.load(name)`` whose judge is ``judge`` (registered under the spec the metric asks for)."""
    metric = capeval_plugins.load(name, model=NAME, batch_size=batch_size, max_new_tokens=args.max_new_tokens,
                                  device=str(judge.device), dtype=args.dtype)
    loading.shared(("LVLMJudge", JudgeSpec.from_config(metric.config)), lambda: judge)
    return metric


def prefill(judge: LVLMJudge, images, index, instructions, rows: int, args, peak: float | None) -> None:
    """FLOPs and time of the model's prefill (vision tower, shared prefixes, the captions' suffixes) of one chunk
    of ``rows`` samples, processor work (CPU, done once beforehand) excluded."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.inference_mode():
        run = judge._prepare(images, index[:rows], instructions[:rows], None, None, 1, True)
        table = judge.label_table(DECIMAL.labels)
        call = lambda: judge._end_chunk(run, list(range(rows)), table)  # noqa: E731
        call()
        with FlopCounterMode(display=False) as counter:
            call()
        seconds, _ = timed(call, args.repeats, str(judge.device))
    flops = counter.get_total_flops()
    rate = flops / seconds / 1e12
    share = f", {100 * rate / peak:.1f} % of the {peak:.0f} TFLOP/s bf16 peak" if peak else " (no peak known)"
    print(f"prefill of {rows} samples ({len(set(index[:rows]))} images): {flops / 1e9:.4g} GFLOP in "
          f"{seconds * 1e3:.1f} ms = {rate:.4g} TFLOP/s{share}")


def fleur_discode(args, device: torch.device, dtype: torch.dtype, peak: float | None) -> None:
    judge = llava_next_judge(LLAVA_TINY if args.tiny else LLAVA_7B, device, dtype)
    images, index, captions = corpus(args.images, args.captions_per_image, args.image_size)
    per_sample = [images[g] for g in index]
    instructions = [fleur_instruction(c) for c in captions]
    enc = judge.processor(text=[judge.chat(instructions[0])], images=[images[0]], return_tensors="pt")
    params = sum(p.numel() for p in judge.model.parameters())
    print(f"LLaVA-NeXT {params / 1e9:.2f}B parameters, {dtype}, on {device}; {len(captions)} pairs = {args.images} "
          f"images x {args.captions_per_image} captions, {args.image_size[0]}x{args.image_size[1]} images, "
          f"{enc['input_ids'].shape[1]} prompt tokens per pair, {args.max_new_tokens} answer tokens")
    n_naive = min(args.naive_pairs, len(captions))
    with torch.inference_mode():
        naive_loop(judge, images, index[:1], captions[:1], args.max_new_tokens)  # warm up
        sync(device)
        start = time.perf_counter()
        naive_loop(judge, images, index[:n_naive], captions[:n_naive], args.max_new_tokens)
        sync(device)
    naive_rate = n_naive / (time.perf_counter() - start)
    print(f"one-pair generate loop (official FLEUR script): {naive_rate:8.2f} pairs/s ({n_naive} pairs)")
    for batch_size in args.batch_sizes:
        for name in ("fleur", "discode"):
            metric = metric_on(name, judge, args, batch_size)
            metric(per_sample[:batch_size], captions[:batch_size])  # warm up
            reset_peak(device)
            seconds, _ = timed(lambda: metric(per_sample, captions), args.repeats, str(device))
            rate = len(captions) / seconds
            print(f"  {name:7s} batch {batch_size:3d}: {rate:8.2f} samples/s  {rate / naive_rate:6.1f}x the loop  "
                  f"peak memory {peak_memory(device)}")
    rows = min(max(args.batch_sizes), len(captions))
    prefill(judge, images, index, instructions, rows, args, peak)
    with torch.inference_mode():
        t_judge, out = timed(lambda: judge.judge(images, index[:rows], instructions[:rows], DECIMAL,
                                                 max_new_tokens=args.max_new_tokens, batch_size=rows),
                             args.repeats, str(device))
    fleur, discode = metric_on("fleur", judge, args, rows), metric_on("discode", judge, args, rows)
    t_heads, _ = timed(lambda: (fleur.head(out), discode.head(out)), max(args.repeats, 20))
    print(f"score heads (FLEUR.head + DISCODE.head) on {rows} answers: {t_heads * 1e6:.0f} us = "
          f"{100 * t_heads / (t_heads + t_judge):.4f} % of the judge's {t_judge * 1e3:.1f} ms")
    loading.clear_cache()  # the 7B judge's memory back before Rigel's model


def rigel(args, device: torch.device, dtype: torch.dtype) -> None:
    from transformers.utils import is_torchvision_available

    from capeval_plugins.models.rigel import RigelModel, RigelSettings
    from rigel_throughput import one_sample_loop

    if not is_torchvision_available():
        print("Rigel on Qwen3-VL: left out, its processor needs torchvision (pip install -e '.[qwen]')")
        return
    judge = qwen3_vl_judge(QWEN3_VL_TINY if args.tiny else QWEN3_VL_2B, device, dtype)
    hidden = int(judge.head.weight.shape[1])
    settings = RigelSettings(base_model="random-qwen3-vl-2b", hidden_size=hidden,
                             head_hidden=(16,) if args.tiny else (1024, 512))
    torch.manual_seed(0)
    model = RigelModel(judge, settings.build_head().to(device).eval(), settings)
    images, index, captions = corpus(args.images, args.captions_per_image, args.image_size)
    params = sum(p.numel() for p in judge.model.parameters())
    print(f"Rigel on Qwen3-VL {params / 1e9:.2f}B parameters, {dtype}: {len(captions)} samples")
    with torch.inference_mode():
        model.probabilities(images, index[:2], captions[:2], batch_size=2)  # warm up
        n_loop = min(args.naive_pairs, len(captions))
        t_loop, slow = timed(lambda: one_sample_loop(model, images, index[:n_loop], captions[:n_loop]), 1,
                             str(device))
        loop_rate = n_loop / t_loop
        print(f"  per-sample loop: {loop_rate:8.2f} samples/s ({n_loop} samples)")
        for batch_size in args.batch_sizes:
            reset_peak(device)
            t, probs = timed(lambda: model.probabilities(images, index, captions, batch_size=batch_size),
                             args.repeats, str(device))
            rate = len(captions) / t
            agree = (heads.label_expectation(probs[:n_loop]) - slow.cpu()).abs().max().item()
            print(f"  batch {batch_size:3d}: {rate:8.2f} samples/s  {rate / loop_rate:6.1f}x the loop  peak memory "
                  f"{peak_memory(device)}  max |E[label] batched - loop| {agree:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--tiny", action="store_true", help="tiny configs on CPU: check the script end to end")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    parser.add_argument("--dtype", default=None, help="default: bf16 (float32 with --tiny)")
    parser.add_argument("--images", type=int, default=None, help="distinct images (default 16; 4 with --tiny)")
    parser.add_argument("--captions-per-image", type=int, default=5)
    parser.add_argument("--image-size", type=int, nargs=2, default=None, metavar=("W", "H"),
                        help="default 640 480 (COCO's usual size; 64 48 with --tiny)")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,5,10,20,40; 1,5,10 --tiny)")
    parser.add_argument("--max-new-tokens", type=int, default=6, help="answer token budget, both ways")
    parser.add_argument("--naive-pairs", type=int, default=None, help="pairs the loops run (default 20; 4 --tiny)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per figure (the best is kept)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    parser.add_argument("--skip", choices=["rigel", "fleur"], action="append", default=[], help="leave a part out")
    args = parser.parse_args()
    args.images = args.images or (4 if args.tiny else 16)
    args.naive_pairs = args.naive_pairs or (4 if args.tiny else 20)
    args.image_size = args.image_size or ([64, 48] if args.tiny else [640, 480])
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("1,5,10" if args.tiny else "1,5,10,20,40")).split(",")]
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no GPU here: run with --tiny for the CPU smoke run")
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    dtype = loading.resolve_dtype(args.dtype, device)
    warnings.filterwarnings("ignore", message=".*no valid score.*")  # random weights write no score
    torch.set_grad_enabled(False)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; torch {torch.__version__}; threads {torch.get_num_threads()}")
    if "fleur" not in args.skip:
        fleur_discode(args, device, dtype, peak_tflops(device, args.peak_tflops))
    if "rigel" not in args.skip:
        rigel(args, device, dtype)


if __name__ == "__main__":
    main()
