"""The one place where the package creates, replaces or deletes a file (docs/files.md states the guarantees).

Three kinds of path meet the package:

- **inputs** (caption files, images, score files, saved fits): read with :func:`open_input` /
  :func:`read_input`, regular files only and opened non-blocking, so a FIFO or a device given as a file never
  hangs a run;
- **outputs the user names** (``--out``, ``--json``, a saved fit): checked with :func:`check_output` before
  the work starts and written with :func:`write_output`: a regular file is replaced whole (a private temporary
  file renamed over it, so the old file's other names and a symlink's target are never written); a FIFO, a
  character device or a standard stream (``/dev/stdout``) is written through; anything else, an input of the
  run, and a symbolic link the user did not name as a stream are refused;
- **folders the package fills** (run folders, training outputs, converted and tiny checkpoints, caches):
  :class:`Folder` works on an open folder (a file descriptor), by plain names only (no ``/``, no ``..``), never
  following a symbolic link, creating files exclusively and replacing them by rename; :class:`Claim` adds an
  authenticated list of what the package wrote there, and only what it lists is ever replaced or removed.

The list is authenticated with an HMAC keyed by a secret kept outside every run folder, in a file only the
user can read (:func:`secret`): a marker copied from elsewhere, written by hand or edited (say, to list
``../victim.txt``) does not verify and is refused.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import mmap
import os
import secrets as _secrets
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator

from capeval_plugins.core.messages import DataError
from capeval_plugins.core.paths import user_base

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


@contextlib.contextmanager
def open_input(path: str | os.PathLike, what: str = "file") -> Iterator[BinaryIO]:
    """A regular file opened for reading. A FIFO, a device or a socket is refused before it could block or
    stream forever (opened non-blocking, its type checked on the open descriptor)."""
    path = os.fspath(path)
    kind = file_kind(path)
    if kind is None:
        raise UnsafePath(f"{what} not found: {path}")
    if kind != "file":
        raise UnsafePath(f"{path} is a {kind}, not a regular file")
    fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC)
    try:
        kind = _kind(os.fstat(fd).st_mode)
        if kind != "file":
            raise UnsafePath(f"{path} is a {kind}, not a regular file")
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


# ---------------------------------------------------------------------------------------------------------
# The user's secret: what makes a marker the package's own


def config_dir() -> Path:
    """``$CAPEVAL_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/capeval_plugins`` (``~/.config/capeval_plugins``; as
    root with another user's HOME, root's own, see :func:`user_base`)."""
    if os.environ.get("CAPEVAL_CONFIG_DIR"):
        return Path(os.environ["CAPEVAL_CONFIG_DIR"])
    return user_base("config") / "capeval_plugins"


SECRET_FILE = "secret.key"
_secret_cache: dict[str, bytes] = {}


def secret() -> bytes:
    """The user's 32-byte secret, made on first use: ``<config_dir>/secret.key``, created 0600 in a folder
    made 0700. A key file that is a link, not the user's, or readable by others is refused."""
    folder = config_dir()
    cached = _secret_cache.get(str(folder))
    if cached is not None:
        return cached
    with _reported(folder, "create the key folder"):
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / SECRET_FILE
    if not os.path.lexists(path):  # made whole under a private name, then linked in: a racing process
        try:                         # sees no key or the whole key, and the first one made wins
            with Folder.open(folder, mine=True)[0] as where:
                where.write(SECRET_FILE, _secrets.token_bytes(32), replace=False, mode=0o600)
        except FileExistsError:
            pass
        except (OSError, UnsafePath) as err:
            raise StorageError(f"cannot create the key file {path}: {getattr(err, 'strerror', None) or err}; set "
                               "CAPEVAL_CONFIG_DIR to a private folder you can write") from None
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    except OSError as err:
        raise UnsafePath(f"cannot read the key file {path}: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise UnsafePath(f"the key file {path} must be a regular file of yours that only you can read "
                             "(chmod 600); remove it to make a new one (run folders made with it are then refused)")
        key = os.read(fd, 64)
    finally:
        os.close(fd)
    if len(key) != 32:
        raise UnsafePath(f"the key file {path} is damaged (remove it to make a new one)")
    _secret_cache[str(folder)] = key
    return key


def mac(key: bytes, *parts: bytes | str) -> str:
    """HMAC-SHA256 of ``parts`` (each length-prefixed, so no two part lists collide), hex."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


def signed_json(content: Any, kind: str, key: bytes | None = None) -> bytes:
    """``content`` as JSON with an HMAC of it (``kind`` separates uses: a marker never verifies as a run)."""
    body = json.dumps(content, sort_keys=True, default=str)
    tag = mac(key if key is not None else secret(), kind, body)
    return json.dumps({"content": json.loads(body), "hmac": tag}, indent=1, sort_keys=True).encode()


def read_signed_json(data: bytes | None, kind: str, key: bytes | None = None) -> Any:
    """The content of :func:`signed_json` output, or None when it does not verify (damaged, forged, written
    with another key, or not such a file)."""
    if data is None:
        return None
    try:
        outer = json.loads(data)
        body = json.dumps(outer["content"], sort_keys=True, default=str)
        tag = mac(key if key is not None else secret(), kind, body)
        if not isinstance(outer.get("hmac"), str) or not hmac.compare_digest(tag, outer["hmac"]):
            return None
        return outer["content"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------------------
# A folder by descriptor


class Folder:
    """An open folder: every operation is relative to its descriptor, by plain names only, and follows no
    symbolic link (a link planted at one of the names is refused, or replaced by rename, never written
    through). Files are created exclusively; a file is replaced by writing a new one and renaming it over."""

    def __init__(self, fd: int, path: str | os.PathLike) -> None:
        self.fd = fd
        self.path = Path(path)

    # -- opening --

    @classmethod
    def open(cls, path: str | os.PathLike, *, create: bool = False, mine: bool = False,
             mode: int = 0o777) -> tuple["Folder", bool]:
        """Open ``path`` (no symbolic link as its last component; parents through links of the user's or root
        only). ``create``: make it (and its parents) when missing. ``mine``: it must belong to the user.
        Returns the folder and whether it was made now."""
        path = Path(path)
        check_links(path)
        created = False
        if create:
            try:
                if not path.parent.is_dir():
                    path.parent.mkdir(parents=True, exist_ok=True)
                os.mkdir(path, mode)
                created = True
            except FileExistsError:
                pass
            except OSError as err:
                raise storage_error(err, path, "create the folder") from None
        try:
            fd = os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
        except FileNotFoundError:
            raise UnsafePath(f"folder not found: {path}") from None
        except OSError as err:
            kind = file_kind(path, follow=False)
            if kind not in (None, "dir"):
                raise UnsafePath(f"{path} is a {kind}, not a folder" + (
                    " (capeval does not follow symbolic links it did not make: give the folder itself)"
                    if kind == "symlink" else "")) from None
            raise storage_error(err, path, "open the folder") from None
        folder = cls(fd, path)
        if mine and os.fstat(fd).st_uid != os.geteuid():
            folder.close()
            raise UnsafePath(f"{path} belongs to another user; capeval writes only into folders of yours")
        return folder, created

    def sub(self, name: str, create: bool = False) -> "Folder":
        """The subfolder ``name`` (made when missing with ``create``)."""
        plain_name(name)
        if create:
            with _reported(self.path / name, "create the folder"):
                try:
                    os.mkdir(name, 0o777, dir_fd=self.fd)
                except FileExistsError:
                    pass
        try:
            fd = os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            raise
        except OSError as err:
            kind = self.kind(name)
            if kind not in (None, "dir"):
                raise UnsafePath(f"{self.path / name} is a {kind}, not a folder") from None
            raise storage_error(err, self.path / name, "open the folder") from None
        return Folder(fd, self.path / name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Folder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- looking --

    def kind(self, name: str) -> str | None:
        try:
            return _kind(os.stat(plain_name(name), dir_fd=self.fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return None

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def size(self, name: str) -> int:
        """The size of the regular file ``name`` (0 when missing or not a regular file)."""
        try:
            st = os.stat(plain_name(name), dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return 0
        return st.st_size if stat.S_ISREG(st.st_mode) else 0

    def _open_file(self, name: str, flags: int, mode: int = 0o666, single: bool = False) -> int:
        """Open the regular file ``name`` (never through a link); ``single``: refuse a file with other names
        (a hard link planted at our name would have us write into someone's file)."""
        try:
            fd = os.open(plain_name(name), flags | _NOFOLLOW | _CLOEXEC | _NONBLOCK, mode, dir_fd=self.fd)
        except FileNotFoundError:
            raise
        except OSError as err:
            kind = self.kind(name)
            if err.errno == errno.ELOOP or kind == "symlink":
                raise UnsafePath(f"{self.path / name} is a symbolic link; capeval does not follow links it did "
                                 "not make") from None
            if kind not in (None, "file"):  # a folder (EISDIR), a FIFO without a reader (ENXIO), ...
                raise UnsafePath(f"{self.path / name} is a {kind}, not a regular file") from None
            raise
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = f"is a {_kind(st.st_mode)}, not a regular file"
        elif single and st.st_nlink != 1:
            problem = f"has {st.st_nlink} names (a hard link); capeval writes only files it made"
        if problem:
            os.close(fd)
            raise UnsafePath(f"{self.path / name} {problem}")
        os.set_blocking(fd, True)
        return fd

    def read(self, name: str) -> bytes | None:
        """The bytes of the regular file ``name``, None when it is missing."""
        try:
            fd = self._open_file(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def map(self, name: str) -> mmap.mmap | bytes | None:
        """The regular file ``name`` mapped read-only (``b""`` when empty), None when it is missing."""
        try:
            fd = self._open_file(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            return mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else b""
        finally:
            os.close(fd)

    # -- writing --

    def write(self, name: str, data: Data, *, replace: bool = True, scratch: str | None = None,
              mode: int = 0o666, leftovers: bool = False) -> None:
        """Write ``name`` whole: into a new file (``scratch``, else a random hidden name), then renamed over
        ``name`` (``replace=False``: linked in, so an existing ``name`` is never replaced: FileExistsError).
        A failure leaves ``name`` as it was and no scratch file. ``leftovers`` (an output in a folder of the
        user's): the hidden name is signed, and the signed hidden files an earlier writer of ``name`` left
        when it was killed are removed first (:meth:`remove_leftovers`)."""
        plain_name(name)
        if self.kind(name) == "dir":
            raise UnsafePath(f"{self.path / name} is a folder")
        if leftovers:
            self.remove_leftovers(name)
        tmp = scratch if scratch is not None else _hidden_name(name, signed=leftovers)
        if scratch is not None:
            self.unlink(scratch)  # a crash's leftover (a regular file of the package's name)
            if self.kind(scratch) is not None:
                raise UnsafePath(f"{self.path / scratch} is a {self.kind(scratch)}; capeval does not remove what it "
                                 "did not make")
        with _reported(self.path / name):
            fd = os.open(plain_name(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode,
                         dir_fd=self.fd)
            try:
                _hold(fd)  # while this writer lives, no later run takes the file for a leftover
                with os.fdopen(fd, "wb") as f:
                    if callable(data):
                        data(f)
                    else:
                        f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                if replace:
                    os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
                else:
                    os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
                    os.unlink(tmp, dir_fd=self.fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=self.fd)
                raise

    def remove_leftovers(self, name: str) -> list[str]:
        """Remove the hidden files a killed writer of ``name`` left here, and only those: a name of the form
        :func:`_hidden_name` makes with its signature verifying under the user's secret, a regular file of the
        user's with no other name, older than a minute and locked by no live writer. Returns what went."""
        prefix = f".{name[:80]}."
        gone = []
        for entry in self.names():
            if not (entry.startswith(prefix) and entry.endswith(".tmp") and _signed(name, entry[len(prefix):-4])):
                continue
            try:
                fd = self._open_file(entry, os.O_RDONLY, single=True)
            except (OSError, UnsafePath):
                continue
            try:
                st = os.fstat(fd)
                if st.st_uid != os.geteuid() or time.time() - st.st_mtime < LEFTOVER_AGE or not _free(fd):
                    continue
                with _reported(self.path / entry, "remove"):
                    os.unlink(entry, dir_fd=self.fd)
                gone.append(entry)
            finally:
                os.close(fd)
        return gone

    def append(self, name: str, data: bytes) -> None:
        """Append ``data`` to ``name`` (made when missing), synced; a failed append is cut off again, so the
        file ends where it ended before."""
        with _reported(self.path / name):
            fd = self._open_file(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, single=True)
            try:
                end = os.fstat(fd).st_size
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, end)
                    raise
            finally:
                os.close(fd)

    def open_append(self, name: str) -> BinaryIO:
        """The regular file ``name`` (made when missing) open for reading and writing, positioned at its end:
        a download resumed where it stopped. Never through a link, never a file with other names."""
        with _reported(self.path / name):
            fd = self._open_file(name, os.O_RDWR | os.O_CREAT, single=True)
        handle = os.fdopen(fd, "r+b")
        handle.seek(0, os.SEEK_END)
        return handle

    def truncate(self, name: str, size: int) -> None:
        with _reported(self.path / name):
            fd = self._open_file(name, os.O_WRONLY, single=True)
            try:
                os.ftruncate(fd, size)
                os.fsync(fd)
            finally:
                os.close(fd)

    def lock(self, name: str) -> tuple[int, bool]:
        """The descriptor of the lock file ``name`` (made when missing: True), a regular file of the user's
        with no other name, for ``flock``."""
        with _reported(self.path / name):
            try:
                fd = os.open(plain_name(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644,
                             dir_fd=self.fd)
                return fd, True
            except FileExistsError:
                fd = self._open_file(name, os.O_RDWR, single=True)
                if os.fstat(fd).st_uid != os.geteuid():
                    os.close(fd)
                    raise UnsafePath(f"{self.path / name} belongs to another user")
                return fd, False

    def unlink(self, name: str) -> bool:
        """Remove ``name`` if it is a regular file (a link, a folder or anything else stays); True if it was."""
        if self.kind(name) != "file":
            return False
        with _reported(self.path / name, "remove"):
            try:
                os.unlink(name, dir_fd=self.fd)
            except FileNotFoundError:
                return False
        return True

    def rmdir(self, name: str) -> bool:
        """Remove the folder ``name`` if it is empty; True if it was."""
        if self.kind(name) != "dir":
            return False
        try:
            os.rmdir(name, dir_fd=self.fd)
        except OSError:
            return False
        return True

    def rename(self, name: str, new: str) -> None:
        """Rename ``name`` to ``new`` in this folder (``new`` replaced when it is a file or an empty folder)."""
        with _reported(self.path / name, "rename"):
            os.rename(plain_name(name), plain_name(new), src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def set_aside(self, name: str, why: str) -> str:
        """Give the regular file ``name`` a new name, ``<name>.<why>-<random>``, never replacing anything (a
        damaged file of the package's is kept for a look, not deleted); returns the new name."""
        if self.kind(name) != "file":
            raise UnsafePath(f"{self.path / name} is not a regular file")
        new = plain_name(f"{name}.{why}-{_secrets.token_hex(4)}")
        with _reported(self.path / name, "rename"):
            os.link(name, new, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
            os.unlink(name, dir_fd=self.fd)
        return str(self.path / new)

    def remove_tree(self, name: str) -> None:
        """Remove the folder ``name`` and everything in it, following no link (a link inside is removed, its
        target never touched). Only for folders the package made whole (a staging folder)."""
        if self.kind(name) != "dir":
            return
        with self.sub(name) as sub:
            for entry in sub.names():
                if sub.kind(entry) == "dir":
                    sub.remove_tree(entry)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry, dir_fd=sub.fd)
        self.rmdir(name)


LEFTOVER_AGE = 60.0  # seconds: a hidden file this young may be a writer's that has not locked it yet


def _scratch_tag(name: str, nonce: str) -> str | None:
    try:
        return mac(secret(), "scratch", name, nonce)[:16]
    except FileError:  # no secret here (a read-only home): the file is not signed, and never taken as a leftover
        return None


def _hidden_name(name: str, signed: bool = False) -> str:
    """A new hidden name beside ``name``: ``.<name>.<random>.tmp``; ``signed``: the random part followed by an
    HMAC of it and ``name`` (under the user's secret), so a later run can tell the file is capeval's own."""
    nonce = _secrets.token_hex(6)
    tag = _scratch_tag(name, nonce) if signed else None
    return f".{name[:80]}.{nonce}{tag or ''}.tmp"


def _signed(name: str, middle: str) -> bool:
    if len(middle) != 28 or any(c not in "0123456789abcdef" for c in middle):
        return False
    tag = _scratch_tag(name, middle[:12])
    return tag is not None and hmac.compare_digest(tag, middle[12:])


def _hold(fd: int) -> None:
    import fcntl

    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _free(fd: int) -> bool:
    """Whether no live process holds a lock on the open file (its writer is gone)."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


class CacheFolder:
    """A cache the package keeps in a folder of its own, as byte entries in subfolders (what the core's caches,
    e.g. :class:`capeval_plugins.core.generation.CachedGenerator`, are given instead of touching files): an
    entry is read by descriptor with no link followed, and written as a new file renamed over the old one, so
    concurrent processes can share the folder."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"CacheFolder({str(self.root)!r})"

    def read(self, sub: str, name: str) -> bytes | None:
        """The entry, or None when there is none (or it is not a regular file the package wrote)."""
        if not (self.root / sub / name).is_file():
            return None
        try:
            with Folder.open(self.root / sub)[0] as folder:
                return folder.read(name)
        except (OSError, FileError):
            return None

    def write(self, sub: str, name: str, data: Data) -> None:
        root, _ = Folder.open(self.root, create=True, mine=True)
        with root, root.sub(sub, create=True) as folder:
            folder.write(name, data)


def private_folder(prefix: str) -> Path:
    """A new folder in the system's temporary folder that only this user can enter (mode 0700, a name no one
    could know before: nothing can be planted in it). Fill it through :class:`Folder`; end it with
    :func:`remove_private`."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def remove_private(path: str | os.PathLike) -> None:
    """Remove a :func:`private_folder` and what is in it, following no link."""
    path = Path(path)
    with Folder.open(path.parent)[0] as parent:
        parent.remove_tree(path.name)


# ---------------------------------------------------------------------------------------------------------
# A folder the package fills, with the authenticated list of what it wrote


class Claim:
    """A folder the package writes into and the list of what it wrote there, kept in ``marker`` with an
    HMAC (:func:`secret`). Only listed names are ever replaced or removed; a name that exists and is not
    listed is the user's and is refused, never overwritten. ``scratch``: names a crash of the package can
    leave before its marker exists (regular files only; they count as empty)."""

    def __init__(self, path: str | os.PathLike, kind: str, marker: str = ".capeval-owned",
                 scratch: Iterable[str] = ()) -> None:
        self.path = Path(path)
        self.kind = kind
        self.marker = plain_name(marker)
        self.scratch = tuple(scratch)
        self.folder: Folder | None = None
        self.files: list[str] = []
        self.created_root = False
        self.extra: dict[str, Any] = {}
        self.found = False  # a valid marker was there when opened

    def open(self, *, new_or_empty: bool = False, create: bool = True) -> "Claim":
        """Open (or make) the folder and read its marker. ``new_or_empty``: a folder without a valid marker
        must be empty (but for scratch); otherwise unlisted names are simply never touched."""
        if self.path.exists() and not self.path.is_dir() and not self.path.is_symlink():
            raise UnsafePath(f"{self.path} is a file; give a folder")
        if new_or_empty and self.path.is_dir() and not self.path.is_symlink():
            self._refuse_foreign()  # before anything is made in someone's folder
        self.folder, self.created_root = Folder.open(self.path, create=create, mine=True)
        self.reload(new_or_empty)
        return self

    def reload(self, new_or_empty: bool = False) -> None:
        """Read the marker again (after taking a lock: nothing may have moved in meanwhile)."""
        content = self._read_marker()
        self.found = content is not None
        if content is None:
            if new_or_empty:
                self._refuse_foreign()
            self.files, self.extra = [], {}
            return
        self.files = list(content["files"])
        self.created_root = bool(content.get("created_root"))
        self.extra = {k: v for k, v in content.items() if k not in ("kind", "files", "created_root")}

    def _read_marker(self) -> dict | None:
        assert self.folder is not None
        try:
            data = self.folder.read(self.marker)
        except UnsafePath:
            data = b"not a marker"
        if data is None:
            return None
        content = read_signed_json(data, "marker")
        valid = (isinstance(content, dict) and content.get("kind") == self.kind and isinstance(content.get("files"), list)
                 and all(isinstance(f, str) for f in content["files"]))
        if valid:
            for name in content["files"]:
                relative_name(name)  # defence in depth: an authentic list still names only plain paths
            return content
        # never a crash of ours (a marker is renamed in whole): someone else's file, left as it is
        raise UnsafePath(
            f"{self.path}: its {self.marker} is damaged, of another kind, or was not written by capeval for this "
            "user, so what in the folder capeval wrote is unknown; capeval leaves it alone: remove the folder "
            "yourself, or give another one")

    def _only_scratch(self) -> bool:
        """Whether the folder holds nothing but the regular files a crash of the package can leave before its
        marker exists (named by the package's convention: ``scratch``)."""
        try:
            entries = sorted(os.listdir(self.path))
        except OSError:
            return False
        return all(e in self.scratch and file_kind(self.path / e, follow=False) == "file" for e in entries)

    def _refuse_foreign(self) -> None:
        if self.folder is not None and self.found:
            return
        if (self.path / self.marker).is_file() and not (self.path / self.marker).is_symlink():
            return  # read and verified by reload
        if not self._only_scratch():
            raise UnsafePath(
                f"{self.path} is not empty and is not a capeval {self.kind} folder (it has no valid "
                f"{self.marker}); capeval only writes one into a new or empty folder and never deletes what it "
                "did not write: give another folder")

    def _write_marker(self) -> None:
        assert self.folder is not None
        content = {**self.extra, "kind": self.kind, "created_root": self.created_root, "files": self.files}
        self.folder.write(self.marker, signed_json(content, "marker"), scratch=self.marker + ".tmp")
        self.found = True

    def own(self, names: Iterable[str]) -> None:
        """Add ``names`` (relative paths; a trailing ``/`` for a folder) to the list, before they are
        written, so a crash never leaves a file of the package's that the list does not name."""
        new = [n for n in dict.fromkeys(names) if n not in self.files]
        for name in new:
            relative_name(name)
            if not name.endswith("/") and self._exists(name):  # never claim what someone else put there
                raise UnsafePath(f"{self.path / name} is not capeval's (it was there before); capeval does not "
                                 "overwrite it: move it away or give another folder")
        if new or not self.found:
            self.files += new
            self._write_marker()

    def owns(self, name: str) -> bool:
        return name in self.files or name + "/" in self.files

    def _parent(self, name: str, create: bool) -> tuple[Folder, str, list[Folder]]:
        assert self.folder is not None
        parts = relative_name(name)
        folder, opened = self.folder, []
        for k, part in enumerate(parts[:-1]):
            if create:
                self.own(["/".join(parts[: k + 1]) + "/"])
            folder = folder.sub(part, create=create)
            opened.append(folder)
        return folder, parts[-1], opened

    def write(self, name: str, data: Data, mode: int = 0o666, scratch: str | None = None) -> None:
        """Write the file ``name`` (a relative path) whole; refused when it exists and is not listed.
        ``scratch``: a name beside it, listed too, that it is written into first (instead of a random hidden
        name), so that what a killed write leaves is a listed file of the package's (replaced by the next
        write, removable by :meth:`remove`)."""
        self.own([name] + ([scratch] if scratch else []))  # refused when it exists and is not listed
        folder, leaf, opened = self._parent(name, create=True)
        if scratch and relative_name(scratch)[:-1] != relative_name(name)[:-1]:
            raise ValueError(f"the scratch name {scratch!r} is not beside {name!r}")
        try:
            folder.write(leaf, data, mode=mode, scratch=relative_name(scratch)[-1] if scratch else None)
        finally:
            for f in opened:
                f.close()

    def read(self, name: str) -> bytes | None:
        return self._look(name, Folder.read)

    def map(self, name: str) -> mmap.mmap | bytes | None:
        """The file ``name`` mapped read-only (:meth:`Folder.map`), None when it is missing."""
        return self._look(name, Folder.map)

    def _look(self, name: str, how: Callable[[Folder, str], Any]) -> Any:
        try:
            folder, leaf, opened = self._parent(name, create=False)
        except FileNotFoundError:
            return None
        try:
            return how(folder, leaf)
        finally:
            for f in opened:
                f.close()

    def remove(self, names: Iterable[str] | None = None) -> None:
        """Remove the listed files (regular files only) and then the listed folders that are empty; with
        ``names``, only those of them. Without ``names`` the scratch files and the marker go too, and
        the folder itself when the package made it and nothing else is in it."""
        assert self.folder is not None
        chosen = self.files if names is None else [n for n in names if n in self.files]
        for name in sorted(chosen, key=lambda n: (n.endswith("/"), -n.count("/"), n)):
            try:
                folder, leaf, opened = self._parent(name, create=False)
            except (FileNotFoundError, UnsafePath):
                continue
            try:
                if name.endswith("/"):
                    folder.rmdir(leaf)
                else:
                    folder.unlink(leaf)
            finally:
                for f in opened:
                    f.close()
        if names is not None:
            left = [n for n in self.files if n not in chosen or self._exists(n)]
            if left != self.files:
                self.files = left
                self._write_marker()
            return
        for name in (*self.scratch, self.marker + ".tmp", self.marker):
            self.folder.unlink(name)
        self.files = []
        self.found = False
        if self.created_root:
            self.folder.close()
            with contextlib.suppress(OSError):
                os.rmdir(self.path)

    def _exists(self, name: str) -> bool:
        try:
            folder, leaf, opened = self._parent(name, create=False)
        except (FileNotFoundError, UnsafePath):
            return False
        try:
            return folder.kind(leaf) is not None
        finally:
            for f in opened:
                f.close()

    @contextlib.contextmanager
    def staging(self, keep_partial: bool = False) -> Iterator[Path]:
        """A new private folder inside the claim for code that writes files by path (``save_pretrained``);
        on success everything written there is moved into the claim (:meth:`publish`), then the staging
        folder goes. Nothing is moved when the block fails, unless ``keep_partial`` (a build whose error
        says what it did save)."""
        assert self.folder is not None
        name = f".capeval-staging-{_secrets.token_hex(6)}"
        self.own([name + "/"])
        with _reported(self.path / name, "create the folder"):
            os.mkdir(name, 0o700, dir_fd=self.folder.fd)
        try:
            try:
                yield self.path / name
            except Exception:
                if keep_partial:
                    self.publish(name)
                raise
            self.publish(name)
        finally:
            self.folder.remove_tree(name)
            self.remove([name + "/"])
            if not self.files:  # nothing was published (a refused build): leave no marker behind
                self.remove()

    def publish(self, staged: str) -> None:
        """Move every file of the staging folder ``staged`` to the same place in the claim. Every name it
        would replace must be listed as the package's; otherwise nothing moves."""
        assert self.folder is not None
        with self.folder.sub(staged) as source:
            found = list(_walk(source, ""))
            conflicts = [n for n in found if not self.owns(n) and self._exists(n)]
            if conflicts:
                shown = ", ".join(conflicts[:5]) + (f" and {len(conflicts) - 5} more" if len(conflicts) > 5 else "")
                raise UnsafePath(f"{self.path} already has {shown}, not written by capeval; capeval does not "
                                 "overwrite them: move them away or give another folder")
            folders = {"/".join(n.split("/")[: k + 1]) + "/" for n in found for k in range(n.count("/"))}
            self.own([*sorted(folders), *found])
            for name in found:
                parts = name.split("/")
                src, dst = source, self.folder
                opened = []
                for part in parts[:-1]:
                    src, dst = src.sub(part), dst.sub(part, create=True)
                    opened += [src, dst]
                try:
                    with _reported(self.path / name):
                        os.rename(parts[-1], parts[-1], src_dir_fd=src.fd, dst_dir_fd=dst.fd)
                finally:
                    for f in opened:
                        f.close()


def _walk(folder: Folder, prefix: str) -> Iterator[str]:
    """Relative names of the regular files under ``folder`` (a link or a special file is refused). A marker
    or staging folder of a claim made inside the staging folder (``.capeval-*``) stays behind."""
    for name in folder.names():
        if not prefix and name.startswith(".capeval-"):
            continue
        kind = folder.kind(name)
        if kind == "dir":
            with folder.sub(name) as sub:
                yield from _walk(sub, f"{prefix}{name}/")
        elif kind == "file":
            yield prefix + name
        else:
            raise UnsafePath(f"{folder.path / name} is a {kind}; capeval publishes regular files only")


# ---------------------------------------------------------------------------------------------------------
# Outputs the user names


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


def check_output(path: str | os.PathLike, inputs: Iterable[Any] = (), what: str = "--out") -> str:
    """Refuse, before any work, an output that cannot or must not be written: a folder, a link, a socket,
    one of the run's ``inputs`` (files, or folders it must not lie in: a model folder), a folder that does
    not exist or that the user cannot write. Returns :func:`output_kind`."""
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
