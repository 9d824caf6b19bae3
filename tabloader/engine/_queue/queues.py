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
* **Fed jobs** (a node of a Ray cluster) take no part in rounds: their row source has no
  sampler here (:mod:`tabloader.engine._queue.sources`), and :meth:`JobQueues.feed` queues the
  rows and rounds their leader sent.

Each job's queue is its :class:`~tabloader.engine._queue.jobqueue.JobQueue` (``job.queue``): this
module alone writes it, and keeps the queues, the samplers and the future uses consistent. Its
caller, the dataset's :class:`~tabloader.engine._queue.scheduler.DatasetScheduler`, holds its lock
around every call and cuts the batches (:meth:`JobQueues.pop`).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from pyroaring import BitMap

from tabloader.catalog._bitmaps import bitmap_to_array
from tabloader.catalog._options import JobSpec
from tabloader.engine._queue.jobqueue import NO_ROWS, JobQueue
from tabloader.engine._queue.jobs import FedRows, JobState, Rows, Weights
from tabloader.engine._queue.uses import FutureUses
from tabloader.sampling._base import Sampler

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
        """Open ``job`` at its source (``RowSource.open``: a sampled job is registered in the
        sampler of its columns), fresh or resumed (``remaining`` rows of ``epoch``); the other
        jobs of that sampler give back what they sampled ahead."""
        q = job.queue
        sampler = self.sampler if job.plan.prepared else self.gather_sampler
        counted = job.source.open(job, sampler, remaining=remaining, epoch=epoch)
        q.repeats = draws_with_replacement(job.spec)  # a leader's draws may repeat too
        if counted is not None and not q.repeats:
            self.future.count(q, bitmap_to_array(counted), +1)
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

    def close(self, job: JobState) -> None:
        """``job`` leaves: its queued rows and remaining uses go, its source forgets it."""
        if self.jobs.get(job.name) is job:
            del self.jobs[job.name]
        q = job.queue
        try:
            self.future.unqueued(q, q.clear(), self._queues())
            if q.left and not q.repeats:
                # the rows of this epoch the source still had for it
                self.future.count(q, bitmap_to_array(job.source.remaining(job)), -1)
        finally:  # whatever failed (a job failing leaves too), the source forgets it
            job.source.close(job)

    # -- filling the queues ------------------------------------------------------------------------
    def feed(self, job: JobState, sent: FedRows) -> None:
        """Queue the rows a leader sent the fed ``job`` (``sent``), with their (leader's)
        rounds and, for a weighted job, each row's ``_weight`` (what its batches carry).

        Raises:
            LoaderError: its source refused them (``RowSource.accept``: not a fed job, or
                rows the leader and this node disagree on).
        """
        weights = job.source.accept(job, sent)
        q = job.queue
        # a sampled job counted its epoch's rows at start; a draw may repeat a row
        self.future.count(q, sent.rows, +1, repeats=q.repeats)
        self._queue(q, sent.rows, sent.rounds, weights)

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
            if j.source.sampler is not None
            and j.all_joined()
            and not j.done_sampling()
            and j.room() >= 0
        ]
        failed: list[tuple[JobState, Exception]] = []
        for sampler in (self.sampler, self.gather_sampler):
            group = [j for j in want if j.source.sampler is sampler]
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
            if j.queue.dynamic() and j.source.sampler is self.sampler and not j.done_sampling()
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

    def _queue(self, q: JobQueue, rows: Rows, rounds: Rows, weights: Weights = None) -> None:
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
        sampler = new.source.sampler
        if sampler is None or not sampler.shares_rounds:
            return
        group = [j for j in self.jobs.values() if j.source.sampler is sampler]
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
            sampler.give_back(j.name, rows)
            q.left += int(rows.size)

    def expected(self, space: int, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.float64] | None:
        """The expected draws of ``rows`` beyond what is sampled, by the open jobs that draw
        with replacement in arena ``space`` (None when there is none: the usual case).

        The dependent sampler sums them over its weighted jobs: two such jobs in different
        arena spaces add to each other's rows there (a ranking hint for the eviction only).
        A fed job's draws are its leader's, whose sampler this loader has not.
        """
        jobs = self.jobs.values()
        mine = [j for j in jobs if j.queue.repeats and j.source.sampler is self.sampler]
        if not any(space in j.queue.spaces() for j in mine):
            return None
        draws: npt.NDArray[np.float64] = self.sampler.expected_draws(rows, repeats_only=True)
        return draws

    # -- cutting -----------------------------------------------------------------------------------
    def pop(self, job: JobState, n: int) -> npt.NDArray[np.int64]:
        """The first ``n`` rows of the job's queue leave it (cut into a batch, or dropped)."""
        rows = job.queue.pop(n)
        self.future.unqueued(job.queue, rows, self._queues())
        return rows
