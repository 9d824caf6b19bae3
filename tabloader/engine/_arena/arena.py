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
* The slabs, slot classes and offset arithmetic are the allocator's
(:mod:`tabloader.engine._arena.slabs`);
  this module decides what the slots hold, pins them and evicts.

Eviction (when a class needs a slot and has none free and no slab is free): the class's unpinned
slots are ranked by the eviction policy (:mod:`tabloader.engine._arena.eviction`; by default
:data:`~tabloader.engine._arena.eviction.ARENA_POLICY`: the value whose next use is farthest
(lookahead: Belady inside the sampler's horizon), then the one with the fewest future uses (RefCnt),
then the least recently used), the same object ``bench sampling``'s simulator replays. A reserve
takes all its slots at once (one ranking for all its victims), and a ranking keeps the next best
victims for the next reserves, checked again on fresh inputs before they go (``_victims``).
``score(space, rows) -> (next_use, uses)`` supplies the first two, vectorized; it is called with the
arena's lock held, so it must not take a lock that an arena caller may hold (the engine's scores are
lock-free numpy reads). A class with no evictable slot takes a whole slab from another class whose
slots are all unpinned (the one whose values are needed least). Room for more than a slab (the
service's staging of a batch) is a run of whole consecutive slabs that hold no pinned value
(``reserve_run``): their values are evicted.

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
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from tabloader.catalog._errors import CacheError
from tabloader.engine._arena.eviction import ARENA_POLICY, EvictionPolicy, keys_at_most
from tabloader.engine._arena.slabs import Slabs, SlotClass, default_slab, size_class

ScoreFn = Callable[[int, npt.NDArray[np.int64]], tuple[npt.ArrayLike, npt.ArrayLike]]
"""``score(space, rows) -> (next_use, uses)``: larger next use = later (inf: none known)."""

# ufunc.at with a scalar of the array's own dtype: a Python int takes numpy's casting path,
# 16 us instead of 1.5 us for 256 rows of an int32 array (numpy 2.4)
_ONE = np.int32(1)
_RUN = -2  # the owner of a slab held by a run of ``reserve_run``


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


class Arena:
    """Prepared values in slots of slabs of one buffer; see the module docstring.

    Args:
        capacity_bytes: the buffer's size (rounded down to whole slabs, at least one).
        score: ``score(space, rows) -> (next_use, uses)`` for eviction; None: every next use
            unknown and no uses (LRU under the default policy).
        policy: ranks eviction candidates by (next use, uses, last use); default
            :data:`~tabloader.engine._arena.eviction.ARENA_POLICY`.
        slab_bytes: bytes per slab (default: capacity / 64, clamped to 64 KiB..16 MiB and
            at most the capacity).
        buffer: the memory to use (e.g. a shared-memory segment); default a private array.

    Raises:
        CacheError: ``capacity_bytes`` is not a positive int, or ``policy`` is not an
            :class:`~tabloader.engine._arena.eviction.EvictionPolicy`.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        score: ScoreFn | None = None,
        policy: EvictionPolicy = ARENA_POLICY,
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
        if not isinstance(policy, EvictionPolicy):
            raise CacheError(
                f"policy must be an eviction policy (FewestUses(), LeastRecent()), got {policy!r}; "
                "pass one, or leave it out for the default."
            )
        if slab_bytes is None:
            slab_bytes = default_slab(capacity_bytes)
        self.slab_bytes = slab_bytes
        self.num_slabs = max(1, capacity_bytes // slab_bytes)
        self._slabs = Slabs(self.num_slabs, slab_bytes)
        size = self.num_slabs * slab_bytes
        self.buffer: npt.NDArray[np.uint8] = (
            np.zeros(size, np.uint8) if buffer is None else np.frombuffer(buffer, np.uint8, size)
        )
        self._score = score
        self.policy = policy
        self._lock = threading.Lock()
        self._unpinned = threading.Condition(self._lock)  # pins dropped: a run may fit now
        self._spaces: dict[str, int] = {}
        self._where: list[npt.NDArray[np.int64]] = []  # space -> row -> offset (-1: absent)
        self._fixed: list[bool] = []  # space -> values of one shape
        self._tick = 0
        self._hits = self._misses = self._puts = self._uncached = self._evictions = 0
        self._warned_big = self._warned_pinned = False
        self._runs: dict[int, list[int]] = {}  # offset -> slabs of a run of ``reserve_run``
        # class id -> slots ranked as victims next, and the keys of the last kept (_victims)
        self._queue: dict[int, tuple[npt.NDArray[np.intp], tuple[Any, ...]]] = {}

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

    def holds(self, space: int, nbytes: int) -> int:
        """How many values of ``nbytes`` of ``space`` the whole arena holds, pinned or not."""
        return self.num_slabs * (self.slab_bytes // size_class(nbytes, exact=self._fixed[space]))

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
                for cls, sel, index in self._slabs.locate_many(offsets[hit]):
                    np.add.at(cls.pins, index, _ONE)
                    cls.tick[index] = self._tick
                    shapes[hit[sel]] = cls.shape[index]
            return Found(offsets, shapes)

    def stored(self, space: int, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """Whether each of ``rows`` has a value in ``space`` now (nothing pinned, nothing
        counted, no recency changed: for introspection)."""
        with self._lock:
            return self._where[space][rows] >= 0

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
            for cls, _, index in self._slabs.locate_many(np.asarray(offsets, np.int64)):
                slots, drops = _counted(index)
                if (cls.pins[slots] < drops).any():
                    raise CacheError(
                        "Cannot release a slot that holds no pin. Release each offset once "
                        "per get() or put() that returned it."
                    )
                parts.append((cls, slots, drops))
            for cls, slots, drops in parts:
                cls.pins[slots] -= drops
                cls.tick[slots] = self._tick
            self._unpinned.notify_all()

    def pin(self, offsets: npt.NDArray[np.int64]) -> None:
        """Add one pin per offset (slots someone holds already, so they cannot be evicted)."""
        with self._lock:
            for cls, _, index in self._slabs.locate_many(np.asarray(offsets, np.int64)):
                np.add.at(cls.pins, index, _ONE)

    def pins(self, offset: int) -> int:
        """How many pins the slot at ``offset`` holds now."""
        with self._lock:
            cls, index = self._slabs.locate(offset)
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
            cls = self._slabs.class_for(size_class(nbytes, exact=self._fixed[space]))
            where = self._where[space]
            existing = where[rows]
            have = np.flatnonzero(existing >= 0)
            if have.size:  # stored already (two loads of a row raced): pinned again
                offsets[have] = existing[have]
                for c, _, index in self._slabs.locate_many(existing[have]):
                    np.add.at(c.pins, index, np.int32(pins))
            want = np.flatnonzero(existing < 0)
            idx = self._slots(cls, want.size) if cls is not None else np.empty(0, np.intp)
            if idx.size < want.size:
                self._uncached += want.size - idx.size
                warning = self._uncached_warning(nbytes, cls is None)
            if idx.size:
                assert cls is not None
                sel = want[: idx.size]
                cls.space[idx], cls.row[idx] = space, rows[sel]
                cls.ndim[idx] = len(shape)
                cls.shape[idx] = 0
                cls.shape[idx, : len(shape)] = shape
                cls.pins[idx] = pins
                cls.tick[idx] = np.arange(self._tick + 1, self._tick + 1 + idx.size)
                self._tick += idx.size
                offsets[sel] = self._slabs.offsets(cls, idx)
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
            for cls, sel, index in self._slabs.locate_many(offsets):
                for k, i in zip(sel.tolist(), index.tolist(), strict=True):
                    row = int(rows[k])
                    existing = int(where[row])
                    if existing < 0:
                        where[row] = offsets[k]
                        self._puts += 1
                        continue
                    c, j = self._slabs.locate(existing)
                    c.pins[j] += cls.pins[i]
                    cls.free_slot(i)
                    out[k] = existing
        return out

    def reserve_run(self, nbytes: int, *, wait: float = 0.0) -> int:
        """The offset of ``nbytes`` in whole consecutive slabs (room for more than a slab, as
        a batch's staging), held until :meth:`discard`; -1 if no run of slabs that are free or
        hold only unpinned values is that long, after waiting up to ``wait`` seconds for pins
        to drop (values pinned by batches in flight are scattered over the slabs: the memory
        is there, not yet in one run). The run's values are evicted: the run with the fewest
        values is taken.
        """
        k = -(-nbytes // self.slab_bytes)
        deadline = time.monotonic() + wait
        with self._lock:
            while (offset := self._run_locked(k)) < 0 and k <= self.num_slabs:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._unpinned.wait(left)
            return offset

    def _run_locked(self, k: int) -> int:
        """``reserve_run`` of ``k`` slabs, once (``_lock`` held)."""
        if k > self.num_slabs:
            return -1
        cost = np.zeros(self.num_slabs)  # values to evict per slab (inf: pinned, a run)
        for slab, cid in enumerate(self._slabs.owner.tolist()):
            if cid == _RUN:
                cost[slab] = np.inf
            elif cid >= 0:
                owner, idx = self._slabs.slots(slab)
                pinned = owner.pins[idx].any()
                cost[slab] = np.inf if pinned else (owner.space[idx] >= 0).sum()
        sums = np.convolve(cost, np.ones(k), "valid")
        first = int(np.argmin(sums))
        if not np.isfinite(sums[first]):
            return -1
        run = list(range(first, first + k))
        for slab in run:
            if self._slabs.owner[slab] >= 0:
                owner, idx = self._slabs.slots(slab)
                for i in idx[owner.space[idx] >= 0].tolist():
                    self._evict(owner, i)
                self._slabs.take_back(slab)
            else:
                self._slabs.free.remove(slab)
            self._slabs.owner[slab] = _RUN
        self._runs[first * self.slab_bytes] = run
        return first * self.slab_bytes

    def discard(self, offsets: npt.NDArray[np.int64]) -> None:
        """Free fresh slots of ``reserve`` that were not filled (a failed decode), and runs of
        :meth:`reserve_run`."""
        with self._lock:
            slots = []
            for offset in offsets.tolist():
                run = self._runs.pop(offset, None)
                if run is None:
                    slots.append(offset)
                    continue
                self._slabs.owner[run] = -1
                self._slabs.free.extend(reversed(run))
            for cls, _, index in self._slabs.locate_many(np.array(slots, np.int64)):
                for i in index.tolist():
                    cls.free_slot(i)
            self._unpinned.notify_all()

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

    # -- slots and eviction (lock held) -------------------------------------------------------
    def _slots(self, cls: SlotClass, n: int) -> npt.NDArray[np.intp]:
        """Up to ``n`` free slot indices of ``cls`` (fewer: no room), in the order one slot
        at a time would take them: free ones (the stack's top first), then free slabs, then
        the best victims of one eviction pass, then slabs of other classes.

        One pass ranks the class's candidates once for all ``n`` (a slot at a time ranked
        them all again every 16 slots: 60% of the engine's time with tiny images).
        Slots taken stay marked free (space -1) until the caller fills them in, so no
        eviction here picks them; they left the free list.
        """
        taken: list[int] = []
        while len(taken) < n:
            if cls.free:
                k = min(n - len(taken), len(cls.free))
                taken += cls.free[: -k - 1 : -1]
                del cls.free[-k:]
            elif self._slabs.free:
                self._slabs.give(cls, self._slabs.free.pop())
            elif (victims := self._victims(cls, n - len(taken))).size:
                for v in victims.tolist():
                    self._evict(cls, v)
                k = min(n - len(taken), victims.size)  # the best are used now, the rest next
                taken += victims[:k].tolist()
                cls.free.extend(victims[: k - 1 : -1].tolist())
            else:
                slab = self._victim_slab(cls)
                if slab < 0:
                    break
                self._slabs.give(cls, slab)
        return np.array(taken, np.intp)

    def _evict(self, cls: SlotClass, index: int) -> None:
        self._where[int(cls.space[index])][int(cls.row[index])] = -1
        cls.space[index] = -1
        cls.row[index] = -1
        self._evictions += 1

    def _inputs(
        self, cls: SlotClass, idx: npt.NDArray[np.intp]
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.int64]]:
        """The eviction inputs (next use, uses, last use) of slots ``idx`` of ``cls``."""
        nxt = np.full(idx.size, np.inf)
        uses = np.zeros(idx.size)
        if self._score is not None and idx.size:
            spaces = cls.space[idx]
            first = int(spaces[0])
            if (spaces == first).all():  # one space, usually
                nxt[:], uses[:] = self._score(first, cls.row[idx])
            else:
                for sp in np.unique(spaces).tolist():
                    sel = spaces == sp
                    nxt[sel], uses[sel] = self._score(sp, cls.row[idx[sel]])
        return nxt, uses, cls.tick[idx]

    def _victims(self, cls: SlotClass, need: int = 1) -> npt.NDArray[np.intp]:
        """The ``need`` best victims of ``cls`` (fewer if it has fewer), best first.

        Ranking every unpinned slot costs ~1 ms with 45,000 of them, and a reserve needs a
        few dozen victims: one ranking keeps the ``isqrt(slots x need)`` best in order, and
        the next reserves evict from them (:meth:`_queued`) while they are still as good
        victims as the last one kept was when ranked (fresh inputs, checked). The candidates
        outside them are ranked again once those run out.
        """
        got = self._queued(cls, need)
        if got is not None:
            return got
        idx = np.flatnonzero((cls.space >= 0) & (cls.pins == 0))
        if idx.size == 0:
            return idx
        keep = min(idx.size, max(need, math.isqrt(idx.size * need)))
        nxt, uses, tick = self._inputs(cls, idx)
        best = self.policy.select(nxt, uses, tick, keep)
        last = int(best[-1])
        if best.size > need:
            bound = self.policy.keys(nxt[last], uses[last], tick[last])
            self._queue[cls.id] = (idx[best[need:]], bound)
        else:
            self._queue.pop(cls.id, None)
        return idx[best[:need]]

    def _queued(self, cls: SlotClass, need: int) -> npt.NDArray[np.intp] | None:
        """``need`` victims from the ones the last ranking of ``cls`` kept, re-ranked on fresh
        inputs, of those still unpinned and no better kept than the last kept was; None if
        fewer are left (then all are ranked again)."""
        entry = self._queue.get(cls.id)
        if entry is None:
            return None
        slots, bound = entry
        slots = np.sort(slots[(cls.space[slots] >= 0) & (cls.pins[slots] == 0)])
        if slots.size >= need:
            nxt, uses, tick = self._inputs(cls, slots)
            keys = [np.broadcast_to(k, slots.size) for k in self.policy.keys(nxt, uses, tick)]
            still = keys_at_most(tuple(keys), bound)
            if np.count_nonzero(still) >= need:
                order = np.lexsort([k[still] for k in keys[::-1]])  # ties: slot order
                ranked = slots[still][order]
                if ranked.size > need:
                    self._queue[cls.id] = (ranked[need:], bound)
                else:
                    del self._queue[cls.id]
                return ranked[:need]
        del self._queue[cls.id]
        return None

    def _victim_slab(self, cls: SlotClass) -> int:
        """A slab of another class whose slots are all unpinned, emptied; -1 if none.

        Of those, the one whose values have the fewest future uses (ties: the biggest class).
        """
        best, best_key = -1, (math.inf, 0)
        for slab, cid in enumerate(self._slabs.owner.tolist()):
            if cid < 0 or cid == cls.id:
                continue
            owner, idx = self._slabs.slots(slab)
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
        owner, idx = self._slabs.slots(best)
        for i in idx[owner.space[idx] >= 0].tolist():
            self._evict(owner, i)
        self._slabs.take_back(best)
        return best

    # -- stats --------------------------------------------------------------------------------
    def stats(self) -> ArenaStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            entries = size = pinned = 0
            for cls in self._slabs.classes.values():
                used = cls.space >= 0
                n = int(used.sum())
                entries += n
                size += n * cls.size
                pinned += int((cls.pins > 0).sum())
            pinned += len(self._runs)  # held like a pinned value
            return ArenaStats(
                capacity_bytes=self.buffer.size,
                slab_bytes=self.slab_bytes,
                slabs_used=self.num_slabs - len(self._slabs.free),
                entries=entries,
                size_bytes=size,
                pinned=pinned,
                hits=self._hits,
                misses=self._misses,
                puts=self._puts,
                uncached=self._uncached,
                evictions=self._evictions,
            )


def values_that_fit(capacity_bytes: int, nbytes: int) -> int:
    """How many fixed-shape values of ``nbytes`` an ``Arena(capacity_bytes)`` holds when every
    slab holds them (its capacity in rows, for cache bounds)."""
    slab = default_slab(capacity_bytes)
    return max(1, capacity_bytes // slab) * (slab // size_class(nbytes, exact=True))


def _counted(index: npt.NDArray[Any]) -> tuple[npt.NDArray[Any], npt.NDArray[Any] | np.int32]:
    """``np.unique(index, return_counts=True)``, with the count a scalar 1 when no index
    repeats (a batch's release, the usual case: a sort and a compare, 3 us for 256 slots
    against ``unique``'s 8 us)."""
    slots = np.sort(index)
    if slots.size < 2 or not (slots[1:] == slots[:-1]).any():
        return slots, _ONE
    return np.unique(slots, return_counts=True)
