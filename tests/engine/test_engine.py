from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from tabloader import catalog
from tabloader.catalog import JobNotFoundError, LoaderError, OptionError, RowReadError
from tabloader.catalog._options import JOB_OPTIONS, JobOption
from tabloader.engine import Loader
from tabloader.engine._arena.shm import shm_available
from tabloader.engine._deliver.batchmem import BatchMemory
from tabloader.engine.decode import decode_image
from tabloader.sampling import DependentSampler
from tests.support.polling import wait_for
from tests.support.wakeups import counting_waiter, held_for, next_batch_in_thread, waiting


def tabloader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tabloader")]


def consume(stream, out: list[int], delay: float = 0.0) -> None:
    for batch in stream:
        out.extend(batch["_id"].tolist())
        time.sleep(delay)


def run_jobs(loader, specs):
    """specs: {job: (batch_size, epochs, delay)} -> {job: delivered ids}, consumed on threads."""
    seen = {name: [] for name in specs}
    streams = {n: loader.open(n, batch_size=b, epochs=e) for n, (b, e, _) in specs.items()}
    threads = [
        threading.Thread(target=consume, args=(streams[n], seen[n], specs[n][2])) for n in specs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for s in streams.values():
        s.close()
    return seen


@pytest.mark.parametrize("sampler", ["dependent", "independent"])
def test_exactly_once_per_epoch_end_to_end(images, sampler):
    images.sql(
        "REGISTER JOB a SELECT image, label FROM imgs WHERE label < 3 WITH (image_size = 16)"
    )
    images.sql("REGISTER JOB b SELECT image FROM imgs WHERE label > 0 WITH (image_size = 16)")
    images.sql("REGISTER JOB c SELECT label FROM imgs WHERE label IN (1, 3)")
    with Loader(images, cache_bytes=1 << 20, workers=3, sampler=sampler) as loader:
        seen = run_jobs(loader, {"a": (7, 2, 0.0), "b": (5, 3, 0.002), "c": (4, 2, 0.0)})
    for name, ids in seen.items():
        expected = sorted(images.job(name).ids)
        epochs = {"a": 2, "b": 3, "c": 2}[name]
        assert len(ids) == epochs * len(expected)
        for e in range(epochs):
            chunk = ids[e * len(expected) : (e + 1) * len(expected)]
            assert sorted(chunk) == expected, f"job {name} epoch {e}"
    assert tabloader_threads() == []


def test_pixels_and_bytes_match_the_source(images, image_folder):
    images.sql("REGISTER JOB full SELECT image, label, path FROM imgs")
    images.sql("REGISTER JOB small SELECT image FROM imgs WITH (image_size = 24)")
    ds = images.dataset("imgs")
    with Loader(images, cache_bytes=8 << 20) as loader:
        full = loader.open("full", batch_size=8, epochs=1)
        batch = full.next_batch()
        for i, row in enumerate(batch["_id"].tolist()):
            path = image_folder / batch["path"][i]
            expected = np.asarray(Image.open(path).convert("RGB"))
            got = batch["image"][i]
            assert got.shape == expected.shape
            assert np.array_equal(got, expected)
            assert int(batch["label"][i]) == ds.take([row], ["label"]).column(1)[0].as_py()
        small = loader.open("small", batch_size=8, epochs=1)
        b2 = small.next_batch()
        assert b2["image"].shape == (8, 24, 24, 3)
        assert b2["image"].dtype == np.uint8
        raw = ds.take([int(b2["_id"][0])], ["image"]).column(1)[0].as_py()
        assert np.array_equal(b2["image"][0], decode_image(raw, size=24))


def test_same_set_same_pace_reads_each_row_once(images):
    for name in ("x", "y", "z"):
        images.sql(f"REGISTER JOB {name} SELECT image FROM imgs WITH (image_size = 16)")
    n = images.job("x").num_rows
    with Loader(images, cache_bytes=64 << 20, workers=2) as loader:
        seen = run_jobs(loader, dict.fromkeys(("x", "y", "z"), (6, 1, 0.0)))
        stats = loader.stats()
    assert all(sorted(ids) == list(range(n)) for ids in seen.values())
    assert stats["decodes"] == n
    assert stats["cache"].puts == n  # each decoded image stored once, served to all three
    # each value a job got was looked up once: a miss where a decode started, else a hit
    # (found cached, or being decoded for another job's batch)
    assert (stats["cache"].misses, stats["cache"].hits) == (n, 2 * n)


def test_the_cache_counts_each_lookup_once(images):
    """A row decoded for a batch is one miss (the second look, for a load that landed
    meanwhile, counted it twice: ``tabloader status`` showed 6,157 misses for 3,000 decodes);
    the next epoch finds every row."""
    images.sql("REGISTER JOB x SELECT image FROM imgs WITH (image_size = 16)")
    n = images.job("x").num_rows
    with Loader(images, cache_bytes=64 << 20, workers=2) as loader:
        counts = []
        for _ in range(2):  # one stream per epoch: no lookup of the next while rows decode
            with loader.open("x", batch_size=4, epochs=1) as stream:
                assert sorted(int(i) for batch in stream for i in batch["_id"]) == list(range(n))
            cache = loader.stats()["cache"]
            counts.append((cache.misses, cache.hits, cache.puts))
    assert counts == [(n, 0, n), (n, n, n)]


def test_independent_sampler_decodes_more_with_a_small_cache(images):
    images.sql("REGISTER JOB x SELECT image FROM imgs WITH (image_size = 16)")
    images.sql("REGISTER JOB y SELECT image FROM imgs WITH (image_size = 16)")
    one_row = 16 * 16 * 3
    decodes = {}
    for sampler in ("dependent", "independent"):
        with Loader(images, cache_bytes=10 * one_row, workers=2, sampler=sampler) as loader:
            x, y = (
                loader.open(j, batch_size=4, prefetch=1, lookahead=8, epochs=1) for j in ("x", "y")
            )
            # one consumer alternating the jobs: the same pace, so the sampler's effect is
            # measured, not the two consumer threads' scheduling by the OS
            for bx, by in zip(x, y, strict=True):
                assert len(bx["_id"]) == len(by["_id"])
            decodes[sampler] = loader.stats()["decodes"]
    n = images.job("x").num_rows
    assert decodes["dependent"] <= 1.3 * n
    assert decodes["independent"] >= 1.5 * n


def test_capacity_and_pins(images):
    images.sql("REGISTER JOB a SELECT image FROM imgs WITH (image_size = 16)")
    images.sql("REGISTER JOB b SELECT image FROM imgs WHERE label < 2 WITH (image_size = 16)")
    capacity = 20 * 16 * 16 * 3
    with Loader(images, cache_bytes=capacity, workers=2) as loader:
        a = loader.open("a", batch_size=4, prefetch=2)
        b = loader.open("b", batch_size=4, prefetch=2)
        for _ in range(5):
            a.next_batch()
            b.next_batch()
            s = loader.stats()["cache"]
            assert s.size_bytes <= s.capacity_bytes <= capacity  # the arena never grows
            assert s.pinned <= 2 * 2 * 4  # only batches being prepared hold pins
        assert loader.stats()["cache"].evictions > 0  # 20 rows fit, the jobs read more
        a.close()
        b.close()
        wait_for(lambda: loader.stats()["cache"].pinned == 0, "every pin released")


def test_closing_a_job_mid_epoch_does_not_disturb_others(images):
    images.sql("REGISTER JOB a SELECT image FROM imgs WITH (image_size = 16)")
    images.sql("REGISTER JOB b SELECT image FROM imgs WHERE label < 3 WITH (image_size = 16)")
    with Loader(images, cache_bytes=1 << 20, workers=2) as loader:
        a = loader.open("a", batch_size=5)
        b = loader.open("b", batch_size=5, epochs=1)
        a.next_batch()
        got = b.next_batch()["_id"].tolist()
        a.close()
        with pytest.raises(LoaderError, match="Job stream 'a' is closed; open the job again"):
            a.next_batch()
        for batch in b:
            got += batch["_id"].tolist()
        assert sorted(got) == sorted(images.job("b").ids)
        again = loader.open("a", batch_size=5, epochs=1)
        ids = [i for batch in again for i in batch["_id"].tolist()]
        assert sorted(ids) == sorted(images.job("a").ids)


def test_corrupt_row_raises_with_its_id_or_is_skipped(corrupt):
    cat, bad = corrupt
    n = cat.dataset("imgs").num_rows
    cat.sql("REGISTER JOB strict SELECT image FROM imgs")
    cat.sql("REGISTER JOB lenient SELECT image FROM imgs")
    cat.sql("REGISTER JOB by_option SELECT image FROM imgs WITH (on_error = 'skip')")
    cat.sql(f"REGISTER JOB other SELECT image FROM imgs WHERE _id <> {bad}")
    with Loader(cat, cache_bytes=32 << 20) as loader:
        strict = loader.open("strict", batch_size=n, epochs=1)
        with pytest.raises(RowReadError, match=f"row {bad}") as info:
            strict.next_batch()
        assert info.value.row_id == bad
        assert info.value.__traceback__ is not None
        lenient = loader.open("lenient", batch_size=n, epochs=1, on_error="skip")
        ids = lenient.next_batch()["_id"].tolist()
        assert sorted(ids) == [i for i in range(n) if i != bad]
        assert lenient.stats()["skipped"] == 1
        by_option = loader.open("by_option", batch_size=n, epochs=1)
        assert len(by_option.next_batch()["_id"]) == n - 1  # the job's on_error
        other = loader.open("other", batch_size=7, epochs=1)
        assert sum(len(b["_id"]) for b in other) == n - 1


def test_resume_mid_epoch_from_state(images):
    images.sql("REGISTER JOB a SELECT label FROM imgs")
    n = images.job("a").num_rows
    with Loader(images, cache_bytes=1 << 20) as loader:
        s = loader.open("a", batch_size=7)
        first = s.next_batch()["_id"].tolist() + s.next_batch()["_id"].tolist()
        state = s.state_dict()
        s.close()
        resumed = loader.open("a", batch_size=7, state=state, epochs=1)
        rest = [i for batch in resumed for i in batch["_id"].tolist()]
    assert sorted(first + rest) == list(range(n))
    assert len(first + rest) == n


def test_open_errors(images):
    images.sql("REGISTER JOB a SELECT label FROM imgs")
    images.sql("REGISTER JOB b SELECT label FROM imgs WHERE label = 0")
    with Loader(images, cache_bytes=1 << 20) as loader:
        with pytest.raises(JobNotFoundError, match="Unknown job 'aa' in .*Did you mean 'a'"):
            loader.open("aa")
        for bad, error, message in (
            ({"batch_size": 0}, OptionError, r"open\(batch_size=0\): .* is out of range"),
            ({"batch_size": "8"}, OptionError, r"batch_size = '8' is not an integer"),
            ({"batch_size": 2.0}, OptionError, r"batch_size = 2\.0 is not an integer"),
            ({"batch_size": 1 << 17}, OptionError, r"from 1 to 65536, e\.g\. WITH"),
            ({"image_size": 100000}, OptionError, r"open\(image_size=100000\): .*from 1 to 32768"),
            ({"image_size": (8, 0)}, OptionError, r"image_size = 0 is out of range"),
            (
                {"batch_size": 65536, "image_size": 512},
                OptionError,
                r"makes one batch of 65536 images 48\.0 GiB .*; use image_size <= 147",
            ),
            ({"prefetch": -1}, LoaderError, r"prefetch -1 is below the range: .* from 1 to 4096"),
            ({"prefetch": True}, LoaderError, r"prefetch True is not a whole number"),
            ({"lookahead": 0}, LoaderError, r"lookahead 0 is below the range"),
            ({"epochs": 0}, LoaderError, r"epochs 0 is below the range: .*, e\.g\. 10\."),
            ({"epochs": [1]}, LoaderError, r"epochs \[1\] is not a whole number"),
        ):
            with pytest.raises(error, match=message):
                loader.open("a", **bad)
        assert loader.stats()["jobs"] == {}
        kept = loader.open("a")  # noqa: F841 (a dropped stream is closed)
        with pytest.raises(LoaderError, match="Job 'a' is open already in this loader"):
            loader.open("a")
        state = {"job": "b", "epoch": 0, "remaining": images.job("a").ids.serialize()}
        with pytest.raises(LoaderError, match="not a non-empty subset of job 'b'"):
            loader.open("b", state=state)
        with pytest.raises(LoaderError, match="Not a job state"):
            loader.open("b", state={"job": "b"})
    with pytest.raises(LoaderError, match="Unknown sampler 'fancy'"):
        Loader(images, sampler="fancy")
    with pytest.raises(LoaderError, match="The loader is closed"):
        loader.open("a")


def test_worker_errors_surface_in_the_consumer(images, monkeypatch):
    images.sql("REGISTER JOB a SELECT label FROM imgs")
    gate, column = threading.Event(), catalog.Catalog.column

    def broken(self, ids, columns):
        raise OSError("disk on fire")

    def held(self, *args, **kwargs):  # the labels read whole land after the batch: it gathers
        gate.wait(60)
        return column(self, *args, **kwargs)

    monkeypatch.setattr(catalog.Catalog, "column", held)
    with Loader(images, cache_bytes=1 << 20) as loader:
        monkeypatch.setattr(type(images.dataset("imgs").reader), "gather", broken)
        stream = loader.open("a", batch_size=4)
        try:
            with pytest.raises(OSError, match="disk on fire"):
                stream.next_batch()
        finally:
            gate.set()
    assert tabloader_threads() == []


@pytest.mark.skipif(not shm_available(), reason="no /dev/shm: no decode processes")
def test_a_batch_starts_its_decodes_before_it_gathers(images, monkeypatch):
    from tabloader.engine._prepare.decoding import DecodePool
    from tabloader.engine._prepare.gather import Gatherer

    events: list[tuple[str, frozenset[int]]] = []  # (step, the rows)
    gather, submit = Gatherer.gather, DecodePool.submit

    def gathering(self, rows, decoders):
        events.append(("gather", frozenset(rows.tolist())))
        return gather(self, rows, decoders)

    def decoding(self, reader, dec, rows, offsets):
        events.append(("decode", frozenset(rows.tolist())))
        return submit(self, reader, dec, rows, offsets)

    monkeypatch.setattr(Gatherer, "gather", gathering)
    monkeypatch.setattr(DecodePool, "submit", decoding)
    images.sql("REGISTER JOB a SELECT image, label FROM imgs WITH (image_size = 8)")
    with Loader(images, cache_bytes=1 << 20, workers=2) as loader:
        loader.wait_ready()  # its decode processes run (they start lazily)
        with loader.open("a", batch_size=4, epochs=1) as stream:
            assert sum(len(b["_id"]) for b in stream) == images.job("a").num_rows
    gathers = [(i, rows) for i, (e, rows) in enumerate(events) if e == "gather"]
    assert len(gathers) == -(-images.job("a").num_rows // 4)
    for at, batch in gathers:  # one epoch: each row is in one batch, decoded once
        started = [i for i, (e, rows) in enumerate(events) if e == "decode" and rows & batch]
        assert started, "a batch gathered without decoding its images"
        assert max(started) < at, events


def test_a_failing_gather_fails_the_batch_whose_decodes_were_started(images, monkeypatch):
    images.sql("REGISTER JOB a SELECT image, label FROM imgs WITH (image_size = 8)")
    gate, column = threading.Event(), catalog.Catalog.column

    def broken(self, ids, columns):
        raise OSError("disk on fire")

    def held(self, *args, **kwargs):  # the labels read whole land after the batch: it gathers
        gate.wait(60)
        return column(self, *args, **kwargs)

    monkeypatch.setattr(catalog.Catalog, "column", held)
    with Loader(images, cache_bytes=1 << 20, workers=2) as loader:
        monkeypatch.setattr(type(images.dataset("imgs").reader), "gather", broken)
        stream = loader.open("a", batch_size=4)
        try:
            with pytest.raises(OSError, match="disk on fire"):
                stream.next_batch()
        finally:
            gate.set()
        stream.close()
        for _ in range(3000):  # the decodes started for it land and release (bounded)
            if loader.arena.stats().pinned == 0:
                break
            time.sleep(0.01)
        assert loader.arena.stats().pinned == 0
    assert tabloader_threads() == []


def test_batches_do_not_wait_for_a_column_being_read_whole(images, monkeypatch):
    """The first batch starts reading its label column whole (once, in the background);
    until that read is done, batches gather their labels row by row, and no lock that
    look-ups, claims and landings take is held."""
    reading, gate = threading.Event(), threading.Event()
    column = catalog.Catalog.column

    def slow(self, *args, **kwargs):
        reading.set()
        gate.wait(60)
        return column(self, *args, **kwargs)

    monkeypatch.setattr(catalog.Catalog, "column", slow)
    images.sql("REGISTER JOB a SELECT image, label FROM imgs WITH (image_size = 8)")
    expected = images.dataset("imgs").take(images.job("a").ids, ["label"]).column("label")
    labels = dict(zip(images.job("a").ids, expected.to_pylist(), strict=True))
    with Loader(images, cache_bytes=1 << 20, workers=2) as loader:
        got: dict[int, int] = {}
        with loader.open("a", batch_size=4, epochs=1) as stream:
            assert reading.wait(30)
            fetcher = loader.scheduler("imgs").fetcher
            done = threading.Thread(
                target=lambda: got.update(
                    (int(i), int(v))
                    for b in stream
                    for i, v in zip(b["_id"], b["label"], strict=True)
                ),
                daemon=True,
            )
            done.start()
            done.join(60)  # bounded: the whole epoch, with the read still blocked
            blocked = not gate.is_set() and fetcher.gatherer.flat("label") is None
            gate.set()
            # the batches' look-ups, claims and landings take the fetcher's lock: none waited
            assert not done.is_alive(), "batches waited for the column being read whole"
        assert blocked
        assert got == labels


@pytest.mark.parametrize("catalog_reads", [True, False])
def test_a_small_column_is_read_whole_from_the_catalog_else_from_the_files(
    images, monkeypatch, catalog_reads
):
    """The labels of a dataset of images come whole from the catalog's table (one columnar
    scan); if that read fails, from the Arrow files; the batches get the same labels."""
    calls: list[tuple[str, str, int]] = []
    column = catalog.Catalog.column

    def spy(self, name, col, *, rows, of=None):
        calls.append((name, col, rows))
        assert of is not None  # the version the loader reads
        assert of.name == name
        if not catalog_reads:
            raise OSError("the catalog cannot be read now")
        return column(self, name, col, rows=rows, of=of)

    monkeypatch.setattr(catalog.Catalog, "column", spy)
    images.sql("REGISTER JOB a SELECT image, label FROM imgs WITH (image_size = 8)")
    ds = images.dataset("imgs")
    stored = ds.take(list(range(ds.num_rows)), ["label"]).column("label").to_numpy()
    with Loader(images, cache_bytes=1 << 20, workers=2) as loader:
        with loader.open("a", batch_size=4, epochs=1) as stream:
            batches = list(stream)
        fetcher = loader.scheduler("imgs").fetcher
        wait_for(lambda: fetcher.gatherer.flat("label") is not None, "the labels read whole")
        assert fetcher.gatherer.flat("label").tolist() == stored.tolist()
    assert calls == [("imgs", "label", ds.num_rows)]
    for b in batches:
        assert b["label"].tolist() == stored[b["_id"]].tolist()


def test_deterministic_for_a_seed(images):
    images.sql("REGISTER JOB a SELECT label FROM imgs")
    orders = []
    for _ in range(2):
        with Loader(images, cache_bytes=1 << 20, seed=5) as loader:
            orders.append(
                [i for b in loader.open("a", batch_size=8, epochs=1) for i in b["_id"].tolist()]
            )
    assert orders[0] == orders[1]
    assert Counter(orders[0]) == Counter(range(images.job("a").num_rows))


def expected_uses(group) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Recomputed from scratch: future uses (remaining sets plus queued rows, not yet in a
    batch being prepared) and each row's next queued round, per arena space."""
    uses = {key: np.zeros_like(counts) for key, counts in group.queues.future.uses.items()}
    nxt = {key: np.full(counts.size, np.inf) for key, counts in group.queues.future.uses.items()}
    for job in group.jobs.values():
        rows = job.queue.q_rows.tolist()
        if job.queue.left:
            rows += list(job.source.sampler.remaining(job.name))
        for _, space in job.plan.prepared:
            np.add.at(uses[space], np.array(rows, dtype=np.intp), 1)
            np.minimum.at(nxt[space], job.queue.q_rows, job.queue.q_rounds)
    return uses, nxt


@pytest.mark.parametrize("sampler", ["dependent", "independent"])
def test_future_uses_match_the_sampler_and_queues(images, sampler):
    """The cache's eviction inputs (kept incrementally) equal a recount at every step."""
    images.sql("REGISTER JOB a SELECT image, label FROM imgs WHERE label < 3 WITH (image_size = 8)")
    images.sql("REGISTER JOB b SELECT image FROM imgs WHERE label > 0 WITH (image_size = 8)")
    images.sql("REGISTER JOB c SELECT label FROM imgs WHERE label IN (1, 3)")
    images.sql("REGISTER JOB d SELECT image FROM imgs WHERE label < 2 WITH (image_size = 8)")
    with Loader(images, cache_bytes=1 << 20, workers=2, sampler=sampler) as loader:
        a = loader.open("a", batch_size=3, epochs=3)
        b = loader.open("b", batch_size=5)
        group = loader.scheduler("imgs")
        checked = 0
        for step in range(40):
            stream = (a, b)[step % 2] if step < 30 else a
            if step == 12:  # a and b give back the rows they sampled ahead (dependent)
                d = loader.open("d", batch_size=2, lookahead=10)
            if 12 <= step < 20:
                next(iter(d))
            if step == 20:
                d.close()
            if step == 25:
                c = loader.open("c", batch_size=2)
            if step == 30:
                b.close()
            if step > 25 and step % 3 == 0:
                next(iter(c))
            if a.epoch < 3:
                next(iter(stream))
            with group.cond:
                want, want_next = expected_uses(group)
                for key, counts in group.queues.future.uses.items():
                    assert counts.tolist() == want[key].tolist(), (step, key)
                    nxt = group.queues.future.next_round[key]
                    assert nxt.tolist() == want_next[key].tolist(), (step, key)
                    checked += int(counts.sum()) + int(np.isfinite(want_next[key]).sum())
        assert checked > 0
        a.close()
        c.close()
        assert all(not counts.any() for counts in group.queues.future.uses.values())
        assert all(np.isinf(nxt).all() for nxt in group.queues.future.next_round.values())


def guarded(fn, timeout: float = 30.0):
    """Call ``fn`` on a thread; a hang fails the test instead of stalling the suite."""
    result: list = []

    def run() -> None:
        try:
            result.append((True, fn()))
        except BaseException as exc:
            result.append((False, exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert result, f"{fn} still blocked after {timeout} s"
    ok, value = result[0]
    if not ok:
        raise value
    return value


@pytest.mark.parametrize("closer", ["stream", "loader"])
def test_close_wakes_a_consumer_waiting_for_rows(images, monkeypatch, closer):
    import tabloader.engine._queue.jobs

    images.sql("REGISTER JOB a SELECT label FROM imgs")
    # the scheduler never samples for the job: its consumer waits for rows that never come
    monkeypatch.setattr(tabloader.engine._queue.jobs.JobState, "hungry", lambda self: False)
    loader = Loader(images, cache_bytes=1 << 20)
    stream = loader.open("a", batch_size=4)
    outcome: list[BaseException] = []
    consumer = next_batch_in_thread(stream, outcome)
    time.sleep(0.3)  # let it reach the wait (if not, it finds the stream closed: same outcome)
    assert consumer.is_alive()
    (stream if closer == "stream" else loader).close()
    consumer.join(30)
    assert not consumer.is_alive(), "the consumer is still waiting after close()"
    assert len(outcome) == 1
    assert isinstance(outcome[0], LoaderError)
    assert "Job stream 'a' is closed" in str(outcome[0])
    loader.close()
    assert tabloader_threads() == []


def test_a_waiting_consumer_sleeps_while_other_jobs_batches_land_and_wakes_on_close(
    images, monkeypatch
):
    """Each consumer is woken for its own batch only (on two cores, waking every consumer of a
    dataset for each landed batch cost more than the batches), and close() still wakes it."""
    images.sql("REGISTER JOB a SELECT label FROM imgs")
    images.sql("REGISTER JOB b SELECT label FROM imgs")
    with Loader(images, cache_bytes=1 << 20) as loader:
        b = loader.open("b", batch_size=4)
        group = loader.scheduler("imgs")
        held = held_for(group, monkeypatch, "a")
        a = loader.open("a", batch_size=4)
        cond = counting_waiter(group, a)
        outcome: list[BaseException] = []
        consumer = next_batch_in_thread(a, outcome)
        wait_for(lambda: waiting(cond), "a's consumer waits for its batch")
        for _ in range(20):  # b's batches land (and b's rounds run) while a waits
            b.next_batch()
        assert held  # a's batches were cut and are still preparing
        assert consumer.is_alive()
        assert cond.notified == 0  # nothing for a: nobody woke its consumer

        closer = threading.Thread(target=a.close, daemon=True)
        closer.start()
        closer.join(30)
        consumer.join(30)
        assert not closer.is_alive()
        assert not consumer.is_alive(), "a's consumer still waits after close()"
        assert len(outcome) == 1
        assert isinstance(outcome[0], LoaderError)
        assert "Job stream 'a' is closed" in str(outcome[0])
        for work in held:  # a closed job's batches may land late: nothing waits for them
            held.land(work)
        assert len(b.next_batch()["_id"]) == 4  # b goes on
        b.close()
    assert tabloader_threads() == []


def test_a_consumer_waiting_for_a_round_wakes_when_its_sampling_fails(images, monkeypatch):
    """A sampler that fails for every job fails each job (alone, its own error), not the
    dataset's scheduler; both consumers waiting for rows wake with it."""
    import tabloader.engine._queue.jobs
    from tabloader.sampling._independent import IndependentSampler

    images.sql("REGISTER JOB a SELECT label FROM imgs")
    images.sql("REGISTER JOB b SELECT label FROM imgs")
    rounds = threading.Event()  # no round until set: the consumers wait for rows
    hungry = tabloader.engine._queue.jobs.JobState.hungry
    monkeypatch.setattr(
        tabloader.engine._queue.jobs.JobState,
        "hungry",
        lambda self: rounds.is_set() and hungry(self),
    )

    def broken(self, jobs, k):
        raise RuntimeError("sampler bug")

    monkeypatch.setattr(IndependentSampler, "sample_many", broken)
    with Loader(images, cache_bytes=1 << 20) as loader:
        streams = [loader.open(name, batch_size=4) for name in ("a", "b")]
        group = loader.scheduler("imgs")
        conds = [counting_waiter(group, s) for s in streams]
        outcome: list[BaseException] = []
        consumers = [next_batch_in_thread(s, outcome) for s in streams]
        wait_for(lambda: all(waiting(c) for c in conds), "both consumers wait for rows")
        rounds.set()  # the scheduler's next look (it polls) runs a round, which fails
        for t in consumers:
            t.join(30)
            assert not t.is_alive(), "a consumer still waits after its sampling failed"
        assert len(outcome) == 2
        for exc in outcome:
            assert isinstance(exc, LoaderError)
            assert "failed in the loader (RuntimeError: sampler bug)" in str(exc)
        assert sorted(str(exc)[:7] for exc in outcome) == ["Job 'a'", "Job 'b'"]
        assert group.error is None
    assert tabloader_threads() == []


def test_next_batch_after_the_last_epoch_raises(images):
    images.sql("REGISTER JOB a SELECT label FROM imgs")
    with Loader(images, cache_bytes=1 << 20) as loader:
        stream = loader.open("a", batch_size=16, epochs=1)
        assert sum(len(b["_id"]) for b in stream) == images.job("a").num_rows
        with pytest.raises(LoaderError, match="has delivered its 1 epoch.*open the job again"):
            guarded(stream.next_batch)


def test_skipped_batches_never_cross_an_epoch(tmp_path):
    """Batches of one row, some rows corrupt: each epoch still has every good row once."""
    images = [np.full((8, 8, 3), i, np.uint8) for i in range(12)]
    encoded = []
    for i, arr in enumerate(images):
        buf = __import__("io").BytesIO()
        Image.fromarray(arr).save(buf, format="PNG")
        encoded.append(buf.getvalue() if i % 4 else b"not an image")  # rows 0, 4, 8 corrupt
    import pyarrow as pa

    with catalog.open_catalog(tmp_path / "cat") as cat:
        cat.import_arrow("t", pa.table({"image": pa.array(encoded, pa.binary())}))
        cat.sql("REGISTER JOB j SELECT image FROM t")
        with Loader(cat, cache_bytes=1 << 20) as loader:
            stream = loader.open("j", batch_size=1, on_error="skip", epochs=5)
            good = [i for i in range(12) if i % 4]
            for epoch in range(5):
                assert stream.epoch == epoch
                ids = guarded(lambda: [int(b["_id"][0]) for b in stream.iter_epoch()])
                assert sorted(ids) == good, f"epoch {epoch}"
            assert stream.stats()["skipped"] == 15
            with pytest.raises(LoaderError, match="has delivered its 5 epoch"):
                guarded(stream.next_batch)


def test_a_dropped_stream_is_closed_and_frees_its_pins(images):
    import gc

    images.sql("REGISTER JOB a SELECT image FROM imgs WITH (image_size = 16)")
    images.sql("REGISTER JOB b SELECT image FROM imgs WITH (image_size = 16)")
    with Loader(images, cache_bytes=1 << 20) as loader:
        a = loader.open("a", batch_size=4)
        b = loader.open("b", batch_size=4, epochs=1)
        a.next_batch()
        del a  # a training thread that died without close()
        gc.collect()
        wait_for(lambda: "a" not in loader.stats()["jobs"], "the scheduler closed job a")
        assert sum(len(x["_id"]) for x in b) == images.job("b").num_rows
        wait_for(lambda: loader.stats()["cache"].pinned == 0, "every pin released")


def test_a_job_reads_only_its_columns(images, monkeypatch):
    images.sql("REGISTER JOB a SELECT label FROM imgs")
    reader_cls = type(images.dataset("imgs").reader)
    asked: list[tuple[tuple[str, ...] | None, int]] = []
    real = reader_cls.gather

    def spy(self, ids, columns):
        asked.append((columns, len(ids)))
        table = real(self, ids, columns)
        assert table.schema.names == list(columns)  # the read fetched that column only
        return table

    monkeypatch.setattr(reader_cls, "gather", spy)
    whole: list[tuple[str, str, int]] = []
    column = catalog.Catalog.column
    monkeypatch.setattr(
        catalog.Catalog,
        "column",
        lambda self, *a, rows, of: whole.append((*a, rows)) or column(self, *a, rows=rows, of=of),
    )
    total = images.dataset("imgs").num_rows
    with Loader(images, cache_bytes=1 << 20) as loader:
        n = sum(len(b["_id"]) for b in loader.open("a", batch_size=8, epochs=1))
        assert loader.stats()["bytes_read"] == 0
    assert n == images.job("a").num_rows
    # a small fixed-width column is read whole, once, from the catalog's table (batches
    # before that read ends gather their own rows, of that column only)
    assert whole == [("imgs", "label", total)]
    assert {columns for columns, _ in asked} <= {("label",)}
    assert all(size <= 8 for _, size in asked)


def test_stats_per_job_and_overall(images):
    images.sql("REGISTER JOB a SELECT image, label FROM imgs WITH (image_size = 16)")
    images.sql("REGISTER JOB b SELECT image, label FROM imgs WITH (image_size = 16)")
    n = images.job("a").num_rows
    with Loader(images, cache_bytes=8 << 20) as loader:
        a = loader.open("a", batch_size=5, epochs=1)
        b = loader.open("b", batch_size=5, epochs=1)
        for _ in zip(a, b, strict=True):  # the cache holds every row: each is read once
            pass
        stats = loader.stats()
        jobs = stats["jobs"]
        assert set(jobs) == {"a", "b"}
        for name in ("a", "b"):
            j = jobs[name]
            assert (j["dataset"], j["rows"], j["epoch"], j["skipped"]) == ("imgs", n, 1, 0)
            assert j["batches"] == -(-n // 5)
            assert j["requests"] == 2 * n
            assert j["loaded"] + j["shared"] == j["requests"]
            assert j["wait_s"] > 0
            assert j["compute_s"] > 0
            assert 0 < j["waiting"] < 1
        # each image decoded once for both jobs; each job gathers its own labels
        assert jobs["a"]["loaded"] + jobs["b"]["loaded"] == n + 2 * n
        assert stats["cache"].puts == stats["decodes"] == n
        ds = stats["datasets"]["imgs"]
        assert ds["read_s"] > 0
        assert ds["decode_s"] > 0
        assert ds["collate_s"] > 0
        assert stats["reads"] == n  # image bytes: the labels are not payload
        assert stats["bytes_read"] == sum(
            len(v.as_py()) for v in images.dataset("imgs").take(list(range(n)), ["image"])[1]
        )


def test_a_failing_scheduler_surfaces_in_every_consumer(images, monkeypatch):
    """What is no one job's (the horizons of all of them) fails the dataset's scheduler:
    every consumer raises it."""
    from tabloader.engine._queue.queues import JobQueues

    images.sql("REGISTER JOB a SELECT image FROM imgs WITH (image_size = 8)")
    images.sql("REGISTER JOB b SELECT label FROM imgs")
    with Loader(images, cache_bytes=1 << 20) as loader:

        def broken(self):
            raise RuntimeError("scheduler bug")

        monkeypatch.setattr(JobQueues, "_set_horizons", broken)
        streams = [loader.open(job, batch_size=4) for job in ("a", "b")]
        for stream in streams:
            with pytest.raises(LoaderError, match="scheduler of dataset 'imgs' failed.*bug"):
                stream.next_batch()
    assert tabloader_threads() == []


def test_a_job_whose_sampling_fails_fails_alone(images, monkeypatch):
    images.sql("REGISTER JOB a SELECT image FROM imgs WITH (image_size = 8)")
    with Loader(images, cache_bytes=1 << 20) as loader:

        def broken(self, jobs, k):
            raise RuntimeError("sampler bug")

        monkeypatch.setattr(DependentSampler, "sample_many", broken)
        stream = loader.open("a", batch_size=4)
        with pytest.raises(LoaderError, match=r"Job 'a' failed in the loader \(Runtime.*bug\)"):
            stream.next_batch()
        assert loader.scheduler("imgs").error is None
    assert tabloader_threads() == []


def test_an_unknown_option_at_open_is_refused_with_the_closest(images):
    images.sql("REGISTER JOB a SELECT label FROM imgs")
    with Loader(images, cache_bytes=1 << 20) as loader:
        with pytest.raises(
            OptionError, match=r"open\(batchsize=8\): Unknown job option 'batchsize'\. Did you"
        ):
            loader.open("a", batchsize=8)
        assert loader.stats()["jobs"] == {}


def test_an_option_added_to_the_table_flows_from_register_to_the_stream(images, monkeypatch):
    """One row in JOB_OPTIONS, and no signature on the way changes."""
    row = JobOption("momentum", int, 9, "a test option", minimum=0, maximum=99, example=9)
    monkeypatch.setitem(JOB_OPTIONS, "momentum", row)
    images.sql("REGISTER JOB a SELECT label FROM imgs WITH (momentum = 5, batch_size = 4)")
    images.sql("REGISTER JOB b SELECT label FROM imgs")
    with Loader(images, cache_bytes=1 << 20) as loader:
        with loader.open("a", epochs=1) as stream:
            assert (stream.spec.momentum, stream.batch_size) == (5, 4)
        with loader.open("a", momentum=7, epochs=1) as stream:
            assert stream.spec.values == {"momentum": 7, "batch_size": 4}
        with loader.open("b", epochs=1) as stream:
            assert stream.spec.momentum == 9  # the table's default
        with pytest.raises(OptionError, match=r"open\(momentum=100\): .* from 0 to 99"):
            loader.open("b", momentum=100)


def test_bad_on_error_policy(images):
    images.sql("REGISTER JOB a SELECT label FROM imgs")
    with (
        Loader(images, cache_bytes=1 << 20) as loader,
        pytest.raises(
            OptionError, match=r"open\(on_error='ignore'\): .* is not one of 'raise', 'skip'"
        ),
    ):
        loader.open("a", on_error="ignore")


def test_the_scheduler_of_a_dataset_no_job_opened_is_a_clear_error(images):
    images.sql("REGISTER JOB a SELECT label FROM imgs")
    with Loader(images, cache_bytes=1 << 20) as loader:
        with pytest.raises(LoaderError, match="No job of dataset 'imgs' was opened .* open one"):
            loader.scheduler("imgs")
        with loader.open("a", batch_size=4):
            assert "a" in loader.scheduler("imgs").jobs


@pytest.mark.parametrize("make", ["default_loader", "Loader"])
def test_exit_with_an_open_stream_is_quiet(tmp_path, image_cat_dir, make):
    """Open loaders close at exit before the thread pools refuse work: a scheduler in the
    middle of a round used to log "cannot schedule new futures after interpreter shutdown"."""
    with catalog.open_catalog(image_cat_dir) as cat:
        cat.sql("REGISTER JOB a SELECT image FROM imgs WITH (image_size = 16)")
    script = textwrap.dedent(f"""
        import time
        from tabloader.engine import {make}
        from tabloader.sampling import DependentSampler
        loader = {make}({str(tmp_path / "cat")!r})  # never closed
        stream = loader.open("a", batch_size=4, lookahead=4)
        stream.next_batch()
        real = DependentSampler.sample_many
        def slow(self, jobs, k):
            time.sleep(0.5)  # the interpreter exits while the scheduler is in a round
            return real(self, jobs, k)
        DependentSampler.sample_many = slow
        stream.next_batch()  # frees room: the scheduler starts a (slow) round
        print("exiting", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "exiting"
    assert proc.stderr == ""


def test_numbers_and_images_never_wake_pyarrows_pandas_shim(tmp_path):
    """pyarrow imports pandas on its first numpy conversion (0.2-0.4 s of a core): batches of
    numbers and images never take that path (tabloader.catalog._arrays), so a service serving them
    never pays it; a job with strings warms it up in the background at open; an exit right after
    is quiet."""
    import pyarrow as pa

    with catalog.open_catalog(tmp_path / "cat", create=True) as cat:
        cat.import_arrow("t", pa.table({"x": list(range(40)), "s": [str(i) for i in range(40)]}))
        cat.sql("REGISTER JOB nums SELECT x FROM t")
        cat.sql("REGISTER JOB strs SELECT x, s FROM t")
    script = textwrap.dedent(f"""
        import sys
        from tabloader.engine import Loader
        loader = Loader({str(tmp_path / "cat")!r}, cache_bytes=1 << 20)
        with loader.open("nums", batch_size=8, epochs=1) as stream:
            assert sum(len(b["x"]) for b in stream) == 40
        print("pandas" in sys.modules)
        loader.open("strs", batch_size=8)  # never closed: exits at once
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
    assert proc.stderr == ""


def test_epochs_count_from_zero_also_after_a_resume(images):
    images.sql("REGISTER JOB a SELECT label FROM imgs")
    n = images.job("a").num_rows
    with Loader(images, cache_bytes=1 << 20) as loader:
        s = loader.open("a", batch_size=7)
        epoch0 = [i for _ in range(-(-n // 7)) for i in s.next_batch()["_id"].tolist()]
        epoch1 = s.next_batch()["_id"].tolist()
        state = s.state_dict()  # in epoch 1, one batch in
        s.close()
        assert state["epoch"] == 1
        assert sorted(epoch0) == list(range(n))
        with loader.open("a", state=state, epochs=1) as past:
            assert list(past) == []  # epoch 1 is past the end
        with loader.open("a", state=state, epochs=2) as rest:
            epoch1 += [i for b in rest for i in b["_id"].tolist()]
    assert sorted(epoch1) == list(range(n))


def test_jobs_that_only_gather_sample_independently(images):
    """Dependent sampling is for sharing decodes; a label-only job reads its own values either
    way, so it takes the vectorized independent sampler and still sees each row once."""
    images.sql("REGISTER JOB pix SELECT image FROM imgs WITH (image_size = 8)")
    images.sql("REGISTER JOB lab SELECT label FROM imgs")
    with Loader(images, cache_bytes=1 << 20) as loader:
        pix, lab = loader.open("pix", epochs=1), loader.open("lab", epochs=1)
        sched = loader.scheduler("imgs")
        assert type(pix.rank_state.job.source.sampler).__name__ == "DependentSampler"
        assert type(lab.rank_state.job.source.sampler).__name__ == "IndependentSampler"
        assert sched.queues.sampler.jobs() == ["pix"]
        assert sched.queues.gather_sampler.jobs() == ["lab"]
        for stream in (pix, lab):
            ids = [i for b in stream for i in b["_id"].tolist()]
            assert sorted(ids) == list(range(images.job("lab").num_rows))


def test_rows_of_a_submitted_batch_are_kept_until_its_look_up(images):
    """A batch cut from a job's queue waits for a pool thread before its look-up pins its
    rows; meanwhile the scheduler no longer counts them as future uses. An eviction in that
    window must take other rows: the batch would decode its rows again at once."""
    images.sql("REGISTER JOB a SELECT image FROM imgs WHERE _id < 8 WITH (image_size = 16)")
    images.sql("REGISTER JOB b SELECT image FROM imgs WHERE _id < 8 WITH (image_size = 16)")
    one_row = 16 * 16 * 3
    with Loader(images, cache_bytes=12 * one_row, workers=1, decode="threads") as loader:
        a = loader.open("a", batch_size=4, epochs=1)
        assert sorted(i for batch in a for i in batch["_id"]) == list(range(8))
        a.close()
        assert loader.stats()["decodes"] == 8  # all 8 cached, 4 slots free
        gate = threading.Event()
        loader.scheduler("imgs").fetcher.pool.submit(
            gate.wait, 30
        )  # the only pool thread: b's batches wait behind it
        try:
            b = loader.open("b", batch_size=4, prefetch=2, epochs=1)
            group = loader.scheduler("imgs")

            def submitted() -> bool:
                with group.cond:
                    return len(group.jobs["b"].ranks[0].batches) == 2

            wait_for(submitted, "b's two batches submitted")
            # other values of the same size take the 4 free slots, then evict 4 rows:
            # released probes (needed by nobody), not b's rows
            arena = loader.arena
            probe = arena.space("probe", num_rows=8, fixed=True)
            for row in range(8):
                off = arena.put(probe, row, np.full((16, 16, 3), row, np.uint8))
                arena.release(np.array([off]))
        finally:
            gate.set()
        assert sorted(i for batch in b for i in batch["_id"]) == list(range(8))
        b.close()
        assert loader.stats()["decodes"] == 8  # b decoded nothing again
        assert arena.stats().evictions == 4


def test_access_log_records_every_look_up_and_its_release(images, tmp_path):
    from tabloader.engine._arena.accounting import AccessLog
    from tests.support.cachesim import belady_pinned

    images.sql("REGISTER JOB x SELECT image FROM imgs WITH (image_size = 16)")
    images.sql("REGISTER JOB y SELECT image FROM imgs WHERE label < 2 WITH (image_size = 16)")
    images.sql("REGISTER JOB z SELECT label FROM imgs")  # gathers only: nothing to log
    path = tmp_path / "access.npz"
    with Loader(images, cache_bytes=20 * 16 * 16 * 3, workers=2, access_log=path) as loader:
        specs = {"x": (4, 2), "y": (3, 1), "z": (4, 1)}  # batch size, epochs
        streams = [
            loader.open(j, batch_size=b, prefetch=2, epochs=e) for j, (b, e) in specs.items()
        ]
        for stream in streams:  # at most 2 x 2 x 4 rows held: the 20-row arena never overflows
            for _ in stream:
                pass
            stream.close()
        decodes = loader.stats()["decodes"]
    with np.load(path) as log:
        kind, space, row = log["kind"], log["space"], log["row"]
    looks = kind == AccessLog.LOOKUP
    x, y = (sorted(images.job(j).ids) for j in ("x", "y"))
    assert Counter(row[looks].tolist()) == Counter(2 * x + y)
    assert len(np.unique(space)) == 1  # one column prepared one way
    held = Counter()
    for is_look, r in zip(looks.tolist(), row.tolist(), strict=True):
        held[r] += 1 if is_look else -1
        assert held[r] >= 0, "released before its look-up"
    assert not +held  # every look-up released
    assert belady_pinned(kind, space, row, 10**6) == len(x)  # room for all: one read each
    assert belady_pinned(kind, space, row, 20) <= decodes


def test_access_log_needs_an_existing_directory(images, tmp_path):
    with pytest.raises(LoaderError, match="access_log=.*directory does not exist"):
        Loader(images, access_log=tmp_path / "missing" / "access.npz")


def _rows_after_a_late_open(images, monkeypatch, *, give_back: bool) -> tuple[list, list]:
    """Job x samples 40 rows ahead, then y opens; both read an epoch at the same pace."""
    if not give_back:
        monkeypatch.setattr(DependentSampler, "shares_rounds", False)  # takes nothing back
    for name in ("x", "y"):
        images.sql(f"REGISTER OR REPLACE JOB {name} SELECT image FROM imgs WITH (image_size = 8)")
    with Loader(images, cache_bytes=1 << 20, workers=2) as loader:
        x = loader.open("x", batch_size=4, prefetch=1, lookahead=40, epochs=1)
        job = loader.scheduler("imgs").jobs["x"]
        wait_for(lambda: job.queue.q_rows.size + job.in_flight() >= 40, "x sampled ahead")
        y = loader.open("y", batch_size=4, prefetch=1, lookahead=40, epochs=1)
        xs: list[int] = []
        ys: list[int] = []
        for bx, by in zip(x, y, strict=True):  # one consumer: the same pace
            xs += bx["_id"].tolist()
            ys += by["_id"].tolist()
        x.close()
        y.close()
    return xs, ys


def test_a_job_opened_later_shares_the_rows_another_sampled_ahead(images, monkeypatch):
    """The rows x sampled ahead (not yet cut into batches) go back when y opens, and the next
    rounds hand them out to both: y's batches are x's from x's second batch on. Without that,
    y's first 40 rows would be drawn alone, and x and y would agree only by chance."""

    def near(xs: list[int], ys: list[int]) -> int:  # y's i-th row within x's i+4 +- 4
        return sum(ys[i] in xs[i : i + 9] for i in range(40))

    xs, ys = _rows_after_a_late_open(images, monkeypatch, give_back=True)
    n = images.job("x").num_rows
    assert sorted(xs) == sorted(ys) == list(range(n))  # still exactly once each
    assert near(xs, ys) >= 30  # DSA: y draws its 4 rows x had at random times
    xs, ys = _rows_after_a_late_open(images, monkeypatch, give_back=False)
    assert near(xs, ys) <= 15  # chance: 9 of 60 rows, 6 of 40


def test_a_service_batch_of_cached_rows_needs_no_pool_thread(images, monkeypatch):
    """A batch handed over to the loader service (``remote``) whose rows are in the arena and
    whose other columns are read whole is looked up and pinned where it is cut: no pool task,
    no thread wake-up. A job in this process (it copies its batch) still uses the pool."""
    images.sql("REGISTER JOB r SELECT image, label FROM imgs WITH (image_size = 16)")
    n = images.job("r").num_rows
    with Loader(images, cache_bytes=4 * n * 16 * 16 * 3, workers=2, decode="threads") as loader:
        local = loader.open("r", batch_size=4, epochs=1)
        assert sorted(i for b in local for i in b["_id"].tolist()) == list(range(n))
        local.close()  # every row decoded, the labels read whole
        group = loader.scheduler("imgs")
        wait_for(lambda: group.fetcher.gatherer.flat("label") is not None, "labels read whole")
        tasks: list[str] = []
        pool = group.fetcher.pool
        submit = pool.submit

        def counting(fn, *args, **kwargs):
            tasks.append(getattr(fn, "__name__", repr(fn)))
            return submit(fn, *args, **kwargs)

        monkeypatch.setattr(pool, "submit", counting)
        remote = loader.serve("r", batch_size=4, epochs=1)
        table = images.sql("SELECT _id, label FROM imgs").to_pydict()
        labels = dict(zip(table["_id"], table["label"], strict=True))
        seen = []
        while (handed := remote.take()) is not None:
            image = {c.name: c for c in handed.columns}["image"]
            assert not image.private
            assert (image.starts >= 0).all()
            batch = handed.copy_out(loader.arena.buffer, BatchMemory())
            seen += batch["_id"].tolist()
            assert batch["label"].tolist() == [labels[i] for i in batch["_id"]]
            loader.arena.release(image.starts)
        remote.close()
        assert sorted(seen) == list(range(n))
        assert tasks == []
        assert loader.stats()["decodes"] == n
        local = loader.open("r", batch_size=4, epochs=1)
        assert sum(len(b["_id"]) for b in local) == n
        local.close()
        assert "_start" in tasks


def test_a_dataset_dropped_and_imported_again_is_read_anew(images, tmp_path):
    """After DROP and a new import under the same name, a job reads the new rows, never the
    old dataset's values cached under the same ids; while a job still reads the dropped one,
    opening a job of the new one is refused."""
    from tabloader.datagen import make_imagefolder

    other = make_imagefolder(tmp_path / "other", num_images=12, num_classes=2, seed=7)
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    images.sql("REGISTER JOB k SELECT image FROM imgs WITH (image_size = 16)")
    with Loader(images, cache_bytes=1 << 20, workers=2) as loader:
        old = loader.open("j", batch_size=4, epochs=1)
        assert sum(len(b["_id"]) for b in old) == images.job("j").num_rows  # all cached
        old.close()
        keep = loader.open("k", batch_size=4, epochs=None)  # still reads the old rows
        images.drop_dataset("imgs", cascade=True)
        images.import_imagefolder("imgs", other)
        images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
        with pytest.raises(LoaderError, match=r"dropped and imported again while job\(s\) k "):
            loader.open("j", batch_size=4, epochs=1)
        keep.close()
        new = loader.open("j", batch_size=4, epochs=1)
        seen = {i: img for b in new for i, img in zip(b["_id"].tolist(), b["image"], strict=True)}
        paths = images.sql("SELECT _id, path FROM imgs").to_pydict()
        assert sorted(seen) == sorted(paths["_id"]) == list(range(12))
        for i, path in zip(paths["_id"], paths["path"], strict=True):
            expected = decode_image((other / path).read_bytes(), size=16)
            assert np.array_equal(seen[i], expected), i
        new.close()


def test_a_shared_decode_that_fails_in_its_slot_frees_the_slot(corrupt):
    """An augmented job's shared decode is written into its arena slot, reserved before the
    decode: a row whose bytes fail (a truncated JPEG) gives its slot back, every other row's
    decode stays cached once, and nothing is left pinned."""
    cat, bad = corrupt
    cat.sql(
        "REGISTER JOB aug SELECT image FROM imgs "
        "WITH (augment = 'RandomResizedCrop(8)', on_error = 'skip')"
    )
    rows = cat.job("aug").num_rows
    with Loader(cat, cache_bytes=8 << 20, workers=2) as loader:
        with loader.open("aug", batch_size=4, epochs=1) as stream:
            seen = [int(i) for b in stream for i in b["_id"]]
        stats = loader.arena.stats()
    assert sorted(seen) == sorted(set(range(rows)) - {bad})
    assert stats.pinned == 0
    assert stats.entries == rows - 1  # every good row's decode, once; no slot left behind


def test_image_jobs_never_wake_pyarrows_pandas_shim(image_cat_dir):
    """The first batches of an augmented and an evaluation job (reads of image values, their
    labels, their ids) take no path that imports pandas: 0.2-0.4 s of a cold service's first
    batch when pandas is installed."""
    with catalog.open_catalog(image_cat_dir) as cat:
        cat.sql("REGISTER JOB aug SELECT image, label FROM imgs WITH (augment = 'RandomCrop(8)')")
        cat.sql("REGISTER JOB ev SELECT image, label FROM imgs WITH (image_size = 8)")
    script = textwrap.dedent(f"""
        import sys
        from tabloader.engine import Loader
        loader = Loader({str(image_cat_dir)!r}, cache_bytes=1 << 24, decode="threads")
        for job in ("aug", "ev"):
            door = loader.serve if job == "aug" else loader.open
            with door(job, batch_size=8, epochs=1) as stream:
                assert stream.take() is not None
        print("pandas" in sys.modules)
        loader.close()
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
