"""Imports read only what they were given: symbolic links that lead out of the folder are refused.

Every importer that takes a path (image folders, Parquet and Arrow IPC folders and globs,
HuggingFace ``save_to_disk`` folders) refuses a link leading out of the imported folder,
naming the link and its target, unless ``WITH (follow_links = true)``. Links that stay inside
are followed. HuggingFace image columns that store only a path are held to the same rule (an
in-memory dataset: relative paths inside the current directory). A refused import leaves
nothing behind.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from tabloader.catalog import ImportFailedError, StatementError
from tabloader.catalog._importers import open_source

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


# HuggingFace image columns that store only a path: the path must lead inside the folder
# (save_to_disk) or, for an in-memory dataset, be relative and stay in the current directory.

HF_FOLDER_FIX = (
    r"imports read only what they were given\. Embed the image bytes in the dataset or copy the "
    r"file into the folder, or read it on purpose with WITH \(follow_links = true\)"
)
HF_MEMORY_FIX = (
    r"imports of an in-memory dataset read only relative paths inside the current directory\. "
    r"Embed the image bytes in the dataset .*, or read such paths on purpose with "
    r"follow_links=True\.$"
)


def _image_paths(paths: list[str | None]):
    """An in-memory dataset whose Image column stores only paths (``{"bytes": None, ...}``)."""
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_dict(
        {
            "n": list(range(len(paths))),
            "image": [None if p is None else {"bytes": None, "path": p} for p in paths],
        },
        features=datasets.Features({"n": datasets.Value("int64"), "image": datasets.Image()}),
    )


def _hostile_folder(saved: Path, paths: list[str | None]) -> Path:
    """A save_to_disk folder whose Image column stores only ``paths``.

    ``save_to_disk`` embeds the bytes of image files, so the folder is written with a plain
    ``struct<bytes, path>`` column and its features are then relabelled ``Image``.
    """
    import json

    datasets = pytest.importorskip("datasets")
    raw = {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}
    datasets.Dataset.from_dict(
        {
            "n": list(range(len(paths))),
            "image": [None if p is None else {"bytes": None, "path": p} for p in paths],
        },
        features=datasets.Features({"n": datasets.Value("int64"), "image": raw}),
    ).save_to_disk(str(saved))
    info = json.loads((saved / "dataset_info.json").read_text())
    info["features"]["image"] = {"_type": "Image"}
    (saved / "dataset_info.json").write_text(json.dumps(info))
    return saved


def test_hf_folder_refuses_an_image_path_out_and_reads_it_when_asked(cat, tmp_path, outside):
    secret = outside / "secret.jpg"
    saved = _hostile_folder(tmp_path / "hf", [None, str(secret)])
    with pytest.raises(
        ImportFailedError,
        match=f"^Image column 'image', row 1, stores only the path '{re.escape(str(secret))}', "
        f"which leads to '{re.escape(str(secret))}', outside the imported folder "
        f"'{re.escape(str(saved))}'; {HF_FOLDER_FIX}",
    ):
        cat.sql(f"CREATE DATASET h FROM '{saved}'")
    _nothing_left(cat)
    ds = cat.sql(f"CREATE DATASET h FROM '{saved}' FORMAT hf WITH (follow_links = true)")
    assert ds.take([0, 1]).to_pydict()["image"] == [None, SECRET]


def test_hf_folder_resolves_relative_image_paths_against_the_folder(
    cat, tmp_path, outside, monkeypatch
):
    saved = tmp_path / "hf"
    saved.mkdir()
    (saved / "a.jpg").write_bytes(b"inside")
    _hostile_folder(saved, ["a.jpg", "./sub/../a.jpg"])
    monkeypatch.chdir(outside)  # not the folder: relative paths are not read from here
    (outside / "a.jpg").write_bytes(b"the current directory")
    ds = cat.import_hf("h", saved)
    assert ds.take([0, 1]).to_pydict()["image"] == [b"inside", b"inside"]
    cat.drop_dataset("h")
    _hostile_folder(tmp_path / "hf2", [None, "../outside/secret.jpg"])
    with pytest.raises(
        ImportFailedError,
        match=r"^Image column 'image', row 1, stores only the path '\.\./outside/secret\.jpg', "
        f"which leads to '{re.escape(str(outside / 'secret.jpg'))}', outside the imported "
        f"folder '.*hf2'; {HF_FOLDER_FIX}",
    ):
        cat.import_hf("h", tmp_path / "hf2")
    _nothing_left(cat)


def test_hf_folder_refuses_an_image_path_through_a_link_out(cat, tmp_path, outside):
    saved = tmp_path / "hf"
    saved.mkdir()
    (tmp_path / "elsewhere").symlink_to(outside)  # the link is beside the folder, not in it
    _hostile_folder(saved, ["../elsewhere/secret.jpg"])
    with pytest.raises(
        ImportFailedError,
        match=f"row 0, stores only the path '../elsewhere/secret.jpg', which leads to "
        f"'{re.escape(str(outside / 'secret.jpg'))}', outside the imported folder",
    ):
        cat.import_hf("h", saved)
    _nothing_left(cat)


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "link"])
def test_hf_in_memory_refuses_paths_out_and_reads_them_when_asked(
    cat, tmp_path, outside, monkeypatch, kind
):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    (here / "mine.jpg").write_bytes(b"mine")
    (here / "out").symlink_to(outside)
    path = {
        "absolute": str(outside / "secret.jpg"),
        "dotdot": "../outside/secret.jpg",
        "link": "out/secret.jpg",
    }[kind]
    what = "an absolute path" if kind == "absolute" else "out of the current directory"
    ds = _image_paths(["mine.jpg", "mine.jpg", None, path, "mine.jpg"])
    # Two rows a batch: the refusal comes after a batch was written, which must not remain.
    source = open_source("hf", ds, batch_size=2)
    with pytest.raises(
        ImportFailedError,
        match=f"^Image column 'image', row 3, stores only the path '{re.escape(path)}', {what}, "
        f"which leads to '{re.escape(str(outside / 'secret.jpg'))}'; {HF_MEMORY_FIX}",
    ):
        cat.import_source("h", source)
    _nothing_left(cat)
    got = cat.import_hf("h", ds, follow_links=True).take([0, 2, 3]).to_pydict()["image"]
    assert got == [b"mine", None, SECRET]


def test_hf_in_memory_reads_relative_paths_inside_the_current_directory(cat, tmp_path, monkeypatch):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.jpg").write_bytes(b"a")
    (tmp_path / "b.jpg").write_bytes(b"b")
    (tmp_path / "again").symlink_to("img")  # a link that stays inside
    monkeypatch.chdir(tmp_path)
    ds = cat.import_hf("h", _image_paths(["img/a.jpg", "img/../b.jpg", "again/a.jpg"]))
    assert ds.take([0, 1, 2]).to_pydict()["image"] == [b"a", b"b", b"a"]


def test_hf_refusal_names_the_row_and_split_of_a_nested_image(cat, tmp_path, outside):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"frames": datasets.List(datasets.Image())})
    red = {"bytes": b"red", "path": None}
    bad = {"bytes": None, "path": str(outside / "secret.jpg")}
    split = datasets.Dataset.from_dict(
        {"frames": [[red], [], [red, red], [red, bad]]}, features=features
    )
    dd = datasets.DatasetDict({"train": split.select([0, 1]), "test": split})
    with pytest.raises(
        ImportFailedError,
        match=r"^Image column 'frames', row 3 of split 'test', stores only the path '.*secret",
    ):
        cat.import_hf("h", dd)
    _nothing_left(cat)
