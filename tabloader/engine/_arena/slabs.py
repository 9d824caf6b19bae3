"""The arena's allocator: one buffer cut into slabs, each slab into slots of one size class.

It knows bytes only: which slab belongs to which slot class, where a slot is (byte offset <-> class
and slot index), and which slots and slabs are free. What a slot holds (its space, row, shape, pins
and last use) is kept per class in arrays that the arena reads and writes, and which value to evict
is the arena's choice (:mod:`tabloader.engine._arena.arena`, whose docstring shows the layout).
Nothing here locks: the arena calls it with its lock held.

Example:
    >>> slabs = Slabs(num_slabs=2, slab_bytes=1024)
    >>> cls = slabs.class_for(size_class(200, exact=True))
    >>> cls.size, cls.per_slab
    (256, 4)
    >>> slabs.give(cls, slabs.free.pop())
    >>> index = cls.free.pop()
    >>> offset = int(slabs.offsets(cls, np.array([index]))[0])
    >>> found, _, at = slabs.locate_many(np.array([offset]))[0]
    >>> found is cls, at.tolist() == [index]
    (True, True)
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tabloader.catalog._errors import CacheError

MIN_SLAB = 64 << 10
MAX_SLAB = 16 << 20
MIN_SLOT = 64

Located = list[tuple["SlotClass", npt.NDArray[np.intp], npt.NDArray[np.intp]]]
"""Per class among some offsets: (class, positions among the offsets, slot indices)."""


class SlotClass:
    """The slots of one byte size, over the slabs given to it, and what each slot holds."""

    def __init__(self, id_: int, size: int, per_slab: int) -> None:
        self.id = id_
        self.size = size
        self.per_slab = per_slab
        self.slabs: list[int] = []  # slab ids, in slot-index order (-1: given back)
        n = 0
        self.space = np.full(n, -1, np.int32)  # -1: the slot is free
        self.row = np.full(n, -1, np.int64)
        self.shape = np.zeros((n, 3), np.int32)
        self.ndim = np.zeros(n, np.int8)
        self.pins = np.zeros(n, np.int32)
        self.tick = np.zeros(n, np.int64)
        self.free: list[int] = []  # free slot indices (a stack)

    def add_slab(self, slab: int) -> int:
        """Take ``slab``; returns its position (slot indices ``pos * per_slab ...``)."""
        try:
            pos = self.slabs.index(-1)
            self.slabs[pos] = slab
        except ValueError:
            pos = len(self.slabs)
            self.slabs.append(slab)
            for name in ("space", "row", "shape", "ndim", "pins", "tick"):
                old = getattr(self, name)
                grown = np.zeros((old.shape[0] + self.per_slab, *old.shape[1:]), old.dtype)
                if name in ("space", "row"):
                    grown[:] = -1
                grown[: old.shape[0]] = old
                setattr(self, name, grown)
        first = pos * self.per_slab
        self.free.extend(range(first + self.per_slab - 1, first - 1, -1))
        return pos

    def free_slot(self, index: int) -> None:
        """``index`` holds nothing any more: back on the free stack."""
        self.space[index] = self.row[index] = -1
        self.pins[index] = 0
        self.free.append(index)


class Slabs:
    """``num_slabs`` slabs of ``slab_bytes``, each free or given to one :class:`SlotClass`."""

    def __init__(self, num_slabs: int, slab_bytes: int) -> None:
        self.num_slabs = num_slabs
        self.slab_bytes = slab_bytes
        self.free = list(range(num_slabs - 1, -1, -1))  # free slab ids (a stack)
        self.classes: dict[int, SlotClass] = {}  # slot size -> its class
        self._by_id: list[SlotClass] = []
        self._pos = np.zeros(num_slabs, np.int64)  # slab -> position in its class
        self.owner = np.full(num_slabs, -1, np.int64)  # slab -> class id (-1: free)

    def class_for(self, size: int) -> SlotClass | None:
        """The class of slots of ``size`` bytes (made on first use); None if larger than a slab."""
        cls = self.classes.get(size)
        if cls is None and size <= self.slab_bytes:
            cls = self.classes[size] = SlotClass(len(self._by_id), size, self.slab_bytes // size)
            self._by_id.append(cls)
        return cls

    def give(self, cls: SlotClass, slab: int) -> None:
        """``slab`` (free) now holds slots of ``cls``."""
        self._pos[slab] = cls.add_slab(slab)
        self.owner[slab] = cls.id

    def slots(self, slab: int) -> tuple[SlotClass, npt.NDArray[np.intp]]:
        """The class ``slab`` was given to and the indices of its slots in that class."""
        cls = self._by_id[int(self.owner[slab])]
        first = int(self._pos[slab]) * cls.per_slab
        return cls, np.arange(first, first + cls.per_slab)

    def take_back(self, slab: int) -> None:
        """``slab``'s slots hold nothing (the caller evicted them): the slab is free again."""
        cls, idx = self.slots(slab)
        gone = set(idx.tolist())
        cls.free = [i for i in cls.free if i not in gone]
        cls.slabs[int(self._pos[slab])] = -1
        self.owner[slab] = -1

    def offsets(self, cls: SlotClass, idx: npt.NDArray[np.intp]) -> npt.NDArray[np.int64]:
        """The byte offsets of slots ``idx`` of ``cls``."""
        slabs = np.asarray(cls.slabs, np.int64)[idx // cls.per_slab]
        return slabs * self.slab_bytes + (idx % cls.per_slab) * cls.size

    def locate_many(self, offsets: npt.NDArray[np.int64]) -> Located:
        """Per class among ``offsets``: (class, positions in ``offsets``, slot indices).

        Raises:
            CacheError: an offset is not a slot of this buffer.
        """
        slab, within = np.divmod(offsets, self.slab_bytes)
        if slab.size and (slab.min() < 0 or slab.max() >= self.num_slabs):
            raise CacheError("an offset is not a slot of this arena.")
        cid = self.owner[slab]
        out: Located = []
        if cid.size == 0:
            return out
        first = int(cid[0])
        one = bool((cid == first).all())  # one class, usually
        for c in [first] if one else np.unique(cid).tolist():
            if c < 0:
                raise CacheError("an offset is not a slot of this arena.")
            cls = self._by_id[c]
            sel = np.arange(cid.size) if one else np.flatnonzero(cid == c)
            at = slab if one else slab[sel]
            index = self._pos[at] * cls.per_slab + (within if one else within[sel]) // cls.size
            out.append((cls, sel, index))
        return out

    def locate(self, offset: int) -> tuple[SlotClass, int]:
        """The class and slot index of the slot at ``offset``."""
        ((cls, _, index),) = self.locate_many(np.array([offset], np.int64))
        return cls, int(index[0])


def default_slab(capacity_bytes: int) -> int:
    """Bytes per slab of a buffer of ``capacity_bytes``: 1/64 of it, between 64 KiB and 16 MiB
    and at most the capacity, 64-byte aligned."""
    slab_bytes = min(capacity_bytes, MAX_SLAB, max(MIN_SLAB, capacity_bytes // 64))
    return max(MIN_SLOT, slab_bytes - slab_bytes % MIN_SLOT)


def size_class(nbytes: int, *, exact: bool) -> int:
    """Slot bytes for a value of ``nbytes``: 64-byte aligned; unless ``exact``, two classes per
    octave above 4 KiB (variable sizes waste at most 1/3; fixed-shape ones only alignment).
    """
    n = max(MIN_SLOT, -(-nbytes // MIN_SLOT) * MIN_SLOT)
    if exact or n <= 4096:
        return n
    top = 1 << (n - 1).bit_length()  # the next power of two
    mid = top // 4 * 3
    return mid if n <= mid else top
