from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from PIL import Image

from tabloader.catalog._errors import ImportFailedError
from tabloader.catalog._importers import detect_format, open_source
from tabloader.catalog._importers.imagefolder import SCHEMA, open_imagefolder


def _write(root: Path, rel: str, data: bytes | None = None) -> bytes:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    data = data if data is not None else f"bytes of {rel}".encode()
    path.write_bytes(data)
    return data


def _table(src) -> pa.Table:
    batches = list(src.batches)
    for b in batches:
        assert b.schema.equals(src.schema)
    return pa.Table.from_batches(batches, schema=src.schema)


@pytest.fixture
def folder(tmp_path) -> Path:
    root = tmp_path / "root"
    for rel in [
        "dog/b.jpg",
        "dog/a.png",
        "cat/z.jpeg",
        "cat/sub/y.JPG",
        "cat/sub/deeper/x.webp",
        "bird/1.bmp",
        "bird/2.gif",
    ]:
        _write(root, rel)
    return root


def test_columns_labels_and_sorted_order(folder):
    src = open_imagefolder(folder)
    assert src.schema.equals(SCHEMA)
    assert src.class_names == {"label": ["bird", "cat", "dog"]}
    assert src.num_rows == 7
    assert src.description == str(folder)
    rows = _table(src).to_pydict()
    assert rows["path"] == [
        "bird/1.bmp",
        "bird/2.gif",
        "cat/sub/deeper/x.webp",
        "cat/sub/y.JPG",
        "cat/z.jpeg",
        "dog/a.png",
        "dog/b.jpg",
    ]
    assert rows["label"] == [0, 0, 1, 1, 1, 2, 2]
    assert rows["label_name"] == ["bird", "bird", "cat", "cat", "cat", "dog", "dog"]
    assert rows["image"] == [(folder / p).read_bytes() for p in rows["path"]]


def test_generated_jpegs_round_trip_unchanged(image_folder):
    src = open_imagefolder(image_folder, batch_size=16)
    table = _table(src)
    assert table.num_rows == src.num_rows == 60
    assert src.class_names["label"] == ["class_000", "class_001", "class_002", "class_003"]
    rows = table.to_pydict()
    for data, rel, label, name in zip(
        rows["image"], rows["path"], rows["label"], rows["label_name"], strict=True
    ):
        assert data == (image_folder / rel).read_bytes()
        assert rel.split("/")[0] == name == src.class_names["label"][label]
    assert Image.open(io.BytesIO(rows["image"][0])).format == "JPEG"
    assert ".tabloader-datagen.json" not in " ".join(rows["path"])


def test_batches_stream_within_batch_size(folder):
    src = open_imagefolder(folder, batch_size=3)
    assert isinstance(src.batches, Iterator)
    assert [b.num_rows for b in src.batches] == [3, 3, 1]


def test_files_are_read_lazily(folder):
    src = open_imagefolder(folder, batch_size=2)
    first = next(src.batches)
    assert first.column("path").to_pylist() == ["bird/1.bmp", "bird/2.gif"]
    (folder / "dog" / "b.jpg").unlink()
    with pytest.raises(ImportFailedError, match=r"Cannot read '.*b\.jpg'.*import again"):
        list(src.batches)


def test_hidden_and_other_files_are_skipped(folder):
    _write(folder, ".DS_Store")
    _write(folder, "notes.txt")
    _write(folder, ".cache/c.jpg")
    _write(folder, "dog/.hidden.jpg")
    _write(folder, "dog/.ipynb_checkpoints/c.jpg")
    _write(folder, "dog/labels.csv")
    src = open_imagefolder(folder)
    assert src.class_names == {"label": ["bird", "cat", "dog"]}
    assert src.num_rows == 7
    assert _table(src).column("path").to_pylist()[-2:] == ["dog/a.png", "dog/b.jpg"]


def test_extensions_option(folder):
    src = open_imagefolder(folder, extensions=["PNG", ".jpg"])
    assert _table(src).column("path").to_pylist() == ["cat/sub/y.JPG", "dog/a.png", "dog/b.jpg"]
    assert open_imagefolder(folder, extensions=".gif").num_rows == 1


def test_empty_class_folder_keeps_its_label(tmp_path):
    _write(tmp_path, "a/1.jpg")
    (tmp_path / "b").mkdir()
    _write(tmp_path, "c/1.jpg")
    src = open_imagefolder(tmp_path)
    assert src.class_names == {"label": ["a", "b", "c"]}
    assert _table(src).column("label").to_pylist() == [0, 2]


def test_registered_and_detected(folder):
    assert detect_format(folder) == "imagefolder"
    assert open_source("imagefolder", folder, batch_size=2).num_rows == 7


def test_missing_root(tmp_path):
    with pytest.raises(ImportFailedError, match=r"No such directory: '.*nope'\. Check the path"):
        open_imagefolder(tmp_path / "nope")


def test_root_is_a_file(tmp_path):
    _write(tmp_path, "x.jpg")
    with pytest.raises(ImportFailedError, match=r"is a file; FORMAT imagefolder needs a folder"):
        open_imagefolder(tmp_path / "x.jpg")


def test_empty_root(tmp_path):
    _write(tmp_path, ".hidden")
    with pytest.raises(ImportFailedError, match=r"is empty; put images in root/<class>/<file>"):
        open_imagefolder(tmp_path)


def test_images_in_root_without_class_folders(tmp_path):
    _write(tmp_path, "1.jpg")
    _write(tmp_path, "2.png")
    with pytest.raises(
        ImportFailedError,
        match=r"2 image file\(s\) directly in it .* and no class folders.*root/all",
    ):
        open_imagefolder(tmp_path)


def test_images_in_root_besides_class_folders(folder):
    _write(folder, "stray.jpg")
    with pytest.raises(
        ImportFailedError, match=r"directly in it \(stray\.jpg\) besides the class folders 'bird'"
    ):
        open_imagefolder(folder)


def test_no_class_folders(tmp_path):
    _write(tmp_path, "README.md")
    with pytest.raises(ImportFailedError, match=r"no class folders \(found only 'README\.md'\)"):
        open_imagefolder(tmp_path)


def test_class_folders_without_images(tmp_path):
    _write(tmp_path, "a/notes.txt")
    (tmp_path / "b").mkdir()
    with pytest.raises(
        ImportFailedError, match=r"No image files with extension .*'a', 'b'.*pass extensions="
    ):
        open_imagefolder(tmp_path)


@pytest.mark.parametrize("bad", [(), [""], "", [3]])
def test_bad_extensions(folder, bad):
    with pytest.raises(ImportFailedError, match=r"names no file extension"):
        open_imagefolder(folder, extensions=bad)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_bad_batch_size(folder, bad):
    with pytest.raises(ImportFailedError, match=r"batch_size must be a positive integer"):
        open_imagefolder(folder, batch_size=bad)


def test_catalog_import_imagefolder(cat, image_folder):
    dataset = cat.import_imagefolder("imgs", image_folder)
    assert dataset.num_rows == 60
    assert dataset.class_names == {"label": ["class_000", "class_001", "class_002", "class_003"]}
    ids = [59, 0, 31, 7, 31, 12, 1]
    got = dataset.take(ids)
    assert got.column("_id").to_pylist() == ids
    source = _table(open_imagefolder(image_folder))
    assert got.drop_columns(["_id"]).equals(source.take(ids))
    for row in got.to_pylist():
        assert row["image"] == (image_folder / row["path"]).read_bytes()
        assert row["path"].split("/")[0] == row["label_name"] == f"class_{row['label']:03d}"
