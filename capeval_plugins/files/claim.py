"""A folder the package fills (:class:`Claim`), with the authenticated list of what it wrote there: only what
the list names is ever replaced or removed."""
from __future__ import annotations

import contextlib
import mmap
import os
import secrets as _secrets
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from capeval_plugins.files.base import Data, UnsafePath, _reported, file_kind, plain_name, relative_name
from capeval_plugins.files.folder import Folder, remove_made
from capeval_plugins.files.secret import read_signed_json, signed_json


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
        self.created_above: list[str] = []  # the missing folders above it that opening it made (absolute paths)
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
        self.created_above = [os.path.abspath(p) for p in self.folder.made if p != self.path]
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
        above = content.get("created_above")
        self.created_above = [p for p in above if isinstance(p, str)] if isinstance(above, list) else []
        self.extra = {k: v for k, v in content.items() if k not in ("kind", "files", "created_root", "created_above")}

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
        content = {**self.extra, "kind": self.kind, "created_root": self.created_root,
                   "created_above": self.created_above, "files": self.files}
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
                self.remove_created_above()

    def remove_created_above(self) -> None:
        """The folders above this one that the package made with it, innermost first, each while empty; only
        those still above it (a run folder moved elsewhere leaves the old place's alone)."""
        here = os.path.abspath(self.path)
        remove_made(p for p in self.created_above if here.startswith(p.rstrip("/") + "/"))

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

