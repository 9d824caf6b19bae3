"""Checksums of stored record batches and the identity of data files (issue 13, item 4)."""

from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pyarrow as pa
import pytest

from tabloader import catalog
from tabloader.catalog._errors import StorageError
from tabloader.catalog.storage import DatasetReader, PartWriter
from tabloader.catalog.storage import _checksums as checksums
from tabloader.cli import main

IMAGE_BYTES = 100_000


def image_table(n: int, seed: int = 0) -> pa.Table:
    """``n`` rows of a label and ~100 KB of random bytes (2 rows per record batch)."""
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "label": pa.array(np.arange(n) % 7),
            "image": pa.array([rng.bytes(IMAGE_BYTES) for _ in range(n)], pa.binary()),
        }
    )


def flip_byte_in(path, needle: bytes, at: int = 5000) -> None:
    """Flip one byte ``at`` bytes into the first occurrence of ``needle`` in the file."""
    data = bytearray(path.read_bytes())
    start = data.find(needle)
    assert start >= 0
    data[start + at] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_type_reads_back_with_matching_checksums(cat, monkeypatch):
    monkeypatch.setattr(
        "tabloader.catalog.storage._writer.TARGET_BATCH_BYTES", 4096
    )  # many batches
    n = 300
    rng = np.random.default_rng(3)
    table = pa.table(
        {
            "i": pa.array(np.arange(n)),
            "f": pa.array(rng.random(n)),
            "b": pa.array(rng.random(n) < 0.5),
            "s": pa.array([None if i % 5 == 0 else f"s{i}" * (i % 4) for i in range(n)]),
            "bin": pa.array([bytes(rng.bytes(i % 50)) for i in range(n)], pa.large_binary()),
            "lst": pa.array([list(range(i % 6)) if i % 7 else None for i in range(n)]),
            "fsl": pa.array([[i, i + 1, i + 2] for i in range(n)], pa.list_(pa.int16(), 3)),
            "st": pa.array([{"x": i, "y": f"y{i}"} for i in range(n)]),
            "cat": pa.array([f"c{i % 3}" for i in range(n)]).dictionary_encode(),
        }
    ).slice(7)  # sliced input: buffers with offsets, as a source may hand them
    ds = cat.import_arrow("t", table)
    assert ds.reader.parts[0].num_batches > 1
    report = cat.verify("t")
    assert report.ok, str(report)
    assert report.unverified == []
    assert report.rows == table.num_rows
    got = ds.take(list(range(table.num_rows)))
    assert got.drop_columns(["_id"]).equals(table.combine_chunks())
    ids = np.arange(0, table.num_rows, 3)
    for columns in [("s",), ("cat", "i"), ("lst", "st", "bin")]:  # column subsets verify too
        fresh = DatasetReader.from_spec(ds.reader.spec(), memory_map=False)
        assert fresh.gather(ids, columns).equals(table.select(list(columns)).take(ids))


def test_flipped_image_byte_is_a_storage_error_naming_dataset_file_and_rows(tmp_path):
    table = image_table(40)
    root = tmp_path / "cat"
    with catalog.open_catalog(root) as cat:
        ds = cat.import_arrow("imgs", table)
        [path] = ds.files
        assert ds.reader.parts[0].rows_per_batch == 2
    flip_byte_in(path, table.column("image")[13].as_py())  # row 13: batch 6, rows 12..13
    with catalog.open_catalog(root) as cat:
        ds = cat.dataset("imgs")
        assert ds.take([11]).column("label").to_pylist() == [11 % 7]  # other batches read
        for ids in ([13], [12], [30, 13, 2]):
            with pytest.raises(StorageError) as info:
                ds.take(ids)
            message = str(info.value)
            assert "Checksum mismatch in record batch 6" in message
            assert f"'{path}'" in message
            assert "dataset 'imgs', rows 12..13, column 'image'" in message
            assert "Re-import the dataset" in message
            assert info.value.dataset == "imgs"
            assert info.value.rows == range(12, 14)
            assert info.value.path == str(path)
        # The loading engine's reads (pread, column subsets) check the same way.
        engine = DatasetReader.from_spec(ds.reader.spec(), memory_map=False)
        with pytest.raises(StorageError, match="rows 12..13, column 'image'"):
            engine.gather(np.array([12]), ("image",))
        assert engine.gather(np.array([12, 13]), ("label",)).column(0).to_pylist() == [5, 6]
        # Unverified on request (to measure the cost): the flipped byte comes through.
        unchecked = DatasetReader(ds.reader.root, ds.reader.parts, ds.reader.schema, verify=False)
        assert unchecked.take([13]).column("image")[0].as_py() != table.column("image")[13].as_py()


def test_each_batch_is_hashed_once_per_reader(cat, monkeypatch):
    ds = cat.import_arrow("imgs", image_table(10))
    calls = []
    real = checksums.column_digest
    monkeypatch.setattr(
        "tabloader.catalog.storage._reader.column_digest", lambda a: calls.append(1) or real(a)
    )
    reader = DatasetReader.from_spec(ds.reader.spec(), memory_map=True)
    for _ in range(3):
        reader.take([4])
        reader.take([5])  # the same record batch
    assert len(calls) == 2  # two columns, hashed on the first read only
    reader.gather(np.array([4]), ("image",))  # another set of columns: read and hashed once
    reader.gather(np.array([4]), ("image",))
    assert len(calls) == 3


def test_storage_error_pickles_with_its_fields():
    exc = StorageError("bad", path="/x", dataset="d", rows=range(4, 6))
    again = pickle.loads(pickle.dumps(exc))
    assert (str(again), again.path, again.dataset, again.rows) == ("bad", "/x", "d", range(4, 6))


def test_a_file_swapped_for_another_datasets_file_of_the_same_size_is_refused(tmp_path):
    root = tmp_path / "cat"
    table = image_table(6)
    with catalog.open_catalog(root) as cat:
        [a] = cat.import_arrow("aa", table).files
        [b] = cat.import_arrow("bb", table).files
    assert a.stat().st_size == b.stat().st_size
    shutil.copyfile(b, a)
    with catalog.open_catalog(root) as cat:
        with pytest.raises(StorageError) as info:
            cat.dataset("aa").take([0])
        assert str(info.value).startswith(f"Data file '{a}' of dataset 'aa' (rows 0..5) holds ")
        assert "holds dataset 'bb' part 1 (file " in str(info.value)
        assert "not dataset 'aa' part 1" in str(info.value)
        assert "swapped or copied over" in str(info.value)
        assert info.value.rows == range(6)
        assert cat.dataset("bb").take([0]).num_rows == 1


def test_the_other_part_of_the_same_dataset_is_refused(tmp_path):
    root = tmp_path / "cat"
    table = image_table(4)
    with catalog.open_catalog(root) as cat:
        for append in (False, True, True):  # parts of rows 0..3, 4..7 and 8..11
            cat.import_arrow("d", table, append=append)
        first, second, _ = cat.dataset("d").files
    assert first.stat().st_size == second.stat().st_size
    data_1, data_2 = first.read_bytes(), second.read_bytes()
    first.write_bytes(data_2)
    second.write_bytes(data_1)
    with catalog.open_catalog(root) as cat:
        ds = cat.dataset("d")
        assert ds.take([9]).column("label").to_pylist() == [9 % 4 % 7]  # part 3 is fine
        swapped = r"holds dataset 'd' part 2 .*not dataset 'd' part 1"
        with pytest.raises(StorageError, match=swapped):
            ds.take([0])
        with pytest.raises(StorageError, match=r"\(rows 4..7\) holds dataset 'd' part 1"):
            ds.take([5])
        report = cat.verify()
    assert [(d.dataset, d.rows) for d in report.damaged] == [("d", range(4)), ("d", range(4, 8))]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_verify_command_reports_damaged_ranges_and_exit_code(tmp_path, capsys):
    root = tmp_path / "cat"
    table = image_table(10)
    with catalog.open_catalog(root) as cat:
        [a] = cat.import_arrow("a", table).files
        cat.import_arrow("b", table)
    code, out, err = run_cli(capsys, "--catalog", str(root), "verify")
    assert (code, err) == (0, "")
    assert out.strip() == (
        "checked 2 dataset(s) (a, b): 2 file(s), 10 record batches, 20 rows; no damage found."
    )
    flip_byte_in(a, table.column("image")[3].as_py())  # rows 2..3
    flip_byte_in(a, table.column("image")[9].as_py())  # rows 8..9
    code, out, err = run_cli(capsys, "--catalog", str(root), "verify")
    assert code == 1
    lines = out.strip().splitlines()
    assert lines[0].startswith(
        f"DAMAGED a: rows 2..3: Checksum mismatch in record batch 1 of '{a}'"
    )
    assert lines[1].startswith(
        f"DAMAGED a: rows 8..9: Checksum mismatch in record batch 4 of '{a}'"
    )
    assert lines[2].startswith("checked 2 dataset(s) (a, b): 2 file(s), 10 record batches")
    assert "4 rows damaged in 2 range(s)" in lines[2]
    code, out, _ = run_cli(capsys, "--catalog", str(root), "verify", "b")
    assert code == 0
    assert "checked 1 dataset(s) (b)" in out
    code, out, err = run_cli(capsys, "--catalog", str(root), "verify", "c")
    assert (code, out) == (1, "")
    assert err.startswith("DatasetNotFoundError: Unknown dataset 'c' in catalog")
    a.unlink()
    code, out, _ = run_cli(capsys, "--catalog", str(root), "verify", "a")
    assert code == 1
    assert out.startswith(f"DAMAGED a: rows 0..9: Missing data file '{a}' of dataset 'a'")


def rewrite_without_checksums(cat, name: str) -> None:
    """Turn a dataset's part files into files of the format before checksums (as an older
    tabloader wrote them) and record their new sizes, as that tabloader would have."""
    for part in cat.dataset(name).reader.parts:
        path = cat.root / part.path
        with pa.ipc.open_file(path) as f:
            schema = f.schema.remove_metadata()
            batches = [f.get_batch(i) for i in range(f.num_record_batches)]
        tmp = path.with_name("old.arrow")
        writer = PartWriter(tmp, schema, part.rows_per_batch)
        for rb in batches:
            writer.write(rb)
        size = writer.close()
        os.replace(tmp, path)
        cat.connection.execute(
            "UPDATE _tabloader.parts SET file_size = ? WHERE path = ?", [size, part.path]
        )


def test_files_without_checksums_open_unverified(tmp_path, capsys):
    root = tmp_path / "cat"
    table = image_table(6)
    with catalog.open_catalog(root) as cat:
        cat.import_arrow("old", table)
        rewrite_without_checksums(cat, "old")
        cat.import_arrow("old", table, append=True)  # a new part: with checksums
    with catalog.open_catalog(root) as cat:
        ds = cat.dataset("old")
        assert (
            ds.take(list(range(12))).drop_columns(["_id"]).equals(pa.concat_tables([table, table]))
        )
        assert [ds.reader.checksummed(i) for i in range(2)] == [False, True]
        [old, _] = ds.files
    flip_byte_in(old, table.column("image")[1].as_py())  # undetectable without checksums
    code, out, _ = run_cli(capsys, "--catalog", str(root), "verify")
    assert code == 0
    assert out.strip().splitlines() == [
        f"UNVERIFIED {old}: written before checksums; re-import the dataset to add them",
        "checked 1 dataset(s) (old): 2 file(s), 6 record batches, 12 rows; no damage found; "
        "1 file(s) unverified (no checksums).",
    ]
