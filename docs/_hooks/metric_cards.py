"""mkdocs hook: publish every ``metric_cards/<name>/README.md`` as ``metrics/<name>.md`` and list them in
``metrics/index.md``, so a new metric needs no edit here or in mkdocs.yml."""
from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

CARDS = Path(__file__).resolve().parents[2] / "metric_cards"
_FRONT = re.compile(r"\A---\n(.*?)\n---\n", re.S)
_CARD_LINK = re.compile(r"\]\(\.\./([a-z0-9_]+)/README\.md\)")


def _cards() -> list[tuple[str, str]]:
    return [(p.parent.name, p.read_text()) for p in sorted(CARDS.glob("*/README.md"))]


def _title(text: str, name: str) -> str:
    match = re.search(r"^title:\s*(.+)$", _FRONT.match(text).group(1), re.M) if _FRONT.match(text) else None
    return match.group(1).strip() if match else name


def on_files(files, config):
    rows = []
    for name, text in _cards():
        body = _CARD_LINK.sub(r"](\1.md)", _FRONT.sub("", text, count=1))
        files.append(File.generated(config, f"metrics/{name}.md", content=body))
        rows.append(f"| [`{name}`]({name}.md) | {_title(text, name)} |")
    index = "# Metrics\n\nEvery metric has a card: what it computes, how to call it, its options and where it " \
            "departs from its paper.\n\n| name | metric |\n| --- | --- |\n" + "\n".join(rows) + "\n"
    files.append(File.generated(config, "metrics/index.md", content=index))
    return files
