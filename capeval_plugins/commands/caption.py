"""``capeval caption (--captioner MODEL | --predict MODULE:FUNCTION) --images DIR [--references FILE] -m METRIC
... --out scores.jsonl``: caption images with a Hugging Face image-to-text model or a function of your own, and
score the captions with the chosen metrics in the same run.

The captions are saved beside the scores: every output row holds the sample's ``image``, its ``caption`` (and
``id`` where the references file gives ids), then the metrics' columns, as ``capeval score`` writes them.
Interrupted (Ctrl-C, a crash, a pre-emption), the same command resumes: caption batches already written are
not captioned again (kept in ``<run dir>.captions``), and scoring resumes as ``capeval score`` does (in
``<out>.capeval-run`` or ``--run-dir``); ``--restart`` starts over."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from capeval_plugins.core.bounds import cli_number

EPILOG = """examples:
  capeval caption --captioner Salesforce/blip-image-captioning-base --images val2014/ \\
      --references refs.jsonl -m cider -m clipscore -o clipscore.model=openai/clip-vit-base-patch32 --out scores.jsonl
  capeval caption --predict my_model.py:caption_batch --images photos/ -m clipscore \\
      --model openai/clip-vit-base-patch32 --out scores.csv"""

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "caption", help="caption images with a model or a function, and score the captions in the same run",
        description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--captioner", metavar="MODEL",
                     help="a Hugging Face image-to-text model: hub id or local folder (AutoModelForImageTextToText "
                          "and AutoProcessor: BLIP, GIT, an LVLM with --prompt, ...)")
    who.add_argument("--predict", metavar="MODULE:FUNCTION",
                     help="a function of your own, predict(images) -> captions (a list of PIL RGB images in, one "
                          "string per image out): an importable module or a .py file, and the function's name")
    p.add_argument("--images", required=True, help="the images folder: every image in it (sorted by name), or the "
                   "folder the --references file's image paths are relative to")
    p.add_argument("--references", metavar="FILE",
                   help="the images to caption and their references: a caption file (JSON Lines, CSV, TSV or "
                        "Parquet with image, references, and optionally id; a caption column is not used)")
    p.add_argument("--metric", "-m", action="append", required=True, help="registered metric name (repeatable)")
    p.add_argument("--option", "-o", action="append", metavar="[METRIC.]KEY=VALUE",
                   help="a metric option (repeatable), as in capeval score")
    p.add_argument("--model", help="model of every selected metric that takes one (same as -o model=...)")
    p.add_argument("--batch-size", dest="batch_size", type=int, help="samples per batch for every metric")
    p.add_argument("--caption-batch-size", type=cli_number(int, ge=1), default=8, metavar="N",
                   help="images per captioning batch (default 8)")
    p.add_argument("--prompt", help="text given to the captioner with each image (a conditional BLIP's prefix, an "
                                    "LVLM's instruction); its tokens are cut from the caption")
    p.add_argument("--max-new-tokens", type=cli_number(int, ge=1), default=30, metavar="N",
                   help="longest caption in tokens (default 30)")
    p.add_argument("--num-beams", type=cli_number(int, ge=1), default=1, metavar="N",
                   help="beam search width (default 1: greedy)")
    p.add_argument("--trust-remote-code", action="store_true", help="let the captioner run its repository's code")
    p.add_argument("--device", help="where the captioner and the metrics run: cpu, cuda, cuda:1, mps")
    p.add_argument("--dtype", help="weights' dtype of the captioner and the metrics: float32, float16, bfloat16")
    p.add_argument("--on-error", dest="on_error", choices=("raise", "skip"),
                   help="a sample whose image does not decode, or that a metric cannot score: stop (raise, "
                        "default) or skip it (not captioned or not scored; its row kept with the reason)")
    p.add_argument("--out", help="per-sample captions and scores: .jsonl, .json, .csv or .parquet")
    p.add_argument("--run-dir", dest="run_dir", help="checkpoint folder of the scoring (default: <out>.capeval-run); "
                   "the captions' checkpoints go in <run dir>.captions")
    p.add_argument("--restart", action="store_true", help="discard an unfinished run in the checkpoint folders")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_caption)


def read_images(args: argparse.Namespace) -> Any:
    """The records to caption: the --references file's (images, references, ids), or every image of --images."""
    from capeval_plugins.caption_files import CaptionRecords, read_captions
    from capeval_plugins.inputs import InputError

    if not os.path.isdir(args.images):
        raise InputError(f"--images {args.images}: not a folder")
    if args.references:
        records = read_captions(args.references, args.images, need_caption=False)
        if any(c is not None for c in records.captions):  # a caption file: its images and references are used
            print(f"capeval: the captions of {args.references} are not used (the captioner writes its own); "
                  f"`capeval score --captions {args.references}` scores them", file=sys.stderr)
        return records
    names = sorted(n for n in os.listdir(args.images)
                   if n.lower().endswith(IMAGE_SUFFIXES) and not n.startswith(".")
                   and os.path.isfile(os.path.join(args.images, n)))
    if not names:
        raise InputError(f"--images {args.images}: no image files ({', '.join(IMAGE_SUFFIXES)})")
    undecodable = [os.fsencode(n) for n in names if not _utf8(n)]
    if undecodable:  # the output's image column is text: such a name failed the run when its table was written
        raise InputError(f"--images {args.images}: {len(undecodable)} file name(s) are not UTF-8, which the output "
                         f"(text) cannot name (e.g. {undecodable[0]!r}); rename them")
    records = CaptionRecords(path=args.images, unit="image")
    for k, name in enumerate(names):
        records.images.append(os.path.join(args.images, name))
        records.image_names.append(name)
        records.captions.append(None)
        records.references.append(None)
        records.groups.append(None)
        records.lines.append(k)
    return records


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # os.listdir's surrogate escapes of bytes that are not UTF-8
        return False
    return True


def check_out_and_run_dirs(out: str, run_dir: str) -> None:
    """``--out`` is neither run folder nor inside one (their files are deleted when the run ends)."""
    from capeval_plugins.captioning import caption_folder
    from capeval_plugins.inputs import InputError

    target = os.path.realpath(out)
    for folder in (run_dir, caption_folder(run_dir)):
        real = os.path.realpath(folder)
        if target == real or target.startswith(real + os.sep):
            raise InputError(f"--out {out} is (inside) the run folder {folder}; give them different names")


def cmd_caption(args: argparse.Namespace) -> int:
    from capeval_plugins import options, runner
    from capeval_plugins.caption_files import check_writable, json_safe, score_table, write_table
    from capeval_plugins.captioning import caption_and_score

    if os.environ.get("WORLD_SIZE", "1").strip() not in ("", "1"):
        from capeval_plugins.inputs import InputError

        raise InputError("capeval caption runs in one process (torchrun / accelerate launch: caption first, then "
                         "`capeval score` the output's captions under torchrun)")
    if args.quiet:
        os.environ.update({"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "CAPEVAL_QUIET": "1"})
    shared = {key: str(value) for key, value in (("model", args.model), ("batch_size", args.batch_size),
                                                  ("device", args.device), ("dtype", args.dtype),
                                                  ("on_error", args.on_error)) if value is not None}
    metrics = options.build_metrics(args.metric, args.option or [], shared)
    from capeval_plugins.commands._functions import load_function

    predict: Any = load_function(args.predict, "--predict") if args.predict else args.captioner
    captioner_options = {} if args.predict else {
        "prompt": args.prompt, "max_new_tokens": args.max_new_tokens, "num_beams": args.num_beams,
        "device": args.device, "dtype": args.dtype, "trust_remote_code": args.trust_remote_code}
    records = read_images(args)
    inputs = [p for p in (args.references, args.captioner) if p and os.path.exists(p)]
    inputs += runner.local_inputs(metrics.values()) + [p for p in records.images if isinstance(p, str)]
    kind = check_writable(args.out, inputs) if args.out else None  # never an input, an image or a model's file
    run_dir = args.run_dir or (f"{args.out}.capeval-run" if kind == "file" else None)
    if args.out and run_dir:
        check_out_and_run_dirs(args.out, run_dir)
    uses_refs = any(m.info.references != "never" for m in metrics.values())
    references = records.references if uses_refs and any(records.references) else None
    try:
        with runner.stop_on_signals() as stop:
            done = caption_and_score(records.images, metrics, predict, references,
                                     batch_size=args.caption_batch_size, run_dir=run_dir, restart=args.restart,
                                     progress=not args.quiet, on_error=args.on_error, describe=records.describe,
                                     stop=stop, **captioner_options)
    except (runner.Interrupted, KeyboardInterrupt) as err:
        kept = f"; run the same command again to resume ({run_dir})" if run_dir else ""
        print(f"capeval: {err or 'interrupted'}{kept}", file=sys.stderr)
        return 130
    records.captions = list(done.captions)
    table = score_table(done.results, records, metrics)
    if args.out:
        write_table(args.out, table, inputs)
    metrics_summary = {name: {"score": r.score, "n_skipped": len(r.skipped)} for name, r in done.results.items()}
    print(json.dumps(json_safe({"n": len(table), "n_skipped": sum("error" in row for row in table),
                                "batches_captioned": done.batches_captioned,
                                "batches_caption_resumed": done.batches_resumed,
                                "batches_scored": done.outcome.batches_scored,
                                "batches_resumed": done.outcome.batches_resumed, "metrics": metrics_summary}),
                     allow_nan=False))
    return 0
