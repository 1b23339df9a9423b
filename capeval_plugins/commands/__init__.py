"""Further ``capeval`` subcommands, one module each (``bench``, ``train``, ``calibrate``, ...).

A module here defines ``add_parser(subparsers)``, which adds its subcommand and sets ``func`` (called with
the parsed arguments, returns the exit code). ``capeval_plugins.cli`` picks every module up, so adding a
command touches no shared file.
"""
from __future__ import annotations

import importlib
import pkgutil


def add_all(subparsers) -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}").add_parser(subparsers)
