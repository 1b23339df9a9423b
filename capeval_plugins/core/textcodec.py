"""Texts as byte arrays, so a metric that needs raw text at finalize (CIDEr's corpus idf, references for a
corpus-level score) keeps it in a state that merges across batches, streams and DDP ranks like any other:
:func:`encode_texts` / :func:`encode_text_lists` give a zero-padded uint8 block per batch, and a merged state is
:class:`PackedTexts`, every row's bytes back to back. Text states are host states: numpy arrays in CPU memory
(a tensor given is read as its bytes; the torchmetrics adapter carries them as tensors between ranks).
Re-exported by :mod:`capeval_plugins.contract`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from capeval_plugins.core.arrays import host


SELECT_BYTES = 1 << 22  # bytes gathered at a time by PackedTexts.select


@dataclass(frozen=True)
class PackedTexts:
    """The merged rows of a text state: ``data``, every row's bytes back to back (uint8), and ``lengths``, each
    row's byte count. The same rows as the zero-padded ``(N, longest)`` tensor (:meth:`padded`), in the total
    of their lengths instead of N times the longest. Rows hold no zero byte (:func:`encode_texts`)."""

    data: np.ndarray
    lengths: np.ndarray

    @classmethod
    def join(cls, parts: Sequence[Any]) -> "PackedTexts":
        """Zero-padded row blocks and packed parts, concatenated in order (one packed part: itself)."""
        if len(parts) == 1 and isinstance(parts[0], PackedTexts):
            return parts[0]
        data, lengths = [], []
        for part in parts:
            if isinstance(part, PackedTexts):
                data.append(part.data)
                lengths.append(part.lengths)
                continue
            array = host(part).astype(np.uint8, copy=False)
            count = array.shape[0] if array.ndim else 0
            if not array.size:  # no rows, or rows of empty texts only
                lengths.append(np.zeros(count, np.int64))
                continue
            block = array.reshape(count, -1)
            filled = block != 0
            data.append(block[filled])  # row-major: row by row, each row's bytes in order
            lengths.append(filled.sum(axis=1, dtype=np.int64))
        data_ = np.concatenate(data) if data else np.zeros(0, np.uint8)
        lengths_ = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        return cls(np.ascontiguousarray(data_, dtype=np.uint8), np.ascontiguousarray(lengths_, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.lengths)

    def _starts(self) -> np.ndarray:
        return np.cumsum(self.lengths) - self.lengths

    def select(self, rows: Any) -> "PackedTexts":
        """The rows at ``rows`` (a 1-D index array or tensor), in that order (``self`` when that is every row in order).
        Bytes are gathered a few MB at a time: an index per byte of the whole state would take eight times
        its size."""
        rows = host(rows).astype(np.int64)
        if len(rows) == len(self) and np.array_equal(rows, np.arange(len(rows))):
            return self
        lengths = self.lengths[rows]
        starts = self._starts()[rows]
        data = self.data
        ends = np.cumsum(lengths)
        picked = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.uint8)
        row = 0
        while row < len(rows):  # rows row:stop hold about SELECT_BYTES bytes (a longer row alone)
            at = int(ends[row - 1]) if row else 0
            stop = max(int(np.searchsorted(ends, at + SELECT_BYTES, side="right")), row + 1)
            n = lengths[row:stop]
            # each kept byte's position: its row's start plus its offset inside the row
            offsets = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            picked[at:at + len(offsets)] = data[np.repeat(starts[row:stop], n) + offsets]
            row = stop
        return PackedTexts(picked, lengths)

    def rows(self) -> list[bytes]:
        blob = self.data.tobytes()
        ends = np.cumsum(self.lengths).tolist()
        return [blob[a:b] for a, b in zip([0, *ends[:-1]], ends)]

    def padded(self) -> np.ndarray:
        """The ``(N, longest)`` zero-padded array of these rows."""
        return _pack(self.rows())

    def to(self, *args: Any, **kwargs: Any) -> "PackedTexts":
        return self  # bytes for finalize: they stay in CPU memory

    cpu = to


def encode_texts(texts: Sequence[str], packed: bool = False) -> np.ndarray | PackedTexts:
    """Strings as a ``(B, max_bytes)`` uint8 array (UTF-8, zero-padded), or with ``packed`` as
    :class:`PackedTexts` (no padding): how a metric that needs the raw text at finalize (corpus statistics such as
    CIDEr's idf) keeps it in a :data:`TEXT_STATE`, which merges across batches and DDP ranks like any state."""
    return _encoded([t.encode("utf-8") for t in texts], packed)


def _encoded(data: list[bytes], packed: bool) -> np.ndarray | PackedTexts:
    if any(b"\x00" in d for d in data):
        raise ValueError("texts must not contain NUL characters")
    if packed:
        lengths = np.fromiter(map(len, data), dtype=np.int64, count=len(data))
        return PackedTexts(np.frombuffer(b"".join(data), dtype=np.uint8).copy(), lengths)
    return _pack(data)


def decode_texts(rows: Any) -> list[str]:
    """Inverse of :func:`encode_texts`."""
    parts = _unpack(rows)
    return b"\x00".join(parts).decode("utf-8").split("\x00") if parts else []


# Ends every text of a list in :func:`encode_text_lists`: a byte that never occurs in UTF-8.
_ITEM_END = b"\xff"


def encode_text_lists(lists: Sequence[Sequence[str]], packed: bool = False) -> np.ndarray | PackedTexts:
    """Lists of strings (e.g. each sample's references) as a ``(B, max_bytes)`` uint8 array (or, ``packed``,
    :class:`PackedTexts`): every string of a row in UTF-8 followed by the byte 0xFF (never part of UTF-8), rows
    zero-padded; no JSON to write or parse, and an empty string or an empty list survive the round trip."""
    return _encoded([b"".join(t.encode("utf-8") + _ITEM_END for t in texts) for texts in lists], packed)


def decode_text_lists(rows: Any) -> list[list[str]]:
    """Inverse of :func:`encode_text_lists`. A row not in that form (e.g. a state saved by an older version)
    raises ``ValueError``."""
    items, counts = [], []
    for row in _unpack(rows):
        if row and not row.endswith(_ITEM_END):
            raise ValueError("a text-list state row does not end its last text with 0xFF (saved in another format?)")
        parts = row.split(_ITEM_END)[:-1]
        items += parts
        counts.append(len(parts))
    texts = b"\x00".join(items).decode("utf-8").split("\x00") if items else []
    out, at = [], 0
    for n in counts:
        out.append(texts[at:at + n])
        at += n
    return out


def _pack(data: list[bytes]) -> np.ndarray:
    """Byte strings (none holding a NUL) as the rows of a zero-padded uint8 array, filled in one assignment."""
    lengths = np.fromiter(map(len, data), dtype=np.int64, count=len(data))
    out = np.zeros((len(data), int(lengths.max(initial=0))), dtype=np.uint8)
    if out.size:
        out[np.arange(out.shape[1]) < lengths[:, None]] = np.frombuffer(b"".join(data), dtype=np.uint8)
    return out


def _unpack(rows: Any) -> list[bytes]:
    """The bytes of each row of a :func:`_pack` array or tensor (padding dropped) or of :class:`PackedTexts`."""
    if isinstance(rows, PackedTexts):
        return rows.rows()
    raw = host(rows).astype(np.uint8, copy=False)
    if raw.ndim != 2 or not len(raw):
        return [b""] * len(raw)
    filled = raw != 0
    ends = np.cumsum(filled.sum(axis=1))
    blob = raw[filled].tobytes()
    return [blob[a:b] for a, b in zip([0, *ends[:-1].tolist()], ends.tolist())]
