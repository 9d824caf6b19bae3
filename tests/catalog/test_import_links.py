"""Imports read only what they were given: symbolic links that lead out of the folder are refused.

Every importer that takes a path (image folders, Parquet and Arrow IPC folders and globs,
HuggingFace ``save_to_disk`` folders) refuses a link leading out of the imported folder,
naming the link and its target, unless ``WITH (follow_links = true)``. Links that stay inside
are followed. A refused import leaves nothing behind.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from catalog import ImportFailedError, StatementError
from catalog.importers import open_source

SECRET = b"\xff\xd8 not for publishing"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder beside the imported one, holding a file and a class-like folder."""
    out = tmp_path / "outside"
    (out / "private").mkdir(parents=True)
    (out / "secret.jpg").write_bytes(SECRET)
    (out / "private" / "p.jpg").write_bytes(SECRET)
    return out


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """An image folder root/<class>/<file> (the bytes need not be real images)."""
    root = tmp_path / "images"
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i in range(3):
            (root / cls / f"{i}.jpg").write_bytes(f"{cls}{i}".encode())
    return root


def _refused(cat, statement: str, link: Path, target: Path) -> None:
    """``statement`` fails naming ``link`` and ``target``, and leaves nothing behind."""
    message = (
        f"'{re.escape(str(link))}' is a symbolic link to '{re.escape(str(target))}', outside "
        r"the imported folder '.*'; imports read only what they were given\. Copy what it "
        r"points to into the folder, or follow links on purpose with WITH \(follow_links = "
        r"true\)"
    )
    with pytest.raises(ImportFailedError, match=message):
        cat.sql(statement)
    _nothing_left(cat)


def _nothing_left(cat) -> None:
    assert cat.dataset_names() == []
    data = Path(cat.root) / "data"
    assert not data.exists() or not any(data.rglob("*"))


def test_imagefolder_refuses_a_file_link_out(cat, folder, outside):
    link = folder / "cat" / "x.jpg"
    link.symlink_to(outside / "secret.jpg")
    _refused(cat, f"CREATE DATASET d FROM '{folder}'", link, outside / "secret.jpg")


def test_imagefolder_refuses_a_class_folder_link_out(cat, folder, outside):
    link = folder / "private"
    link.symlink_to(outside / "private")
    _refused(cat, f"CREATE DATASET d FROM '{folder}' FORMAT imagefolder", link, outside / "private")


def test_imagefolder_refuses_a_nested_folder_link_out(cat, folder, outside):
    link = folder / "dog" / "more"
    link.symlink_to(outside)
    _refused(cat, f"CREATE DATASET d FROM '{folder}'", link, outside)


def test_imagefolder_follows_links_inside(cat, folder):
    (folder / "cat" / "again.jpg").symlink_to(folder / "dog" / "0.jpg")
    (folder / "kitten").symlink_to("cat")  # a relative link to a sibling class folder
    ds = cat.sql(f"CREATE DATASET d FROM '{folder}'")
    rows = ds.take(list(range(ds.num_rows))).to_pydict()
    by_path = dict(zip(rows["path"], rows["image"], strict=True))
    assert by_path["cat/again.jpg"] == b"dog0"
    assert by_path["kitten/again.jpg"] == b"dog0"
    assert by_path["kitten/1.jpg"] == b"cat1"
    assert sorted(set(rows["label_name"])) == ["cat", "dog", "kitten"]


def test_imagefolder_refuses_a_link_loop(cat, folder):
    link = folder / "cat" / "loop"
    link.symlink_to(folder)
    with pytest.raises(
        ImportFailedError,
        match=f"'{re.escape(str(link))}' is a symbolic link to '.*images', a folder that "
        "contains it, so the folder would be listed endlessly; remove the link",
    ):
        cat.sql(f"CREATE DATASET d FROM '{folder}'")
    _nothing_left(cat)


def test_imagefolder_follows_links_out_when_asked(cat, folder, outside):
    (folder / "cat" / "x.jpg").symlink_to(outside / "secret.jpg")
    (folder / "private").symlink_to(outside / "private")
    ds = cat.sql(f"CREATE DATASET d FROM '{folder}' FORMAT imagefolder WITH (follow_links = true)")
    rows = ds.take(list(range(ds.num_rows))).to_pydict()
    by_path = dict(zip(rows["path"], rows["image"], strict=True))
    assert by_path["cat/x.jpg"] == SECRET
    assert by_path["private/p.jpg"] == SECRET
    assert ds.num_rows == 8


def test_imagefolder_python_api_takes_follow_links(cat, folder, outside):
    (folder / "cat" / "x.jpg").symlink_to(outside / "secret.jpg")
    with pytest.raises(ImportFailedError, match="outside the imported folder"):
        cat.import_imagefolder("d", folder)
    _nothing_left(cat)
    assert cat.import_imagefolder("d", folder, follow_links=True).num_rows == 7


def test_a_file_swapped_for_a_link_during_the_import_is_refused(cat, folder, outside):
    source = open_source("imagefolder", folder, batch_size=2)  # listed: no link yet
    victim = folder / "dog" / "2.jpg"
    victim.unlink()
    victim.symlink_to(outside / "secret.jpg")
    with pytest.raises(ImportFailedError, match=f"'{re.escape(str(victim))}' is a symbolic"):
        cat.import_source("d", source)  # two batches are written before the refusal
    _nothing_left(cat)


def _parquet(path: Path, value: int) -> None:
    pq.write_table(pa.table({"x": [value]}), path)


def test_parquet_glob_refuses_a_match_that_links_out(cat, tmp_path, outside):
    data = tmp_path / "data"
    data.mkdir()
    _parquet(data / "a.parquet", 1)
    _parquet(outside / "b.parquet", 2)
    (data / "b.parquet").symlink_to(outside / "b.parquet")
    _refused(
        cat, f"CREATE DATASET p FROM '{data}/*.parquet'", data / "b.parquet", outside / "b.parquet"
    )
    ds = cat.sql(f"CREATE DATASET p FROM '{data}/*.parquet' WITH (follow_links = true)")
    assert ds.num_rows == 2


def test_glob_through_a_folder_link_out_is_refused(cat, tmp_path, outside):
    data = tmp_path / "data"
    (data / "in").mkdir(parents=True)
    _parquet(data / "in" / "a.parquet", 1)
    _parquet(outside / "private" / "a.parquet", 2)
    (data / "out").symlink_to(outside / "private")
    _refused(cat, f"CREATE DATASET p FROM '{data}/*/a.parquet'", data / "out", outside / "private")


def test_directory_of_files_refuses_a_link_out_and_follows_one_inside(cat, tmp_path, outside):
    data = tmp_path / "data"
    data.mkdir()
    feather.write_feather(pa.table({"x": [1]}), data / "a.arrow")
    feather.write_feather(pa.table({"x": [2]}), outside / "b.arrow")
    (data / "c.arrow").symlink_to(data / "a.arrow")
    assert cat.import_ipc("inside", data).num_rows == 2
    cat.drop_dataset("inside")
    (data / "b.arrow").symlink_to(outside / "b.arrow")
    _refused(
        cat, f"CREATE DATASET f FROM '{data}' FORMAT arrow", data / "b.arrow", outside / "b.arrow"
    )
    with pytest.raises(ImportFailedError, match="outside the imported folder"):
        cat.import_parquet("p", f"{data}/*.arrow")
    assert cat.import_ipc("f", data, follow_links=True).num_rows == 3


def test_a_single_file_given_by_name_may_be_a_link(cat, tmp_path, outside):
    _parquet(outside / "b.parquet", 2)
    (tmp_path / "b.parquet").symlink_to(outside / "b.parquet")
    assert cat.sql(f"CREATE DATASET p FROM '{tmp_path / 'b.parquet'}'").num_rows == 1


def test_hf_folder_refuses_a_data_file_link_out(cat, tmp_path, outside):
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "hf"
    datasets.Dataset.from_dict({"x": [1, 2, 3]}).save_to_disk(str(saved))
    (data,) = saved.glob("data-*.arrow")
    os.replace(data, outside / data.name)
    data.symlink_to(outside / data.name)
    _refused(cat, f"CREATE DATASET h FROM '{saved}' FORMAT hf", data, outside / data.name)
    ds = cat.sql(f"CREATE DATASET h FROM '{saved}' FORMAT hf WITH (follow_links = true)")
    assert ds.num_rows == 3


def test_hf_folder_refuses_a_data_file_named_outside(cat, tmp_path, outside):
    import json

    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "hf"
    datasets.Dataset.from_dict({"x": [1, 2, 3]}).save_to_disk(str(saved))
    (data,) = saved.glob("data-*.arrow")
    os.replace(data, outside / data.name)
    state = json.loads((saved / "state.json").read_text())
    state["_data_files"] = [{"filename": f"../outside/{data.name}"}]
    (saved / "state.json").write_text(json.dumps(state))
    with pytest.raises(
        ImportFailedError,
        match=f"names the data file '.*{re.escape(data.name)}', outside the folder; imports "
        "read only what they were given",
    ):
        cat.import_hf("h", saved)
    _nothing_left(cat)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("follow_links = 1", r"Option follow_links must be TRUE or FALSE, not 1\."),
        ("nope = true", r"Unknown option 'nope' for an import of FORMAT imagefolder; use "),
        ("split = 'train'", r"Unknown option 'split' for an import of FORMAT imagefolder"),
        ("follow_links", r"Expected key = value in WITH"),
        ("split = 1", r"Option split must be a 'string', not 1\."),
    ],
)
def test_import_option_errors(cat, folder, options, message):
    fmt = "hf" if options.startswith("split = 1") else "imagefolder"
    with pytest.raises(StatementError, match=message):
        cat.sql(f"CREATE DATASET d FROM '{folder}' FORMAT {fmt} WITH ({options})")
    _nothing_left(cat)


def test_imagefolder_ignores_links_it_would_not_read(cat, folder, outside):
    (outside / "notes.txt").write_text("not an image")
    (folder / "notes.txt").symlink_to(outside / "notes.txt")
    (folder / "cat" / "notes.txt").symlink_to(outside / "notes.txt")
    assert cat.sql(f"CREATE DATASET d FROM '{folder}'").num_rows == 6
