"""``capeval reproduce [--metric NAME ...] [--benchmark NAME ...]``: run metrics on the benchmarks their papers
report and compare with the published figures shipped with the package (each with its paper and table).

Prints a status table: per published figure, the measured one and whether it is reproduced within the paper's
rounding, not reproduced, or not runnable here (and why: a metric not installed, no data, weights not in the
cache, no GPU). ``--dry-run`` lists the pairs and what each needs without running anything (nor fetching).
Benchmarks with a public home are fetched on first use (as ``capeval bench`` does); others need
``--data BENCH=PATH``."""
from __future__ import annotations

import argparse
import json
import sys
import time

from capeval_plugins.core.bounds import cli_number

EPILOG = """examples:
  capeval reproduce --dry-run                                   # every pair with a published value
  capeval reproduce --metric bleu4 --metric cider --benchmark flickr8k-expert --data flickr8k-expert=flickr8k.json
  capeval reproduce --benchmark composite --limit 200           # a smoke pass on 200 rows
  capeval reproduce --metric fleur --benchmark flickr8k-expert --scores fleur:flickr8k-expert=fleur_expert.jsonl
  capeval reproduce --json reproduce.json --markdown reproduce.md"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "reproduce", help="run metrics on benchmarks and compare with the figures their papers publish",
        description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metric", action="append", default=[],
                   help="a metric (registered name, e.g. bleu4) or a table entry (e.g. discode_lv); repeatable "
                        "(default: every one with a published value)")
    p.add_argument("--benchmark", action="append", default=[], help="a benchmark; repeatable (default: all)")
    p.add_argument("--data", action="append", default=[], metavar="BENCH=PATH",
                   help="a benchmark's local file or folder (instead of fetching it; needed for benchmarks capeval "
                        "does not fetch)")
    p.add_argument("--images", action="append", default=[], metavar="BENCH=DIR",
                   help="a benchmark's image (or video frame) folder (fetched benchmarks bring theirs)")
    p.add_argument("--scores", action="append", default=[], metavar="ENTRY:BENCH=FILE",
                   help="per-sample scores computed elsewhere for one pair (e.g. FLEUR's released outputs), read "
                        "as `capeval bench --scores` reads them; ENTRY is the table's entry (fleur, reffleur, ...: "
                        "see --dry-run --json)")
    p.add_argument("--option", "-o", action="append", default=[], metavar="METRIC.KEY=VALUE",
                   help="an option of one metric, on top of the paper's (e.g. rigel.checkpoint=DIR)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the pairs, their published values and what each needs (data, weights, GPU); run "
                        "nothing, fetch nothing")
    p.add_argument("--limit", type=cli_number(int, ge=1), metavar="N",
                   help="a smoke pass: the first N rows (or pairs) of every benchmark, not compared (the later "
                        "rows of a row-keyed --scores file are left out)")
    p.add_argument("--refresh", action="store_true", help="fetch the benchmarks anew (see capeval bench --refresh)")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write the rows and the runs as JSON here")
    p.add_argument("--markdown", dest="markdown_out", metavar="OUT", help="write the status table here")
    p.add_argument("--cache", metavar="FILE",
                   help="score cache (default: $CAPEVAL_CACHE/bench/scores.sqlite, else "
                        "~/.cache/capeval_plugins/bench/scores.sqlite)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write cached scores")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_reproduce)


def pairs_of(values: list[str], what: str, sep: str = "=") -> dict[str, str]:
    from capeval_plugins.inputs import InputError

    out = {}
    for value in values:
        key, found, rest = value.partition(sep)
        if not found or not key.strip() or not rest.strip():
            raise InputError(f"{what} expects {'BENCH' if sep == '=' else 'METRIC'}{sep}..., got {value!r}")
        out[key.strip()] = rest.strip()
    return out


def unused_inputs(pairs: list, inputs) -> list[str]:
    """What the user gave that no selected pair uses (a benchmark without a published value of the selected
    metrics), one line each: said, never silently ignored."""
    benchmarks = sorted({p.setting.benchmark for p in pairs})
    entries = {(p.entry.id, p.setting.benchmark) for p in pairs} | {(p.entry.metric, p.setting.benchmark) for p in pairs}
    out = []
    for option, given in (("--data", inputs.data), ("--images", inputs.images)):
        for bench, path in given.items():
            if bench not in benchmarks:
                out.append(f"{option} {bench}={path} is not used: the selected metrics have no published value on "
                           f"{bench} (they have on: {', '.join(benchmarks)})")
    for (entry, bench), path in inputs.scores.items():
        if (entry, bench) not in entries:
            out.append(f"--scores {entry}:{bench}={path} is not used: no selected metric has a published value "
                       f"named {entry} on {bench}")
    return out


def cmd_reproduce(args: argparse.Namespace) -> int:
    from capeval_plugins import files
    from capeval_plugins.bench import reproduce as rp
    from capeval_plugins.bench.benchmarks import BENCHMARKS
    from capeval_plugins.core.messages import unknown_name
    from capeval_plugins.inputs import InputError

    started = time.perf_counter()
    scores = {}
    for name_bench, path in pairs_of(args.scores, "--scores").items():
        name, found, bench = name_bench.partition(":")
        if not found:
            raise InputError(f"--scores expects ENTRY:BENCH=FILE, got {name_bench}={path}")
        scores[(name, bench)] = path
    inputs = rp.Inputs(data=pairs_of(args.data, "--data"), images=pairs_of(args.images, "--images"), scores=scores,
                       options=args.option)
    for name in dict.fromkeys([*args.benchmark, *inputs.data, *inputs.images]):
        if name not in BENCHMARKS:
            raise unknown_name("benchmark", name, list(BENCHMARKS))
    values = rp.load_published()
    known = {v.entry.id for v in values} | {v.entry.metric for v in values}
    missing = [m for m in args.metric if m not in known]
    if missing:
        raise InputError(f"no published value for {', '.join(missing)}; the table has {', '.join(sorted(known))}")
    pairs = rp.select(values, args.metric, args.benchmark)
    if not pairs:
        raise InputError("no published value for these metrics on these benchmarks")
    for line in unused_inputs(pairs, inputs):
        print(f"capeval: note: {line}", file=sys.stderr)
    outputs = [o for o in (args.json_out, args.markdown_out) if o]
    for out in outputs:
        files.check_output(out, [*inputs.data.values(), *inputs.scores.values()])
    plans = rp.plan(pairs, inputs, fetch_now=not args.dry_run, refresh=args.refresh, progress=not args.quiet)
    if args.dry_run:
        text = rp.dry_run_markdown(plans, rp.benchmark_notes())
        print(text)
        if args.markdown_out:
            files.write_output(args.markdown_out, (text + "\n").encode(), what="--markdown")
        if args.json_out:
            doc = {"pairs": [{"entry": p.pair.entry.id, "metric": p.pair.entry.metric, "label": p.pair.entry.label,
                              "setting": p.pair.setting.key, "data": p.data, "weights": p.weights,
                              "gpu": p.pair.entry.gpu, "runnable": p.problem is None, "problem": p.problem,
                              "published": [{"statistic": v.statistic, "value": v.value, "source": v.source}
                                            for v in p.pair.values]} for p in plans]}
            files.write_output(args.json_out, (json.dumps(doc, indent=1) + "\n").encode(), what="--json")
        return 0
    rows, runs = rp.reproduce(plans, inputs, limit=args.limit, cache=False if args.no_cache else args.cache,
                              progress=not args.quiet)
    text = rp.markdown(rows, rp.benchmark_notes())
    print(text)
    wall = time.perf_counter() - started
    print(f"\nwall time: {wall:.1f} s", file=sys.stderr)
    if args.markdown_out:
        files.write_output(args.markdown_out, (text + "\n").encode(), what="--markdown")
    if args.json_out:
        doc = {"limit": args.limit, "summary": rp.summary(rows), "rows": [r.to_dict() for r in rows], "runs": runs,
               "wall_time_s": round(wall, 3)}
        files.write_output(args.json_out, (json.dumps(doc, indent=1) + "\n").encode(), what="--json")
    return 0
