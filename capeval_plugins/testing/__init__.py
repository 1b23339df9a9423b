"""Tiny, randomly initialised checkpoints of the real architectures, built on the spot.

For our tests and for users testing their own pipelines offline: each builder writes a directory that loads
through the same ``from_pretrained`` path as a hub id (safetensors weights, the real processor classes,
tokenizers trained in milliseconds on a synthetic caption corpus). Scores from such models are meaningless;
use them to test plumbing, shapes, invariances and agreement with independent implementations.

    from capeval_plugins.testing import tiny_checkpoint
    path = tiny_checkpoint("clip")              # cached per process (and per root, if given)
    capeval_plugins.load("clipscore", model=str(path))
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import threading
from pathlib import Path
from typing import Callable

from capeval_plugins.core.messages import UnknownName
from capeval_plugins.testing.corpus import caption_corpus

__all__ = ["build_tiny", "tiny_checkpoint", "scratch_folder", "kinds", "builder", "caption_corpus"]

_BUILDERS: dict[str, Callable[[Path, int], None]] = {}
_MODULES = ("clip", "vision_language", "text_encoders", "vilbert", "official", "vela", "captioners")
_built: dict[tuple[str, str, int], Path] = {}
_lock = threading.Lock()
_default_root: Path | None = None


def builder(kind: str) -> Callable:
    """Register ``fn(path, seed)`` as the builder of ``kind``."""

    def decorate(fn: Callable[[Path, int], None]) -> Callable[[Path, int], None]:
        _BUILDERS[kind] = fn
        return fn

    return decorate


def _load_builders() -> None:
    for name in _MODULES:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise


def kinds() -> list[str]:
    """Architectures that can be built."""
    _load_builders()
    return sorted(_BUILDERS)


def build_tiny(kind: str, path: str | Path, seed: int = 0) -> Path:
    """Build a tiny random checkpoint of ``kind`` into ``path`` (created); deterministic for a seed. It is
    built in a private staging folder and then moved in: a file of the user's already in ``path`` is never
    overwritten (the build is refused, naming it); files of an earlier tiny build there are replaced."""
    from capeval_plugins import files

    _load_builders()
    if kind not in _BUILDERS:
        raise UnknownName(f"unknown tiny checkpoint {kind!r}; available: {sorted(_BUILDERS)}")
    path = Path(path)
    with files.Claim(path, "tiny-checkpoint").open().staging(keep_partial=True) as staged:
        try:
            _BUILDERS[kind](staged, seed)
        except RuntimeError as err:  # a partial build (a missing optional package) names where it saved
            raise RuntimeError(str(err).replace(str(staged), str(path))) from err
    return path


def scratch_folder(prefix: str) -> Path:
    """A private temporary folder that this process removes when it exits (a forked child leaves it to its
    parent): for checkpoints built on the spot, so that test runs leave nothing in the temporary folder."""
    from capeval_plugins import files

    path, owner = files.private_folder(prefix), os.getpid()

    def remove() -> None:
        if os.getpid() == owner:
            with contextlib.suppress(OSError):  # already gone, or the process is ending on a full disk
                files.remove_private(path)

    atexit.register(remove)
    return path


def tiny_checkpoint(kind: str, root: str | Path | None = None, seed: int = 0) -> Path:
    """Build once per process (per root and seed) and return the directory."""
    global _default_root
    with _lock:
        if root is None:
            if _default_root is None:
                _default_root = scratch_folder("capeval-tiny-")
            root = _default_root
        key = (kind, str(root), seed)
        if key not in _built:
            _built[key] = build_tiny(kind, Path(root) / f"{kind}-seed{seed}", seed)
        return _built[key]
