"""BatchMemory: a block is reused only once nothing can see it."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

from tabloader.batchmem import BatchMemory


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
    assert mem._free_bytes == 3000
    assert len(mem._free[1000]) == 3
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
