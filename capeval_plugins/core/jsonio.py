"""JSON read from the files users give (caption files, benchmark files, score files, configs), and the one JSON
Lines reader every such file goes through.

An object that names a key twice is refused (:class:`RepeatedKeyError`): ``json`` would keep the last value and
drop the other silently. ``json``'s decoder follows nesting recursively, so a document nested deeper than Python's recursion limit
(``[[[[...]]]]``, crafted or a file of brackets) raises ``RecursionError``, which no reader expects: a traceback.
:func:`loads` reports it as the ``json.JSONDecodeError`` every reader already turns into a message naming its
file and line.

JSON Lines (:func:`json_lines`): a file is UTF-8 (a leading byte-order mark dropped), one JSON value per line,
lines ending at ``\\n`` (or ``\\r\\n``) only: U+2028, U+2029, U+0085, ``\\v`` and ``\\f`` are characters a JSON
string may hold as they are (``str.splitlines`` would cut a caption there). Blank lines are skipped. A problem
is a :class:`JSONLinesError` naming the file and line.
"""
from __future__ import annotations

import json
from typing import IO, Any


class JSONLinesError(ValueError):
    """A file that is not UTF-8 JSON Lines, by file and line (``line``: 1-based)."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


class RepeatedKeyError(json.JSONDecodeError):
    """An object that names one key twice: ``json`` keeps the last value and drops the other without a word (a
    prediction, a sample's references, a record's caption lost), so which one is meant cannot be known."""

    def __init__(self, key: str) -> None:
        super().__init__(f"key {json.dumps(key, ensure_ascii=False)[:80]} is given twice in one object (which value "
                         "is meant?)", "", 0)
        self.key = key

    def __str__(self) -> str:
        return self.msg


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise RepeatedKeyError(key)
            seen.add(key)
    return obj


def loads(text: str | bytes) -> Any:
    """``json.loads``, but an object naming a key twice is a :class:`RepeatedKeyError`, and a document nested past
    the recursion limit or holding an integer past Python's digit limit a ``json.JSONDecodeError`` (all
    ``JSONDecodeError``: every reader names its file)."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply to read", "", 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError:  # an integer past Python's digit limit (4,300): int() refuses it mid-parse
        raise json.JSONDecodeError("an integer of more digits than Python reads (4,300 unless configured)", "", 0) from None


def load(file: IO) -> Any:
    return loads(file.read())


def decode_text(data: bytes, where: str) -> str:
    """``data`` as UTF-8 text, a leading byte-order mark dropped; invalid UTF-8 is refused by its line."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise JSONLinesError(f"{where}:{line}: not valid UTF-8 (byte {data[err.start]:#04x} at offset {err.start}); "
                             "save the file as UTF-8", line) from None


def json_lines(text: str, where: str) -> list[tuple[int, Any]]:
    """``(line number, value)`` for every non-blank line of a JSON Lines text (see the module docstring)."""
    if text.startswith("\ufeff"):
        text = text[1:]
    rows = []
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            rows.append((lineno, loads(line)))
        except json.JSONDecodeError as err:
            raise JSONLinesError(f"{where}:{lineno}: not valid JSON: {err}", lineno) from None
    return rows
