"""A job's batch is its own: in-place writes never reach another job, a later epoch or the cache."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

import catalog
from tabloader.engine import Loader
from tabloader.prep import decode_image
from tabloader.torch import JobDataset


def source_images(cat, ids, size):
    raw = cat.dataset("imgs").take([int(i) for i in ids], ["image"]).column("image")
    return [decode_image(v.as_buffer(), size=size) for v in raw]


@pytest.mark.parametrize("size", [16, None], ids=["fixed", "variable"])
def test_in_place_writes_never_reach_another_job_or_epoch(images, size):
    opts = "" if size is None else f" WITH (image_size = {size})"
    images.sql(f"REGISTER JOB writer SELECT image, label FROM imgs{opts}")
    images.sql(f"REGISTER JOB reader SELECT image, label FROM imgs{opts}")
    n = images.job("writer").num_rows
    with Loader(images, cache_bytes=32 << 20, workers=2) as loader:
        writer = loader.open("writer", batch_size=5, epochs=2)
        reader = loader.open("reader", batch_size=5, epochs=2)
        arena = loader._arena.buffer
        checked = 0
        for w, r in zip(writer, reader, strict=True):
            imgs = w["image"] if isinstance(w["image"], list) else [w["image"]]
            for img in imgs:  # the writer vandalises its batch in every way it can
                assert not np.shares_memory(img, arena)
                img[...] = 0
            w["label"] -= 1000
            for batch in (w, r):  # nothing the writer did shows anywhere
                expected = source_images(images, batch["_id"], size)
                if batch is w:
                    continue
                got = batch["image"] if isinstance(batch["image"], list) else list(batch["image"])
                for g, e in zip(got, expected, strict=True):
                    np.testing.assert_array_equal(g, e)
                    checked += 1
                assert (batch["label"] >= 0).all()
        assert checked == 2 * n  # the reader saw every row of both epochs intact


def test_tensors_written_in_place_stay_in_their_job(images):
    images.sql("REGISTER JOB a SELECT image FROM imgs WITH (image_size = 8)")
    images.sql("REGISTER JOB b SELECT image FROM imgs WITH (image_size = 8)")
    with Loader(images, cache_bytes=8 << 20, workers=2) as loader:
        a = JobDataset("a", loader=loader, batch_size=4)
        b = JobDataset("b", loader=loader, batch_size=4)
        seen = 0
        for ba, bb in zip(a, b, strict=True):
            ba["image"].zero_()  # torch in place, e.g. Normalize(inplace=True)
            expected = np.stack(source_images(images, bb["_id"].tolist(), 8))
            assert torch.equal(bb["image"], torch.from_numpy(expected))
            seen += len(bb["_id"])
        a.close()
        b.close()
    assert seen == images.job("b").num_rows


def test_numeric_list_and_string_columns_are_copies(tmp_path):
    cat = catalog.connect(tmp_path / "cat")
    n = 50
    table = pa.table(
        {
            "x": np.arange(n, dtype=np.int64),
            "emb": pa.FixedSizeListArray.from_arrays(
                pa.array(np.arange(2 * n, dtype=np.float32)), 2
            ),
            "tokens": pa.array([[i, i + 1, i + 2] for i in range(n)], pa.list_(pa.int32())),
            "name": [f"row {i}" for i in range(n)],
        }
    )
    cat.import_arrow("t", table)
    for job in ("a", "b"):
        cat.sql(f"REGISTER JOB {job} SELECT x, emb, tokens, name FROM t")
    with Loader(cat, cache_bytes=1 << 20) as loader:
        a = loader.open("a", batch_size=7, epochs=1)
        b = loader.open("b", batch_size=7, epochs=1)
        rows = 0
        for ba, bb in zip(a, b, strict=True):
            ba["x"] -= 100
            ba["emb"][:] = -1
            ba["tokens"][:] = -1
            ba["name"][0] = "vandalised"
            for batch in (bb,):
                ids = batch["_id"]
                np.testing.assert_array_equal(batch["x"], ids)
                np.testing.assert_array_equal(batch["emb"], np.stack([2 * ids, 2 * ids + 1], 1))
                assert batch["emb"].dtype == np.float32
                np.testing.assert_array_equal(batch["tokens"], np.stack([ids, ids + 1, ids + 2], 1))
                assert batch["name"] == [f"row {i}" for i in ids]
            rows += len(bb["_id"])
    assert rows == n
    cat.close()
