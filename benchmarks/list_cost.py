"""What `capeval list` and `capeval --help` cost as a user runs them: CPU seconds of the whole process and its peak
resident memory, best and median of ``--rounds`` interleaved runs (after one untimed run each: bytecode caches).

    python benchmarks/list_cost.py [--rounds 10]

`capeval list` names every metric and what it needs without importing a metric, torch or a model library (the
package's catalog, capeval_plugins/metrics/catalog.json; tests/test_listing.py asserts the modules it imports).
"""
from __future__ import annotations

import argparse
import statistics
import sys

from common import interleaved_processes, process_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    cli = [sys.executable, "-m", "capeval_plugins.cli"]
    commands = {"capeval list": lambda: [*cli, "list"], "capeval list --json": lambda: [*cli, "list", "--json"],
                "capeval --help": lambda: [*cli, "--help"]}
    times = interleaved_processes(commands, process_env(1), args.rounds)
    for name, runs in times.items():
        cpu = [c for _, c, _ in runs]
        print(f"{name:22s} CPU s best {min(cpu):.3f}, median {statistics.median(cpu):.3f}; "
              f"peak RSS {max(m for _, _, m in runs) * 1024:.0f} MB")


if __name__ == "__main__":
    main()
