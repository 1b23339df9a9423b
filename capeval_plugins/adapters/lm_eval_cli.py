"""``capeval-lm-eval``: lm-eval's command line with capeval's metrics and tasks (see
:func:`capeval_plugins.adapters.lm_eval.main`). This module imports nothing of lm-eval itself, so that
``capeval-lm-eval --help`` prints help (exit 0) wherever the package is installed, and without the ``lm-eval``
extra every other use says so in one line (exit 2) instead of a traceback."""
from __future__ import annotations

import sys

from capeval_plugins.core.messages import MissingExtra

PROG = "capeval-lm-eval"
ABOUT = (f"{PROG}: lm-eval's command line with every capeval metric registered (as <name> and capeval/<name>), "
         "the shipped capeval_caption task on the include path, and each task's capeval metrics checked before "
         "generation. lm-eval's own options follow.")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    wants_help = any(a in ("-h", "--help") for a in args)
    try:
        from capeval_plugins.adapters.lm_eval import main as run
    except MissingExtra as err:
        if wants_help:  # help always prints
            print(f"usage: {PROG} [lm-eval options]\n\n{ABOUT}\n\nlm-eval is not installed: {err}")
            raise SystemExit(0) from None
        print(f"{PROG}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if wants_help:
        print(ABOUT + "\n")
    run(argv)
