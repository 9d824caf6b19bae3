from __future__ import annotations

import io
import sys
from collections.abc import Iterator

import pyarrow as pa
import pytest

datasets = pytest.importorskip("datasets")
PIL_Image = pytest.importorskip("PIL.Image")

from tabloader.catalog._errors import ImportFailedError  # noqa: E402
from tabloader.catalog._importers import open_source  # noqa: E402
from tabloader.catalog._importers.hf import open_hf  # noqa: E402

NAMES = ["cat", "dog", "fish"]


def _labelled(n: int = 10) -> datasets.Dataset:
    features = datasets.Features(
        {
            "x": datasets.Value("int32"),
            "label": datasets.ClassLabel(names=NAMES),
            "tags": datasets.List(datasets.Value("string")),
        }
    )
    return datasets.Dataset.from_dict(
        {
            "x": list(range(n)),
            "label": [i % 3 for i in range(n)],
            "tags": [[f"t{i}"] * (i % 2) for i in range(n)],
        },
        features=features,
    )


def _png(color: tuple[int, int, int], size: tuple[int, int] = (6, 4)) -> PIL_Image.Image:
    return PIL_Image.new("RGB", size, color)


def _rows(src) -> dict[str, list]:
    batches = list(src.batches)
    for b in batches:
        assert b.schema.equals(src.schema)
    return pa.Table.from_batches(batches, schema=src.schema).to_pydict()


def test_classlabel_becomes_int64_with_names():
    src = open_hf(_labelled())
    assert src.schema.field("label").type == pa.int64()
    assert src.schema.field("x").type == pa.int32()
    assert src.schema.field("tags").type == pa.list_(pa.string())
    assert src.class_names == {"label": NAMES}
    assert src.num_rows == 10
    assert "_id" not in src.schema.names
    assert src.schema.metadata is None
    rows = _rows(src)
    assert rows["label"] == [i % 3 for i in range(10)]
    assert rows["tags"][1] == ["t1"]


def test_list_of_classlabel_keeps_names():
    features = datasets.Features({"labels": datasets.List(datasets.ClassLabel(names=["a", "b"]))})
    ds = datasets.Dataset.from_dict({"labels": [[0, 1], [], [1]]}, features=features)
    src = open_hf(ds)
    assert src.class_names == {"labels": ["a", "b"]}
    assert src.schema.field("labels").type == pa.list_(pa.int64())
    assert _rows(src)["labels"] == [[0, 1], [], [1]]


def test_image_from_pil_becomes_encoded_bytes():
    images = [_png((255, 0, 0)), _png((0, 255, 0), (3, 5)), None]
    ds = datasets.Dataset.from_dict(
        {"image": images, "label": [0, 1, 2]},
        features=datasets.Features(
            {"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)}
        ),
    )
    src = open_hf(ds)
    assert src.schema.field("image").type == pa.binary()
    rows = _rows(src)
    stored = ds.data.table.column("image").to_pylist()
    assert rows["image"][:2] == [s["bytes"] for s in stored[:2]]
    assert rows["image"][2] is None
    decoded = PIL_Image.open(io.BytesIO(rows["image"][1]))
    assert decoded.size == (3, 5)
    assert decoded.convert("RGB").getpixel((0, 0)) == (0, 255, 0)


def test_image_stored_by_path_reads_the_file_bytes(tmp_path, monkeypatch):
    path = tmp_path / "a.png"
    _png((1, 2, 3)).save(path)
    monkeypatch.chdir(tmp_path)
    ds = datasets.Dataset.from_dict(
        {"image": ["a.png"]}, features=datasets.Features({"image": datasets.Image()})
    )
    assert ds.data.table.column("image")[0]["bytes"].as_py() is None
    assert _rows(open_hf(ds))["image"] == [path.read_bytes()]


def test_image_inside_list_and_dict_becomes_bytes():
    red, blue = _png((255, 0, 0)), _png((0, 0, 255))
    features = datasets.Features(
        {
            "frames": datasets.List(datasets.Image()),
            "meta": {"thumb": datasets.Image(), "n": datasets.Value("int8")},
        }
    )
    ds = datasets.Dataset.from_dict(
        {"frames": [[red, blue], []], "meta": [{"thumb": red, "n": 1}, {"thumb": None, "n": 2}]},
        features=features,
    )
    src = open_hf(ds, batch_size=1)
    assert src.schema.field("frames").type == pa.list_(pa.binary())
    assert src.schema.field("meta").type == pa.struct([("thumb", pa.binary()), ("n", pa.int8())])
    rows = _rows(src)
    assert [len(f) for f in rows["frames"]] == [2, 0]
    assert PIL_Image.open(io.BytesIO(rows["frames"][0][1])).getpixel((0, 0)) == (0, 0, 255)
    assert rows["meta"][1] == {"thumb": None, "n": 2}


def test_missing_image_file_is_an_import_error(tmp_path):
    path = tmp_path / "gone.png"
    _png((1, 2, 3)).save(path)
    ds = datasets.Dataset.from_dict(
        {"image": [str(path)]}, features=datasets.Features({"image": datasets.Image()})
    )
    path.unlink()
    src = open_hf(ds, follow_links=True)
    with pytest.raises(
        ImportFailedError,
        match=r"^Image column 'image', row 0, stores only the path .*gone\.png', which cannot be "
        r"read \(No such file or directory\)\. Restore the file",
    ):
        list(src.batches)


def test_image_feature_over_other_storage_is_an_import_error():
    ds = datasets.Dataset.from_dict({"image": ["a.png", "b.png"]})
    ds.info.features = datasets.Features({"image": datasets.Image()})  # storage stays string
    with pytest.raises(
        ImportFailedError,
        match=r"Image column 'image' is stored as string, not struct<bytes, path>; cast it",
    ):
        open_hf(ds)


def test_batches_stream_within_batch_size():
    src = open_hf(_labelled(10), batch_size=3)
    assert isinstance(src.batches, Iterator)
    assert [b.num_rows for b in src.batches] == [3, 3, 3, 1]


@pytest.mark.parametrize(
    "make",
    [
        lambda ds: ds.shuffle(seed=3),
        lambda ds: ds.select([7, 2, 2, 9, 0]),
        lambda ds: ds.shuffle(seed=1).select(range(6)),
        lambda ds: ds.filter(lambda row: row["x"] % 2 == 1),
    ],
    ids=["shuffle", "select", "shuffle-select", "filter"],
)
def test_indices_mapping_keeps_the_visible_order(make):
    ds = make(_labelled(12))
    src = open_hf(ds, batch_size=4)
    batches = list(src.batches)
    assert all(b.num_rows <= 4 for b in batches)
    rows = pa.Table.from_batches(batches).to_pydict()
    assert rows["x"] == ds["x"]
    assert rows["label"] == ds["label"]
    assert src.num_rows == len(ds)


def _dict() -> datasets.DatasetDict:
    full = _labelled(10)
    return datasets.DatasetDict({"train": full.select(range(7)), "test": full.select(range(7, 10))})


def test_datasetdict_one_split():
    src = open_hf(_dict(), split="test")
    assert "split" not in src.schema.names
    assert _rows(src)["x"] == [7, 8, 9]
    assert src.num_rows == 3
    assert src.class_names == {"label": NAMES}


def test_datasetdict_all_splits_with_split_column():
    src = open_hf(_dict(), batch_size=4)
    assert src.schema.field("split").type == pa.string()
    assert src.schema.names[-1] == "split"
    assert src.num_rows == 10
    batches = list(src.batches)
    assert [b.num_rows for b in batches] == [4, 3, 3]
    rows = pa.Table.from_batches(batches).to_pydict()
    assert rows["x"] == list(range(10))
    assert rows["split"] == ["train"] * 7 + ["test"] * 3


def test_unknown_split_suggests_the_closest():
    with pytest.raises(ImportFailedError, match=r"Unknown split 'trian'.*Did you mean 'train'\?"):
        open_hf(_dict(), split="trian")


def test_splits_with_different_features_need_a_split():
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"a": [1]}),
            "test": datasets.Dataset.from_dict({"a": ["x"]}),
        }
    )
    with pytest.raises(ImportFailedError, match=r"different features.*pass split="):
        open_hf(dd)
    assert _rows(open_hf(dd, split="test"))["a"] == ["x"]


def test_existing_split_column_conflicts():
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"split": ["a"]})})
    with pytest.raises(ImportFailedError, match=r"already has a column 'split'"):
        open_hf(dd)


def test_empty_datasetdict():
    with pytest.raises(ImportFailedError, match="has no splits"):
        open_hf(datasets.DatasetDict())


def test_split_of_a_dataset_must_match():
    named = datasets.Dataset.from_dict({"a": [1]}, split="train")
    assert _rows(open_hf(named, split="train"))["a"] == [1]
    with pytest.raises(ImportFailedError, match=r"split='test' was asked.*'train' split"):
        open_hf(named, split="test")


@pytest.mark.parametrize("as_str", [True, False])
def test_save_to_disk_dataset(tmp_path, as_str):
    ds = _labelled(5)
    ds.save_to_disk(str(tmp_path / "ds"))
    path = str(tmp_path / "ds") if as_str else tmp_path / "ds"
    src = open_hf(path, batch_size=2)
    assert src.class_names == {"label": NAMES}
    assert _rows(src)["x"] == list(range(5))
    assert str(tmp_path / "ds") in src.description


def test_save_to_disk_datasetdict(tmp_path):
    _dict().save_to_disk(str(tmp_path / "dd"))
    rows = _rows(open_hf(tmp_path / "dd"))
    assert rows["split"] == ["train"] * 7 + ["test"] * 3
    assert _rows(open_hf(tmp_path / "dd", split="train"))["x"] == list(range(7))


def test_save_to_disk_with_images(tmp_path):
    ds = datasets.Dataset.from_dict(
        {"image": [_png((9, 9, 9))]}, features=datasets.Features({"image": datasets.Image()})
    )
    ds.save_to_disk(str(tmp_path / "img"))
    rows = _rows(open_hf(tmp_path / "img"))
    assert PIL_Image.open(io.BytesIO(rows["image"][0])).getpixel((0, 0)) == (9, 9, 9)


def test_registered_as_format_hf(tmp_path):
    src = open_source("hf", _dict(), split="train")
    assert src.num_rows == 7


def test_missing_path():
    with pytest.raises(ImportFailedError, match=r"No such directory: '.*nope'"):
        open_hf("/definitely/nope")


def test_path_is_a_file(tmp_path):
    (tmp_path / "f.arrow").write_bytes(b"x")
    with pytest.raises(ImportFailedError, match=r"is a file, not a folder written by"):
        open_hf(tmp_path / "f.arrow")


def test_folder_that_is_not_a_dataset(tmp_path):
    (tmp_path / "other").mkdir()
    with pytest.raises(ImportFailedError, match=r"not a HuggingFace dataset folder.*save_to_disk"):
        open_hf(tmp_path / "other")


@pytest.mark.parametrize("obj", [[1, 2], pa.table({"a": [1]}), {"train": 1}, 3])
def test_unsupported_object(obj):
    with pytest.raises(ImportFailedError, match=r"Cannot import a .* as a HuggingFace dataset"):
        open_hf(obj)


def test_iterable_dataset_is_refused():
    # An empty IterableDatasetDict: building an IterableDataset imports torch (seconds).
    with pytest.raises(
        ImportFailedError,
        match=r"Cannot import a streaming datasets\.IterableDatasetDict: .*"
        r"without streaming=True",
    ):
        open_hf(datasets.IterableDatasetDict())


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_batch_size(bad):
    with pytest.raises(ImportFailedError, match="batch_size must be a positive integer"):
        open_hf(_labelled(3), batch_size=bad)


def test_datasets_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportFailedError, match=r"pip install 'tabloader\[hf\]'"):
        open_hf("anything")


def test_catalog_import_hf(cat):
    dataset = cat.import_hf("pets", _dict())
    assert dataset.num_rows == 10
    assert dataset.class_names == {"label": NAMES}


def test_catalog_import_hf_take_round_trip(cat):
    """Rows taken by id from the catalog equal the HF rows (images as their encoded bytes)."""
    import numpy as np

    rng = np.random.default_rng(0)
    base = _labelled(12)
    features = datasets.Features(
        {**base.features, "image": datasets.Image(), "noise": datasets.Value("binary")}
    )
    full = datasets.Dataset.from_dict(
        {
            **base.to_dict(),
            "image": [
                _png(tuple(rng.integers(0, 256, 3).tolist()), (40 + i, 30)) for i in range(12)
            ],
            "noise": [rng.bytes(90_000) for _ in range(12)],  # several record batches
        },
        features=features,
    )
    dd = datasets.DatasetDict({"train": full.select(range(8)), "test": full.select(range(8, 12))})
    ds = cat.import_hf("pets", dd)
    assert ds.reader.parts[0].rows_per_batch < ds.num_rows
    ids = [11, 0, 5, 8, 5, 2]
    got = ds.take(ids).to_pydict()
    raw = full.cast_column("image", datasets.Image(decode=False))
    assert got["_id"] == ids
    for key in ("x", "label", "tags", "noise"):
        assert got[key] == [full[i][key] for i in ids]
    assert got["image"] == [raw[i]["image"]["bytes"] for i in ids]
    assert got["split"] == ["test" if i >= 8 else "train" for i in ids]
