"""A shared, thread-safe, column-aware reference-count cache of prepared row values.

Several jobs ask for the same rows at about the same time (the dependent sampler makes them).
:class:`RowCache` makes sure each row-column is read and decoded once and served to every job:

* **Keys** are ``(row_id, column)``. ``column`` is a decoder key from :mod:`tabloader.prep`
  (``"label"``, ``"image@224"``), so two jobs that decode the same column with different
  parameters never share an entry, and a job reading ``{image, label}`` shares ``image`` with
  a job reading ``{image}``.
* **Request merging.** :meth:`RowCache.get_or_load` on a key that another thread is loading
  waits for that load and returns the very same object: one read, one decode.
* **Pins.** A value handed to a job and not yet consumed is pinned (a count: several jobs can
  pin one key). Pinned entries are never evicted. Every ``get_or_load(..., pin=True)`` that
  returns must be matched by exactly one :meth:`RowCache.unpin` (or one key in
  :meth:`RowCache.release`), even when the value was too large to be cached. A call that
  raises holds no pin.
* **Errors** in ``load`` reach the caller and every merged waiter as the same exception
  object (with its original traceback), and are not cached: the next request loads again.

Eviction policies (capacity is in bytes; chosen by the callbacks given):

=============  ==================================================  ======================
policy         victim                                              cost per eviction
=============  ==================================================  ======================
LRU            least recently used (``refcount=next_use=None``)    O(1), exact
RefCnt         lowest ``refcount`` (0 = no job needs it this       sampled, see below
               epoch), ties: least recently used
Belady (MIN)   farthest ``next_use`` (lookahead), ties: lowest     sampled, see below
               refcount, then least recently used
=============  ==================================================  ======================

"Recently used" means the last hit or the last unpin (a consumed row counts as used then).

**Why sampling.** Reference counts change all the time (the sampler decrements a row's count
as each job consumes it, and refills whole epochs at once), so a heap ordered by count is
stale the moment it is built, and a lazily repaired heap only works for keys that grow, while
ours mostly shrink. Scoring every entry on every eviction is exact but O(n). The cache
therefore scores a candidate set, with one vectorized callback call per column:

* the ``SAMPLE_LRU_HEAD`` least recently used unpinned entries (so ties resolve like LRU),
* the ``SAMPLE_MRU_TAIL`` most recently used or released ones: a row whose last job just
  consumed it is released there with count 0, exactly the victim RefCnt wants,
* ``sample_size`` entries drawn uniformly at random from the unpinned ones,
* the ``POOL_SIZE`` best candidates left over from the previous eviction, re-scored (the
  eviction pool of Redis' approximated LRU; a good victim once seen is not forgotten),

and evicts from it, best victim first, until the new value fits. With at most
``sample_size`` unpinned entries the candidate set is all of them, so small caches are exact;
``sample_size=None`` always scores everything (the exact reference, for ablations).

Measured on the dev box (2 shared cores, Python 3.11, CPU time; 20 000 unpinned 1 KiB
entries, a vectorized numpy ``refcount``, every insert evicts one entry):

==================  ============  ==================================================
candidates          per insert    victim has the lowest refcount of the whole cache
==================  ============  ==================================================
LRU (no scoring)    ~15 us        --
sampled, K=16       ~75 us        --
sampled, K=32       ~95 us        100 % with 1/4 of the rows at 0; 100 % when the
                                  0-count rows are the ones jobs just released;
                                  ~5 % with 20 zeros hidden at random LRU positions
sampled, K=64       ~140 us       --
all (exact)         ~9 000 us     100 % always
==================  ============  ==================================================

So sampling costs about 5 % of one JPEG decode (1.6 ms for 500x375 here) and is exact in
the common cases; it misses only rare low-count rows buried in the middle of the LRU order
(a sample finds one with probability ``1 - (1 - p) ** K``), where exact scoring would cost
more than the decode it saves. A hit costs about 1 us (3 us with pin + unpin).

**Locking rule.** The cache lock is a leaf: the cache never calls ``load``, ``refcount`` or
``next_use`` (nor emits a warning) while holding its own lock. Callbacks may therefore take
other locks (the sampler's), and may call back into the cache. The other side of the rule:
callers must not call :meth:`RowCache.get_or_load`, :meth:`RowCache.unpin` or
:meth:`RowCache.release` while holding a lock that ``refcount`` or ``next_use`` need (for
example the sampler's lock), because those calls may evict, and eviction calls them.
Candidate scores are computed outside the lock, so a score can be a few microseconds stale;
an entry pinned or replaced in between is never evicted.

**Over capacity.** If every entry is pinned and a new value does not fit, it is cached anyway
(evicting nothing else would deadlock the jobs that hold the pins). The cache is then over
capacity until pins are released; the next eviction brings it back. ``stats().overshoot_bytes``
records the largest excess, and a :class:`CacheOvershootWarning` is emitted once per cache:
capacity is too small for the rows the jobs hold at once. A value larger than the whole
capacity is returned without being cached at all (``stats().uncached``).

Example:
    >>> import numpy as np
    >>> cache = RowCache(1000, refcount=lambda ids, column: np.zeros(len(ids)))
    >>> cache.get_or_load((7, "label"), lambda: (3, 8))
    3
    >>> cache.get_or_load((7, "label"), lambda: (4, 8))
    3
    >>> cache.release([(7, "label"), (7, "label")])
    >>> s = cache.stats()
    >>> (s.requests, s.hits, s.reads, s.pinned)
    (2, 1, 1, 0)
"""

from __future__ import annotations

import logging
import random
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from catalog.errors import CacheError

__all__ = [
    "CacheKey",
    "CacheOvershootWarning",
    "CacheStats",
    "CacheTooSmallWarning",
    "Loader",
    "NextUseFn",
    "RefCountFn",
    "RowCache",
]

logger = logging.getLogger(__name__)

CacheKey = tuple[int, str]
"""``(row_id, column)``; ``column`` is a decoder key such as ``"image@224"``."""

Loader = Callable[[], tuple[Any, int]]
"""Reads and prepares one value; returns ``(value, nbytes)``."""


class RefCountFn(Protocol):
    """How many jobs still need each row of one column this epoch (vectorized).

    Called with an int64 array of row ids and the cache key column; returns an array of the
    same length (any numeric dtype). Called without the cache lock held.
    """

    def __call__(self, row_ids: npt.NDArray[np.int64], column: str, /) -> npt.ArrayLike:
        """Return one count per row id."""
        ...


class NextUseFn(Protocol):
    """When each row of one column is next used (vectorized; ``np.inf`` = never).

    Called with an int64 array of row ids and the cache key column; returns an array of the
    same length of comparable times or positions (larger = later). Called without the cache
    lock held.
    """

    def __call__(self, row_ids: npt.NDArray[np.int64], column: str, /) -> npt.ArrayLike:
        """Return one next-use time per row id."""
        ...


class CacheOvershootWarning(RuntimeWarning):
    """The pinned rows alone exceed the cache capacity (emitted once per cache)."""


class CacheTooSmallWarning(RuntimeWarning):
    """A value is larger than the whole cache, so it is never cached (emitted once per cache)."""


@dataclass(frozen=True)
class CacheStats:
    """A consistent snapshot of a :class:`RowCache`'s counters.

    ``requests == hits + merged + reads`` always holds.

    Attributes:
        requests: ``get_or_load`` calls.
        hits: requests served from the cache.
        merged: requests that waited on another thread's in-flight load of the same key.
        reads: ``load()`` calls (successful or not).
        failed: ``load()`` calls that raised.
        bytes_read: sum of ``nbytes`` of successful loads.
        uncached: loaded values larger than the capacity, returned without caching.
        evictions: entries evicted to make room.
        bytes_evicted: their bytes.
        entries: entries cached now.
        size_bytes: bytes cached now.
        capacity_bytes: the configured capacity.
        pinned: cached entries with at least one pin now.
        pinned_bytes: their bytes.
        overshoot_bytes: the largest excess of ``size_bytes`` over ``capacity_bytes`` seen
            because every entry was pinned (0 if never).
    """

    requests: int
    hits: int
    merged: int
    reads: int
    failed: int
    bytes_read: int
    uncached: int
    evictions: int
    bytes_evicted: int
    entries: int
    size_bytes: int
    capacity_bytes: int
    pinned: int
    pinned_bytes: int
    overshoot_bytes: int

    @property
    def hit_rate(self) -> float:
        """Fraction of requests served without a read of their own (hits + merged)."""
        return (self.hits + self.merged) / self.requests if self.requests else 0.0


class _Entry:
    __slots__ = ("key", "nbytes", "pins", "pos", "tick", "value")

    def __init__(self, key: CacheKey, value: Any, nbytes: int) -> None:
        self.key = key
        self.value = value
        self.nbytes = nbytes
        self.pins = 0
        self.tick = 0
        self.pos = -1  # index in RowCache._evictable, -1 when pinned or not scored


class _Pending:
    __slots__ = ("error", "event", "owner", "pins", "value")

    def __init__(self, owner: int) -> None:
        self.event = threading.Event()
        self.owner = owner
        self.pins = 0
        self.value: Any = None
        self.error: BaseException | None = None


class RowCache:
    """A byte-bounded cache of prepared ``(row_id, column)`` values shared by threads.

    Args:
        capacity_bytes: the most bytes to keep cached (see "Over capacity" in the module
            docstring for the one exception).
        refcount: vectorized ``refcount(row_ids, column)``; enables RefCnt eviction.
        next_use: vectorized ``next_use(row_ids, column)``; enables Belady eviction.
        sample_size: random candidates scored per eviction; None scores every unpinned
            entry (exact, O(n)). Ignored in LRU mode.
        seed: seed of the candidate sampler, so runs are reproducible.

    Raises:
        CacheError: ``capacity_bytes`` or ``sample_size`` is not a positive int.
    """

    SAMPLE_LRU_HEAD = 8
    """Least recently used entries always among the candidates."""
    SAMPLE_MRU_TAIL = 8
    """Most recently used or released entries always among the candidates."""
    POOL_SIZE = 16
    """Best leftover candidates re-scored at the next eviction."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        refcount: RefCountFn | None = None,
        next_use: NextUseFn | None = None,
        sample_size: int | None = 32,
        seed: int = 0,
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise CacheError(f"capacity_bytes must be an int, got {capacity_bytes!r}.")
        if capacity_bytes <= 0:
            raise CacheError(
                f"capacity_bytes must be positive, got {capacity_bytes}; "
                "give the cache a budget in bytes, e.g. 4 << 30 for 4 GiB."
            )
        if sample_size is not None and (
            isinstance(sample_size, bool) or not isinstance(sample_size, int) or sample_size < 1
        ):
            raise CacheError(
                f"sample_size must be a positive int or None (exact), got {sample_size!r}."
            )
        self._capacity = capacity_bytes
        self._refcount = refcount
        self._next_use = next_use
        self._scored = refcount is not None or next_use is not None
        self._sample_size = sample_size
        self._rng = random.Random(seed)

        self._lock = threading.Lock()
        self._entries: dict[CacheKey, _Entry] = {}
        self._lru: OrderedDict[CacheKey, _Entry] = OrderedDict()  # unpinned, oldest first
        self._evictable: list[_Entry] = []  # unpinned, for random sampling (scored mode)
        self._pool: list[_Entry] = []
        self._pending: dict[CacheKey, _Pending] = {}
        self._ghost_pins: dict[CacheKey, int] = {}  # pins on values too big to cache
        self._tick = 0
        self._size = 0
        self._pinned = 0
        self._pinned_bytes = 0
        self._warned = False
        self._warned_too_big = False

        self._requests = 0
        self._hits = 0
        self._merged = 0
        self._reads = 0
        self._failed = 0
        self._bytes_read = 0
        self._uncached = 0
        self._evictions = 0
        self._bytes_evicted = 0
        self._overshoot = 0

    # ------------------------------------------------------------------ public API

    @property
    def capacity_bytes(self) -> int:
        """The configured capacity in bytes."""
        return self._capacity

    def get_or_load(self, key: CacheKey, load: Loader, *, pin: bool = True) -> Any:
        """Return the value of ``key``, loading it once however many threads ask.

        On a hit, returns the cached value. On a miss, if another thread is loading the same
        key, waits for it and returns its result; otherwise calls ``load()`` (without the
        cache lock), caches the value and evicts as needed.

        Args:
            key: ``(row_id, column)``.
            load: returns ``(value, nbytes)``; called at most once per miss.
            pin: pin the value until :meth:`unpin`; pinned values are never evicted.

        Returns:
            The cached (or just loaded) value; every merged caller gets the same object.

        Raises:
            Exception: whatever ``load`` raised, the same object in every merged caller;
                nothing is cached and the call holds no pin.
            CacheError: ``load`` returned something other than ``(value, nbytes >= 0)``,
                ``load`` asked for the key it is loading, or a ``refcount``/``next_use``
                callback failed during eviction (the value stays cached; no pin is held).
        """
        me = threading.get_ident()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._requests += 1
                self._hits += 1
                if pin:
                    if entry.pins == 0:
                        self._pin_entry(entry)
                    entry.pins += 1
                elif entry.pins == 0:
                    self._touch(entry)
                return entry.value
            pending = self._pending.get(key)
            if pending is None:
                pending = _Pending(me)
                self._pending[key] = pending
                self._reads += 1
                owner = True
            elif pending.owner == me:
                raise CacheError(
                    f"load() for {key!r} asked the cache for {key!r} again; this would wait "
                    "on itself forever. A loader must not request its own key."
                )
            else:
                self._merged += 1
                owner = False
            self._requests += 1
            if pin:
                pending.pins += 1
        if not owner:
            pending.event.wait()
            if pending.error is not None:
                raise pending.error
            return pending.value
        return self._load(key, load, pending, pin)

    def unpin(self, key: CacheKey) -> None:
        """Drop one pin of ``key`` (a job consumed the value it was handed).

        Raises:
            CacheError: ``key`` holds no pin.
        """
        self.release((key,))

    def release(self, keys: Iterable[CacheKey]) -> None:
        """Drop one pin per key (a key listed twice drops two pins).

        May evict if the cache was over capacity because everything was pinned.

        Raises:
            CacheError: a key holds no pin; the keys before it were released.
        """
        with self._lock:
            for key in keys:
                self._unpin_locked(key)
            over = self._size > self._capacity
        if over:
            self._evict()

    def pins(self, key: CacheKey) -> int:
        """Return how many pins ``key`` holds now (including on an uncached value)."""
        with self._lock:
            entry = self._entries.get(key)
            return (entry.pins if entry is not None else 0) + self._ghost_pins.get(key, 0)

    def stats(self) -> CacheStats:
        """Return a consistent snapshot of the counters."""
        with self._lock:
            return CacheStats(
                requests=self._requests,
                hits=self._hits,
                merged=self._merged,
                reads=self._reads,
                failed=self._failed,
                bytes_read=self._bytes_read,
                uncached=self._uncached,
                evictions=self._evictions,
                bytes_evicted=self._bytes_evicted,
                entries=len(self._entries),
                size_bytes=self._size,
                capacity_bytes=self._capacity,
                pinned=self._pinned,
                pinned_bytes=self._pinned_bytes,
                overshoot_bytes=self._overshoot,
            )

    def clear(self) -> int:
        """Drop every unpinned entry (pinned ones stay until released); counters stay.

        Returns:
            The number of entries dropped.
        """
        with self._lock:
            dropped = list(self._lru.values())
            for entry in dropped:
                del self._entries[entry.key]
                self._size -= entry.nbytes
            self._lru.clear()
            self._evictable.clear()
            self._pool.clear()
        logger.debug("cleared %d cache entries", len(dropped))
        return len(dropped)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __repr__(self) -> str:
        policy = "belady" if self._next_use else "refcount" if self._refcount else "lru"
        return (
            f"RowCache({self._size}/{self._capacity} bytes, {len(self._entries)} entries, "
            f"policy={policy})"
        )

    # ------------------------------------------------------------------ loading

    def _load(self, key: CacheKey, load: Loader, pending: _Pending, pin: bool) -> Any:
        try:
            result = load()
        except BaseException as exc:
            shared: BaseException = exc
            if not isinstance(exc, Exception):  # KeyboardInterrupt & co. stay in their thread
                shared = CacheError(f"load() for {key!r} was interrupted")
                shared.__cause__ = exc
            self._fail(key, pending, shared)
            raise
        try:
            value, nbytes = result
        except (TypeError, ValueError):
            nbytes = None
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            error = CacheError(
                f"load() for {key!r} returned {type(result).__name__}; it must return "
                "(value, nbytes) with nbytes a non-negative int."
            )
            self._fail(key, pending, error)
            raise error
        nbytes = int(nbytes)
        too_big = False
        with self._lock:
            del self._pending[key]
            self._bytes_read += nbytes
            if nbytes > self._capacity:
                self._uncached += 1
                too_big, self._warned_too_big = not self._warned_too_big, True
                if pending.pins:
                    self._ghost_pins[key] = self._ghost_pins.get(key, 0) + pending.pins
                over = False
            else:
                entry = _Entry(key, value, nbytes)
                self._entries[key] = entry
                self._size += nbytes
                if pending.pins:
                    entry.pins = pending.pins
                    self._pinned += 1
                    self._pinned_bytes += nbytes
                else:
                    self._add_evictable(entry)
                over = self._size > self._capacity
            pending.value = value
            pending.event.set()
        if too_big:
            warnings.warn(
                f"RowCache: a value of {nbytes} bytes ({key[1]}) is larger than the whole cache "
                f"(capacity_bytes={self._capacity}); such values are never cached, so no other "
                "request can share it. Raise the cache capacity.",
                CacheTooSmallWarning,
                stacklevel=4,
            )
        if over:
            try:
                self._evict()
            except BaseException:
                if pin:
                    with self._lock:
                        self._unpin_locked(key)
                raise
        return value

    def _fail(self, key: CacheKey, pending: _Pending, error: BaseException) -> None:
        with self._lock:
            del self._pending[key]
            self._failed += 1
            pending.error = error
            pending.event.set()

    # ------------------------------------------------------------------ pin bookkeeping
    # All helpers below run with self._lock held.

    def _unpin_locked(self, key: CacheKey) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1
            if entry.pins == 0:
                self._pinned -= 1
                self._pinned_bytes -= entry.nbytes
                self._add_evictable(entry)
            return
        ghost = self._ghost_pins.get(key, 0)
        if ghost:
            if ghost == 1:
                del self._ghost_pins[key]
            else:
                self._ghost_pins[key] = ghost - 1
            return
        state = "cached but not pinned" if entry is not None else "not cached"
        raise CacheError(
            f"Cannot unpin {key!r}: it is {state}. Release each key once per "
            "get_or_load(..., pin=True) that returned it."
        )

    def _pin_entry(self, entry: _Entry) -> None:
        del self._lru[entry.key]
        if self._scored:
            self._remove_evictable(entry)
        self._pinned += 1
        self._pinned_bytes += entry.nbytes

    def _touch(self, entry: _Entry) -> None:
        self._tick += 1
        entry.tick = self._tick
        self._lru.move_to_end(entry.key)

    def _add_evictable(self, entry: _Entry) -> None:
        self._tick += 1
        entry.tick = self._tick
        self._lru[entry.key] = entry
        if self._scored:
            entry.pos = len(self._evictable)
            self._evictable.append(entry)

    def _remove_evictable(self, entry: _Entry) -> None:
        last = self._evictable.pop()
        if last is not entry:
            self._evictable[entry.pos] = last
            last.pos = entry.pos
        entry.pos = -1

    def _drop(self, entry: _Entry) -> None:
        del self._entries[entry.key]
        del self._lru[entry.key]
        if self._scored:
            self._remove_evictable(entry)
        self._size -= entry.nbytes
        self._evictions += 1
        self._bytes_evicted += entry.nbytes

    # ------------------------------------------------------------------ eviction

    def _evict(self) -> None:
        """Evict until size <= capacity; call with the lock NOT held."""
        while True:
            with self._lock:
                if self._size <= self._capacity:
                    return
                if self._scored and self._lru:
                    candidates = self._candidates()
                    keys = [e.key for e in candidates]
                    ticks = [e.tick for e in candidates]
                else:
                    while self._size > self._capacity and self._lru:
                        self._drop(next(iter(self._lru.values())))
                    if self._size <= self._capacity:
                        return
                    excess = self._size - self._capacity
                    self._overshoot = max(self._overshoot, excess)
                    warn = not self._warned
                    self._warned = True
                    pinned_bytes = self._pinned_bytes
                    break
            order = self._rank(keys, ticks)  # calls refcount / next_use: outside the lock
            with self._lock:
                pool: dict[CacheKey, _Entry] = {}  # best leftovers, re-scored next time
                entries = self._entries
                for i in order.tolist():
                    victim: _Entry = candidates[i]
                    if victim.pins or entries.get(victim.key) is not victim:
                        continue  # pinned, replaced or already evicted since it was scored
                    if self._size > self._capacity:
                        self._drop(victim)
                    elif len(pool) < self.POOL_SIZE:
                        pool[victim.key] = victim
                    else:
                        break
                self._pool = list(pool.values())
        if warn:
            warnings.warn(
                f"RowCache: pinned rows take {pinned_bytes} bytes, more than "
                f"capacity_bytes={self._capacity}; the cache is over capacity by up to "
                f"{excess} bytes until jobs release rows. Raise capacity_bytes or hand out "
                "fewer rows ahead of consumption.",
                CacheOvershootWarning,
                stacklevel=4,
            )

    def _candidates(self) -> list[_Entry]:
        """Entries to score (may repeat one; duplicates are skipped at eviction)."""
        evictable = self._evictable
        n = len(evictable)
        k = self._sample_size
        if k is None or n <= k:
            return list(evictable)
        entries = self._entries
        chosen = [e for e in self._pool if e.pins == 0 and entries.get(e.key) is e]
        lru = self._lru.values()
        chosen.extend(islice(lru, self.SAMPLE_LRU_HEAD))
        chosen.extend(islice(reversed(lru), self.SAMPLE_MRU_TAIL))
        rand = self._rng.random
        chosen.extend([evictable[int(rand() * n)] for _ in range(k)])
        return chosen

    def _rank(self, keys: list[CacheKey], ticks: list[int]) -> npt.NDArray[np.intp]:
        """Return candidate indices, best victim first."""
        sort_keys: list[npt.NDArray[Any]] = [np.array(ticks, dtype=np.int64)]  # last = primary
        if self._refcount is not None:
            sort_keys.append(_call_score(self._refcount, "refcount", keys))
        if self._next_use is not None:
            sort_keys.append(-_call_score(self._next_use, "next_use", keys))
        return np.lexsort(sort_keys)


def _call_score(
    fn: RefCountFn | NextUseFn, name: str, keys: list[CacheKey]
) -> npt.NDArray[np.float64]:
    """Call ``fn`` once per column among ``keys``; one float per key."""
    ids = np.array([k[0] for k in keys], dtype=np.int64)
    columns = [k[1] for k in keys]
    first = columns[0]
    if columns.count(first) == len(columns):
        groups: dict[str, Any] = {first: slice(None)}
    else:
        by_column: dict[str, list[int]] = {}
        for i, column in enumerate(columns):
            by_column.setdefault(column, []).append(i)
        groups = {c: np.array(idx, dtype=np.intp) for c, idx in by_column.items()}
    out = np.empty(len(keys), dtype=np.float64)
    for column, idx in groups.items():
        sub = ids[idx]
        try:
            scores = np.asarray(fn(sub, column), dtype=np.float64)
        except Exception as exc:
            raise CacheError(f"{name}(row_ids, {column!r}) failed during eviction: {exc}") from exc
        if scores.shape != sub.shape:
            raise CacheError(
                f"{name}(row_ids, {column!r}) returned shape {scores.shape} for "
                f"{len(sub)} row ids; return one number per row id."
            )
        out[idx] = scores
    return out
