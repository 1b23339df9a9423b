"""Warnings said once per process (truncation, fallbacks), not once per batch."""
from __future__ import annotations

import importlib
import threading
import warnings
from types import ModuleType

_warned: set[tuple] = set()


class ModelLoadError(OSError):
    """A model, tokenizer, processor or weights file that cannot be loaded or is not whole: one line naming the
    file and the first fault (exit code 2)."""


class DataError(ValueError):
    """The data cannot be scored as configured (e.g. too few distinct images for a Gaussian fit): a problem
    of the input, not a bug, so the command line reports it in one line (exit code 2)."""


class ExternalToolError(RuntimeError):
    """A tool run as a child process (Java: the PTB tokenizer, METEOR, SPICE) is missing, failed, died or stopped
    answering: a problem of the environment or of an input the tool cannot take, not a bug, so the command line
    reports it in one line (exit code 2). The message says which tool and what it printed."""


class UnknownName(KeyError):
    """A name the user gave (a metric, a benchmark, a protocol, a tiny checkpoint kind) that is not known; the
    message lists the known ones (one line, exit code 2). A KeyError of any other kind is a bug."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def unknown_name(what: str, name: str, known: "list[str] | tuple[str, ...]") -> UnknownName:
    """``no <what> named '<name>'; did you mean ...?`` (the close known names), or the known names when none is
    close: one line, for a typo in any name the user gives."""
    import difflib

    close = difflib.get_close_matches(name, known, n=3)
    hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"known: {', '.join(known)}"
    return UnknownName(f"no {what} named {name!r}; {hint}")


_warn_lock = threading.Lock()


def install_extra(extra: str) -> str:
    """How to install one of the package's optional extras. The package is installed from a clone (it is not
    on PyPI), so the hint names the editable install the docs use."""
    return f"pip install -e '.[{extra}]' in your capeval-plugins clone"


class MissingExtra(ModuleNotFoundError):
    """A part of the package is used without the optional dependency that it needs: one line naming the extra
    that installs it (the command line prints it and exits with 2). An ImportError of any other kind is a bug.

    ``MissingExtra(what, module, extra)`` words the message; ``MissingExtra(message)`` gives it whole."""

    def __init__(self, what: str, module: str | None = None, extra: str | None = None) -> None:
        if module is None:
            super().__init__(what)
        else:
            super().__init__(f"{what} needs {module}, which is not installed: {install_extra(extra or module)}",
                             name=module)
        self.extra = extra


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` (an ecosystem an adapter plugs into), or raise :class:`MissingExtra` naming ``extra``.
    A module missing inside an installed ``module`` is that package's own problem, raised as it is."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] != module.split(".")[0]:
            raise
        raise MissingExtra(what, module, extra) from None


class InternalsMoved(ImportError):
    """A library's internals that an adapter relies on are not where the versions it was checked on keep them
    (see ``capeval_plugins/adapters/*_internals.py``): one line naming the library, what moved and the versions
    checked, instead of an adapter that silently misbehaves."""

    def __init__(self, library: str, version: str, checked_on: tuple[str, ...] | list[str], what: str) -> None:
        super().__init__(
            f"capeval-plugins relies on {library} internals that {library} {version} does not have ({what}); they were "
            f"checked on {library} {', '.join(checked_on)}: install one of those versions, or update "
            f"capeval_plugins/adapters/ (the module that keeps {library}'s internals)")
        self.library = library


def warn_once(key: tuple, message: str) -> None:
    """Warn the first time ``key`` is seen in this process (e.g. one truncation warning per model)."""
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, stacklevel=3)
