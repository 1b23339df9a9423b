"""Where the package keeps its per-user folders: one rule for every cache (METEOR's index, generated images,
converted models, fetched benchmarks, downloaded weights, the bench score cache, evaluate modules) and for the config folder.

A cache is ``$CAPEVAL_CACHE/<sub>``, else ``$XDG_CACHE_HOME/capeval_plugins/<sub>``, else
``~/.cache/capeval_plugins/<sub>``. As root with another user's HOME (``sudo`` without ``-H``), root's own home
stands in for ``~``: a folder made in that user's home would belong to root and lock the user out of it. Only
paths are computed here; nothing is created (the file layer, :mod:`capeval_plugins.files`, does that)."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "CAPEVAL_CACHE"  # relocates every capeval cache at once
PACKAGE_FOLDER = "capeval_plugins"
_XDG = {"config": "XDG_CONFIG_HOME", "cache": "XDG_CACHE_HOME"}


def user_base(kind: str) -> Path:
    """``$XDG_CONFIG_HOME`` / ``$XDG_CACHE_HOME`` (``kind``: "config" or "cache"), else ``~/.config`` /
    ``~/.cache``; as root with another user's HOME, root's own home's instead."""
    base = os.path.expanduser(os.environ.get(_XDG[kind]) or os.path.join("~", f".{kind}"))
    if os.geteuid() == 0 and _nearest_owner(base) not in (0, None):
        import pwd

        base = os.path.join(pwd.getpwuid(0).pw_dir, f".{kind}")
    return Path(base)


def cache_dir(sub: str = "") -> Path:
    """The package's cache folder ``sub`` (the root itself when empty): ``$CAPEVAL_CACHE/<sub>``, else
    ``<user_base("cache")>/capeval_plugins/<sub>``."""
    explicit = os.environ.get(CACHE_ENV)
    root = Path(explicit).expanduser() if explicit else user_base("cache") / PACKAGE_FOLDER
    return root / sub if sub else root


def _nearest_owner(path: str) -> int | None:
    """The owner of ``path``, or of its nearest existing parent."""
    path = os.path.abspath(path)
    while True:
        try:
            return os.stat(path).st_uid
        except OSError:
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent
