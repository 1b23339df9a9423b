"""``capeval bench <benchmark> --data PATH [--images DIR] (--metric NAME | --scores NAME=FILE) ...``: correlation
or accuracy of registered metrics, or of per-sample scores computed elsewhere, against human judgments, with
the protocol each benchmark's official evaluation code uses.

Prints a markdown table (and the paired comparisons when several metrics run), writes the JSON report with
``--json`` and a PNG with ``--plot``. Per-sample scores are cached (``--cache``, ``--no-cache``). Without ``--data``,
a benchmark with a public home (Flickr8k-Expert / CF, Composite, Nebula, Polaris, DOCENT, LongCap-Arena) is fetched
from the Hugging Face Hub on first use and read from the cache afterwards (``--refresh`` fetches it anew)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from dataclasses import replace
from typing import Sequence

from capeval_plugins.core.bounds import cli_number
from capeval_plugins import files
from capeval_plugins.core.messages import install_extra

EPILOG = """examples:
  capeval bench composite --metric bleu4 --metric clipscore        # fetched on first use, then cached
  capeval bench flickr8k-expert --data flickr8k.json --metric bleu4 --metric cider --json out.json
  capeval bench pascal50s --data pascal_50s.json --images VOC2012/JPEGImages --metric clipscore \\
      --option clipscore.model=openai/clip-vit-base-patch32 --plot plots/
  capeval bench sugarcrepe --data sugar-crepe/data --images val2017 --metric clipscore --save-scores scores/
  capeval bench youcook2-fact --data FactVC/data/youcook2 --scores theirs=their_scores.jsonl --metric cider
  capeval bench nebula --data nebula_test.json --function mine=my_metric.py:score --metric cider
  capeval bench caparena --data caparena_annots_eval.json --images caparena/images --metric soft_msd \
      --protocol msd-score --option soft_msd.aligner=ALIGNER_DIR
  capeval bench pascal50s --data pascal_50s.json --scores fleur=fleur_pascal.jsonl --labels FLEUR/results"""


def add_parser(subparsers) -> None:
    from capeval_plugins.bench.benchmarks import benchmark_names

    p = subparsers.add_parser(
        "bench", help="correlation / accuracy of metrics against human judgments on a benchmark",
        description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    # not argparse's choices: a typo gets one line with the close names (did you mean), not the usage
    p.add_argument("benchmark", metavar="BENCHMARK", help=f"one of: {', '.join(benchmark_names())}")
    p.add_argument("--data", help="the benchmark's file, or the folder holding its files (default: fetched from the "
                                  "benchmark's public home on first use, then read from the cache)")
    p.add_argument("--refresh", action="store_true",
                   help="without --data: fetch the benchmark anew (the revision its home serves now), replacing the "
                        "cached copy, also one that changed since it was fetched")
    p.add_argument("--no-corrections", action="store_true",
                   help="without --data: the fetched file's own human judgments, not the published corrections "
                        "applied by default (Nebula: Spica's corrected scores)")
    p.add_argument("--images", help="image folder (needed only by metrics that score images)")
    p.add_argument("--metric", "-m", action="append", default=[],
                   help="registered metric name (repeatable; all of them are scored in one pass over the images)")
    p.add_argument("--scores", action="append", default=[], metavar="NAME=FILE",
                   help="per-sample scores computed elsewhere: JSON Lines / CSV / Parquet with score and the "
                        "benchmark row (row), or image (its path, its file name, or that name without suffix) and "
                        "caption (repeatable; compared with the --metric runs; which key matched is printed)")
    p.add_argument("--function", action="append", default=[], metavar="NAME=MODULE:FUNCTION",
                   help="a scoring function of your own, fn(images, candidates, references) -> one score per row "
                        "(an importable module or a .py file; repeatable; evaluated like a metric)")
    p.add_argument("--save-scores", metavar="DIR",
                   help="write every metric's per-row scores (and extras) to DIR/<name>.jsonl, readable by --scores")
    p.add_argument("--frames", action="append", default=[], metavar="[METRIC=]N",
                   help="video benchmarks: sample N frames uniformly from each video's frame folder, for every "
                        "metric or for one (repeatable; EMScore's VATEX-EVAL protocol: 10; default: every frame)")
    p.add_argument("--extras", action="store_true",
                   help="also report each metric's per-sample extras as rows of their own (metric:extra)")
    p.add_argument("--num-references", type=cli_number(int, ge=0), metavar="N",
                   help="keep the first N references of every row (0: none; VATEX-EVAL: 1 or 9)")
    p.add_argument("--option", "-o", action="append", default=[], metavar="[METRIC.]KEY=VALUE",
                   help="an option of one metric, e.g. clipscore.model=PATH, or of every metric that takes it "
                        "(repeatable)")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write the JSON report here")
    p.add_argument("--plot", metavar="DIR", help="write <benchmark>.png into this folder")
    p.add_argument("--cache", metavar="FILE",
                   help="score cache (default: $CAPEVAL_CACHE/bench/scores.sqlite, else "
                        "~/.cache/capeval_plugins/bench/scores.sqlite)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write cached scores")
    p.add_argument("--bootstrap", type=cli_number(int, ge=0), default=1000, metavar="N",
                   help="bootstrap replicates (0: none)")
    p.add_argument("--bootstrap-unit", choices=("image", "row"), default="image",
                   help="what the bootstrap resamples (default: images, so rows of one image stay together)")
    p.add_argument("--seed", type=cli_number(int, ge=0), default=0, help="bootstrap seed")
    p.add_argument("--ties", choices=("wrong", "half", "tie", "b"), default=None,
                   help="pairwise benchmarks: a tied pair counts as wrong, half right, as a predicted tie "
                        "(right where humans judged a tie: CapArena), or as a vote for the pair's second "
                        "caption B (Polos's Pascal-50S code) (default: the benchmark's official script's "
                        "convention, see docs/bench.md)")
    p.add_argument("--tie-margin", type=tie_margin, default=None, metavar="D|calibrated",
                   help="pairwise benchmarks: scores within D of each other are a metric tie (default: the "
                        "protocol's, 0 = equal scores only for the official ones, 1e-4 for MSD-Score's CapArena "
                        "protocol); 'calibrated': below the k-th smallest score difference, k = the human ties "
                        "(PoSh's CapArena reading)")
    p.add_argument("--protocol", default=None, metavar="NAME",
                   help="judge by another protocol of this benchmark: 'msd-score' on caparena and docent "
                        "(MSD-Score's own scripts, its Tables III and IV); default: the benchmark's official one")
    p.add_argument("--shuffle-rounds", type=cli_number(int, ge=1), default=None, metavar="R",
                   help="caparena --protocol msd-score: average the single-pass Elo ratings over R shuffles of the "
                        "battles, as its caparena.py --shuffle_rounds (default 1, the script's; its README runs 5)")
    p.add_argument("--labels", metavar="FILE|DIR",
                   help="human judgments that replace the benchmark file's where they name the same rows: pair "
                        "labels (JSON / JSON Lines / CSV, or FLEUR's released result texts, e.g. its Pascal-50S "
                        "run) or per-row scores (averaged per image and caption); see docs/bench.md")
    p.add_argument("--human-scale", type=human_scale, default=None, metavar="LOW,HIGH",
                   help="rating benchmarks: the scale this file's human scores are on, when it is not the "
                        "benchmark's published one (a human score outside the scale is refused, naming its row; "
                        "with a negative LOW write --human-scale=LOW,HIGH)")
    p.add_argument("--with-references", action="store_true",
                   help="also give references to metrics for which they are optional")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_bench)


def build_metrics(names: Sequence[str], options: Sequence[str], benchmark: str | None = None) -> dict:
    """The metrics, with ``metric.key=value`` options (and bare ``key=value`` for every metric that takes
    it), exactly as ``capeval score`` builds them, after the benchmark's own defaults for its metrics."""
    from capeval_plugins.bench.benchmarks import metric_options
    from capeval_plugins.options import build_metrics as build

    if benchmark is not None:
        given = list(options)
        options = metric_options(benchmark, names, given)
        added = options[: len(options) - len(given)]
        if added:
            print(f"benchmark defaults: {', '.join(added)} (--option overrides)", file=sys.stderr)
    return build(names, options, {})


def scoring_functions(values: Sequence[str], metrics: dict) -> dict:
    """``--function NAME=MODULE:FUNCTION`` -> ``{name: function}``; a name given twice, or also a --metric's,
    is refused."""
    from capeval_plugins.commands._functions import load_function
    from capeval_plugins.inputs import InputError

    out: dict = {}
    for value in values:
        name, sep, spec = value.partition("=")
        name = name.strip()
        if not sep or not name or not spec.strip():
            raise InputError(f"--function expects NAME=MODULE:FUNCTION, got {value!r}")
        if name in out or name in metrics:
            raise InputError(f"--function: {name!r} names two metrics")
        out[name] = load_function(spec.strip(), "--function")
    return out


def human_scale(value: str) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH (two numbers), got {value!r}") from None
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise argparse.ArgumentTypeError(f"expected two finite numbers LOW < HIGH, got {value!r}")
    return low, high


def tie_margin(value: str) -> float | str:
    if value == "calibrated":
        return value
    try:
        margin = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or 'calibrated', got {value!r}") from None
    if not margin >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or 'calibrated', got {value!r}")
    return margin


def parse_frames(values: Sequence[str]) -> int | dict[str, int] | None:
    """``--frames N`` (every metric) or ``--frames METRIC=N`` (one metric), repeatable."""
    from capeval_plugins.inputs import InputError

    every, per = None, {}
    for value in values:
        name, _, count = value.rpartition("=")
        if not count.strip().isdigit() or int(count) < 1:
            raise InputError(f"--frames expects N or METRIC=N with N >= 1, got {value!r}")
        if name:
            per[name.strip()] = int(count)
        else:
            every = int(count)
    if not per:
        return every
    return {**({} if every is None else {"*": every}), **per}


def check_outputs(args: argparse.Namespace, score_files: dict, metrics: dict) -> list[str]:
    """``--json`` and ``--plot``, refused before any metric runs (a link, a folder, an input of the run); the
    inputs, for the writes at the end."""
    from capeval_plugins.bench.plots import plot_path
    from capeval_plugins.bench.runner import run_inputs
    from capeval_plugins.caption_files import check_writable

    cache = None if args.no_cache else args.cache
    inputs = run_inputs(args.data, args.images, score_files, metrics, cache)
    if args.json_out:
        check_writable(args.json_out, inputs, "--json")
    if args.plot:
        files.Folder.open(args.plot, create=True)[0].close()
        check_writable(plot_path(args.benchmark, args.plot), inputs, "--plot")
    return inputs


def fetched_data(args: argparse.Namespace):
    """Without ``--data``: the benchmark from the cache, fetched first when needed; ``args.data``, ``args.images``
    and ``args.labels`` then name the cached copy (the user's ``--images`` / ``--labels`` win)."""
    from capeval_plugins.bench import fetch

    if args.data is not None:
        if args.refresh or args.no_corrections:
            raise fetch.FetchError("--refresh and --no-corrections apply to fetched data; they do nothing with --data")
        return None
    fetched = fetch.fetch(args.benchmark, refresh=args.refresh, progress=not args.quiet)
    args.data = str(fetched.data)
    args.images = args.images or (str(fetched.images) if fetched.images else None)
    if fetched.labels is not None:
        applied = args.labels is None and not args.no_corrections
        fetched.provenance["corrections"]["applied"] = applied
        args.labels = str(fetched.labels) if applied else args.labels
    return fetched


def cmd_bench(args: argparse.Namespace) -> int:
    from capeval_plugins.bench.plots import plot_report
    from capeval_plugins.bench.runner import run_benchmark

    started = time.perf_counter()
    from capeval_plugins.bench.benchmarks import get_benchmark

    benchmark = get_benchmark(args.benchmark)  # an unknown name: one line, before anything else
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(f"capeval: error: --plot needs matplotlib: {install_extra('bench')}", file=sys.stderr)
        return 2
    if not args.metric and not args.scores and not args.function:
        print("capeval: error: give --metric NAME, --function NAME=MODULE:FUNCTION or --scores NAME=FILE",
              file=sys.stderr)
        return 2
    known = benchmark.protocols()
    if args.protocol is not None and args.protocol not in known:
        print(f"capeval: error: {args.benchmark} has no protocol {args.protocol!r}; known: {', '.join(known)}",
              file=sys.stderr)
        return 2
    try:
        from capeval_plugins.bench.scorefiles import parse_score_args

        score_files = parse_score_args(args.scores)
        metrics = build_metrics(args.metric, args.option, args.benchmark) if args.metric else {}
        metrics.update(scoring_functions(args.function, metrics))
        fetched = fetched_data(args)
        inputs = check_outputs(args, score_files, metrics)
        report = run_benchmark(
            args.benchmark, args.data, metrics, images=args.images,
            cache=False if args.no_cache else args.cache, bootstrap=args.bootstrap, seed=args.seed,
            unit=args.bootstrap_unit, ties=args.ties, with_references=args.with_references, progress=not args.quiet,
            scores=score_files, extras=args.extras, save_scores=args.save_scores,
            num_references=args.num_references, tie_margin=args.tie_margin, frames=parse_frames(args.frames),
            protocol=args.protocol, labels=args.labels, shuffle_rounds=args.shuffle_rounds,
            human_scale=args.human_scale)
    except RuntimeError as err:  # a missing runtime (Java, SPICE's jars): one line, not a traceback
        print(f"capeval: error: {err}", file=sys.stderr)
        return 2
    report.wall_time = time.perf_counter() - started
    if fetched is not None:
        report.data = replace(report.data, notes={**report.data.notes, "fetched": fetched.provenance})
        print(f"data: {fetched.provenance['repository']} at {fetched.provenance['revision'][:12]} "
              f"(cached in {fetched.provenance['cache']})")
    for name, run in report.runs.items():  # which key of each --scores file found its rows
        if run.source and name in score_files:
            print(f"{name}: {run.source} matched by {run.matched_by}", file=sys.stderr)
    print(report.markdown())
    if args.plot:
        print(f"\nplot: {plot_report(report, args.plot, inputs)}")
    if args.json_out:
        text = json.dumps(report.to_dict(), indent=2, allow_nan=False)  # strict JSON: no NaN (to_dict says null)
        files.write_output(args.json_out, (text + "\n").encode(), inputs, "--json")
        print(f"json: {args.json_out}")
    if args.save_scores:
        print(f"scores: {args.save_scores}/")
    print(f"\nwall time: {report.wall_time:.1f} s")
    return 0
