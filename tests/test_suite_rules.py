"""``make test`` on a stranger's machine, busy or quiet: no test measures the clock, every part runs whatever the
others did, a passing run leaves nothing in the temporary folder, and the lowest-versions run lets no test skip.

The rules the suite keeps live in ``tests/helpers/suite_rules.py`` (pytest hooks ``conftest.py`` imports); here
they are tried on small pytest runs of their own, and the Makefile's ``test`` recipe on stand-in venvs."""
from __future__ import annotations

import ast
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG_GUARD, ROOT

HELPERS = ROOT / "tests" / "helpers"


def pytest_run(tmp_path: Path, source: str, *args: str, env: dict | None = None,
               config: Path | None = None) -> subprocess.CompletedProcess:
    """``pytest`` on one test file holding ``source``, with the suite's rules loaded as a plugin, in a folder of
    its own (not this suite's conftest)."""
    test = tmp_path / "test_case.py"
    test.write_text(source)
    if config is None:
        config = tmp_path / "pytest.ini"
        config.write_text("[pytest]\n")
    full = {**os.environ, "PYTHONPATH": str(HELPERS), **(env or {})}
    if "CAPEVAL_NO_SKIPS" not in (env or {}):
        full.pop("CAPEVAL_NO_SKIPS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-p", "suite_rules", "-c", str(config), "--rootdir", str(tmp_path), *args, str(test)],
                          capture_output=True, text=True, env=full, cwd=tmp_path, timeout=HANG_GUARD)


# Based on Hypothesis's "default" profile by name: with no base, a CI machine (CI=true) would lend these settings
# the "ci" profile, which has no deadline and no too-slow check, and nothing would be left to refuse.
HYPOTHESIS_CASE = """
from hypothesis import given, settings, strategies as st

@settings(settings.get_profile("default"), {options})
@given(st.integers())
def test_it(x):
    assert x == x
"""


@pytest.mark.parametrize("options, refused", [
    ("max_examples=5", True),                                            # Hypothesis's own 200 ms deadline
    ("max_examples=5, deadline=None", True),                             # the too_slow health check
    ("max_examples=5, deadline=None, suppress_health_check=[__import__('hypothesis').HealthCheck.too_slow]", False),
])
def test_a_hypothesis_test_that_measures_wall_time_is_refused_at_collection(tmp_path, options, refused):
    proc = pytest_run(tmp_path, HYPOTHESIS_CASE.format(options=options))
    if refused:
        assert proc.returncode != 0 and "measure wall time" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        assert "test_case.py::test_it" in proc.stdout + proc.stderr
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_suite_runs_hypothesis_without_a_clock():
    """conftest's profile: a test that names neither setting has no deadline and no too-slow check."""
    from hypothesis import HealthCheck, settings

    assert settings.default.deadline is None and HealthCheck.too_slow in settings.default.suppress_health_check


SKIPPING = """
import pytest
def test_runs():
    pass
def test_needs_something():
    pytest.skip("no such package here")
"""
MODULE_SKIP = """
import pytest
pytest.importorskip("no_such_module_anywhere")
def test_never():
    pass
"""


def test_in_the_lowest_run_a_skip_is_a_failure_naming_why(tmp_path):
    quiet = pytest_run(tmp_path, SKIPPING)
    assert quiet.returncode == 0 and "1 skipped" in quiet.stdout, quiet.stdout
    strict = pytest_run(tmp_path, SKIPPING, env={"CAPEVAL_NO_SKIPS": "1"})
    assert strict.returncode == 1 and "1 failed, 1 passed" in strict.stdout, strict.stdout
    assert "CAPEVAL_NO_SKIPS=1" in strict.stdout and "no such package here" in strict.stdout
    whole_file = pytest_run(tmp_path, MODULE_SKIP, env={"CAPEVAL_NO_SKIPS": "1"})
    assert whole_file.returncode != 0 and "no_such_module_anywhere" in whole_file.stdout, whole_file.stdout


WALL_CLOCKS = {"time", "monotonic", "perf_counter", "monotonic_ns", "perf_counter_ns", "time_ns"}


def _reads_wall_clock(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in WALL_CLOCKS
               and isinstance(n.func.value, ast.Name) and n.func.value.id == "time" for n in ast.walk(node))


def clock_dependence(source: str) -> list[tuple[int, str]]:
    """Where ``source`` makes a test's outcome depend on wall time: an assert on a clock reading (or on a name
    set from one), a literal ``timeout=`` or a ``.wait(N)`` / ``.join(N)`` limit (the suite's limit for a real
    hang is ``conftest.HANG_GUARD``)."""
    tree = ast.parse(source)
    timed = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and _reads_wall_clock(n.value)
             for t in n.targets if isinstance(t, ast.Name)}
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Assert) and (_reads_wall_clock(n.test) or any(
                isinstance(m, ast.Name) and m.id in timed for m in ast.walk(n.test))):
            found.append((n.lineno, "an assert on the wall clock"))
        elif isinstance(n, ast.keyword) and n.arg == "timeout" and isinstance(n.value, ast.Constant):
            found.append((n.value.lineno, f"timeout={n.value.value!r}"))
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("wait", "join")
              and n.args and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, (int, float))):
            found.append((n.lineno, f".{n.func.attr}({n.args[0].value!r})"))
    return sorted(found)


def test_no_test_depends_on_the_wall_clock():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in sorted((ROOT / "tests").rglob("*.py"))
                 for line, what in clock_dependence(path.read_text())]
    assert not offenders, "tests that a busy machine fails: " + "; ".join(offenders)


def test_the_clock_check_finds_what_it_looks_for():
    source = ("import time, subprocess\nstart = time.monotonic()\nsubprocess.run(['x'], timeout=120)\n"
              "took = time.monotonic() - start\nassert took < 60\nassert time.perf_counter() - start < 1\n"
              "proc.wait(30)\nthread.join(timeout=HANG_GUARD)\n")
    assert clock_dependence(source) == [(3, "timeout=120"), (5, "an assert on the wall clock"),
                                        (6, "an assert on the wall clock"), (7, ".wait(30)")]


WRITES = """
def test_writes(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 100000)

def test_writes_a_session_folder(tmp_path_factory):
    (tmp_path_factory.mktemp("models") / "weights").write_bytes(b"y" * 100000)
"""


def test_a_passing_run_leaves_nothing_in_the_temporary_folder(tmp_path):
    """pytest's default keeps the last three runs' temporary folders (1.2 GB of tiny checkpoints and corpora for
    this suite): with pyproject.toml's settings a passing run removes its own."""
    root = tmp_path / "temproot"
    root.mkdir()
    proc = pytest_run(tmp_path, WRITES, config=ROOT / "pyproject.toml", env={"PYTEST_DEBUG_TEMPROOT": str(root)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    left = [p for p in root.rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert not left, left


FAKE_PYTEST = """#!/bin/sh
echo "$0 CAPEVAL_NO_SKIPS=${{CAPEVAL_NO_SKIPS:-}} $*" >> {calls}
echo "=== {summary} in 0.01s ==="
exit {code}
"""


def fake_venv(folder: Path, calls: Path, code: int, summary: str) -> Path:
    (folder / "bin").mkdir(parents=True)
    script = folder / "bin" / "pytest"
    script.write_text(FAKE_PYTEST.format(calls=calls, code=code, summary=summary))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder


@pytest.mark.parametrize("failing", ["main", "lmms", "lowest"])
def test_make_test_runs_every_part_and_fails_at_the_end(tmp_path, failing):
    """A failing part (here each in turn, in venvs whose pytest is a stand-in) hides none of the others: all three
    run, the summary names each part's result and pytest's closing line, and make fails."""
    calls = tmp_path / "calls"
    venvs = {part: fake_venv(tmp_path / part, calls, 1 if part == failing else 0,
                             "1 failed, 9 passed" if part == failing else "10 passed")
             for part in ("main", "lmms", "lowest")}
    stamps = [f"{venvs[p]}/.installed" for p in venvs] + [".cache/tokenizer-wheels/.downloaded",
                                                          ".cache/reference-wheels/.downloaded"]
    proc = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), *[a for s in stamps for a in ("-o", s)],
                           "test", f"VENV={venvs['main']}", f"LMMS_VENV={venvs['lmms']}",
                           f"LOWEST_VENV={venvs['lowest']}", f"PARTS={tmp_path / 'parts'}"],
                          capture_output=True, text=True, timeout=HANG_GUARD)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    ran = calls.read_text().splitlines()
    assert sorted(Path(line.split()[0]).parent.parent.name for line in ran) == ["lmms", "lowest", "main"], ran
    lowest = next(line for line in ran if "/lowest/" in line)
    assert "CAPEVAL_NO_SKIPS=1" in lowest and "not slow and not lmms" in lowest
    lmms = next(line for line in ran if "/lmms/" in line)
    assert "tests/test_lmms_eval_adapter.py" in lmms and "tests/test_internals.py" in lmms
    summary = proc.stdout[proc.stdout.index("make test:"):]
    for part, label in (("main", "main suite"), ("lmms", "lmms-eval tests"), ("lowest", "lowest versions")):
        result = "FAILED (exit 1): 1 failed, 9 passed" if part == failing else "passed: 10 passed"
        assert f"{label} ({venvs[part]}): {result} in 0.01s" in summary, summary
    assert summary.rstrip().endswith("make test: FAILED (see each part's output above)"), summary


def test_the_load_check_ends_its_busy_processes(tmp_path):
    """make test-under-load: the busy processes spin while the command runs and are gone when it has ended (here
    a command that fails: its status is passed on)."""
    seen = tmp_path / "pids"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "under_load.py"), "3", sys.executable, "-c",
                           f"import os, sys; open({str(seen)!r}, 'w').write(os.environ['UNDER_LOAD_PIDS']); "
                           "sys.exit(3)"], capture_output=True, text=True, timeout=HANG_GUARD)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    pids = [int(p) for p in seen.read_text().split()]
    assert len(pids) == 3
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    makefile = (ROOT / "Makefile").read_text()
    assert "test-under-load:" in makefile and "tools/under_load.py $(LOAD) $(MAKE) test" in makefile
