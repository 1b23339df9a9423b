"""The pinned environments (requirements/*.txt) stay true to pyproject.toml and to how the Makefile uses them.

A dependency added to pyproject.toml without `make lock` would be missing from the venv `make test` builds
(it installs the pins with --no-deps): this file fails first, naming it.
"""
from __future__ import annotations

import re
import sys
import tomllib

import pytest
from conftest import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

sys.path.insert(0, str(ROOT / "tools"))
import pins  # noqa: E402

# environment -> the extras of capeval-plugins it is built with (see tools/pins.py)
EXTRAS = {"main": ["test"], "lmms": ["test", "lmms"]}
# pinned away on purpose (tools/pins.py): PyPI's torchvision does not load beside the CPU torch
LEFT_OUT = {"lmms": {"torchvision"}}


def pinned(name: str) -> dict[str, Version]:
    out = {}
    for line in pins.read_lock(name):
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line)
        assert match, f"requirements/{name}.txt: not an exact pin: {line!r}"
        out[canonicalize_name(match.group(1))] = Version(match.group(2))
    return out


def wanted(extras: list[str]) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_every_requirement_of_pyproject_is_pinned_inside_its_range(name):
    versions = pinned(name)
    problems = []
    for req in wanted(EXTRAS[name]):
        if req.marker is not None and not req.marker.evaluate():
            continue
        key = canonicalize_name(req.name)
        if key in LEFT_OUT.get(name, set()):
            continue
        if key not in versions:
            problems.append(f"{req.name} is not pinned")
        elif not req.specifier.contains(versions[key], prereleases=True):
            problems.append(f"{req.name}=={versions[key]} is outside {req.specifier}")
    assert not problems, f"requirements/{name}.txt is stale ({'; '.join(problems)}): run `make lock`"


@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_lock_names_the_python_it_was_resolved_on(name):
    first = pins.read_lock(name)[0]
    assert re.match(rf"{re.escape(pins.HEADER)} python \d+\.\d+\.\d+ ", first), first
    assert {"hatchling", "editables"} <= pinned(name).keys(), "the editable build runs without isolation"


def test_known_broken_combination_is_excluded():
    """lmms-eval 0.7.x imports filelock._api, which filelock 4 removed: the lmms pins and the extra keep
    filelock below 4."""
    assert pinned("lmms")["filelock"] < Version("4")
    assert any(canonicalize_name(r.name) == "filelock" and not r.specifier.contains("4.0.0")
               for r in wanted(["lmms"]))


def test_makefile_installs_exactly_the_pins():
    makefile = (ROOT / "Makefile").read_text()
    for lock in ("$(LOCK)", "$(LMMS_LOCK)"):
        assert f"pip install -q --no-deps -r {lock}" in makefile
    assert makefile.count("--no-deps --no-build-isolation -e .") == 2
    assert "pins.py refresh" in makefile  # make lock


def test_changes_lists_every_moved_version():
    old = ["# pinned: python 3.11.7", "a==1.0", "b-c==2.0", "gone==1"]
    new = ["a==1.1", "B_C==2.0", "fresh==3"]
    assert pins.changes(old, new) == ["  a: 1.0 -> 1.1", "  fresh: (new) -> 3", "  gone: 1 -> (removed)"]
