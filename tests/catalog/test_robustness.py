"""No raw tracebacks, no hangs: damaged catalogs, odd import paths, broken job bitmaps."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pyarrow as pa
import pytest

from tabloader import catalog
from tabloader.catalog import CatalogError, ImportFailedError, StorageError


def make_catalog(root):
    with catalog.open_catalog(root) as c:
        c.import_arrow("t", pa.table({"x": list(range(100_000))}))
        c.sql("REGISTER JOB a SELECT x FROM t WHERE x < 10")
        c.sql("REGISTER JOB b SELECT x FROM t WHERE x >= 99990")


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text
    return text


def test_a_truncated_catalog_is_one_line_naming_the_fix(tmp_path):
    root = tmp_path / "cat"
    make_catalog(root)
    db = root / "catalog.duckdb"
    with open(db, "r+b") as f:
        f.truncate(db.stat().st_size // 2)
    with pytest.raises(CatalogError) as info:
        catalog.open_catalog(root)
    text = one_line(info.value)
    assert f"Opening catalog '{db}' failed in DuckDB" in text
    assert "damaged or is not a DuckDB database: restore it from a backup" in text
    proc = subprocess.run(
        [sys.executable, "-m", "tabloader", "--catalog", str(root), "sql", "SHOW DATASETS"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("CatalogError: Opening catalog")
    assert len(proc.stderr.strip().splitlines()) == 1


def run_briefly(fn):
    """Run ``fn`` in a thread; fail (instead of hanging) if it blocks."""
    outcome: list[BaseException | None] = []

    def target():
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(60)
    assert outcome, "the import blocked"
    return outcome[0]


@pytest.fixture
def cat(tmp_path):
    with catalog.open_catalog(tmp_path / "cat", create=True) as c:
        yield c


def test_a_glob_matching_directories_is_refused(cat, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.arrow").write_bytes(b"x")
    with pytest.raises(ImportFailedError) as info:
        cat.sql(f"CREATE DATASET e FROM '{src}/*'")
    assert one_line(info.value).startswith(f"'{src / 'sub'}' is a directory, not a regular file;")
    with pytest.raises(ImportFailedError, match="is a directory, not a regular file"):
        cat.sql("CREATE DATASET e FROM '/etc/*'")
    assert cat.dataset_names() == []
    assert not (cat.root / "data" / "e").exists()


def fifo(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def test_a_fifo_named_jpg_does_not_block_an_image_import(cat, tmp_path, image_folder):
    folder = tmp_path / "imgs"
    shutil.copytree(image_folder, folder)
    pipe = fifo(next(p for p in folder.iterdir() if p.is_dir()) / "zzz.jpg")
    exc = run_briefly(lambda: cat.import_imagefolder("imgs", folder))
    assert isinstance(exc, ImportFailedError)
    assert one_line(exc).startswith(f"'{pipe}' is a FIFO (named pipe), not a regular file;")
    assert cat.dataset_names() == []
    assert not (cat.root / "data" / "imgs").exists()


@pytest.mark.parametrize("statement", ["FROM '{p}' FORMAT arrow", "FROM '{p}'"])
def test_format_arrow_on_a_fifo_does_not_block(cat, tmp_path, statement):
    pipe = fifo(tmp_path / "p.arrow")
    exc = run_briefly(lambda: cat.sql(f"CREATE DATASET f {statement.format(p=pipe)}"))
    assert isinstance(exc, ImportFailedError)
    assert "is a FIFO (named pipe), not a regular file" in one_line(exc)


def test_a_sparse_giant_image_is_refused(cat, tmp_path, image_folder):
    folder = tmp_path / "imgs"
    shutil.copytree(image_folder, folder)
    giant = next(p for p in folder.iterdir() if p.is_dir()) / "giant.jpg"
    with open(giant, "wb") as f:
        f.truncate(50 << 30)  # 50 GB, no block written
    with pytest.raises(ImportFailedError) as info:
        cat.import_imagefolder("imgs", folder)
    assert one_line(info.value) == (
        f"'{giant}' is 50.0 GiB, over the limit of 1.0 GiB for one file read whole (an image); "
        "remove it from the folder, or import it another way."
    )


def swap_bitmap(root, job, other):
    (file,) = (root / "jobs").glob(f"{job}-*.roaring")
    (source,) = (root / "jobs").glob(f"{other}-*.roaring")
    file.write_bytes(source.read_bytes())
    return file


def test_a_swapped_bitmap_is_rebuilt_and_affects_only_its_job(tmp_path):
    root = tmp_path / "cat"
    make_catalog(root)
    file = swap_bitmap(root, "a", "b")  # a valid bitmap, but b's
    with catalog.open_catalog(root) as c:
        assert c.sql("SHOW DATASETS").column("jobs").to_pylist() == [2]
        assert c.sql("SHOW JOBS").column("rows").to_pylist() == [10, 10]
        assert sorted(c.job("a").ids) == list(range(10))  # rebuilt from its predicate
        assert sorted(c.job("b").ids) == list(range(99990, 100000))
    assert file.read_bytes() != next((root / "jobs").glob("b-*.roaring")).read_bytes()


def test_an_unrebuildable_bitmap_fails_only_its_job(tmp_path):
    root = tmp_path / "cat"
    make_catalog(root)
    with catalog.open_catalog(root) as c:
        c.connection.execute("UPDATE _tabloader.jobs SET num_ids = 11 WHERE name = 'a'")
    swap_bitmap(root, "a", "b")
    with catalog.open_catalog(root) as c:
        assert c.sql("SHOW DATASETS").column("jobs").to_pylist() == [2]
        assert c.sql("SHOW JOBS").column("name").to_pylist() == ["a", "b"]
        assert c.job("b").num_rows == 10
        with pytest.raises(StorageError) as info:
            c.job("a")
        text = one_line(info.value)
        assert "The row ids of job 'a' are lost: its file" in text
        assert "does not hold the job's ids" in text
        assert "its predicate selects 10 rows of 't' version 1, not the stored 11" in text
        assert text.endswith("REGISTER OR REPLACE JOB a ...")


def test_empty_dataset_folders_are_removed_at_open(tmp_path):
    root = tmp_path / "cat"
    make_catalog(root)
    (root / "data" / "killed").mkdir()  # what a killed import leaves
    (root / "data" / "keep").mkdir()
    (root / "data" / "keep" / "notes.txt").write_text("not tabloader's")
    with catalog.open_catalog(root) as c:
        assert sorted(p.name for p in (root / "data").iterdir()) == ["keep", "t"]
        assert c.dataset("t").num_rows == 100_000


@pytest.mark.parametrize("where", ["absolute", "escaping"])
def test_a_part_path_outside_the_storage_is_refused_as_damage(tmp_path, where):
    """A part path in catalog.duckdb that is absolute or climbs out with ``..`` names a file
    anywhere (here a faithful copy of the part, which would read fine): refused, never read."""
    root = tmp_path / "cat"
    with catalog.open_catalog(root, create=True) as c:
        c.import_arrow("t", pa.table({"x": list(range(100))}))
        (part,) = c.dataset("t").reader.parts
    elsewhere = tmp_path / "elsewhere" / "data" / "t"
    elsewhere.mkdir(parents=True)
    shutil.copy(root / part.path, elsewhere)
    name = os.path.basename(part.path)
    forged = str(elsewhere / name) if where == "absolute" else f"../elsewhere/data/t/{name}"
    with catalog.open_catalog(root) as c:
        c.connection.execute("UPDATE _tabloader.parts SET path = ?", [forged])
    with catalog.open_catalog(root) as c:
        with pytest.raises(StorageError) as info:
            c.dataset("t").take([0])
        text = one_line(info.value)
        assert text.startswith(f"The catalog is damaged: it records part '{forged}' (rows 0..99)")
        assert f"which is {where if where == 'absolute' else 'outside the storage root'}" in text
        assert text.endswith("re-import the dataset (DROP DATASET, then CREATE DATASET).")
        assert info.value.path == forged
