"""Checkpoints of a scoring run, so an interrupted run resumes where it stopped.

A run folder is the package's own only as far as the package wrote it (every file goes through
:mod:`capeval_plugins.files`). It holds:

- ``capeval-run.manifest``: the marker that says the folder is a run folder, and the list of every file and
  folder the package may write in it, authenticated with an HMAC keyed by the user's secret (kept outside the
  folder, see :func:`capeval_plugins.files.secret`): a manifest copied, forged or edited does not verify.
  Only listed files are ever deleted; a non-empty folder without a valid manifest is refused, never cleared;
- ``capeval-run.lock``: held (``flock``) by the process that runs in the folder, so a second run in it is
  refused; the kernel drops the lock when that process dies, however it dies;
- ``run.json``: the fingerprint of what is being scored (metrics, options, models and inputs by content, world
  size) and a random run id, authenticated;
- one folder per rank with, per metric, an append-only log with one record per finished batch (its
  per-sample ``"cat"`` rows and the samples it had to skip) and, for metrics with summed statistics, the
  running sums after the last finished batch (replaced whole).

Every record and the sums carry an HMAC keyed by the run's key (derived from the secret and the run id), the
run id, the metric, the batch number and a digest of the batch's samples: on resume each is checked against
the run and its batch plan. A record cut short by a crash (the last one) is dropped and its batch scored
again; anything else that does not check out, anywhere in a log, is a damaged run folder, refused with a
message naming ``restart``, before anything in the folder is changed.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from capeval_plugins import files
from capeval_plugins.contract import PackedTexts
from capeval_plugins.core.arrays import as_tensor, host, is_tensor
from capeval_plugins.resources import tensorfile
from capeval_plugins.inputs import InputError

if TYPE_CHECKING:
    from torch import Tensor

FORMAT = 3
MAGIC = b"CPV3"
_HEAD = struct.Struct("<4sIQI")  # magic, header bytes, body bytes, CRC-32 of the three
_TAG = 32  # HMAC-SHA256 of the record

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
# Records: a JSON header and a safetensors body, authenticated


class DamagedRecords(ValueError):
    """Bytes in a log that are neither an authentic record nor the torn end of the last one."""

    def __init__(self, offset: int, count: int) -> None:
        super().__init__(f"record {count} (byte {offset}) is damaged or not of this run")
        self.offset, self.count = offset, count


def _bytes(tensors: Mapping[str, Any]) -> bytes:
    """Arrays and tensors as safetensors bytes (host states alone: through numpy, torch never imported)."""
    if not any(is_tensor(v) for v in tensors.values()):
        from safetensors.numpy import save as save_arrays

        return save_arrays({k: np.asarray(v, order="C") for k, v in tensors.items()})  # (a 0-d sum stays 0-d)
    from safetensors.torch import save as save_tensors

    return save_tensors({k: as_tensor(v).detach().cpu().contiguous().clone() for k, v in tensors.items()})


# A text state's rows (PackedTexts) are stored as two tensors under these suffixes (":" is in no state name).
_PACKED = (":packed-data", ":packed-lengths")


def flat_rows(rows: Mapping[str, Tensor | PackedTexts]) -> dict[str, Tensor]:
    """A batch's rows as plain tensors for a record: packed texts as their bytes and lengths."""
    flat = {}
    for key, value in rows.items():
        if isinstance(value, PackedTexts):
            flat[key + _PACKED[0]], flat[key + _PACKED[1]] = value.data, value.lengths
        else:
            flat[key] = value
    return flat


def rows_back(tensors: Mapping[str, Tensor]) -> dict[str, Tensor | PackedTexts]:
    """Inverse of :func:`flat_rows`."""
    rows: dict[str, Tensor | PackedTexts] = {}
    for key, value in tensors.items():
        if key.endswith(_PACKED[0]):
            name = key[: -len(_PACKED[0])]
            rows[name] = PackedTexts(host(value).astype(np.uint8, copy=False),
                                     host(tensors[name + _PACKED[1]]).astype(np.int64, copy=False))
        elif not key.endswith(_PACKED[1]):
            rows[key] = value
    return rows


def run_key(run_id: str) -> bytes:
    """The key of one run's records: the user's secret and the run id (rank 0 hands it to the other ranks)."""
    return bytes.fromhex(files.mac(files.secret(), "run-key", run_id))


def encode_record(header: Mapping[str, Any], tensors: Mapping[str, Tensor], key: bytes) -> bytes:
    head = json.dumps(header, sort_keys=True).encode()
    body = _bytes(tensors) if tensors else b""
    fixed = struct.pack("<4sIQ", MAGIC, len(head), len(body))
    start = fixed + struct.pack("<I", zlib.crc32(fixed)) + head + body
    return start + hmac.new(key, start, hashlib.sha256).digest()


def decode_records(data: bytes, key: bytes) -> tuple[list[tuple[dict, dict[str, Tensor]]], list[int]]:
    """Every record of ``data`` and the offset where each ends. Only the end of the data may be torn (a
    crash while appending: a record cut short, or a last record whose bytes did not all reach the disk); it
    is left out. Anything else that does not verify raises :class:`DamagedRecords`."""
    records, ends, offset = [], [], 0
    while offset < len(data):
        if offset + _HEAD.size > len(data):
            break  # a header cut short
        magic, head_len, body_len, crc = _HEAD.unpack_from(data, offset)
        if magic != MAGIC or crc != zlib.crc32(data[offset : offset + _HEAD.size - 4]):
            if not data[offset:].strip(b"\0"):
                break  # the file grew but its last bytes never reached the disk
            raise DamagedRecords(offset, len(records))
        end = offset + _HEAD.size + head_len + body_len + _TAG
        if end > len(data):
            break  # cut short
        tag = hmac.new(key, data[offset : end - _TAG], hashlib.sha256).digest()
        if not hmac.compare_digest(tag, data[end - _TAG : end]):
            if end == len(data):
                break  # the last record, not all of it written
            raise DamagedRecords(offset, len(records))
        start = offset + _HEAD.size
        try:
            header = json.loads(data[start : start + head_len])
            body = data[start + head_len : end - _TAG]
            tensors = tensorfile.load_bytes(body, "a record", arrays=True) if body_len else {}
        except Exception:  # authentic but unreadable: not ours to guess at
            raise DamagedRecords(offset, len(records)) from None
        records.append((header, tensors))
        ends.append(end)
        offset = end
    return records, ends


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
    death). The pid and host written in the file (:meth:`announce`, once the run is accepted: a refused run
    leaves the file as it found it) only name the holder in the message to a second run."""

    def __init__(self, folder: files.Folder) -> None:
        self.folder = folder
        self.path = folder.path / LOCK
        self.fd: int | None = None
        self.created = False

    def acquire(self) -> None:
        import fcntl

        while True:
            try:
                fd, created = self.folder.lock(LOCK)
            except files.UnsafePath as err:
                raise RunFolderError(str(err)) from None
            self.created = self.created or created
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
                same = os.path.samestat(os.fstat(fd), os.stat(LOCK, dir_fd=self.folder.fd, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd

    def announce(self) -> None:
        """Name this process in the lock file, for the message to a second run."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)

    def release(self, unlink: bool = False) -> None:
        if self.fd is None:
            return
        if unlink:
            self.folder.unlink(LOCK)
        os.close(self.fd)  # closing drops the flock
        self.fd = None


def planned_files(metrics: Sequence[str], world: int) -> list[str]:
    """Every file and folder a run of ``metrics`` on ``world`` ranks may write, relative to its folder,
    folders after their files (the order they are removed in)."""
    names = []
    for rank in range(world):
        part = f"rank-{rank}-of-{world}"
        for metric in metrics:
            names += [f"{part}/{metric}.log", f"{part}/{metric}.sums", f"{part}/{metric}.sums.tmp"]
        names.append(part + "/")
    return names + [RUN + ".tmp", RUN]


def _refused(err: files.UnsafePath) -> RunFolderError:
    return RunFolderError(str(err.args[0]) if err.args else str(err))


class RunStore:
    """One rank's view of a run folder. Rank 0 :meth:`open` s it (lock, marker, checks); every rank then
    :meth:`attach` es to the run id (and key) rank 0 found or wrote."""

    def __init__(self, root: str | os.PathLike, rank: int = 0, world: int = 1) -> None:
        self.root = Path(root)
        self.rank, self.world = rank, world
        self.part_name = f"rank-{rank}-of-{world}"
        self.part = self.root / self.part_name
        self.run_id: str | None = None
        self.key: bytes | None = None
        self.claim: files.Claim | None = None
        self.lock: _Lock | None = None
        self._part: files.Folder | None = None
        self.had_progress = False  # finished batches were there when opened: never removed by a failed run

    # -- the folder as a whole (rank 0) --

    def _claim(self) -> files.Claim:
        return files.Claim(self.root, "run", MANIFEST, scratch=_SCRATCH)

    def open(self, fingerprint: Mapping[str, Any], restart: bool = False) -> bool:
        """Lock the folder and make it hold this run; True when an earlier part of it is there to resume.
        The lock is held until :meth:`close` or :meth:`remove`."""
        claim = self._claim()
        try:
            claim.open(new_or_empty=True)
        except files.UnsafePath as err:
            raise _refused(err) from None
        self.claim = claim
        self.lock = _Lock(claim.folder)
        try:
            self.lock.acquire()
        except BaseException:
            self._abandon(claim, created_lock=False)
            raise
        try:
            try:
                claim.reload(new_or_empty=True)  # again, now that the folder is ours: nothing may have moved in
            except files.UnsafePath as err:
                raise _refused(err) from None
            self.had_progress = self._prepare(fingerprint, restart)
            self.lock.announce()
            return self.had_progress
        except BaseException:
            self._abandon(claim, created_lock=self.lock.created)
            raise

    def _abandon(self, claim: files.Claim, created_lock: bool) -> None:
        """Leave a folder this process could not start a run in as it found it: the lock file goes when this
        process made it, and is left unwritten otherwise."""
        self.close(unlink=created_lock)
        if claim.created_root and not claim.found:
            claim.folder.close()
            try:
                os.rmdir(self.root)
                claim.remove_created_above()
            except OSError:
                pass

    def _prepare(self, fingerprint: Mapping[str, Any], restart: bool) -> bool:
        claim = self.claim
        assert claim is not None
        metrics = sorted(fingerprint.get("metrics", {})) if isinstance(fingerprint.get("metrics"), dict) else []
        wanted = {"format": FORMAT, "fingerprint": json.loads(json.dumps(fingerprint, sort_keys=True, default=str))}
        if claim.found:
            if claim.extra.get("format") != FORMAT:
                raise RunFolderError(
                    f"{self.root} is a run folder of another version of capeval-plugins, so what in it capeval "
                    "wrote is unknown; remove the folder yourself")
            found, damaged = None, None
            if not restart:
                try:
                    found = self._read_run()
                except DamagedRun as err:
                    damaged = err
            if found is not None and found.get("format") == FORMAT and found["fingerprint"] == wanted["fingerprint"]:
                self._start(found["run"])
                return self._has_progress(claim.files)
            if not restart and self._has_progress(claim.files):
                if damaged is not None:
                    raise damaged
                if found is None:
                    raise DamagedRun(self.root, f"its {RUN} is missing but finished batches are there")
                raise RunMismatch(
                    f"{self.root} holds an unfinished run of something else ({describe_difference(found, wanted)}); "
                    "use {restart} to discard it, or write elsewhere")
            # restart, or an earlier run that finished no batch: nothing to keep
            claim.remove(list(claim.files))
        self._start(secrets.token_hex(8))
        claim.extra.update(format=FORMAT, package="capeval-plugins")
        claim.own(planned_files(metrics, self.world))
        claim.folder.write(RUN, files.signed_json({**wanted, "run": self.run_id}, "run"), scratch=RUN + ".tmp")
        return False

    def _start(self, run_id: str) -> None:
        self.run_id, self.key = run_id, run_key(run_id)

    def _read_run(self) -> dict | None:
        try:
            if self.claim is not None and self.claim.folder is not None and self.claim.folder.fd >= 0:
                data = self.claim.folder.read(RUN)
            else:
                root, _ = files.Folder.open(self.root)
                with root:
                    data = root.read(RUN)
        except files.UnsafePath as err:
            raise DamagedRun(self.root, str(err)) from None
        if data is None:
            return None
        found = files.read_signed_json(data, "run")
        if not isinstance(found, dict) or not isinstance(found.get("run"), str) or "fingerprint" not in found:
            raise DamagedRun(self.root, f"{RUN} does not match its checksum")
        return found

    def _has_progress(self, names: Sequence[str]) -> bool:
        assert self.claim is not None and self.claim.folder is not None
        for name in names:
            if not name.endswith((".log", ".sums")) or "/" not in name:
                continue
            part, leaf = name.split("/", 1)
            try:
                with self.claim.folder.sub(part) as folder:
                    if folder.size(leaf):
                        return True
            except (FileNotFoundError, files.UnsafePath):
                continue
        return False

    def close(self, unlink: bool = False) -> None:
        """Release the lock (the folder stays)."""
        if self.lock is not None:
            self.lock.release(unlink)
            self.lock = None
        if self._part is not None:
            self._part.close()
            self._part = None

    def remove(self, run_id: str | None = None) -> None:
        """Delete what the package wrote (per the manifest) and nothing else; the folder itself only when the
        package made it and it is empty. Needs the lock (held, or taken now; a busy folder is left alone).
        ``run_id``: only if the folder still holds that run."""
        if self.lock is None:
            if not (self.root / MANIFEST).is_file():
                return
            self.claim = self._claim()
            try:
                self.claim.open(create=False)
            except files.UnsafePath as err:
                raise _refused(err) from None
            if not self.claim.found:
                return
            self.lock = _Lock(self.claim.folder)
            try:
                self.lock.acquire()
            except RunFolderBusy:
                self.lock = None
                return
        claim = self.claim
        assert claim is not None
        try:
            claim.reload()
        except files.UnsafePath as err:
            self.close()
            raise _refused(err) from None
        if not claim.found or (run_id is not None and self.current_run() != run_id):
            self.close()
            return
        claim.remove()  # the listed files, the scratch, the manifest, the folder if the run made it
        self.close()

    def current_run(self) -> str | None:
        """The run id in the folder now (None without a readable one)."""
        try:
            found = self._read_run()
        except (DamagedRun, files.FileError, OSError):
            return None
        return found.get("run") if found else None

    # -- one metric's part on this rank --

    def attach(self, run_id: str, key: bytes | None = None) -> None:
        self.run_id = run_id
        self.key = key if key is not None else run_key(run_id)

    def _folder(self) -> files.Folder:
        if self._part is None:
            try:
                if self.claim is not None and self.claim.folder is not None and self.claim.folder.fd >= 0:
                    self._part = self.claim.folder.sub(self.part_name, create=True)
                else:  # a rank other than 0 (rank 0 made the folder), or a store used on its own
                    root, _ = files.Folder.open(self.root, create=True, mine=True)
                    with root:
                        self._part = root.sub(self.part_name, create=True)
            except files.UnsafePath as err:
                raise DamagedRun(self.root, str(err)) from None
        return self._part

    def _belongs(self, header: Mapping[str, Any], metric: str, batch: int, plan: Sequence[str] | None) -> bool:
        return (header.get("run") == self.run_id and header.get("metric") == metric and header.get("batch") == batch
                and (plan is None or (batch < len(plan) and header.get("plan") == plan[batch])))

    def load(self, metric: str, has_sums: bool, plan: Sequence[str] | None = None) -> Progress:
        """What this rank finished of ``metric``, every record checked against the run and ``plan`` (the
        digest of each planned batch, see :func:`batch_digest`). Nothing is changed in the folder unless
        everything checks out; then a torn last record (and rows a crash left ahead of the sums) is cut."""
        assert self.key is not None
        name = f"{metric}.log"
        folder = self._folder()
        data = self._read(folder, name) or b""
        try:
            records, ends = decode_records(data, self.key)
        except DamagedRecords as err:
            raise DamagedRun(self.root, f"{self.part_name}/{name} {err}") from None
        for k, (header, _) in enumerate(records):
            if not self._belongs(header, metric, k, plan):
                raise DamagedRun(self.root, f"{name} record {k} is not batch {k} of this run")
        sums, done = None, len(records)
        if has_sums:
            sums, done_sums = self._load_sums(folder, metric, plan)
            if done_sums > done:
                raise DamagedRun(self.root, f"the saved sums of {metric} are ahead of its rows")
            done = done_sums
        keep = ends[done - 1] if done else 0
        if keep != len(data):  # a torn record, or a batch whose rows were written but not its sums
            try:
                folder.truncate(name, keep)
            except files.UnsafePath as err:  # a planted hard link: refused, the folder left as it is
                raise DamagedRun(self.root, str(err)) from None
        progress = Progress(batches=done, sums=sums)
        for header, tensors in records[:done]:
            progress.rows.append(rows_back(tensors))
            progress.skipped.update({int(i): r for i, r in header.get("skipped", {}).items()})
        return progress

    def _read(self, folder: files.Folder, name: str) -> bytes | None:
        try:
            return folder.read(name)
        except files.UnsafePath as err:
            raise DamagedRun(self.root, str(err)) from None

    def _load_sums(self, folder: files.Folder, metric: str,
                   plan: Sequence[str] | None) -> tuple[dict[str, Tensor] | None, int]:
        name = f"{metric}.sums"
        data = self._read(folder, name)
        if data is None:
            return None, 0
        try:
            records, ends = decode_records(data, self.key)
        except DamagedRecords:
            records, ends = [], []
        if len(records) != 1 or ends[0] != len(data):
            raise DamagedRun(self.root, f"{name} does not match its checksum")
        header, sums = records[0]
        batches = header.get("batches")
        if not isinstance(batches, int) or batches < 1 or not self._belongs(header, metric, batches - 1, plan):
            raise DamagedRun(self.root, f"{name} is not from this run")
        return sums, batches

    def save(self, metric: str, batch: int, rows: Mapping[str, Tensor], sums: Mapping[str, Tensor] | None,
             skipped: Mapping[int, str], plan: str | None = None) -> None:
        """Record a finished batch: its rows first, then the sums that include it."""
        assert self.key is not None
        folder = self._folder()
        header = {"run": self.run_id, "metric": metric, "batch": batch, "plan": plan}
        try:
            folder.append(f"{metric}.log", encode_record({**header, "skipped": {str(i): r for i, r in skipped.items()}},
                                                         flat_rows(rows), self.key))
            if sums is not None:
                folder.write(f"{metric}.sums", encode_record({**header, "batches": batch + 1}, sums, self.key),
                             scratch=f"{metric}.sums.tmp")
        except files.UnsafePath as err:
            raise DamagedRun(self.root, str(err)) from None


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
