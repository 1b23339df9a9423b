"""A folder by descriptor (:class:`Folder`): plain names only, no link followed, files created exclusively and
replaced by rename; the hidden scratch files a killed writer leaves, and only those, removed again; the
package's caches (:class:`CacheFolder`) and private temporary folders built on it."""
from __future__ import annotations

import contextlib
import errno
import hmac
import mmap
import os
import secrets as _secrets
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO, Iterable

from capeval_plugins.files.base import (_CLOEXEC, _DIRECTORY, _NOFOLLOW, _NONBLOCK, Data, FileError, UnsafePath,
                                         _kind, _reported, check_links, file_kind, plain_name, storage_error)
from capeval_plugins.files.secret import mac, secret


class Folder:
    """An open folder: every operation is relative to its descriptor, by plain names only, and follows no
    symbolic link (a link planted at one of the names is refused, or replaced by rename, never written
    through). Files are created exclusively; a file is replaced by writing a new one and renaming it over."""

    def __init__(self, fd: int, path: str | os.PathLike, made: tuple[Path, ...] = ()) -> None:
        self.fd = fd
        self.path = Path(path)
        self.made = made  # the folders :meth:`open` made, outermost first (this one last, when it made it)

    # -- opening --

    @classmethod
    def open(cls, path: str | os.PathLike, *, create: bool = False, mine: bool = False,
             mode: int = 0o777) -> tuple["Folder", bool]:
        """Open ``path`` (no symbolic link as its last component; parents through links of the user's or root
        only). ``create``: make it (and its missing parents) when missing; every folder made is listed in
        :attr:`made`, so that it can be removed again (:func:`remove_made`). ``mine``: it must belong to the
        user. Returns the folder and whether it was made now."""
        path = Path(path)
        check_links(path)
        made: list[Path] = []
        if create:
            try:
                made = _make_folders(path, mode)
            except OSError as err:
                raise storage_error(err, path, "create the folder") from None
        created = path in made
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
        folder = cls(fd, path, tuple(made))
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


def _make_folders(path: Path, mode: int) -> list[Path]:
    """Make ``path`` (with ``mode``) and every missing folder above it; returns those this call made, outermost
    first (one another process made meanwhile is not listed: it is not ours to remove)."""
    missing = []
    for folder in (path, *path.parents):
        if os.path.lexists(folder):
            break
        missing.append(folder)
    made = []
    for folder in reversed(missing):
        try:
            os.mkdir(folder, mode if folder == path else 0o777)
        except FileExistsError:
            continue
        made.append(folder)
    return made


def remove_made(made: Iterable[str | os.PathLike]) -> list[Path]:
    """Remove folders the package made (:attr:`Folder.made`, or such a list kept in a marker), innermost first,
    each only while it is empty and a folder (a link in its place stays); the first that stays ends the walk
    up, since every folder above it holds it (one already gone is passed). Returns what went."""
    gone = []
    for folder in sorted(map(Path, made), key=lambda p: len(p.parts), reverse=True):
        if not os.path.lexists(folder):  # removed already (a run folder's own removal)
            continue
        try:
            with Folder.open(folder.parent)[0] as parent:
                removed = parent.rmdir(folder.name)
        except (OSError, FileError):
            removed = False
        if not removed:
            break
        gone.append(folder)
    return gone


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
    e.g. :class:`capeval_plugins.models.generation.CachedGenerator`, are given instead of touching files): an
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

