"""Parquet read within bounds: caption files, benchmark files and the Hub's Parquet conversions.

Parquet compresses repeated values to almost nothing: a 230 KB file of 1,000,000 identical rows decodes into
GBs of Python objects, and a 1 KB file can hold one 10 MB value that 100,000 rows repeat. So, before any row is
decoded, the footer is read and the file refused when it holds more rows than the caller allows (a benchmark
has a known order of rows), or when its values, at :data:`CELL_BYTES` each in Python, or its columns would
take more than :data:`RATIO` times the file's size (never less than :data:`FLOOR`); then every page header is
read (the sizes pyarrow will decompress to, whatever the footer claims) and the file refused when its pages
decode to more than that, or when a page uses an encoding whose decoded size has no bound. Rows are then
decoded a few at a time (few enough that a batch repeating the largest dictionary value stays small), each
batch counted as written out, so repeated values are refused part-way. A file pyarrow cannot read is one line
naming it (:class:`ParquetError`), never a traceback.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from capeval_plugins.core.messages import DataError, install_extra

# decoded bytes allowed per byte of file: real caption data (text, embedded JPEGs) decodes to a few times its
# size; text of repeated references, dictionary-encoded, to tens of times
RATIO = 64
FLOOR = 256 << 20  # a small file may always decode to this much
CELL_BYTES = 128  # what one decoded value costs in Python (an object and its slot in a row dict: ~110 B measured)
BATCH_ROWS = 256


class ParquetError(DataError):
    """A Parquet file that cannot be read, or that would decode into more than its bounds (one line, exit 2)."""


def _reason(err: BaseException) -> str:
    return " ".join(str(err).split())[:200] or type(err).__name__


@dataclass
class Bounds:
    """What a file may decode to: at most ``max_rows`` rows (None: any number) and ``budget`` bytes."""

    where: str
    size: int
    max_rows: int | None = None
    what: str = ""

    @property
    def budget(self) -> int:
        return max(FLOOR, RATIO * self.size)

    def limit(self) -> str:
        return (f"{self.budget / 1e6:,.0f} MB ({RATIO}x the file's {self.size / 1e6:,.2f} MB, at least "
                f"{FLOOR >> 20} MiB)")

    def refuse(self, why: str) -> ParquetError:
        return ParquetError(f"{self.where}: {why}; refused before it could fill memory")


# Page encodings whose decoded size follows from the page's own size. DELTA_BYTE_ARRAY is not among them: each
# value may repeat any prefix of the one before, so a few bytes a row decode to a megabyte a row.
SAFE_ENCODINGS = {0, 2, 3, 4, 5, 6, 8, 9}  # PLAIN, PLAIN_DICTIONARY, RLE, BIT_PACKED, DELTA_BINARY_PACKED,
#                                           DELTA_LENGTH_BYTE_ARRAY, RLE_DICTIONARY, BYTE_STREAM_SPLIT
DICTIONARY_PAGE = 2


class _Thrift:
    """Just enough of Thrift's compact protocol to read a page header: a struct as ``{field id: value}``,
    integers and nested structs kept, everything else skipped."""

    def __init__(self, data: Any, pos: int, end: int) -> None:
        self.data, self.pos, self.end = data, pos, end

    def byte(self) -> int:
        if self.pos >= self.end:
            raise ValueError("a page header runs past its column chunk")
        value = self.data[self.pos]
        self.pos += 1
        return value

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise ValueError("a varint longer than 64 bits")

    def zigzag(self) -> int:
        v = self.varint()
        return (v >> 1) ^ -(v & 1)

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.end:
            raise ValueError("a page header runs past its column chunk")
        self.pos += n

    def value(self, kind: int, depth: int) -> Any:
        if kind in (1, 2):  # boolean true / false, in the field header
            return kind == 1
        if kind == 3:
            return self.byte()
        if kind in (4, 5, 6):
            return self.zigzag()
        if kind == 7:
            return self.skip(8)
        if kind == 8:
            return self.skip(self.varint())
        if kind in (9, 10):
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            for _ in range(size):
                self.byte() if head & 15 in (1, 2) else self.value(head & 15, depth + 1)
            return None
        if kind == 11:
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.value(types >> 4, depth + 1)
                    self.value(types & 15, depth + 1)
            return None
        if kind == 12:
            return self.struct(depth + 1)
        raise ValueError(f"unknown Thrift type {kind}")

    def struct(self, depth: int = 0) -> dict[int, Any]:
        if depth > 16:
            raise ValueError("a page header nested too deeply")
        fields: dict[int, Any] = {}
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return fields
            last = last + (head >> 4) if head >> 4 else self.zigzag()
            fields[last] = self.value(head & 15, depth)


def _pages(data: Any, start: int, length: int) -> Iterator[tuple[int, int, int | None]]:
    """The pages of the column chunk at ``start``: (page type, decoded bytes, encoding of a data page)."""
    end = start + length
    if start < 0 or length < 0 or end > len(data):
        raise ValueError("a column chunk lies outside the file")
    pos = start
    while pos < end:
        reader = _Thrift(data, pos, end)
        header = reader.struct()
        kind, decoded, stored = header.get(1), header.get(2), header.get(3)
        if not all(isinstance(v, int) and v >= 0 for v in (kind, decoded, stored)):
            raise ValueError("a page header without its type and sizes")
        inner = header.get(5) if kind == 0 else header.get(8) if kind == 3 else None
        encoding = inner.get(2 if kind == 0 else 4) if isinstance(inner, dict) else None
        yield kind, decoded, encoding
        pos = reader.pos + stored


class ParquetTable:
    """A Parquet file whose footer was read and checked against :class:`Bounds`; :meth:`batches` decodes it."""

    def __init__(self, data: Any, where: str, *, max_rows: int | None = None, what: str = "") -> None:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ParquetError(f"reading {where} (Parquet) needs pyarrow: {install_extra('parquet')}") from None
        self.bounds = Bounds(where, len(data), max_rows, what)
        try:
            self.file = pq.ParquetFile(pa.BufferReader(data))
            meta = self.file.metadata
            chunks = [meta.row_group(g).column(c) for g in range(meta.num_row_groups) for c in range(meta.num_columns)]
            self.rows = int(meta.num_rows)
            declared = sum(max(0, int(chunk.total_uncompressed_size)) for chunk in chunks)
            values = sum(max(0, int(chunk.num_values)) for chunk in chunks)
        except Exception as err:  # noqa: BLE001  (pyarrow raises several types for a damaged footer)
            raise ParquetError(f"{where}: not a readable Parquet file ({_reason(err)})") from None
        names = self.file.schema_arrow.names
        if len(set(names)) != len(names):  # each row would keep one of the two values, silently (as json would)
            raise ParquetError(f"{where}: a column name appears twice: {names}")
        self._check(declared, values)
        self.largest_dictionary = self._check_pages(data, chunks)

    def _check(self, declared: int, values: int) -> None:
        bounds = self.bounds
        if self.rows < 0:
            raise bounds.refuse(f"its footer declares {self.rows} rows")
        if bounds.max_rows is not None and self.rows > bounds.max_rows:
            raise bounds.refuse(f"{self.rows:,} rows, more than {bounds.what or 'this file'} has by far (at most "
                                f"{bounds.max_rows:,})")
        if declared > bounds.budget:
            raise bounds.refuse(f"its columns decode to {declared / 1e6:,.0f} MB, more than {bounds.limit()}")
        if values * CELL_BYTES > bounds.budget:
            raise bounds.refuse(f"{values:,} values in {self.rows:,} rows would take {values * CELL_BYTES / 1e6:,.0f} "
                                f"MB or more as Python objects, more than {bounds.limit()}")

    def _check_pages(self, data: Any, chunks: list[Any]) -> int:
        """Walk every page header (the sizes pyarrow will decompress to, whatever the footer says): refuse a file
        whose pages decode to more than the budget, or that uses an encoding whose decoded size is unbounded.
        Returns the largest dictionary page (the largest value a row can repeat)."""
        bounds = self.bounds
        total = largest = 0
        for chunk in chunks:
            starts = [o for o in (chunk.dictionary_page_offset, chunk.data_page_offset) if o is not None and o > 0]
            start = min(starts) if starts else 0
            try:
                for kind, decoded, encoding in _pages(data, start, int(chunk.total_compressed_size)):
                    total += decoded
                    if kind == DICTIONARY_PAGE:
                        largest = max(largest, decoded)
                    if encoding is not None and encoding not in SAFE_ENCODINGS:
                        raise bounds.refuse(f"column {chunk.path_in_schema} uses encoding {encoding} (DELTA_BYTE_ARRAY "
                                            "or unknown), whose values can repeat without bound; write it with the "
                                            "default encodings")
                    if total > bounds.budget:
                        raise bounds.refuse(f"its pages decode to more than {bounds.limit()}")
            except ParquetError:
                raise
            except ValueError as err:
                raise ParquetError(f"{bounds.where}: not a readable Parquet file ({err})") from None
        return largest

    def batches(self) -> Iterator[list[dict[str, Any]]]:
        """The rows in order, a few at a time (as dicts), the decoded bytes counted against the budget."""
        bounds = self.bounds
        # a batch stays within a quarter of the budget even when every row repeats the largest dictionary value
        per_batch = max(1, min(BATCH_ROWS, (bounds.budget // 4) // max(1, self.largest_dictionary)))
        decoded = 0
        try:
            for batch in self.file.iter_batches(batch_size=per_batch):
                decoded += sum(_logical_bytes(column) for column in batch.columns)
                decoded += batch.num_rows * batch.num_columns * CELL_BYTES
                if decoded > bounds.budget:
                    raise bounds.refuse(f"its rows decode to more than {bounds.limit()}")
                yield batch.to_pylist()
        except ParquetError:
            raise
        except Exception as err:  # noqa: BLE001  (a damaged page, a codec pyarrow lacks, ...)
            raise ParquetError(f"{bounds.where}: cannot read its rows ({_reason(err)})") from None

    def read(self) -> list[dict[str, Any]]:
        return [row for batch in self.batches() for row in batch]


def _logical_bytes(array: Any) -> int:
    """The bytes ``array`` holds once every row is written out: a dictionary-typed column (what a file written
    from one reads back as) counts its value once per row that names it, not once."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    if pa.types.is_dictionary(kind):
        values = array.dictionary
        if pa.types.is_binary(values.type) or pa.types.is_string(values.type) or \
                pa.types.is_large_binary(values.type) or pa.types.is_large_string(values.type):
            sizes = pc.fill_null(pc.binary_length(values), 0)
        else:
            sizes = pa.array([max(1, values.nbytes // max(1, len(values)))] * len(values), pa.int64())
        total = pc.sum(pc.take(sizes, pc.fill_null(array.indices, 0))).as_py() if len(values) else 0
        return int(total or 0) + array.indices.nbytes
    if pa.types.is_struct(kind):
        return sum(_logical_bytes(child) for child in array.flatten())
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _logical_bytes(array.flatten()) + 8 * len(array)
    return int(array.nbytes)


def read_rows(data: Any, where: str, *, max_rows: int | None = None, what: str = "") -> list[dict[str, Any]]:
    """Every row of the Parquet file ``data`` (bytes or a mapped file), within bounds (see the module docstring)."""
    return ParquetTable(data, where, max_rows=max_rows, what=what).read()
