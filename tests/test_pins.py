"""The pinned environments (requirements/*.txt) stay true to pyproject.toml and to how the Makefile uses them.

A dependency added to pyproject.toml without `make lock` would be missing from the venv `make test` builds
(it installs the pins with --no-deps): this file fails first, naming it.
"""
from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

sys.path.insert(0, str(ROOT / "tools"))
import pins  # noqa: E402

# environment -> the extras of capeval-plugins it is built with (see tools/pins.py)
EXTRAS = {"main": ["all", "test"], "lmms": ["all", "test", "lmms"], "lowest": ["all", "test"]}
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
    """The requirements of pyproject.toml with ``extras``, extras that name other extras expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines, todo, done = list(project["dependencies"]), list(extras), set()
    while todo:
        extra = todo.pop()
        if extra not in done:
            done.add(extra)
            for line in project["optional-dependencies"][extra]:
                req = Requirement(line)
                if canonicalize_name(req.name) == canonicalize_name(pins.PROJECT):
                    todo += sorted(req.extras)
                else:
                    lines.append(line)
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
    install = re.search(r"^UV_INSTALL = (.*)$", makefile, re.M).group(1)
    # no dependency resolution; bytecode written as modules are first imported: the machines set
    # PYTHONDONTWRITEBYTECODE, and with it every process of the suite compiles torch and transformers anew
    assert "pip install" in install and "--no-deps" in install
    assert re.search(r"^unexport PYTHONDONTWRITEBYTECODE$", makefile, re.M)
    for venv, lock in ((".venv", "$(LOCK)"), ("$(LMMS_VENV)", "$(LMMS_LOCK)"), ("$(LOWEST_VENV)", "$(LOWEST_LOCK)")):
        python = "$(BIN)/python" if venv == ".venv" else f"{venv}/bin/python"
        assert f"$(UV_INSTALL) {python} -r {lock}" in makefile
        assert f"$(UV_INSTALL) {python} --no-build-isolation -e ." in makefile
    assert re.fullmatch(r"uv==[\d.]+\n", (ROOT / "requirements" / "uv.txt").read_text())
    assert "$(LOWEST_VENV)/bin/pytest" in makefile  # the fast part runs on the lowest versions
    assert "pins.py refresh" in makefile  # make lock


def test_uv_installs_from_where_pip_is_configured_to(monkeypatch):
    """pip's index, extra indexes (a list in one value) and wheel folders, as pip reads them (here from PIP_*
    variables, the machine's config files left out), each passed to uv once."""
    import os

    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # pip then reads no config file
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///a/simple file:///b/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "/wheels")
    args = pins.uv_sources()
    pairs = list(zip(args[::2], args[1::2]))
    assert pairs == [("--index-url", "https://mirror.example/simple"), ("--extra-index-url", "file:///a/simple"),
                     ("--extra-index-url", "file:///b/simple"), ("--find-links", "/wheels"),
                     ("--extra-index-url", pins.TORCH_CPU_INDEX),  # none of them has the CPU torch
                     ("--index-strategy", "unsafe-best-match")]


def test_the_lowest_environment_pins_every_requirement_at_its_floor():
    """A floor of pyproject.toml that the lowest environment does not run (changed without `make lock`, or one
    the others' requirements lift) fails here, naming it. torch is kept at the machines' CPU build."""
    versions = pinned("lowest")
    off = []
    for req in wanted(EXTRAS["lowest"]):
        floor = next((Version(s.version) for s in req.specifier if s.operator == ">="), None)
        key = canonicalize_name(req.name)
        if floor is None or key == "torch":
            continue
        got = versions.get(key)
        if got is None or got.release[:len(floor.release)] != floor.release:
            off.append(f"{req.name} {req.specifier}: {got}")
    assert not off, f"requirements/lowest.txt is not at the floors ({'; '.join(off)}): run `make lock`"
    assert versions["torch"] == Version(pins.TORCH.split("==")[1])


def test_base_install_pulls_no_ecosystem():
    """A plain install is torch, transformers and what the core needs: every ecosystem is an extra."""
    base = {canonicalize_name(r.name) for r in wanted([])}
    ecosystems = {"evaluate", "datasets", "lm-eval", "lmms-eval", "pycocoevalcap", "torchmetrics", "lightning"}
    assert not base & ecosystems, base & ecosystems
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"evaluate", "torchmetrics", "lightning", "pycocoevalcap", "lm-eval", "lmms", "all"} <= extras.keys()


def test_changes_lists_every_moved_version():
    old = ["# pinned: python 3.11.7", "a==1.0", "b-c==2.0", "gone==1"]
    new = ["a==1.1", "B_C==2.0", "fresh==3"]
    assert pins.changes(old, new) == ["  a: 1.0 -> 1.1", "  fresh: (new) -> 3", "  gone: 1 -> (removed)"]


def test_uv_gets_each_source_from_where_pip_install_takes_it(tmp_path, monkeypatch):
    """A PIP_* variable wins over the config files, their [install] section over [global]: one value each, not
    a union (the file is read after the machine's own, so its keys win there)."""
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nindex-url = https://g.example/simple\nextra-index-url = file:///a file:///b\n"
                      "find-links = /global-wheels\n[install]\nfind-links = /install-wheels\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///c")
    args = pins.uv_sources()
    pairs = list(zip(args[::2], args[1::2]))
    assert pairs == [("--index-url", "https://g.example/simple"), ("--extra-index-url", "file:///c"),
                     ("--find-links", "/install-wheels"), ("--extra-index-url", pins.TORCH_CPU_INDEX),
                     ("--index-strategy", "unsafe-best-match")]


# ---------------------------------------------------------------------------------------------------------
# The CPU build of torch everywhere: no CUDA package in any environment


CUDA = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")


@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_no_lock_holds_a_cuda_package_and_torch_is_the_cpu_build(name):
    """The suite runs on the CPU: a CUDA build of torch (PyPI's plain version) pulls in 3.5 GB of nvidia-* and
    triton that nothing uses. Every lock pins the CPU build (its local label says so) and no CUDA package."""
    versions = pinned(name)
    assert not [k for k in versions if CUDA.match(k)], f"requirements/{name}.txt holds CUDA packages"
    assert versions["torch"].local == "cpu", f"requirements/{name}.txt pins torch {versions['torch']}, not a CPU build"
    assert pins.cuda_packages(pins.read_lock(name)) == []


def test_a_resolution_that_brings_in_cuda_stops_naming_it():
    assert pins.cuda_packages(["torch==2.13.0", "nvidia-cublas==13.1.1.3", "triton==3.7.1", "numpy==2.0",
                               "cuda-bindings==13.5.0"]) == ["cuda-bindings", "nvidia-cublas", "triton"]
    with pytest.raises(SystemExit, match="CUDA packages .*nvidia-cublas.*torch resolved to a CUDA build"):
        pins.refuse_cuda("lowest", ["torch==2.13.0", "nvidia-cublas==13.1.1.3"])


def test_the_lowest_resolution_overrides_torch_to_the_cpu_build_from_pips_sources(tmp_path, monkeypatch):
    """uv resolves the lowest set with torch overridden to the main set's CPU build, looked up where pip finds
    packages here (PyPI alone has only the CUDA build of a plain version)."""
    monkeypatch.setattr(pins, "uv_sources", lambda: ["--find-links", "/wheels", "--index-strategy", "x"])
    cmd = pins.lowest_command(Path("uv"), tmp_path / "override.txt", tmp_path / "floors.txt")
    assert cmd[cmd.index("--override") + 1] == str(tmp_path / "override.txt")
    assert cmd[cmd.index("--find-links") + 1] == "/wheels" and "--resolution" in cmd
    assert pins.TORCH.endswith("+cpu")
    main_torch = pinned("main")["torch"]
    assert Version(pins.TORCH.split("==")[1]) == main_torch  # the same build as the main set


def test_a_local_copy_of_the_cpu_torch_needs_no_other_index(tmp_path, monkeypatch):
    """A wheel folder or a file:// index holding the pinned CPU torch is enough; otherwise PyTorch's CPU index is
    added (on a stranger's machine pip's sources are PyPI, which has no CPU build)."""
    import os

    version = pins.TORCH.split("==")[1]
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / f"torch-{version}-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    index = tmp_path / "simple" / "torch"
    index.mkdir(parents=True)
    (index / "index.html").write_text(f'<a href="torch-{version.replace("+", "%2B")}-cp311.whl">x</a>')
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    assert pins.TORCH_CPU_INDEX not in pins.uv_sources()
    monkeypatch.delenv("PIP_FIND_LINKS")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", f"file://{tmp_path / 'simple'}")
    assert pins.TORCH_CPU_INDEX not in pins.uv_sources()
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://mirror.example/simple")
    assert pins.TORCH_CPU_INDEX in pins.uv_sources()


def test_lightning_at_its_floor_imports_without_pkg_resources():
    """Lightning below 2.4 imports pkg_resources, which setuptools 81 removed (and torch 2.13 needs setuptools >=
    77): the floor is the first that imports with the rest of the lowest set, where its tests run (not skip)."""
    floor = next(Version(s.version) for r in wanted(["lightning"]) if canonicalize_name(r.name) == "lightning"
                 for s in r.specifier if s.operator == ">=")
    assert floor >= Version("2.4")
    makefile = (ROOT / "Makefile").read_text()
    lowest_tests = re.search(r"^LOWEST_TESTS := ((?:.*\\\n)*.*)$", makefile, re.M).group(1)
    assert "tests/test_torchmetrics_adapter.py" in lowest_tests  # the Lightning tests
    assert "CAPEVAL_NO_SKIPS=1 $(LOWEST_VENV)/bin/pytest" in makefile
