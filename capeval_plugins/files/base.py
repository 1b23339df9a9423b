"""The file layer's ground floor: its errors, the open flags it uses, checks of names and paths, and inputs
(regular files only, opened non-blocking, so a FIFO or a device given as a file never hangs a run)."""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Any, BinaryIO, Callable, Iterator

from capeval_plugins.core.messages import DataError

Data = bytes | Callable[[BinaryIO], None]

# failures of the machine, not of the package: reported in one line (exit 2), naming the path
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO,
                                errno.EFBIG, errno.ENAMETOOLONG, errno.EMFILE, errno.ENFILE, errno.ENOTDIR})
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
# names a user gives for a standard stream: written through the open descriptor, never renamed over
STREAMS = {"/dev/stdout": 1, "/dev/stderr": 2}


class FileError(DataError):
    """A path the package refuses, or a file the machine would not let it write: a problem of the input or
    of the environment, not a bug (the command line reports it in one line, exit code 2)."""


class UnsafePath(FileError):
    """A path the package will not write, replace, delete or read as asked."""


class StorageError(FileError):
    """The machine refused a write (a full disk, a read-only or forbidden folder); the message says what and
    where. What was there before is left as it was."""

    def __init__(self, message: str, errno_: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno_


def is_environment_error(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in ENVIRONMENT_ERRNOS


def storage_error(err: OSError, path: Any, doing: str = "write") -> StorageError:
    """``err`` as one line naming ``path``: ``cannot write /x/y: No space left on device``."""
    reason = err.strerror or str(err)
    return StorageError(f"cannot {doing} {path}: {reason}", err.errno)


@contextlib.contextmanager
def _reported(path: Any, doing: str = "write") -> Iterator[None]:
    try:
        yield
    except OSError as err:
        if isinstance(err, FileError) or not is_environment_error(err):
            raise
        raise storage_error(err, path, doing) from None


# ---------------------------------------------------------------------------------------------------------
# Names and paths


def plain_name(name: str) -> str:
    """``name`` when it is one plain path component (not empty, no ``/``, not ``.`` or ``..``)."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
        raise UnsafePath(f"{name!r} is not a plain file name")
    return name


def relative_name(name: str) -> list[str]:
    """The components of a relative path made of plain names (a trailing ``/`` names a folder)."""
    if not isinstance(name, str) or name.startswith("/"):
        raise UnsafePath(f"{name!r} is not a relative path")
    parts = name.rstrip("/").split("/")
    for part in parts:
        plain_name(part)
    return parts


_KINDS = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "dir"), (stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "FIFO"),
          (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "special file")


def file_kind(path: str | os.PathLike, follow: bool = True) -> str | None:
    """``"file"``, ``"dir"``, ``"symlink"`` (``follow=False``), ``"FIFO"``, ... or None when nothing is there."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except OSError:
        return None
    return _kind(st.st_mode)


def check_links(path: str | os.PathLike) -> None:
    """Refuse a path through a symbolic link that someone else owns (the kernel's ``protected_symlinks`` rule,
    for every folder, not only sticky ones): another user's link in a shared folder must not steer where the
    package writes. Links owned by the user or by root are followed."""
    trusted = (os.geteuid(), 0)
    absolute = os.path.abspath(os.fspath(path))
    for candidate in (absolute, os.path.realpath(os.path.dirname(absolute))):
        prefix = "/"
        for part in candidate.split("/"):
            if not part:
                continue
            prefix = os.path.join(prefix, part)
            try:
                st = os.lstat(prefix)
            except OSError:
                break
            if stat.S_ISLNK(st.st_mode) and st.st_uid not in trusted:
                raise UnsafePath(f"{path}: the path goes through {prefix}, a symbolic link owned by another user "
                                 f"(uid {st.st_uid}); give a path without it")


def same_or_inside(path: str | os.PathLike, other: str | os.PathLike) -> bool:
    """Whether ``path`` is ``other`` (the same file, also through a hard or symbolic link) or lies inside the
    folder ``other``."""
    path, other = os.fspath(path), os.fspath(other)
    try:
        if os.path.exists(path) and os.path.exists(other) and os.path.samefile(path, other):
            return True
    except OSError:
        pass
    real, root = os.path.realpath(path), os.path.realpath(other)
    return real == root or (os.path.isdir(root) and real.startswith(root.rstrip("/") + "/"))


# ---------------------------------------------------------------------------------------------------------
# Inputs: regular files only, never blocking


def check_input(path: str | os.PathLike, what: str = "file") -> None:
    """Refuse, in one line saying what is there, an input path that is missing or is not a regular file (a
    folder, a FIFO, a device, a socket). Only ``stat`` is used: nothing is opened, so a FIFO never blocks."""
    kind = file_kind(path)
    if kind is None:
        raise UnsafePath(f"{what} not found: {os.fspath(path)}")
    if kind != "file":
        raise UnsafePath(_not_a_file(path, kind, what))


def _not_a_file(path: str | os.PathLike, kind: str, what: str) -> str:
    named = "folder" if kind == "dir" else kind
    return f"{what} {os.fspath(path)} is a {named}, not a regular file"


@contextlib.contextmanager
def open_input(path: str | os.PathLike, what: str = "file") -> Iterator[BinaryIO]:
    """A regular file opened for reading. A FIFO, a device or a socket is refused before it could block or
    stream forever (opened non-blocking, its type checked on the open descriptor)."""
    path = os.fspath(path)
    check_input(path, what)
    fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC)
    try:
        kind = _kind(os.fstat(fd).st_mode)
        if kind != "file":
            raise UnsafePath(_not_a_file(path, kind, what))
        if _NONBLOCK:
            os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def read_input(path: str | os.PathLike, what: str = "file") -> bytes:
    with open_input(path, what) as f:
        return f.read()

