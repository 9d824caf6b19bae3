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
  (inf if none). Rows leave both when their batch starts preparing (then they are pinned).
* **Own pace.** A slow job's queue reaches its horizon and it stops taking part in rounds; the
  fast jobs go on alone. Nobody waits for anybody.
* **Epochs.** Batches never straddle an epoch; the last batch of an epoch may be short.
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

__all__ = ["DatasetScheduler", "JobState", "OnError"]

logger = logging.getLogger(__name__)

ABANDONED_CHECK_S = 1.0  # how often an idle scheduler looks for streams dropped without close()
_EMPTY = np.empty(0, np.int64)


class OnError(enum.Enum):
    """What a job does with a row that fails to read or decode."""

    RAISE = "raise"
    SKIP = "skip"


@dataclass(eq=False)
class JobState:
    """One open job of a dataset: its queue, its batches in preparation, its counters."""

    name: str
    ids: BitMap
    plan: Plan
    batch_size: int
    prefetch: int  # batches prepared ahead
    horizon: int  # rows sampled ahead (queued + preparing + ready)
    on_error: OnError
    epochs: int | None = None  # stop after this many epochs (None: never)
    sampler: Any = None  # the scheduler's sampler the job is registered in
    id_array: npt.NDArray[np.int64] = field(default_factory=lambda: _EMPTY)
    epoch: int = 0  # epoch of the rows the sampler hands out next
    left: int = 0  # rows of that epoch the sampler still has to hand out
    q_rows: npt.NDArray[np.int64] = field(default_factory=lambda: _EMPTY)
    q_rounds: npt.NDArray[np.int64] = field(default_factory=lambda: _EMPTY)
    q_epochs: npt.NDArray[np.int64] = field(default_factory=lambda: _EMPTY)
    batches: deque[Work] = field(default_factory=deque)  # preparing or ready, in order
    remote: bool = False  # batches are handed over pinned (the loader service's clients)
    closed: bool = False
    abandoned: bool = False  # its stream was garbage-collected without close()
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

    def in_flight(self) -> int:
        return sum(w.rows.size for w in self.batches)

    def next_epoch(self) -> int:
        """The epoch of the job's next batch."""
        if self.batches:
            return self.batches[0].epoch
        if self.q_rows.size:
            return int(self.q_epochs[0])
        return self.epoch + 1 if self.left == 0 else self.epoch

    def done_sampling(self) -> bool:
        """True once the sampler has handed out the job's last epoch."""
        return self.left == 0 and self.epochs is not None and self.epoch + 1 >= self.epochs

    def room(self) -> int:
        """Rows below the horizon (negative: up to one batch over it; see ``_sample_locked``)."""
        if self.done_sampling():
            return 0
        return self.horizon - self.q_rows.size - self.in_flight()

    def finished(self) -> bool:
        """True once the next batch would belong to epoch ``epochs`` (counted from 0)."""
        return self.epochs is not None and self.next_epoch() >= self.epochs

    def hungry(self) -> bool:
        """True if the job has fewer rows ahead than ``prefetch`` batches (it starts a round)."""
        return (
            self.room() > 0
            and self.q_rows.size + self.in_flight() < self.prefetch * self.batch_size
        )

    def stats(self) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.started
        busy = self.wait_s + self.compute_s
        return {
            "job": self.name,
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
        close_job: how the owner closes a job whose stream was dropped without close().
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
        self.cond = threading.Condition()
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
                    arrays[key] = grown  # type: ignore[assignment]
            self._mark = np.zeros(num_rows, bool)
            self.num_rows = num_rows

    # -- jobs ------------------------------------------------------------------------------------
    def add(self, job: JobState, *, remaining: BitMap | None, epoch: int) -> None:
        """Open ``job``, fresh or resumed (``remaining`` rows of epoch ``epoch``).

        Raises:
            LoaderError: a job of that name is open already.
        """
        with self.cond:
            if job.name in self.jobs:
                raise LoaderError(
                    f"Job {job.name!r} is open already in this loader; close its stream first."
                )
            job.sampler = self.sampler if job.plan.prepared else self.gather_sampler
            if remaining is None:
                job.sampler.add_job(job.name, job.ids)
                remaining = job.ids
            else:
                job.sampler.add_job(job.name, job.ids, remaining=remaining, epoch=epoch)
                job.epoch = epoch
            job.left = len(remaining)
            self._count_uses(job, bitmap_to_array(remaining), +1)
            self.jobs[job.name] = job
            self.cond.notify_all()

    def remove(self, job: JobState) -> None:
        """Close ``job``: its queued rows and remaining uses go, the sampler forgets it."""
        with self.cond:
            if job.closed:
                return
            job.closed = True
            self.jobs.pop(job.name, None)
            queued = job.q_rows
            job.q_rows = job.q_rounds = job.q_epochs = _EMPTY
            self._unqueue(job, queued)
            if job.left:  # the rows of this epoch that the sampler still had for the job
                self._count_uses(job, bitmap_to_array(job.sampler.remaining(job.name)), -1)
            job.sampler.remove_job(job.name)
            for work in job.batches:  # ready ones handed over pinned: released here; those
                if work.ready and work.result is not None and job.remote:  # still preparing
                    self.fetcher.release(work)  # release when they land (``landed``)
            job.batches.clear()
            self.cond.notify_all()

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
            self.uses[space][rows] -= 1
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
        """The arena's eviction inputs: (round of next queued use, future uses) per row."""
        nxt, uses = self.next_round.get(space), self.uses.get(space)
        if nxt is None or uses is None:
            return np.full(rows.size, np.inf), np.zeros(rows.size)
        ok = rows < nxt.size
        n = np.full(rows.size, np.inf)
        u = np.zeros(rows.size)
        n[ok], u[ok] = nxt[rows[ok]], uses[rows[ok]]
        return n, u

    # -- the scheduling thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.closed and not any(j.hungry() for j in self.jobs.values()):
                        if self._close_abandoned_locked():
                            continue
                        self.cond.wait(ABANDONED_CHECK_S)
                    if self.closed:
                        return
                    self._sample_locked()
                    for job in self.jobs.values():
                        self._activate_locked(job)
                    self.cond.notify_all()
        except BaseException as exc:  # surfaces in every consumer of this dataset
            logger.exception("scheduler of %s failed", self.name)
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def _close_abandoned_locked(self) -> bool:
        gone = [j for j in self.jobs.values() if j.abandoned]
        for job in gone:
            logger.warning("job %s: its stream was dropped without close(); closing it", job.name)
            self._close_job(job)
        return bool(gone)

    def _sample_locked(self) -> None:
        """One ``sample_many`` call per sampler for every job at or below its horizon.

        A job exactly at its horizon takes part too (its queue may pass the horizon by one
        batch): jobs at the same pace on different threads are rarely all below it at the
        same instant, and a job that missed a call holds rows the others do not, which splits
        their shared region and sends the dependent sampler's later rounds one by one instead
        of vectorized.
        """
        want = [j for j in self.jobs.values() if not j.done_sampling() and j.room() >= 0]
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
            rows = ids[j.name]
            j.left -= k
            j.q_rows = np.concatenate((j.q_rows, rows))
            j.q_rounds = np.concatenate((j.q_rounds, rounds))
            j.q_epochs = np.concatenate((j.q_epochs, np.full(k, j.epoch, np.int64)))
            for space in self._spaces(j):
                nxt = self.next_round[space]
                nxt[rows] = np.minimum(nxt[rows], rounds)

    def _activate_locked(self, job: JobState) -> None:
        """Cut the job's next batches from its queue and start preparing them (``prefetch``)."""
        while len(job.batches) < job.prefetch and job.q_rows.size:
            epoch = int(job.q_epochs[0])
            other = np.flatnonzero(job.q_epochs != epoch)
            same = int(other[0]) if other.size else job.q_rows.size
            n = min(job.batch_size, same)
            complete = other.size > 0 or epoch < job.epoch or job.left == 0
            if n < job.batch_size and not complete:
                return
            rows = job.q_rows[:n].copy()
            job.q_rows, job.q_rounds, job.q_epochs = (
                job.q_rows[n:],
                job.q_rounds[n:],
                job.q_epochs[n:],
            )
            self._unqueue(job, rows)
            work = Work(job, rows, epoch, job.plan, skip=job.on_error is OnError.SKIP)
            job.batches.append(work)
            job.requests += rows.size * len(job.plan.columns)
            self.fetcher.submit(work)

    def landed(self, work: Work) -> None:
        """The fetcher finished ``work`` (the Fetcher's ``on_done``): its job may take it."""
        with self.cond:
            job: JobState = work.job
            job.loaded += work.loaded + work.rows.size * len(work.plan.gathered)
            work.ready = True
            if not job.closed:
                self.cond.notify_all()
            elif job.remote and work.result is not None:
                self.fetcher.release(work)

    # -- the consumer side -------------------------------------------------------------------------
    def take(self, job: JobState, epoch: int | None) -> dict[str, Any] | None:
        """The job's next batch, or None at the end of ``epoch`` (if given) or of the last epoch.

        A batch whose rows were all skipped is not returned: the next one of its epoch is.
        """
        while True:
            t0 = time.perf_counter()
            if job.last_return is not None:
                job.compute_s += t0 - job.last_return
                job.last_return = None
            with self.cond:
                while True:
                    self._check(job)
                    if job.finished() or (epoch is not None and job.next_epoch() != epoch):
                        job.last_return = time.perf_counter()
                        return None
                    if job.batches and job.batches[0].ready:
                        work = job.batches.popleft()
                        break
                    if not job.batches:
                        self._activate_locked(job)
                    self.cond.notify_all()
                    self.cond.wait()
                self._activate_locked(job)
                self.cond.notify_all()  # room for the scheduler
            now = time.perf_counter()
            job.wait_s += now - t0
            job.last_return = now
            batch = self._deliver(job, work)
            if batch is not None:
                return batch

    def _deliver(self, job: JobState, work: Work) -> dict[str, Any] | None:
        if work.error is not None:
            raise work.error
        if work.errors:
            first = work.errors[min(work.errors)]
            if job.on_error is OnError.RAISE:
                raise first
            job.skipped += len(work.errors)
            for e in work.errors.values():
                logger.warning("job %s skipped a row: %s", job.name, e)
        batch = work.result
        if batch is not None:
            job.delivered += 1
            job.rows += len(batch["_id"])
        return batch

    def _check(self, job: JobState) -> None:
        if job.closed:
            raise LoaderError(f"Job stream {job.name!r} is closed; open the job again.")
        if self.error is not None:
            raise LoaderError(
                f"The scheduler of dataset {self.name!r} failed: {self.error!r}"
            ) from self.error

    def state_dict(self, job: JobState) -> dict[str, Any]:
        """Where the job is: its epoch and the rows of that epoch it has not received yet."""
        with self.cond:
            epoch = job.next_epoch()
            parts = [w.rows for w in job.batches if w.epoch == epoch]
            parts.append(job.q_rows[job.q_epochs == epoch])
            rows = BitMap(np.concatenate(parts).astype(np.uint32))
            if epoch == job.epoch and job.left > 0:
                rows |= job.sampler.remaining(job.name)
            elif epoch > job.epoch:  # nothing of the next epoch handed out yet
                rows = BitMap(job.ids)
        return {"job": job.name, "epoch": epoch, "remaining": rows.serialize()}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join()
