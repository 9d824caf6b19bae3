"""``rank_timeout``: a rank that never opens its job makes the waiting ranks raise, in a
bounded time, instead of holding them up forever (accelerate's default dispatch opens the
job on process 0 only)."""

from __future__ import annotations

import threading
import time

import pytest

from tabloader.catalog import LoaderError, OptionError
from tabloader.engine import Loader
from tabloader.service._client import RemoteLoader
from tests.support.polling import wait_for
from tests.support.service import TIMEOUT, start_service
from tests.support.threads import JOIN_S, epochs_of, run_threads
from tests.support.wakeups import counting_waiter, waiting

NEVER_OPENED = (
    r"job 'j': rank 0 waited 1 s for rank 1, which never opened the job\. Every rank must "
    r"iterate its own JobDataset\. Under accelerate .* "
    r"tabloader\.integrations\.accelerate\.prepare\(accelerator, dataset\) .* "
    r"tabloader\.integrations\.transformers\.JobTrainer instead of Trainer.* "
    r"uses another world_size\. Raise rank_timeout to wait longer"
)


def test_a_rank_that_never_opens_makes_the_waiting_rank_raise(images):
    images.sql("REGISTER JOB j SELECT label FROM imgs WITH (rank_timeout = 1)")
    rows = set(images.job("j").ids)
    with Loader(images, cache_bytes=1 << 20) as loader:
        r0 = loader.open("j", batch_size=5, rank=0, world_size=2, epochs=1)
        with pytest.raises(LoaderError, match=NEVER_OPENED):
            r0.next_batch()
        with pytest.raises(LoaderError, match=NEVER_OPENED):  # again: it still waits
            r0.next_batch()
        r0.close()
        assert "j" not in loader.stats()["jobs"]  # nothing left of the job
        streams = [loader.open("j", batch_size=5, rank=r, world_size=2, epochs=1) for r in (0, 1)]
        seen: list[list[list[list[int]]]] = [[], []]
        run_threads([lambda r=r: epochs_of(streams[r], 1, seen[r]) for r in (0, 1)])
        assert sorted(i for r in (0, 1) for b in seen[r][0] for i in b) == sorted(rows)
        for s in streams:
            s.close()
        assert loader.stats()["cache"].pinned == 0


def test_every_missing_rank_is_named(images):
    images.sql("REGISTER JOB j SELECT label FROM imgs")
    with Loader(images, cache_bytes=1 << 20) as loader:
        r1 = loader.open("j", batch_size=4, rank=1, world_size=4, rank_timeout=1)
        r2 = loader.open("j", batch_size=4, rank=2, world_size=4, rank_timeout=1)
        with pytest.raises(LoaderError, match=r"rank 1 waited 1 s for ranks 0, 3, which never"):
            r1.next_batch()
        r2.close()  # a rank that left is not waited for
        with pytest.raises(LoaderError, match=r"rank 1 waited 1 s for ranks 0, 3, which never"):
            r1.next_batch()
        r1.close()


def test_a_job_dataset_whose_other_rank_never_opens_raises(images):
    pytest.importorskip("torch")
    from tabloader.torch import JobDataset

    images.sql("REGISTER JOB j SELECT label FROM imgs")
    with Loader(images, cache_bytes=1 << 20) as loader:
        data = JobDataset("j", loader=loader, rank=0, world_size=2, batch_size=5, rank_timeout=1)
        with pytest.raises(LoaderError, match=NEVER_OPENED):
            next(iter(data))
        data.close()
        assert "j" not in loader.stats()["jobs"]


def test_a_world_that_never_comes_costs_nothing(images):
    """Rank 0 of 60 opens alone: the other ranks have no state, nothing is sampled or dealt
    (a batch for each pending rank was prepared before), and the message names a few."""
    images.sql("REGISTER JOB j SELECT label FROM imgs WITH (drop_last = false)")
    with Loader(images, cache_bytes=1 << 20) as loader:
        r0 = loader.open("j", batch_size=1, rank=0, world_size=60, rank_timeout=1)
        job = loader.scheduler("imgs").jobs["j"]
        assert list(job.ranks) == [0]
        with pytest.raises(LoaderError, match=r"ranks 1, 2, 3, 4, 5, 6, 7, 8 and 51 more, which"):
            r0.next_batch()
        assert job.queue.q_rows.size == 0
        assert not job.ranks[0].batches
        assert loader.stats()["jobs"]["j"]["ranks"][0]["loaded"] == 0
        r0.close()


def test_the_timeout_counts_from_the_wait_not_from_the_open(images):
    """Rank 0 opens, waits longer than rank_timeout before it reads, then reads: it waits for
    rank 1, which opens half a second into that wait; both read their epoch."""
    images.sql("REGISTER JOB j SELECT label FROM imgs")
    rows = set(images.job("j").ids)
    opts = {"batch_size": 5, "world_size": 2, "epochs": 1, "rank_timeout": 2}
    with Loader(images, cache_bytes=1 << 20) as loader:
        r0 = loader.open("j", rank=0, **opts)
        time.sleep(2.5)  # longer than rank_timeout since the open: not counted
        cond = counting_waiter(loader.scheduler("imgs"), r0)
        seen: list[list[list[list[int]]]] = [[], []]
        failed: list[BaseException] = []

        def read() -> None:
            try:
                epochs_of(r0, 1, seen[0])
            except BaseException as exc:
                failed.append(exc)

        consumer = threading.Thread(target=read, daemon=True)
        consumer.start()
        wait_for(lambda: waiting(cond) or bool(failed), "rank 0 waits for rank 1")
        assert not failed
        time.sleep(0.5)  # slow to open, within rank_timeout
        r1 = loader.open("j", rank=1, **opts)
        run_threads([lambda: epochs_of(r1, 1, seen[1])])
        consumer.join(JOIN_S)
        assert not consumer.is_alive()
        assert not failed
        assert len(seen[0][0]) == len(seen[1][0]) == len(rows) // 10
        r0.close()
        r1.close()


def test_a_rank_that_opened_but_is_slow_never_times_out(images):
    """Rank 1 takes longer than rank_timeout between its batches: rank 0, in lockstep, waits
    for it as long as it takes."""
    images.sql("REGISTER JOB j SELECT label FROM imgs WHERE _id < 20 WITH (rank_timeout = 1)")
    opts = {"batch_size": 5, "world_size": 2, "epochs": 1, "prefetch": 1}
    with Loader(images, cache_bytes=1 << 20) as loader:
        streams = [loader.open("j", rank=r, **opts) for r in (0, 1)]
        seen: list[list[list[int]]] = [[], []]

        def slow() -> None:
            for batch in streams[1]:
                time.sleep(1.5)
                seen[1].append(batch["_id"].tolist())

        run_threads([lambda: seen[0].extend(b["_id"].tolist() for b in streams[0]), slow])
        assert len(seen[0]) == len(seen[1]) == 2
        assert sorted(i for s in seen for b in s for i in b) == list(range(20))
        for s in streams:
            s.close()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, r"rank_timeout = 0 is out of range; .* from 1 to 86400, e\.g\. WITH \(rank_timeout"),
        ("'x'", r"rank_timeout = 'x' is not an integer"),
    ],
)
def test_bad_rank_timeout(images, value, message):
    with pytest.raises(OptionError, match=message):
        images.sql(f"REGISTER JOB j SELECT label FROM imgs WITH (rank_timeout = {value})")
    images.sql("REGISTER JOB j SELECT label FROM imgs")
    with Loader(images, cache_bytes=1 << 20) as loader, pytest.raises(OptionError, match=message):
        loader.open("j", rank_timeout=0 if value == 0 else "x")


def test_a_client_of_the_service_gets_the_timeout_and_can_open_again(cat_dir):
    proc = start_service(cat_dir)
    try:
        with RemoteLoader(cat_dir, start=False) as remote:
            opts = {"batch_size": 2, "world_size": 2, "epochs": 1, "rank_timeout": 1}
            r0 = remote.open("a", rank=0, **opts)
            with pytest.raises(LoaderError, match=NEVER_OPENED.replace("'j'", "'a'")):
                r0.take()
            r0.close()
            deadline = time.monotonic() + TIMEOUT
            while remote.stats()["jobs"]:
                assert time.monotonic() < deadline, "the job never left the service"
                time.sleep(0.05)
            streams = [remote.open("a", rank=r, **opts) for r in (0, 1)]
            seen: list[list[list[list[int]]]] = [[], []]
            run_threads([lambda r=r: epochs_of(streams[r], 1, seen[r]) for r in (0, 1)])
            assert len(seen[0][0]) == len(seen[1][0]) > 0
            for s in streams:
                s.close()
    finally:
        proc.terminate()
        proc.wait(TIMEOUT)
