"""Datasets in object storage: the S3 store against moto's server on loopback, behind our
fault-injecting proxy (the ``s3`` fixture, tests/support/s3proxy.py)."""

from __future__ import annotations

import io
import socket
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tabloader import catalog
from tabloader.catalog._errors import ImportFailedError, StorageError
from tabloader.catalog._settings import STORAGE_ENV
from tabloader.catalog.storage import DatasetReader
from tabloader.catalog.storage._footer import footer_length, parse_footer
from tabloader.catalog.storage._ranged import TAIL_FETCH_BYTES, PartFile, coalesce
from tabloader.catalog.storage._s3 import ATTEMPTS, open_s3, s3_config
from tests.support.polling import wait_for
from tests.support.s3proxy import Faults


def table(n: int = 300, *, row_bytes: int = 500) -> pa.Table:
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, row_bytes + i % 7, dtype=np.uint8).tobytes() for i in range(n)]
    return pa.table({"blob": pa.array(blobs, pa.binary()), "label": np.arange(n) % 5})


def stored(cat, s3, name: str = "t", n: int = 300, **kw):
    """Dataset ``name`` of ``table(n)`` imported into the bucket (prefix ``pre``)."""
    return cat.import_arrow(name, table(n), storage=f"{s3.uri}/pre", **kw)


def forget_parts(store) -> None:
    """The store forgets the part files it opened (their footers and sizes): it reads afresh."""
    store._parts.clear()


def fresh_reader(ds) -> DatasetReader:
    """A reader of ``ds`` that has read nothing yet (the store's part files forgotten too)."""
    forget_parts(ds.reader.store)
    return DatasetReader.from_spec(ds.reader.spec(), memory_map=False)


# -- the footer and ranges -------------------------------------------------------------------------
def test_the_footers_blocks_are_where_arrow_reads_its_batches():
    t = pa.table({"a": np.arange(1000), "s": pa.array(["u", "v"] * 500).dictionary_encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, t.schema) as w:
        for b in t.to_batches(max_chunksize=128):
            w.write_batch(b, custom_metadata={"k": "v"})
    data = sink.getvalue().to_pybytes()
    n = footer_length(data[-10:], len(data))
    footer = parse_footer(data[len(data) - 10 - n : -10], len(data) - 10 - n, len(data))
    assert len(footer.batches) == 8
    assert len(footer.dictionaries) == 1
    for i in range(8):
        offset, length = footer.batch_range(i)
        message = pa.ipc.read_message(pa.py_buffer(data[offset : offset + length]))
        assert message.type == "record batch"
        assert message.metadata.size + message.body.size <= length
    with pytest.raises(ValueError, match="not an Arrow IPC file"):
        footer_length(b"0123456789", 100)


def test_adjacent_ranges_are_merged_up_to_the_limit():
    ranges = [(0, 10), (10, 10), (20, 5), (40, 10), (50, 100)]
    assert coalesce(ranges, 25) == [(0, 25, [0, 1, 2]), (40, 10, [3]), (50, 100, [4])]


# -- imports and reads -----------------------------------------------------------------------------
def test_an_import_into_a_bucket_is_read_by_ranged_reads(cat, s3):
    data = table()
    ds = stored(cat, s3)
    assert s3.keys() == [f"pre/{p.path}" for p in ds.reader.parts]  # the probe is gone too
    assert not (cat.root / "data" / "t").exists()  # nothing local
    assert ds.reader.spec()[0] == f"{s3.uri}/pre"
    reader = fresh_reader(ds)
    s3.proxy.reset()
    values, errors = reader.binary_values(np.arange(300), "blob")
    assert errors == {}
    assert [bytes(v) for v in values] == data["blob"].to_pylist()
    part = reader.parts[0]
    # the tail (footer) and the record batches, adjacent ones in one request
    assert s3.proxy.stats.gets() == 2
    assert s3.proxy.stats.body_bytes[f"/{s3.bucket}/pre/{part.path}"] <= part.file_size + (64 << 10)
    assert reader.take([7, 250]).column("label").to_pylist() == [2, 0]


def test_a_buckets_record_batches_are_cut_for_reads_of_one_row(cat, s3):
    """A record batch is what one request fetches: in a bucket a row of 40 KB gets its own
    (a random order then fetches no row it does not use); in the catalog directory four share
    one (scans and local reads like larger batches); tiny rows share one in both."""
    big = table(40, row_bytes=40_000)
    remote = cat.import_arrow("remote", big, storage=f"{s3.uri}/big")
    local = cat.import_arrow("local", big)
    assert remote.reader.parts[0].rows_per_batch == 1
    assert local.reader.parts[0].rows_per_batch == 4
    tiny = stored(cat, s3, "tiny")  # rows of ~500 bytes
    assert tiny.reader.parts[0].rows_per_batch >= 32


def test_create_append_and_drop_with_storage_in_sql(cat, s3, tmp_path):
    pq.write_table(table(40), tmp_path / "a.parquet")
    cat.sql(f"CREATE DATASET d FROM '{tmp_path}/a.parquet' WITH (storage = '{s3.uri}/x/')")
    cat.sql(f"APPEND TO DATASET d FROM '{tmp_path}/a.parquet'")  # where the dataset is
    ds = cat.dataset("d")
    assert ds.num_rows == 80
    assert len(ds.reader.parts) == 2
    assert len(s3.keys("x/data/d/")) == 2
    assert ds.take([45]).column("blob").to_pylist() == [table(40)["blob"][5].as_py()]
    with pytest.raises(ImportFailedError, match=r"is stored in s3://.*/x; append to it without"):
        cat.import_arrow("d", table(40), append=True, storage=f"{s3.uri}/elsewhere")
    cat.sql("DROP DATASET d")
    assert s3.keys() == []


def test_a_failed_upload_leaves_nothing_in_the_bucket_or_the_catalog(cat, s3):
    s3.proxy.faults = Faults(deny=frozenset({"PUT", "POST"}), path="/part-")  # the probe passes
    with pytest.raises(ImportFailedError, match=r"access denied .* Nothing was stored"):
        stored(cat, s3)
    assert s3.keys() == []
    assert cat.dataset_names() == []
    assert not (cat.root / "data" / "t").exists()


def test_503s_and_cut_bodies_are_retried(cat, s3):
    data = table(400, row_bytes=4000)  # 64 rows a record batch
    ds = cat.import_arrow("t", data, storage=s3.uri)
    s3.proxy.faults = Faults(seed=4, slowdown=0.2, cut=0.1)
    reader = fresh_reader(ds)
    for row in range(0, 400, 7):  # a request each, each with its chance of a fault
        values, errors = reader.binary_values(np.array([row]), "blob")
        assert errors == {}
        assert bytes(values[0]) == data["blob"][row].as_py()
    faults = s3.proxy.stats.faults
    assert faults["slowdown"] > 0
    assert faults["cut"] > 0
    assert reader.store.counters.retries >= faults["slowdown"] + faults["cut"]


def test_a_body_that_fails_its_checksum_is_fetched_again(cat, s3):
    data = table()
    ds = stored(cat, s3)
    reader = fresh_reader(ds)
    reader.open_all()  # the footer fetched clean
    s3.proxy.faults = Faults(corrupt=1.0, budget=1)  # the first fetch is corrupted
    values, errors = reader.binary_values(np.arange(300), "blob")
    assert errors == {}
    assert [bytes(v) for v in values] == data["blob"].to_pylist()
    assert s3.proxy.stats.faults["corrupt"] >= 1
    assert reader.store.counters.refetches >= 1


def test_a_body_damaged_on_every_fetch_is_reported_with_its_rows(cat, s3):
    ds = stored(cat, s3)
    reader = fresh_reader(ds)
    reader.open_all()
    # every fetch damaged, each at a byte of the column read (the seed's draws; a flip in the
    # unread label column or the padding would go unseen, and harm nothing)
    s3.proxy.faults = Faults(corrupt=1.0, seed=4)
    _values, errors = reader.binary_values(np.array([3, 5]), "blob")  # of one record batch
    assert set(errors) == {0, 1}
    assert all(isinstance(e, StorageError) for e in errors.values())
    assert errors[0].rows.start <= 3 < errors[0].rows.stop
    with pytest.raises(StorageError, match=r"record batch \d+ of 's3://.*' \(dataset 't', rows"):
        reader.take([3])
    assert reader.store.counters.refetches >= 2


def test_verify_checks_a_buckets_dataset(cat, s3):
    ds = stored(cat, s3, n=600)
    assert cat.verify("t").ok
    part = ds.reader.parts[0]
    key = f"pre/{part.path}"
    body = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    body[5000] ^= 0xFF  # inside a record batch's values
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(body))
    forget_parts(open_s3(f"{s3.uri}/pre"))
    report = cat.verify("t")
    assert not report.ok
    assert len(report.damaged) == 1
    assert report.damaged[0].path.startswith(f"{s3.uri}/pre/")
    assert "rows" in str(report)


# -- sources in object storage ---------------------------------------------------------------------
def test_sources_in_a_bucket_import_as_the_local_ones(cat, s3, image_folder, tmp_path):
    files = sorted(p for p in image_folder.rglob("*") if p.is_file())
    for p in files:
        s3.client.put_object(
            Bucket=s3.bucket,
            Key=f"imgs/{p.relative_to(image_folder).as_posix()}",
            Body=p.read_bytes(),
        )
    s3.client.put_object(Bucket=s3.bucket, Key="imgs/.hidden/x.jpg", Body=b"skipped")
    remote = cat.import_imagefolder("remote", f"{s3.uri}/imgs")
    local = cat.import_imagefolder("local", image_folder)
    assert (
        remote.take(list(range(60))).drop(["_id"]).equals(local.take(list(range(60))).drop(["_id"]))
    )
    assert cat.dataset("remote").class_names == local.class_names
    t = table(50)
    pq.write_table(t, buf := io.BytesIO())
    s3.client.put_object(Bucket=s3.bucket, Key="pq/a.parquet", Body=buf.getvalue())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, t.schema) as w:
        w.write_table(t)
    s3.client.put_object(Bucket=s3.bucket, Key="ipc/a.arrow", Body=sink.getvalue().to_pybytes())
    cat.sql(f"CREATE DATASET p FROM '{s3.uri}/pq' FORMAT parquet")
    cat.sql(f"CREATE DATASET a FROM '{s3.uri}/ipc/a.arrow'")  # the format from the extension
    for name in ("p", "a"):
        assert cat.dataset(name).take(list(range(50))).drop(["_id"]).equals(t)


# -- one line each naming the fix -----------------------------------------------------------------
def test_missing_credentials_name_the_variables(cat, s3, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    with pytest.raises(ImportFailedError, match=r"No S3 credentials .* set AWS_ACCESS_KEY_ID"):
        stored(cat, s3)


def test_a_bucket_that_does_not_exist_is_named(cat, s3):
    with pytest.raises(ImportFailedError, match=r"bucket 'tl-no-such-bucket' does not exist"):
        cat.import_arrow("t", table(), storage="s3://tl-no-such-bucket/p")


def test_a_prefix_without_the_dataset_names_where_it_looked(cat, s3, monkeypatch):
    stored(cat, s3)
    cat.close()
    monkeypatch.setenv(STORAGE_ENV, f"{s3.uri}/empty")
    with (
        catalog.open_catalog(cat.root) as again,
        pytest.raises(
            StorageError,
            match=r"Missing data file 's3://.*/empty/data/t/part-.*is s3://.*/empty where",
        ),
    ):
        again.dataset("t").take([0])
    with pytest.raises(ImportFailedError, match=r"No objects ending \.parquet/\.pq under s3://"):
        catalog.open_catalog(cat.root).sql(
            f"CREATE DATASET p FROM '{s3.uri}/nothing' FORMAT parquet"
        )


def test_a_read_only_bucket_refuses_the_import_before_it_starts(cat, s3):
    s3.proxy.faults = Faults(deny=frozenset({"PUT", "POST"}))
    with pytest.raises(ImportFailedError, match=r"access denied .* Grant them .*s3:PutObject"):
        stored(cat, s3)
    assert s3.proxy.stats.requests[f"PUT /{s3.bucket}/pre/data/t/"] == 0  # (only the probe)


def test_an_endpoint_that_does_not_answer(cat, s3, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    with pytest.raises(
        ImportFailedError, match=rf"did not answer after {ATTEMPTS} attempts .* AWS_ENDPOINT_URL"
    ):
        stored(cat, s3)


def test_the_configuration_comes_from_the_environment_and_profiles(tmp_path):
    (tmp_path / "credentials").write_text(
        "[default]\naws_access_key_id = d\naws_secret_access_key = ds\n"
        "[minio]\naws_access_key_id = m\naws_secret_access_key = ms\n"
    )
    (tmp_path / "config").write_text(
        "[profile minio]\nregion = eu-west-3\nendpoint_url = http://127.0.0.1:9000/\n"
    )
    files = {
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"),
        "AWS_CONFIG_FILE": str(tmp_path / "config"),
    }
    cfg = s3_config({**files, "AWS_PROFILE": "minio"})
    assert (cfg.access_key_id, cfg.secret_access_key) == ("m", "ms")
    assert (cfg.region, cfg.endpoint) == ("eu-west-3", "http://127.0.0.1:9000")
    default = s3_config(files)
    assert (default.access_key_id, default.region, default.endpoint) == ("d", "us-east-1", None)
    env = s3_config({**files, "AWS_ACCESS_KEY_ID": "e", "AWS_SECRET_ACCESS_KEY": "es"})
    assert env.access_key_id == "e"  # the environment's keys win over a profile's
    assert s3_config({"AWS_NO_SIGN_REQUEST": "true", "HOME": str(tmp_path)}).anonymous


def test_a_missing_part_fails_its_own_rows_only(cat, s3):
    data = table(100)
    stored(cat, s3, n=100)
    ds = cat.import_arrow("t", data, append=True)  # a second part, in the bucket too
    s3.client.delete_object(Bucket=s3.bucket, Key=f"pre/{ds.reader.parts[1].path}")
    values, errors = fresh_reader(ds).binary_values(np.arange(200), "blob")
    assert sorted(errors) == list(range(100, 200))
    assert "Missing data file 's3://" in str(errors[150])
    assert [bytes(v) for v in values[:100]] == data["blob"].to_pylist()


def test_a_load_that_waited_on_a_failed_fetch_fetches_the_batch_itself():
    """The read-ahead's fetch of a batch spent its tries while a decode's load waited for it:
    the decode's load fetches the batch once itself instead of taking that error as its own."""
    t = pa.table({"blob": pa.array([bytes([i % 251]) * 2000 for i in range(400)], pa.binary())})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, t.schema) as w:
        for b in t.to_batches(max_chunksize=50):  # 8 batches of 100 KB: the first not in the tail
            w.write_batch(b)
    data = sink.getvalue().to_pybytes()
    gate, failing = threading.Event(), [True]

    def read_ranges(ranges):
        if failing[0] and any(off < len(data) - TAIL_FETCH_BYTES for off, _ in ranges):
            failing[0] = False
            gate.wait(30)
            raise StorageError("Reading s3://b/p: answered 503 to 5 attempts")
        return [data[off : off + n] for off, n in ranges]

    file = PartFile(read_ranges, len(data), "part")
    errors: list[BaseException] = []

    def load() -> None:
        try:
            file.load([0])
        except BaseException as exc:
            errors.append(exc)

    first = threading.Thread(target=load)
    first.start()
    wait_for(lambda: 0 in file.inflight, timeout=30)
    second = threading.Thread(target=load)
    second.start()
    wait_for(lambda: file.inflight.get(0, [None, 0])[1] == 1, timeout=30)  # it waits
    gate.set()
    first.join(30)
    second.join(30)
    assert len(errors) == 1  # the first load's own fetch failed: its error
    assert "503" in str(errors[0])
    assert file.held(0)  # the second load fetched it and holds it
    file.release([0])
    assert not file.held(0)
