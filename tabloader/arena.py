"""The arena: one byte-capacity buffer of prepared values, in slabs of equal-size slots.

Decoded images (``uint8`` H x W x 3) are the values worth sharing between jobs: a decode costs
about a millisecond, a copy out of the arena about ten microseconds. They live here, not in one
Python object per row, so the loader service can place the same buffer in shared memory and
hand another process ``(offset, shape)`` instead of a pickled array.

Layout
------
::

    buffer  |<- slab 0 ->|<- slab 1 ->|<- slab 2 ->| ...     num_slabs * slab_bytes bytes
             slot slot ..  free         slot slot ..
             (class 150528 B)           (class 49152 B)

* The buffer is ``num_slabs`` slabs of ``slab_bytes`` each (about 1/64 of the capacity,
  between 64 KiB and 16 MiB, and at most the capacity). A slab is free, or belongs to one
  *slot class* and is cut into ``slab_bytes // size`` slots of that class's ``size`` bytes.
* Fixed-shape values (``image_size`` set) all have one byte size, which is their class: no
  waste. Variable-size values (full-size images) round up to a size class, two per octave
  (at most 1/3 waste); values larger than a slab are handed out uncached (``stats().uncached``).
* A slot is named by its byte ``offset`` in the buffer, and holds its value's ``shape``
  (dtype ``uint8``): ``view(offset, shape)`` is the value. Per class, numpy arrays hold each
  slot's space, row, shape, pin count and last-use tick; per *space* (one dataset column
  prepared one way, e.g. ``imgs/image@224``) an array maps row id -> slot (-1 if absent).

Eviction (when a class needs a slot and has none free and no slab is free): among the class's
unpinned slots, the value whose next use is farthest (lookahead: Belady inside the sampler's
horizon), then the one with the fewest future uses (RefCnt), then the least recently used.
``score(space, rows) -> (next_use, uses)`` supplies the first two, vectorized; it is called
with the arena's lock held, so it must not take a lock that an arena caller may hold (the
engine's scores are lock-free numpy reads). A class with no evictable slot takes a whole slab
from another class whose slots are all unpinned (the one whose values are needed least).

Pins: ``get`` and ``put`` pin what they return; ``release`` unpins. A pinned slot is never
evicted. In the engine a pin lasts from a batch's lookup until its values are copied into the
job's own batch, so pins are few and short.

Example:
    >>> import numpy as np
    >>> arena = Arena(1 << 20)
    >>> space = arena.space("imgs/image@4", num_rows=10)
    >>> off = arena.put(space, 3, np.full((4, 4, 3), 7, np.uint8))
    >>> arena.view(off, (4, 4, 3)).sum() == 7 * 48
    np.True_
    >>> found = arena.get(space, np.array([3, 5]))
    >>> found.offsets.tolist()[1], found.shapes[0].tolist()
    (-1, [4, 4, 3])
    >>> arena.release(np.array([off, found.offsets[0]]))
    >>> arena.stats().pinned
    0
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from catalog.errors import CacheError

__all__ = [
    "Arena",
    "ArenaStats",
    "CacheOvershootWarning",
    "CacheTooSmallWarning",
    "Found",
    "values_that_fit",
]

ScoreFn = Callable[[int, npt.NDArray[np.int64]], tuple[npt.ArrayLike, npt.ArrayLike]]
"""``score(space, rows) -> (next_use, uses)``: larger next use = later (inf: none known)."""

MIN_SLAB = 64 << 10
MAX_SLAB = 16 << 20
MIN_SLOT = 64
EVICT_BATCH = 16  # most victims chosen per scoring pass


class CacheOvershootWarning(RuntimeWarning):
    """Every slot the arena could give was pinned: a value went out uncached (once per arena)."""


class CacheTooSmallWarning(RuntimeWarning):
    """A value is larger than a slab, so it is never cached (emitted once per arena)."""


@dataclass(frozen=True)
class ArenaStats:
    """A snapshot of the arena's counters.

    Attributes:
        capacity_bytes: the buffer's size (slabs x slab bytes).
        slab_bytes: bytes per slab.
        slabs_used: slabs given to a class.
        entries: values cached now.
        size_bytes: bytes of the slots holding them.
        pinned: slots with at least one pin now.
        hits: rows ``get`` found, and rows it did not find that a load in flight for another
            batch serves (``in_flight``): rows looked up and not read again.
        misses: the other rows looked up: each row looked up for a batch counts once, as a
            hit or as a miss (a second look with ``again`` does not count it again).
        puts: values stored.
        uncached: values ``put`` could not store (larger than a slab, or all slots pinned).
        evictions: values evicted to make room.
    """

    capacity_bytes: int
    slab_bytes: int
    slabs_used: int
    entries: int
    size_bytes: int
    pinned: int
    hits: int
    misses: int
    puts: int
    uncached: int
    evictions: int


class Found(NamedTuple):
    """What :meth:`Arena.get` found: per row its slot offset (-1 if absent) and shape.

    ``shapes`` is (rows, 3) int32, zero-padded for values of fewer dims; 0s where absent.
    """

    offsets: npt.NDArray[np.int64]
    shapes: npt.NDArray[np.int32]


class _Class:
    """The slots of one byte size, over the slabs given to it."""

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


class Arena:
    """Prepared values in slots of slabs of one buffer; see the module docstring.

    Args:
        capacity_bytes: the buffer's size (rounded down to whole slabs, at least one).
        score: ``score(space, rows) -> (next_use, uses)`` for eviction; None: LRU.
        slab_bytes: bytes per slab (default: capacity / 64, clamped to 64 KiB..16 MiB and
            at most the capacity).
        buffer: the memory to use (e.g. a shared-memory segment); default a private array.

    Raises:
        CacheError: ``capacity_bytes`` is not a positive int.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        score: ScoreFn | None = None,
        slab_bytes: int | None = None,
        buffer: Any = None,
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise CacheError(f"capacity_bytes must be an int, got {capacity_bytes!r}.")
        if capacity_bytes <= 0:
            raise CacheError(
                f"capacity_bytes must be positive, got {capacity_bytes}; give the cache a "
                "budget in bytes, e.g. 4 << 30 for 4 GiB."
            )
        if slab_bytes is None:
            slab_bytes = _default_slab(capacity_bytes)
        self.slab_bytes = slab_bytes
        self.num_slabs = max(1, capacity_bytes // slab_bytes)
        size = self.num_slabs * slab_bytes
        self.buffer: npt.NDArray[np.uint8] = (
            np.zeros(size, np.uint8) if buffer is None else np.frombuffer(buffer, np.uint8, size)
        )
        self._score = score
        self._lock = threading.Lock()
        self._free_slabs = list(range(self.num_slabs - 1, -1, -1))
        self._classes: dict[int, _Class] = {}
        self._spaces: dict[str, int] = {}
        self._where: list[npt.NDArray[np.int64]] = []  # space -> row -> offset (-1: absent)
        self._fixed: list[bool] = []  # space -> values of one shape
        self._slab_pos = np.zeros(self.num_slabs, np.int64)  # slab -> position in its class
        self._slab_cid = np.full(self.num_slabs, -1, np.int64)  # slab -> class id (-1: free)
        self._by_id: list[_Class] = []
        self._tick = 0
        self._hits = self._misses = self._puts = self._uncached = self._evictions = 0
        self._warned_big = self._warned_pinned = False

    # -- spaces ------------------------------------------------------------------------------
    def space(self, name: str, *, num_rows: int, fixed: bool = False) -> int:
        """The id of the space ``name`` (a dataset column prepared one way), rows ``< num_rows``.

        ``fixed``: every value of the space has one shape (slots of exactly its size). Calling
        it again with more rows grows the space (an appended dataset).
        """
        with self._lock:
            sid = self._spaces.get(name)
            if sid is None:
                sid = self._spaces[name] = len(self._where)
                self._where.append(np.full(num_rows, -1, np.int64))
                self._fixed.append(fixed)
            elif num_rows > self._where[sid].size:
                grown = np.full(num_rows, -1, np.int64)
                grown[: self._where[sid].size] = self._where[sid]
                self._where[sid] = grown
            return sid

    # -- lookups -----------------------------------------------------------------------------
    def get(self, space: int, rows: npt.NDArray[np.int64], *, again: bool = False) -> Found:
        """The slots of ``rows`` (offset -1 where absent); found ones are pinned.

        ``again``: a second look at rows that just missed (one may have landed since); its
        finds count as hits and nothing as a miss, so that each row looked up for a batch
        counts once, as a hit or as a miss.
        """
        with self._lock:
            offsets = self._where[space][rows]
            shapes = np.zeros((rows.size, 3), np.int32)
            hit = np.flatnonzero(offsets >= 0)
            self._hits += hit.size
            if again:  # they were counted as misses by the first look
                self._misses -= hit.size
            else:
                self._misses += rows.size - hit.size
            if hit.size:
                self._tick += 1
                for cls, sel, index in self._locate_many(offsets[hit]):
                    np.add.at(cls.pins, index, 1)
                    cls.tick[index] = self._tick
                    shapes[hit[sel]] = cls.shape[index]
            return Found(offsets, shapes)

    def in_flight(self, rows: int) -> None:
        """``rows`` that ``get`` missed are served by a load in flight for another batch:
        count them as hits (they are not read again)."""
        with self._lock:
            self._hits += rows
            self._misses -= rows

    def view(self, offset: int, shape: tuple[int, ...]) -> npt.NDArray[np.uint8]:
        """The value stored at ``offset`` (a read-only view; copy it before handing it out)."""
        n = math.prod(shape)
        out = self.buffer[offset : offset + n].reshape(shape)
        out.flags.writeable = False
        return out

    def release(self, offsets: npt.NDArray[np.int64]) -> None:
        """Drop one pin per offset (an offset listed twice drops two).

        Raises:
            CacheError: an offset holds no pin (then none is released).
        """
        with self._lock:
            self._tick += 1
            parts = []
            for cls, _, index in self._locate_many(np.asarray(offsets, np.int64)):
                slots, drops = np.unique(index, return_counts=True)
                if (cls.pins[slots] < drops).any():
                    raise CacheError(
                        "Cannot release a slot that holds no pin. Release each offset once "
                        "per get() or put() that returned it."
                    )
                parts.append((cls, slots, drops))
            for cls, slots, drops in parts:
                cls.pins[slots] -= drops
                cls.tick[slots] = self._tick

    def pin(self, offsets: npt.NDArray[np.int64]) -> None:
        """Add one pin per offset (slots someone holds already, so they cannot be evicted)."""
        with self._lock:
            for cls, _, index in self._locate_many(np.asarray(offsets, np.int64)):
                np.add.at(cls.pins, index, 1)

    def pins(self, offset: int) -> int:
        """How many pins the slot at ``offset`` holds now."""
        with self._lock:
            cls, index = self._locate(offset)
            return int(cls.pins[index])

    # -- storing -----------------------------------------------------------------------------
    def put(self, space: int, row: int, value: npt.NDArray[np.uint8], *, pins: int = 1) -> int:
        """Store ``value`` as ``row`` of ``space`` with ``pins`` pins; its offset, or -1.

        -1 means the value was not stored (larger than a slab, or every slot it could take is
        pinned): the caller hands out its own copy. A row already stored is pinned again and
        its offset returned (two loads of one row raced; the first one stays).
        """
        if value.dtype != np.uint8 or not 1 <= value.ndim <= 3:
            raise CacheError(f"the arena stores uint8 arrays of 1-3 dims, got {value.dtype}.")
        rows = np.array([row], np.int64)
        offsets, fresh = self.reserve(space, rows, value.shape, pins=pins)
        offset = int(offsets[0])
        if offset < 0 or not fresh[0]:
            return offset
        # Outside the lock: the slot is reserved (pinned, and no ``get`` finds it yet).
        self.buffer[offset : offset + value.nbytes] = value.reshape(-1)
        return int(self.publish(space, rows, offsets)[0])

    def reserve(
        self, space: int, rows: npt.NDArray[np.int64], shape: tuple[int, ...], *, pins: int = 1
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """Slots for ``rows`` of ``space`` (values of ``shape``), each with ``pins`` pins.

        Returns ``(offsets, fresh)``: a fresh slot is the caller's to fill (``view`` of it,
        writable through ``buffer``) and then to :meth:`publish` (or :meth:`discard`); until
        then ``get`` does not find it. A row stored already is pinned and not fresh. -1: no
        room (the value is larger than a slab, or every slot it could take is pinned).
        """
        nbytes = math.prod(shape)
        offsets = np.full(rows.size, -1, np.int64)
        fresh = np.zeros(rows.size, bool)
        warning: Warning | None = None
        with self._lock:
            size = _size_class(nbytes, exact=self._fixed[space])
            where = self._where[space]
            cls = self._classes.get(size)
            if cls is None and size <= self.slab_bytes:
                cls = self._classes[size] = _Class(len(self._by_id), size, self.slab_bytes // size)
                self._by_id.append(cls)
            existing = where[rows]
            have = np.flatnonzero(existing >= 0)
            if have.size:  # stored already (two loads of a row raced): pinned again
                offsets[have] = existing[have]
                for c, _, index in self._locate_many(existing[have]):
                    np.add.at(c.pins, index, pins)
            want = np.flatnonzero(existing < 0)
            taken: list[int] = []
            for _ in range(want.size if cls is not None else 0):
                # Slots taken here stay marked free (space -1) until the loop ends, so no
                # eviction in a later ``_slot`` call picks them; they left the free list.
                slot = self._slot(cls)  # type: ignore[arg-type]
                if slot < 0:
                    break
                taken.append(slot)
            if len(taken) < want.size:
                self._uncached += want.size - len(taken)
                warning = self._uncached_warning(nbytes, cls is None)
            if taken:
                assert cls is not None
                idx = np.array(taken, np.intp)
                sel = want[: idx.size]
                cls.space[idx], cls.row[idx] = space, rows[sel]
                cls.ndim[idx] = len(shape)
                cls.shape[idx] = 0
                cls.shape[idx, : len(shape)] = shape
                cls.pins[idx] = pins
                cls.tick[idx] = np.arange(self._tick + 1, self._tick + 1 + idx.size)
                self._tick += idx.size
                slabs = np.asarray(cls.slabs, np.int64)[idx // cls.per_slab]
                offsets[sel] = slabs * self.slab_bytes + (idx % cls.per_slab) * cls.size
                fresh[sel] = True
        if warning is not None:  # outside the lock: a warning filter may run any code
            warnings.warn(warning, stacklevel=3)
        return offsets, fresh

    def publish(
        self, space: int, rows: npt.NDArray[np.int64], offsets: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """Make filled fresh slots of ``reserve`` visible to ``get``; the offsets now holding
        the rows (another one where a racing load published the row first: ours is freed and
        its pins move there).
        """
        out = offsets.copy()
        with self._lock:
            where = self._where[space]
            if (where[rows] < 0).all():  # no load raced ours (the usual case)
                where[rows] = offsets
                self._puts += rows.size
                return out
            for cls, sel, index in self._locate_many(offsets):
                for k, i in zip(sel.tolist(), index.tolist(), strict=True):
                    row = int(rows[k])
                    existing = int(where[row])
                    if existing < 0:
                        where[row] = offsets[k]
                        self._puts += 1
                        continue
                    c, j = self._locate(existing)
                    c.pins[j] += cls.pins[i]
                    self._free_slot(cls, i)
                    out[k] = existing
        return out

    def discard(self, offsets: npt.NDArray[np.int64]) -> None:
        """Free fresh slots of ``reserve`` that were not filled (a failed decode)."""
        with self._lock:
            for cls, _, index in self._locate_many(offsets):
                for i in index.tolist():
                    self._free_slot(cls, i)

    def _free_slot(self, cls: _Class, index: int) -> None:
        cls.space[index] = cls.row[index] = -1
        cls.pins[index] = 0
        cls.free.append(index)

    def _uncached_warning(self, nbytes: int, too_big: bool) -> Warning | None:
        if too_big and not self._warned_big:
            self._warned_big = True
            return CacheTooSmallWarning(
                f"Arena: a value of {nbytes} bytes is larger than a slab "
                f"({self.slab_bytes} bytes, 1/64 of the cache); such values are never "
                "cached, so no other job can share them. Raise cache_bytes."
            )
        if not too_big and not self._warned_pinned:
            self._warned_pinned = True
            return CacheOvershootWarning(
                "Arena: every slot was pinned, so a value went out uncached; the "
                "cache is too small for the rows being prepared at once. Raise "
                "cache_bytes or lower prefetch."
            )
        return None

    # -- bookkeeping (lock held) ---------------------------------------------------------------
    def _locate_many(
        self, offsets: npt.NDArray[np.int64]
    ) -> list[tuple[_Class, npt.NDArray[np.intp], npt.NDArray[np.intp]]]:
        """Per class among ``offsets``: (class, positions in ``offsets``, slot indices)."""
        slab, within = np.divmod(offsets, self.slab_bytes)
        if slab.size and (slab.min() < 0 or slab.max() >= self.num_slabs):
            raise CacheError("an offset is not a slot of this arena.")
        cid = self._slab_cid[slab]
        out: list[tuple[_Class, npt.NDArray[np.intp], npt.NDArray[np.intp]]] = []
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
            index = self._slab_pos[at] * cls.per_slab + (within if one else within[sel]) // cls.size
            out.append((cls, sel, index))
        return out

    def _locate(self, offset: int) -> tuple[_Class, int]:
        ((cls, _, index),) = self._locate_many(np.array([offset], np.int64))
        return cls, int(index[0])

    def _offset(self, cls: _Class, index: int) -> int:
        pos, k = divmod(index, cls.per_slab)
        return cls.slabs[pos] * self.slab_bytes + k * cls.size

    def _slot(self, cls: _Class) -> int:
        """A free slot index of ``cls``, evicting or taking a slab if needed; -1 if none."""
        if cls.free:
            return cls.free.pop()
        if self._free_slabs:
            self._give_slab(cls, self._free_slabs.pop())
            return cls.free.pop()
        victims = self._victims(cls)
        if victims:
            for v in victims:
                self._evict(cls, v)
            cls.free.extend(victims[:0:-1])  # the best victim is used now, the rest next
            return victims[0]
        slab = self._victim_slab(cls)
        if slab < 0:
            return -1
        self._give_slab(cls, slab)
        return cls.free.pop()

    def _give_slab(self, cls: _Class, slab: int) -> None:
        self._slab_pos[slab] = cls.add_slab(slab)
        self._slab_cid[slab] = cls.id

    def _evict(self, cls: _Class, index: int) -> None:
        self._where[int(cls.space[index])][int(cls.row[index])] = -1
        cls.space[index] = -1
        cls.row[index] = -1
        self._evictions += 1

    def _scores(self, cls: _Class, idx: npt.NDArray[np.intp]) -> npt.NDArray[np.intp]:
        """``idx`` (occupied, unpinned slots of ``cls``) ordered best victim first."""
        nxt = np.full(idx.size, np.inf)
        uses = np.zeros(idx.size)
        if self._score is not None:
            spaces = cls.space[idx]
            first = int(spaces[0])
            if (spaces == first).all():  # one space, usually
                nxt[:], uses[:] = self._score(first, cls.row[idx])
            else:
                for sp in np.unique(spaces).tolist():
                    sel = spaces == sp
                    nxt[sel], uses[sel] = self._score(sp, cls.row[idx[sel]])
        return idx[np.lexsort((cls.tick[idx], uses, -nxt))]

    def _victims(self, cls: _Class) -> list[int]:
        """The best victims of ``cls``: 1/32 of its unpinned slots (at least one, at most 16).

        Scoring every slot costs ~100 us with a thousand slots; evicting a few at a time
        spends it once per few puts (the runners-up were next in line anyway).
        """
        idx = np.flatnonzero((cls.space >= 0) & (cls.pins == 0))
        if idx.size == 0:
            return []
        k = min(EVICT_BATCH, max(1, idx.size // 32))
        return [int(i) for i in self._scores(cls, idx)[:k]]

    def _victim_slab(self, cls: _Class) -> int:
        """A slab of another class whose slots are all unpinned, emptied; -1 if none.

        Of those, the one whose values have the fewest future uses (ties: the biggest class).
        """
        best, best_key = -1, (math.inf, 0)
        for slab, cid in enumerate(self._slab_cid.tolist()):
            if cid < 0 or cid == cls.id:
                continue
            owner = self._by_id[cid]
            idx = self._slab_slots(owner, slab)
            if owner.pins[idx].any():
                continue
            used = idx[owner.space[idx] >= 0]
            need = 0.0
            if used.size and self._score is not None:
                for sp in np.unique(owner.space[used]).tolist():
                    rows = owner.row[used[owner.space[used] == sp]]
                    need += float(np.sum(self._score(sp, rows)[1]))
            key = (need, -len(owner.slabs))
            if key < best_key:
                best, best_key = slab, key
        if best < 0:
            return -1
        owner = self._by_id[int(self._slab_cid[best])]
        idx = self._slab_slots(owner, best)
        for i in idx[owner.space[idx] >= 0].tolist():
            self._evict(owner, i)
        gone = set(idx.tolist())
        owner.free = [i for i in owner.free if i not in gone]
        owner.slabs[int(self._slab_pos[best])] = -1
        self._slab_cid[best] = -1
        return best

    def _slab_slots(self, cls: _Class, slab: int) -> npt.NDArray[np.intp]:
        first = int(self._slab_pos[slab]) * cls.per_slab
        return np.arange(first, first + cls.per_slab)

    # -- stats --------------------------------------------------------------------------------
    def stats(self) -> ArenaStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            entries = size = pinned = 0
            for cls in self._classes.values():
                used = cls.space >= 0
                n = int(used.sum())
                entries += n
                size += n * cls.size
                pinned += int((cls.pins > 0).sum())
            return ArenaStats(
                capacity_bytes=self.buffer.size,
                slab_bytes=self.slab_bytes,
                slabs_used=self.num_slabs - len(self._free_slabs),
                entries=entries,
                size_bytes=size,
                pinned=pinned,
                hits=self._hits,
                misses=self._misses,
                puts=self._puts,
                uncached=self._uncached,
                evictions=self._evictions,
            )


def _default_slab(capacity_bytes: int) -> int:
    slab_bytes = min(capacity_bytes, MAX_SLAB, max(MIN_SLAB, capacity_bytes // 64))
    return max(MIN_SLOT, slab_bytes - slab_bytes % MIN_SLOT)


def values_that_fit(capacity_bytes: int, nbytes: int) -> int:
    """How many fixed-shape values of ``nbytes`` an ``Arena(capacity_bytes)`` holds when every
    slab holds them (its capacity in rows, for cache bounds)."""
    slab = _default_slab(capacity_bytes)
    return max(1, capacity_bytes // slab) * (slab // _size_class(nbytes, exact=True))


def _size_class(nbytes: int, *, exact: bool) -> int:
    """Slot bytes for a value of ``nbytes``: 64-byte aligned; unless ``exact``, two classes per
    octave above 4 KiB (variable sizes waste at most 1/3; fixed-shape ones only alignment).
    """
    n = max(MIN_SLOT, -(-nbytes // MIN_SLOT) * MIN_SLOT)
    if exact or n <= 4096:
        return n
    top = 1 << (n - 1).bit_length()  # the next power of two
    mid = top // 4 * 3
    return mid if n <= mid else top
