"""Reads planned from the jobs' lookahead and the local storage tier, against the loopback S3
server (the ``s3`` fixture): what each epoch fetches from the bucket, counted by the store and
by the proxy."""

from __future__ import annotations

import json
import threading

import pytest

from tabloader.catalog.storage import _writer
from tabloader.catalog.storage._s3 import forget_stores, open_s3
from tabloader.catalog.storage._tier import INDEX_FILE, TAIL, StorageTier, entry_path
from tabloader.engine import Loader
from tabloader.engine._prepare.storage import CACHE_DIR
from tests.support.polling import wait_for
from tests.support.s3proxy import Faults

ROWS = 80
IMAGE_SIZE = 128  # decoded values of 48 KiB: the arena (CACHE) holds 32, not the dataset
CACHE = 3 << 19  # (room for every row pinned at once: else CacheOvershootWarning, an error)


@pytest.fixture
def bucket_dataset(cat, s3, tier_images, monkeypatch):
    """Dataset ``imgs`` in the bucket, a record batch a row (so that batches are many), and
    jobs ``j0``..``j3`` over all of it; returns its bytes (the part file's)."""
    monkeypatch.setattr(_writer, "RANGED_BATCH_BYTES", 16 << 10)
    ds = cat.import_imagefolder("imgs", tier_images, storage=s3.uri)
    assert ds.reader.parts[0].rows_per_batch == 1
    for j in range(4):
        cat.sql(f"REGISTER JOB j{j} SELECT image, label FROM imgs WITH (image_size = {IMAGE_SIZE})")
    s3.proxy.reset()
    return sum(p.file_size for p in ds.reader.parts)


def run(loader, jobs, epochs, between=None):
    """Each of ``jobs`` on its own thread for ``epochs`` epochs, in step: ``between(epoch)``
    runs after every job finished ``epoch``, before any starts the next. Returns each job's
    rows (sorted), epoch by epoch."""
    seen = {name: [] for name in jobs}
    barrier = threading.Barrier(len(jobs))
    streams = {name: loader.open(name, batch_size=4, prefetch=2, epochs=epochs) for name in jobs}
    errors = []

    def consume(name):
        try:
            for e in range(epochs):
                rows = [i for b in streams[name].iter_epoch() for i in b["_id"].tolist()]
                seen[name].append(sorted(rows))
                if barrier.wait(60) == 0 and between is not None:
                    between(e)
                barrier.wait(60)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=consume, args=(n,)) for n in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for stream in streams.values():
        stream.close()
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return seen


def got(s3):
    """Bytes of the dataset's parts the bucket answered GETs with (the proxy's count)."""
    return sum(n for k, n in s3.proxy.stats.body_bytes.items() if "/data/imgs/" in k)


def loader(cat, *, tier, cache=CACHE, ahead=1 << 20):
    """A loader of a ``CACHE`` arena, 1 MiB of read-ahead (about half the dataset), and
    ``tier``."""
    return Loader(
        cat,
        cache_bytes=cache,
        workers=2,
        decode="threads",
        storage_cache_bytes=tier,
        readahead_bytes=ahead,
    )


def test_four_jobs_over_two_epochs_fetch_the_dataset_about_once(cat, s3, bucket_dataset):
    size = bucket_dataset
    store = open_s3(s3.uri)
    before = store.counters.snapshot()
    with loader(cat, tier=2 * size, cache=4 << 20) as ld:
        seen = run(ld, ["j0", "j1", "j2", "j3"], epochs=2)
        stats = ld.stats()["storage"]
    rows = list(range(ROWS))
    assert all(epochs == [rows, rows] for epochs in seen.values())
    fetched = store.counters.snapshot()["bytes"] - before["bytes"]
    assert fetched == got(s3)  # the store counts what the bucket sent
    assert fetched <= 1.15 * size, (fetched, size)
    assert stats["tier"]["admitted"] > 0
    assert stats["readahead"]["imgs"]["fetched"] > 0


def test_without_a_tier_each_epoch_fetches_what_the_read_ahead_does_not_hold(
    cat, s3, bucket_dataset
):
    size, ahead = bucket_dataset, 1 << 20
    with loader(cat, tier=0, ahead=ahead) as ld:
        run(ld, ["j0"], epochs=2)
        assert ld.stats()["storage"]["tier"] is None
    # the control of the tier's tests below: the first epoch fetches the dataset; the second
    # what the read-ahead's memory (half the dataset) does not hold: it keeps what it fetched
    # while its budget has room, so the second epoch fetches less than the dataset, and at
    # least the dataset less the budget (it holds no more than that)
    slack = 4 * (size // ROWS)
    assert 2 * size - ahead - slack <= got(s3) <= 2 * size - ahead // 4, (got(s3), size)


def test_a_tier_smaller_than_the_dataset_fetches_at_most_the_rest_each_epoch(
    cat, s3, bucket_dataset
):
    size = bucket_dataset
    tier = size // 2
    marks = []
    with loader(cat, tier=tier) as ld:
        run(ld, ["j0"], epochs=4, between=lambda e: marks.append(got(s3)))
        stats = ld.stats()["storage"]["tier"]
    assert stats["used_bytes"] <= tier
    # each epoch after the first: the dataset less the tier (the read-ahead fetches a few
    # batches of an epoch before the last one ends: counted over the epochs after the first)
    later = got(s3) - marks[0]
    slack = 4 * (size // ROWS)
    assert later <= 3 * (size - stats["used_bytes"]) + slack, (later, size, tier)
    assert stats["rejected"] > 0  # batches used this epoch did not push out the ones to come


def test_a_restarted_loader_reads_its_next_epoch_from_the_tier(cat, s3, bucket_dataset):
    size = bucket_dataset
    with loader(cat, tier=2 * size) as ld:
        run(ld, ["j0"], epochs=1)
    assert (cat.root / CACHE_DIR / INDEX_FILE).exists()
    first = got(s3)
    with loader(cat, tier=2 * size) as ld:  # a new process would read the same files
        seen = run(ld, ["j1"], epochs=1)
        stats = ld.stats()["storage"]["tier"]
    assert seen["j1"] == [list(range(ROWS))]
    assert got(s3) - first <= 0.05 * size, (got(s3) - first, size)
    assert stats["hits"] >= 0.9 * ROWS  # (the last batches come with the part's tail)


def test_a_damaged_tier_entry_is_dropped_and_fetched_again(cat, s3, bucket_dataset):
    size = bucket_dataset
    with loader(cat, tier=2 * size) as ld:
        run(ld, ["j0"], epochs=1)
    # a batch from the middle of the part: the run below reads it from the tier (its tail is
    # not read again: the catalog's store keeps the part's footer; the last batches came with it)
    index = json.loads((cat.root / CACHE_DIR / INDEX_FILE).read_bytes())
    ((part, batches),) = index["parts"].items()
    middle = sorted(b for b, _, _ in batches if b != TAIL)[len(batches) // 2]
    damaged = entry_path(cat.root / CACHE_DIR, (part, middle))
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    first = got(s3)
    with loader(cat, tier=2 * size) as ld:
        seen = run(ld, ["j0"], epochs=1)
        stats = ld.stats()["storage"]["tier"]
    assert seen["j0"] == [list(range(ROWS))]
    assert stats["dropped"] == 1
    assert 0 < got(s3) - first <= len(data)  # that batch only, from the bucket
    assert damaged.read_bytes() != bytes(data)  # written again, whole


def test_a_parts_tail_is_kept_though_it_was_opened_without_the_tier_and_checked_when_read(
    cat, s3, bucket_dataset, tmp_path
):
    """A part the catalog's own reads opened first (no tier) still leaves its tail (footer)
    in the tier once a reader with the tier asks for it; a new process (a new store) reads the
    tail from the tier, and a damaged one is dropped and fetched again."""
    info = cat.dataset("imgs").reader.parts[0]
    forget_stores()  # a part not open yet in this process
    tier = StorageTier(tmp_path / "tier", 1 << 30)
    try:
        open_s3(s3.uri).part(info.path, size=info.file_size, what="p")  # no tier: not kept
        assert tier.keys() == []
        open_s3(s3.uri).part(info.path, size=info.file_size, what="p", cache=tier)
        assert tier.keys() == [(info.path, TAIL)]  # offered by the reader with the tier
        damaged = entry_path(tmp_path / "tier", (info.path, TAIL))
        data = bytearray(damaged.read_bytes())
        data[-1] ^= 0xFF
        damaged.write_bytes(bytes(data))
        forget_stores()  # as in a new process
        first = got(s3)
        part = open_s3(s3.uri).part(info.path, size=info.file_size, what="p", cache=tier)
        assert part.footer.batches.size == ROWS
        assert tier.counters.snapshot()["dropped"] == 1
        assert 0 < got(s3) - first <= 64 << 10  # the tail, from the bucket
        assert damaged.read_bytes() != bytes(data)  # kept again, whole
        forget_stores()
        again = got(s3)
        open_s3(s3.uri).part(info.path, size=info.file_size, what="p", cache=tier)
        assert got(s3) == again  # from the tier
        assert tier.counters.snapshot()["hits"] == 1
    finally:
        tier.close()


def test_read_ahead_holds_at_most_its_budget_and_hides_latency(cat, s3, bucket_dataset):
    s3.proxy.faults = Faults(latency=0.01)
    budget = 1 << 20  # about 40 batches of the dataset
    with loader(cat, tier=0, ahead=budget) as ld:
        seen = run(ld, ["j0", "j1"], epochs=1)
        ahead = ld.stats()["storage"]["readahead"]["imgs"]
    assert seen["j0"] == seen["j1"] == [list(range(ROWS))]
    assert ahead["fetched"] >= ROWS // 2  # most batches were fetched before a decode asked
    slack = 2 * (bucket_dataset // ROWS)  # (sizes estimated before a part is open)
    assert 0 < ahead["peak"] <= budget + slack
    assert 0 < ahead["held_bytes"] <= budget + slack  # kept for a next use while there is room


def test_read_ahead_lets_its_batches_go_once_no_job_reads_the_dataset(cat, s3, bucket_dataset):
    with loader(cat, tier=0) as ld:
        run(ld, ["j0"], epochs=1)

        def held():
            return ld.stats()["storage"]["readahead"]["imgs"]["held_bytes"]

        assert held() >= (1 << 20) // 2  # kept (the budget: 1 MiB, about half the dataset)
        wait_for(lambda: held() == 0, "the batches let go", 30)
