"""Eviction policies: which cached value makes room, from its next use, uses and last use.

A policy sees three numbers per candidate (a cached value that nothing pins):

* ``next_use``: when the value is needed next (larger = later; ``inf``: not known to be
  needed, e.g. beyond the sampler's horizon). The arena gets the round of the next queued use
  from the scheduler; the cache simulator (:mod:`tests.support.cachesim`) the position of
  the next request when it falls inside its lookahead window.
* ``uses``: how many jobs still need the value this epoch (its reference count).
* ``last_use``: when it was last used (larger = more recent).

A policy is defined by one method, :meth:`EvictionPolicy.keys`: the sort keys of a candidate,
most significant first; the candidate of the smallest keys is evicted first. ``keys`` works
on scalars and on numpy arrays alike, so the arena ranks a whole slot class at once and the
simulator keeps a heap of per-row key tuples: both rank by the same object, so the benchmark
measures the code that runs. The arena's policy is :data:`ARENA_POLICY` (:class:`FarthestNextUse`).

The arena needs the best few victims of many candidates (a cache of small values holds tens
of thousands): :meth:`EvictionPolicy.select` finds the ``k`` best in linear time, a
``partition`` per key, and sorts only those (``order(...)[:k]`` sorted them all: a
``lexsort`` of 40,000 candidates to evict 16 cost about 3 ms); both give the same positions
in the same order.

Belady's MIN is not a policy here: it needs every future request (not a horizon), and it may
decline to cache the incoming value. With all next uses known, :class:`FarthestNextUse` is
MIN; the simulator keeps MIN as a separate offline computation over the whole stream (a
bound for every policy, checked against this one in the tests).

Example:
    >>> import numpy as np
    >>> ARENA_POLICY.order(np.array([5.0, 9, 9, np.inf]), np.array([0, 3, 1, 2]),
    ...                    np.array([1, 2, 3, 4])).tolist()
    [3, 2, 1, 0]
    >>> ARENA_POLICY.select(np.array([5.0, 9, 9, np.inf]), np.array([0, 3, 1, 2]),
    ...                     np.array([1, 2, 3, 4]), 2).tolist()
    [3, 2]
    >>> ARENA_POLICY.keys(9.0, 1, 3)
    (-9.0, 1, 3)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt


class EvictionPolicy:
    """Ranks eviction candidates by :meth:`keys`; subclasses define ``keys``."""

    name = "policy"

    def keys(self, next_use: Any, uses: Any, last_use: Any) -> tuple[Any, ...]:
        """The sort keys of candidates (scalars or arrays), most significant first: the
        smallest keys are evicted first."""
        raise NotImplementedError

    def order(
        self, next_use: npt.ArrayLike, uses: npt.ArrayLike, last_use: npt.ArrayLike
    ) -> npt.NDArray[np.intp]:
        """Candidate positions, best victim first (ties keep the given order)."""
        keys = self.keys(np.asarray(next_use), np.asarray(uses), np.asarray(last_use))
        return np.lexsort(keys[::-1]).astype(np.intp, copy=False)

    def select(
        self, next_use: npt.ArrayLike, uses: npt.ArrayLike, last_use: npt.ArrayLike, k: int
    ) -> npt.NDArray[np.intp]:
        """The ``k`` best victims' positions, best first: ``order(...)[:k]``, in linear time
        (a ``partition`` per key narrows the candidates; only the ``k`` chosen are sorted)."""
        arrays = [np.asarray(a) for a in (next_use, uses, last_use)]
        n = max(a.size for a in arrays)
        if k >= n:
            return self.order(*arrays)
        keys = [np.broadcast_to(key, n) for key in self.keys(*arrays)]
        chosen = _smallest(keys, np.arange(n), max(k, 0))
        return chosen[np.lexsort([key[chosen] for key in keys[::-1]])].astype(np.intp, copy=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FarthestNextUse(EvictionPolicy):
    """The arena's policy: the farthest next use (unknown ones first), then the fewest future
    uses (RefCnt: zero first), then the least recent use.

    Inside the sampler's horizon this is Belady's MIN; beyond it (``inf``), RefCnt.
    """

    name = "farthest next use"

    def keys(self, next_use: Any, uses: Any, last_use: Any) -> tuple[Any, ...]:
        return (-next_use, uses, last_use)


class FewestUses(EvictionPolicy):
    """RefCnt without lookahead: the fewest future uses (zero first), then the least recent."""

    name = "fewest uses"

    def keys(self, next_use: Any, uses: Any, last_use: Any) -> tuple[Any, ...]:
        return (uses, last_use)


class LeastRecent(EvictionPolicy):
    """LRU: the least recently used (the arena's policy when it is given no scores)."""

    name = "least recent"

    def keys(self, next_use: Any, uses: Any, last_use: Any) -> tuple[Any, ...]:
        return (last_use,)


def _smallest(
    keys: list[npt.NDArray[Any]], cand: npt.NDArray[np.intp], k: int
) -> npt.NDArray[np.intp]:
    """The ``k`` of ``cand`` (sorted positions) of the lexicographically smallest ``keys``,
    sorted by position; of tied candidates, the first ones (``lexsort`` is stable)."""
    if k >= cand.size:
        return cand
    if k == 0:
        return cand[:0]
    key = keys[0][cand]
    low = key.min()
    at_low = key == low
    if np.count_nonzero(at_low) >= k:  # the usual case: many unknown next uses, or no uses
        tie = cand[at_low]
        return tie[:k] if len(keys) == 1 else _smallest(keys[1:], tie, k)
    # (numpy's partition is slow on many infinities: 5 ms for 45,000 keys, 90% -inf)
    kth = np.partition(key, k - 1)[k - 1]
    below = cand[key < kth]
    tie = cand[key == kth]
    rest = k - below.size
    picked = tie[:rest] if len(keys) == 1 else _smallest(keys[1:], tie, rest)
    return np.sort(np.concatenate((below, picked)))


def keys_at_most(keys: tuple[Any, ...], bound: tuple[Any, ...]) -> npt.NDArray[np.bool_]:
    """Which candidates' ``keys`` (arrays, most significant first) are at most ``bound`` (a
    candidate's keys, scalars) in the policies' lexicographic order: as good victims as it
    or better."""
    out = np.asarray(keys[-1] <= bound[-1])
    for key, limit in zip(keys[-2::-1], bound[-2::-1], strict=True):
        out = (key < limit) | ((key == limit) & out)
    return out


ARENA_POLICY: EvictionPolicy = FarthestNextUse()
"""The policy an :class:`~tabloader.engine._arena.arena.Arena` uses unless given another."""
