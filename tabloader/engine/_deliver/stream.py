"""The consumer side: a job's batches as an iterator (:class:`JobStream`), and the stream a
server serves to its client (:class:`ServedStream`)."""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tabloader.catalog._errors import LoaderError
from tabloader.engine._deliver.streams import StreamBase
from tabloader.engine._queue.jobs import FedRows, JobState, RankState, Rows, Weights
from tabloader.engine._queue.scheduler import DatasetScheduler
from tabloader.sampling._importance import report_arrays

if TYPE_CHECKING:
    from tabloader.catalog._options import JobSpec
    from tabloader.engine._prepare.augment import Augmenter


class JobStream(StreamBase):
    """The batches of one job (of one rank of a data-parallel job); iterate it, or call
    ``next_batch()``.

    Iterating yields batches until ``epochs`` epochs are done (forever if None); ``iter_epoch``
    yields the batches of the current epoch only. Each batch is the job's own (a dict of
    column -> new array or list, ``_id`` first): writing into it changes nothing anywhere else.
    Close it (or use ``with``) to leave: the other jobs are not disturbed.

    With ``world_size`` ranks (see ``Loader.open``) each rank's stream has its own batches,
    ``epoch`` and ``stats``; ``state_dict`` is the job's, at this rank's step.

    Attributes:
        name: the job name.
        rank: this stream's rank (0 for a plain job).
        world_size: the job's number of ranks (1 for a plain job).
        batch_size: rows per batch.
        spec: the job's options it was opened with (``REGISTER``'s, with the open's laid over).
        epochs: the epochs the stream delivers (None: no end).
    """

    def __init__(self, scheduler: DatasetScheduler, rank: RankState) -> None:
        self._scheduler = scheduler
        self._rank = rank
        self._job: JobState = rank.job
        self.name, self.rank = self._job.name, rank.rank  # fixed by the open (see the class)
        self.world_size, self.batch_size = self._job.world_size, self._job.batch_size
        self.spec: JobSpec = self._job.spec
        self.epochs: int | None = self._job.epochs
        # A stream dropped without close() (its training thread died): the scheduler closes
        # the rank. The finalizer only sets a flag: it may run inside any lock, on any thread.
        weakref.finalize(self, setattr, rank, "abandoned", True)

    @property
    def rank_state(self) -> RankState:
        """This stream's rank: its batches, condition and counters, and its job's state
        (``rank_state.job``: queue, sampler, plan). For introspection and tests."""
        return self._rank

    @property
    def epoch(self) -> int:
        """The epoch of this stream's next batch (0-based)."""
        with self._scheduler.cond:
            return self._rank.next_epoch()

    @property
    def finished(self) -> bool:
        """Whether the stream has delivered its ``epochs`` (never with ``epochs=None``)."""
        with self._scheduler.cond:
            return self._rank.finished()

    def _take(self, epoch: int | None) -> Any:
        """The next batch (``DatasetScheduler.take``), its consumer's stalls timed: seconds
        waiting in here (``wait_s``) and between its calls (``compute_s``); batches and rows
        delivered counted."""
        rank = self._rank
        t0 = time.perf_counter()
        if rank.last_return is not None:
            rank.compute_s += t0 - rank.last_return
            rank.last_return = None
        batch = self._scheduler.take(rank, epoch)
        now = rank.last_return = time.perf_counter()
        if batch is not None:
            rank.wait_s += now - t0
            rank.delivered += 1
            rank.rows += len(batch["_id"])
        return batch

    def next_batch(self) -> dict[str, Any]:
        """Return the next batch: a dict of column -> array (``_id`` included).

        Raises:
            LoaderError: the stream is closed (also while waiting), its scheduler failed, or
                it has delivered the ``epochs`` it was opened for.
            RowReadError: a row of the batch failed (``on_error="raise"``).
        """
        batch: dict[str, Any] | None = self._take(None)
        if batch is None:
            raise LoaderError(
                f"Job stream {self._rank.label()} has delivered its {self.epochs} "
                "epoch(s); open the job again (or with epochs=None) to read on."
            )
        return batch

    def take(self, epoch: int | None = None) -> dict[str, Any] | None:
        """The next batch, or None at the end of ``epoch`` (if given) or of the last epoch."""
        batch: dict[str, Any] | None = self._take(epoch)
        return batch

    def abandon(self, epoch: int, *, ahead_rows: int = 0) -> int:
        """Give up the rest of ``epoch`` (a new iteration starts the next one): the rows of it
        not taken yet are dropped (unprepared where they were not prepared yet) and counted
        in ``stats()["abandoned_rows"]``; returns how many. Nothing happens when the stream is
        past ``epoch``. With ranks, this rank's share only (each rank gives up its own).
        ``ahead_rows``: rows of a batch taken that its consumer dropped (a service client's
        batch read ahead), counted too."""
        return self._scheduler.abandon(self._rank, epoch, ahead_rows)

    def report(self, ids: Any, losses: Any) -> None:
        """Score the rows ``ids`` of a batch of this job by their per-row ``losses`` (a job
        with ``importance = 'loss'``: its next epochs draw the rows that score high more
        often; see :mod:`tabloader.sampling._importance`). Every rank of a data-parallel job
        reports into the job's one set of scores.

        Raises:
            LoaderError: bad arrays (``report_arrays``), rows not of the job, or a job
                without ``importance = 'loss'``.
        """
        checked_ids, checked_losses = report_arrays(ids, losses)
        self._scheduler.report(self._rank, checked_ids, checked_losses)

    def state_dict(self, *, undelivered: int = 0) -> dict[str, Any]:
        """Where the job is: its epoch and the rows of that epoch it has not received yet.

        With ranks, the job's state at this rank's step: the rows of the epoch not in the
        batches that every rank had taken by the same step (so every rank must save at the
        same step, as DDP checkpoints do; they then save the same state). Open every rank
        again with it (and the same ``world_size``) to resume: each row of the epoch is
        delivered once, before or after.

        ``undelivered``: batches taken from this stream that the job has not trained on yet
        (at most ``MAX_UNDELIVERED``: the loader service's client reads one ahead, and a
        framework may fetch one before it trains); their rows count as still to come.

        A job with ``importance = 'loss'`` also saves its scores (``importance``), as they
        are when saved: a resume draws from them as the run would have.

        Raises:
            LoaderError: the stream is closed.
        """
        return self._scheduler.state_dict(self._rank, undelivered)

    @property
    def augment(self) -> Mapping[str, Augmenter]:
        """The job's own augmentation of its image columns, by column (empty: the shared
        values as they are)."""
        return self._job.plan.augment

    def stats(self) -> dict[str, Any]:
        """This stream's counters so far (of its rank, for a data-parallel job).

        ``batches``, ``rows`` and ``skipped`` rows delivered; the ``epoch`` of the next batch;
        ``requests``: values (row x column) fetched for the job, ``loaded``: those it read or
        decoded itself, ``shared``: those another job's decode served (cached or in flight);
        stalls: ``wait_s`` blocked waiting for batches, ``compute_s`` between batches (the
        job's own work), ``waiting`` the first's share of both; ``rows_per_s``; ``rank`` and
        ``world_size``.
        """
        with self._scheduler.cond:
            return self._rank.stats()

    def close(self) -> None:
        """Leave: unregister from sampling; batches in preparation release their pins.

        A rank of a data-parallel job leaves alone: the others go on without waiting for it
        (its share of the current epoch is lost), and the job leaves with its last rank.
        """
        self._scheduler.leave(self._rank)


class ServedStream(JobStream):
    """A stream that a server serves to its client process (``Loader.serve``: the loader
    service, a node of a Ray cluster): a :class:`JobStream` and the calls only its server
    makes. The client's process times its own stalls and says when its job has a batch; a
    process may end without closing it; a fed job's server queues the rows its leader sent
    and fails the stream when the leader's job is gone.
    """

    def _take(self, epoch: int | None) -> Any:
        """The next batch; its client times its stalls and says when it has it."""
        return self._scheduler.take(self._rank, epoch)

    def record_stalls(self, wait_s: float, compute_s: float, augment_s: float = 0.0) -> None:
        """Add seconds the client measured: waiting for batches, between them, and
        augmenting them (its own threads).

        Without the scheduler's lock: only the rank's own consumer (its connection's thread)
        writes these counters, and ``stats`` only reads them. (Taken on every request, the
        lock was the most contended wait of four tiny-row jobs' connections: 8% of the
        service's samples.)
        """
        rank = self._rank
        rank.wait_s += wait_s
        rank.compute_s += compute_s
        rank.augment_s += augment_s

    def record_delivery(self, rows: int) -> None:
        """Count a batch of ``rows`` rows as delivered: the client says when its job got one
        (no lock: see ``record_stalls``)."""
        self._rank.delivered += 1
        self._rank.rows += rows

    def lost(self, who: str, *, undelivered: int = 0) -> None:
        """This rank's process ended without ``close()`` (``who`` names it): the stream closes,
        and the job's other ranks fail with the reason: at once if it was mid-epoch; after the
        epoch whose whole share it had otherwise (that is no death: they finish the epoch).
        ``undelivered``: as for ``state_dict``."""
        self._scheduler.lost(self._rank, who, undelivered)

    def share_done(self, *, undelivered: int = 0) -> bool:
        """Whether the rank has read its last epoch, or the whole share of one and nothing of
        the next (``undelivered``: as for ``state_dict``)."""
        with self._scheduler.cond:
            return self._rank.finished() or self._rank.share_done(undelivered) is not None

    # -- a fed stream (``Loader.serve(source=Fed)``: its rows come from a leader) --------------
    def feed(self, epoch: int, rows: Rows, rounds: Rows, weights: Weights = None) -> None:
        """Queue ``rows`` of ``epoch`` that the job's leader sent, with their rounds (and a
        weighted job's ``_weight`` of each row, which its batches carry).

        Raises:
            LoaderError: the job is not fed, or the leader and this node disagree on its
                epochs, or on whether and how its rows are weighted.
        """
        self._scheduler.feed(self._job, FedRows(epoch, rows, rounds, weights))

    def fail(self, reason: str) -> None:
        """The leader's job is gone: the stream raises ``reason`` once it would wait for rows
        (the batches it has are still delivered).

        Raises:
            LoaderError: the job is not fed.
        """
        self._scheduler.fail(self._job, reason)

    def wants_rows(self) -> bool:
        """Whether the stream is open with fewer rows queued and in flight than its horizon
        (its node asks the leader for more)."""
        with self._scheduler.cond:
            return self._job.wants_rows()
