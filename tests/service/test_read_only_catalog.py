"""A catalog this process may not write (a read-only disk, another user's catalog) opens
read-only: SHOW, SELECT, DESCRIBE, verify and in-process loading work and change nothing;
every write fails with "read-only", the reason and the fix, never as damage.

Tests run as root, whom file modes do not stop, and no read-only mount is at hand: the two
places where the catalog learns it may not write are simulated instead: ``os.access`` (and
``os.statvfs``'s read-only flag) for the check before DuckDB opens, and DuckDB's own refusal
to open the file for writing (its error text, as a read-only disk or a mode gives it). A
snapshot of the directory proves nothing was written."""

from __future__ import annotations

import os
import types

import duckdb
import pyarrow as pa
import pytest

from tabloader import catalog, cli
from tabloader.catalog import CatalogError
from tabloader.engine import Loader

HOW = {
    "access-erofs": "is on a read-only file system",
    "access-eacces": "this user may not write '",
    "duckdb-erofs": "is on a read-only file system (Read-only file system)",
    "duckdb-eacces": "may not be written by this user (Permission denied)",
}


@pytest.fixture
def root(tmp_path):
    path = tmp_path / "cat"
    with catalog.open_catalog(path, create=True) as c:
        c.import_arrow("t", pa.table({"x": list(range(100)), "y": [i % 7 for i in range(100)]}))
        c.sql("REGISTER JOB a SELECT x, y FROM t WHERE x < 50")
    return path


def read_only(monkeypatch, root, how):
    """Make ``root`` unwritable the way ``how`` says (see the module docstring)."""
    inside = str(root)
    if how.startswith("access"):
        access, statvfs = os.access, os.statvfs

        def fake_access(path, mode, *args, **kwargs):
            if mode & os.W_OK and os.fspath(path).startswith(inside):
                return False
            return access(path, mode, *args, **kwargs)

        def fake_statvfs(path):
            if how == "access-erofs" and os.fspath(path).startswith(inside):
                return types.SimpleNamespace(f_flag=os.ST_RDONLY)
            return statvfs(path)

        monkeypatch.setattr(os, "access", fake_access)
        monkeypatch.setattr(os, "statvfs", fake_statvfs)
    else:
        connect = duckdb.connect
        text = "Read-only file system" if how == "duckdb-erofs" else "Permission denied"

        def fake_connect(database, *args, read_only=False, **kwargs):
            if not read_only and str(database).startswith(inside):
                raise duckdb.IOException(f'IO Error: Cannot open file "{database}": {text}')
            return connect(database, *args, read_only=read_only, **kwargs)

        monkeypatch.setattr(duckdb, "connect", fake_connect)


def snapshot(root):
    return {
        (p.relative_to(root).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if ".service" not in p.parts
    }


@pytest.mark.parametrize("how", list(HOW))
def test_a_read_only_catalog_serves_reads_and_refuses_writes(root, monkeypatch, how):
    before = snapshot(root)
    read_only(monkeypatch, root, how)
    with catalog.open_catalog(root) as c:
        assert c.sql("SHOW DATASETS").column("name").to_pylist() == ["t"]
        assert c.sql("SHOW JOBS").column("name").to_pylist() == ["a"]
        assert c.sql("SELECT count(*) AS n FROM t WHERE y = 3").column("n").to_pylist() == [14]
        assert "y" in c.sql("DESCRIBE t").column("column").to_pylist()
        assert c.verify().ok
        with Loader(c, cache_bytes=1 << 20, workers=1) as loader:
            ids = [i for b in loader.open("a", batch_size=8, epochs=1) for i in b["_id"].tolist()]
        assert sorted(ids) == list(range(50))
        writes = {
            "REGISTER JOB b": lambda: c.sql("REGISTER JOB b SELECT x FROM t"),
            "UNREGISTER JOB a": lambda: c.sql("UNREGISTER JOB a"),
            "DROP DATASET t": lambda: c.sql("DROP DATASET t CASCADE"),
            "Import of 'u'": lambda: c.import_arrow("u", pa.table({"x": [1]})),
        }
        for what, write in writes.items():
            with pytest.raises(CatalogError) as info:
                write()
            text = str(info.value)
            assert text.startswith(f"{what} failed: catalog '{root}' is read-only: "), text
            assert HOW[how] in text
            assert "copy the catalog directory to a place you can write" in text
            assert "damaged" not in text
    assert snapshot(root) == before


def test_the_cli_reads_a_read_only_catalog_and_says_why_it_cannot_write(root, monkeypatch, capsys):
    read_only(monkeypatch, root, "duckdb-erofs")
    base = ["--catalog", str(root)]
    assert cli.main([*base, "sql", "SHOW DATASETS"]) == 0
    assert cli.main([*base, "verify"]) == 0
    capsys.readouterr()
    assert cli.main([*base, "sql", "REGISTER JOB b SELECT x FROM t"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"CatalogError: REGISTER JOB b failed: catalog '{root}' is read-only")
    assert len(err.strip().splitlines()) == 1


def test_a_damaged_catalog_is_still_damaged(tmp_path):
    """Only "may not write" errors open read-only; anything else stays the damage it is."""
    root = tmp_path / "cat"
    root.mkdir()
    (root / "catalog.duckdb").write_bytes(b"not a database" * 100)
    with pytest.raises(CatalogError, match="damaged or is not a DuckDB database"):
        catalog.open_catalog(root)


def test_a_catalog_this_user_may_not_even_read_says_so(root, monkeypatch):
    """Another user's private catalog (0600 files): not readable, not "damaged"."""

    def refuse(database, *args, **kwargs):
        raise duckdb.IOException(f'IO Error: Cannot open file "{database}": Permission denied')

    monkeypatch.setattr(duckdb, "connect", refuse)
    with pytest.raises(CatalogError) as info:
        catalog.open_catalog(root)
    assert str(info.value) == (
        f"Opening catalog '{root / 'catalog.duckdb'}' failed: this user may not read it "
        f"(Permission denied). Its owner can share it (chmod -R g+rX {root}, for the group), "
        "or use a catalog of your own."
    )
