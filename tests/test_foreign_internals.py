"""Other libraries' private names are used in one module per library (``*_internals.py``, and the evaluate import
hook), each naming what it uses and checking it where it can; anywhere else a private name belongs to the package.
Read from the source: a private attribute (``x._name``, ``getattr(x, "_name")``) is the package's own when the
package defines it somewhere (a function, a class, an assignment ``x._name = ...``); a private module path
(``numpy._core``) is never the package's."""
from __future__ import annotations

import ast
import re

import pytest
from conftest import ROOT

PACKAGE = ROOT / "capeval_plugins"
QUARANTINE = ("_internals.py", "evaluate_hook.py")
PRIVATE_MODULE = re.compile(r"^[A-Za-z]\w*(\.\w+)*\._[a-z]\w*(\.\w+)*$")
# Public, documented names that start with an underscore (the exit that runs no clean-up in a forked child)
DOCUMENTED = {"os._exit"}


def sources():
    return sorted(PACKAGE.rglob("*.py"))


def own_names() -> set[str]:
    """Every name the package defines: functions, classes, arguments, and attributes it assigns."""
    names: set[str] = set()
    for path in sources():
        if path.name.endswith(QUARANTINE):  # what those assign is another library's
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Dict):  # a class built with type(name, bases, {"_attribute": ...})
                names.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return names


def foreign_private_names(source: str, own: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr not in own and ast.unparse(node) not in DOCUMENTED:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.startswith("_") \
                    and not name.value.startswith("__") and name.value not in own:
                found.append(f"line {node.lineno}: {node.func.id}(..., {name.value!r})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PRIVATE_MODULE.match(node.value) \
                and not node.value.startswith("capeval_plugins"):
            found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("capeval_plugins"):
            private = [a.name for a in node.names if a.name.startswith("_") and a.name != "__future__"]
            if any(part.startswith("_") and not part.startswith("__") for part in node.module.split(".")) or private:
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
    return found


@pytest.fixture(scope="module")
def own():
    return own_names()


@pytest.mark.parametrize("path", [p for p in sources() if not p.name.endswith(QUARANTINE)],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_foreign_private_name_outside_the_quarantine_files(path, own):
    found = foreign_private_names(path.read_text(), own)
    assert not found, f"{path.relative_to(PACKAGE)}: {found}"


@pytest.mark.parametrize("source", [
    "def f(task):\n    return task._aggregation_list\n",
    "def f(task):\n    task._metric_fn_list = {}\n",
    "def f(m):\n    return hasattr(m, '_hf_hook')\n",
    "PICKLED = 'numpy._core.multiarray'\n",
    "from diffusers.utils.deprecation_utils import _resolve_dtype\n",
    "from lm_eval._private import thing\n",
])
def test_the_check_sees_a_foreign_private_name(source, own):
    assert foreign_private_names(source, own)
