"""Numeric settings with the range their maths allows, checked in one place whatever the entry point.

A dataclass field declared with :func:`bounded` carries its bounds; :func:`field_problem` checks any field of
any dataclass by its annotation: a bool must be a bool (the string "false" is true), an int an integer, a float
a finite number (NaN and infinities would reach every score or weight), each inside its bounds. Metric options
(:func:`capeval_plugins.contract.build_config`) and training settings use it; :func:`cli_number` gives the
command line the same checks for flags that are not fields.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import numbers
import typing
from typing import Any, Callable

# The largest seed every generator takes (torch.manual_seed: below 2**64; numpy: any; int64 everywhere).
MAX_SEED = 2**63 - 1

_COMPARE = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
            "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None) -> Any:
    """A numeric field's default and its range (``ge``: >=, ``gt``: >, ``le``: <=, ``lt``: <)."""
    return dataclasses.field(default=default, metadata={"bounds": _limits(ge, gt, le, lt)})


def _limits(ge, gt, le, lt) -> dict[str, float]:
    return {key: value for key, value in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if value is not None}


@functools.cache
def field_kinds(cls: type) -> dict[str, frozenset[str]]:
    """Each field's annotated types by name (``int | None`` -> {"int", "None"}; generic types by origin)."""
    hints = typing.get_type_hints(cls)
    kinds = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        parts = typing.get_args(hint) if type(hint).__name__ in ("UnionType", "_UnionGenericAlias") else (hint,)
        kinds[f.name] = frozenset("None" if part is type(None) else
                                  getattr(typing.get_origin(part) or part, "__name__", str(part)) for part in parts)
    return kinds


def _is_bool(value: Any) -> bool:
    """A bool, or numpy's (known by its type's name: the command line's parsing, which checks its flags here,
    stays free of numpy's import)."""
    kind = type(value)
    return kind is bool or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


def value_problem(value: Any, kinds: frozenset[str], limits: dict[str, float]) -> str | None:
    """Why ``value`` is not of ``kinds`` (bool, int, float, None) inside ``limits``, or None."""
    if value is None and "None" in kinds:
        return None
    kinds = kinds - {"None"}
    if kinds == {"bool"}:
        return None if _is_bool(value) else f"expects true or false, got {value!r}"
    if not kinds or not kinds <= {"int", "float"}:
        return None
    if _is_bool(value) or not isinstance(value, numbers.Real):
        return f"expects {'an integer' if kinds == {'int'} else 'a number'}, got {value!r}"
    if kinds == {"int"} and not isinstance(value, numbers.Integral):
        return f"expects an integer, got {value!r}"
    if not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    for key, limit in limits.items():
        sign, holds = _COMPARE[key]
        if not holds(value, limit):
            return f"must be {sign} {limit:g}, got {value!r}"
    return None


def field_problem(obj: Any, name: str) -> str | None:
    """Why field ``name`` of the dataclass instance ``obj`` cannot be used, or None."""
    field = next(f for f in dataclasses.fields(obj) if f.name == name)
    return value_problem(getattr(obj, name), field_kinds(type(obj))[name], field.metadata.get("bounds", {}))


def check_fields(obj: Any, label: str) -> None:
    """Raise ``ValueError`` naming the first field of ``obj`` that :func:`field_problem` refuses."""
    for f in dataclasses.fields(obj):
        problem = field_problem(obj, f.name)
        if problem:
            raise ValueError(f"{label}: {f.name} {problem}")


def cli_number(kind: type, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
               lt: float | None = None) -> Callable[[str], Any]:
    """An argparse ``type=``: ``kind`` (int or float) parsed, finite and inside the bounds, else a usage error."""
    limits = _limits(ge, gt, le, lt)

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        problem = value_problem(value, frozenset({kind.__name__}), limits)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse
