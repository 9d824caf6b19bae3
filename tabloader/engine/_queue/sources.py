"""Where an open job's rows come from: its *row source*, chosen once when the job opens.

* :class:`Sampled` (``Loader.open``'s, and the loader service's): this loader's sampler draws
  the job's rows, in rounds it shares with the dataset's other jobs
  (:mod:`tabloader.engine._queue.queues`). The ``_weight`` column of a weighted job's batches,
  its losses (``report``) and its progress (``state_dict``) are that sampler's.
* :class:`Fed`: a leader elsewhere samples and sends the rows (``ServedStream.feed``): on a
  node of a Ray cluster, the node's :class:`~tabloader.service._plugins.Feed` passes on what
  the cluster's leader sends. The job takes no part in this loader's rounds; each rank of the
  cluster job is a job of its own here, whose epochs have that rank's share of rows; its
  ``_weight`` column came with the rows; the leader takes its losses and keeps its progress.

Both offer :class:`~tabloader.engine._queue.jobs.RowSource`'s methods, which the scheduler,
its queues and its dealer call without asking which source a job has: a new feed (a peer
node's cache, object storage) is one more class here, passed to ``Loader.serve(source=...)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from pyroaring import BitMap

from tabloader.catalog._errors import LoaderError, SamplingError
from tabloader.engine._queue.jobs import Rows, Seat, Weights
from tabloader.engine._queue.ranks import rank_share

if TYPE_CHECKING:
    from tabloader.catalog._options import JobSpec
    from tabloader.engine._queue.jobs import FedRows, JobState
    from tabloader.sampling._base import Sampler

_SAMPLED_HERE = (
    "is sampled by this loader: its rows come from its sampler, not from feed(); open it "
    "with a fed source (Loader.serve(source=Fed)) to feed it."
)
_LEADER_REPORTS = (
    "is fed by a cluster leader, which takes its reports; report through the node's loader "
    "service (a RemoteStream)."
)
_LEADER_KEEPS = (
    "reads on a Ray cluster, whose leader keeps the job's progress and checkpoints it; "
    "state_dict() is for a local loader."
)


class Sampled:
    """The job's rows are drawn by this loader's sampler (the one its columns go with,
    given at ``open``)."""

    def __init__(self) -> None:
        self.sampler: Sampler | None = None

    @classmethod
    def seat(
        cls, name: str, spec: JobSpec, *, rank: int, world_size: int, share: int, resumes: bool
    ) -> Seat:
        """The job as it is asked for: its ranks are the job's ranks here."""
        return Seat(name, rank, world_size, cls())

    def _drawing(self) -> Sampler:
        if self.sampler is None:  # pragma: no cover - the scheduler opens a job first
            raise AssertionError("the job's source was not opened")
        return self.sampler

    def open(
        self, job: JobState, sampler: Sampler, *, remaining: BitMap | None, epoch: int
    ) -> BitMap:
        """Register the job in ``sampler``, fresh or resumed (an importance job with its
        scores, a weighted one with its draws); every row of its first epoch counts."""
        self.sampler = sampler
        q = job.queue
        if remaining is None:
            sampler.add_job(job.name, job.ids, job.spec, weights=job.weights)
            remaining = job.ids
        else:
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
        return remaining

    def close(self, job: JobState) -> None:
        if self.sampler is not None:
            self.sampler.remove_job(job.name)

    def remaining(self, job: JobState) -> BitMap:
        return self._drawing().remaining(job.name)

    def epoch_rows(self, job: JobState, epoch: int) -> int:
        """The rows the job has (fewer in a resumed first epoch), shared out among its ranks
        as ``rank_share`` does."""
        q = job.queue
        n = q.first_rows if epoch == q.first_epoch else job.num_ids
        return rank_share(n, job.batch_size, job.world_size, job.spec.drop_last)

    def hungry(self, job: JobState) -> bool:
        """True if the job has fewer rows ahead than ``prefetch`` batches per rank, or a job
        whose lookahead follows the cache has an eighth of it (and a batch) to refill: it
        starts a round (its next uses stay known as it consumes). Never before every rank
        has opened."""
        if not job.all_joined():
            return False
        room = job.room()
        if room <= 0:
            return False
        q, ahead = job.queue, job.batch_size * job.world_size
        if q.dynamic() and room >= max(ahead, q.horizon // 8):
            return True
        return q.q_rows.size + job.in_flight() < job.prefetch * ahead

    def weights(self, job: JobState, epoch: int, rows: Rows, sent: Weights) -> Weights:
        """A weighted job's ``1 / (N p_row)`` from its sampler (``row_weights``), asked in cut
        order (it forgets the epochs before); None for a plain job."""
        got = self._drawing().row_weights(job.name, epoch, rows)
        return None if got is None else np.asarray(got, dtype=np.float32)

    def accept(self, job: JobState, sent: FedRows) -> Weights:
        raise LoaderError(f"Job {job.name!r} {_SAMPLED_HERE}")

    def fail(self, reason: str) -> None:
        raise LoaderError(f"A job this loader samples has no leader to fail it ({reason}).")

    def check_going(self, job: JobState) -> None:
        """Its sampler never runs dry."""

    def report(self, job: JobState, ids: Rows, losses: Any) -> None:
        try:
            self._drawing().report(job.name, ids, losses)
        except SamplingError as exc:
            raise LoaderError(f"Job {job.name!r}: {exc}") from None

    def progress(self, job: JobState) -> Sampler:
        return self._drawing()


class Fed:
    """The job's rows come from a leader (``accept``: what ``feed`` queues), each epoch the
    ``rank_rows`` of one rank of the leader's job.

    Args:
        rank_rows: rows of each epoch (the rank's share of the cluster job's).
    """

    sampler: Sampler | None = None  # none here: the leader draws

    def __init__(self, rank_rows: int) -> None:
        self.rank_rows = rank_rows
        self.gone: str | None = None  # why no more rows come (``fail``)

    @classmethod
    def seat(
        cls, name: str, spec: JobSpec, *, rank: int, world_size: int, share: int, resumes: bool
    ) -> Seat:
        """Each rank is a job of its own here (rank 0 of 1), named after its rank.

        Raises:
            LoaderError: padded epochs (``drop_last = false``), or a state to resume from (the
                leader keeps the job's progress).
        """
        if not spec.drop_last:
            raise LoaderError(
                f"Job {name!r}: drop_last = false (padded epochs) is not supported on a Ray "
                "cluster yet; open it there with drop_last = true (the default)."
            )
        if resumes:
            raise LoaderError(
                "On a Ray cluster the leader keeps each job's progress (and checkpoints it); "
                "open the job without state."
            )
        return Seat(name if world_size == 1 else f"{name}[rank {rank}]", 0, 1, cls(share))

    def open(
        self, job: JobState, sampler: Sampler, *, remaining: BitMap | None, epoch: int
    ) -> None:
        """Nothing received of epoch 0 yet (``accept``); each row counts as it comes."""
        job.queue.left = job.queue.first_rows = 0
        job.queue.epoch = -1

    def close(self, job: JobState) -> None:
        """Nothing to forget: the leader hears of it from the feed."""

    def remaining(self, job: JobState) -> BitMap:
        return BitMap()  # what the leader has still to send is not counted here

    def epoch_rows(self, job: JobState, epoch: int) -> int:
        return self.rank_rows

    def hungry(self, job: JobState) -> bool:
        return False  # it asks its leader (``JobState.wants_rows``), never this loader

    def weights(self, job: JobState, epoch: int, rows: Rows, sent: Weights) -> Weights:
        return sent  # the leader's, queued with the rows

    def accept(self, job: JobState, sent: FedRows) -> Weights:
        """Rows of the epoch the job reads, or of the next once this one is complete, and no
        more than an epoch has; their weights checked.

        Raises:
            LoaderError: rows of an epoch before the previous one is complete, more rows than
                the epoch has, or weights missing, unexpected or bad (the leader and this
                node disagree).
        """
        weights = _fed_weights(job, sent.rows, sent.weights)
        q = job.queue
        if sent.epoch != q.epoch:
            if q.left or sent.epoch < q.epoch:
                raise LoaderError(
                    f"Job {job.name!r} got rows of epoch {sent.epoch} from the cluster leader "
                    f"while epoch {q.epoch} misses {q.left} rows; restart the job."
                )
            q.epoch, q.left = sent.epoch, self.rank_rows
        if sent.rows.size > q.left:
            raise LoaderError(
                f"Job {job.name!r} got {sent.rows.size} rows of epoch {sent.epoch} from the "
                f"cluster leader, {q.left} more than its {self.rank_rows} a rank reads per epoch; "
                "restart the job."
            )
        q.left -= sent.rows.size
        return weights

    def fail(self, reason: str) -> None:
        self.gone = reason

    def check_going(self, job: JobState) -> None:
        if self.gone is not None:
            raise LoaderError(
                f"Job {job.name!r} left the cluster: {self.gone}. Its other ranks stop too; "
                "start every rank again."
            )

    def report(self, job: JobState, ids: Rows, losses: Any) -> None:
        raise LoaderError(f"Job {job.name!r} {_LEADER_REPORTS}")

    def progress(self, job: JobState) -> Sampler:
        raise LoaderError(f"Job {job.name!r} {_LEADER_KEEPS}")


def _fed_weights(job: JobState, rows: Rows, weights: Weights) -> Weights:
    """The ``_weight``s the leader sent with ``rows`` of the fed ``job``, checked: one finite
    positive number per row for a weighted job (``weight``, ``importance``), none for a plain
    one.

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
