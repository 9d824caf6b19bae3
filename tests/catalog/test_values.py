"""``DatasetReader.binary_values``: small rows read one value at a time (issue 35, item 4).

Every answer is checked against ``take`` (the per-row read that was there before), and the
whole-batch reads are counted: each record batch of a part of small rows is read whole once
(its checked first read), then only values.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from tabloader.catalog._errors import StorageError
from tabloader.catalog.storage import DatasetReader
from tabloader.catalog.storage._values import INDEX_ROWS


def flip_byte_in(path, needle: bytes, at: int) -> None:
    """Flip one byte ``at`` bytes into the first occurrence of ``needle`` in the file."""
    data = bytearray(path.read_bytes())
    start = data.find(needle)
    assert start >= 0
    data[start + at] ^= 0x01
    path.write_bytes(bytes(data))


def values_of(reader: DatasetReader, ids: np.ndarray, column: str) -> list:
    got, errors = reader.binary_values(ids, column)
    assert errors == {}
    return [None if v is None else bytes(v) for v in got]


def expected(ds, ids: np.ndarray, column: str) -> list:
    col = ds.take(ids.tolist(), [column]).column(column)
    if pa.types.is_struct(col.type):
        col = pa.chunked_array([c.field("bytes") for c in col.chunks])
    return [v.encode() if isinstance(v, str) else v for v in col.to_pylist()]


def small_rows(n: int, seed: int = 0) -> pa.Table:
    """``n`` rows of a few dozen bytes each (many rows per record batch), with nulls."""
    rng = np.random.default_rng(seed)
    data = [None if i % 11 == 5 else rng.bytes(int(rng.integers(1, 60))) for i in range(n)]
    return pa.table(
        {
            "label": pa.array(np.arange(n) % 7),
            "image": pa.array(data, pa.binary()),
            "big": pa.array(data, pa.large_binary()),
            "hf": pa.array([{"bytes": d, "path": f"p{i}"} for i, d in enumerate(data)]),
            "name": pa.array([f"n{i}" for i in range(n)]),
        }
    )


@pytest.mark.parametrize("column", ["image", "big", "hf", "name"])
def test_binary_values_are_the_rows_values_in_the_asked_order(cat, monkeypatch, column):
    monkeypatch.setattr(
        "tabloader.catalog.storage._writer.TARGET_BATCH_BYTES", 2048
    )  # many batches
    ds = cat.import_arrow("t", small_rows(500))
    ds = cat.import_arrow("t", small_rows(300, seed=1), append=True)  # a second part
    reader = DatasetReader.from_spec(ds.reader.spec(), memory_map=False)
    assert len(reader.parts) == 2
    assert all(p.rows_per_batch >= INDEX_ROWS for p in reader.parts)
    rng = np.random.default_rng(0)
    for ids in (rng.permutation(800)[:300], np.array([3, 3, 799, 0, 3]), np.arange(800)):
        assert values_of(reader, ids, column) == expected(ds, ids, column)


def test_each_batch_of_small_rows_is_read_whole_once(cat, monkeypatch):
    monkeypatch.setattr("tabloader.catalog.storage._writer.TARGET_BATCH_BYTES", 2048)
    ds = cat.import_arrow("t", small_rows(400))
    reader = DatasetReader.from_spec(ds.reader.spec(), memory_map=False)
    calls = []
    real = reader.record_batch
    monkeypatch.setattr(reader, "record_batch", lambda *a: calls.append(a[:2]) or real(*a))
    rng = np.random.default_rng(1)
    for _ in range(5):
        ids = rng.permutation(400)[:100]
        assert values_of(reader, ids, "image") == expected(ds, ids, "image")
    assert len(calls) == len(set(calls))  # never a batch twice
    assert len(calls) <= ds.reader.parts[0].num_batches


def test_large_rows_are_read_a_record_batch_at_a_time(cat):
    data = [bytes([i]) * 100_000 for i in range(6)]  # ~100 KB each: few rows per batch
    ds = cat.import_arrow("t", pa.table({"image": pa.array(data, pa.binary())}))
    reader = DatasetReader.from_spec(ds.reader.spec(), memory_map=False)
    assert reader.parts[0].rows_per_batch < INDEX_ROWS
    ids = np.array([5, 0, 3])
    assert values_of(reader, ids, "image") == [data[5], data[0], data[3]]
    assert reader._values == {(0, (0,)): None}  # not indexed


def test_a_damaged_batch_fails_its_own_rows_only(tmp_path, monkeypatch):
    from tabloader import catalog

    monkeypatch.setattr("tabloader.catalog.storage._writer.TARGET_BATCH_BYTES", 4096)
    table = pa.table({"image": pa.array([bytes([i % 251]) * 200 for i in range(400)])})
    root = tmp_path / "cat"
    with catalog.open_catalog(root, create=True) as cat:
        ds = cat.import_arrow("t", table)
        rpb = ds.reader.parts[0].rows_per_batch
        assert rpb >= INDEX_ROWS
        [path] = ds.files
        flip_byte_in(path, table.column("image")[3 * rpb + 1].as_py(), at=10)
        reader = DatasetReader.from_spec(ds.reader.spec(), memory_map=False)
    ids = np.array([0, 3 * rpb, 3 * rpb + 2, 5 * rpb, 1])
    got, errors = reader.binary_values(ids, "image")
    assert sorted(errors) == [1, 2]
    assert all(isinstance(e, StorageError) for e in errors.values())
    assert "Checksum mismatch in record batch 3" in str(errors[1])
    assert [bytes(got[i]) for i in (0, 3, 4)] == [
        table.column("image")[i].as_py() for i in (0, 5 * rpb, 1)
    ]
