"""A user's results checked against the user's expected values, each within a tolerance (``capeval verify``):
what ``capeval reproduce`` does with the published values shipped in the package, for any figure.

The expected file mirrors the results file: the same keys down to each number to check, e.g. for a
``capeval bench --json`` report::

    {"results": {"cider": {"kendall_tau_c": 43.9, "n": 5664}, "mine": {"kendall_tau_c": {"value": 51.2,
     "tolerance": 0.3}}}}

or for ``capeval score``'s summary line ``{"metrics": {"cider": {"score": 0.912}}}``. A leaf is a number, or
``{"value": x, "tolerance": t}``. The tolerance is absolute: the leaf's own, else the one given for the whole
check, else half a unit of the expected value's last written digit (43.9: 0.05; 5664: 0.5), the rounding a
published table is written with. Every leaf is reported: within, outside, or missing from the results (absent,
null, or not a number).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Mapping

from capeval_plugins.inputs import InputError


@dataclass
class Check:
    """One expected value against the measured one."""

    path: str  # the keys down to the value, joined by "."
    expected: float
    tolerance: float
    measured: float | None

    @property
    def status(self) -> str:
        if self.measured is None:
            return "missing"
        return "ok" if abs(self.measured - self.expected) <= self.tolerance else "outside"

    def to_dict(self) -> dict[str, Any]:
        diff = None if self.measured is None else self.measured - self.expected
        return {"path": self.path, "expected": self.expected, "measured": self.measured, "difference": diff,
                "tolerance": self.tolerance, "status": self.status}


def read_json(path: str | os.PathLike, what: str) -> Any:
    """A JSON document (or, for a results file, the last JSON line of a command's output, as ``capeval score``
    prints its summary)."""
    from capeval_plugins import files
    from capeval_plugins.core import jsonio

    try:
        files.check_input(path, what)  # a folder, a FIFO or a device is said as such, never opened
        text = jsonio.decode_text(files.read_input(path, what), str(path))
    except (files.FileError, jsonio.JSONLinesError) as err:
        raise InputError(str(err)) from None
    try:
        return jsonio.loads(text)
    except json.JSONDecodeError:
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            return jsonio.loads(lines[-1]) if lines else None
        except json.JSONDecodeError as err:
            raise InputError(f"{path}: not JSON ({err})") from None


def default_tolerance(value: float) -> float:
    """Half a unit of the last digit ``value`` is written with (43.9: 0.05; 44: 0.5; 0.912: 0.0005)."""
    exponent = Decimal(repr(value)).as_tuple().exponent
    return 0.5 * 10.0 ** min(int(exponent), 0) if isinstance(exponent, int) else 0.0


def _number(value: Any, where: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{where}: {what} must be a finite number, got {json.dumps(value)[:40]}")
    return float(value)


def verify(results: Mapping[str, Any] | str | os.PathLike, expected: Mapping[str, Any] | str | os.PathLike,
           tolerance: float | None = None) -> list[Check]:
    """Every expected leaf against ``results`` (dicts, or JSON files), see the module docstring."""
    where = str(expected) if not isinstance(expected, Mapping) else "expected"
    if tolerance is not None and not (math.isfinite(tolerance) and tolerance >= 0):
        raise InputError(f"tolerance must be a finite number >= 0, got {tolerance}")
    if not isinstance(results, Mapping):
        results = read_json(results, "results file")
    if not isinstance(expected, Mapping):
        expected = read_json(expected, "expected values file")
    if not isinstance(expected, Mapping) or not expected:
        raise InputError(f"{where}: expected values are a JSON object mirroring the results, e.g. "
                         '{"results": {"cider": {"kendall_tau_c": 43.9}}}')
    checks: list[Check] = []
    _walk(expected, results, [], tolerance, checks, where)
    return checks


verify_results = verify  # the name ``capeval_plugins.bench`` exports (``bench.verify`` is this module)


def _walk(expected: Any, found: Any, keys: list[str], tolerance: float | None, checks: list[Check],
          where: str) -> None:
    path = ".".join(keys)
    if isinstance(expected, Mapping) and "value" in expected and set(expected) <= {"value", "tolerance"}:
        value = _number(expected["value"], where, f"{path}.value")
        own = expected.get("tolerance")
        tol = _number(own, where, f"{path}.tolerance") if own is not None else None
        if tol is not None and tol < 0:
            raise InputError(f"{where}: {path}.tolerance must be >= 0, got {tol}")
        _leaf(value, found, path, tol if tol is not None else tolerance, checks)
        return
    if isinstance(expected, Mapping):
        for key, sub in expected.items():
            inner = found.get(key) if isinstance(found, Mapping) else None
            _walk(sub, inner, [*keys, str(key)], tolerance, checks, where)
        return
    _leaf(_number(expected, where, path or "the value"), found, path, tolerance, checks)


def _leaf(value: float, found: Any, path: str, tolerance: float | None, checks: list[Check]) -> None:
    measured = None
    if not isinstance(found, bool) and isinstance(found, (int, float)) and math.isfinite(found):
        measured = float(found)
    checks.append(Check(path, value, default_tolerance(value) if tolerance is None else tolerance, measured))


def markdown(checks: list[Check]) -> str:
    """The table ``capeval verify`` prints, then a count."""
    lines = ["| value | expected | measured | difference | tolerance | status |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for c in checks:
        measured = "-" if c.measured is None else f"{c.measured:.6g}"
        diff = "-" if c.measured is None else f"{c.measured - c.expected:+.3g}"
        lines.append(f"| {c.path} | {c.expected:.6g} | {measured} | {diff} | {c.tolerance:.3g} | {c.status} |")
    ok = sum(c.status == "ok" for c in checks)
    lines.append(f"\n{ok} of {len(checks)} within tolerance" + ("" if ok == len(checks) else
                 f"; {sum(c.status == 'outside' for c in checks)} outside, "
                 f"{sum(c.status == 'missing' for c in checks)} missing"))
    return "\n".join(lines)
