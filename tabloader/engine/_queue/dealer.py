"""A job's dealer (:class:`Dealer`): cuts its batches from its queue, deals them to its ranks in
turn and says where the job is (``state_dict``).

* **Cutting.** Batches never straddle an epoch. The next batch cut is batch ``cut`` (from 0) of
  epoch ``cut_epoch``; batch k of an epoch goes to rank ``k % world_size``. With several ranks
  an epoch's rows past the last full turn are dropped, or, when the job ``pads`` (``drop_last =
  false``), dealt in a last turn of shorter batches padded with the epoch's first rows (see
  :mod:`tabloader.engine._queue.jobs`).
* **Lockstep.** A batch is cut only while the rank whose turn it is has room below
  ``prefetch``; a rank that left has its turns dropped unprepared, and so has a rank giving up
  the rest of an epoch (``abandoning``).
* **The log** of the batches cut and not yet behind every rank, for ``state_dict``: the rows of
  an epoch not in the batches every rank had taken at a rank's step.

The scheduler holds its lock around every call (:mod:`tabloader.engine._queue.scheduler`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from pyroaring import BitMap

from tabloader.catalog._bitmaps import bitmap_to_array
from tabloader.catalog._errors import LoaderError
from tabloader.engine._prepare.work import Work
from tabloader.engine._queue.jobqueue import NO_ROWS
from tabloader.engine._queue.jobs import MAX_UNDELIVERED, JobState, OnError, RankState
from tabloader.sampling._base import Sampler

DRAWN_MAX = 1 << 20
"""The most rows drawn ahead that a weighted job's state carries (4 bytes each, in hex in a
message of the service); a job that drew more ahead resumes with draws of its own (of the
same distribution), not the run's."""


class Dealer:
    """Cuts ``job``'s batches and deals them to its ranks.

    Args:
        job: the open job.
        pop: takes the first n rows off the job's queue (``JobQueues.pop``: future uses follow).
        submit: starts preparing a batch dealt (``Fetcher.submit``).
        resumed: the state the job was opened from, (epoch, remaining rows), or None.
    """

    def __init__(
        self,
        job: JobState,
        *,
        pop: Callable[[int], npt.NDArray[np.int64]],
        submit: Callable[[Work], None],
        resumed: tuple[int, BitMap] | None = None,
    ) -> None:
        self.job = job
        self._pop = pop
        self._submit = submit
        self.resumed = resumed  # the state it was opened from (ranks joining compare)
        # the next batch cut is batch ``cut`` (from 0) of epoch ``cut_epoch``
        self.cut_epoch = job.queue.first_epoch
        self.cut = 0
        # batches cut and not yet behind every rank: (epoch, index, rows), for ``state``;
        # an epoch's dropped remainder is logged with index ``batches_per_epoch``, a padded
        # batch with its own rows only (the repeats are no rows still to come)
        self.log: deque[tuple[int, int, npt.NDArray[np.int64]]] = deque()
        # padding (``pads``): the first rows cut of epoch ``cut_epoch`` (up to ``world_size``),
        # repeated in turn to pad its last batches; ``padded`` of them so far
        self.pad_rows: npt.NDArray[np.int64] = NO_ROWS
        self.padded = 0

    # -- cutting -------------------------------------------------------------------------------
    def pads(self) -> bool:
        """True if the ranks' shares of an epoch are padded to one size (``drop_last =
        false`` with several ranks), none of its rows dropped."""
        return self.job.world_size > 1 and not self.job.spec.drop_last

    def cut_size(self) -> int:
        """Rows of the next batch dealt (batch ``cut`` of epoch ``cut_epoch``), padding
        included: ``batch_size``, but for a job that ``pads`` the last turn's (each rank's
        share past its full batches). Fewer are left at an epoch's end without padding."""
        job = self.job
        if not self.pads():
            return job.batch_size
        share = job.rank_rows_of(self.cut_epoch)
        full = share // job.batch_size  # full batches per rank
        return job.batch_size if self.cut < full * job.world_size else share % job.batch_size

    def owes_padding(self) -> bool:
        """True if the job ``pads`` and epoch ``cut_epoch`` has had all its rows cut but not
        all its batches: the rest are padding only (when ``world_size`` exceeds the rows of
        the last turn)."""
        job, q = self.job, self.job.queue
        total = job.batches_per_rank(self.cut_epoch) * job.world_size
        if not self.pads() or not 0 < self.cut < total:
            return False
        if q.q_rows.size and q.q_epochs[0] == self.cut_epoch:
            return False
        return q.epoch > self.cut_epoch or q.left == 0

    def pad(self, rows: npt.NDArray[np.int64], size: int) -> npt.NDArray[np.int64]:
        """The batch of ``rows`` (cut of epoch ``cut_epoch``) at ``size`` rows: the first
        rows of the epoch are remembered, and repeated in turn to fill a short one."""
        if self.pad_rows.size < self.job.world_size:
            self.pad_rows = np.concatenate([self.pad_rows, rows])[: self.job.world_size]
        short = size - rows.size
        if short <= 0 or not self.pad_rows.size:
            return rows
        turn = (self.padded + np.arange(short)) % self.pad_rows.size
        self.padded += short
        return np.concatenate([rows, self.pad_rows[turn]])

    def deal(self) -> None:
        """Cut the job's next batches from its queue, deal them to its ranks in turn and start
        preparing them (``prefetch`` per rank; the rank whose turn it is must have room)."""
        job, q = self.job, self.job.queue
        if not job.all_joined():  # nothing is dealt to a world that has not come
            return
        while q.q_rows.size or self.owes_padding():
            if self.owes_padding():  # the epoch's rows are all cut, its last batches not
                epoch, same, complete = self.cut_epoch, 0, True
            else:
                epoch = int(q.q_epochs[0])
                # rows of this epoch at the head of the queue, counted up to a batch and one:
                # a batch needs no more (the whole queue costs O(queue) per batch, 14 us at
                # 1,000)
                head = q.q_epochs[: job.batch_size + 1]
                other = np.flatnonzero(head != epoch)
                same = int(other[0]) if other.size else head.size
                complete = other.size > 0 or epoch < q.epoch or q.left == 0
            if job.gone_from is not None and epoch >= job.gone_from:
                return  # a rank died: its peers get no batch it would have shared
            if epoch != self.cut_epoch:
                self.cut_epoch, self.cut = epoch, 0
                self.pad_rows, self.padded = self.pad_rows[:0], 0
            full = job.batches_per_rank(epoch) * job.world_size
            if self.cut >= full:  # the epoch's last rows, fewer than a batch per rank: dropped
                rest = np.flatnonzero(q.q_epochs != epoch)
                same = int(rest[0]) if rest.size else q.q_rows.size
                self.log.append((epoch, full, self._pop(same)))
                continue
            rank = job.ranks[self.cut % job.world_size]
            if not rank.closed and len(rank.batches) >= job.prefetch:
                return
            size = self.cut_size()
            n = min(size, same)
            if n < size and not complete:
                return
            sent = q.head_weights(n)  # weights queued with the rows (a fed weighted job's)
            rows = self._pop(n)
            self.log.append((epoch, self.cut, rows))
            if self.pads():  # the epoch's last batches are padded to every rank's share
                rows = self.pad(rows, size)
            self.cut += 1
            if rank.closed:  # that rank left: its share is dropped, unprepared
                continue
            if rank.abandoning == epoch:  # it gives up the rest of this epoch: unprepared
                rank.give_up(rows.size)
                rank.cond.notify_all()
                continue
            work = Work(rank, rows, epoch, job.plan, skip=job.on_error is OnError.SKIP)
            work.weights = job.source.weights(job, epoch, rows, sent)
            rank.batches.append(work)
            rank.requests += rows.size * len(job.plan.columns)
            self._submit(work)

    # -- state ---------------------------------------------------------------------------------
    def trim_log(self) -> None:
        """Forget the cut batches that every rank still going is past, but the last
        ``MAX_UNDELIVERED`` turns (a batch each, and an epoch's dropped rows): a ``state_dict``
        may be that many steps back (``RankState.position``)."""
        job = self.job
        marks = [
            (r.next_epoch(), r.taken * job.world_size) for r in job.ranks.values() if not r.closed
        ]
        if not marks:
            self.log.clear()
            return
        low = min(marks)
        behind = 0
        for epoch, index, _ in self.log:
            if (epoch, index) >= low:
                break
            behind += 1
        for _ in range(behind - MAX_UNDELIVERED * job.world_size - 1):
            self.log.popleft()

    def state(self, rank: RankState, sampler: Sampler, back: int = 0) -> dict[str, Any]:
        """The job's state at ``rank``'s step ``back`` batches ago (``position``): its epoch
        and the rows of that epoch not in the batches every rank had taken at that step
        (``sampler``: the one that keeps the job's progress, ``RowSource.progress``).

        A weighted job with replacement has draws left, not rows: its state is that many rows
        (its first ids: which ones does not matter, a job resumed with ``remaining`` draws
        ``len(remaining)`` more in that epoch). A weighted job's state also has its
        ``draws`` (``_drawn``): a resume makes the same draws the run would have."""
        job, q = self.job, self.job.queue
        epoch, taken = rank.position(back)
        behind = taken * job.world_size  # batches of the epoch every rank has had
        parts = [rows for e, k, rows in self.log if e == epoch and k >= behind]
        parts.append(q.q_rows[q.q_epochs == epoch])
        state: dict[str, Any] = {"job": job.name, "epoch": epoch}
        if sampler.weighted(job.name) and job.spec.replacement:
            left = sum(p.size for p in parts) + (q.left if epoch == q.epoch else 0)
            left = len(job.ids) if epoch > q.epoch else left
            ids = bitmap_to_array(job.ids)[:left].astype(np.uint32)
            state["remaining"] = BitMap(ids).serialize()
        else:
            rows = BitMap(np.concatenate(parts).astype(np.uint32))
            if epoch == q.epoch and q.left > 0:
                rows |= sampler.remaining(job.name)
            elif epoch > q.epoch:  # nothing of that epoch handed out yet
                rows = BitMap(job.ids)
            state["remaining"] = rows.serialize()
        drawn = self._drawn(sampler, epoch, behind)
        if drawn is not None:
            state["draws"] = drawn
        return state

    def _drawn(self, sampler: Sampler, epoch: int, behind: int) -> dict[str, Any] | None:
        """A weighted job's draws at the step (batch ``behind`` of ``epoch``): the rows drawn
        after it already (cut since, or queued), by epoch, and where its sampler's stream
        stands (``Sampler.drawn``): a resume replays the one and draws on from the other.
        None for a plain job, or one that drew more ahead than a state carries."""
        q = self.job.queue
        point = sampler.drawn(self.job.name, epoch)
        if point is None:
            return None
        pieces = [(e, rows) for e, k, rows in self.log if (e, k) >= (epoch, behind)]
        cuts = np.flatnonzero(np.diff(q.q_epochs)) + 1
        pieces += [
            (int(e[0]), r)
            for e, r in zip(np.split(q.q_epochs, cuts), np.split(q.q_rows, cuts), strict=True)
            if r.size
        ]
        if sum(r.size for _, r in pieces) > DRAWN_MAX:
            return None
        epochs: list[list[int]] = []
        for e, rows in pieces:
            if epochs and epochs[-1][0] == e:
                epochs[-1][1] += int(rows.size)
            elif rows.size:
                epochs.append([e, int(rows.size)])
        rows = np.concatenate([NO_ROWS, *(r for _, r in pieces)]).astype(np.uint32)
        return {**point, "rows": rows.tobytes(), "epochs": epochs}

    def check_state(self, rank: int, remaining: BitMap | None, epoch: int) -> None:
        """Rank ``rank`` joins with the state ``remaining`` rows of ``epoch`` (or None).

        Raises:
            LoaderError: it is another state than the one the job was opened with.
        """
        state = None if remaining is None else (epoch, BitMap(remaining))
        if state != self.resumed:
            raise LoaderError(
                f"Rank {rank} of job {self.job.name!r} was opened with another state than its "
                "ranks open already; every rank must pass the same state (saved at the same "
                "step), or none."
            )
