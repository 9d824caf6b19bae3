from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tabloader.catalog._job_bitmaps
import tabloader.catalog.storage._writer
from tabloader import catalog
from tabloader.catalog import (
    AlreadyExistsError,
    CatalogError,
    CatalogLockedError,
    DatasetNotFoundError,
    ImportFailedError,
    RowIdError,
    StorageError,
    UnknownColumnError,
)


def make_table(n: int = 1000, payload: int = 200, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "label": rng.integers(0, 10, n),
            "split": np.where(rng.random(n) < 0.8, "train", "val"),
            "score": rng.random(n),
            "image": [rng.bytes(payload) for _ in range(n)],
        }
    )


def data_files(cat: catalog.Catalog) -> list[str]:
    return sorted(
        str(p.relative_to(cat.root)) for p in (cat.root / "data").rglob("*") if p.is_file()
    )


def duckdb_tables(cat: catalog.Catalog) -> list[str]:
    return [
        r[0]
        for r in cat.connection.execute(
            "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main'"
        ).fetchall()
    ]


def test_connect_default_path_uses_env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TABLOADER_CATALOG", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    with catalog.open_catalog() as c:  # not ./catalog: that is the source package in a checkout
        assert c.root == tmp_path / "xdg" / "tabloader" / "catalog"
        assert not c.exists
    assert not (tmp_path / "xdg").exists()  # a read-only open creates nothing
    monkeypatch.setenv("TABLOADER_CATALOG", str(tmp_path / "elsewhere"))
    with catalog.open_catalog(create=True) as c:
        assert c.root == tmp_path / "elsewhere"
        assert (tmp_path / "elsewhere" / "catalog.duckdb").exists()


def test_reads_refuse_a_directory_that_is_not_a_catalog(tmp_path):
    root = tmp_path / "typo"
    with catalog.open_catalog(root) as c:
        for read in (
            c.dataset_names,
            c.job_names,
            lambda: c.dataset("t"),
            lambda: c.job("j"),
            lambda: c.sql("SHOW DATASETS"),
            lambda: c.sql("SHOW JOBS"),
            lambda: c.sql("DESCRIBE t"),
            lambda: c.sql("SELECT 1"),
        ):
            with pytest.raises(CatalogError, match=rf"'{root}' is not a tabloader catalog \(it "):
                read()
        assert not root.exists()
        c.import_arrow("t", make_table(10))  # an import creates it
        assert c.exists
        assert c.dataset_names() == ["t"]


def test_not_found_errors_name_the_catalog(cat):
    cat.import_arrow("t", make_table(10))
    with pytest.raises(DatasetNotFoundError, match=f"Unknown dataset 'x' in catalog '{cat.root}'"):
        cat.dataset("x")
    with pytest.raises(LookupError, match=f"Unknown job 'cnn' in catalog '{cat.root}'"):
        cat.job("cnn")
    with pytest.raises(DatasetNotFoundError, match=f"unknown dataset 'x' in catalog '{cat.root}'"):
        cat.import_arrow("x", make_table(10), append=True)


def test_connect_refuses_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CatalogError, match="is a file; give a directory"):
        catalog.open_catalog(f)


def test_connect_refuses_a_non_duckdb_file(tmp_path):
    (tmp_path / "catalog.duckdb").write_bytes(b"not a database" * 100)
    with pytest.raises(CatalogError, match="Opening catalog .* failed in DuckDB"):
        catalog.open_catalog(tmp_path)


def make_data_a_file(root):
    root.mkdir()
    (root / "data").write_text("not a folder")
    return root


@pytest.mark.parametrize(
    ("make_root", "problem"),
    [
        (lambda p: (p / "f").write_text("x") and p / "f" / "cat", r"Not a directory: '.*/f/cat"),
        (lambda p: make_data_a_file(p / "cat"), r"File exists: '.*/cat/data'"),
    ],
)
def test_connect_maps_os_errors(tmp_path, make_root, problem):
    with pytest.raises(CatalogError, match=rf"as a catalog directory \({problem}.*\)\. Give a new"):
        catalog.open_catalog(make_root(tmp_path), create=True)


def test_os_error_after_duckdb_opened_is_mapped(tmp_path, monkeypatch):
    def unreadable(root, db):
        raise PermissionError(errno.EACCES, "Permission denied", str(root / "jobs"))

    monkeypatch.setattr("tabloader.catalog._catalog.collect_garbage", unreadable)
    with pytest.raises(CatalogError, match=r"\(Permission denied: '.*/jobs'\)\. Give a new"):
        catalog.open_catalog(tmp_path, create=True)


def files_under(root) -> list[str]:
    """The files in ``data/`` and ``jobs/`` of catalog directory ``root``."""
    return sorted(
        p.relative_to(root).as_posix()
        for folder in ("data", "jobs")
        for p in (root / folder).rglob("*")
        if p.is_file()
    )


@pytest.mark.parametrize("folder", ["data/train", "jobs"])
def test_connect_refuses_a_directory_that_is_not_a_catalog(tmp_path, folder):
    (tmp_path / folder).mkdir(parents=True)
    (tmp_path / folder / "shard0.arrow").write_bytes(b"user data")
    with pytest.raises(CatalogError, match=r"not a tabloader catalog: .* empty or new directory"):
        catalog.open_catalog(tmp_path, create=True)
    assert (tmp_path / folder / "shard0.arrow").read_bytes() == b"user data"
    assert not (tmp_path / "catalog.duckdb").exists()


def test_garbage_collection_deletes_only_tabloader_files(tmp_path):
    root = tmp_path / "cat"
    with catalog.open_catalog(root) as cat:
        cat.import_arrow("t", make_table(10))
        cat.register_job("j", "t")
        kept = files_under(root)
    token = "0123456789ab"
    theirs = [
        "data/t/notes.txt",
        "data/t/shard0.arrow",
        f"data/t/part-{token}.arrow",
        "data/train/shard0.arrow",
        f"data/train/deep/part-v00001-{token}.arrow",
        "jobs/notes.txt",
        f"jobs/my-job-{token}.roaring",
        f"jobs/sub/j-{token}.roaring",
    ]
    ours = [
        f"data/t/part-v00002-{token}.arrow",
        f"data/t/.tmp-{token}.arrow",
        f"data/u/.tmp-{token}.arrow",
        f"jobs/k-{token}.roaring",
        f"jobs/.tmp-j-{token}.roaring",
    ]
    for rel in theirs + ours:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    with catalog.open_catalog(root) as cat:
        assert files_under(root) == sorted(kept + theirs)
        assert not (root / "data/u").exists()  # emptied by the collection
        assert cat.dataset("t").take([3]).num_rows == 1
        cat.drop_dataset("t", cascade=True)
        assert sorted((root / "data/t").iterdir()) == sorted(
            root / rel for rel in theirs if rel.startswith("data/t/")
        )


@pytest.mark.parametrize("ids", [[0], [999, 0, 500, 3, 3], list(range(1000))[::-7]])
def test_import_arrow_take_round_trip(cat, ids):
    table = make_table()
    ds = cat.import_arrow("t", table)
    assert (ds.name, ds.version, ds.num_rows) == ("t", 1, 1000)
    assert ds.columns == ["_id", "label", "split", "score", "image"]
    got = ds.take(ids)
    assert got.column("_id").to_pylist() == ids
    assert got.drop_columns(["_id"]).equals(table.take(ids))


def test_take_selected_columns_and_bitmap(cat):
    from pyroaring import BitMap

    ds = cat.import_arrow("t", make_table())
    got = ds.take(BitMap([5, 1, 9]), columns=["image"])
    assert got.column_names == ["_id", "image"]
    assert got.column("_id").to_pylist() == [1, 5, 9]
    with pytest.raises(UnknownColumnError, match="Unknown column 'imag'. Did you mean 'image'"):
        ds.take([1], columns=["imag"])
    with pytest.raises(RowIdError, match=r"Row id 1000 is out of range; .* has ids 0\.\.999"):
        ds.take([1000])
    assert ds.take([3], columns="label").column_names == ["_id", "label"]  # one column


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1000], r"Row id 1000 is out of range; this dataset version has ids 0\.\.999\."),
        ([5, -1, 2], r"Row id -1 is out of range"),
        (np.array([1, 2000] * 600), r"Row id 2000 is out of range"),  # the batched path
        ([1.5], r"Row id 1\.5 is not an integer \(float\); pass integer ids\."),
        ([1, 2.0], r"Row id 1\.0 is not an integer \(float\)"),
        (np.array([0.0, 3.0]), r"Row id 0\.0 is not an integer \(float\)"),
        (["3"], r"Row id '3' is not an integer \(str\)"),
        ([2**70], r"Row id 1180591620717411303424 is out of range"),
        ([1, 2**70], r"Row id 1180591620717411303424 is out of range; ids are below 2\*\*63"),
        (np.array([1, 2**64 - 1], dtype=np.uint64), r"Row id 18446744073709551615 is out of"),
    ],
)
def test_take_refuses_bad_row_ids(cat, ids, message):
    ds = cat.import_arrow("t", make_table())
    for columns in (None, ["label"]):  # the single-row fast path and the general one
        with pytest.raises(RowIdError, match=message) as info:
            ds.take(ids, columns=columns)
        assert isinstance(info.value, IndexError)
        assert isinstance(info.value, catalog.TabloaderError)
    assert ds.take(np.array([3, 1], dtype=np.uint32)).column("_id").to_pylist() == [3, 1]
    assert ds.take([np.int64(4)]).column("_id").to_pylist() == [4]
    assert ds.take([]).num_rows == 0


def test_register_job_takes_one_column_name(cat):
    cat.import_arrow("t", make_table(10))
    assert cat.register_job("j", "t", columns="label").columns == ("label",)


def test_small_batches_for_large_rows(cat):
    small = cat.import_arrow("small", make_table(payload=10))
    large = cat.import_arrow("large", make_table(payload=100_000, n=40))
    assert small.reader.parts[0].rows_per_batch > large.reader.parts[0].rows_per_batch
    assert large.reader.parts[0].rows_per_batch <= 4


def test_payload_stays_out_of_duckdb(cat):
    cat.import_arrow("t", make_table())
    cols = [r[0] for r in cat.connection.execute("DESCRIBE t").fetchall()]
    assert cols == ["_id", "label", "split", "score"]
    pk = cat.connection.execute(
        "SELECT constraint_type FROM duckdb_constraints() WHERE table_name = 't'"
    ).fetchall()
    assert ("PRIMARY KEY",) in pk


def test_a_queryable_column_whole_equals_the_stored_one(cat):
    n = 300
    table = make_table(n).append_column(
        "emb", pa.FixedSizeListArray.from_arrays(pa.array(np.arange(4 * n, dtype=np.float32)), 4)
    )
    table = table.append_column("day", pa.array(np.arange(n).astype("datetime64[D]")))
    table = table.append_column("small", pa.array(np.arange(n) % 7, pa.int8()))
    cat.import_arrow("t", table)
    cat.import_arrow("t", table.slice(0, 50), append=True)
    v1 = cat.dataset("t", version=1)
    for name in ("label", "split", "score", "emb", "day", "small"):
        got = cat.column("t", name, rows=n)  # version 1's rows, though the table has more
        assert got.equals(v1.take(list(range(n)), [name]).column(name).combine_chunks()), name
    assert len(cat.column("t", "label", rows=n + 50)) == n + 50
    with pytest.raises(UnknownColumnError, match="Column 'image' of t holds bytes"):
        cat.column("t", "image", rows=n)
    with pytest.raises(UnknownColumnError, match="Unknown column 'labl'.*Did you mean 'label'"):
        cat.column("t", "labl", rows=n)
    with pytest.raises(DatasetNotFoundError):
        cat.column("nope", "label", rows=n)
    with pytest.raises(StorageError, match="has 350 rows below _id 400; run `tabloader verify`"):
        cat.column("t", "label", rows=400)
    assert cat.column("t", "label", rows=n, of=v1).equals(cat.column("t", "label", rows=n))
    cat.drop_dataset("t")
    cat.import_arrow("t", table)
    with pytest.raises(StorageError, match="t was dropped and imported again since version 1"):
        cat.column("t", "label", rows=n, of=v1)


def test_import_parquet_glob_and_ipc(cat, tmp_path):
    table = make_table(300)
    for i in range(3):
        pq.write_table(table.slice(i * 100, 100), tmp_path / f"p{i}.parquet")
    ds = cat.import_parquet("pq", tmp_path / "p*.parquet")
    assert ds.take(list(range(300))).drop_columns(["_id"]).equals(table)
    with pa.OSFile(str(tmp_path / "x.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    with pa.OSFile(str(tmp_path / "s.arrows"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    assert (
        cat.import_ipc("ipc", tmp_path / "x.arrow")
        .take([7])
        .drop_columns(["_id"])
        .equals(table.slice(7, 1))
    )
    stream = cat.import_ipc("ipcs", tmp_path / "s.arrows")
    ids = [299, 0, 150, 7, 150, 42]
    assert stream.take(ids).column("_id").to_pylist() == ids
    assert stream.take(ids).drop_columns(["_id"]).equals(table.take(ids))


def test_import_reader_streams(cat):
    table = make_table(5000)
    reader = pa.RecordBatchReader.from_batches(table.schema, table.to_batches(max_chunksize=333))
    ds = cat.import_arrow("r", reader)
    assert ds.take([4999, 0]).drop_columns(["_id"]).equals(table.take([4999, 0]))


@pytest.mark.parametrize(
    ("make_source", "error", "message"),
    [
        (lambda p: p / "missing.parquet", ImportFailedError, "No such Parquet file"),
        (lambda p: p / "nothing*.parquet", ImportFailedError, "No Parquet files match"),
        (
            lambda p: (p / "bad.parquet").write_bytes(b"garbage") and p / "bad.parquet",
            ImportFailedError,
            "not a readable Parquet file",
        ),
    ],
)
def test_import_parquet_errors(cat, tmp_path, make_source, error, message):
    with pytest.raises(error, match=message):
        cat.import_parquet("x", make_source(tmp_path))
    assert cat.dataset_names() == []


def test_import_errors(cat, tmp_path):
    cat.import_arrow("t", make_table(10))
    with pytest.raises(AlreadyExistsError, match="Dataset 't' exists already; DROP DATASET t"):
        cat.import_arrow("t", make_table(10))
    with pytest.raises(CatalogError, match="Invalid dataset name '1bad'"):
        cat.import_arrow("1bad", make_table(10))
    with pytest.raises(ImportFailedError, match="has a column named '_id'"):
        cat.import_arrow("u", pa.table({"_id": [1]}))
    with pytest.raises(ImportFailedError, match="has no rows"):
        cat.import_arrow("u", make_table(0))
    with pytest.raises(ImportFailedError, match="Cannot import a dict as Arrow"):
        cat.import_arrow("u", {"a": [1]})
    with pytest.raises(DatasetNotFoundError, match="Cannot append to unknown dataset 'tt'"):
        cat.import_arrow("tt", make_table(10), append=True)
    with pytest.raises(ImportFailedError, match="differs from the dataset's"):
        cat.import_arrow("t", pa.table({"x": [1]}), append=True)
    (tmp_path / "bad.arrow").write_bytes(b"nope")
    with pytest.raises(ImportFailedError, match="is not an Arrow IPC file or stream"):
        cat.import_ipc("u", tmp_path / "bad.arrow")
    assert cat.dataset_names() == ["t"]


def test_names_ignore_case_as_in_duckdb(cat, tmp_path):
    cat.import_arrow("meta", make_table(10))
    pq.write_table(make_table(10), tmp_path / "x.parquet")
    taken = r"Dataset 'meta' exists already, and dataset names ignore case .* 'Meta' is taken too"
    with pytest.raises(AlreadyExistsError, match=rf"{taken}\. Use 'meta', or another name\."):
        cat.sql(f"CREATE DATASET Meta FROM '{tmp_path / 'x.parquet'}'")
    with pytest.raises(AlreadyExistsError, match=taken):
        cat.import_arrow("Meta", make_table(10), append=True)
    cat.register_job("j", "meta")
    with pytest.raises(AlreadyExistsError, match=r"Job 'j' exists already, and job names ignore"):
        cat.sql("REGISTER OR REPLACE JOB J SELECT label FROM meta")
    assert len(list((cat.root / "jobs").iterdir())) == 1  # the refused job's file is gone
    cat.connection.execute('CREATE TABLE "Other" (a INTEGER)')
    with pytest.raises(AlreadyExistsError, match="A DuckDB table 'Other' exists already; pick"):
        cat.import_arrow("other", make_table(10))
    assert (cat.dataset_names(), cat.job_names()) == (["meta"], ["j"])


class _InsertFails:
    """A DuckDB connection whose INSERT into a dataset table fails (aborting the transaction)."""

    def __init__(self, con):
        self.con = con

    def execute(self, sql, *args):
        if sql.startswith('INSERT INTO "'):
            sql, args = "SELECT error('injected insert failure')", ()
        return self.con.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self.con, name)


def test_duckdb_errors_during_import_are_not_masked(cat, monkeypatch):
    """The failed statement aborts the transaction; the unregister after it must not hide it."""
    cat.connection.execute("CREATE VIEW v AS SELECT 1 AS a")  # CREATE TABLE v fails
    with pytest.raises(ImportFailedError, match=r'in DuckDB: Catalog Error: View with name "v"'):
        cat.import_arrow("v", make_table(10))
    monkeypatch.setattr(cat, "connection", _InsertFails(cat.connection))
    with pytest.raises(ImportFailedError, match=r"in DuckDB: .*injected insert failure"):
        cat.import_arrow("t", make_table(10))
    monkeypatch.undo()
    assert cat.dataset_names() == []
    assert cat.import_arrow("t", make_table(10)).num_rows == 10


def test_dataset_not_found_suggests(cat):
    cat.import_arrow("imagenet", make_table(10))
    with pytest.raises(
        DatasetNotFoundError, match="Unknown dataset 'imagnet' in catalog .*Did you mean 'imagenet'"
    ):
        cat.dataset("imagnet")
    with pytest.raises(LookupError):
        cat.dataset("imagnet")
    with pytest.raises(DatasetNotFoundError, match="has versions 1..1; version 2 does not exist"):
        cat.dataset("imagenet", version=2)


def failing_reader(table: pa.Table, fail_after: int) -> pa.RecordBatchReader:
    def batches():
        for i, b in enumerate(table.to_batches(max_chunksize=100)):
            if i == fail_after:
                raise RuntimeError("injected failure")
            yield b

    return pa.RecordBatchReader.from_batches(table.schema, batches())


@pytest.mark.parametrize("append", [False, True])
def test_failed_import_leaves_nothing(cat, append):
    table = make_table(1000)
    if append:
        cat.import_arrow("t", table)
    before_files, before_tables = data_files(cat), duckdb_tables(cat)
    with pytest.raises(RuntimeError, match="injected failure"):
        cat.import_arrow("t", failing_reader(table, fail_after=5), append=append)
    assert data_files(cat) == before_files
    assert duckdb_tables(cat) == before_tables
    if append:
        ds = cat.dataset("t")
        assert (ds.version, ds.num_rows) == (1, 1000)
        assert cat.connection.execute("SELECT count(*) FROM t").fetchone() == (1000,)
    else:
        assert cat.dataset_names() == []


DISK_FULL = "No space left on device"


class _CommitFails:
    """A DuckDB connection whose commit fails as on a full disk (after DuckDB rolled back)."""

    def __init__(self, con):
        self.con = con

    def commit(self):
        self.con.rollback()
        raise duckdb.IOException(f'Could not write file "catalog.duckdb.wal": {DISK_FULL}')

    def __getattr__(self, name):
        return getattr(self.con, name)


@pytest.mark.parametrize("where", ["data file", "commit"])
def test_full_disk_import_stores_nothing_and_says_so(cat, monkeypatch, where):
    cat.import_arrow("keep", make_table(100))
    before_files, before_tables = data_files(cat), duckdb_tables(cat)
    if where == "data file":

        def write(self, batch):
            raise OSError(errno.ENOSPC, DISK_FULL)

        monkeypatch.setattr(tabloader.catalog.storage._writer.PartWriter, "write", write)
    else:
        monkeypatch.setattr(cat, "connection", _CommitFails(cat.connection))
    with pytest.raises(
        ImportFailedError, match=r"Nothing was stored\. The disk holding .* is full"
    ):
        cat.import_arrow("t", make_table(1000))
    monkeypatch.undo()
    assert data_files(cat) == before_files
    assert duckdb_tables(cat) == before_tables
    assert cat.dataset_names() == ["keep"]
    assert cat.import_arrow("t", make_table(10)).num_rows == 10  # usable once there is room


def test_full_disk_register_keeps_the_old_job(cat, monkeypatch):
    cat.import_arrow("t", make_table(1000))
    old = cat.register_job("j", "t", where="label < 5")

    def no_space(path, data):
        raise OSError(errno.ENOSPC, DISK_FULL)

    monkeypatch.setattr(tabloader.catalog._job_bitmaps, "write_file", no_space)
    with pytest.raises(CatalogError, match=r"REGISTER JOB j failed: .* disk holding .* is full"):
        cat.register_job("j", "t", where="label < 2", replace=True)
    monkeypatch.undo()
    assert cat.job("j").ids == old.ids
    assert cat.job("j").predicate == old.predicate
    assert len(list((cat.root / "jobs").iterdir())) == 1  # the old job's bitmap, no temp file


def test_killed_import_is_cleaned_up_at_next_open(tmp_path):
    root = tmp_path / "cat"
    script = textwrap.dedent(f"""
        import time, numpy as np, pyarrow as pa
        from tabloader import catalog
        schema = pa.schema([("x", pa.int64()), ("b", pa.binary())])
        def batches():
            for i in range(10**6):
                if i == 20:
                    print("writing", flush=True)
                    time.sleep(60)
                yield pa.record_batch([pa.array(np.arange(100)), pa.array([b"y" * 1000] * 100)],
                                      schema=schema)
        cat = catalog.open_catalog({str(root)!r})
        cat.import_arrow("t", pa.RecordBatchReader.from_batches(schema, batches()))
    """)
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout.readline().strip() == "writing"
        leftovers = list((root / "data").rglob("*.arrow"))
        assert leftovers, "the import should have a temp file open"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with catalog.open_catalog(root) as cat:
        assert cat.dataset_names() == []
        assert list((root / "data").rglob("*")) == []
        assert cat.import_arrow("t", make_table(10)).num_rows == 10


def test_append_bumps_version_and_old_version_stays(cat):
    a, b = make_table(100, seed=1), make_table(50, seed=2)
    cat.import_arrow("t", a)
    ds2 = cat.import_arrow("t", b, append=True)
    assert (ds2.version, ds2.num_rows) == (2, 150)
    assert ds2.take([100, 149]).drop_columns(["_id"]).equals(b.take([0, 49]))
    v1 = cat.dataset("t", version=1)
    assert v1.num_rows == 100
    with pytest.raises(RowIdError, match="Row id 120 is out of range"):
        v1.take([120])
    assert cat.connection.execute("SELECT min(_id), max(_id), count(*) FROM t").fetchone() == (
        0,
        149,
        150,
    )


def test_second_open_in_one_process_is_refused(tmp_path):
    root = tmp_path / "cat"
    first = catalog.open_catalog(root)
    first.import_arrow("t", make_table(10))
    (tmp_path / "link").symlink_to(root)
    for spelling in (root, tmp_path / "link"):
        with pytest.raises(
            CatalogLockedError,
            match=r"Catalog '.*' is open already in this process\. Reuse that Catalog object "
            r"\(pass it as catalog= to Loader or JobDataset\), or close\(\) it",
        ):
            catalog.open_catalog(spelling)
    assert first.dataset("t").take([3]).num_rows == 1  # the refused open changed nothing
    first.close()
    first.close()
    with catalog.open_catalog(root) as again:
        assert again.dataset_names() == ["t"]


def test_failed_or_dropped_catalog_frees_its_root(tmp_path, monkeypatch):
    import gc

    root = tmp_path / "cat"

    def fails(root, db):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("tabloader.catalog._catalog.collect_garbage", fails)
    with pytest.raises(CatalogError, match="Input/output error") as info:
        catalog.open_catalog(root, create=True)
    monkeypatch.undo()
    catalog.open_catalog(root).import_arrow("t", make_table(10))  # dropped without close()
    gc.collect()
    with catalog.open_catalog(root) as cat:
        assert cat.dataset_names() == ["t"]
    assert info.traceback  # its frames (and the half-opened Catalog) were alive all along


def test_second_process_gets_a_clear_error(cat):
    code = f"from tabloader import catalog; catalog.open_catalog({str(cat.root)!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "CatalogLockedError" in proc.stderr
    assert "is in use by another process (PID" in proc.stderr


def test_corrupt_and_truncated_files(tmp_path):
    root = tmp_path / "cat"
    with catalog.open_catalog(root) as cat:
        cat.import_arrow("t", make_table(1000))
        cat.import_arrow("u", make_table(1000))
        [t_file] = cat.dataset("t").files
        [u_file] = cat.dataset("u").files
    with open(t_file, "r+b") as f:
        f.truncate(os.path.getsize(t_file) - 100)
    size = os.path.getsize(u_file)
    u_file.write_bytes(b"\0" * size)
    with catalog.open_catalog(root) as cat:
        with pytest.raises(
            StorageError, match=r"truncated or replaced\)\. Restore the file or re-import"
        ):
            cat.dataset("t").take([1])
        with pytest.raises(StorageError, match="Corrupt data file") as info:
            cat.dataset("u").take([1])
        assert info.value.path == str(u_file)
        u_file.unlink()
        with pytest.raises(StorageError, match="Missing data file"):
            cat.dataset("u").reader.open_all()
        assert cat.dataset_names() == ["t", "u"]


def test_corrupt_bytes_give_storage_error_or_rows(tmp_path):
    """Overwritten bytes: right rows or StorageError, never a raw Arrow error, never wrong
    values (every record batch carries checksums; bytes no reader looks at, such as padding,
    may change unnoticed)."""
    from tabloader.catalog.storage import DatasetReader

    table = make_table(1000)
    with catalog.open_catalog(tmp_path / "cat") as cat:
        ds = cat.import_arrow("t", table)
    [path] = ds.files
    good = path.read_bytes()
    rng = np.random.default_rng(0)
    offsets = [
        *rng.integers(0, len(good) - 8, 60).tolist(),  # mostly payload
        *range(0, 1024, 16),  # the schema and the first record batch's header
        *range(len(good) - 520, len(good) - 8, 8),  # the footer
    ]
    ids = [*rng.permutation(1000).tolist(), 7]
    outcomes = set()
    for offset in offsets:
        bad = bytearray(good)
        bad[offset : offset + 8] = rng.bytes(8)
        path.write_bytes(bytes(bad))
        reader = DatasetReader(ds.reader.root, ds.reader.parts, ds.reader.schema)  # opens anew
        for some in (ids, ids[:5], ids[:1]):  # many rows, a few, one
            try:
                got = reader.take(some)
            except StorageError as exc:
                outcomes.add(str(exc).split(" '")[0])
                continue
            assert got.column("_id").to_pylist() == some
            assert got.schema.equals(ds.schema)
            right = got.drop_columns(["_id"]).equals(table.take(some))
            outcomes.add("right rows" if right else "flipped payload")
    assert {"right rows", "Corrupt data file", "Checksum mismatch in record batch 0 of"} <= outcomes
    assert "flipped payload" not in outcomes


def test_short_buffer_is_caught_by_validate(tmp_path):
    """The IPC reader accepts a buffer shorter than its column; validate() refuses it."""
    import struct

    root = tmp_path / "cat"
    with catalog.open_catalog(root) as cat:
        [path] = cat.import_arrow("t", pa.table({"x": np.arange(10)})).files
    data = path.read_bytes()
    buffer = struct.pack("<qq", 0, 80)  # (offset, length) of the 80 bytes of x in the header
    assert data.count(buffer) == 1
    path.write_bytes(data.replace(buffer, struct.pack("<qq", 0, 8)))
    with (
        catalog.open_catalog(root) as cat,
        pytest.raises(
            StorageError, match=r"Corrupt record batch 0 in .*: .*Buffer #1 too small.* Re-import"
        ),
    ):
        cat.dataset("t").take([9, 0])


def test_inconsistent_batch_offsets_give_storage_error(cat, monkeypatch):
    """A batch whose binary offsets go backwards passes the cheap validate(); take maps it."""
    ds = cat.import_arrow("t", pa.table({"b": [b"ab", b"cd", b"ef"]}))
    offsets = pa.py_buffer(np.array([0, 4, 2, 6], dtype=np.int32).tobytes())
    broken = pa.Array.from_buffers(pa.binary(), 3, [None, offsets, pa.py_buffer(b"abcdef")])
    batch = pa.record_batch([broken], names=["b"])
    batch.validate()
    monkeypatch.setattr(ds.reader, "record_batch", lambda part, b, fields=None: batch)
    with pytest.raises(StorageError, match=r"Corrupt data in '.*/data/t': .* Re-import") as info:
        ds.take([2, 0, 1])
    assert info.value.path == str(cat.root / "data" / "t")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            "num_rows = num_rows - 1",
            r"Corrupt record batch 0 in .*: it has 1000 rows, expected 999",
        ),
        ("rows_per_batch = 256", r"has 1 record batches, expected 4\. Restore the file"),
    ],
)
def test_part_row_counts_are_checked(tmp_path, change, message):
    root = tmp_path / "cat"
    with catalog.open_catalog(root) as cat:
        cat.import_arrow("t", make_table(1000, payload=10))
        assert cat.dataset("t").reader.parts[0].num_batches == 1
        cat.connection.execute(f"UPDATE _tabloader.parts SET {change}")
    with catalog.open_catalog(root) as cat, pytest.raises(StorageError, match=message):
        cat.dataset("t").take([0])


def test_stock_duckdb_cli_reads_the_catalog(tmp_path):
    root = tmp_path / "cat"
    with catalog.open_catalog(root) as cat:
        cat.import_arrow("imagenet", make_table(100))
        cat.sql("REGISTER JOB j SELECT label FROM imagenet WHERE label < 3")
    query = "SELECT count(*), max(_id) FROM imagenet; SELECT name, num_ids FROM _tabloader.jobs"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "duckdb_cli",
            "-readonly",
            "-csv",
            "-noheader",
            str(root / "catalog.duckdb"),
            "-c",
            query,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    n = int((make_table(100).column("label").to_numpy() < 3).sum())
    assert out.stdout.split() == ["100,99", f"j,{n}"]


def test_open_reads_footers_only(cat, monkeypatch):
    ds = cat.import_arrow("t", make_table(2000, payload=5000))
    opened: list[str] = []
    memory_map, os_file = pa.memory_map, pa.OSFile
    monkeypatch.setattr(pa, "memory_map", lambda p, *a: opened.append(p) or memory_map(p, *a))
    monkeypatch.setattr(pa, "OSFile", lambda p, *a: opened.append(p) or os_file(p, *a))
    ds = cat.dataset("t")
    assert opened == []
    ds.reader.open_all()
    # each part once, through the descriptor its checks were made on (never by path again)
    assert len(opened) == len(ds.reader.parts)
    assert all(p.startswith("/proc/self/fd/") for p in opened)
    part = ds.reader.parts[0]
    assert part.num_batches == -(-2000 // part.rows_per_batch)


def test_background_flushes_while_writing(cat, monkeypatch):
    """Imports flush every SYNC_EVERY_BYTES on a thread; close and abort wait for it."""
    import threading

    from tabloader.catalog.storage import _writer as writer

    flushed: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(writer, "SYNC_EVERY_BYTES", 4096)
    monkeypatch.setattr(writer.os, "fdatasync", lambda fd: flushed.append(fd) or real(fd))
    table = make_table(2000, payload=500)
    ds = cat.import_arrow("t", table)
    assert flushed, "no background flush ran"
    assert ds.take([0, 1999]).drop_columns(["_id"]).equals(table.take([0, 1999]))
    with pytest.raises(RuntimeError, match="injected failure"):
        cat.import_arrow("u", failing_reader(table, fail_after=15))
    assert [t for t in threading.enumerate() if t.name == "tabloader-flush"] == []
    assert cat.dataset_names() == ["t"]


def test_corrupt_offsets_never_crash_a_large_take(tmp_path):
    """A gather over a batch with damaged offsets reads out of bounds (SIGSEGV seen with the
    cheap validate() alone); every batch's values are checked on first read. In a child
    process, so a crash fails this test instead of killing the run."""
    with catalog.open_catalog(tmp_path / "cat") as cat:
        ds = cat.import_arrow("t", make_table(1000))
    script = textwrap.dedent(f"""
        import numpy as np
        from tabloader import catalog
        from tabloader.catalog import StorageError
        with catalog.open_catalog({str(tmp_path / "cat")!r}) as cat:
            reader = cat.dataset("t").reader
        [part] = reader.parts
        path = reader.root / part.path
        good = path.read_bytes()
        rng = np.random.default_rng(1)
        ids = [*rng.permutation(1000).tolist(), *range(100)]  # > 1024 ids: the gather path
        errors = 0
        for _ in range(25):
            offset = int(rng.integers(0, len(good) - 4))
            bad = bytearray(good)
            bad[offset : offset + 4] = rng.bytes(4)
            path.write_bytes(bytes(bad))
            try:
                type(reader)(reader.root, reader.parts, reader.schema).take(ids)
            except StorageError:
                errors += 1
        print("storage errors", errors)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert int(proc.stdout.split()[-1]) >= 1
    assert ds.num_rows == 1000
