"""``capeval``: list metrics, score a caption file, build tiny test checkpoints, and the subcommands of
``capeval_plugins/commands/`` (benchmarks, training, ...).

``capeval score`` also runs under ``torchrun`` / ``accelerate launch``: each rank scores its shard and the
states are merged through the same reduce step as the torchmetrics adapter.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Sequence


def _parse_value(raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"expected a boolean, got {raw!r}")
    if isinstance(default, str):
        return raw
    if isinstance(default, (int, float)):
        return type(default)(raw)
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def metric_options(metric_cls: type, pairs: Sequence[str]) -> dict[str, Any]:
    """``key=value`` strings -> typed options, typed by the metric's Config defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(metric_cls.Config)}
    options = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise SystemExit(f"--option expects key=value, got {pair!r}")
        if key not in defaults:
            raise SystemExit(f"{metric_cls.info.name}: unknown option {key!r}; valid: {sorted(defaults)}")
        options[key] = _parse_value(raw, defaults[key])
    return options


def cmd_list(args: argparse.Namespace) -> int:
    from capeval_plugins import registry

    entries = sorted(registry.metrics().items())
    if args.json:
        rows = [
            {"name": name, "display_name": e.info.display_name, "plugin": e.plugin, "distribution": e.distribution,
             "references": e.info.references, "images": e.info.images, "video": e.info.video,
             "groups": e.info.groups, "description": e.info.description}
            for name, e in entries
        ]
        print(json.dumps(rows, indent=2))
        return 0
    header = ("name", "from", "references", "images", "description")
    rows = [
        (name, f"{e.distribution or '?'}:{e.plugin}", e.info.references,
         e.info.images + ("+video" if e.info.video else ""), e.info.description.split(". ")[0])
        for name, e in entries
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + row[4])
    return 0


def _init_distributed() -> tuple[int, int]:
    """torchrun / accelerate set WORLD_SIZE, RANK and the rendezvous variables."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def cmd_score(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from capeval_plugins import registry
    from capeval_plugins.adapters.torchmetrics import metric_class
    from capeval_plugins.caption_files import read_captions, write_scores
    from capeval_plugins.inputs import check_group_ids

    entry = registry.get(args.metric)
    options = metric_options(entry.cls, args.option or [])
    for key in ("model", "batch_size", "device", "dtype"):
        value = getattr(args, key)
        if value is not None:
            options[key] = value
    records = read_captions(args.captions, args.images)
    info = entry.info
    groups = None
    if info.groups:
        groups = check_group_ids([g if g is not None else img for g, img in zip(records.groups, records.images)], len(records))
    references = records.references if info.references != "never" and any(records.references) else None

    rank, world = _init_distributed()
    metric = metric_class(entry.info.name)(metric=entry.cls(**options))
    mine = list(range(rank, len(records), world))
    step = metric.capeval_metric.config.batch_size
    bar = tqdm(total=len(mine), desc=entry.info.name, unit="sample", disable=args.quiet or rank != 0)
    for start in range(0, len(mine), step):
        part = mine[start : start + step]
        metric.update(
            [records.images[i] for i in part] if info.images != "never" else None,
            [records.captions[i] for i in part],
            [references[i] for i in part] if references is not None else None,
            ids=part,
            group_ids=[groups[i] for i in part] if groups is not None else None,
        )
        bar.update(len(part))
    bar.close()
    result = metric.compute_all()  # merges every rank's states when torch.distributed is initialised
    if rank == 0:
        if args.out:
            write_scores(args.out, result)
        summary = {"metric": info.name, "score": result.score, "n": len(result), **result.corpus_extras}
        print(json.dumps(summary))
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


def cmd_tiny(args: argparse.Namespace) -> int:
    from capeval_plugins.testing import build_tiny, kinds

    if args.kind == "list":
        print("\n".join(kinds()))
        return 0
    path = build_tiny(args.kind, args.path, seed=args.seed)
    print(path)
    return 0


def cmd_evaluate_module(args: argparse.Namespace) -> int:
    from capeval_plugins.adapters.hf_evaluate import module_file

    print(module_file(args.metric, args.out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="capeval", description="Caption-evaluation metrics (capeval-plugins)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="every registered metric, where it came from and what it needs")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("score", help="score a caption file (JSON Lines) with one metric")
    p.add_argument("--metric", required=True, help="registered metric name (see `capeval list`)")
    p.add_argument("--captions", required=True, help='JSON Lines: {"image", "caption", "references"} per line')
    p.add_argument("--images", help="folder the image paths are relative to (default: the caption file's)")
    p.add_argument("--out", help="per-sample scores, JSON Lines (or CSV if it ends in .csv), input order")
    p.add_argument("--model", help="hub id or local path of the metric's model")
    p.add_argument("--batch-size", dest="batch_size", type=int)
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--option", "-o", action="append", metavar="KEY=VALUE", help="any metric option (repeatable)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("tiny", help="build a tiny random checkpoint (for tests; its scores are meaningless)")
    p.add_argument("kind", help="architecture, or 'list'")
    p.add_argument("path", nargs="?", default=".cache/tiny", help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_tiny)

    p = sub.add_parser("evaluate-module", help="write an evaluate module script (fallback without the hook)")
    p.add_argument("metric")
    p.add_argument("--out", help="folder (default: ~/.cache/capeval_plugins/evaluate_modules)")
    p.set_defaults(func=cmd_evaluate_module)

    from capeval_plugins.commands import add_all

    add_all(sub)  # bench, train, ...: one module each in capeval_plugins/commands/
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (KeyError, ValueError, FileNotFoundError) as err:
        from capeval_plugins.inputs import InputError

        if isinstance(err, (InputError, KeyError)):
            print(f"capeval: error: {err.args[0] if err.args else err}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
