"""Checkpoints of a scoring run, so an interrupted run resumes where it stopped.

A run folder holds ``run.json`` (the fingerprint of what is being scored: metrics, options, models, inputs,
world size) and one folder per rank. In it, per metric, an append-only log with one record per finished
batch (its per-sample ``"cat"`` rows and the samples it had to skip) and, for metrics with summed
statistics, the running sums after the last finished batch (replaced atomically). Records carry a checksum;
a record torn by a crash is dropped when the log is read again, and that batch is scored again.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import Tensor

from capeval_plugins.inputs import InputError

FORMAT = 1
MAGIC = b"CPV1"
_HEAD = struct.Struct("<4sIQ")  # magic, header bytes, body bytes
_CRC = struct.Struct("<I")


class RunMismatch(InputError):
    """The run folder holds a run of something else."""


def _bytes(tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    return save_tensors({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()},
                        metadata=dict(metadata or {}))


class RecordLog:
    """Append-only records, each a JSON header and a safetensors body, checksummed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> list[tuple[dict, dict[str, Tensor]]]:
        """Every intact record, in order; anything after the first torn or corrupt one is cut off."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        records, offset = [], 0
        while offset + _HEAD.size <= len(data):
            magic, head_len, body_len = _HEAD.unpack_from(data, offset)
            end = offset + _HEAD.size + head_len + body_len + _CRC.size
            if magic != MAGIC or end > len(data):
                break
            payload = data[offset + _HEAD.size : end - _CRC.size]
            if _CRC.unpack_from(data, end - _CRC.size)[0] != zlib.crc32(payload):
                break
            header = json.loads(payload[:head_len])
            records.append((header, load_tensors(payload[head_len:]) if body_len else {}))
            offset = end
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
        head = json.dumps(header, sort_keys=True).encode()
        body = _bytes(tensors) if tensors else b""
        record = _HEAD.pack(MAGIC, len(head), len(body)) + head + body + _CRC.pack(zlib.crc32(head + body))
        with open(self.path, "ab") as f:
            f.write(record)
            f.flush()
            os.fsync(f.fileno())


@dataclass
class Progress:
    """What a rank has finished of one metric: ``batches`` done, their rows, the running sums, the samples
    skipped while scoring."""

    batches: int = 0
    rows: list[dict[str, Tensor]] = field(default_factory=list)
    sums: dict[str, Tensor] | None = None
    skipped: dict[int, str] = field(default_factory=dict)


class RunStore:
    """One rank's view of a run folder."""

    def __init__(self, root: str | os.PathLike, rank: int = 0, world: int = 1) -> None:
        self.root = Path(root)
        self.rank, self.world = rank, world
        self.part = self.root / f"rank-{rank}-of-{world}"

    # -- the run as a whole (rank 0 writes it; every rank checks it) --

    def check(self, fingerprint: Mapping[str, Any], restart: bool = False) -> bool:
        """Make the folder hold this run; True when an earlier part of it is there to resume. A folder
        holding another run is refused (``restart=True`` clears it instead)."""
        meta = self.root / "run.json"
        wanted = json.loads(json.dumps({"format": FORMAT, "fingerprint": fingerprint}, sort_keys=True, default=str))
        if restart and self.rank == 0 and self.root.exists():
            shutil.rmtree(self.root)
        if meta.exists():
            found = json.loads(meta.read_text())
            if found != wanted:
                raise RunMismatch(
                    f"{self.root} holds an unfinished run of something else ({describe_difference(found, wanted)}); "
                    "run with --restart to discard it, or write elsewhere")
            return True
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = meta.with_suffix(".tmp")
            tmp.write_text(json.dumps(wanted, indent=1, sort_keys=True))
            os.replace(tmp, meta)
        return False

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # -- one metric's part on this rank --

    def _log(self, metric: str) -> RecordLog:
        return RecordLog(self.part / f"{metric}.log")

    def _sums_path(self, metric: str) -> Path:
        return self.part / f"{metric}.sums"

    def load(self, metric: str, has_sums: bool) -> Progress:
        log = self._log(metric)
        records = log.read()
        sums, done = None, len(records)
        if has_sums:
            path = self._sums_path(metric)
            if path.exists():
                from safetensors import safe_open

                with safe_open(str(path), "pt") as f:
                    done_sums = int(f.metadata()["batches"])
                    sums = {k: f.get_tensor(k) for k in f.keys()}
            else:
                done_sums = 0
            if done_sums > done:
                raise RunMismatch(f"{self.part}: the saved sums of {metric} are ahead of its rows; the run folder "
                                  "is damaged (run with --restart)")
            done = done_sums
        if done < len(records):  # a batch whose rows were written but not its sums: score it again
            log.keep(done)
            records = records[:done]
        progress = Progress(batches=done, sums=sums)
        for header, tensors in records:
            progress.rows.append(tensors)
            progress.skipped.update({int(i): r for i, r in header.get("skipped", {}).items()})
        return progress

    def save(self, metric: str, batch: int, rows: Mapping[str, Tensor], sums: Mapping[str, Tensor] | None,
             skipped: Mapping[int, str]) -> None:
        """Record a finished batch: its rows first, then the sums that include it."""
        self.part.mkdir(parents=True, exist_ok=True)
        self._log(metric).append({"batch": batch, "skipped": {str(i): r for i, r in skipped.items()}}, rows)
        if sums is not None:
            path = self._sums_path(metric)
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(_bytes(sums, {"batches": str(batch + 1)}))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)


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
