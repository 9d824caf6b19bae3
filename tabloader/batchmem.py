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

Example:
    >>> mem = BatchMemory()
    >>> a = mem.empty((2, 3))
    >>> address = a.ctypes.data
    >>> del a  # the last reference: the block goes back
    >>> mem.empty((2, 3)).ctypes.data == address
    True
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["BatchMemory"]


class BatchMemory:
    """Arrays over recycled blocks; see the module docstring.

    Args:
        keep_bytes: free blocks kept for reuse, at most (more are released when they come
            back: a job that holds many batches at once does not pin that memory for ever).
    """

    def __init__(self, keep_bytes: int = 256 << 20) -> None:
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[npt.NDArray[np.uint8]]] = {}  # block size -> blocks
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.reused = 0  # arrays handed out over a block that came back
        self.fresh = 0  # ... over a new block

    def empty(self, shape: tuple[int, ...], dtype: Any = np.uint8) -> npt.NDArray[Any]:
        """A new, writable array of ``shape`` (uninitialized), the caller's own."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return np.empty(shape, dtype)
        with self._lock:
            blocks = self._free.get(nbytes)
            block = blocks.pop() if blocks else None
            if block is None:
                self.fresh += 1
            else:
                self._free_bytes -= nbytes
                self.reused += 1
        if block is None:
            block = np.empty(nbytes, np.uint8)
        lease = (ctypes.c_ubyte * nbytes).from_address(block.ctypes.data)
        fin = weakref.finalize(lease, self._give_back, block)
        fin.atexit = False  # nothing to give back to at exit
        return np.frombuffer(lease, dtype).reshape(shape)

    def _give_back(self, block: npt.NDArray[np.uint8]) -> None:
        """The last view of ``block`` died (any thread: the one that dropped it)."""
        with self._lock:
            if self._free_bytes + block.size > self.keep_bytes:
                return  # released with ``block``
            self._free.setdefault(block.size, []).append(block)
            self._free_bytes += block.size
