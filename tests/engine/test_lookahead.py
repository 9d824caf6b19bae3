"""The lookahead follows the cache and the jobs' paces (issue 35, item 5): a job opened
without ``lookahead`` samples as far ahead as the arena holds its values, so the arena knows
the next use of what it holds; its share of that window follows its measured pace."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from tabloader.engine import Loader
from tabloader.engine._arena.arena import values_that_fit
from tabloader.engine._queue.jobqueue import RoundLog
from tabloader.engine._queue.jobs import Pace
from tabloader.engine._queue.queues import LOOKAHEAD_CACHES

ROWS = 3000
CACHE = 256 << 10  # 4 slabs of 85 values of 16x16x3: 340 rows


@pytest.fixture
def tiny(cat):
    """``ROWS`` rows of one 24x24 JPEG, and jobs ``a``, ``b`` on all of them."""
    buf = io.BytesIO()
    Image.fromarray(np.full((24, 24, 3), 90, np.uint8)).save(buf, "JPEG")
    cat.import_arrow("t", pa.table({"image": pa.array([buf.getvalue()] * ROWS, pa.binary())}))
    for name in ("a", "b"):
        cat.sql(f"REGISTER JOB {name} SELECT image FROM t WITH (image_size = 16)")
    return cat


def test_a_jobs_lookahead_is_the_caches_capacity_in_rounds(tiny):
    cache_rows = values_that_fit(CACHE, 16 * 16 * 3)
    assert cache_rows == 340
    with Loader(tiny, cache_bytes=CACHE, workers=2) as loader:
        stream = loader.open("a", batch_size=16, epochs=1)
        next(iter(stream))
        sched = loader.scheduler("t")
        with sched.cond:
            job = sched.jobs["a"]
            assert job.queue.cache_rows == cache_rows
            assert job.queue.horizon == LOOKAHEAD_CACHES * cache_rows  # one job: the whole window
            ahead = job.queue.q_rows.size + job.in_flight()
            assert job.queue.horizon // 2 < ahead <= job.queue.horizon + 16
            # the arena knows the next use of every row queued
            [space] = job.spaces()
            known = np.isfinite(sched.queues.future.next_round[space])
            assert known.sum() == job.queue.q_rows.size
        stream.close()
        fixed = loader.open("b", batch_size=16, epochs=1, lookahead=32)
        next(iter(fixed))
        with sched.cond:
            job = sched.jobs["b"]
            assert job.queue.horizon == job.queue.floor == 16 * max(2, job.prefetch)
            assert job.queue.q_rows.size + job.in_flight() <= job.queue.horizon + 16
        fixed.close()


def test_each_jobs_share_of_the_window_follows_its_pace(tiny):
    with Loader(tiny, cache_bytes=CACHE, workers=2) as loader:
        streams = [loader.open(j, batch_size=16, epochs=1) for j in ("a", "b")]
        sched = loader.scheduler("t")
        with sched.cond:
            a, b = sched.jobs["a"], sched.jobs["b"]
            a.pace, b.pace = Pace(), Pace()
            for t in range(5):  # a takes 4 batches a second, b one
                a.pace.add(64, now=float(t))
                b.pace.add(16, now=float(t))
            sched.queues._set_horizons()
            window = LOOKAHEAD_CACHES * a.queue.cache_rows
            # as measured now (the time since the marks counts), a is 4x b; unmeasured: alike
            assert a.queue.horizon == window
            assert abs(b.queue.horizon - window // 4) <= 1
        for s in streams:
            s.close()


def test_pace_is_rows_over_the_last_seconds():
    pace = Pace()
    assert pace.rate(now=0.0) is None
    for t in range(20):
        pace.add(100, now=t * 0.5)  # 200 rows a second
    assert pace.rate(now=9.5) == pytest.approx(200, rel=0.15)
    assert pace.rate(now=9.5 + 60) < 20  # a job that stopped taking slows down


def test_the_round_log_keeps_the_last_rounds_it_is_asked_to():
    log = RoundLog()
    for start in range(0, 1000, 10):
        log.add(np.arange(start, start + 10), keep=50)
        assert log.rounds()[-10:].tolist() == list(range(start, start + 10))
        assert log.rounds().size >= min(start + 10, 50)
    log.keep_from(995)
    assert log.rounds().tolist() == [995, 996, 997, 998, 999]
