"""A catalog this process may not write (a read-only disk, another user's catalog) opens
read-only: SHOW, SELECT, DESCRIBE, verify and in-process loading work and change nothing;
every write fails with "read-only", the reason and the fix, never as damage.

Tests run as root, whom file modes do not stop, and no read-only mount is at hand: the two
places where the catalog learns it may not write are simulated instead: ``os.access`` (and
``os.statvfs``'s read-only flag) for the check before DuckDB opens, and DuckDB's own refusal
to open the file for writing (its error text, as a read-only disk or a mode gives it). A
snapshot of the directory proves nothing was written."""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import subprocess
import sys
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


def no_folders_in(monkeypatch, root):
    """Also refuse to make folders in ``root`` (a read-only disk refuses every write)."""
    mkdir = os.mkdir

    def fake_mkdir(path, *args, **kwargs):
        if os.fspath(path).startswith(str(root)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", fake_mkdir)


@pytest.fixture
def short_root(root, short_tmp):
    """``root`` at a short path, as the default catalog's: its service's folder would be in it
    (``.service``), not in /tmp (where a long path's goes)."""
    return shutil.copytree(root, short_tmp / "cat")


def test_status_of_a_read_only_catalog_reports_no_service_and_creates_nothing(
    short_root, monkeypatch, capsys
):
    root = short_root
    before = snapshot(root)
    read_only(monkeypatch, root, "access-erofs")
    no_folders_in(monkeypatch, root)
    assert cli.main(["--catalog", str(root), "status"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith(f"No loader service runs for catalog {root}"), out.err
    assert snapshot(root) == before
    assert not (root / ".service").exists()


def test_a_service_directory_that_cannot_be_made_says_how_to_fix_it(short_tmp, monkeypatch):
    from tabloader.catalog._errors import ServiceError
    from tabloader.service._protocol import runtime_dir

    root = short_tmp / "cat"  # short: its .service, not the /tmp fallback
    root.mkdir()
    no_folders_in(monkeypatch, root)  # a catalog this user may write, on a disk gone full/RO
    with pytest.raises(
        ServiceError,
        match=r"cannot create the service directory .*\.service: Read-only file system\. The "
        r"loader service keeps its socket there .*: make .* writable for this user",
    ):
        runtime_dir(root)


READ_ONLY_JOB = """
import sys
from tabloader.service._client import RemoteLoader
with RemoteLoader(sys.argv[1]) as remote, remote.open("a", batch_size=8, epochs=1) as s:
    ids = sorted(i for b in s for i in b["_id"].tolist())
print(len(ids), remote.service_pid, flush=True)
import os, signal
os.kill(remote.service_pid, signal.SIGTERM)
"""


def unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not unshare_works(), reason="no unprivileged mount namespace (unshare -rm)")
def test_a_job_reads_a_catalog_on_a_read_only_mount_through_a_service(short_root):
    """A real read-only mount (a bind mount in a mount namespace of the script's own): the
    service's folder goes to /tmp, the job reads its rows, and the catalog is unchanged."""
    root = short_root
    before = snapshot(root)
    mount = f"mount --bind -o ro {shlex.quote(str(root))} {shlex.quote(str(root))}"
    script = shlex.join([sys.executable, "-c", READ_ONLY_JOB, str(root)])
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"{mount} && {script}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TABLOADER_IDLE_EXIT": "5"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split()[0] == "50"  # x < 50
    assert snapshot(root) == before
    assert not (root / ".service").exists()
