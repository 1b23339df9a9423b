"""JSON read from the files users give (caption files, benchmark files, score files, configs).

``json``'s decoder follows nesting recursively, so a document nested deeper than Python's recursion limit
(``[[[[...]]]]``, crafted or a file of brackets) raises ``RecursionError``, which no reader expects: a traceback.
:func:`loads` reports it as the ``json.JSONDecodeError`` every reader already turns into a message naming its
file and line.
"""
from __future__ import annotations

import json
from typing import IO, Any


def loads(text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply to read", "", 0) from None


def load(file: IO) -> Any:
    return loads(file.read())
