"""Recycled memory for the image arrays of the batches handed to jobs.

A job usually drops its batch a step after it got it, and the next batch has the same shape.
Fresh memory for each one costs page faults: the kernel maps and zeroes every page on its
first touch (about 2 us a 4 KiB page here; the io threads of one image-224 job took 18,000
faults and 0.24 s of system time an epoch). :class:`BatchMemory` hands out arrays over blocks
it keeps and takes a block back once nothing can see it any more.

How a block comes back: each array handed out is a view of a ``ctypes`` *lease* over its
block. numpy views of the array (slices, reshapes) and tensors made from it
(``torch.from_numpy``) keep the lease alive, so the lease dies only after the last of them;
a ``weakref.finalize`` on it then returns the block. A block is never reused while anything
can still read or write it, and a job writing into its batch never touches another's.

The finalizer takes no lock: it may run in any thread, at any moment (the garbage collector
freeing a batch caught in a reference cycle, in the middle of :meth:`BatchMemory.empty` on
the same thread). It appends the block to a queue (one atomic operation), which ``empty``
drains under its lock. It holds the pool only by a weak reference: a batch kept after its
loader is gone keeps its own block alive, not the pool's.

Example:
    >>> mem = BatchMemory()
    >>> a = mem.empty((2, 3))
    >>> address = a.ctypes.data
    >>> del a  # the last reference: the block goes back
    >>> mem.empty((2, 3)).ctypes.data == address
    True
"""

from __future__ import annotations

import collections
import ctypes
import math
import threading
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

Block = npt.NDArray[np.uint8]


class BatchMemory:
    """Arrays over recycled blocks; see the module docstring.

    Args:
        keep_bytes: free blocks kept for reuse, at most; past it the blocks that came back
            first are released (a job that held many batches at once, or batches of a size
            no job asks for any more, do not pin that memory for ever).
    """

    def __init__(self, keep_bytes: int = 256 << 20) -> None:
        self.keep_bytes = keep_bytes
        self._returned: collections.deque[Block] = collections.deque()  # by finalizers
        self._free: dict[int, list[Block]] = {}  # block size -> blocks, under ``_lock``
        # the free blocks by id, oldest first (never compared: ``==`` on arrays is per element)
        self._order: collections.OrderedDict[int, Block] = collections.OrderedDict()
        self._free_bytes = 0
        self._lock = threading.Lock()
        self._closed = False
        self.reused = 0  # arrays handed out over a block that came back
        self.fresh = 0  # ... over a new block

    def empty(self, shape: tuple[int, ...], dtype: Any = np.uint8) -> npt.NDArray[Any]:
        """A new, writable array of ``shape`` (uninitialized), the caller's own."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return np.empty(shape, dtype)
        with self._lock:
            self.drain_locked()
            blocks = self._free.get(nbytes)
            block = blocks.pop() if blocks else None
            if block is None:
                self.fresh += 1
            else:
                del self._order[id(block)]
                self._free_bytes -= nbytes
                self.reused += 1
        if block is None:
            block = np.empty(nbytes, np.uint8)
        lease = (ctypes.c_ubyte * nbytes).from_address(block.ctypes.data)
        fin = weakref.finalize(lease, _give_back, weakref.ref(self), block)
        fin.atexit = False  # nothing to give back to at exit
        return np.frombuffer(lease, dtype).reshape(shape)

    def free_bytes(self) -> int:
        """Bytes of the blocks kept for reuse now."""
        with self._lock:
            self.drain_locked()
            return self._free_bytes

    def close(self) -> None:
        """Release the free blocks; blocks that come back later are released too."""
        with self._lock:
            self._closed = True
            self._returned.clear()
            self._free.clear()
            self._order.clear()
            self._free_bytes = 0

    def drain_locked(self) -> None:
        while self._returned:
            block = self._returned.popleft()
            self._free.setdefault(block.size, []).append(block)
            self._order[id(block)] = block
            self._free_bytes += block.size
        while self._free_bytes > self.keep_bytes:  # the oldest go first
            _, old = self._order.popitem(last=False)
            same = self._free[old.size]
            del same[next(i for i, b in enumerate(same) if b is old)]
            self._free_bytes -= old.size


def _give_back(pool: weakref.ref[BatchMemory], block: Block) -> None:
    """The last view of ``block`` died: queue it for its pool (no lock; see the module
    docstring). With the pool gone or closed, ``block`` is released with this call."""
    mem = pool()
    if mem is not None and not mem._closed:
        mem._returned.append(block)
