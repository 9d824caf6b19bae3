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
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from tabloader.engine.jobs import JobState

__all__ = ["FutureUses"]


class FutureUses:
    """``uses`` and ``next_round`` per arena space over ``num_rows`` rows."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.uses: dict[int, npt.NDArray[np.int32]] = {}  # arena space -> row -> future uses
        self.next_round: dict[int, npt.NDArray[np.float64]] = {}  # space -> row -> round
        self._mark = np.zeros(num_rows, bool)  # scratch: rows being unqueued

    def grow(self, num_rows: int) -> None:
        """The dataset has ``num_rows`` rows now (appended ones have no uses yet)."""
        for arrays, fill in ((self.uses, 0), (self.next_round, np.inf)):
            for key, old in arrays.items():
                grown = np.full(num_rows, fill, dtype=old.dtype)
                grown[: old.size] = old
                arrays[key] = grown
        self._mark = np.zeros(num_rows, bool)
        self.num_rows = num_rows

    def count(self, job: JobState, rows: npt.NDArray[Any], delta: int) -> None:
        """``job`` will use ``rows`` (``delta`` +1), or no longer will (-1)."""
        for space in job.spaces():
            counts = self.uses.get(space)
            if counts is None:
                counts = self.uses[space] = np.zeros(self.num_rows, np.int32)
                self.next_round[space] = np.full(self.num_rows, np.inf)
            counts[rows.astype(np.intp, copy=False)] += delta

    def queued(
        self, job: JobState, rows: npt.NDArray[np.int64], rounds: npt.NDArray[np.int64]
    ) -> None:
        """``rows`` joined ``job``'s queue, to be used in ``rounds``."""
        for space in job.spaces():
            nxt = self.next_round[space]
            nxt[rows] = np.minimum(nxt[rows], rounds)

    def unqueued(
        self,
        job: JobState,
        rows: npt.NDArray[np.int64],
        jobs: Iterable[JobState],
        *,
        used: bool = True,
    ) -> None:
        """``rows`` left ``job``'s queue: one use less (``used``: cut into a batch; else given
        back to the sampler, still a future use); their next queued use is recomputed from the
        queues of ``jobs`` (the scheduler's open jobs)."""
        if rows.size == 0:
            return
        mark = self._mark
        mark[rows] = True
        others = list(jobs)
        for space in job.spaces():
            if used:
                np.subtract.at(self.uses[space], rows, 1)  # a queue spanning epochs repeats
            nxt = self.next_round[space]
            nxt[rows] = np.inf
            for other in others:
                if other.q_rows.size and space in other.spaces():
                    hit = mark[other.q_rows]
                    if hit.any():  # reversed: of a row queued twice, the earlier round wins
                        q, r = other.q_rows[hit][::-1], other.q_rounds[hit][::-1]
                        nxt[q] = np.minimum(nxt[q], r)
        mark[rows] = False

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
