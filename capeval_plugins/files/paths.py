"""Where the package keeps its per-user folders: one rule for every cache (METEOR's index, generated images,
converted models, fetched benchmarks, downloaded weights, the bench score cache, evaluate modules) and for the config folder.

A cache is ``$CAPEVAL_CACHE/<sub>``, else ``$XDG_CACHE_HOME/capeval_plugins/<sub>``, else
``~/.cache/capeval_plugins/<sub>``. As root, a base that lies in another user's folder (``sudo`` without ``-H``
keeps the user's HOME; ``sudo -E`` the user's ``XDG_*`` and ``CAPEVAL_CACHE`` too) gives way to root's own
``~/.cache`` / ``~/.config``: a folder made there would belong to root and lock the user out of it. Only paths
are computed here; nothing is created (the file layer, :mod:`capeval_plugins.files`, does that)."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "CAPEVAL_CACHE"  # relocates every capeval cache at once
PACKAGE_FOLDER = "capeval_plugins"
_XDG = {"config": "XDG_CONFIG_HOME", "cache": "XDG_CACHE_HOME"}


def user_base(kind: str) -> Path:
    """``$XDG_CONFIG_HOME`` / ``$XDG_CACHE_HOME`` (``kind``: "config" or "cache"), else ``~/.config`` /
    ``~/.cache``; as root, root's own home's instead of a base in another user's folder."""
    base = os.path.expanduser(os.environ.get(_XDG[kind]) or os.path.join("~", f".{kind}"))
    return Path(base) if _usable_base(base) else _root_home(kind)


def cache_dir(sub: str = "") -> Path:
    """The package's cache folder ``sub`` (the root itself when empty): ``$CAPEVAL_CACHE/<sub>``, else
    ``<user_base("cache")>/capeval_plugins/<sub>``; as root, ``$CAPEVAL_CACHE`` in another user's folder gives
    way to root's own cache, by the rule :func:`user_base` applies to ``HOME`` and ``XDG_CACHE_HOME``."""
    explicit = os.path.expanduser(os.environ.get(CACHE_ENV) or "")
    if explicit and _usable_base(explicit):
        root = Path(explicit)
    else:
        root = user_base("cache") / PACKAGE_FOLDER
    return root / sub if sub else root


def _usable_base(path: str) -> bool:
    """Whether the package may make its folders at ``path``: a user always (the file layer refuses what is not
    theirs); root only where the nearest existing folder on the way is root's, since a folder it made in another
    user's place would be root's and lock that user out."""
    return os.geteuid() != 0 or _nearest_owner(path) in (0, None)


def _root_home(kind: str) -> Path:
    import pwd

    return Path(pwd.getpwuid(0).pw_dir) / f".{kind}"


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
