"""One job's queue (:class:`JobQueue`): the rows sampled for it and not yet cut into batches.

The queue is three arrays of one length (row, round it is used in, epoch; a fed weighted job
has a fourth, each row's ``_weight`` as its leader sent it), its row source's
position for the job (``epoch``, ``left``: rows of that epoch it still hands out) and how far
ahead the job samples (``horizon``, from ``lookahead`` or the cache). Only
:mod:`tabloader.engine._queue.queues` writes it (rounds append, cuts pop the head, a newcomer gets
the tail given back); the scheduler and the dealer read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

NO_ROWS = np.empty(0, np.int64)  # an empty queue (shared: queues are replaced, never written)
NO_WEIGHTS = np.empty(0, np.float32)  # no weights queued (every job but a fed weighted one)


class RoundLog:
    """The rounds of the rows a job cut lately, for :meth:`JobQueues._rebase` (appended in
    place: a job of a long lookahead cuts a batch at a time)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, np.int64)
        self._n = 0

    def add(self, rounds: npt.NDArray[np.int64], keep: int) -> None:
        """Log ``rounds``, keeping at least the last ``keep`` logged."""
        if self._n + rounds.size > self._buf.size:
            tail = self._buf[max(0, self._n - keep) : self._n]
            buf = np.empty(max(64, 2 * (keep + rounds.size)), np.int64)
            buf[: tail.size] = tail
            self._buf, self._n = buf, tail.size
        self._buf[self._n : self._n + rounds.size] = rounds
        self._n += rounds.size

    def rounds(self) -> npt.NDArray[np.int64]:
        """The rounds logged (a view)."""
        return self._buf[: self._n]

    def keep_from(self, floor: int) -> None:
        """Forget the rounds below ``floor``."""
        kept = self.rounds()[self.rounds() >= floor]
        self._buf, self._n = kept.copy(), kept.size


@dataclass(eq=False)
class JobQueue:
    """The rows sampled for one job (all its ranks) and not cut yet, and its source's place.

    The horizon: ``lookahead`` given at open (per rank, times the ranks), else it follows
    the cache (``cache_rows``: the arena's capacity in this job's values) and the job's pace,
    never below ``floor`` (:meth:`JobQueues._set_horizons`).
    """

    horizon: int  # rows sampled ahead (queued + preparing + ready), all ranks
    floor: int = 0
    lookahead: int | None = None
    cache_rows: int = 0
    arena_spaces: list[int] = field(default_factory=list)  # of the job's prepared columns
    q_rows: npt.NDArray[np.int64] = field(default_factory=lambda: NO_ROWS)
    q_rounds: npt.NDArray[np.int64] = field(default_factory=lambda: NO_ROWS)
    q_epochs: npt.NDArray[np.int64] = field(default_factory=lambda: NO_ROWS)
    # a fed weighted job's ``_weight`` of each queued row (the leader's); else empty
    q_weights: npt.NDArray[np.float32] = field(default_factory=lambda: NO_WEIGHTS)
    epoch: int = 0  # epoch of the rows its source hands out next
    left: int = 0  # rows of that epoch the source still has to hand out
    # the job draws with replacement (a weighted job): a row may come twice in an epoch or
    # never, so its rows count as future uses when sampled, not all at the epoch's start
    repeats: bool = False
    # where the job started: its first epoch has ``first_rows`` rows (fewer when resumed)
    first_epoch: int = 0
    first_rows: int = 0
    # rounds of the rows cut from the queue lately (``JobQueues._rebase``)
    cut_rounds: RoundLog = field(default_factory=RoundLog)

    def spaces(self) -> list[int]:
        """The arena spaces whose values the queued rows will use (``FutureUses`` counts)."""
        return self.arena_spaces

    def dynamic(self) -> bool:
        """Whether the horizon follows the cache and the job's pace (no ``lookahead`` given,
        prepared columns in the arena)."""
        return self.lookahead is None and self.cache_rows > 0

    def append(
        self,
        rows: npt.NDArray[np.int64],
        rounds: npt.NDArray[np.int64],
        weights: npt.NDArray[np.float32] | None = None,
    ) -> None:
        """Queue ``rows`` of the current epoch, used in ``rounds`` (with their ``weights``:
        a fed weighted job's, given with every append or never)."""
        if weights is not None:
            self.q_weights = np.concatenate((self.q_weights, weights))
        self.q_rows = np.concatenate((self.q_rows, rows))
        self.q_rounds = np.concatenate((self.q_rounds, rounds))
        self.q_epochs = np.concatenate((self.q_epochs, np.full(rows.size, self.epoch, np.int64)))

    def pop(self, n: int) -> npt.NDArray[np.int64]:
        """The first ``n`` rows leave (cut into a batch, or dropped); their rounds are logged."""
        rows = self.q_rows[:n].copy()
        self.cut_rounds.add(self.q_rounds[:n], 2 * self.horizon)
        self.q_weights = self.q_weights[n:]
        self.q_rows, self.q_rounds, self.q_epochs = (
            self.q_rows[n:],
            self.q_rounds[n:],
            self.q_epochs[n:],
        )
        return rows

    def head_weights(self, n: int) -> npt.NDArray[np.float32] | None:
        """The ``_weight``s of the first ``n`` rows (None: the queue carries none)."""
        return self.q_weights[:n].copy() if self.q_weights.size else None

    def keep(self, n: int) -> npt.NDArray[np.int64]:
        """Keep the first ``n`` rows; the rest leave (given back to the sampler)."""
        rows = self.q_rows[n:]
        self.q_weights = self.q_weights[:n]
        self.q_rows, self.q_rounds, self.q_epochs = (
            self.q_rows[:n],
            self.q_rounds[:n],
            self.q_epochs[:n],
        )
        return rows

    def clear(self) -> npt.NDArray[np.int64]:
        """Empty the queue (the job leaves); the rows it held."""
        rows = self.q_rows
        self.q_rows = self.q_rounds = self.q_epochs = NO_ROWS
        self.q_weights = NO_WEIGHTS
        return rows
