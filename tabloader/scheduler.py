"""Per-dataset scheduling: sampling rounds -> each job's queue of row ids -> batches to prepare.

Data flow, per dataset::

    scheduler thread: sample_many(every job with room below its horizon)
        -> rows queued per job as arrays (row, round, epoch)
    a job's first ``prefetch`` batches are cut from its queue and handed to the Fetcher
        -> Work (one per batch) -> gathered, looked up / decoded in the arena, collated
    the job's consumer takes its next finished batch (``take``)

* **Rounds with many jobs.** A job whose queued and in-flight rows fall below ``prefetch``
  batches triggers a round, and every job with at least a batch of room below its *horizon*
  (``lookahead`` rows) takes part, so jobs at about the same pace get the same rows although
  their consumers wake at different moments. Ids are cheap: sampling ahead costs a queue.
* **Future uses** (the arena's eviction inputs), per arena space, kept incrementally with
  array operations: ``uses[row]``, the open jobs that still need the row this epoch (in the
  sampler's remaining set, or queued); ``next_round[row]``, the round of its next queued use
  (inf if none). Rows leave both when they are cut into a batch; until that batch's look-up
  pins them, the fetcher counts them (``Fetcher.starting``) and ``score`` ranks them as
  needed before any queued row.
* **Own pace.** A slow job's queue reaches its horizon and it stops taking part in rounds; the
  fast jobs go on alone. Nobody waits for anybody.
* **Epochs.** Batches never straddle an epoch; the last batch of an epoch may be short.
* **Ranks (DDP).** The ranks of a data-parallel job are one job (one queue, one entry in the
  sampler: it shares with every other job); each rank is a :class:`RankState`, a plain job
  has one. Batches are cut from the job's queue as above and dealt round-robin, the k-th of an
  epoch to rank ``k % world_size``. With more than one rank every rank gets
  ``n // (batch_size * world_size)`` full batches of an epoch of ``n`` rows and the last
  ``n % (batch_size * world_size)`` rows (the last in the sampler's order) are dropped, as
  ``DistributedSampler(drop_last=True)`` does. Lockstep: batches are cut only while the rank
  whose turn it is has room below ``prefetch``, so a rank ahead waits for the slow one and
  at most ``prefetch`` batches per rank are in flight. A rank that left has its turns
  dropped, unprepared.
* **Fed jobs (a cluster node).** On a node of a Ray cluster the leader samples for every
  job (:mod:`tabloader.cluster`): each rank there is a job of its own here (``fed``), whose
  queue :meth:`DatasetScheduler.feed` fills with the rows and rounds the leader sent, and whose
  epoch has ``rank_rows`` rows. It takes no part in this scheduler's rounds. A fed job whose
  cluster job is gone (a rank or node failed) raises the reason once it would wait for rows.
* **Stalls.** Per job, seconds blocked in ``take`` (waiting for data) vs seconds between
  batches (its own compute).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from pyroaring import BitMap

from catalog.bitmaps import bitmap_to_array
from catalog.errors import LoaderError
from tabloader.fetch import Fetcher, Plan, Work

__all__ = ["DatasetScheduler", "JobState", "OnError", "RankState"]

logger = logging.getLogger(__name__)

ABANDONED_CHECK_S = 1.0  # how often an idle scheduler looks for streams dropped without close()
PENDING_WARN_S = 30.0  # a rank waiting this long for a rank that never opened logs a warning
_EMPTY = np.empty(0, np.int64)


class OnError(enum.Enum):
    """What a job does with a row that fails to read or decode."""

    RAISE = "raise"
    SKIP = "skip"


@dataclass(eq=False)
class JobState:
    """One open job of a dataset: its queue of rows, its ranks (one unless data-parallel).

    ``world_size`` ranks share the queue and take turns (see the module docstring); each
    :class:`RankState` has its own batches in preparation and counters.
    """

    name: str
    ids: BitMap
    plan: Plan
    batch_size: int
    prefetch: int  # batches prepared ahead, per rank
    horizon: int  # rows sampled ahead (queued + preparing + ready), all ranks
    on_error: OnError
    epochs: int | None = None  # stop after this many epochs (None: never)
    world_size: int = 1
    sampler: Any = None  # the scheduler's sampler the job is registered in
    id_array: npt.NDArray[np.int64] = field(default_factory=lambda: _EMPTY)
    epoch: int = 0  # epoch of the rows the sampler hands out next
    left: int = 0  # rows of that epoch the sampler still has to hand out
    q_rows: npt.NDArray[np.int64] = field(default_factory=lambda: _EMPTY)
    q_rounds: npt.NDArray[np.int64] = field(default_factory=lambda: _EMPTY)
    q_epochs: npt.NDArray[np.int64] = field(default_factory=lambda: _EMPTY)
    remote: bool = False  # batches are handed over pinned (the loader service's clients)
    closed: bool = False
    ranks: list[RankState] = field(init=False)
    num_ids: int = field(init=False)
    # where the job started: its first epoch has ``first_rows`` rows (fewer when resumed)
    first_epoch: int = 0
    first_rows: int = 0
    resumed: tuple[int, BitMap] | None = None  # the state it was opened from (ranks compare)
    # dealing: the next batch cut is batch ``cut`` (from 0) of epoch ``cut_epoch``
    cut_epoch: int = 0
    cut: int = 0
    # batches cut and not yet behind every rank: (epoch, index, rows), for ``state_dict``;
    # an epoch's dropped remainder is logged with index ``batches_per_epoch``
    log: deque[tuple[int, int, npt.NDArray[np.int64]]] = field(default_factory=deque)
    warned_pending: bool = False
    fed: bool = False  # rows come from ``feed`` (a cluster leader), not from a sampler
    rank_rows: int = 0  # fed: rows of each epoch
    gone: str | None = None  # fed: why the cluster job left (its ranks fail with it)

    def __post_init__(self) -> None:
        self.num_ids = len(self.ids)
        self.ranks = [RankState(self, r) for r in range(self.world_size)]

    def in_flight(self) -> int:
        return sum(w.rows.size for r in self.ranks for w in r.batches)

    def all_joined(self) -> bool:
        """True once every rank has opened (or left): before, no rank gets a batch, so a rank
        that finishes early never leaves the job before the others have joined it."""
        return all(r.opened or r.closed for r in self.ranks)

    def batches_per_rank(self, epoch: int) -> int:
        """Batches each rank gets in ``epoch`` (the last may be short with a single rank)."""
        if self.fed:
            return -(-self.rank_rows // self.batch_size)
        n = self.first_rows if epoch == self.first_epoch else self.num_ids
        if self.world_size == 1:
            return -(-n // self.batch_size)
        return n // (self.batch_size * self.world_size)

    def done_sampling(self) -> bool:
        """True once the sampler has handed out the job's last epoch."""
        return self.left == 0 and self.epochs is not None and self.epoch + 1 >= self.epochs

    def room(self) -> int:
        """Rows below the horizon (negative: up to one batch over it; see ``_sample_locked``)."""
        if self.done_sampling():
            return 0
        return self.horizon - self.q_rows.size - self.in_flight()

    def hungry(self) -> bool:
        """True if the job has fewer rows ahead than ``prefetch`` batches per rank (it starts a
        round)."""
        return (
            not self.fed
            and self.room() > 0
            and self.q_rows.size + self.in_flight()
            < self.prefetch * self.batch_size * self.world_size
        )

    def stats(self) -> dict[str, Any]:
        """The job's counters: its rank's, or the sum over its ranks (and each under ``ranks``)."""
        per_rank = [r.stats() for r in self.ranks]
        if self.world_size == 1:
            return per_rank[0]
        total = {
            key: sum(s[key] for s in per_rank)
            for key in (
                "batches",
                "rows",
                "skipped",
                "requests",
                "loaded",
                "shared",
                "wait_s",
                "compute_s",
                "rows_per_s",
            )
        }
        going = [r for r in self.ranks if not r.closed] or self.ranks
        busy = total["wait_s"] + total["compute_s"]
        return {
            "job": self.name,
            **total,
            "epoch": min(r.next_epoch() for r in going),
            "waiting": total["wait_s"] / busy if busy > 0 else 0.0,
            "world_size": self.world_size,
            "ranks": per_rank,
        }


@dataclass(eq=False)
class RankState:
    """One rank of a job (a plain job has one): its consumer's batches and counters.

    Its position is (``epoch``, ``taken``): batches taken of that epoch. A rank is *pending*
    until its stream opens (batches are dealt to it all the same: the others wait for it),
    then open, then closed.
    """

    job: JobState = field(repr=False)
    rank: int
    batches: deque[Work] = field(default_factory=deque)  # preparing or ready, in order
    # its consumer waits here, on the scheduler's lock (set by ``DatasetScheduler.add``)
    cond: threading.Condition = field(init=False, repr=False)
    opened: bool = False
    closed: bool = False
    abandoned: bool = False  # its stream was garbage-collected without close()
    epoch: int = 0
    taken: int = 0
    # counters
    delivered: int = 0
    rows: int = 0
    skipped: int = 0
    requests: int = 0
    loaded: int = 0
    wait_s: float = 0.0  # blocked in take(): waiting for data
    compute_s: float = 0.0  # between batches: the job's own work
    last_return: float | None = None
    started: float = field(default_factory=time.perf_counter)

    def label(self) -> str:
        """The job's name, and the rank when there are several."""
        job = self.job
        if job.world_size == 1:
            return repr(job.name)
        return f"{job.name!r} (rank {self.rank} of {job.world_size})"

    def is_open(self) -> bool:
        return self.opened and not self.closed

    def next_epoch(self) -> int:
        """The epoch of the rank's next batch."""
        job = self.job
        while self.taken >= job.batches_per_rank(self.epoch):
            if self.epoch != job.first_epoch and job.batches_per_rank(self.epoch) == 0:
                break  # an empty job: no epoch has a batch
            self.epoch, self.taken = self.epoch + 1, 0
        return self.epoch

    def finished(self) -> bool:
        """True once the next batch would belong to epoch ``epochs`` (counted from 0)."""
        return self.job.epochs is not None and self.next_epoch() >= self.job.epochs

    def stats(self) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.started
        busy = self.wait_s + self.compute_s
        return {
            "job": self.job.name,
            "rank": self.rank,
            "world_size": self.job.world_size,
            "batches": self.delivered,
            "rows": self.rows,
            "epoch": self.next_epoch(),
            "skipped": self.skipped,
            "requests": self.requests,
            "loaded": self.loaded,
            "shared": self.requests - self.loaded,
            "wait_s": self.wait_s,
            "compute_s": self.compute_s,
            "waiting": self.wait_s / busy if busy > 0 else 0.0,
            "rows_per_s": self.rows / elapsed if elapsed > 0 else 0.0,
        }


class DatasetScheduler:
    """One dataset's sampler, jobs, future uses and scheduling thread.

    Args:
        name: the dataset.
        num_rows: rows of the dataset version read.
        sampler: the sampler of the jobs that prepare values in the arena (dependent
            sampling: they share decodes).
        gather_sampler: the sampler of the jobs that only gather cheap columns. Those read
            straight from storage whatever the others do, so nothing is gained by asking for
            the same rows at the same time; an independent sampler is vectorized
            (0.04 us a row) where dependent rounds for jobs that joined at different moments
            go round by round (0.6 us a row for four jobs).
        fetcher: prepares the batches.
        close_job: how the owner closes a job whose streams were all dropped without close().
    """

    def __init__(
        self,
        name: str,
        num_rows: int,
        sampler: Any,
        fetcher: Fetcher,
        *,
        gather_sampler: Any,
        close_job: Callable[[JobState], None],
    ) -> None:
        self.name = name
        self.num_rows = num_rows
        self.sampler = sampler
        self.gather_sampler = gather_sampler
        self.fetcher = fetcher
        self._close_job = close_job
        self._mark = np.zeros(num_rows, bool)  # scratch: rows being unqueued
        self.uses: dict[int, npt.NDArray[np.int32]] = {}  # arena space -> row -> future uses
        self.next_round: dict[int, npt.NDArray[np.float64]] = {}  # space -> row -> round
        self.round = 0
        self.jobs: dict[str, JobState] = {}
        # One lock for everything above; ``cond`` (on it) is where the scheduling thread
        # waits, each rank's ``cond`` (on it too) where that rank's consumer waits: a landed
        # batch wakes its own consumer only, not every consumer of the dataset (on few cores
        # the herd of wakeups cost more than the batches). Re-entrant: a batch of cheap
        # columns is prepared inline under the lock and lands (``landed``) there too.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.closed = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"tabloader-sched-{name}", daemon=True
        )
        self.thread.start()

    def grow(self, num_rows: int) -> None:
        """The dataset has ``num_rows`` rows now (appended ones have no uses yet)."""
        with self.cond:
            for arrays, fill in ((self.uses, 0), (self.next_round, np.inf)):
                for key, old in arrays.items():
                    grown = np.full(num_rows, fill, dtype=old.dtype)
                    grown[: old.size] = old
                    arrays[key] = grown
            self._mark = np.zeros(num_rows, bool)
            self.num_rows = num_rows

    # -- jobs ------------------------------------------------------------------------------------
    def add(
        self, job: JobState, *, remaining: BitMap | None, epoch: int, rank: int = 0
    ) -> RankState:
        """Open ``job``, fresh or resumed (``remaining`` rows of epoch ``epoch``), as ``rank``.

        If a job of that name is open already with ``job.world_size`` ranks, ``rank`` joins
        it instead (``job`` only carries the options, which must be the same).

        Raises:
            LoaderError: the job is open already (as a plain job, or that rank), or with
                another world size, other options or another state.
        """
        with self.cond:
            current = self.jobs.get(job.name)
            if current is not None:
                return self._attach_locked(current, job, rank, remaining, epoch)
            if job.fed:
                return self._add_fed_locked(job)
            job.sampler = self.sampler if job.plan.prepared else self.gather_sampler
            for r in job.ranks:
                r.cond = threading.Condition(self.lock)
            if remaining is None:
                job.sampler.add_job(job.name, job.ids)
                remaining = job.ids
            else:
                job.sampler.add_job(job.name, job.ids, remaining=remaining, epoch=epoch)
                job.epoch = epoch
                job.resumed = (epoch, BitMap(remaining))
            job.left = job.first_rows = len(remaining)
            job.first_epoch = job.cut_epoch = job.epoch
            for r in job.ranks:
                r.epoch = job.epoch
            self._count_uses(job, bitmap_to_array(remaining), +1)
            self.jobs[job.name] = job
            joined = job.ranks[rank]
            joined.opened = True
            self.cond.notify()  # a round for the new job
            return joined

    def _add_fed_locked(self, job: JobState) -> RankState:
        job.left = job.first_rows = 0  # nothing received of epoch 0 yet: see ``feed``
        job.epoch = -1
        joined = job.ranks[0]
        joined.cond = threading.Condition(self.lock)
        self.jobs[job.name] = job
        joined.opened = True
        return joined

    def feed(
        self,
        job: JobState,
        epoch: int,
        rows: npt.NDArray[np.int64],
        rounds: npt.NDArray[np.int64],
    ) -> None:
        """Queue ``rows`` of ``epoch`` for the fed ``job`` with their (leader's) rounds.

        Raises:
            LoaderError: rows of an epoch come before the previous epoch is complete, or more
                rows than the epoch has (the leader and this node disagree).
        """
        with self.cond:
            if job.closed or (job.epochs is not None and epoch >= job.epochs):
                return  # past the epochs the job reads: nothing to load
            if epoch != job.epoch:
                if job.left or epoch < job.epoch:
                    raise LoaderError(
                        f"Job {job.name!r} got rows of epoch {epoch} from the cluster leader "
                        f"while epoch {job.epoch} misses {job.left} rows; restart the job."
                    )
                job.epoch, job.left = epoch, job.rank_rows
            if rows.size > job.left:
                raise LoaderError(
                    f"Job {job.name!r} got {rows.size} rows of epoch {epoch} from the cluster "
                    f"leader, {job.left} more than its {job.rank_rows} a rank reads per epoch; "
                    "restart the job."
                )
            job.left -= rows.size
            self._count_uses(job, rows, +1)  # a sampled job counted its epoch's rows at start
            self._queue_locked(job, rows, rounds)
            self._activate_locked(job)
            self._wake_job(job)

    def fail(self, job: JobState, reason: str) -> None:
        """The fed ``job``'s cluster job is gone: its rank raises ``reason`` once it would
        wait for rows (the batches it has go on being delivered)."""
        with self.cond:
            job.gone = reason
            self._wake_job(job)

    def _attach_locked(
        self, job: JobState, asked: JobState, rank: int, remaining: BitMap | None, epoch: int
    ) -> RankState:
        """Rank ``rank`` joins the open ``job``; ``asked`` has the options it was opened with."""
        name = job.name
        if job.world_size == 1 and asked.world_size == 1:
            raise LoaderError(
                f"Job {name!r} is open already in this loader; close its stream first."
            )
        if job.world_size != asked.world_size:
            raise LoaderError(
                f"Job {name!r} is open already in this loader with world_size={job.world_size}"
                f", and this open asks for world_size={asked.world_size}: every rank of a job "
                "must pass the same world_size (or close the job's streams first)."
            )
        joined = job.ranks[rank]
        if joined.is_open():
            raise LoaderError(
                f"Rank {rank} of job {name!r} is open already in this loader: each rank opens "
                "the job once (close that stream first, or pass another rank)."
            )
        if joined.closed:
            raise LoaderError(
                f"Rank {rank} of job {name!r} left while its other ranks go on; a rank cannot "
                "rejoin mid-run: close every rank, then open them all again (with the same "
                "state_dict() to resume)."
            )
        mine = _options(job)
        theirs = _options(asked)
        differ = [k for k in mine if mine[k] != theirs[k]]
        if differ or job.ids != asked.ids:
            what = ", ".join(f"{k}={theirs[k]!r} (rank 0's: {mine[k]!r})" for k in differ)
            raise LoaderError(
                f"Rank {rank} of job {name!r} was opened with other options than its ranks "
                f"open already: {what or 'the job rows changed (re-registered?)'}; every rank "
                "must open the job the same way."
            )
        state = None if remaining is None else (epoch, BitMap(remaining))
        if state != job.resumed:
            raise LoaderError(
                f"Rank {rank} of job {name!r} was opened with another state than its ranks "
                "open already; every rank must pass the same state (saved at the same step), "
                "or none."
            )
        joined.opened = True
        joined.started = time.perf_counter()
        self._wake_job(job)  # every rank may have been waiting for this one
        return joined

    def remove(self, job: JobState) -> None:
        """Close ``job`` (every rank): its queued rows and remaining uses go, the sampler
        forgets it."""
        with self.cond:
            self._remove_locked(job)

    def _remove_locked(self, job: JobState) -> None:
        if job.closed:
            return
        job.closed = True
        for r in job.ranks:
            r.closed = True
            self._drop_batches(r)
        if self.jobs.get(job.name) is job:
            del self.jobs[job.name]
        queued = job.q_rows
        job.q_rows = job.q_rounds = job.q_epochs = _EMPTY
        job.log.clear()
        self._unqueue(job, queued)
        if not job.fed:  # a fed job has no sampler here
            if job.left:  # the rows of this epoch that the sampler still had for the job
                self._count_uses(job, bitmap_to_array(job.sampler.remaining(job.name)), -1)
            job.sampler.remove_job(job.name)
        self._wake_job(job)  # a consumer waiting in take() raises: closed

    def _drop_batches(self, rank: RankState) -> None:
        """Forget a closed rank's batches. Ready ones handed over pinned (the service's) are
        released here; those still preparing release their pins when they land (``landed``)."""
        for work in rank.batches:
            if work.remote and work.ready and work.result is not None:
                self.fetcher.release(work)
        rank.batches.clear()

    def leave(self, rank: RankState) -> None:
        """Close one rank: the job goes on with the others (and leaves with the last).

        The batches dealt to the rank from now on are dropped unprepared, so the others never
        wait for it: a rank that leaves mid-epoch loses its share of that epoch.
        """
        with self.cond:
            self._leave_locked(rank)

    def _leave_locked(self, rank: RankState) -> None:
        if rank.closed:
            return
        job = rank.job
        rank.closed = True
        self._drop_batches(rank)
        if not any(r.is_open() for r in job.ranks):
            self._remove_locked(job)
            return
        self._trim_log(job)
        self._activate_locked(job)  # it may have been that rank's turn
        self._wake_job(job)  # that rank (closed: its take() raises), and the others: all_joined
        self._poke(job)

    # -- future uses (under ``cond``; read lock-free by the arena) -------------------------------
    def _spaces(self, job: JobState) -> list[int]:
        return [space for _, space in job.plan.prepared]

    def _count_uses(self, job: JobState, rows: npt.NDArray[Any], delta: int) -> None:
        for space in self._spaces(job):
            counts = self.uses.get(space)
            if counts is None:
                counts = self.uses[space] = np.zeros(self.num_rows, np.int32)
                self.next_round[space] = np.full(self.num_rows, np.inf)
            counts[rows.astype(np.intp, copy=False)] += delta

    def _unqueue(self, job: JobState, rows: npt.NDArray[np.int64]) -> None:
        """``rows`` left ``job``'s queue: one use less; their next queued use is recomputed."""
        if rows.size == 0:
            return
        mark = self._mark
        mark[rows] = True
        for space in self._spaces(job):
            np.subtract.at(self.uses[space], rows, 1)  # a queue spanning epochs repeats rows
            nxt = self.next_round[space]
            nxt[rows] = np.inf
            for other in self.jobs.values():
                if other.q_rows.size and space in self._spaces(other):
                    hit = mark[other.q_rows]
                    if hit.any():  # reversed: of a row queued twice, the earlier round wins
                        q, r = other.q_rows[hit][::-1], other.q_rounds[hit][::-1]
                        nxt[q] = np.minimum(nxt[q], r)
        mark[rows] = False

    def score(self, space: int, rows: npt.NDArray[np.int64]) -> tuple[Any, Any]:
        """The arena's eviction inputs: (round of next queued use, future uses) per row.

        A row of a batch cut and submitted but not yet looked up (so not pinned yet) is
        counted as a use due before every queued one (round -1).
        """
        nxt, uses = self.next_round.get(space), self.uses.get(space)
        n = np.full(rows.size, np.inf)
        u = np.zeros(rows.size)
        if nxt is not None and uses is not None:
            ok = rows < nxt.size
            n[ok], u[ok] = nxt[rows[ok]], uses[rows[ok]]
        starting = self.fetcher.starting(space, rows)
        if starting.any():
            n[starting > 0] = -1
            u += starting
        return n, u

    # -- the scheduling thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    # dropped ranks first: the other ranks of their jobs may wait for them
                    self._close_abandoned_locked()
                    while not self.closed and not any(j.hungry() for j in self.jobs.values()):
                        if self._close_abandoned_locked():
                            continue
                        self.cond.wait(ABANDONED_CHECK_S)
                    if self.closed:
                        return
                    self._sample_locked()
                    for job in self.jobs.values():
                        self._activate_locked(job)  # their batches wake them as they land
        except BaseException as exc:  # surfaces in every consumer of this dataset
            logger.exception("scheduler of %s failed", self.name)
            with self.cond:
                self.error = exc
                self._wake_all()

    def _close_abandoned_locked(self) -> bool:
        """Close the ranks whose streams were dropped without close(); False if none."""
        found = False
        for job in list(self.jobs.values()):
            gone = [r for r in job.ranks if r.abandoned and not r.closed]
            if not gone:
                continue
            found = True
            for r in gone:
                logger.warning(
                    "job %s: its stream was dropped without close(); closing it", r.label()
                )
            if all(r.abandoned for r in job.ranks if r.is_open()):
                self._close_job(job)
            else:
                for r in gone:
                    self._leave_locked(r)
        return found

    def _sample_locked(self) -> None:
        """One ``sample_many`` call per sampler for every job at or below its horizon.

        A job exactly at its horizon takes part too (its queue may pass the horizon by one
        batch): jobs at the same pace on different threads are rarely all below it at the
        same instant, and a job that missed a call holds rows the others do not, which splits
        their shared region and sends the dependent sampler's later rounds one by one instead
        of vectorized.
        """
        want = [
            j for j in self.jobs.values() if not j.fed and not j.done_sampling() and j.room() >= 0
        ]
        for sampler in (self.sampler, self.gather_sampler):
            group = [j for j in want if j.sampler is sampler]
            if group:
                self._sample_group(sampler, group)

    def _sample_group(self, sampler: Any, want: list[JobState]) -> None:
        for j in want:
            if j.left == 0:  # the sampler starts the job's next epoch on this call
                j.epoch += 1
                j.left = len(j.ids)
                self._count_uses(j, j.id_array, +1)
        k = min(*(j.room() + j.batch_size for j in want), *(j.left for j in want))
        ids = sampler.sample_many([j.name for j in want], k)
        base, self.round = self.round, self.round + k
        rounds = np.arange(base, base + k, dtype=np.int64)
        for j in want:
            j.left -= k
            self._queue_locked(j, ids[j.name], rounds)

    def _queue_locked(
        self, job: JobState, rows: npt.NDArray[np.int64], rounds: npt.NDArray[np.int64]
    ) -> None:
        """Append ``rows`` of the job's current epoch, used in ``rounds``, to its queue."""
        job.q_rows = np.concatenate((job.q_rows, rows))
        job.q_rounds = np.concatenate((job.q_rounds, rounds))
        job.q_epochs = np.concatenate((job.q_epochs, np.full(rows.size, job.epoch, np.int64)))
        for space in self._spaces(job):
            nxt = self.next_round[space]
            nxt[rows] = np.minimum(nxt[rows], rounds)

    def _pop_locked(self, job: JobState, n: int) -> npt.NDArray[np.int64]:
        """The first ``n`` rows of the job's queue leave it."""
        rows = job.q_rows[:n].copy()
        job.q_rows, job.q_rounds, job.q_epochs = (
            job.q_rows[n:],
            job.q_rounds[n:],
            job.q_epochs[n:],
        )
        self._unqueue(job, rows)
        return rows

    def _activate_locked(self, job: JobState) -> None:
        """Cut the job's next batches from its queue, deal them to its ranks in turn and start
        preparing them (``prefetch`` per rank; the rank whose turn it is must have room)."""
        while job.q_rows.size:
            epoch = int(job.q_epochs[0])
            if epoch != job.cut_epoch:
                job.cut_epoch, job.cut = epoch, 0
            # rows of this epoch at the head of the queue, counted up to a batch and one: a
            # batch needs no more (the whole queue costs O(queue) per batch, 14 us at 1,000)
            head = job.q_epochs[: job.batch_size + 1]
            other = np.flatnonzero(head != epoch)
            same = int(other[0]) if other.size else head.size
            full = job.batches_per_rank(epoch) * job.world_size
            if job.cut >= full:  # the epoch's last rows, fewer than a batch per rank: dropped
                rest = np.flatnonzero(job.q_epochs != epoch)
                same = int(rest[0]) if rest.size else job.q_rows.size
                job.log.append((epoch, full, self._pop_locked(job, same)))
                continue
            rank = job.ranks[job.cut % job.world_size]
            if not rank.closed and len(rank.batches) >= job.prefetch:
                return
            n = min(job.batch_size, same)
            complete = other.size > 0 or epoch < job.epoch or job.left == 0
            if n < job.batch_size and not complete:
                return
            rows = self._pop_locked(job, n)
            job.log.append((epoch, job.cut, rows))
            job.cut += 1
            if rank.closed:  # that rank left: its share is dropped, unprepared
                continue
            work = Work(
                rank, rows, epoch, job.plan, skip=job.on_error is OnError.SKIP, remote=job.remote
            )
            rank.batches.append(work)
            rank.requests += rows.size * len(job.plan.columns)
            self.fetcher.submit(work)

    def _trim_log(self, job: JobState) -> None:
        """Forget the cut batches that every rank still going is past."""
        marks = [(r.next_epoch(), r.taken * job.world_size) for r in job.ranks if not r.closed]
        if not marks:
            job.log.clear()
            return
        low = min(marks)
        while job.log and (job.log[0][0], job.log[0][1]) < low:
            job.log.popleft()

    def landed(self, work: Work) -> None:
        """The fetcher finished ``work`` (the Fetcher's ``on_done``): its rank may take it."""
        with self.cond:
            rank: RankState = work.job
            rank.loaded += work.loaded + work.rows.size * len(work.plan.gathered)
            work.ready = True
            if not rank.closed:
                if rank.batches and rank.batches[0] is work:  # what its consumer waits for
                    rank.cond.notify_all()
            elif work.remote and work.result is not None:
                self.fetcher.release(work)

    # -- the consumer side -------------------------------------------------------------------------
    def take(self, rank: RankState, epoch: int | None) -> dict[str, Any] | None:
        """The rank's next batch, or None at the end of ``epoch`` (if given) or of the last
        epoch.

        A batch whose rows were all skipped is not returned: the next one of its epoch is.
        """
        job = rank.job
        while True:
            t0 = time.perf_counter()
            if rank.last_return is not None:
                rank.compute_s += t0 - rank.last_return
                rank.last_return = None
            with self.cond:
                while True:
                    self._check(rank)
                    if rank.finished() or (epoch is not None and rank.next_epoch() != epoch):
                        rank.last_return = time.perf_counter()
                        return None
                    if rank.batches and rank.batches[0].ready and job.all_joined():
                        work = rank.batches.popleft()
                        break
                    if not rank.batches:
                        self._activate_locked(job)
                        if job.gone is not None and not rank.batches:
                            raise LoaderError(
                                f"Job {job.name!r} left the cluster: {job.gone}. Its other "
                                "ranks stop too; start every rank again."
                            )
                    self._poke(job)
                    self._wait_locked(rank, t0)
                rank.taken += 1
                self._trim_log(job)
                self._activate_locked(job)
                self._poke(job)  # room for the scheduler
            now = time.perf_counter()
            rank.wait_s += now - t0
            rank.last_return = now
            batch = self._deliver(rank, work)
            if batch is not None:
                return batch

    def _wait_locked(self, rank: RankState, since: float) -> None:
        """Wait for news; warn once if the job's ranks wait for one that never opened."""
        job = rank.job
        if job.warned_pending or job.all_joined():
            rank.cond.wait()
            return
        rank.cond.wait(PENDING_WARN_S)
        if time.perf_counter() - since >= PENDING_WARN_S and not job.warned_pending:
            missing = [r.rank for r in job.ranks if not r.opened and not r.closed]
            if missing:
                job.warned_pending = True
                logger.warning(
                    "job %r: rank %d has waited %.0f s for rank(s) %s, which have not opened "
                    "the job in this loader; no rank gets a batch before every rank has opened "
                    "(as DDP's init_process_group waits for every rank): start them all (ranks "
                    "in separate processes meet only through the catalog's service)",
                    job.name,
                    rank.rank,
                    PENDING_WARN_S,
                    ", ".join(map(str, missing)),
                )

    def _deliver(self, rank: RankState, work: Work) -> dict[str, Any] | None:
        if work.error is not None:
            raise work.error
        job = rank.job
        if work.errors:
            first = work.errors[min(work.errors)]
            if job.on_error is OnError.RAISE:
                raise first
            rank.skipped += len(work.errors)
            for e in work.errors.values():
                logger.warning("job %s skipped a row: %s", rank.label(), e)
        batch = work.result
        if batch is not None:
            rank.delivered += 1
            rank.rows += len(batch["_id"])
        return batch

    def _check(self, rank: RankState) -> None:
        if rank.closed:
            raise LoaderError(f"Job stream {rank.label()} is closed; open the job again.")
        if self.error is not None:
            raise LoaderError(
                f"The scheduler of dataset {self.name!r} failed: {self.error!r}"
            ) from self.error

    def state_dict(self, rank: RankState) -> dict[str, Any]:
        """Where the job is at this rank's step: its epoch and the rows of that epoch that
        are not in the batches every rank had taken at that step.

        Ranks that save at the same step get the same state, however far the others are.
        """
        job = rank.job
        if job.fed:
            raise LoaderError(
                f"Job {job.name!r} reads on a Ray cluster, whose leader keeps the job's "
                "progress and checkpoints it; state_dict() is for a local loader."
            )
        with self.cond:
            self._check(rank)
            epoch = rank.next_epoch()
            behind = rank.taken * job.world_size  # batches of the epoch every rank has had
            parts = [rows for e, k, rows in job.log if e == epoch and k >= behind]
            parts.append(job.q_rows[job.q_epochs == epoch])
            rows = BitMap(np.concatenate(parts).astype(np.uint32))
            if epoch == job.epoch and job.left > 0:
                rows |= job.sampler.remaining(job.name)
            elif epoch > job.epoch:  # nothing of that epoch handed out yet
                rows = BitMap(job.ids)
        return {"job": job.name, "epoch": epoch, "remaining": rows.serialize()}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self._wake_all()
        self.thread.join()

    # -- wakeups (under the lock) ------------------------------------------------------------------
    def _poke(self, job: JobState) -> None:
        """Wake the scheduling thread if ``job`` wants a round, or has a rank whose stream was
        dropped (the others may wait for it; the thread also polls for those)."""
        if job.hungry() or any(r.abandoned and not r.closed for r in job.ranks):
            self.cond.notify()

    def _wake_job(self, job: JobState) -> None:
        """Wake every rank of ``job``: one closed, opened or left (``take`` checks again)."""
        for r in job.ranks:
            r.cond.notify_all()

    def _wake_all(self) -> None:
        """Wake everybody: the scheduler failed or closes."""
        self.cond.notify_all()
        for job in self.jobs.values():
            self._wake_job(job)


def _options(job: JobState) -> dict[str, Any]:
    """What every rank of a job must open it with."""
    return {
        "batch_size": job.batch_size,
        "prefetch": job.prefetch,
        "lookahead": job.horizon // job.world_size,
        "on_error": job.on_error.value,
        "epochs": job.epochs,
        "image_size": [dec.image_size for dec, _ in job.plan.prepared],
    }
