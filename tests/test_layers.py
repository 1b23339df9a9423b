"""Floors only look down. The order is declared once, in pyproject.toml's ``[tool.importlinter]`` (top floor first):
core <- files <- resources (model loading, tensor files, region files, METEOR's index and JVMs) <- models (the
inference models) <- contract <- inputs <- session (a package: the one batch loop every entry point feeds) <-
runner <- metrics <- bench <- training <- adapters | commands
<- the ecosystems' entry modules and the testing kit <- cli. import-linter (``lint-imports``) checks every import of
the package's own modules, at module level or inside a function, direct or through other modules, and every
module must sit on a floor (``exhaustive``). The one named exception: ``Metric.__call__`` scores through the
package's own ``score``, which imports the runner when first used.

The core is numerics on data passed in: no module under ``core/`` opens a file, walks a folder or starts a
process (checked here from the source: what it imports and what it calls)."""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGE = ROOT / "capeval_plugins"


def floors() -> list[list[str]]:
    """The declared floors, lowest first, each a list of the top-level modules on it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["id"] == "floors"]
    return [re.split(r"\s*[|:]\s*", layer.strip()) for layer in reversed(contract["layers"])]


def lint(root: Path, env_path: Path | None = None) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package found first on the path (a clone's when ``env_path`` is given)."""
    env = {"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(env_path or ROOT), "HOME": str(root)}
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)


def test_every_import_of_the_package_keeps_to_the_floors():
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "KEPT" in out.stdout


def top_module(name: str) -> str:
    return name.split(".")[1]


def a_module_of(top: str) -> str:
    """A real module file of the top-level module ``top`` (its ``__init__`` for a package)."""
    path = PACKAGE / top
    return f"{top}/__init__.py" if path.is_dir() else f"{top}.py"


# The upward imports a reviewer added to a clone, one at a time, that the previous check missed (issue 51).
UPWARD = [("metrics", "cli"), ("metrics", "adapters.torchmetrics"), ("metrics", "bench.runner"),
          ("training", "commands"), ("bench", "adapters"), ("options", "cli"), ("functional", "cli"),
          ("digests", "session"), ("core", "files"), ("contract", "runner"), ("session", "runner"),
          ("core", "resources.loading"), ("files", "resources"), ("models", "contract"), ("resources", "models")]


def test_an_upward_import_added_anywhere_fails(tmp_path):
    """A clone with, in one function each, every upward import above and one from every floor to the floor right
    above it: each is reported. (One lint run over all of them; each pair of floors is reported on its own.)"""
    clone = tmp_path / "clone"
    shutil.copytree(PACKAGE, clone / "capeval_plugins", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", clone)
    declared = floors()
    pairs = list(UPWARD) + [(low[0], high[0]) for low, high in zip(declared, declared[1:])]
    for n, (low, high) in enumerate(pairs):
        target = clone / "capeval_plugins" / a_module_of(low.split(".")[0])
        with target.open("a") as f:
            f.write(f"\n\ndef _upward_{n}():\n    import capeval_plugins.{high}  # noqa: F401\n")
    out = lint(clone, env_path=clone)
    assert out.returncode != 0
    for low, high in pairs:
        assert f"capeval_plugins.{low.split('.')[0]} is not allowed to import capeval_plugins.{high.split('.')[0]}" \
            in out.stdout, (low, high, out.stdout[-3000:])


def test_every_module_of_the_package_sits_on_a_floor():
    on_a_floor = {m for floor in floors() for m in floor}
    modules = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
               if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert modules == on_a_floor


# What the core may import: computation only. No os, pathlib, shutil, tempfile, subprocess, sockets, images or
# tensor-file libraries; and the few names below it never calls (builtin open, io.open, from_pretrained; numpy's and
# torch's load/save only on a stream it made in memory).
CORE_MAY_IMPORT = {"__future__", "typing", "dataclasses", "math", "numbers", "re", "json", "io", "struct",
                   "tokenize", "argparse", "importlib", "threading", "types", "functools", "collections",
                   "itertools", "enum", "warnings", "abc", "contextlib", "bisect", "heapq", "operator", "string",
                   "unicodedata", "hashlib", "difflib", "torch", "numpy", "transformers", "xxhash", "scipy", "capeval_plugins"}
LOADERS = {("np", "load"), ("np", "save"), ("np", "savez"), ("np", "savez_compressed"), ("np", "fromfile"),
           ("torch", "load"), ("torch", "save"), ("io", "open"), ("os", "open")}


def file_or_process_use(source: str) -> list[str]:
    """Why ``source`` (a core module) may touch files or processes: its imports outside :data:`CORE_MAY_IMPORT`,
    calls of the builtin ``open``, ``from_pretrained``, ``tofile``, or numpy's / torch's loaders on anything but
    an in-memory stream."""
    tree = ast.parse(source)
    found, in_memory = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) in (
                "io.BytesIO", "io.StringIO"):
            in_memory.update(ast.unparse(t) for t in node.targets)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"imports {n}" for n in names if n.split(".")[0] not in CORE_MAY_IMPORT]
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "open":
                found.append("calls open()")
            elif isinstance(func, ast.Attribute):
                owner = ast.unparse(func.value)
                if func.attr in ("from_pretrained", "tofile", "read_text", "read_bytes", "write_text", "write_bytes"):
                    found.append(f"calls {owner}.{func.attr}()")
                elif (owner, func.attr) in LOADERS:
                    first = ast.unparse(node.args[0]) if node.args else ""
                    if not (first in in_memory or first.startswith(("io.BytesIO(", "io.StringIO("))):
                        found.append(f"calls {owner}.{func.attr}({first})")
    return found


@pytest.mark.parametrize("path", sorted((PACKAGE / "core").rglob("*.py")), ids=lambda p: p.name)
def test_the_core_opens_no_file_and_starts_no_process(path):
    assert not file_or_process_use(path.read_text()), f"core/{path.name}: {file_or_process_use(path.read_text())}"


@pytest.mark.parametrize("source, why", [
    ("import os\n", "imports os"),
    ("def f(p):\n    from pathlib import Path\n    return Path(p)\n", "imports pathlib"),
    ("def f(p):\n    with open(p) as f:\n        return f.read()\n", "calls open()"),
    ("import numpy as np\ndef f(p):\n    return np.load(p)\n", "calls np.load(p)"),
    ("import subprocess\n", "imports subprocess"),
    ("def f(m, p):\n    return m.from_pretrained(p)\n", "calls m.from_pretrained()"),
])
def test_the_core_check_sees_each_way_of_touching_a_file(source, why):
    assert why in file_or_process_use(source)
    assert not file_or_process_use("import io\nimport numpy as np\n"
                                   "def f(data):\n    buf = io.BytesIO(data)\n    return np.load(buf)\n")


@pytest.mark.parametrize("path", sorted((PACKAGE / "files").rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_file_layer_stands_on_the_core_s_messages_only(path):
    """The file layer is below every other floor but the core, and of the core it uses only the error types."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("capeval_plugins"):
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names if a.name.startswith("capeval_plugins"))
    bad = sorted(m for m in imported
                 if not (m.startswith("capeval_plugins.files") or m == "capeval_plugins.core.messages"))
    assert not bad, f"{path.name} imports {bad}"


def test_the_contract_scores_through_the_runner_without_importing_it():
    code = ("import sys; from capeval_plugins.metrics.coco import Bleu1; "
            "assert Bleu1(tokenize=False)(None, ['a dog'], [['a dog runs']]).score > 0; "
            "import capeval_plugins.contract as c; print(c.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_listing_metrics_and_building_the_cli_import_no_model_library():
    """Every metric module is imported to list the metrics, and every command module to build ``capeval``'s
    parser: a module-level import of transformers' model classes there (Polos's model once) costs every ``capeval``
    process 3 s, a failing one included. The model libraries load with the first model."""
    code = ("import sys; import capeval_plugins; from capeval_plugins import cli; capeval_plugins.list_metrics(); "
            "cli.build_parser(); print(sorted(m for m in ('transformers', 'timm', 'diffusers', 'peft', 'open_clip') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "[]"
