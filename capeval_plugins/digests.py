"""Content digests of the files a run reads, for its fingerprint: an input changed between a run and its resume
(an image replaced by another of the same size, new weights in the same model folder) changes the fingerprint,
so old scores are never reused for new content.

Every file is hashed once per run (XXH3-128 from ``xxhash``, which ``datasets`` and ``evaluate`` already
need: several GB/s, so a model folder costs about what reading it costs); within a run a file seen again with
the same (path, size, mtime_ns) reuses its digest, so an image shared by many captions is read once.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import xxhash

from capeval_plugins import files

_BLOCK = 8 * 2**20


def file_hash(path: str) -> str:
    """XXH3-128 of a regular file's bytes (several GB/s on one core: a change detector, not a signature). A
    FIFO or a device is refused unopened (:func:`capeval_plugins.files.open_input`): it would never end."""
    h = xxhash.xxh3_128()
    with files.open_input(path) as f:
        buffer = bytearray(_BLOCK)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


class ContentDigests:
    """Digests of files and folders, cached for one run by (real path, size, mtime_ns)."""

    def __init__(self) -> None:
        self._files: dict[tuple[str, int, int], str] = {}

    def file(self, path: str | os.PathLike) -> list[Any]:
        """``["file", real path, size, xxh3-128]`` (None for the last two when it cannot be read: validation
        reports that)."""
        real = os.path.realpath(os.fspath(path))
        try:
            stat = os.stat(real)
        except OSError:
            return ["file", real, None, None]
        kind = files.file_kind(real)
        if kind != "file":  # a FIFO or a device: never opened (validation says what it is)
            return ["file", real, kind, None]
        key = (real, stat.st_size, stat.st_mtime_ns)
        if key not in self._files:
            try:
                self._files[key] = file_hash(real)
            except (OSError, files.FileError):
                return ["file", real, stat.st_size, None]
        return ["file", real, stat.st_size, self._files[key]]

    def folder(self, path: str | os.PathLike) -> list[Any]:
        """``["folder", real path, digest over every file's relative name and digest]``. Hidden names (``.git``,
        ``.cache``) are left out: no loader reads them."""
        root = os.path.realpath(os.fspath(path))
        h = xxhash.xxh3_128()
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(n for n in names if not n.startswith(".")):
                full = os.path.join(folder, name)
                h.update(f"{os.path.relpath(full, root)}\0{self.file(full)[3]}\n".encode())
        return ["folder", root, h.hexdigest()]

    def source(self, value: str, revision: str | None = None) -> Any:
        """A model or data option: a local file or folder by content; a hub id by the commit its cached
        snapshot of ``revision`` (default ``main``) resolves to (None when it is not cached yet)."""
        expanded = os.path.expanduser(value)
        if os.path.isdir(expanded):
            return self.folder(expanded)
        if os.path.exists(expanded):
            return self.file(expanded)
        return ["hub", value, cached_commit(value, revision or "main")]

    def options(self, config: Any, keys: Any = None, defaults: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The identity of every option of ``config`` (a metric's dataclass) that names a file, a folder or a
        hub model (``Config.input_paths``, or ``keys``), or of what an unset one resolves to (``defaults``:
        ``Metric.default_sources()``): by content or resolved commit (see :meth:`source`). What ``capeval
        score``'s resume and ``capeval bench``'s score cache key on."""
        found = {}
        revision = getattr(config, "revision", None)
        keys = list(keys if keys is not None else getattr(config, "input_paths", ()))
        for key in [*keys, *(k for k in defaults or {} if k not in keys)]:
            value = getattr(config, key, None) or (defaults or {}).get(key)
            if isinstance(value, str) and value:
                found[key] = self.source(value, revision if isinstance(revision, str) else None)
        return found


def unresolved(identity: Any) -> bool:
    """Whether an identity from :meth:`ContentDigests.source` could not be pinned (a hub id not cached yet,
    a file that could not be read): it must not key anything that is reused later."""
    return isinstance(identity, list) and identity[-1] is None


def cached_commit(repo_id: str, revision: str = "main") -> str | None:
    """The commit of ``repo_id`` at ``revision`` in the local Hugging Face cache (no network); a revision that
    is itself a commit hash is that commit."""
    if len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        return revision
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    ref = os.path.join(constants.HF_HUB_CACHE, f"models--{repo_id.replace('/', '--')}", "refs", revision)
    try:
        with open(ref, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def model_files_digest(model: str, revision: str | None) -> str | None:
    """XXH3-128 over every file of the folder ``model`` is read from (a local folder, or a hub id's cached
    snapshot), by relative name and content, as run folders key on: the same for a copy under another path;
    None when a hub id is not cached. What a saved fit or a training run binds itself to."""
    from capeval_plugins.resources import loading

    local = os.path.expanduser(model)
    folder = local if os.path.exists(local) else loading.source_folder(model, revision)
    return ContentDigests().source(folder)[-1] if folder else None


STAMP_ENTRIES = 4096  # files of a model folder looked at for its stamp (a model folder holds a few dozen)


def files_stamp(path: str | os.PathLike) -> tuple | None:
    """What changes when the local file or folder ``path`` is rewritten: (name, size, modification time,
    change time, inode) of each file, links followed (a hub snapshot links to its blobs); None for a hub id. The
    change time is the kernel's, which no copy that keeps times (``cp -p``, ``rsync -t``) can set back."""
    path = os.fspath(path)
    try:
        if not os.path.isdir(path):
            st = os.stat(path)
            return ((os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino),)
    except OSError:
        return None
    found: list[tuple] = []
    for root, folders, names in os.walk(path, followlinks=False):
        folders.sort()
        for name in sorted(names):
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue
            found.append((os.path.relpath(os.path.join(root, name), path), st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                          st.st_ino))
            if len(found) >= STAMP_ENTRIES:
                return tuple(found)
    return tuple(found)
