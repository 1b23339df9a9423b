"""``capeval verify RESULTS --expected EXPECTED [--tolerance T]``: your results (a ``capeval bench --json``
report, ``capeval score``'s summary line, any JSON of numbers) checked against your expected values, each
within a tolerance, as ``capeval reproduce`` checks the published values it ships.

EXPECTED mirrors RESULTS down to the numbers to check (``{"results": {"cider": {"kendall_tau_c": 43.9}}}``); a
value may carry its own tolerance (``{"value": 43.9, "tolerance": 0.3}``). Default tolerance: half a unit of the
expected value's last written digit. Exit code 0 when every value is within its tolerance, 3 when one is outside
or missing, 2 for unreadable input."""
from __future__ import annotations

import argparse
import json

EPILOG = """examples:
  capeval bench flickr8k-expert --metric cider --json expert.json
  capeval verify expert.json --expected my_expected.json
  capeval score -m cider --captions caps.jsonl > summary.json && capeval verify summary.json \\
      --expected '{"metrics": {"cider": {"score": 0.912}}}' --tolerance 0.001"""

OUTSIDE = 3  # a value outside its tolerance, or missing: a failed check, not an input error


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "verify", help="check results against your expected values within a tolerance",
        description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="a JSON file of results (capeval bench --json, capeval score's summary, ...)")
    p.add_argument("--expected", required=True, metavar="FILE|JSON",
                   help="a JSON file mirroring the results down to the values to check, or that JSON itself")
    p.add_argument("--tolerance", type=float, default=None, metavar="T",
                   help="absolute tolerance of every value without its own (default: half a unit of its last "
                        "written digit)")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write every check as JSON here")
    p.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    from capeval_plugins import files
    from capeval_plugins.bench.verify import loads_keeping_digits, markdown, verify
    from capeval_plugins.inputs import InputError

    expected = args.expected
    if expected.lstrip().startswith("{"):
        try:
            expected = loads_keeping_digits(expected)  # 0.10 keeps the digit that sets its tolerance
        except json.JSONDecodeError as err:
            raise InputError(f"--expected: not valid JSON ({err})") from None
    if args.json_out:
        files.check_output(args.json_out, [p for p in (args.results, args.expected) if isinstance(p, str)])
    checks = verify(args.results, expected, args.tolerance)
    print(markdown(checks))
    if args.json_out:
        doc = {"results": args.results, "checks": [c.to_dict() for c in checks]}
        files.write_output(args.json_out, (json.dumps(doc, indent=1) + "\n").encode(), what="--json")
    return 0 if all(c.status == "ok" for c in checks) else OUTSIDE
