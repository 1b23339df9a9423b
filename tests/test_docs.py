"""Docs stay true: the site builds without warnings, every metric has a card naming every option and saying what its
defaults reproduce, and the README's set-up commands are the ones CI runs."""
from __future__ import annotations

import re

import pytest
from conftest import PYTHON, ROOT, run

from capeval_plugins import registry
from capeval_plugins.cards import card_path, card_problems


def test_mkdocs_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    run([PYTHON, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")])
    assert (tmp_path / "site" / "metrics" / "clipscore" / "index.html").is_file()


@pytest.mark.parametrize("name", sorted(n for n, e in registry.metrics().items() if e.plugin == registry.BUILTIN))
def test_every_builtin_metric_has_a_card_with_every_option(name):
    """The card format docs/adding-a-metric.md describes (checked for a plugin's card by the metric test kit)."""
    assert card_path(name) is not None, f"metric_cards/{name}/README.md is missing"
    problems = card_problems(registry.get(name).cls)
    assert not problems, problems


UNCHECKED = re.compile(r"unverified|not verified|cannot be (?:checked|verified|reproduced)|not the paper's method",
                       re.I)


@pytest.mark.parametrize("name", sorted(n for n, e in registry.metrics().items()
                                        if e.plugin == registry.BUILTIN))
def test_every_card_says_in_one_place_what_its_defaults_reproduce(name):
    """One paragraph under "Options and departures" says what the defaults reproduce and what they cannot; no
    card claims "defaults reproduce the paper" anywhere while saying elsewhere that something is unverified."""
    text = card_path(name).read_text()
    departures = text.split("## Options and departures from the paper", 1)[1]
    assert "**What the defaults reproduce.**" in departures, f"{name}: no 'What the defaults reproduce' paragraph"
    assert text.count("**What the defaults reproduce.**") == 1
    if UNCHECKED.search(text):
        assert not re.search(r"defaults reproduce the paper", text, re.I), name


def test_readme_opens_with_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()
