"""``capeval train METHOD ...``: train what a metric needs, one sub-command per method, each with its own options.

* ``capeval train rigel --phase 1|2 --train FILE --out DIR ...``: a Rigel checkpoint. Phase 1 distils the scoring
  head from the frozen LVLM (its hidden states are extracted once and cached under ``--cache``, default
  ``<out>/features``); phase 2 adapts the backbone with LoRA from a phase-1 checkpoint (``--init``). Defaults are
  the paper's (Table 4). Scored with ``capeval score --metric rigel -o checkpoint=DIR``.
* ``capeval train msd-aligner --train chat.json --images DIR --out DIR ...``: MSD-Score's local aligner (frozen
  CLIP vision tower and LLM, a trained linear projector; contrastive + reconstruction objectives). Defaults are
  LLaVA v1's projector stage where the paper is silent. Scored with ``capeval score --metric msd_score -o
  aligner=DIR``.

Running the same command again continues an interrupted run from its last saved epoch or step; ``--overwrite``
starts afresh. Each prints a JSON summary.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import capeval_plugins
from capeval_plugins.core import jsonio
from capeval_plugins.core.bounds import MAX_SEED, cli_number
from capeval_plugins.core.messages import MissingExtra

RIGEL_EPILOG = """examples:
  capeval train rigel --phase 1 --train spica_train.parquet --val spica_val.parquet --images images/ \\
      --out rigel-p1
  capeval train rigel --phase 2 --init rigel-p1 --train spica_train.parquet --images images/ --out rigel
  capeval train rigel --phase 2 --head-init lm --train spica_train.parquet --images images/ --out rigel-lm
  capeval train rigel --phase 1 --train vid_lepus_train.jsonl --images frames/ --score-range 1 5 \\
      --num-frames 8 --out rigel-video-p1
  capeval score --metric rigel -o checkpoint=rigel --images DIR --captions captions.jsonl"""

ALIGNER_EPILOG = """examples:
  capeval train msd-aligner --train LLaVA-CC3M-Pretrain-595K/chat.json --images LLaVA-CC3M-Pretrain-595K/images \\
      --out msd-aligner --gradient-checkpointing
  capeval train msd-aligner --train pairs.jsonl --llm path/to/llama-7b --cache features/ --epochs 3 --out aligner
  capeval score --metric msd_score -o aligner=msd-aligner --images DIR --captions captions.jsonl"""

PACKAGE = Path(capeval_plugins.__file__).resolve().parent
FORMATS = ("rows", "flickr8k-expert", "flickr8k-cf", "composite", "nebula", "polaris", "thumb")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train what a metric needs (Rigel, MSD-Score's aligner)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    methods = p.add_subparsers(dest="method", required=True, metavar="METHOD")
    add_rigel(methods)
    add_msd_aligner(methods)


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="checkpoint folder to write (and to resume in)")
    p.add_argument("--overwrite", action="store_true", help="discard an earlier run's state in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_rigel(methods) -> None:
    p = methods.add_parser("rigel", help="Rigel's scoring head (phase 1) and LoRA (phase 2)", epilog=RIGEL_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", type=int, choices=(1, 2), required=True,
                   help="1: distil the scoring head (frozen backbone); 2: LoRA on the backbone (head frozen)")
    _run_options(p)
    data = p.add_argument_group("data")
    data.add_argument("--train", required=True, help="human-judgment file to train on")
    data.add_argument("--val", help="validation file (phase 1: early stopping on its Kendall tau-c)")
    data.add_argument("--val-fraction", type=cli_number(float, ge=0, lt=1), default=None,
                      help="without --val: share of the training images held out for validation "
                           "(default 0.1 in phase 1, 0 in phase 2)")
    data.add_argument("--format", choices=FORMATS, default="rows",
                      help="file format: generic rows (default) or a rating benchmark's published format")
    data.add_argument("--images", help="folder of the images and frame folders (default: the file's folder)")
    data.add_argument("--score-range", type=cli_number(float), nargs=2, default=(0.0, 1.0), metavar=("LOW", "HIGH"),
                      help="scale of the file's human scores, mapped to [0, 1] (default 0 1; e.g. 1 5)")
    data.add_argument("--num-frames", type=cli_number(int, ge=1),
                      help="frames taken evenly from each frame folder (default all)")
    data.add_argument("--references", choices=("auto", "ignore", "both"), default="auto",
                      help="auto: reference-based prompt where a sample has references; ignore: all "
                           "reference-free; both: each sample with references twice, with and without")
    model = p.add_argument_group("model (phase 1, and phase 2 without --init; phase 2 takes them from --init)")
    model.add_argument("--model", help="base LVLM, hub id or path (default Qwen/Qwen3-VL-2B-Instruct; in phase 2 "
                                       "it replaces the one --init names, e.g. a local copy)")
    model.add_argument("--revision")
    model.add_argument("--device")
    model.add_argument("--dtype")
    model.add_argument("--local-files-only", action="store_true")
    model.add_argument("--trust-remote-code", action="store_true")
    model.add_argument("--prompt-layout", choices=("flat", "lines"), default="flat",
                       help="the paper's prompts as printed (flat) or one line per item (lines)")
    model.add_argument("--prompts", help="JSON file of custom prompts {image, image_ref, video, video_ref} "
                                         "with {cand} and {refs_text} placeholders (replaces the paper's)")
    model.add_argument("--reference-separator", default="\n", help="between references in the prompt")
    model.add_argument("--answer-prefix", default="", help="text after the generation prompt (default none)")
    model.add_argument("--video-input", choices=("auto", "video", "frames"), default="auto")
    # bounds: RigelSettings (capeval_plugins/models/rigel.py)
    model.add_argument("--video-fps", type=cli_number(float, gt=0, le=1000), default=2.0,
                       help="sampling rate of the given frames")
    model.add_argument("--temperature", type=cli_number(float, ge=1e-6), default=1.0,
                       help="distillation temperature tau")
    model.add_argument("--head-hidden", type=hidden_widths, default=(1024, 512),
                       help="widths of the head's hidden layers, comma-separated (default 1024,512)")
    model.add_argument("--head-activation", choices=("relu", "gelu", "tanh"), default="relu")
    opt = p.add_argument_group("optimisation (defaults: the paper's, per phase)")
    opt.add_argument("--init", help="phase 2: the phase-1 checkpoint folder")
    # bounds: Phase1Config and Phase2Config (capeval_plugins/training/phase1.py, phase2.py)
    opt.add_argument("--epochs", type=cli_number(int, ge=1))
    opt.add_argument("--batch-size", type=cli_number(int, ge=1))
    opt.add_argument("--lr", type=cli_number(float, gt=0))
    opt.add_argument("--weight-decay", type=cli_number(float, ge=0))
    opt.add_argument("--patience", type=cli_number(int, ge=1),
                     help="phase 1: epochs without a better validation tau-c (5)")
    opt.add_argument("--seed", type=cli_number(int, ge=0, le=MAX_SEED), default=0)
    opt.add_argument("--extract-batch-size", type=cli_number(int, ge=1),
                     help="phase 1: samples per backbone batch (16)")
    opt.add_argument("--cache", help="phase 1: hidden-state cache folder (default <out>/features)")
    opt.add_argument("--lora-r", type=cli_number(int, ge=1))
    opt.add_argument("--lora-alpha", type=cli_number(int, ge=1))
    opt.add_argument("--lora-dropout", type=cli_number(float, ge=0, lt=1))
    opt.add_argument("--lora-targets", help="regular expression over module names (default: the language "
                                            "model's q_proj and v_proj)")
    opt.add_argument("--ties", choices=("up", "down"), help="phase 2: a mean score half-way between labels")
    opt.add_argument("--save-every", type=cli_number(int, ge=1), help="phase 2: steps between saved states (200)")
    ablation = p.add_argument_group("the paper's head ablations (defaults: the method as published)")
    ablation.add_argument("--objective", choices=("emd", "kl"),
                          help="phase 1: distil with the EMD of Eq. 2 (default) or tau x KL (Table 5)")
    ablation.add_argument("--head-init", dest="head_init", choices=("phase1", "random", "lm"),
                          help="phase 2: train against the distilled head (default), a fresh seeded random head "
                               "kept frozen (Table 3, row iii), or the LM head's label tokens (Table 3, row i); "
                               "random and lm need no --init (the model options above then apply)")
    ablation.add_argument("--lm-softmax", dest="lm_softmax", choices=("labels", "vocabulary"),
                          help="phase 2 with --head-init lm: the cross-entropy of the softmax over the label "
                               "tokens (default) or over the whole vocabulary (next-token training)")
    p.set_defaults(func=cmd_train)


def add_msd_aligner(methods) -> None:
    from capeval_plugins.models.msd_aligner import (DEFAULT_LLM, DEFAULT_VISION, TEXT_FEATURES, TEXT_POOLINGS,
                                                    VISION_FEATURES)
    from capeval_plugins.training.msd_aligner import SCHEDULES

    p = methods.add_parser("msd-aligner", help="MSD-Score's local vision-language aligner", epilog=ALIGNER_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Train MSD-Score's local aligner: a linear projector of frozen CLIP patch "
                                       "features into a frozen LLM's embedding space, with a symmetric contrastive "
                                       "loss on pooled features and caption reconstruction through the LLM.")
    _run_options(p)
    data = p.add_argument_group("data")
    data.add_argument("--train", required=True,
                      help="image-caption pairs: LLaVA's chat.json (CC3M-595K) or {image, caption} records "
                           "(JSON, JSON Lines, CSV, Parquet)")
    data.add_argument("--images", help="folder the image paths are relative to (default: the file's folder)")
    data.add_argument("--limit", type=cli_number(int, ge=1), help="train on the first N pairs only")
    model = p.add_argument_group("backbones (frozen)")
    model.add_argument("--vision-model", default=DEFAULT_VISION, help=f"CLIP checkpoint (default {DEFAULT_VISION})")
    model.add_argument("--vision-revision")
    # bounds: AlignerSettings (capeval_plugins/models/msd_aligner/model.py); a layer the tower lacks is refused
    # once it is loaded
    model.add_argument("--vision-layer", type=cli_number(int, ge=-1000, le=1000), default=-2,
                       help="hidden state taken from the vision tower (default -2, the penultimate layer)")
    model.add_argument("--vision-feature", choices=VISION_FEATURES, default="patch",
                       help="patch: drop the class token (default); cls_patch: keep it")
    model.add_argument("--llm", default=DEFAULT_LLM, help=f"causal language model (default {DEFAULT_LLM})")
    model.add_argument("--llm-revision")
    model.add_argument("--text-features", choices=TEXT_FEATURES, default="last_hidden",
                       help="caption token embeddings: the LLM's last hidden states (default, as the official "
                            "scripts; the LLM is loaded at scoring) or its input embeddings (no LLM at scoring)")
    model.add_argument("--text-pooling", choices=TEXT_POOLINGS, default="content",
                       help="the caption's global embedding: the normalised mean of its normalised content tokens "
                            "(default, as the image side) or 'raw': the mean of the raw features over every "
                            "non-padding position, BOS kept (the official scripts)")
    model.add_argument("--max-length", type=cli_number(int, ge=2, le=2**20), default=2048,
                       help="LLM context: patches + caption (2048)")
    model.add_argument("--caption-suffix", default="\\n",
                       help="appended to each caption for reconstruction (default \\n, a newline: LLaVA's plain "
                            "template; \\n and \\t are read as newline and tab)")
    model.add_argument("--device")
    model.add_argument("--dtype", help="of the frozen backbones (default bfloat16 on GPU, float32 on CPU)")
    model.add_argument("--local-files-only", action="store_true")
    model.add_argument("--trust-remote-code", action="store_true")
    opt = p.add_argument_group("optimisation (defaults: LLaVA's projector stage, CLIP's temperature)")
    # bounds: AlignerConfig (capeval_plugins/training/msd_aligner/train.py)
    opt.add_argument("--epochs", type=cli_number(int, ge=1), default=1)
    opt.add_argument("--batch-size", type=cli_number(int, ge=1), default=128,
                     help="pairs per step, the contrastive negatives (128)")
    opt.add_argument("--micro-batch-size", type=cli_number(int, ge=1), default=16,
                     help="pairs per LLM forward pass within a step (16; changes memory use, not the loss)")
    opt.add_argument("--lr", type=cli_number(float, gt=0), default=2e-3)
    opt.add_argument("--weight-decay", type=cli_number(float, ge=0), default=0.0)
    opt.add_argument("--warmup-ratio", type=cli_number(float, ge=0, lt=1), default=0.03)
    opt.add_argument("--schedule", choices=SCHEDULES, default="cosine")
    opt.add_argument("--contrastive-weight", type=cli_number(float, ge=0), default=1.0)
    opt.add_argument("--reconstruction-weight", type=cli_number(float, ge=0), default=1.0)
    opt.add_argument("--temperature", type=cli_number(float, gt=0), default=0.07,
                     help="initial (or fixed) contrastive temperature")
    opt.add_argument("--fixed-temperature", action="store_true", help="do not learn the temperature")
    opt.add_argument("--max-logit-scale", type=cli_number(float, gt=0), default=100.0)
    opt.add_argument("--gradient-checkpointing", action="store_true",
                     help="recompute the LLM's activations in the backward pass (less memory; for 7B LLMs)")
    opt.add_argument("--seed", type=cli_number(int, ge=0, le=MAX_SEED), default=0)
    opt.add_argument("--save-every", type=cli_number(int, ge=1), default=200,
                     help="steps between saved states (200)")
    opt.add_argument("--extract-batch-size", type=cli_number(int, ge=1), default=64,
                     help="images per vision pass of the cache")
    opt.add_argument("--cache", help="cache the vision features in this folder (about 0.5 MiB per image for "
                                     "ViT-L/14 in 16 bits; default: no cache)")
    p.set_defaults(func=cmd_train_aligner)


def _given(args: argparse.Namespace, names: dict[str, str]) -> dict:
    return {field: getattr(args, arg) for arg, field in names.items() if getattr(args, arg) is not None}


def read_data(args: argparse.Namespace, path: str):
    from capeval_plugins.training.data import read_judgments

    data = read_judgments(path, format=args.format, images=args.images, score_range=tuple(args.score_range),
                          num_frames=args.num_frames)
    return data.with_references(args.references)


def split_data(args: argparse.Namespace):
    train = read_data(args, args.train)
    if args.val:
        return train, read_data(args, args.val)
    fraction = args.val_fraction if args.val_fraction is not None else (0.1 if args.phase == 1 else 0.0)
    if fraction > 0:
        return train.split(fraction, args.seed)
    return train, None


def settings_from(args: argparse.Namespace):
    from capeval_plugins.models.rigel import DEFAULT_BASE_MODEL, RigelSettings, paper_prompts

    if args.prompts:
        from capeval_plugins.inputs import InputError

        try:
            with open(args.prompts, encoding="utf-8") as f:
                prompts = jsonio.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise InputError(f"--prompts {args.prompts}: not a JSON file of prompts ({err})") from None
        if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
            raise InputError(f"--prompts {args.prompts}: expected an object of prompt strings "
                             "{image, image_ref, video, video_ref}")
    else:
        prompts = paper_prompts(args.prompt_layout)
    return RigelSettings(base_model=args.model or DEFAULT_BASE_MODEL, revision=args.revision, prompts=prompts,
                         reference_separator=args.reference_separator, temperature=args.temperature,
                         head_hidden=args.head_hidden, head_activation=args.head_activation,
                         video_input=args.video_input, video_fps=args.video_fps, answer_prefix=args.answer_prefix)


def cmd_train(args: argparse.Namespace) -> int:
    return _one_line_errors(run_training, args)


def cmd_train_aligner(args: argparse.Namespace) -> int:
    return _one_line_errors(run_aligner_training, args)


def _one_line_errors(run, args: argparse.Namespace) -> int:
    try:
        return run(args)
    except (FileExistsError, MissingExtra) as err:  # a used output folder, no peft: one line, not a traceback
        print(f"capeval: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        if not _refused_by_capeval(err):  # a bug: its traceback
            raise
        print(f"capeval: error: {err}", file=sys.stderr)
        return 2


def _refused_by_capeval(err: ValueError) -> bool:
    """Whether the package's own checks raised ``err``: settings or a combination of options the training code
    refuses, some only once a model is loaded (--vision-layer beyond the tower's layers). A ValueError from a
    library is a bug, shown with its traceback."""
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(PACKAGE)


def hidden_widths(text: str) -> tuple[int, ...]:
    """``--head-hidden``: comma-separated widths, each and their number within RigelSettings' bounds."""
    from capeval_plugins.models.rigel import MAX_LAYERS, MAX_WIDTH

    widths = tuple(cli_number(int, ge=1, le=MAX_WIDTH)(x.strip()) for x in text.split(",") if x.strip())
    if len(widths) > MAX_LAYERS:
        raise argparse.ArgumentTypeError(f"at most {MAX_LAYERS} widths, got {len(widths)}")
    return widths


def run_aligner_training(args: argparse.Namespace) -> int:
    from capeval_plugins.training.msd_aligner.data import read_captions
    from capeval_plugins.models.msd_aligner.model import AlignerSettings
    from capeval_plugins.training.msd_aligner.train import AlignerConfig, train_aligner

    data = read_captions(args.train, images=args.images, limit=args.limit)
    settings = AlignerSettings(
        vision_model=args.vision_model, vision_revision=args.vision_revision, vision_layer=args.vision_layer,
        vision_feature=args.vision_feature, llm=args.llm, llm_revision=args.llm_revision,
        text_features=args.text_features, text_pooling=args.text_pooling, max_length=args.max_length,
        caption_suffix=args.caption_suffix.replace("\\n", "\n").replace("\\t", "\t"))
    config = AlignerConfig(
        epochs=args.epochs, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size, lr=args.lr,
        weight_decay=args.weight_decay, warmup_ratio=args.warmup_ratio, schedule=args.schedule,
        contrastive_weight=args.contrastive_weight, reconstruction_weight=args.reconstruction_weight,
        temperature=args.temperature, learn_temperature=not args.fixed_temperature,
        max_logit_scale=args.max_logit_scale, gradient_checkpointing=args.gradient_checkpointing, seed=args.seed,
        save_every=args.save_every, extract_batch_size=args.extract_batch_size)
    out = train_aligner(args.out, data, settings=settings, config=config, device=args.device, dtype=args.dtype,
                        local_files_only=args.local_files_only or None, trust_remote_code=args.trust_remote_code,
                        cache_dir=args.cache, progress=not args.quiet, overwrite=args.overwrite)
    print(json.dumps(aligner_summary(out), indent=2))
    return 0


def aligner_summary(checkpoint) -> dict:
    from capeval_plugins.models.msd_aligner.model import read_record, read_settings

    settings, record = read_settings(checkpoint), read_record(checkpoint)
    losses = record.get("losses", [])
    return {"checkpoint": str(checkpoint), "vision_model": settings.vision_model, "llm": settings.llm,
            "text_features": settings.text_features, "text_pooling": settings.text_pooling, "train_samples": record.get("train_samples"),
            "epochs": record.get("epoch"), "steps": record.get("global_step"),
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "history": record.get("history", []), "logit_scale": record.get("logit_scale")}


def run_training(args: argparse.Namespace) -> int:
    train, val = split_data(args)
    progress = not args.quiet
    if args.phase == 1:
        from capeval_plugins.models.lvlm import JudgeSpec
        from capeval_plugins.training.phase1 import Phase1Config, train_phase1

        settings = settings_from(args)
        config = Phase1Config(seed=args.seed, **_given(args, {
            "epochs": "epochs", "batch_size": "batch_size", "lr": "lr", "weight_decay": "weight_decay",
            "patience": "patience", "extract_batch_size": "extract_batch_size", "objective": "objective"}))
        spec = JudgeSpec(settings.base_model, args.device, args.dtype, args.revision, args.local_files_only or None,
                         args.trust_remote_code)
        out = train_phase1(args.out, train, val, settings=settings, config=config, spec=spec, cache_dir=args.cache,
                           progress=progress, overwrite=args.overwrite)
    else:
        from capeval_plugins.training.phase2 import Phase2Config, train_phase2

        if not args.init and args.head_init in (None, "phase1"):
            print("capeval: error: phase 2 needs --init (a phase-1 checkpoint folder), unless --head-init is "
                  "random or lm", file=sys.stderr)
            return 2
        config = Phase2Config(seed=args.seed, **_given(args, {
            "epochs": "epochs", "batch_size": "batch_size", "lr": "lr", "weight_decay": "weight_decay",
            "lora_r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
            "lora_targets": "lora_targets", "ties": "ties", "save_every": "save_every", "head_init": "head_init",
            "lm_softmax": "lm_softmax"}))
        out = train_phase2(args.out, args.init or None, train, val, config=config,
                           settings=None if args.init else settings_from(args), model=args.model,
                           device=args.device, dtype=args.dtype, local_files_only=args.local_files_only or None,
                           trust_remote_code=args.trust_remote_code, progress=progress, overwrite=args.overwrite)
    print(json.dumps(summary(out), indent=2))
    return 0


def summary(checkpoint) -> dict:
    from capeval_plugins.models.rigel import read_record, read_settings

    settings, record = read_settings(checkpoint), read_record(checkpoint)
    history = record.get("history", [])
    last = history[-1] if history else {}
    out = {"checkpoint": str(checkpoint), "phase": settings.phase, "base_model": settings.base_model,
           "train_samples": record.get("train_samples"), "validation_samples": record.get("validation_samples")}
    if settings.phase == 1:
        out.update(epochs=record.get("epochs_done"), best_epoch=record.get("best_epoch"),
                   best_validation_tau_c=record.get("best_tau_c"), stopped_early=record.get("stopped_early"))
    else:
        out.update(epochs=record.get("epoch"), steps=record.get("global_step"),
                   validation=last.get("validation"))
    return out
