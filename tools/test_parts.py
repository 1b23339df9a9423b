"""The closing summary of ``make test``: each part's result, then exit 1 if any part failed or did not finish.

    python3 tools/test_parts.py .cache/test-parts main="main suite (.venv)" lmms="..." lowest="..."

Each part wrote its exit status to ``<folder>/<part>`` and its output to ``<folder>/<part>.log``; the summary
shows pytest's closing line of each (``1581 passed, 55 skipped in ...``). Standard library only.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

# pytest's closing line: "==== 3 failed, 120 passed, 2 skipped in 95.1s (0:01:35) ====" (or without the rules, -q)
CLOSING = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+ in [\d.]+s.*?)\s*=*$")


def closing_line(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "no output"
    found = [m.group(1) for line in lines if (m := CLOSING.match(line.strip()))]
    return found[-1] if found else (lines[-1].strip() if lines else "no output")


def summary(folder: Path, parts: dict[str, str]) -> tuple[list[str], bool]:
    """The summary's lines and whether every part passed."""
    lines, ok = ["make test:"], True
    for key, label in parts.items():
        try:
            code = int((folder / key).read_text().strip())
        except (OSError, ValueError):
            code = None
        if code == 0:
            result = "passed"
        else:
            ok = False
            result = "did not finish" if code is None else f"FAILED (exit {code})"
        lines.append(f"  {label}: {result}: {closing_line(folder / f'{key}.log')}")
    lines.append("make test: every part passed" if ok else "make test: FAILED (see each part's output above)")
    return lines, ok


def main(argv: list[str]) -> int:
    folder, parts = Path(argv[0]), dict(arg.split("=", 1) for arg in argv[1:])
    lines, ok = summary(folder, parts)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
