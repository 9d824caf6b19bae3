"""Files the catalog recorded are verified before they are read: never through a link, never a
FIFO or a device, of the size recorded (or a sane cap); a bad job bitmap is rebuilt with one
warning, a bad data file refused with one line."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time

import pyarrow as pa
import pytest

from tabloader import catalog
from tabloader.catalog import StorageError
from tabloader.catalog._directory import open_file, read_file
from tabloader.catalog._job_bitmaps import max_bitmap_bytes


def make_catalog(root):
    with catalog.open_catalog(root, create=True) as c:
        c.import_arrow("t", pa.table({"x": list(range(1000))}))
        c.sql("REGISTER JOB a SELECT x FROM t WHERE x < 10")
        c.sql("REGISTER JOB b SELECT x FROM t WHERE x >= 990")


def bounded(fn, seconds=30):
    """``fn()`` in a thread: fail, instead of hanging, if it blocks (a FIFO read) or reads
    for ever (``/dev/zero``)."""
    out: list = []

    def target():
        try:
            out.append(("ok", fn()))
        except BaseException as exc:
            out.append(("error", exc))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"blocked for {seconds} s"
    kind, value = out[0]
    if kind == "error":
        raise value
    return value


def replace_with(path, kind):
    """Put a link to /dev/zero, a FIFO or an oversize regular file where ``path`` was."""
    path.unlink()
    if kind == "link":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(b"\0" * (1 << 20))


PROBLEMS = {
    "link": "is a symbolic link (to '/dev/zero'); catalog files are never read through links",
    "fifo": "is a FIFO, not a regular file",
    "large": "has 1048576 bytes, more than the ",
}


@pytest.mark.parametrize("kind", ["link", "fifo", "large"])
def test_a_bitmap_replaced_by_a_link_a_fifo_or_a_giant_is_rebuilt(tmp_path, caplog, kind):
    root = tmp_path / "cat"
    make_catalog(root)
    (file,) = (root / "jobs").glob("a-*.roaring")
    replace_with(file, kind)
    caplog.set_level(logging.WARNING, logger="tabloader.catalog._job_bitmaps")
    with catalog.open_catalog(root) as c:
        ids = bounded(lambda: c.job("a").ids)
        assert sorted(ids) == list(range(10))
        assert sorted(c.job("b").ids) == list(range(990, 1000))
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"job 'a': rebuilding its row ids (its file {file} {PROBLEMS[kind]}")
    assert not file.is_symlink()
    assert file.stat().st_size < 100  # rewritten as the job's bitmap


def test_a_bitmap_link_that_cannot_be_rebuilt_is_one_line(tmp_path, caplog):
    root = tmp_path / "cat"
    make_catalog(root)
    with catalog.open_catalog(root) as c:
        c.connection.execute("UPDATE _tabloader.jobs SET num_ids = 11 WHERE name = 'a'")
    (file,) = (root / "jobs").glob("a-*.roaring")
    replace_with(file, "link")
    with catalog.open_catalog(root) as c, pytest.raises(StorageError) as info:
        bounded(lambda: c.job("a"))
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"The row ids of job 'a' are lost: its file {file} is a symbolic link")
    assert text.endswith("REGISTER OR REPLACE JOB a ...")


@pytest.mark.parametrize("kind", ["link", "fifo", "copy"])
def test_a_data_file_replaced_by_a_link_or_a_fifo_is_refused(tmp_path, kind):
    root = tmp_path / "cat"
    make_catalog(root)
    with catalog.open_catalog(root) as c:
        [part] = c.dataset("t").files
    if kind == "copy":  # a link to an identical copy: still a link
        shutil.copy(part, tmp_path / "copy.arrow")
        part.unlink()
        part.symlink_to(tmp_path / "copy.arrow")
    else:
        replace_with(part, kind)
    problem = "is a symbolic link" if kind != "fifo" else "is a FIFO, not a regular file"
    with catalog.open_catalog(root) as c:
        for memory_map in (True, False):
            reader = c.dataset("t").reader
            reader.memory_map = memory_map
            with pytest.raises(StorageError, match=f"{problem}.*Restore the file or re-import"):
                bounded(reader.open_all)
        report = bounded(c.verify)
    assert not report.ok
    assert problem in str(report)


def test_open_file_checks_type_and_size(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"12345")
    assert read_file(path, what="F", size=5) == b"12345"
    assert read_file(path, what="F", max_bytes=5) == b"12345"
    with pytest.raises(StorageError, match=r"^F has 5 bytes, expected 4 \(truncated or replaced"):
        open_file(path, what="F", size=4)
    with pytest.raises(StorageError, match=r"^F has 5 bytes, more than the 4 it can hold\.$"):
        read_file(path, what="F", max_bytes=4)
    with pytest.raises(StorageError, match=r"^F is a directory, not a regular file\.$"):
        open_file(tmp_path, what="F")
    with pytest.raises(StorageError, match=r"^F is a character device, not a regular file"):
        open_file(__import__("pathlib").Path("/dev/null"), what="F")
    with pytest.raises(FileNotFoundError):
        open_file(tmp_path / "missing", what="F")
    started = time.monotonic()
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(StorageError, match=r"^F is a FIFO"):
        bounded(lambda: read_file(tmp_path / "fifo", what="F"), 10)
    assert time.monotonic() - started < 10


def test_the_bitmap_cap_holds_every_bitmap():
    """``max_bitmap_bytes`` is an upper bound on the serialized size of any bitmap (dense,
    sparse, runs, past 2^16 containers) of that many ids, with and without run_optimize."""
    from pyroaring import BitMap

    cases = [
        BitMap(range(0, 1 << 20, 2)),
        BitMap(range(0, 1 << 20, 17)),
        BitMap(range(100_000)),
        BitMap(range(0, 1 << 22, 1 << 16)),
        BitMap([5]),
    ]
    for ids in cases:
        top = ids.max() + 1
        assert len(ids.serialize()) <= max_bitmap_bytes(len(ids), top)
        ids.run_optimize()
        assert len(ids.serialize()) <= max_bitmap_bytes(len(ids), top)


def test_what_tabloader_creates_in_a_catalog_is_private_whatever_the_umask(tmp_path):
    """Folders 0700 and files 0600 (the DuckDB file, data files, bitmaps), as ``.service``,
    even under umask 0; modes of what exists are left alone."""
    old = os.umask(0)
    try:
        root = tmp_path / "cat"
        make_catalog(root)
        shared = tmp_path / "shared"
        shared.mkdir(0o755)  # a catalog directory the user made: its mode stays
        with catalog.open_catalog(shared, create=True) as c:
            c.import_arrow("t", pa.table({"x": [1, 2]}))
    finally:
        os.umask(old)
    modes = {p.relative_to(root).as_posix(): p.stat().st_mode & 0o777 for p in root.rglob("*")}
    assert modes.pop("catalog.duckdb") == 0o600
    for path, mode in modes.items():
        expected = 0o700 if (root / path).is_dir() else 0o600
        assert mode == expected, f"{path}: {oct(mode)}"
    assert {p.split("/")[0] for p in modes} >= {"data", "jobs"}
    assert root.stat().st_mode & 0o777 == 0o700
    assert shared.stat().st_mode & 0o777 == 0o755
    assert (shared / "catalog.duckdb").stat().st_mode & 0o777 == 0o600
