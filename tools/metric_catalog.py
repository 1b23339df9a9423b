"""Write ``capeval_plugins/metrics/catalog.json``: what ``capeval list`` shows of the package's own metrics, read
without importing them (see capeval_plugins/metrics/__init__.py). Run after changing a metric module:

    .venv/bin/python tools/metric_catalog.py          # --check: exit 1 if the file is out of date
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from capeval_plugins import metrics

    text = json.dumps(metrics.catalog_entries(), indent=1, sort_keys=True) + "\n"
    current = metrics.CATALOG.read_text(encoding="utf-8") if metrics.CATALOG.is_file() else None
    if "--check" in sys.argv[1:]:
        if current != text:
            print(f"{metrics.CATALOG} is out of date: run python tools/metric_catalog.py", file=sys.stderr)
            return 1
        return 0
    if current != text:
        metrics.CATALOG.write_text(text, encoding="utf-8")
        print(f"wrote {metrics.CATALOG}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
