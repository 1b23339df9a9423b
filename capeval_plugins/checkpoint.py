"""Checkpoints of a scoring run, so an interrupted run resumes where it stopped.

A run folder is the package's own only as far as the package wrote it. It holds:

- ``capeval-run.manifest``: the marker that says the folder is a run folder, and the list of every file and
  folder the package may write in it (checksummed). Only these are ever deleted; a non-empty folder without
  the marker is refused, never cleared;
- ``capeval-run.lock``: held (``flock``) by the process that runs in the folder, so a second run in it is
  refused; the kernel drops the lock when that process dies, however it dies;
- ``run.json``: the fingerprint of what is being scored (metrics, options, models and inputs by content, world
  size) and a random run id, checksummed;
- one folder per rank with, per metric, an append-only log with one record per finished batch (its
  per-sample ``"cat"`` rows and the samples it had to skip) and, for metrics with summed statistics, the
  running sums after the last finished batch (replaced atomically).

Every record and the sums carry a checksum, the run id, the metric, the batch number and a digest of the
batch's samples: on resume each is checked against the run and its batch plan. A record torn by a crash (the
last one) is dropped and its batch scored again; anything else that does not check out is a damaged run
folder, refused with a message naming ``restart``.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import socket
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import Tensor

from capeval_plugins.inputs import InputError

FORMAT = 2
MAGIC = b"CPV2"
_HEAD = struct.Struct("<4sIQ")  # magic, header bytes, body bytes
_CRC = struct.Struct("<I")

MANIFEST = "capeval-run.manifest"
LOCK = "capeval-run.lock"
RUN = "run.json"
# what a crash of the package can leave in a folder before its manifest exists
_SCRATCH = (LOCK, MANIFEST + ".tmp")


class RunFolderError(InputError):
    """A run folder that cannot be used as asked. The message names the way to start over the way the caller
    gives it: ``restart=True`` in Python, ``--restart`` on the command line (:attr:`cli_message`)."""

    def __init__(self, text: str) -> None:
        self.text = text
        super().__init__(text.replace("{restart}", "restart=True"))

    @property
    def cli_message(self) -> str:
        return self.text.replace("{restart}", "--restart")


class RunMismatch(RunFolderError):
    """The run folder holds a run of something else."""


class DamagedRun(RunFolderError):
    """A state file of the run folder does not check out."""

    def __init__(self, root: Path, what: str) -> None:
        super().__init__(f"damaged run folder {root} ({what}); use {{restart}} to start over")


class RunFolderBusy(RunFolderError):
    """Another live process runs in the folder."""


# ---------------------------------------------------------------------------------------------------------
# Records: a JSON header and a safetensors body, checksummed


def _bytes(tensors: Mapping[str, Tensor]) -> bytes:
    return save_tensors({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()})


def encode_record(header: Mapping[str, Any], tensors: Mapping[str, Tensor]) -> bytes:
    head = json.dumps(header, sort_keys=True).encode()
    body = _bytes(tensors) if tensors else b""
    return _HEAD.pack(MAGIC, len(head), len(body)) + head + body + _CRC.pack(zlib.crc32(head + body))


def decode_records(data: bytes) -> tuple[list[tuple[dict, dict[str, Tensor]]], int]:
    """Every intact record from the start of ``data``, and where the intact part ends."""
    records, offset = [], 0
    while offset + _HEAD.size <= len(data):
        magic, head_len, body_len = _HEAD.unpack_from(data, offset)
        end = offset + _HEAD.size + head_len + body_len + _CRC.size
        if magic != MAGIC or end > len(data):
            break
        payload = data[offset + _HEAD.size : end - _CRC.size]
        if _CRC.unpack_from(data, end - _CRC.size)[0] != zlib.crc32(payload):
            break
        try:
            header = json.loads(payload[:head_len])
            tensors = load_tensors(payload[head_len:]) if body_len else {}
        except Exception:  # a checksummed record that does not parse: written by something else
            break
        records.append((header, tensors))
        offset = end
    return records, offset


def _fsync_write(path: Path, data: bytes, mode: str = "wb") -> None:
    with open(path, mode) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` whole (a fixed scratch name: one writer per file, the folder's lock)."""
    tmp = path.with_name(path.name + ".tmp")
    _fsync_write(tmp, data)
    os.replace(tmp, path)


class RecordLog:
    """Append-only records."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> list[tuple[dict, dict[str, Tensor]]]:
        """Every intact record, in order; a torn or corrupt one and anything after it is cut off (those
        batches are scored again)."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        records, offset = decode_records(data)
        if offset != len(data):
            self.truncate(offset)
        return records

    def truncate(self, size: int) -> None:
        with open(self.path, "r+b") as f:
            f.truncate(size)

    def keep(self, count: int) -> None:
        """Keep only the first ``count`` records."""
        if not self.path.exists():
            return
        data, offset = self.path.read_bytes(), 0
        for _ in range(count):
            _, head_len, body_len = _HEAD.unpack_from(data, offset)
            offset += _HEAD.size + head_len + body_len + _CRC.size
        self.truncate(offset)

    def append(self, header: Mapping[str, Any], tensors: Mapping[str, Tensor]) -> None:
        _fsync_write(self.path, encode_record(header, tensors), "ab")


def _checksummed(content: Mapping[str, Any]) -> bytes:
    body = json.dumps(content, sort_keys=True, default=str)
    digest = hashlib.sha256(body.encode()).hexdigest()
    return json.dumps({"sha256": digest, "content": json.loads(body)}, indent=1, sort_keys=True).encode()


def _read_checksummed(path: Path) -> dict | None:
    """The content of a checksummed JSON file; None when it is damaged."""
    try:
        outer = json.loads(path.read_bytes())
        body = json.dumps(outer["content"], sort_keys=True, default=str)
        if hashlib.sha256(body.encode()).hexdigest() != outer["sha256"]:
            return None
        return outer["content"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


def batch_digest(indices: Sequence[int]) -> str:
    """The identity of one planned batch: the samples it holds, in order."""
    return hashlib.sha1(json.dumps([int(i) for i in indices]).encode()).hexdigest()[:16]


@dataclass
class Progress:
    """What a rank has finished of one metric: ``batches`` done, their rows, the running sums, the samples
    skipped while scoring."""

    batches: int = 0
    rows: list[dict[str, Tensor]] = field(default_factory=list)
    sums: dict[str, Tensor] | None = None
    skipped: dict[int, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------
# The folder: marker, manifest, lock


class _Lock:
    """An exclusive ``flock`` on the folder's lock file, held by this process until :meth:`release` (or its
    death). The pid and host written in the file only name the holder in the message to a second run."""

    def __init__(self, root: Path) -> None:
        self.path = root / LOCK
        self.fd: int | None = None
        self.created = False

    def acquire(self) -> None:
        import fcntl

        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                self.created = True
            except FileExistsError:
                try:
                    fd = os.open(self.path, os.O_RDWR)
                except FileNotFoundError:  # removed by its holder in between: try again
                    continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
                os.close(fd)
                if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise RunFolderBusy(f"{self.path.parent} is in use by another capeval run ({holder}); wait for "
                                        "it to end, or write elsewhere") from None
                raise
            try:  # the holder before us may have removed the file after we opened it: lock the live one
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self.fd = fd

    def release(self, unlink: bool = False) -> None:
        if self.fd is None:
            return
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self.fd)  # closing drops the flock
        self.fd = None


def planned_files(metrics: Sequence[str], world: int) -> list[str]:
    """Every file and folder a run of ``metrics`` on ``world`` ranks may write, relative to its folder,
    folders after their files (the order they are removed in)."""
    files = []
    for rank in range(world):
        part = f"rank-{rank}-of-{world}"
        for metric in metrics:
            files += [f"{part}/{metric}.log", f"{part}/{metric}.sums", f"{part}/{metric}.sums.tmp"]
        files.append(part + "/")
    return files + [RUN + ".tmp", RUN]


def _is_empty_but_scratch(root: Path) -> bool:
    return all(entry.name in _SCRATCH for entry in root.iterdir())


class RunStore:
    """One rank's view of a run folder. Rank 0 :meth:`open` s it (lock, marker, checks); every rank then
    :meth:`attach` es to the run id rank 0 found or wrote."""

    def __init__(self, root: str | os.PathLike, rank: int = 0, world: int = 1) -> None:
        self.root = Path(root)
        self.rank, self.world = rank, world
        self.part = self.root / f"rank-{rank}-of-{world}"
        self.run_id: str | None = None
        self.lock: _Lock | None = None

    # -- the folder as a whole (rank 0) --

    def open(self, fingerprint: Mapping[str, Any], restart: bool = False) -> bool:
        """Lock the folder and make it hold this run; True when an earlier part of it is there to resume.
        The lock is held until :meth:`close` or :meth:`remove`."""
        self._refuse_foreign()
        created_root = not self.root.exists()
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock = _Lock(self.root)
        self.lock.acquire()
        try:
            return self._prepare(fingerprint, restart, created_root)
        except BaseException:
            self.close(unlink=self.lock.created and not (self.root / MANIFEST).exists())
            if created_root:
                _rmdir(self.root)
            raise

    def _refuse_foreign(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise RunFolderError(f"run folder {self.root} is a file; give a folder")
        if self.root.is_dir() and not (self.root / MANIFEST).exists() and not _is_empty_but_scratch(self.root):
            raise RunFolderError(
                f"{self.root} is not empty and is not a capeval run folder (it has no {MANIFEST}); capeval "
                "only writes a run folder into a new or empty folder and never deletes what it did not write: "
                "give another folder (if this is a run folder of an older capeval-plugins, remove it yourself)")

    def _prepare(self, fingerprint: Mapping[str, Any], restart: bool, created_root: bool) -> bool:
        self._refuse_foreign()  # again, now that the folder is ours: nothing may have moved in
        metrics = sorted(fingerprint.get("metrics", {})) if isinstance(fingerprint.get("metrics"), dict) else []
        wanted = {"format": FORMAT, "fingerprint": json.loads(json.dumps(fingerprint, sort_keys=True, default=str))}
        manifest = self._read_manifest()
        if manifest is not None:
            found, damaged = None, None
            if not restart:
                try:
                    found = self._read_run()
                except DamagedRun as err:
                    damaged = err
            if found is not None and found.get("format") == FORMAT and found["fingerprint"] == wanted["fingerprint"]:
                self.run_id = found["run"]
                return self._has_progress(manifest["files"])
            if not restart and self._has_progress(manifest["files"]):
                if damaged is not None:
                    raise damaged
                if found is None:
                    raise DamagedRun(self.root, f"its {RUN} is missing but finished batches are there")
                raise RunMismatch(
                    f"{self.root} holds an unfinished run of something else ({describe_difference(found, wanted)}); "
                    "use {restart} to discard it, or write elsewhere")
            # restart, or an earlier run that finished no batch: nothing to keep
            self._remove_files(manifest["files"])
            created_root = manifest["created_root"]
        self.run_id = secrets.token_hex(8)
        self._write_manifest(metrics, created_root)
        _atomic_write(self.root / RUN, _checksummed({**wanted, "run": self.run_id}))
        return False

    def _read_manifest(self) -> dict | None:
        path = self.root / MANIFEST
        if not path.exists():
            return None
        manifest = _read_checksummed(path)
        if manifest is None or manifest.get("format") != FORMAT:
            raise RunFolderError(
                f"{self.root}: its {MANIFEST} is damaged or from another version of capeval-plugins, so what in "
                "it capeval wrote is unknown; remove the folder yourself")
        return manifest

    def _read_run(self) -> dict | None:
        path = self.root / RUN
        if not path.exists():
            return None
        found = _read_checksummed(path)
        if found is None or not isinstance(found.get("run"), str) or "fingerprint" not in found:
            raise DamagedRun(self.root, f"{RUN} does not match its checksum")
        return found

    def _write_manifest(self, metrics: Sequence[str], created_root: bool, keep: Sequence[str] = ()) -> None:
        files = list(dict.fromkeys([*keep, *planned_files(metrics, self.world)]))
        files.sort(key=lambda f: (not f.startswith("rank-"), f.endswith("/"), f))  # files, then folders, run.json
        content = {"format": FORMAT, "package": "capeval-plugins", "created_root": created_root, "files": files}
        _atomic_write(self.root / MANIFEST, _checksummed(content))

    def _has_progress(self, files: Sequence[str]) -> bool:
        return any(f.endswith((".log", ".sums")) and (self.root / f).is_file() and (self.root / f).stat().st_size
                   for f in files)

    def _remove_files(self, files: Sequence[str]) -> None:
        for name in files:
            path = self.root / name
            if name.endswith("/"):
                _rmdir(path)
            elif path.is_file() and not path.is_symlink():
                path.unlink()

    def close(self, unlink: bool = False) -> None:
        """Release the lock (the folder stays)."""
        if self.lock is not None:
            self.lock.release(unlink)
            self.lock = None

    def remove(self, run_id: str | None = None) -> None:
        """Delete what the package wrote (per the manifest) and nothing else; the folder itself only when the
        package made it and it is empty. Needs the lock (held, or taken now; a busy folder is left alone).
        ``run_id``: only if the folder still holds that run."""
        if self.lock is None:
            if not (self.root / MANIFEST).exists():
                return
            self.lock = _Lock(self.root)
            try:
                self.lock.acquire()
            except RunFolderBusy:
                self.lock = None
                return
        try:
            manifest = self._read_manifest()
        except RunFolderError:
            self.close()
            raise
        if manifest is None or (run_id is not None and self.current_run() != run_id):
            self.close()
            return
        self._remove_files([*manifest["files"], MANIFEST + ".tmp"])
        (self.root / MANIFEST).unlink()
        self.close(unlink=True)
        if manifest["created_root"]:
            _rmdir(self.root)

    def current_run(self) -> str | None:
        """The run id in the folder now (None without a readable one)."""
        try:
            found = _read_checksummed(self.root / RUN) if (self.root / RUN).exists() else None
        except OSError:
            return None
        return found.get("run") if found else None

    # -- one metric's part on this rank --

    def attach(self, run_id: str) -> None:
        self.run_id = run_id

    def _log(self, metric: str) -> RecordLog:
        return RecordLog(self.part / f"{metric}.log")

    def _sums_path(self, metric: str) -> Path:
        return self.part / f"{metric}.sums"

    def _belongs(self, header: Mapping[str, Any], metric: str, batch: int, plan: Sequence[str] | None) -> bool:
        return (header.get("run") == self.run_id and header.get("metric") == metric and header.get("batch") == batch
                and (plan is None or (batch < len(plan) and header.get("plan") == plan[batch])))

    def load(self, metric: str, has_sums: bool, plan: Sequence[str] | None = None) -> Progress:
        """What this rank finished of ``metric``, every record checked against the run and ``plan`` (the
        digest of each planned batch, see :func:`batch_digest`)."""
        log = self._log(metric)
        records = log.read()
        for k, (header, _) in enumerate(records):
            if not self._belongs(header, metric, k, plan):
                raise DamagedRun(self.root, f"{log.path.name} record {k} is not batch {k} of this run")
        sums, done = None, len(records)
        if has_sums:
            sums, done_sums = self._load_sums(metric, plan)
            if done_sums > done:
                raise DamagedRun(self.root, f"the saved sums of {metric} are ahead of its rows")
            done = done_sums
        if done < len(records):  # a batch whose rows were written but not its sums: score it again
            log.keep(done)
            records = records[:done]
        progress = Progress(batches=done, sums=sums)
        for header, tensors in records:
            progress.rows.append(tensors)
            progress.skipped.update({int(i): r for i, r in header.get("skipped", {}).items()})
        return progress

    def _load_sums(self, metric: str, plan: Sequence[str] | None) -> tuple[dict[str, Tensor] | None, int]:
        path = self._sums_path(metric)
        if not path.exists():
            return None, 0
        data = path.read_bytes()
        records, end = decode_records(data)
        if len(records) != 1 or end != len(data):
            raise DamagedRun(self.root, f"{path.name} does not match its checksum")
        header, sums = records[0]
        batches = header.get("batches")
        if not isinstance(batches, int) or batches < 1 or not self._belongs(header, metric, batches - 1, plan):
            raise DamagedRun(self.root, f"{path.name} is not from this run")
        return sums, batches

    def save(self, metric: str, batch: int, rows: Mapping[str, Tensor], sums: Mapping[str, Tensor] | None,
             skipped: Mapping[int, str], plan: str | None = None) -> None:
        """Record a finished batch: its rows first, then the sums that include it."""
        self.part.mkdir(parents=True, exist_ok=True)
        header = {"run": self.run_id, "metric": metric, "batch": batch, "plan": plan}
        self._log(metric).append({**header, "skipped": {str(i): r for i, r in skipped.items()}}, rows)
        if sums is not None:
            _atomic_write(self._sums_path(metric), encode_record({**header, "batches": batch + 1}, sums))


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:  # not empty (the user's files), or gone
        pass


def describe_difference(found: Mapping[str, Any], wanted: Mapping[str, Any]) -> str:
    """Which parts of two fingerprints differ, in words."""
    a, b = found.get("fingerprint", {}), wanted.get("fingerprint", {})
    if found.get("format") != wanted.get("format"):
        return "it was written by another version of capeval-plugins"
    parts = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key):
            continue
        if key == "metrics" and isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
            for name in sorted(set(a[key]) | set(b[key])):
                if name not in a[key] or name not in b[key]:
                    parts.append(f"metric {name} {'added' if name not in a[key] else 'removed'}")
                elif a[key][name] != b[key][name]:
                    old, new = a[key][name], b[key][name]
                    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
                    parts.append(f"{name} options {', '.join(changed)}")
        else:
            parts.append(f"{key} differ")
    return "; ".join(parts) or "different settings"
