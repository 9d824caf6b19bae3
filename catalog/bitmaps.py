"""Fast conversions between numpy arrays and pyroaring bitmaps.

``BitMap(numpy_array)`` adds ids one by one (~70 ms for 640k ids; ~7 ms through
``array.array``). ``bitmap_from_array`` instead writes Roaring's portable serialization with
numpy, one container (2^16 ids) at a time, and lets pyroaring deserialize it (~1 ms for 640k
ids). Every module that turns ids into a bitmap or back goes through these two functions.

Portable format (no run containers): cookie 12346 and the container count (uint32 each); per
container its key and cardinality - 1 (uint16 each); per container its byte offset (uint32);
then the containers: sorted uint16 values when they hold at most 4096 ids, else a 65536-bit
little-endian bitset.
"""

from __future__ import annotations

import numpy as np
from pyroaring import BitMap

__all__ = ["bitmap_from_array", "bitmap_to_array"]

_COOKIE = 12346
_ARRAY_MAX = 4096


def bitmap_from_array(ids: np.ndarray) -> BitMap:
    """Build a ``BitMap`` from an array of ids in ``[0, 2**32)`` (any order, repeats allowed)."""
    a = np.asarray(ids)
    if a.size == 0:
        return BitMap()
    if a.dtype != np.uint32:
        if a.min() < 0 or a.max() >= 2**32:
            raise ValueError("row ids must be in [0, 2**32)")
        a = a.astype(np.uint32)
    if a.size > 1 and not bool(np.all(a[1:] > a[:-1])):
        a = np.unique(a)
    high = a >> 16
    starts = np.flatnonzero(np.r_[True, high[1:] != high[:-1]])
    ends = np.r_[starts[1:], a.size]
    keys = high[starts].astype(np.uint16)
    counts = ends - starts
    low = (a & 0xFFFF).astype(np.uint16)
    bodies = []
    for s, e in zip(starts.tolist(), ends.tolist(), strict=False):
        if e - s <= _ARRAY_MAX:
            bodies.append(low[s:e].tobytes())
        else:
            bits = np.zeros(1 << 16, dtype=bool)
            bits[low[s:e]] = True
            bodies.append(np.packbits(bits, bitorder="little").tobytes())
    n = len(bodies)
    header = np.array([_COOKIE, n], dtype="<u4").tobytes()
    descriptive = np.empty(2 * n, dtype="<u2")
    descriptive[0::2] = keys
    descriptive[1::2] = counts - 1
    sizes = np.array([len(b) for b in bodies], dtype=np.int64)
    offsets = len(header) + 4 * n + 4 * n + np.r_[0, np.cumsum(sizes)[:-1]]
    blob = b"".join([header, descriptive.tobytes(), offsets.astype("<u4").tobytes(), *bodies])
    return BitMap.deserialize(blob)


def bitmap_to_array(bitmap: BitMap) -> np.ndarray:
    """Return the ids of ``bitmap`` as a sorted ``uint32`` numpy array."""
    return np.frombuffer(bitmap.to_array(), dtype=np.uint32)
