"""A user's results checked against the user's expected values, each within a tolerance (``capeval verify``):
what ``capeval reproduce`` does with the published values shipped in the package, for any figure.

The expected file mirrors the results file: the same keys down to each number to check, e.g. for a
``capeval bench --json`` report::

    {"results": {"cider": {"kendall_tau_c": 43.9, "n": 5664}, "mine": {"kendall_tau_c": {"value": 51.2,
     "tolerance": 0.3}}}}

or for ``capeval score``'s summary line ``{"metrics": {"cider": {"score": 0.912}}}``. A leaf is a number, or
``{"value": x, "tolerance": t}``. The tolerance is absolute: the leaf's own, else the one given for the whole
check, else half a unit of the expected value's last written digit (43.9: 0.05; 5664: 0.5; 0.10: 0.005), the
rounding a published table is written with. The digits are the ones written: an expected file (or JSON text) is
read keeping them, and a number given from Python counts as written the way ``repr`` writes it (an ``int`` has
no decimals, ``44.0`` one, a :class:`~decimal.Decimal` its own). The bound is inclusive and decided exactly, on
the decimal numbers (a float as ``repr`` writes it), not on their binary approximations: 0.9125 is within 0.0005
of both 0.912 and 0.913. Every leaf is reported: within, outside, or missing from the results (absent, null, or
not a number).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from decimal import Decimal, localcontext
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
        return "ok" if within(self.measured, self.expected, self.tolerance) else "outside"

    def to_dict(self) -> dict[str, Any]:
        diff = None if self.measured is None else self.measured - self.expected
        return {"path": self.path, "expected": self.expected, "measured": self.measured, "difference": diff,
                "tolerance": self.tolerance, "status": self.status}


# Enough for two floats' decimal forms (1e308 down to 5e-324, 17 significant digits) to subtract exactly.
EXACT_DIGITS = 1000


def within(measured: float, expected: float, tolerance: float) -> bool:
    """``|measured - expected| <= tolerance`` on the numbers' decimal forms: a difference of exactly the
    tolerance is within, whichever way binary floating point would round it (0.9125 vs 0.913 and vs 0.912)."""
    with localcontext() as exact:
        exact.prec = EXACT_DIGITS
        return abs(_decimal(measured) - _decimal(expected)) <= _decimal(tolerance)


def _decimal(value: float | int | Decimal) -> Decimal:
    """A number as written: a float the way ``repr`` writes it (``float.__repr__``: numpy's own repr names
    its type)."""
    if isinstance(value, Decimal):
        return value
    return Decimal(float.__repr__(value)) if isinstance(value, float) else Decimal(value)


def read_json(path: str | os.PathLike, what: str, keep_digits: bool = False) -> Any:
    """A JSON document (or, for a results file, the last JSON line of a command's output, as ``capeval score``
    prints its summary). ``keep_digits``: see :func:`loads_keeping_digits`."""
    from capeval_plugins import files
    from capeval_plugins.core import jsonio

    try:
        files.check_input(path, what)  # a folder, a FIFO or a device is said as such, never opened
        text = jsonio.decode_text(files.read_input(path, what), str(path))
    except (files.FileError, jsonio.JSONLinesError) as err:
        raise InputError(str(err)) from None
    load = loads_keeping_digits if keep_digits else jsonio.loads
    try:
        return load(text)
    except json.JSONDecodeError:
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            return load(lines[-1]) if lines else None
        except json.JSONDecodeError as err:
            raise InputError(f"{path}: not JSON ({err})") from None


def loads_keeping_digits(text: str) -> Any:
    """JSON text with every number that has a fraction or an exponent read as the :class:`~decimal.Decimal`
    written (``0.10`` keeps its last digit, which sets its default tolerance; a float would be ``0.1``)."""
    from capeval_plugins.core import jsonio

    jsonio.loads(text)  # first through the reader every user's file goes through: a key given twice is refused
    return json.loads(text, parse_float=Decimal)


def default_tolerance(value: float | int | Decimal) -> float:
    """Half a unit of the last digit ``value`` is written with (43.9: 0.05; 44: 0.5; 0.912: 0.0005;
    ``Decimal("0.10")``: 0.005; a float as ``repr`` writes it, so 44.0: 0.05)."""
    exponent = _decimal(value).as_tuple().exponent
    return float(Decimal(5).scaleb(min(exponent, 0) - 1)) if isinstance(exponent, int) else 0.0


def _finite(value: Any) -> bool:
    """Whether ``value`` is a number (not a boolean) that a float holds finitely."""
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
        return False
    try:
        return math.isfinite(value)
    except (OverflowError, ValueError):  # an int of hundreds of digits; a signalling NaN
        return False


def _number(value: Any, where: str, what: str) -> int | float | Decimal:
    """``value`` as written (its digits set the default tolerance), refused unless it is a finite number."""
    if not _finite(value):
        raise InputError(f"{where}: {what} must be a finite number, got {json.dumps(value, default=str)[:40]}")
    return value


def verify(results: Mapping[str, Any] | str | os.PathLike, expected: Mapping[str, Any] | str | os.PathLike,
           tolerance: float | None = None) -> list[Check]:
    """Every expected leaf against ``results`` (dicts, or JSON files; ``expected`` also JSON text, ``{...}``),
    see the module docstring. Expected values read here keep their written digits."""
    if isinstance(expected, str) and expected.lstrip().startswith("{"):
        try:
            expected = loads_keeping_digits(expected)
        except json.JSONDecodeError as err:
            raise InputError(f"expected values: not valid JSON ({err})") from None
    where = str(expected) if not isinstance(expected, Mapping) else "expected"
    if tolerance is not None and not (math.isfinite(tolerance) and tolerance >= 0):
        raise InputError(f"tolerance must be a finite number >= 0, got {tolerance}")
    if not isinstance(results, Mapping):
        results = read_json(results, "results file")
    if not isinstance(expected, Mapping):
        expected = read_json(expected, "expected values file", keep_digits=True)
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
        _leaf(value, found, path, float(tol) if tol is not None else tolerance, checks)
        return
    if isinstance(expected, Mapping):
        for key, sub in expected.items():
            inner = found.get(key) if isinstance(found, Mapping) else None
            _walk(sub, inner, [*keys, str(key)], tolerance, checks, where)
        return
    _leaf(_number(expected, where, path or "the value"), found, path, tolerance, checks)


def _leaf(value: int | float | Decimal, found: Any, path: str, tolerance: float | None, checks: list[Check]) -> None:
    measured = float(found) if _finite(found) else None
    own = default_tolerance(value) if tolerance is None else tolerance  # from the digits, before float() drops any
    checks.append(Check(path, float(value), own, measured))


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
