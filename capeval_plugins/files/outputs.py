"""Outputs the user names (``--out``, ``--json``, a saved fit): checked before the work starts, then a regular
file is replaced whole and a stream (a FIFO, a character device, ``/dev/stdout``) written through."""
from __future__ import annotations

import contextlib
import errno
import os
import secrets as _secrets
import stat
import sys
from pathlib import Path
from typing import Any, Iterable

from capeval_plugins.files.base import (_CLOEXEC, _NOFOLLOW, STREAMS, Data, StorageError, UnsafePath, _reported,
                                         check_links, file_kind, same_or_inside, storage_error)
from capeval_plugins.files.folder import Folder
from capeval_plugins.files.paths import cache_dir
from capeval_plugins.files.secret import secret_path

# The package's caches under cache_dir() that hold its state (each module names its own subfolder: bench/cache.py,
# bench/fetch.py, models/generation.py, resources/meteor_table.py, commands/convert_official.py,
# commands/fetch_weights.py). evaluate_modules/ is not one: it holds the scripts `capeval evaluate-module` writes
# as outputs.
PACKAGE_CACHES = {"bench": "the score cache", "benchmarks": "fetched benchmarks", "generated": "generated images",
                  "meteor": "METEOR's paraphrase index", "models": "converted models", "weights": "downloaded weights"}


def stream_fd(path: str | os.PathLike) -> int | None:
    """The descriptor a standard stream name stands for (``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``,
    ``/proc/self/fd/N``), or None."""
    text = os.fspath(path)
    if text in STREAMS:
        return STREAMS[text]
    for prefix in ("/dev/fd/", "/proc/self/fd/"):
        if text.startswith(prefix) and text[len(prefix):].isdigit():
            return int(text[len(prefix):])
    return None


def output_kind(path: str | os.PathLike) -> str:
    """How :func:`write_output` treats ``path``: ``"stream"`` (a standard stream name, a FIFO or a character
    device: written through), ``"file"`` (a regular file or a new name: replaced whole). Anything else is
    refused with a message saying why."""
    path = os.fspath(path)
    if stream_fd(path) is not None:
        return "stream"
    kind = file_kind(path, follow=False)
    if kind in (None, "file"):
        return "file"
    if kind in ("FIFO", "character device"):
        return "stream"
    if kind == "symlink":
        raise UnsafePath(f"{path} is a symbolic link (to {os.readlink(path)}); capeval writes outputs as regular "
                         "files and does not follow links it did not make: give the target's own path")
    raise UnsafePath(f"{path} is a {kind}; give a file name")


def kept_by_the_package(what: str = "--out") -> list[tuple[Path, str]]:
    """The files and folders the package keeps its own state in, each with what it is: never an output (the
    secret replaced, every run folder and cache row made with it is refused; a cache replaced, refused or
    rebuilt). The score cache is a file of the package's when named as one: ``what == "--cache"``."""
    key = secret_path()
    kept = [(key, f"your secret key {key} (it signs run folders and cache rows)")]
    for sub, holds in PACKAGE_CACHES.items():
        if not (sub == "bench" and what == "--cache"):
            kept.append((cache_dir(sub), f"the package's cache folder {cache_dir(sub)} ({holds})"))
    return kept


def check_output(path: str | os.PathLike, inputs: Iterable[Any] = (), what: str = "--out") -> str:
    """Refuse, before any work, an output that cannot or must not be written: a folder, a link, a socket,
    one of the run's ``inputs`` (files, or folders it must not lie in: a model folder), a file the package
    keeps (:func:`kept_by_the_package`), a folder that does not exist or that the user cannot write. Returns
    :func:`output_kind`."""
    path = Path(path)
    if path.is_dir() and stream_fd(path) is None:
        raise UnsafePath(f"{what} {path} is a folder; give a file name")
    kind = output_kind(path)
    for given in inputs:
        if given is None or (isinstance(given, str) and not given):
            continue
        if same_or_inside(path, given):
            relation = "is" if not os.path.isdir(given) or os.path.realpath(path) == os.path.realpath(given) else "is inside"
            raise UnsafePath(f"{what} {path} {relation} an input of this run ({given}); give another file name")
    for kept, description in kept_by_the_package(what):
        if same_or_inside(path, kept):  # also through a symbolic link on the way, or a hard link to the file
            relation = "is inside" if os.path.isdir(kept) else "is"
            raise UnsafePath(f"{what} {path} {relation} {description}; give another file name")
    if kind == "stream":
        _check_stream(path)
        return kind
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise UnsafePath(f"cannot write {path}: folder {folder} does not exist")
    check_links(path)
    if _read_only(folder):
        raise StorageError(f"cannot write {path}: read-only file system", errno.EROFS)
    if path.exists() and not os.access(path, os.W_OK):
        raise StorageError(f"cannot write {path}: permission denied", errno.EACCES)
    try:  # the folder takes a new file (a read-only mount or /proc answers only when asked)
        with Folder.open(folder)[0] as where:
            probe = f".{path.name[:80]}.{_secrets.token_hex(6)}.tmp"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600,
                             dir_fd=where.fd))
            os.unlink(probe, dir_fd=where.fd)
    except OSError as err:
        raise storage_error(err, path) from None
    return kind


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def _check_stream(path: str | os.PathLike) -> None:
    """A descriptor named as an output (``/dev/fd/3``) must be open for writing now, not found closed after
    the whole run was scored."""
    import fcntl

    fd = stream_fd(path)
    if fd is None:
        return
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        raise UnsafePath(f"cannot write {path}: descriptor {fd} is not open (give a file name, or open it in the "
                         f"shell: 3>file)") from None
    if flags & os.O_ACCMODE == os.O_RDONLY:
        raise UnsafePath(f"cannot write {path}: descriptor {fd} is open for reading only")


def write_output(path: str | os.PathLike, data: Data, inputs: Iterable[Any] = (), what: str = "--out") -> None:
    """Write an output the user named (see :func:`check_output`, run again now): a regular file is replaced
    whole (a new file renamed over it: the old file's other hard links and a reader see the old or the new
    content, never a mix); a stream is written through, never renamed over or truncated."""
    kind = check_output(path, inputs, what)
    if kind == "stream":
        _write_stream(path, data)
        return
    path = Path(path)
    folder, _ = Folder.open(path.parent if str(path.parent) else Path("."))
    with folder:
        folder.write(path.name, data, leftovers=True)


def _write_stream(path: str | os.PathLike, data: Data) -> None:
    fd = stream_fd(path)
    own = fd is None
    with _reported(path):
        if own:
            fd = os.open(path, os.O_WRONLY | os.O_NOCTTY | _CLOEXEC)  # no O_CREAT, no O_TRUNC: written through
            if not stat.S_ISFIFO(os.fstat(fd).st_mode) and not stat.S_ISCHR(os.fstat(fd).st_mode):
                os.close(fd)
                raise UnsafePath(f"{path} changed into a regular file; run again")
        else:  # what was printed before goes first
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
        try:
            f = os.fdopen(os.dup(fd), "wb")
            with f:
                if callable(data):
                    data(f)
                else:
                    f.write(data)
        finally:
            if own:
                os.close(fd)
