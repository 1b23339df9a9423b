"""A function of the user's own named on the command line (``capeval caption --predict``, ``capeval bench
--function``)."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable


def load_function(spec: str, flag: str) -> Callable:
    """``module:function`` (importable, the current folder first) or ``path/to/file.py:function``."""
    from capeval_plugins.inputs import InputError

    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise InputError(f"{flag} expects MODULE:FUNCTION or FILE.py:FUNCTION, got {spec!r}")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise InputError(f"{flag} {spec}: no such file: {where}")
            loader = importlib.util.spec_from_file_location(Path(where).stem, where)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except (ImportError, SyntaxError) as err:  # its own module missing, or not Python
        raise InputError(f"{flag} {spec}: cannot import {where}: {err}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise InputError(f"{flag} {spec}: {where} has no function {name!r}")
    return fn
