"""Docs stay true: the site builds without warnings, every metric has a card naming every option, and the
README's set-up commands are the ones CI runs."""
from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import PYTHON, ROOT, run

from capeval_plugins import registry
from capeval_plugins.cards import card_path


def test_mkdocs_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    run([PYTHON, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")])
    assert (tmp_path / "site" / "metrics" / "clipscore" / "index.html").is_file()


@pytest.mark.parametrize("name", sorted(n for n, e in registry.metrics().items() if e.plugin == registry.BUILTIN))
def test_every_builtin_metric_has_a_card_with_every_option(name):
    path = card_path(name)
    assert path is not None, f"metric_cards/{name}/README.md is missing"
    text = path.read_text()
    for section in ("## Metric Description", "## How to Use", "### Inputs", "### Output Values",
                    "## Limitations and Bias", "## Options and departures from the paper", "## Citation"):
        assert section in text, f"{name}: card lacks {section!r}"
    for field in dataclasses.fields(registry.get(name).cls.Config):
        assert f"`{field.name}`" in text, f"{name}: card does not mention option {field.name!r}"


def test_readme_opens_with_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()
