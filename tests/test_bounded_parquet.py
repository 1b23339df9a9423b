"""Parquet read within bounds (capeval_plugins/resources/parquet.py) wherever the package reads it: a caption file
(``capeval score``), a benchmark file (``--data``), a score file, a fetched conversion. Issue 49: a 230 KB file of
1,000,000 rows grew to 2.33 GB; a malformed file was a traceback. The bounds are checked on files pyarrow writes
in every layout it has (dictionary or not, data pages v1 / v2, compressed, nested), against pyarrow's own reading
and footer; mutated files give rows or one ParquetError, never another exception."""
from __future__ import annotations

import io
import json
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capeval_plugins.resources import parquet
from capeval_plugins.bench import load_benchmark
from capeval_plugins.cli import main
from capeval_plugins.inputs import InputError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def written(table, **options) -> bytes:
    out = io.BytesIO()
    pq.write_table(table, out, **options)
    return out.getvalue()


def captions_table(n: int = 2000):
    caps = [f"a photo number {i} of a dog on the grass" for i in range(n)]
    return pa.table({"image": [f"{i}.jpg" for i in range(n)], "caption": caps,
                     "references": [[c, c + " again"] for c in caps],
                     "img": [{"bytes": b"\x89PNG" + bytes([i % 251]) * (i % 97), "path": f"{i}.png"} for i in range(n)],
                     "score": np.linspace(0, 1, n)})


def repeated(value, n: int):
    """``n`` rows naming one dictionary value: a few bytes a row on disk, ``len(value)`` bytes a row decoded."""
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([value]))


LAYOUTS = [{}, {"compression": "zstd"}, {"data_page_version": "2.0"}, {"use_dictionary": False},
           {"row_group_size": 300, "write_statistics": True}, {"compression": "gzip", "data_page_size": 4096}]


@pytest.mark.parametrize("options", LAYOUTS)
def test_every_layout_reads_as_pyarrow_reads_it_and_its_pages_add_up(options):
    """The rows equal pyarrow's own ``to_pylist``; the page headers walked add up to the footer's decoded sizes
    (which count each page header too: a little more, never less)."""
    table = captions_table()
    data = written(table, **options)
    got = parquet.ParquetTable(data, "t.parquet")
    assert got.read() == table.to_pylist()
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    for g in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            chunk = meta.row_group(g).column(c)
            start = min(o for o in (chunk.dictionary_page_offset, chunk.data_page_offset) if o)
            pages = sum(size for _, size, _ in parquet._pages(data, start, chunk.total_compressed_size))
            assert 0 < pages <= chunk.total_uncompressed_size <= pages + 64 * 1024, chunk


def test_a_million_repeated_rows_are_refused_from_the_footer():
    data = written(pa.table({"cand": repeated("a caption", 1_000_000), "refs": repeated("a ref", 1_000_000),
                             "score": np.full(1_000_000, 0.5)}))
    assert len(data) < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(parquet.ParquetError, match="1,000,000 rows, more than Nebula has by far"):
            parquet.read_rows(data, "n.parquet", max_rows=200_000, what="Nebula")
        with pytest.raises(parquet.ParquetError, match="would take .* MB or more as Python objects"):
            parquet.read_rows(data, "n.parquet")  # no row bound (a caption file): the values' cost bounds it
        assert tracemalloc.get_traced_memory()[1] < 20 << 20  # refused before any row was decoded
    finally:
        tracemalloc.stop()


def test_one_value_repeated_by_every_row_is_refused_part_way(monkeypatch):
    """A 1 KB file whose 20,000 rows repeat one 100 KB value (2 GB written out) passes the footer and its pages
    (one small dictionary page); it is refused as its rows decode, a few at a time, holding a bounded amount."""
    monkeypatch.setattr(parquet, "FLOOR", 8 << 20)
    data = written(pa.table({"cand": repeated("x" * 100_000, 20_000)}), compression="zstd")
    assert len(data) < 5_000
    table = parquet.ParquetTable(data, "bomb.parquet")
    assert table.largest_dictionary >= 100_000
    tracemalloc.start()
    try:
        with pytest.raises(parquet.ParquetError, match="its rows decode to more than 8 MB"):
            table.read()
        assert tracemalloc.get_traced_memory()[1] < 4 * (8 << 20)
    finally:
        tracemalloc.stop()


def test_pages_that_decompress_past_the_budget_are_refused_before_decoding(monkeypatch):
    monkeypatch.setattr(parquet, "FLOOR", 1 << 20)
    data = written(pa.table({"cand": ["0" * (5 << 20)]}), compression="zstd", use_dictionary=False)
    assert len(data) < 5_000
    with pytest.raises(parquet.ParquetError, match="decode to .*more than 1 MB|decode to 5 MB, more than 1 MB"):
        parquet.ParquetTable(data, "z.parquet")


def test_an_encoding_whose_values_repeat_without_bound_is_refused():
    table = pa.table({"caption": [f"caption {i}" for i in range(100)]})
    data = written(table, use_dictionary=False, column_encoding={"caption": "DELTA_BYTE_ARRAY"})
    with pytest.raises(parquet.ParquetError, match="DELTA_BYTE_ARRAY"):
        parquet.read_rows(data, "d.parquet")
    fine = written(table, use_dictionary=False, column_encoding={"caption": "DELTA_LENGTH_BYTE_ARRAY"})
    assert parquet.read_rows(fine, "d.parquet") == table.to_pylist()


@pytest.mark.parametrize("content", [b"", b"PAR1", b"PAR1" + b"\0" * 64 + b"PAR1", b"x" * 100])
def test_what_is_not_parquet_is_one_error(content):
    with pytest.raises(parquet.ParquetError, match="not a readable Parquet file"):
        parquet.read_rows(content, "bad.parquet")


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_mutation_of_a_real_file_gives_its_rows_or_one_parquet_error(data):
    """Bytes overwritten, cut or appended anywhere in real files (footer, page headers, pages): pyarrow's rows,
    other rows, or a ParquetError; never another exception, never an allocation past the budget."""
    options = data.draw(st.sampled_from(LAYOUTS[:4]))
    original = bytearray(written(captions_table(60), **options))
    kind = data.draw(st.sampled_from(["overwrite", "cut", "append"]))
    at = data.draw(st.integers(0, len(original)))
    junk = data.draw(st.binary(min_size=1, max_size=16))
    if kind == "overwrite":
        original[at: at + len(junk)] = junk
    elif kind == "cut":
        del original[at:]
    else:
        original[at:at] = junk
    try:
        rows = parquet.read_rows(bytes(original), "m.parquet")
    except parquet.ParquetError:
        return
    assert isinstance(rows, list)


# ------------------------------------------------------------------------------------------- where it is read

def test_a_caption_file_of_repeated_rows_is_one_line(tmp_path, capsys):
    bomb = tmp_path / "captions.parquet"
    n = 1_000_000
    bomb.write_bytes(written(pa.table({"image": repeated("a.png", n), "caption": repeated("a dog", n),
                                       "references": repeated("a dog", n)})))
    assert main(["score", "-m", "bleu1", "--captions", str(bomb), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("capeval: error: ") and "\n" not in err and "as Python objects" in err, err


def test_a_column_named_twice_is_refused_not_one_value_kept(tmp_path, capsys):
    """Parquet allows two columns of one name; each row kept one of the two captions and scored it with exit 0
    (as json keeps an object's last key): every Parquet file read is refused so, in one line."""
    twice = tmp_path / "captions.parquet"
    twice.write_bytes(written(pa.Table.from_arrays([pa.array(["a dog"]), pa.array([["a dog runs"]]), pa.array(["zzz"])],
                                                   names=["caption", "references", "caption"])))
    assert main(["score", "-m", "bleu1", "-o", "tokenize=false", "--captions", str(twice), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "a column name appears twice" in err and "\n" not in err, err


def test_a_benchmark_file_beyond_its_rows_is_refused(tmp_path):
    """--data: a Parquet file by its footer, a JSON file by its records (before its rows are built), naming the
    benchmark; a caption longer than any caption is refused by its row."""
    rows = pa.table({"imgid": repeated("1", 300_000), "mt": repeated("a dog", 300_000),
                     "refs": repeated('["a dog"]', 300_000), "score": np.full(300_000, 0.5)})
    (tmp_path / "n.parquet").write_bytes(written(rows))
    with pytest.raises(InputError, match="300,000 rows, more than Nebula has by far"):
        load_benchmark("nebula", tmp_path / "n.parquet")
    (tmp_path / "n.json").write_text(json.dumps([{"imgid": 1}] * 300_000))
    with pytest.raises(InputError, match="300,000 records, more than Nebula has by far"):
        load_benchmark("nebula", tmp_path / "n.json")
    long = [{"imgid": 1, "mt": "a dog", "refs": ["a dog"], "score": 0.5},
            {"imgid": 2, "mt": "x" * (2 << 20), "refs": ["a dog"], "score": 0.5}]
    (tmp_path / "l.json").write_text(json.dumps(long))
    with pytest.raises(InputError, match=r"row 1: candidate caption is 2,097,152 characters long"):
        load_benchmark("nebula", tmp_path / "l.json")
    long[1]["mt"], long[1]["refs"] = "a dog", ["a dog", "y" * (2 << 20)]
    (tmp_path / "l.json").write_text(json.dumps(long))
    with pytest.raises(InputError, match=r"row 1: a reference is 2,097,152 characters long"):
        load_benchmark("nebula", tmp_path / "l.json")
