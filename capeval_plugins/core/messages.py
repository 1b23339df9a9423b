"""Warnings said once per process (truncation, fallbacks), not once per batch."""
from __future__ import annotations

import threading
import warnings

_warned: set[tuple] = set()


class DataError(ValueError):
    """The data cannot be scored as configured (e.g. too few distinct images for a Gaussian fit): a problem
    of the input, not a bug, so the command line reports it in one line (exit code 2)."""


class ExternalToolError(RuntimeError):
    """A tool run as a child process (Java: the PTB tokenizer, METEOR, SPICE) is missing, failed, died or stopped
    answering: a problem of the environment or of an input the tool cannot take, not a bug, so the command line
    reports it in one line (exit code 2). The message says which tool and what it printed."""


class MissingExtra(ImportError):
    """An optional dependency that a chosen metric or option needs is not installed; the message says which
    and how to install it (the command line prints it in one line, exit code 2). An ImportError of any other
    kind is a bug."""


class UnknownName(KeyError):
    """A name the user gave (a metric, a benchmark, a protocol, a tiny checkpoint kind) that is not known; the
    message lists the known ones (one line, exit code 2). A KeyError of any other kind is a bug."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


_warn_lock = threading.Lock()


def install_extra(extra: str) -> str:
    """How to install one of the package's optional extras. The package is installed from a clone (it is not
    on PyPI), so the hint names the editable install the docs use."""
    return f"pip install -e '.[{extra}]' in your capeval-plugins clone"


def warn_once(key: tuple, message: str) -> None:
    """Warn the first time ``key`` is seen in this process (e.g. one truncation warning per model)."""
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, stacklevel=3)
