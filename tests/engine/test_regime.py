"""Which regime each job is in (DESIGN §17): waiting on the loader, or on its own step."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from tabloader.engine import Loader
from tabloader.engine._queue.jobs import Regime


def test_a_regime_follows_the_share_of_the_last_window_spent_waiting():
    regime = Regime()
    assert regime.name == "loader"  # not measured yet: it waits for its first batches
    assert regime.update(0.0, 0.0, now=0.0) == "loader"
    assert regime.update(0.125, 0.25, now=0.5) == "loader"  # within the window: not judged yet
    assert regime.update(0.25, 0.75, now=1.0) == "step"  # 0.25 s of 1 s waiting
    assert regime.update(1.0, 1.0, now=2.0) == "loader"  # then 0.75 of 1 s
    assert regime.update(1.0, 1.0, now=3.0) == "loader"  # nothing reported: as it was
    assert regime.update(1.5, 1.5, now=4.0) == "loader"  # half and half: the loader's
    assert regime.update(1.75, 2.5, now=5.0) == "step"


def test_stats_say_a_job_that_computes_between_batches_waits_on_its_step(cat):
    cat.import_arrow("t", pa.table({"x": np.arange(400)}))
    cat.register_job("slow", "t")
    cat.register_job("idle", "t")
    with Loader(cat, workers=1, decode="threads") as loader:
        slow = loader.open("slow", batch_size=4)
        idle = loader.open("idle", batch_size=4)  # (kept: a dropped stream closes)
        for _ in range(12):  # 1.2 s of steps of 0.1 s, each batch there before it is asked for
            slow.next_batch()
            time.sleep(0.1)
        slow.next_batch()
        jobs = loader.stats()["jobs"]
        assert jobs["slow"]["regime"] == "step", jobs["slow"]
        assert jobs[idle.name]["regime"] == "loader"  # not measured: it waits for its first batch
