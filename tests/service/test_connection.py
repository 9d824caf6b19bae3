"""``tabloader.connect``: one type, the same answers with the catalog's service running or not."""

from __future__ import annotations

import errno
import io
import os
import shlex
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_read_only_catalog import unshare_works

import tabloader
from tabloader import catalog, cli
from tabloader.catalog._errors import (
    CatalogLockedError,
    DatasetInUseError,
    JobNotFoundError,
    StorageError,
    UnknownColumnError,
)
from tabloader.service._client import RemoteLoader
from tabloader.service._protocol import runtime_dir
from tests.support.service import TIMEOUT, start_service


def user_script(root, data) -> dict:
    """What a user would write, run as is with and without a service; its observations."""
    seen: dict = {}
    with tabloader.connect(root) as cat:
        seen["type"] = type(cat).__name__
        nums = pa.table({"x": list(range(20)), "name": [f"n{i}" for i in range(20)]})
        ds = cat.import_arrow("nums", nums)
        seen["imported"] = (type(ds).__name__, ds.name, ds.version, ds.num_rows, ds.schema)
        seen["parquet"] = cat.import_parquet("pq", data / "t.parquet").num_rows
        seen["ipc"] = cat.import_ipc("ipc", data / "t.arrow").columns
        seen["appended"] = cat.import_arrow("nums", nums.slice(0, 5), append=True).num_rows
        job = cat.sql("REGISTER JOB small SELECT x FROM nums WHERE x < 5")
        seen["small"] = (type(job).__name__, job.name, job.columns, sorted(job.ids))
        seen["small_ids"] = sorted(cat.job("small").ids)
        big = cat.register_job(
            "big", "nums", columns=["x"], where="x >= 15", options={"batch_size": 4}
        )
        seen["big"] = (big.dataset_version, big.predicate, big.options, sorted(big.ids))
        seen["big_options"] = cat.job("big").options
        weighted = cat.register_job("w", "nums", where="x < 3", options={"weight": "x + 0.5"})
        seen["weights"] = (weighted.weights.tolist(), cat.job("w").weights.tolist())
        cat.unregister_job("w")
        seen["take"] = cat.dataset("nums").take([24, 3, 1], ["name"]).to_pydict()
        seen["take_v1"] = cat.dataset("nums", version=1).num_rows
        seen["images"] = cat.dataset("imgs").take([0], ["label"]).to_pydict()
        seen["class_names"] = cat.dataset("imgs").class_names
        seen["jobs"] = [(j.name, j.num_rows) for j in cat.jobs()]
        seen["datasets"] = [(d.name, d.num_rows) for d in cat.datasets()]
        seen["select"] = cat.sql("SELECT sum(x) AS s FROM nums").to_pydict()
        seen["show"] = cat.sql("SHOW JOBS").column("name").to_pylist()
        seen["infos"] = [(i.name, i.columns, i.options, i.num_rows) for i in cat.job_infos()]
        seen["values"] = cat.column("nums", "x", rows=3, of=cat.dataset("nums")).to_pylist()
        with pytest.raises(JobNotFoundError) as missing:
            cat.job("smal")
        seen["missing"] = str(missing.value)
        with pytest.raises(UnknownColumnError) as column:
            cat.dataset("nums").take([0], ["nmae"])
        seen["column"] = str(column.value)
        cat.unregister_job("big")
        cat.drop_dataset("pq")
        seen["drop"] = cat.sql("DROP DATASET ipc")
        seen["after"] = (cat.job_names(), cat.dataset_names())
    return seen


@pytest.fixture
def empty(tmp_path, image_folder):
    """A catalog holding only ``imgs`` (a service reads a catalog; it creates none), and
    files to import."""
    root = tmp_path / "cat"
    with catalog.open_catalog(root, create=True) as cat:
        cat.import_imagefolder("imgs", image_folder)
    data = tmp_path / "data"
    data.mkdir()
    table = pa.table({"y": [1.5, 2.5, 3.5]})
    pq.write_table(table, data / "t.parquet")
    with pa.ipc.new_file(data / "t.arrow", table.schema) as writer:
        writer.write_table(table)
    return root, data


def test_the_same_script_gives_the_same_answers_with_and_without_a_service(tmp_path, empty):
    root, data = empty
    alone = user_script(root, data)
    with catalog.open_catalog(root) as cat:  # again from the start, for the service's run
        cat.drop_dataset("nums", cascade=True)
    proc = start_service(root)
    try:
        with tabloader.connect(root) as cat:
            assert cat.service_pid == proc.pid  # it did go through the service
        served = user_script(root, data)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)
    assert served == alone
    assert alone["type"] == "Connection"
    assert alone["imported"][0] == "Dataset"
    assert alone["small_ids"] == [0, 1, 2, 3, 4, 20, 21, 22, 23, 24]
    assert alone["weights"] == ([0.5, 1.5, 2.5] * 2, [0.5, 1.5, 2.5] * 2)  # ids 0-2, 20-22
    assert alone["take"] == {"_id": [24, 3, 1], "name": ["n4", "n3", "n1"]}
    assert alone["class_names"]["label"]  # the image folder's classes, by value
    assert "Did you mean 'small'" in alone["missing"]
    assert alone["after"] == (["small"], ["imgs", "nums"])
    assert alone["infos"] == [("big", ("x",), {"batch_size": 4}, 5), ("small", ("x",), {}, 10)]
    assert alone["values"] == [0, 1, 2]


@pytest.fixture
def served(empty):
    root, _ = empty
    with catalog.open_catalog(root) as cat:
        cat.sql("REGISTER JOB a SELECT label FROM imgs")
    proc = start_service(root)
    yield root, proc
    proc.send_signal(signal.SIGTERM)
    proc.wait(TIMEOUT)


def test_calls_that_need_the_catalog_itself_say_so_while_a_service_runs(served):
    root, proc = served
    with tabloader.connect(root) as cat:
        with pytest.raises(
            CatalogLockedError,
            match=rf"verify reads catalog .* service \(pid {proc.pid}\) holds it: stop the "
            rf"service \(`kill {proc.pid}`",
        ):
            cat.verify()
        with pytest.raises(CatalogLockedError, match=r"held by its loader service .*JobDataset"):
            cat.catalog  # noqa: B018
        # REGISTER through the service says, here, what it said in the service's log
        with pytest.warns(UserWarning, match=r"Job 'huge': a batch of 60 rows takes 720\.0 MiB"):
            cat.sql(
                "REGISTER JOB huge SELECT image FROM imgs WITH (batch_size=64, image_size=2048)"
            )
        with pytest.warns(UserWarning, match="a service started by default could not open"):
            cat.register_job("huge", "imgs", options={"image_size": 2048}, replace=True)
        loader = RemoteLoader(root, start=False)
        try:
            with loader.open("a", batch_size=4, epochs=1) as stream:
                assert stream.take() is not None  # the job reads imgs now
                for drop in (
                    lambda: cat.sql("DROP DATASET imgs CASCADE"),
                    lambda: cat.drop_dataset("imgs", cascade=True),
                ):
                    with pytest.raises(
                        DatasetInUseError,
                        match=rf"'imgs' is read by job\(s\) a open in the loader service "
                        rf"\(pid {proc.pid}\); drop it once they are closed",
                    ):
                        drop()
                assert stream.take() is not None  # and still does
        finally:
            loader.close()
        assert "imgs" in cat.dataset_names()


def test_without_a_service_the_catalog_is_opened_here(empty):
    root, _ = empty
    with tabloader.connect(root) as cat:
        assert cat.service_pid is None
        assert isinstance(cat.catalog, catalog.Catalog)
        assert cat.verify().ok
        with tabloader.Loader(cat.catalog, cache_bytes=1 << 20) as loader:
            cat.sql("REGISTER JOB a SELECT label FROM imgs WHERE label = 1")
            ids = [i for b in loader.open("a", batch_size=8, epochs=1) for i in b["_id"]]
        assert sorted(ids) == sorted(cat.job("a").ids)


BAD_ARGUMENTS = [
    ("tables", {}, r"Unknown catalog operation 'tables'; is the client another"),
    ("verify", {}, r"Unknown catalog operation 'verify'"),  # runs where the catalog is open
    ("job", {"name": 3}, r"needs a string 'name', got 3"),
    ("job", {"name": "j", "version": 1}, r"job takes no argument\(s\) 'version'"),
    ("dataset", {"name": "imgs", "version": "1"}, r"'version' has the wrong type: '1'"),
    ("register_job", {"name": "j", "dataset": "imgs", "replace": 1}, r"'replace' has the"),
    ("register_job", {"name": "j", "dataset": "imgs", "options": [1]}, r"'options' has"),
    ("drop_dataset", {"name": "imgs", "cascade": "yes"}, r"'cascade' has the wrong type"),
    ("column", {"name": "imgs", "column": "label", "rows": True}, r"'rows' has the wrong"),
    ("column", {"name": "imgs", "column": "label", "rows": 1, "of": {}}, r"'of' is not a"),
    ("import_source", {"name": "x", "source": {"path": 1}}, r"string 'source.path', got 1"),
]


def test_the_services_catalog_operations_refuse_bad_arguments(served):
    from tabloader.catalog._errors import ServiceError
    from tabloader.service._client import dial

    root, _ = served
    client = dial(root, start=False)
    try:
        for op, args, error in BAD_ARGUMENTS:
            with pytest.raises(ServiceError, match=error):
                client.call("catalog", call=op, args=args)
        with pytest.raises(ServiceError, match=r"'args' has the wrong type: \[\]"):
            client.call("catalog", call="job", args=[])
        names = client.call("catalog", call="dataset_names")["result"]
        assert names == ["imgs"]  # still connected
    finally:
        client.close()


HOLD = """
import sys, time
from tabloader import catalog
cat = catalog.open_catalog(sys.argv[1])
print("holding", flush=True)
time.sleep(1.0)
cat.close()
"""


@pytest.mark.parametrize("role", ["serve", "script"])
def test_a_statement_racing_a_holder_waits_for_it(empty, role, capsys):
    """A catalog held for a moment by another process (a service that stops: it closes its
    socket and lets its service lock go before DuckDB's; or a script) is waited for: the
    statement runs once the catalog is free (``tabloader.service._turns``)."""
    root, _ = empty
    argv = [sys.executable, "-c", HOLD, str(root), role]  # its command line says what it is
    with subprocess.Popen(argv, stdout=subprocess.PIPE) as proc:
        try:
            assert proc.stdout.readline() == b"holding\n"
            code = cli.main(["--catalog", str(root), "sql", "SHOW DATASETS"])  # held for 1 s
        finally:
            proc.wait(TIMEOUT)
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "imgs" in out.out


def test_every_kind_of_argument_and_result_has_its_codec():
    from tabloader.catalog._api import OPERATIONS, Arg, Wire
    from tabloader.service._catalog_ops import ARGS, RESULTS

    assert set(ARGS) == set(Arg)
    assert set(RESULTS) == set(Wire)
    assert {kind for op in OPERATIONS.values() for _, kind in op.args} <= set(ARGS)


class FullDisk(io.RawIOBase):
    """A file on a full disk: every write fails as the kernel's would (``ENOSPC``)."""

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_data_in_memory_goes_to_the_service_names_the_fix(served, monkeypatch):
    """``import_arrow`` of a table in memory is written to a file in the service's folder
    for the service to read: a full disk there is a ``StorageError`` naming the file and the
    fix, nothing is imported, and no part of the file is left."""
    import pyarrow

    root, proc = served
    real = pyarrow.OSFile
    monkeypatch.setattr(
        pyarrow, "OSFile", lambda path, mode="r": pyarrow.PythonFile(FullDisk(), mode="w")
    )
    with tabloader.connect(root) as cat:
        assert cat.service_pid == proc.pid
        with pytest.raises(StorageError) as info:
            cat.import_arrow("big", pa.table({"x": list(range(1000))}))
        monkeypatch.setattr(pyarrow, "OSFile", real)
        text = str(info.value)
        assert "No space left on device. Nothing was imported; the disk is full: free space" in text
        assert info.value.path.startswith(str(runtime_dir(root)))
        assert not list(runtime_dir(root).glob("import-*"))
        assert cat.dataset_names() == ["imgs"]  # and the service serves on


FULL_DISK = """
import sys
from pathlib import Path
import pyarrow as pa
import tabloader
from tabloader import catalog
from tabloader.catalog._errors import StorageError
from tabloader.service._client import RemoteLoader
from tabloader.service._protocol import runtime_dir
from tabloader.service._protocol import runtime_dir
root = sys.argv[1]
with catalog.open_catalog(root, create=True) as cat:
    cat.import_arrow("small", pa.table({"x": [1, 2, 3]}))
remote = RemoteLoader(root)  # starts the service, whose folder is in the catalog
with tabloader.connect(root) as cat:
    assert cat.service_pid == remote.service_pid
    try:
        cat.import_arrow("big", pa.table({"x": pa.array([b"x" * 1000] * 8000)}))
    except StorageError as exc:
        print(f"{type(exc).__name__}: {exc}")
    print(cat.dataset_names(), list(runtime_dir(Path(root).absolute()).glob("import-*")))
import os, signal
os.kill(remote.service_pid, signal.SIGTERM)
"""


@pytest.mark.skipif(not unshare_works(), reason="no unprivileged mount namespace (unshare -rm)")
def test_a_catalog_on_a_full_disk_imports_nothing_through_the_service(short_tmp):
    """The same on a real full disk: a 4 MB tmpfs, in a mount namespace of the script's own."""
    disk = short_tmp / "disk"
    disk.mkdir()
    mount = f"mount -t tmpfs -o size=4m tmpfs {shlex.quote(str(disk))}"
    script = shlex.join([sys.executable, "-c", FULL_DISK, str(disk / "cat")])
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"{mount} && {script}"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT * 2,
        env={**os.environ, "TABLOADER_IDLE_EXIT": "5"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    error, left = result.stdout.strip().splitlines()
    assert error.startswith("StorageError: Importing data held in memory through the loader")
    assert "No space left on device. Nothing was imported; the disk is full" in error
    assert left == "['small'] []"
