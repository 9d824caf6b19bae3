"""The consumer side: a job's batches as an iterator (:class:`JobStream`)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from catalog.errors import LoaderError
from tabloader.scheduler import DatasetScheduler, JobState

__all__ = ["JobStream"]


class JobStream:
    """The batches of one job; iterate it, or call ``next_batch()``.

    Iterating yields batches until ``epochs`` epochs are done (forever if None); ``iter_epoch``
    yields the batches of the current epoch only. Each batch is the job's own (a dict of
    column -> new array or list, ``_id`` first): writing into it changes nothing anywhere else.
    Close it (or use ``with``) to leave: the other jobs are not disturbed.
    """

    def __init__(self, scheduler: DatasetScheduler, job: JobState) -> None:
        self._scheduler = scheduler
        self._job = job
        # A stream dropped without close() (its training thread died): the scheduler closes
        # the job. The finalizer only sets a flag: it may run inside any lock, on any thread.
        weakref.finalize(self, setattr, job, "abandoned", True)

    @property
    def name(self) -> str:
        """The job name."""
        return self._job.name

    @property
    def epoch(self) -> int:
        """The epoch of the next batch (0-based)."""
        with self._scheduler.cond:
            return self._job.next_epoch()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while (batch := self._scheduler.take(self._job, None)) is not None:
            yield batch

    def iter_epoch(self) -> Iterator[dict[str, Any]]:
        """Yield the remaining batches of the current epoch."""
        epoch = self.epoch
        while (batch := self._scheduler.take(self._job, epoch)) is not None:
            yield batch

    def next_batch(self) -> dict[str, Any]:
        """Return the next batch: a dict of column -> array (``_id`` included).

        Raises:
            LoaderError: the stream is closed (also while waiting), its scheduler failed, or
                it has delivered the ``epochs`` it was opened for.
            RowReadError: a row of the batch failed (``on_error="raise"``).
        """
        batch = self._scheduler.take(self._job, None)
        if batch is None:
            raise LoaderError(
                f"Job stream {self._job.name!r} has delivered its {self._job.epochs} epoch(s); "
                "open the job again (or with epochs=None) to read on."
            )
        return batch

    def take(self, epoch: int | None = None) -> dict[str, Any] | None:
        """The next batch, or None at the end of ``epoch`` (if given) or of the last epoch."""
        return self._scheduler.take(self._job, epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where the job is: its epoch and the rows of that epoch it has not received yet."""
        return self._scheduler.state_dict(self._job)

    def stats(self) -> dict[str, Any]:
        """The job's counters so far.

        ``batches``, ``rows`` and ``skipped`` rows delivered; the ``epoch`` of the next batch;
        ``requests``: values (row x column) fetched for the job, ``loaded``: those it read or
        decoded itself, ``shared``: those another job's decode served (cached or in flight);
        stalls: ``wait_s`` blocked waiting for batches, ``compute_s`` between batches (the
        job's own work), ``waiting`` the first's share of both; ``rows_per_s``.
        """
        with self._scheduler.cond:
            return self._job.stats()

    def close(self) -> None:
        """Leave: unregister from sampling; batches in preparation release their pins."""
        self._scheduler.remove(self._job)

    def __enter__(self) -> JobStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
