from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image, UnidentifiedImageError

from tabloader.datagen import (
    MARKER,
    Corruption,
    corrupt_image,
    make_imagefolder,
    make_metadata_table,
)

SMALL = {"num_images": 20, "num_classes": 3, "size": (120, 90)}


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.jpg"))}


def test_layout(tmp_path):
    root = make_imagefolder(tmp_path / "imgs", **SMALL)
    assert root == tmp_path / "imgs"
    assert sorted(p.name for p in root.iterdir()) == [MARKER, "class_000", "class_001", "class_002"]
    files = _files(root)
    assert len(files) == 20
    assert "class_000/img_000000.jpg" in files
    assert "class_002/img_000017.jpg" in files
    assert [len(list((root / c).iterdir())) for c in ["class_000", "class_001", "class_002"]] == [
        7,
        7,
        6,
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_same_seed_same_bytes(tmp_path):
    a = _files(make_imagefolder(tmp_path / "a", **SMALL, seed=5))
    b = _files(make_imagefolder(tmp_path / "b", **SMALL, seed=5))
    c = _files(make_imagefolder(tmp_path / "c", **SMALL, seed=6))
    assert a == b
    assert a.keys() == c.keys()
    assert all(a[k] != c[k] for k in a)


def test_process_pool_gives_the_same_bytes(tmp_path):
    params = {"num_images": 140, "num_classes": 4, "size": (32, 24), "seed": 2}
    seen = []
    pooled = make_imagefolder(tmp_path / "a", **params, workers=2, progress=seen.append)
    assert sorted(seen) == seen
    assert seen[-1] == 140
    assert len(seen) == 3
    assert _files(pooled) == _files(make_imagefolder(tmp_path / "b", **params, workers=1))


def test_jpegs_decode_with_sizes_near_nominal(tmp_path):
    root = make_imagefolder(tmp_path / "imgs", **SMALL, size_jitter=0.2)
    sizes = []
    for path in sorted(root.rglob("*.jpg")):
        with Image.open(path) as im:
            assert im.format == "JPEG"
            assert im.mode == "RGB"
            im.load()
            sizes.append(im.size)
    widths, heights = zip(*sizes, strict=True)
    assert all(96 <= w <= 144 for w in widths)
    assert all(72 <= h <= 108 for h in heights)
    assert len(set(widths)) > 5
    assert len(set(heights)) > 5


def test_default_size_is_imagenet_like(tmp_path):
    root = make_imagefolder(tmp_path / "imgs", num_images=6, num_classes=2)
    for path in root.rglob("*.jpg"):
        with Image.open(path) as im:
            w, h = im.size
        assert 400 <= w <= 600
        assert 300 <= h <= 450
        assert 30_000 < path.stat().st_size < 150_000


def test_no_jitter_gives_the_exact_size(tmp_path):
    root = make_imagefolder(
        tmp_path / "imgs", num_images=3, num_classes=1, size=(64, 48), size_jitter=0
    )
    for path in root.rglob("*.jpg"):
        with Image.open(path) as im:
            assert im.size == (64, 48)


def test_idempotent(tmp_path):
    root = make_imagefolder(tmp_path / "imgs", **SMALL)
    marker = json.loads((root / MARKER).read_text())
    assert marker["num_images"] == 20
    stamp = {p: p.stat().st_mtime_ns for p in root.rglob("*.jpg")}
    seen = []
    assert make_imagefolder(root, **SMALL, workers=2, progress=seen.append) == root
    assert seen == [20]
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*.jpg")} == stamp


def test_other_parameters_regenerate(tmp_path):
    root = make_imagefolder(tmp_path / "imgs", **SMALL)
    make_imagefolder(root, **{**SMALL, "num_images": 5})
    assert len(_files(root)) == 5
    assert json.loads((root / MARKER).read_text())["num_images"] == 5


def test_empty_existing_folder_is_used(tmp_path):
    (tmp_path / "imgs").mkdir()
    assert len(_files(make_imagefolder(tmp_path / "imgs", **SMALL))) == 20


def test_foreign_folder_is_not_overwritten(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match=r"not made by make_imagefolder"):
        make_imagefolder(tmp_path / "imgs", **SMALL)
    assert (tmp_path / "imgs" / "mine.txt").read_text() == "keep"


def test_progress_reports_every_image(tmp_path):
    seen = []
    make_imagefolder(
        tmp_path / "imgs", num_images=150, num_classes=2, size=(32, 32), progress=seen.append
    )
    assert seen == [64, 128, 150]


def test_interrupted_run_leaves_nothing(tmp_path):
    def stop(n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        make_imagefolder(tmp_path / "imgs", **SMALL, progress=stop)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_images": 0}, "num_images"),
        ({"num_classes": 0}, "num_classes"),
        ({"size": (4, 100)}, "size"),
        ({"size_jitter": 1.0}, "size_jitter"),
        ({"quality": 0}, "quality"),
        ({"workers": -1}, "workers"),
    ],
)
def test_bad_parameters(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_imagefolder(tmp_path / "imgs", **{**SMALL, **kwargs})


def test_corrupt_image_truncate_fails_at_decode(tmp_path):
    root = make_imagefolder(tmp_path / "imgs", **SMALL)
    path = root / "class_000" / "img_000000.jpg"
    size = path.stat().st_size
    corrupt_image(path)
    assert path.stat().st_size < size
    with Image.open(path) as im, pytest.raises(OSError, match="truncated"):
        im.load()


def test_corrupt_image_header_fails_at_open(tmp_path):
    root = make_imagefolder(tmp_path / "imgs", **SMALL)
    path = root / "class_001" / "img_000001.jpg"
    corrupt_image(path, how=Corruption.HEADER)
    with pytest.raises(UnidentifiedImageError):
        Image.open(path)


def test_metadata_table():
    table = make_metadata_table(20_000, payload_bytes=8, seed=1)
    assert table.schema == pa.schema(
        [
            ("label", pa.int64()),
            ("split", pa.string()),
            ("width", pa.int32()),
            ("height", pa.int32()),
            ("payload", pa.binary()),
        ]
    )
    assert table.num_rows == 20_000
    label = table.column("label").to_numpy()
    assert label.min() >= 0
    assert label.max() < 1000
    assert len(np.unique(label)) == 1000
    split = table.column("split").to_pylist()
    assert set(split) == {"train", "val"}
    assert 0.02 < split.count("val") / len(split) < 0.06
    width, height = table.column("width").to_numpy(), table.column("height").to_numpy()
    assert ((width == 500) | (height == 500)).all()
    assert (np.minimum(width, height) >= 100).all()
    assert 330 < np.minimum(width, height).mean() < 410
    payload = table.column("payload")
    assert set(pa.compute.binary_length(payload).to_pylist()) == {8}
    assert len(set(payload.to_pylist()[:1000])) == 1000


def test_metadata_table_is_deterministic():
    assert make_metadata_table(1000, seed=3).equals(make_metadata_table(1000, seed=3))
    assert not make_metadata_table(1000, seed=3).equals(make_metadata_table(1000, seed=4))


@pytest.mark.parametrize(("rows", "payload_bytes"), [(0, 16), (5, 0)])
def test_metadata_table_edges(rows, payload_bytes):
    table = make_metadata_table(rows, payload_bytes=payload_bytes)
    assert table.num_rows == rows
    assert all(v == b"" for v in table.column("payload").to_pylist())


def test_metadata_table_bad_arguments():
    with pytest.raises(ValueError, match="must be >= 0"):
        make_metadata_table(-1)
