"""A dataset's open jobs and their queues of row ids: filled by sampling rounds, cut at the head.

* **Rounds with many jobs.** A job whose queued and in-flight rows fall below ``prefetch``
  batches triggers a round, and every job with at least a batch of room below its *horizon*
  (``lookahead`` rows) takes part, so jobs at about the same pace get the same rows although
  their consumers wake at different moments. Ids are cheap: sampling ahead costs a queue.
* **Lookahead (the cache's).** The arena evicts the value whose next queued use is farthest:
  Belady's MIN, as far as the queues reach. So a job opened without ``lookahead`` samples
  ahead as far as the cache holds (:meth:`JobQueues._set_horizons`): ``LOOKAHEAD_CACHES`` times
  the arena's capacity in its values, in rounds, and for each job the rows it takes in that
  many rounds: the fastest job's horizon is the whole window, a job of half its measured pace
  (:class:`~tabloader.engine._queue.jobs.Pace`) half of it. Equal windows in time keep a row's uses
  by fast and slow jobs close in time, so round numbers order uses as time does. Such a job
  refills as it consumes (a round when an eighth of its horizon is free), so its next uses
  stay known; a round samples at most ``ROUND_ROWS`` rows (the first batch waits for one).
* **Future uses** (the arena's eviction inputs) follow each queue change:
  :mod:`tabloader.engine._queue.uses`. A job that draws with replacement (weighted, SHADE's
  importance) counts its rows when they are sampled, and adds, beyond what it sampled, its
  *expected* draws of each row (the epoch's probability times the draws left,
  ``DependentSampler.expected_draws``): :meth:`JobQueues.expected`, SHADE's priority cache in
  the arena's one policy.
* **Own pace.** A slow job's queue reaches its horizon and it stops taking part in rounds; the
  fast jobs go on alone. Nobody waits for anybody.
* **Joining.** When a job opens, the jobs of its sampler give back (``give_back``) the rows
  they sampled ahead that no job has cut into a batch, so the newcomer's first rounds are
  shared with them instead of drawn alone (four jobs opened 15 ms apart each had 160 rows of
  its own ahead: their first batches waited for 640 decodes).
* **Fed jobs** (a node of a Ray cluster) take no part in rounds: :meth:`JobQueues.feed` queues
  the rows and rounds the cluster leader sent.

Each job's queue is its :class:`~tabloader.engine._queue.jobqueue.JobQueue` (``job.queue``): this
module alone writes it, and keeps the queues, the samplers and the future uses consistent. Its
caller, the dataset's :class:`~tabloader.engine._queue.scheduler.DatasetScheduler`, holds its lock
around every call and cuts the batches (:meth:`JobQueues.pop`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from pyroaring import BitMap

from tabloader.catalog._bitmaps import bitmap_to_array
from tabloader.catalog._errors import LoaderError
from tabloader.catalog._options import JobSpec
from tabloader.engine._queue.jobqueue import NO_ROWS, JobQueue
from tabloader.engine._queue.jobs import JobState
from tabloader.engine._queue.uses import FutureUses
from tabloader.sampling._base import Sampler

__all__ = [
    "LOOKAHEAD_CACHES",
    "LOOKAHEAD_ROWS",
    "ROUND_ROWS",
    "FedRows",
    "JobQueues",
    "draws_with_replacement",
]

LOOKAHEAD_CACHES = 2
"""The lookahead window, in rounds, in arena capacities (of the job's values); each job samples
its share of it. Simulated (``bench sampling``): one capacity stays within 7% of Belady, four
within 3%."""
ROUND_ROWS = 2048  # rows a round samples at most (a long lookahead fills over several)
LOOKAHEAD_ROWS = 1 << 18
"""A job's horizon at most, per rank (its queue: 24 bytes a row): a cache of tiny values can
hold millions, and a window that large costs more memory than it saves decodes."""


def draws_with_replacement(spec: JobSpec) -> bool:
    """Whether a job of ``spec`` draws with replacement: weighted (``weight``, ``importance``)
    with ``replacement`` on (a row may come twice in an epoch, or never)."""
    return bool((spec.weight is not None or spec.importance is not None) and spec.replacement)


@dataclass(frozen=True)
class FedRows:
    """Rows of one epoch that the cluster leader sent a fed job, with the rounds (the
    leader's) they are used in and, for a weighted job, each row's ``_weight``."""

    epoch: int
    rows: npt.NDArray[np.int64]
    rounds: npt.NDArray[np.int64]
    weights: npt.NDArray[np.float32] | None = None


def _fed_weights(
    job: JobState, rows: npt.NDArray[np.int64], weights: npt.NDArray[np.float32] | None
) -> npt.NDArray[np.float32] | None:
    """The ``_weight``s the cluster leader sent with ``rows`` of the fed ``job``, checked: one
    finite positive number per row for a weighted job (``weight``, ``importance``), none for a
    plain one.

    Raises:
        LoaderError: weights missing, unexpected, of another length or not finite and > 0.
    """
    weighted = job.spec.weight is not None or job.spec.importance is not None
    if weights is None and not weighted:
        return None
    if weights is None or not weighted:
        raise LoaderError(
            f"Job {job.name!r} got rows {'without' if weighted else 'with'} weights from the "
            f"cluster leader, but it is {'' if weighted else 'not '}a weighted job here: the "
            "leader and this node disagree on its options; restart the job."
        )
    w = np.asarray(weights, dtype=np.float32)
    if w.shape != rows.shape or not (np.isfinite(w) & (w > 0)).all():
        raise LoaderError(
            f"Job {job.name!r} got {w.size} weights for {rows.size} rows from the cluster "
            "leader, or weights not finite and > 0; restart the job."
        )
    return w


class JobQueues:
    """The open jobs of one dataset, their samplers, queues and future uses.

    Args:
        num_rows: rows of the dataset version read.
        sampler: the sampler of the jobs that prepare values in the arena (dependent
            sampling: they share decodes).
        gather_sampler: the sampler of the jobs that only gather cheap columns. Those read
            straight from storage whatever the others do, so nothing is gained by asking for
            the same rows at the same time; an independent sampler is vectorized
            (0.04 us a row) where dependent rounds for jobs that joined at different moments
            go round by round (0.6 us a row for four jobs).
    """

    def __init__(self, num_rows: int, sampler: Sampler, *, gather_sampler: Sampler) -> None:
        self.sampler = sampler
        self.gather_sampler = gather_sampler
        self.future = FutureUses(num_rows)
        self.round = 0  # the next round number
        self.jobs: dict[str, JobState] = {}  # the open jobs, by name

    def grow(self, num_rows: int) -> None:
        """The dataset has ``num_rows`` rows now (appended ones have no uses yet)."""
        self.future.grow(num_rows)

    # -- jobs ------------------------------------------------------------------------------------
    def open(self, job: JobState, *, remaining: BitMap | None, epoch: int) -> None:
        """Register ``job`` with its sampler, fresh or resumed (``remaining`` rows of
        ``epoch``); the other jobs of that sampler give back what they sampled ahead."""
        q = job.queue
        q.sampler = sampler = self.sampler if job.plan.prepared else self.gather_sampler
        if remaining is None:
            sampler.add_job(job.name, job.ids, job.spec, weights=job.weights)
            remaining = job.ids
        else:  # an importance job resumes with its scores, a weighted one with its draws
            sampler.add_job(
                job.name,
                job.ids,
                job.spec,
                remaining=remaining,
                epoch=epoch,
                weights=job.weights,
                scores=job.scores,
                drawn=job.drawn,
            )
            q.epoch = epoch
        q.left = q.first_rows = len(remaining)
        q.first_epoch = q.epoch
        q.repeats = draws_with_replacement(job.spec)
        if not q.repeats:
            self.future.count(q, bitmap_to_array(remaining), +1)
        if job.drawn is not None:
            self._replay(job)
        self._rebase(job)
        self.jobs[job.name] = job

    def _replay(self, job: JobState) -> None:
        """Queue the rows a resumed weighted job's run had drawn already (``JobState.drawn``:
        its sampler took them as drawn), epoch by epoch, as its rounds would have."""
        assert job.drawn is not None
        q = job.queue
        for epoch, rows in job.drawn.segments:
            if epoch != q.epoch:  # the next epoch: as ``_sample_group`` starts one
                q.epoch, q.left = epoch, len(job.ids)
                if not q.repeats:
                    self.future.count(q, job.id_array, +1)
            q.left -= int(rows.size)
            base, self.round = self.round, self.round + int(rows.size)
            if q.repeats:
                self.future.count(q, rows, +1, repeats=True)
            self._queue(q, rows, np.arange(base, self.round, dtype=np.int64))

    def open_fed(self, job: JobState) -> None:
        """Register the fed ``job``: no sampler, nothing received of epoch 0 yet (``feed``)."""
        job.queue.left = job.queue.first_rows = 0
        job.queue.epoch = -1
        job.queue.repeats = draws_with_replacement(job.spec)  # the leader's draws may repeat
        self.jobs[job.name] = job

    def close(self, job: JobState) -> None:
        """``job`` leaves: its queued rows and remaining uses go, the sampler forgets it."""
        if self.jobs.get(job.name) is job:
            del self.jobs[job.name]
        q = job.queue
        try:
            self.future.unqueued(q, q.clear(), self._queues())
            if q.sampler is not None and q.left and not q.repeats:
                # the rows of this epoch the sampler still had for it
                self.future.count(q, bitmap_to_array(q.remaining(job.name)), -1)
        finally:  # whatever failed (a job failing leaves too), the sampler forgets it
            if q.sampler is not None:  # a fed job has none here
                q.sampler.remove_job(job.name)

    # -- filling the queues ------------------------------------------------------------------------
    def feed(self, job: JobState, fed: FedRows) -> None:
        """Queue the rows the cluster leader sent the fed ``job`` (``fed``), with their
        (leader's) rounds and, for a weighted job, each row's ``_weight`` (what its batches
        carry).

        Raises:
            LoaderError: rows of an epoch come before the previous epoch is complete, more
                rows than the epoch has, or weights missing, unexpected or bad (the leader and
                this node disagree).
        """
        epoch, rows = fed.epoch, fed.rows
        q = job.queue
        weights = _fed_weights(job, rows, fed.weights)
        if epoch != q.epoch:
            if q.left or epoch < q.epoch:
                raise LoaderError(
                    f"Job {job.name!r} got rows of epoch {epoch} from the cluster leader "
                    f"while epoch {q.epoch} misses {q.left} rows; restart the job."
                )
            q.epoch, q.left = epoch, job.rank_rows
        if rows.size > q.left:
            raise LoaderError(
                f"Job {job.name!r} got {rows.size} rows of epoch {epoch} from the cluster "
                f"leader, {q.left} more than its {job.rank_rows} a rank reads per epoch; "
                "restart the job."
            )
        q.left -= rows.size
        # a sampled job counted its epoch's rows at start; a draw may repeat a row
        self.future.count(q, rows, +1, repeats=q.repeats)
        self._queue(q, rows, fed.rounds, weights)

    def sample(self) -> list[tuple[JobState, Exception]]:
        """One ``sample_many`` call per sampler for every job at or below its horizon.

        A job exactly at its horizon takes part too (its queue may pass the horizon by one
        batch): jobs at the same pace on different threads are rarely all below it at the
        same instant, and a job that missed a call holds rows the others do not, which splits
        their shared region and sends the dependent sampler's later rounds one by one instead
        of vectorized.

        Returns the jobs whose own part failed, each with its error (the caller fails them);
        the others have their rows.
        """
        self._set_horizons()
        want = [
            j
            for j in self.jobs.values()
            if not j.fed and j.all_joined() and not j.done_sampling() and j.room() >= 0
        ]
        failed: list[tuple[JobState, Exception]] = []
        for sampler in (self.sampler, self.gather_sampler):
            group = [j for j in want if j.queue.sampler is sampler]
            if group:
                failed += self._sample_group(sampler, group)
        return failed

    def _sample_group(
        self, sampler: Sampler, want: list[JobState]
    ) -> list[tuple[JobState, Exception]]:
        """One call of ``sampler`` for the jobs ``want``; the jobs whose part failed. A call
        that fails as a whole is made again for each job alone: the one that fails then is
        the one to fail (each of the others has its rounds of its own, this once)."""
        failed: list[tuple[JobState, Exception]] = []
        for j in list(want):
            try:
                if j.queue.left == 0:  # the sampler starts the job's next epoch on this call
                    j.queue.epoch += 1
                    j.queue.left = len(j.ids)
                    if not j.queue.repeats:
                        self.future.count(j.queue, j.id_array, +1)
            except Exception as exc:
                failed.append((j, exc))
                want.remove(j)
        if not want:
            return failed
        k = min(ROUND_ROWS, *(j.room() + j.batch_size for j in want), *(j.queue.left for j in want))
        try:
            ids = sampler.sample_many([j.name for j in want], k)
        except Exception as exc:
            if len(want) == 1:
                return [*failed, (want[0], exc)]
            for j in want:
                failed += self._sample_group(sampler, [j])
            return failed
        base, self.round = self.round, self.round + k
        rounds = np.arange(base, base + k, dtype=np.int64)
        for j in want:
            try:
                j.queue.left -= k
                if j.queue.repeats:
                    self.future.count(j.queue, ids[j.name], +1, repeats=True)
                self._queue(j.queue, ids[j.name], rounds)
            except Exception as exc:
                failed.append((j, exc))
        return failed

    def _set_horizons(self) -> None:
        """The horizons of the jobs whose lookahead follows the cache (``JobState.dynamic``):
        ``LOOKAHEAD_CACHES`` arena capacities of rounds, in each job's rows by its pace against
        the fastest's (jobs not measured yet: the mean of the others, or all alike), at least
        its ``floor`` and at most an epoch of its rows (and ``LOOKAHEAD_ROWS``)."""
        group = [
            j
            for j in self.jobs.values()
            if j.queue.dynamic() and j.queue.sampler is self.sampler and not j.done_sampling()
        ]
        if not group:
            return
        rates = [j.pace.rate() for j in group]
        known = [r for r in rates if r]
        default = sum(known) / len(known) if known else 1.0
        paces = [r or default for r in rates]
        fastest = max(paces)
        for job, pace in zip(group, paces, strict=True):
            q = job.queue
            window = LOOKAHEAD_CACHES * q.cache_rows * job.world_size
            share = int(window * pace / fastest)
            most = min(job.num_ids, LOOKAHEAD_ROWS) * job.world_size
            q.horizon = max(q.floor, min(share, most))

    def _queue(
        self,
        q: JobQueue,
        rows: npt.NDArray[np.int64],
        rounds: npt.NDArray[np.int64],
        weights: npt.NDArray[np.float32] | None = None,
    ) -> None:
        """Append ``rows`` of the job's current epoch, used in ``rounds`` (a fed weighted
        job's with their ``_weight``s), to its queue, and count them as future uses."""
        q.append(rows, rounds, weights)
        self.future.queued(q, rows, rounds)

    def _queues(self) -> list[JobQueue]:
        """The open jobs' queues (``FutureUses`` finds a row's next use among them)."""
        return [j.queue for j in self.jobs.values()]

    def _rebase(self, new: JobState) -> None:
        """``new`` opens: the other jobs of its sampler give back the rows sampled ahead that
        no job has cut into a batch yet, so that the next round, shared with ``new``, hands
        them out again (jobs opened a moment apart share their first batches, instead of
        each having up to ``horizon`` rows of its own ahead of the others).

        A job keeps its queue up to the last round some other job has cut rows of: those rows
        are shared (usually) and prepared or being prepared. The tail given back is chosen by
        rounds, never by which rows it holds, so every job's order stays uniform (see
        ``DependentSampler.give_back``). Only rows of the epoch the sampler is in go back.
        """
        sampler = new.queue.sampler
        give_back: Callable[[str, npt.NDArray[np.int64]], None] | None
        give_back = getattr(sampler, "give_back", None)  # a sampler whose jobs share rounds
        if give_back is None:
            return
        group = [j for j in self.jobs.values() if j.queue.sampler is sampler and not j.fed]
        queues = [j.queue for j in group]
        floor = min((int(q.q_rounds[0]) for q in queues if q.q_rounds.size), default=None)
        if floor is None:
            return
        for q in queues:
            q.cut_rounds.keep_from(floor)
        for j, q in zip(group, queues, strict=True):
            if not q.q_rows.size:
                continue
            cut = np.concatenate([NO_ROWS, *(k.cut_rounds.rounds() for k in queues if k is not q)])
            shared = np.flatnonzero(np.isin(q.q_rounds, cut))
            earlier = np.flatnonzero(q.q_epochs != q.epoch)  # earlier epochs: at the head
            keep = 1 + max(shared[-1] if shared.size else -1, earlier[-1] if earlier.size else -1)
            if keep == q.q_rows.size:
                continue
            rows = q.keep(keep)
            # a row given back stays a future use of an epoch counted at its start; a draw
            # with replacement given back is drawn again, counted again when it is
            self.future.unqueued(q, rows, self._queues(), used=q.repeats)
            give_back(j.name, rows)
            q.left += int(rows.size)

    def expected(self, space: int, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.float64] | None:
        """The expected draws of ``rows`` beyond what is sampled, by the open jobs that draw
        with replacement in arena ``space`` (None when there is none: the usual case).

        The dependent sampler sums them over its weighted jobs: two such jobs in different
        arena spaces add to each other's rows there (a ranking hint for the eviction only).
        A fed job's draws are the cluster leader's, whose sampler this node has not.
        """
        jobs = self.jobs.values()
        if not any(j.queue.repeats and not j.fed and space in j.queue.spaces() for j in jobs):
            return None
        draws: npt.NDArray[np.float64] = self.sampler.expected_draws(rows, repeats_only=True)
        return draws

    # -- cutting -----------------------------------------------------------------------------------
    def pop(self, job: JobState, n: int) -> npt.NDArray[np.int64]:
        """The first ``n`` rows of the job's queue leave it (cut into a batch, or dropped)."""
        rows = job.queue.pop(n)
        self.future.unqueued(job.queue, rows, self._queues())
        return rows
