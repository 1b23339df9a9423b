"""Metric cards (Hugging Face metric-card format): ``metric_cards/<name>/README.md``.

Shipped inside the wheel as ``capeval_plugins/metric_cards``; in a source checkout they are read from the
repository's top-level ``metric_cards/``. A third-party metric can point at its own card with a ``card``
class attribute (a path or the text itself).
"""
from __future__ import annotations

import re
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_LOCATIONS = (_PACKAGE / "metric_cards", _PACKAGE.parent / "metric_cards")
_FRONT_MATTER = re.compile(r"\A---\n.*?\n---\n", re.S)


def card_path(name: str) -> Path | None:
    for root in _LOCATIONS:
        path = root / name / "README.md"
        if path.is_file():
            return path
    return None


def card_text(metric_cls) -> str:
    """The card of a metric class, or a short stand-in built from its info if it has none."""
    own = getattr(metric_cls, "card", None)
    if own:
        path = Path(own) if len(own) < 4096 and "\n" not in own else None
        return path.read_text() if path is not None and path.is_file() else own
    path = card_path(metric_cls.info.name)
    if path is not None:
        return path.read_text()
    info = metric_cls.info
    return f"# {info.display_name}\n\n{info.description}\n\n## Citation\n\n```bibtex\n{info.citation}\n```\n"


def card_body(metric_cls) -> str:
    """The card without its YAML front matter."""
    return _FRONT_MATTER.sub("", card_text(metric_cls), count=1).strip() + "\n"
