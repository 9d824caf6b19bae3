"""Future uses of a dataset's rows: the arena's eviction inputs, kept by the scheduler.

Per arena space (a job's prepared columns and their parameters), two arrays over the
dataset's rows, kept incrementally with array operations:

* ``uses[row]``: the open jobs that still need the row this epoch (in the sampler's remaining
  set, or queued);
* ``next_round[row]``: the round of the row's next queued use (inf if none).

Rows leave both when they are cut into a batch; until that batch's look-up pins them, the
fetcher counts them (``Fetcher.starting``) and the scheduler's ``score`` ranks them as needed
before any queued row. The caller holds the scheduler's lock; the arena reads the arrays
without it (a stale value only makes one eviction choice less good).

``next_round`` is the least of each job's own first queued round of the row (``first``, an
array per job with a queue, and ``entries``, its entries of each row: a queue spanning two
epochs holds a row twice). When rows leave a queue, their next round is the least of the
other jobs' first rounds: a few gathers per row, whatever the queues' lengths (scanning every
queue cost O(all queued rows) per batch: with queues of the cache's size, the lookahead that
lets the arena evict as Belady's MIN does, that was most of the scheduler's time).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from tabloader.engine._queue.jobqueue import JobQueue


class FutureUses:
    """``uses`` and ``next_round`` per arena space over ``num_rows`` rows."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.uses: dict[int, npt.NDArray[np.int32]] = {}  # arena space -> row -> future uses
        self.next_round: dict[int, npt.NDArray[np.float64]] = {}  # space -> row -> round
        self.first: dict[Any, npt.NDArray[np.float64]] = {}  # job -> row -> its first round
        self.entries: dict[Any, npt.NDArray[np.integer[Any]]] = {}  # job -> row -> entries queued
        self._mark = np.zeros(num_rows, bool)  # scratch: rows being unqueued

    def grow(self, num_rows: int) -> None:
        """The dataset has ``num_rows`` rows now (appended ones have no uses yet)."""
        for arrays, fill in (
            (self.uses, 0),
            (self.next_round, np.inf),
            (self.first, np.inf),
            (self.entries, 0),
        ):
            for key, old in arrays.items():
                grown = np.full(num_rows, fill, dtype=old.dtype)
                grown[: old.size] = old
                arrays[key] = grown
        self._mark = np.zeros(num_rows, bool)
        self.num_rows = num_rows

    # ``ufunc.at`` is given a scalar of the array's own dtype: with a Python int, numpy 2.4
    # takes its casting path (16 us instead of 1.5 us for 256 rows of an int8/int32 array)

    def count(
        self, job: JobQueue, rows: npt.NDArray[Any], delta: int, *, repeats: bool = False
    ) -> None:
        """``job`` will use ``rows`` (``delta`` +1), or no longer will (-1); ``repeats``:
        ``rows`` may hold a row more than once (draws with replacement), each counted."""
        for space in job.spaces():
            counts = self.uses.get(space)
            if counts is None:
                counts = self.uses[space] = np.zeros(self.num_rows, np.int32)
                self.next_round[space] = np.full(self.num_rows, np.inf)
            if repeats:
                np.add.at(counts, rows, counts.dtype.type(delta))
            else:
                counts[rows.astype(np.intp, copy=False)] += delta

    def queued(
        self, job: JobQueue, rows: npt.NDArray[np.int64], rounds: npt.NDArray[np.int64]
    ) -> None:
        """``rows`` joined ``job``'s queue, to be used in ``rounds``."""
        if not job.spaces():  # a job that prepares nothing (gathers only) ranks no value
            return
        first, count = self._queue_of(job)
        np.add.at(count, rows, count.dtype.type(1))
        first[rows] = np.minimum(first[rows], rounds)
        for space in job.spaces():
            nxt = self.next_round[space]
            nxt[rows] = np.minimum(nxt[rows], rounds)

    def _queue_of(self, job: Any) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.integer[Any]]]:
        first = self.first.get(job)
        if first is None:
            first = self.first[job] = np.full(self.num_rows, np.inf)
            # a permutation queues a row at most twice (two epochs); draws with replacement
            # may queue one row thousands of times
            dtype = np.int32 if getattr(job, "repeats", False) else np.int8
            self.entries[job] = np.zeros(self.num_rows, dtype)
        return first, self.entries[job]

    def unqueued(
        self,
        job: JobQueue,
        rows: npt.NDArray[np.int64],
        jobs: Iterable[JobQueue],
        *,
        used: bool = True,
    ) -> None:
        """``rows`` left ``job``'s queue (``job.q_rows`` is what stays): one use less
        (``used``: cut into a batch; else given back to the sampler, still a future use);
        their next queued use is the least first round of the jobs ``jobs`` (the scheduler's
        open jobs) that queue them."""
        if rows.size == 0 or not job.spaces():
            return
        first, count = self._queue_of(job)
        np.subtract.at(count, rows, count.dtype.type(1))
        first[rows] = np.inf
        again = rows[count[rows] > 0]
        if again.size:  # its queue spans two epochs and holds them again: their next entry
            mark = self._mark
            mark[again] = True
            hit = mark[job.q_rows]
            mark[again] = False
            q, r = job.q_rows[hit][::-1], job.q_rounds[hit][::-1]  # of two, the earlier wins
            first[q] = np.minimum(first[q], r)
        others = [o for o in jobs if o is not job and o in self.first]
        for space in job.spaces():
            if used:
                # a queue spanning epochs repeats rows
                np.subtract.at(self.uses[space], rows, np.int32(1))
            best = first[rows]
            for other in others:
                if space in other.spaces():
                    best = np.minimum(best, self.first[other][rows])
            self.next_round[space][rows] = best
        if job.q_rows.size == 0:  # nothing queued: its arrays hold nothing (made again)
            del self.first[job], self.entries[job]

    def of(self, space: int, rows: npt.NDArray[np.int64]) -> tuple[Any, Any]:
        """(round of next queued use, future uses) of ``rows`` in ``space`` (inf and 0 for
        rows past the arrays or a space no job uses)."""
        nxt, uses = self.next_round.get(space), self.uses.get(space)
        if nxt is not None and uses is not None and (rows.size == 0 or rows.max() < nxt.size):
            return nxt.take(rows), uses.take(rows)  # the usual case: two gathers, no mask
        n = np.full(rows.size, np.inf)
        u = np.zeros(rows.size)
        if nxt is not None and uses is not None:
            ok = rows < nxt.size
            n[ok], u[ok] = nxt[rows[ok]], uses[rows[ok]]
        return n, u
