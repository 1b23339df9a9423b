"""``capeval-lm-eval``: lm-eval's command line with capeval's metrics and tasks (see
:func:`capeval_plugins.adapters.lm_eval.main`). This module imports nothing of lm-eval itself, so that without
the ``lm-eval`` extra the command says so in one line instead of a traceback."""
from __future__ import annotations

import sys

from capeval_plugins.core.messages import MissingExtra

USAGE = "usage: capeval-lm-eval [lm-eval's options]: lm-eval's command line with capeval's metrics and caption tasks"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        from capeval_plugins.adapters.lm_eval import main as run
    except MissingExtra as err:
        if any(a in ("-h", "--help") for a in args):  # help always prints
            print(f"{USAGE}\n\n{err}")
            raise SystemExit(0) from None
        print(f"capeval-lm-eval: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    run(argv)


if __name__ == "__main__":
    main()
