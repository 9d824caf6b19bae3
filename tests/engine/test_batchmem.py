"""BatchMemory: a block is reused only once nothing can see it."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
import torch

from tabloader.engine._deliver.batchmem import BatchMemory


def test_a_dropped_array_gives_its_block_back():
    mem = BatchMemory()
    a = mem.empty((4, 8, 3))
    assert a.shape == (4, 8, 3)
    assert a.dtype == np.uint8
    assert a.flags.writeable
    address = a.ctypes.data
    del a
    b = mem.empty((4, 8, 3))
    assert b.ctypes.data == address
    assert (mem.fresh, mem.reused) == (1, 1)


@pytest.mark.parametrize(
    "keep",
    [
        lambda a: a[1:3],  # a slice
        lambda a: a.reshape(-1),  # a reshape
        lambda a: torch.from_numpy(a),  # a tensor
        lambda a: torch.from_numpy(a)[0],  # a view of a tensor
        lambda a: memoryview(a),
    ],
    ids=["slice", "reshape", "tensor", "tensor-view", "memoryview"],
)
def test_a_block_is_not_reused_while_a_view_of_it_lives(keep):
    mem = BatchMemory()
    a = mem.empty((4, 16))
    a[:] = 7
    kept = keep(a)
    address = a.ctypes.data
    del a
    gc.collect()
    b = mem.empty((4, 16))
    assert b.ctypes.data != address
    b[:] = 0  # the job that got the new batch writes into it
    assert (np.asarray(kept) == 7).all()  # the other still reads its own values
    del kept
    gc.collect()
    assert mem.empty((4, 16)).ctypes.data == address  # now it comes back
    assert (mem.fresh, mem.reused) == (2, 1)


def test_blocks_past_keep_bytes_are_released():
    mem = BatchMemory(keep_bytes=3 * 1000)
    held = [mem.empty((1000,)) for _ in range(5)]
    del held
    assert mem.free_bytes() == 3000  # the two that came back first were released
    again = [mem.empty((1000,)) for _ in range(5)]
    assert (mem.fresh, mem.reused) == (7, 3)
    del again


def test_other_shapes_and_dtypes_of_the_same_size_share_blocks():
    mem = BatchMemory()
    a = mem.empty((2, 6), np.float32)  # 48 bytes
    address = a.ctypes.data
    del a
    b = mem.empty((48,))
    assert b.ctypes.data == address
    assert b.dtype == np.uint8


def test_an_empty_shape_needs_no_block():
    mem = BatchMemory()
    assert mem.empty((0, 224, 224, 3)).shape == (0, 224, 224, 3)
    assert mem.fresh == 0


def test_blocks_come_back_from_other_threads():
    """A job's consumer thread drops its batches while the loader's threads allocate."""
    mem = BatchMemory()
    batches: list[np.ndarray] = [mem.empty((64, 32)) for _ in range(200)]
    start = threading.Barrier(3)

    def drop(part: list[np.ndarray]) -> None:
        start.wait()
        while part:
            part.pop()

    parts = [batches[:100], batches[100:]]
    del batches
    threads = [threading.Thread(target=drop, args=(p,)) for p in parts]
    for t in threads:
        t.start()
    start.wait()
    got = [mem.empty((64, 32)) for _ in range(200)]
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    addresses = {g.ctypes.data for g in got}
    assert len(addresses) == 200  # no block handed out twice
    assert mem.fresh + mem.reused == 400


def test_blocks_of_a_size_no_longer_asked_for_make_room():
    mem = BatchMemory(keep_bytes=10_000)
    old = [mem.empty((1000,)) for _ in range(10)]  # e.g. the batches of another image size
    del old
    assert mem.free_bytes() == 10_000
    for _ in range(5):
        mem.empty((999,))  # dropped at once: it comes back, an old block makes room
    assert (mem.fresh, mem.reused) == (11, 4)
    assert mem.free_bytes() == 9 * 1000 + 999


def test_a_batch_the_garbage_collector_frees_inside_empty_does_not_deadlock(monkeypatch):
    """A batch caught in a reference cycle is freed whenever the collector runs: possibly on
    a thread inside ``empty``, with the pool's lock held. Its block must still come back."""
    mem = BatchMemory()
    gc.disable()
    try:
        cycle: list = [mem.empty((64,))]
        cycle.append(cycle)
        del cycle
        drain = mem.drain_locked

        def drain_then_collect() -> None:
            drain()
            gc.collect()  # the cycle's batch dies here, its finalizer runs, the lock is held

        monkeypatch.setattr(mem, "drain_locked", drain_then_collect)
        got: list[np.ndarray] = []
        worker = threading.Thread(target=lambda: got.append(mem.empty((64,))), daemon=True)
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), "empty() hung on its own lock"
        monkeypatch.undo()
    finally:
        gc.enable()
    assert got[0].shape == (64,)
    assert mem.free_bytes() == 64  # the collected batch's block came back


def test_closed_or_gone_pools_release_what_comes_back():
    mem = BatchMemory()
    a = mem.empty((100,))
    mem.close()
    del a
    assert mem.free_bytes() == 0
    other = BatchMemory()
    kept = other.empty((100,))
    kept[:] = 3
    pool = weakref.ref(other)
    del other
    gc.collect()
    assert pool() is None  # a batch still held does not keep its pool alive
    assert (kept == 3).all()
    del kept  # its block is released with it, nothing raised
