"""The loader's thread pool: the earliest batch's tasks run first."""

from __future__ import annotations

import threading
import time

import pytest

from tabloader.engine._prepare.pool import PriorityPool


def test_tasks_run_lowest_priority_first_and_in_order_within_one():
    pool = PriorityPool(1, "tl-test")
    gate, ran = threading.Event(), []
    pool.submit(gate.wait, 30)  # holds the one thread while the rest queue
    futures = [
        pool.submit(ran.append, name, priority=p)
        for name, p in (("c", 5), ("a1", 1), ("b", 3), ("a2", 1), ("z", 0))
    ]
    gate.set()
    for f in futures:
        f.result(30)
    assert ran == ["z", "a1", "a2", "b", "c"]
    pool.shutdown()


def test_errors_reach_the_future_and_shutdown_cancels_or_refuses():
    pool = PriorityPool(2, "tl-test")

    def boom():
        raise OSError("disk on fire")

    with pytest.raises(OSError, match="disk on fire"):
        pool.submit(boom).result(30)
    gate = threading.Event()
    running = [pool.submit(gate.wait, 30) for _ in range(2)]
    deadline = time.monotonic() + 30
    while not all(f.running() for f in running):  # both threads have taken theirs
        assert time.monotonic() < deadline, "the pool's threads did not start their tasks"
        time.sleep(0.01)
    queued = pool.submit(print, "never")
    threading.Thread(target=lambda: (threading.Event().wait(0.2), gate.set())).start()
    pool.shutdown(wait=True, cancel_futures=True)
    assert queued.cancelled()
    assert all(f.result(0) for f in running)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print, "late")
    assert not [t for t in threading.enumerate() if t.name.startswith("tl-test")]
