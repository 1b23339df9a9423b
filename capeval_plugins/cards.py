"""Metric cards (Hugging Face metric-card format): ``metric_cards/<name>/README.md``.

Shipped inside the wheel as ``capeval_plugins/metric_cards``; in a source checkout they are read from the
repository's top-level ``metric_cards/``. A third-party metric can point at its own card with a ``card``
class attribute (a path or the text itself). :func:`card_problems` says what a card lacks: the sections below, every
option of the metric by name, and one paragraph saying what its defaults reproduce.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_LOCATIONS = (_PACKAGE / "metric_cards", _PACKAGE.parent / "metric_cards")
_FRONT_MATTER = re.compile(r"\A---\n.*?\n---\n", re.S)
# The sections of every card (Hugging Face's metric-card format, plus where the metric departs from its paper).
SECTIONS = ("## Metric Description", "## How to Use", "### Inputs", "### Output Values", "## Limitations and Bias",
            "## Options and departures from the paper", "## Citation")
DEFAULTS_PARAGRAPH = "**What the defaults reproduce.**"


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


def card_problems(metric_cls) -> list[str]:
    """What the card of a metric class lacks (empty when nothing): a card of its own, each of :data:`SECTIONS`,
    each option of its ``Config`` named in backticks, and one :data:`DEFAULTS_PARAGRAPH` under "Options and
    departures from the paper"."""
    name = metric_cls.info.name
    own = getattr(metric_cls, "card", None) or card_path(name)
    if not own:
        return [f"{name}: no card (metric_cards/{name}/README.md for the package's own metrics, the class attribute "
                "`card` (a path or the text) for a plugin's)"]
    text = card_text(metric_cls)
    problems = [f"{name}: card lacks {section!r}" for section in SECTIONS if section not in text]
    problems += [f"{name}: card does not mention option {f.name!r}" for f in dataclasses.fields(metric_cls.Config)
                 if f"`{f.name}`" not in text]
    departures = text.split("## Options and departures from the paper", 1)[-1]
    if text.count(DEFAULTS_PARAGRAPH) != 1 or DEFAULTS_PARAGRAPH not in departures:
        problems.append(f"{name}: card needs one {DEFAULTS_PARAGRAPH!r} paragraph under 'Options and departures "
                        "from the paper'")
    return problems
