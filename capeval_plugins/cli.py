"""``capeval``: list metrics, score a caption file, build tiny test checkpoints, and the subcommands of
``capeval_plugins/commands/`` (benchmarks, training, ...).

``capeval score`` also runs under ``torchrun`` / ``accelerate launch``: each rank scores its shard and the
states are merged through the same reduce step as the torchmetrics adapter.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from typing import Any, Iterator, Sequence

from capeval_plugins.core.bounds import cli_number


class UsageError(Exception):
    """A mistake in the command line or its inputs: one line on stderr, exit code 2."""


def cmd_list(args: argparse.Namespace) -> int:
    from capeval_plugins import registry

    entries = registry.listing()  # imports no metric (and so neither torch nor a model library)
    if args.json:
        rows = [{"name": e.name, "display_name": e.row["display_name"], "plugin": e.plugin,
                 "distribution": e.distribution, **{k: e.row[k] for k in registry.LISTED[2:]}} for e in entries]
        print(json.dumps(rows, indent=2))
        return 0
    header = ("name", "from", "references", "images", "description")
    rows = [
        (e.name, f"{e.distribution or '?'}:{e.plugin}", e.row["references"],
         e.row["images"] + ("+video" if e.row["video"] else ""), e.row["description"].split(". ")[0])
        for e in entries
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + row[4])
    return 0


def env_int(name: str, default: int) -> int:
    """A non-negative integer the launcher (torchrun, accelerate) sets, e.g. ``WORLD_SIZE``; anything else is a
    usage error naming the variable."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit() or len(text) > 9:
        raise UsageError(f"{name} must be a non-negative integer (torchrun sets it), got {text!r}")
    return int(text)


def _init_distributed() -> tuple[int, int]:
    """torchrun / accelerate set WORLD_SIZE, RANK and the rendezvous variables."""
    world = env_int("WORLD_SIZE", 1)
    if world <= 1:
        return 0, 1
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(env_int("LOCAL_RANK", 0))
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


QUIET_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
             "CAPEVAL_QUIET": "1"}  # the last: the Java tools of the classic metrics too (metrics/coco.py)


def quiet_libraries() -> None:
    """No progress bars from the model libraries either (weights loading, downloads), no Java lines. Undone
    when ``main`` returns, so a caller that runs the CLI in its own process keeps its environment."""
    os.environ.update(QUIET_ENV)
    if "transformers" in sys.modules:  # else it reads HF_HUB_DISABLE_PROGRESS_BARS when (if ever) imported
        sys.modules["transformers"].utils.logging.disable_progress_bar()


@contextlib.contextmanager
def restored_environment() -> Iterator[None]:
    """What ``quiet_libraries`` changes, put back as it was (variables and transformers' progress bars)."""
    saved = {key: os.environ.get(key) for key in QUIET_ENV}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if "transformers" in sys.modules and saved["TQDM_DISABLE"] is None:
            import warnings

            with warnings.catch_warnings():  # huggingface_hub read the variable at import and says so
                warnings.simplefilter("ignore")
                sys.modules["transformers"].utils.logging.enable_progress_bar()


def cmd_score(args: argparse.Namespace) -> int:
    if _rank() != 0:  # under torchrun only rank 0 draws progress bars (--quiet: _main, for every command)
        quiet_libraries()
    from capeval_plugins import options, runner
    from capeval_plugins.caption_files import check_writable, score_table, write_table

    given = input_files(args)
    shared = {key: str(value) for key in ("model", "batch_size", "device", "dtype", "on_error")
              if (value := getattr(args, key)) is not None}
    metrics = options.build_metrics(args.metric, args.option or [], shared)
    inputs = [*given, *runner.local_inputs(metrics.values())]
    kind = check_writable(args.out, inputs) if args.out else None
    # a stream (/dev/stdout, a FIFO) has no folder beside it to keep a run in: resumable with --run-dir only
    run_dir = args.run_dir or (f"{args.out}.capeval-run" if kind == "file" else None)
    if args.out:
        check_out_and_run_dir(args.out, run_dir)
    records = read_inputs(args)
    if args.out:
        check_not_an_image(args.out, records.images)
    if not len(records):
        raise UsageError(f"{records.path} holds no captions")
    if reads_image_files(metrics.values()):
        from capeval_plugins.caption_files import no_image_found
        from capeval_plugins.inputs import InputError

        missing = no_image_found(records, args.images)
        if missing:
            raise InputError(missing)  # (under torchrun, said by rank 0 only)
    uses_references = any(m.uses_references() for m in metrics.values())
    groups = None
    if any(g is not None for g in records.groups):
        groups = [g if g is not None else img for g, img in zip(records.groups, records.images)]
    corpus = runner.Corpus(
        candidates=records.captions,
        images=records.images if any(m.info.images != "never" for m in metrics.values()) else None,
        references=records.references if any(records.references) and uses_references else None,
        group_ids=groups,
        describe=records.describe,
    )

    rank, world = _init_distributed()
    try:
        with runner.stop_on_signals() as stop:
            outcome = runner.run(metrics, corpus, run_dir=run_dir, restart=args.restart, progress=not args.quiet,
                                 shard=True, gather_to=0, stop=stop)
        if rank == 0:
            table = score_table(outcome.results, records, metrics)
            if args.out:
                write_table(args.out, table, inputs)
            print(json.dumps(summary(outcome, table), allow_nan=False))
        if run_dir:
            runner.finish(run_dir, shard=True, run_id=outcome.run_id)
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, inside a batch
        if rank == 0:
            from capeval_plugins.checkpoint import MANIFEST

            saved = run_dir is not None and os.path.exists(os.path.join(run_dir, MANIFEST))
            kept = f"; finished batches are saved in {run_dir}, run the same command again to resume" if saved else ""
            print(f"capeval: interrupted{kept}", file=sys.stderr)
        return 130
    except runner.Interrupted as err:
        if rank == 0:
            if run_dir:
                print(f"capeval: {err}; run the same command again to resume, or add --restart to start over",
                      file=sys.stderr)
            else:
                print(f"capeval: {err}; nothing was kept (give --out or --run-dir to make a run resumable)",
                      file=sys.stderr)
        return 130
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


def input_files(args: argparse.Namespace) -> list[str]:
    """The files the captions come from: a caption file (``--captions``), a COCO results file with its
    annotation file (``--captions`` and ``--annotations``), bert-score's text files (``-c`` and ``-r``), or
    predictions and references joined by id (``--predictions`` and ``--references``)."""
    if args.predictions is not None:
        if args.captions is not None or args.annotations is not None or args.candidates is not None:
            raise UsageError("give either --predictions FILE --references FILE (two files joined by id), "
                             "--captions or -c/-r, not several")
        if not args.references or len(args.references) != 1:
            raise UsageError("--predictions FILE goes with one --references FILE (the references, joined by id)")
        return [args.predictions, args.references[0]]
    if args.candidates is not None:
        if args.captions is not None or args.annotations is not None:
            raise UsageError("give either -c/-r (plain text files) or --captions (a caption file or a COCO results "
                             "file with --annotations), not both")
        return [args.candidates, *(args.references or [])]
    if args.references:
        raise UsageError("-r (references, one per line) goes with -c (candidates, one per line), or --references "
                         "FILE with --predictions FILE (joined by id)")
    if args.captions is None:
        raise UsageError("give the captions to score: --captions FILE (a caption file; a COCO results file with "
                         "--annotations), -c CANDIDATES.txt -r REFERENCES.txt, or --predictions FILE "
                         "--references FILE (joined by id)")
    return [args.captions] + ([args.annotations] if args.annotations else [])


def read_inputs(args: argparse.Namespace) -> Any:
    from capeval_plugins.caption_files import read_captions, read_coco_results, read_text_pairs

    if args.predictions is not None:
        from capeval_plugins.caption_ids import read_joined

        return read_joined(args.predictions, args.references[0], args.images)
    if args.candidates is not None:
        return read_text_pairs(args.candidates, args.references or [])
    if args.annotations is not None:
        return read_coco_results(args.captions, args.annotations, args.images)
    return read_captions(args.captions, args.images)


def reads_image_files(metrics: Any) -> bool:
    """Whether any of ``metrics`` reads the records' images as pixel files (not, e.g., as names of precomputed
    region features)."""
    from capeval_plugins.inputs import InputError

    for metric in metrics:
        if metric.info.images == "never":
            continue
        try:
            if metric.image_reader() is None:
                return True
        except InputError:  # a reader misconfigured: its own error comes in its turn
            continue
    return False


def check_out_and_run_dir(out: str, run_dir: str | None) -> None:
    """The output is never one of the run folder's own files (they are deleted when the run ends)."""
    from pathlib import Path

    from capeval_plugins.checkpoint import LOCK, MANIFEST, RUN

    if run_dir is None:
        return
    target, folder = Path(os.path.realpath(out)), Path(os.path.realpath(run_dir))
    if target == folder:
        raise UsageError(f"--out {out} and --run-dir {run_dir} are the same path; give them different names")
    if (target.parent == folder and target.name.startswith((MANIFEST, LOCK, RUN))) or (
            target.parent.parent == folder and target.parent.name.startswith("rank-")):
        raise UsageError(f"--out {out} is a file name capeval uses in the run folder {run_dir}; give another name")


def check_not_an_image(out: str, images: Sequence[Any]) -> None:
    """``--out`` is none of the images (by path, or the same file under another name: a link)."""
    try:
        st = os.stat(out)
    except OSError:
        return
    for image in images:
        if isinstance(image, str):
            try:
                other = os.stat(image)
            except OSError:
                continue
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                raise UsageError(f"--out {out} is an image of the caption file ({image}); give another file name")


def summary(outcome: Any, table: list[dict]) -> dict[str, Any]:
    """The closing line: counts, and per metric its corpus score and corpus extras (strict JSON)."""
    from capeval_plugins.caption_files import json_safe

    metrics = {}
    for name, result in outcome.results.items():
        extras = {k: v for k, v in result.corpus_extras.items() if k not in ("n_invalid", "n_skipped")}
        metrics[name] = {"score": result.score, "n_invalid": int(result.corpus_extras.get("n_invalid", 0)),
                         "n_skipped": len(result.skipped), **extras}
    return json_safe({"n": len(table), "n_skipped": sum("error" in row for row in table),
                      "batches_scored": outcome.batches_scored, "batches_resumed": outcome.batches_resumed,
                      "metrics": metrics})


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

    p = sub.add_parser("score", help="score a caption file with one or more metrics in one pass",
                       description=SCORE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metric", "-m", action="append", required=True,
                   help="registered metric name (repeatable; see `capeval list`)")
    p.add_argument("--captions",
                   help='JSON Lines ({"image", "caption", "references"} per line), or .csv / .tsv / .parquet with '
                        "those columns (references: a JSON list in the cell; a list column in Parquet); with "
                        '--annotations, a COCO results file ([{"image_id", "caption"}])')
    p.add_argument("--annotations", metavar="COCO_JSON",
                   help="a COCO annotation file (captions_val2014.json): --captions is then a COCO results file, "
                        "each result's references are its image's captions there and its image the file_name "
                        "there, under --images")
    p.add_argument("-c", "--candidates", metavar="TXT",
                   help="plain text, one candidate caption per line (bert-score's -c); instead of --captions")
    p.add_argument("-r", "--references", metavar="TXT", nargs="+", action="extend",
                   help="plain text, one reference per line, line i for candidate i (bert-score's -r; several "
                        "files give several references); with --predictions, the references file joined by id")
    p.add_argument("--predictions", metavar="FILE",
                   help='predictions keyed by id ([{"id", "caption"}] or {id: caption}; JSON, JSON Lines, CSV, '
                        'Parquet), joined by id with --references FILE ([{"id", "references", "image"}] or '
                        "{id: [refs]}); instead of --captions")
    p.add_argument("--images", help="folder the image paths are relative to (default: the caption file's)")
    p.add_argument("--out", help="per-sample scores: .jsonl, .json (one array), .csv or .parquet (one row per "
                   "sample, input order)")
    p.add_argument("--model", help="model of every selected metric that takes one (same as -o model=...)")
    p.add_argument("--batch-size", dest="batch_size", type=int,
                   help="samples per batch, for every selected metric (same as -o batch_size=N; default: each "
                        "metric's own)")
    p.add_argument("--device", help="where the models run: cpu, cuda, cuda:1, mps (same as -o device=...; default: "
                                    "cuda when available, else cpu)")
    p.add_argument("--dtype", help="model weights' dtype: float32, float16, bfloat16 (same as -o dtype=...; "
                                   "default: float32 on CPU, each metric's own on a GPU)")
    p.add_argument("--on-error", dest="on_error", choices=("raise", "skip"),
                   help="a sample that cannot be scored: stop before scoring (raise, default) or skip it")
    p.add_argument("--option", "-o", action="append", metavar="[METRIC.]KEY=VALUE",
                   help="a metric option (repeatable); without METRIC. it goes to every metric that takes it")
    p.add_argument("--run-dir", dest="run_dir", help="checkpoint folder, new or empty (default: <out>.capeval-run); "
                   "capeval deletes only the files it wrote there")
    p.add_argument("--restart", action="store_true", help="discard an unfinished (or damaged) run in the checkpoint "
                   "folder")
    p.add_argument("--quiet", action="store_true", help="no progress bars (ours or the model libraries')")
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("tiny", help="build a tiny random checkpoint (for tests; its scores are meaningless)")
    p.add_argument("kind", help="architecture, or 'list'")
    p.add_argument("path", nargs="?", default=".cache/tiny", help="output folder")
    p.add_argument("--seed", type=cli_number(int, ge=0), default=0)
    p.set_defaults(func=cmd_tiny)

    p = sub.add_parser("evaluate-module", help="write an evaluate module script (fallback without the hook)")
    p.add_argument("metric")
    p.add_argument("--out", help="folder (default: $CAPEVAL_CACHE/evaluate_modules, else "
                   "$XDG_CACHE_HOME/capeval_plugins/evaluate_modules, else ~/.cache/capeval_plugins/evaluate_modules)")
    p.set_defaults(func=cmd_evaluate_module)

    from capeval_plugins.commands import add_all

    add_all(sub)  # bench, train, ...: one module each in capeval_plugins/commands/
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 done, 2 a usage or input error, or a missing model, runtime (Java) or optional dependency
    (one line on stderr, before any work), 130 interrupted, 141 the reader of the output went away (``capeval
    list | head``), 1 a bug (with its traceback: a KeyError or an ImportError from inside the code is one)."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # nothing more can be printed; the interpreter's own flush at exit must not complain either
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def typed_errors() -> tuple[type[Exception], ...]:
    """The errors reported in one line, exit 2. Called by ``_main``'s ``except`` only once something was raised,
    so that a command that needs none of their modules (``capeval list``) does not import them (torch)."""
    from capeval_plugins.core.messages import DataError, ExternalToolError, MissingExtra, ModelLoadError, UnknownName
    from capeval_plugins.inputs import InputError
    from capeval_plugins.preflight import RequirementError

    return (UsageError, InputError, DataError, ExternalToolError, UnknownName, ModelLoadError, MissingExtra,
            RequirementError)


# Options naming a file or folder: an empty one (``--out "$OUT"`` with OUT unset) is refused, not read as absent.
PATH_OPTIONS = ("out", "run_dir", "json_out", "markdown_out", "plot", "cache", "captions", "images", "references",
                "predictions", "annotations", "data", "scores", "expected", "destination", "ratings")


def empty_path_option(args: argparse.Namespace) -> str | None:
    for dest in PATH_OPTIONS:
        value = getattr(args, dest, None)
        if isinstance(value, str) and not value.strip():
            return "--" + (dest.removesuffix("_out") if dest.endswith("_out") else dest).replace("_", "-")
    return None


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        empty = empty_path_option(args)
        if empty:
            raise UsageError(f"{empty}: an empty path (an unset variable?); give a file or folder")
        with restored_environment(), one_line_warnings():
            if getattr(args, "quiet", False):  # every command's --quiet: the libraries' bars and Java lines too
                quiet_libraries()
            return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C outside a run (loading, reading): one line, not a traceback
        print("capeval: interrupted", file=sys.stderr)
        return 130
    except typed_errors() as err:
        # typed errors only: an unknown name, a missing optional extra (accelerate, torchvision, ...), bad input
        from capeval_plugins.inputs import InputError

        message = getattr(err, "cli_message", None) or (err.args[0] if err.args else str(err))
        # every rank validates the same input: rank 0 reports that; a rank reports what only it found
        if _rank() == 0 or not isinstance(err, InputError) or getattr(err, "rank_specific", False):
            print(f"capeval: error: {message}", file=sys.stderr)
        return 2
    except OSError as err:  # the machine's, not a bug: a full disk, a read-only folder, a file left unreadable
        from capeval_plugins.files import is_environment_error

        if not is_environment_error(err):
            raise
        where = f": {err.filename}" if err.filename else ""
        print(f"capeval: error: {err.strerror or err}{where}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """The package's own warnings as ``capeval: warning: ...`` (Python's format adds the file, the line and the
    source line of the call, which tell a user of the command nothing); other libraries' keep theirs."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not os.path.abspath(filename).startswith(package):
            return shown(message, category, filename, lineno, file, line)
        print(f"capeval: warning: {message}", file=sys.stderr if file is None else file)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _rank() -> int:
    try:
        return env_int("RANK", 0)
    except UsageError:
        return 0  # reported by _init_distributed when it matters


SCORE_HELP = """Score a caption file with one or more metrics in one pass.

Every input is checked before any model loads; problems are listed by row (`sample 250 (captions.jsonl
line 251)`). With --out, finished batches are saved in <out>.capeval-run (or --run-dir): after Ctrl-C,
a crash or a pre-emption, the same command resumes where it stopped; --restart starts over. A run
folder is made only in a new or empty folder, locked while a run uses it, and only the files capeval wrote
there are ever deleted. Runs under torchrun too (each rank scores a share; resume with the same number of
ranks).

Exit codes: 0 done; 2 a usage or input error; 130 interrupted (resumable); 1 a bug.

examples:
  capeval score -m clipscore -m refclipscore -m msd_score --model openai/clip-vit-base-patch32 \\
      --images examples/images --captions examples/captions.jsonl --out scores.jsonl
  capeval score -m clipscore -m bertscore -o clipscore.model=openai/clip-vit-base-patch32 \\
      -o bertscore.model=roberta-large --captions caps.jsonl --out scores.parquet --on-error skip
  capeval score -m cider -m clipscore --model openai/clip-vit-base-patch32 --captions results.json \\
      --annotations annotations/captions_val2014.json --images val2014 --out scores.jsonl
  capeval score -m bertscore -c cands.txt -r refs.txt --out scores.jsonl
  capeval score -m cider -m bleu4 --predictions preds.json --references refs.json --out scores.jsonl"""


if __name__ == "__main__":
    sys.exit(main())
