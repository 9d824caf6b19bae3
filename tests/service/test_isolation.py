"""A job's batch is its own: in-place writes never reach another job, a later epoch or the cache.

Every check compares a batch with the source table (the stored bytes decoded as a job decodes
them, the stored labels and strings), so a write that stays plausible (a label moved to
another class, strings swapped) is caught as surely as zeroed images.
"""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pytest
import torch

from tabloader import catalog
from tabloader.catalog._errors import LoaderError
from tabloader.engine import Loader
from tabloader.engine._arena.arena import CacheOvershootWarning
from tabloader.engine.decode import decode_image
from tabloader.torch import JobDataset

# Fixed-size images are decoded by decode processes into the arena, or by threads and then put
# there; variable-size ones always by threads.
MODES = pytest.mark.parametrize(
    ("size", "decode"),
    [(16, "processes"), (16, "threads"), (None, "threads")],
    ids=["fixed-processes", "fixed-threads", "variable"],
)


def source_rows(cat, ids, size):
    """Rows ``ids`` of the source table: images decoded as a job decodes them, labels, paths."""
    table = cat.dataset("imgs").take([int(i) for i in ids], ["image", "label", "path"])
    images = [decode_image(v.as_buffer(), size=size) for v in table.column("image")]
    return images, table.column("label").to_numpy(), table.column("path").to_pylist()


def assert_like_source(cat, batch, size):
    """Every value of ``batch`` (image, label, path) equals the source's."""
    images, labels, paths = source_rows(cat, np.asarray(batch["_id"]), size)
    got = batch["image"]
    if size is not None:
        assert isinstance(got, np.ndarray | torch.Tensor)
        assert tuple(got.shape) == (len(images), size, size, 3)
    assert len(got) == len(images)
    for g, e in zip(got, images, strict=True):
        np.testing.assert_array_equal(np.asarray(g), e)
    np.testing.assert_array_equal(np.asarray(batch["label"]), labels)
    assert np.asarray(batch["label"]).dtype == labels.dtype
    if "path" in batch:
        assert list(batch["path"]) == paths


def vandalise(batch):
    """Write into every column of ``batch`` in place, in every way a job might; labels and
    strings stay plausible (a check that they are merely in range would not see it)."""
    for img in batch["image"]:  # a stacked array's rows, or a list's arrays
        img[...] = 0  # img.zero_(), x -= mean, Normalize(inplace=True)...
    batch["label"][:] = (batch["label"] + 1) % 4  # another of the 4 classes
    if "path" in batch:
        batch["path"].reverse()
        batch["path"][0] = "vandalised"
    batch["_id"][:] = batch["_id"][::-1].copy()


def _arrays(batch):
    """The numpy arrays of ``batch``: its columns and, for a list column, the list's arrays."""
    for value in batch.values():
        if isinstance(value, np.ndarray):
            yield value
        elif isinstance(value, list):
            yield from (v for v in value if isinstance(v, np.ndarray))


@MODES
def test_a_job_writing_into_its_batches_sees_the_source_in_every_epoch(images, size, decode):
    """The same job's later epochs are served from the cache its vandalised batches came from:
    they must not see the writes. 57 rows in batches of 8: a last batch of one row each epoch.
    """
    opts = "" if size is None else f" WITH (image_size = {size})"
    images.sql(f"REGISTER JOB writer SELECT image, label, path FROM imgs WHERE _id < 57{opts}")
    with Loader(images, cache_bytes=32 << 20, workers=2, decode=decode) as loader:
        stream = loader.open("writer", batch_size=8, epochs=3)
        arena = loader.arena.buffer
        seen: list[int] = []
        for batch in stream:
            assert_like_source(images, batch, size)  # every value, every epoch
            seen += batch["_id"].tolist()
            for array in _arrays(batch):
                assert not np.shares_memory(array, arena)
            vandalise(batch)
        assert loader.stats()["cache"].hits >= 2 * 57  # epochs 2 and 3 read the cache
    assert len(seen) == 3 * 57  # each row once an epoch: the writes never reached the ids
    for epoch in range(3):
        assert sorted(seen[57 * epoch : 57 * (epoch + 1)]) == list(range(57))


@MODES
def test_in_place_writes_never_reach_another_job(images, size, decode):
    opts = "" if size is None else f" WITH (image_size = {size})"
    images.sql(f"REGISTER JOB writer SELECT image, label, path FROM imgs{opts}")
    images.sql(f"REGISTER JOB reader SELECT image, label, path FROM imgs{opts}")
    n = images.job("writer").num_rows
    with Loader(images, cache_bytes=32 << 20, workers=2, decode=decode) as loader:
        writer = loader.open("writer", batch_size=5, epochs=2)
        reader = loader.open("reader", batch_size=5, epochs=2)
        arena = loader.arena.buffer
        checked = 0
        for w, r in zip(writer, reader, strict=True):
            assert_like_source(images, w, size)  # the writer's own batch, before it writes
            for a in _arrays(w):
                assert not np.shares_memory(a, arena)
                assert not any(np.shares_memory(a, b) for b in _arrays(r))
            vandalise(w)
            assert_like_source(images, r, size)  # nothing the writer did shows
            checked += len(r["_id"])
        assert checked == 2 * n  # the reader saw every row of both epochs intact


def test_tensors_written_in_place_stay_in_their_job(images):
    images.sql("REGISTER JOB a SELECT image, label FROM imgs WITH (image_size = 8)")
    images.sql("REGISTER JOB b SELECT image, label FROM imgs WITH (image_size = 8)")
    with Loader(images, cache_bytes=8 << 20, workers=2) as loader:
        a = JobDataset("a", loader=loader, batch_size=4)
        b = JobDataset("b", loader=loader, batch_size=4)
        seen = 0
        for _ in range(2):  # the second epoch from the cache: a's writes are not in it
            for ba, bb in zip(a, b, strict=True):
                assert_like_source(images, ba, 8)
                ba["image"].zero_()  # torch in place, e.g. Normalize(inplace=True)
                ba["label"].add_(1)
                assert_like_source(images, bb, 8)
                seen += len(bb["_id"])
        a.close()
        b.close()
    assert seen == 2 * images.job("b").num_rows


@pytest.mark.parametrize("decode", ["processes", "threads"])
def test_values_handed_out_uncached_are_copies_too(images, decode):
    """A cache too small for the rows in flight hands values out uncached (one decode for the
    batches that wait for it): each batch still gets its own copy."""
    images.sql("REGISTER JOB a SELECT image, label FROM imgs WITH (image_size = 16)")
    images.sql("REGISTER JOB b SELECT image, label FROM imgs WITH (image_size = 16)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheOvershootWarning)
        with Loader(images, cache_bytes=4 << 10, workers=2, decode=decode) as loader:
            a = loader.open("a", batch_size=10, epochs=2)
            b = loader.open("b", batch_size=10, epochs=2)
            for ba, bb in zip(a, b, strict=True):
                assert_like_source(images, ba, 16)
                vandalise(ba)
                assert_like_source(images, bb, 16)
            uncached = loader.stats()["cache"].uncached
    assert uncached > 0  # the path under test was taken


def test_numeric_list_and_string_columns_are_copies(tmp_path):
    cat = catalog.open_catalog(tmp_path / "cat")
    n = 50
    table = pa.table(
        {
            "x": np.arange(n, dtype=np.int64),
            "emb": pa.FixedSizeListArray.from_arrays(
                pa.array(np.arange(2 * n, dtype=np.float32)), 2
            ),
            "tokens": pa.array([[i, i + 1, i + 2] for i in range(n)], pa.list_(pa.int32())),
            "ragged": pa.array([list(range(i % 3 + 1)) for i in range(n)], pa.list_(pa.int64())),
            "name": [f"row {i}" for i in range(n)],
        }
    )
    cat.import_arrow("t", table)
    for job in ("a", "b"):
        cat.sql(f"REGISTER JOB {job} SELECT x, emb, tokens, ragged, name FROM t")

    def assert_like_source(batch):
        ids = batch["_id"]
        np.testing.assert_array_equal(batch["x"], ids)
        assert batch["x"].dtype == np.int64
        np.testing.assert_array_equal(batch["emb"], np.stack([2 * ids, 2 * ids + 1], 1))
        assert batch["emb"].dtype == np.float32
        np.testing.assert_array_equal(batch["tokens"], np.stack([ids, ids + 1, ids + 2], 1))
        assert [r.tolist() for r in batch["ragged"]] == [list(range(i % 3 + 1)) for i in ids]
        assert batch["name"] == [f"row {i}" for i in ids]

    with Loader(cat, cache_bytes=1 << 20) as loader:
        a = loader.open("a", batch_size=7, epochs=2)
        b = loader.open("b", batch_size=7, epochs=2)
        rows = 0
        for ba, bb in zip(a, b, strict=True):
            assert_like_source(ba)  # a's own batch, also in its second epoch
            for x in _arrays(ba):
                assert not any(np.shares_memory(x, y) for y in _arrays(bb))
            ba["x"] += 1
            ba["emb"][:] = -1
            ba["tokens"][:] = ba["tokens"][::-1].copy()
            for r in ba["ragged"]:
                r += 1
            ba["name"][0] = "vandalised"
            ba["name"].reverse()
            assert_like_source(bb)
            rows += len(bb["_id"])
    assert rows == 2 * n
    cat.close()


# -- a job's own failure is its own ----------------------------------------------------------
def _break(where: str, loader: Loader, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make job 'att''s ``where`` (its sampling, queueing or dealing) raise."""
    from tabloader.engine._queue.dealer import Dealer

    queues = loader.scheduler("imgs").queues

    def boom(asked: bool) -> None:
        if asked:
            raise RuntimeError("boom")

    if where == "sampling":  # labels only: the gathering jobs' sampler
        sample_many = queues.gather_sampler.sample_many
        monkeypatch.setattr(
            queues.gather_sampler,
            "sample_many",
            lambda names, n: boom("att" in names) or sample_many(names, n),
        )
    elif where == "queueing":
        queue = queues._queue
        monkeypatch.setattr(
            queues,
            "_queue",
            lambda q, *a: boom(q is getattr(queues.jobs.get("att"), "queue", None)) or queue(q, *a),
        )
    else:
        deal = Dealer.deal
        monkeypatch.setattr(Dealer, "deal", lambda d: boom(d.job.name == "att") or deal(d))


@pytest.mark.parametrize("where", ["sampling", "queueing", "dealing"])
def test_an_error_in_one_jobs_scheduling_fails_that_job_alone(images, monkeypatch, where):
    """The dataset's scheduler, its sampler and every other job go on; the job's every
    call raises the one reason (not 'the scheduler failed'), and it opens again."""
    images.sql("REGISTER JOB obs SELECT label FROM imgs")
    images.sql("REGISTER JOB att SELECT label FROM imgs")
    n = images.job("obs").num_rows
    with Loader(images, cache_bytes=1 << 20) as loader:
        obs = loader.open("obs", batch_size=7, epochs=3)
        seen = list(obs.next_batch()["_id"])
        _break(where, loader, monkeypatch)
        att = loader.open("att", batch_size=7)
        failed = r"Job 'att' failed in the loader \(RuntimeError: boom\); the other jobs of"
        for _ in range(2):  # each call: the reason, in one line
            with pytest.raises(LoaderError, match=failed):
                att.next_batch()
        seen += [i for batch in obs for i in batch["_id"]]  # its three epochs, whole
        for epoch in range(3):
            assert sorted(seen[n * epoch : n * (epoch + 1)]) == list(range(n))
        att.close()
        monkeypatch.undo()
        with loader.open("att", batch_size=7, epochs=1) as again:
            assert sorted(i for batch in again for i in batch["_id"]) == list(range(n))
        assert loader.scheduler("imgs").error is None
