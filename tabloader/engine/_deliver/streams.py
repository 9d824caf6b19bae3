"""What every consumer of a job's batches programs against: the :class:`Stream` protocol.

Two streams implement it: :class:`~tabloader.engine._deliver.stream.JobStream` (a loader in this
process) and :class:`~tabloader.service._client.RemoteStream` (a job of the loader service), on
:class:`StreamBase` (what they do alike by ``take``: iterating, and ``with``).
``tabloader.torch`` and the integrations take either. This module imports nothing of the
engine, so a job process of the service can name the type without loading it.

:func:`report_arrays` (:mod:`tabloader.sampling._importance`) checks a job's reported losses
(``Stream.report``) the same way on each side of the service: before they leave the job's process,
and where they arrive.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tabloader.catalog._errors import LoaderError

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Self

    from tabloader.catalog._options import JobSpec


@runtime_checkable
class Stream(Protocol):
    """The batches of one job (one rank of it), in process or from the service."""

    @property
    def name(self) -> str:
        """The job name."""

    @property
    def rank(self) -> int:
        """This stream's rank (0 for a plain job)."""

    @property
    def world_size(self) -> int:
        """The job's number of ranks (1 for a plain job)."""

    @property
    def spec(self) -> JobSpec:
        """The job's options it was opened with."""

    @property
    def epoch(self) -> int:
        """The epoch of the next batch (0-based)."""

    def take(self, epoch: int | None = None) -> dict[str, Any] | None:
        """The next batch, or None at the end of ``epoch`` (if given) or of the last epoch."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The batches until the last epoch (forever without one)."""

    def iter_epoch(self) -> Iterator[dict[str, Any]]:
        """The remaining batches of the current epoch."""

    def next_batch(self) -> dict[str, Any]:
        """The next batch; raises ``LoaderError`` past the last epoch."""

    def state_dict(self, *, undelivered: int = 0) -> dict[str, Any]:
        """Where the job is (``undelivered``: batches taken and not trained on yet)."""

    def report(self, ids: np.ndarray, losses: np.ndarray) -> None:
        """Score rows of a batch by their losses (a job with ``importance = 'loss'``)."""

    def abandon(self, epoch: int) -> int:
        """Give up the rest of ``epoch``; the rows given up."""

    def stats(self) -> dict[str, Any]:
        """The stream's counters so far."""

    def close(self) -> None:
        """Leave the job (this rank of it)."""

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


class StreamBase:
    """What a :class:`Stream` does by its ``take``, ``epoch`` and ``close``, alike for both
    streams: iterating, and ``with``."""

    def __iter__(self: Stream) -> Iterator[dict[str, Any]]:
        """The batches until the last epoch (forever without one)."""
        while (batch := self.take(None)) is not None:
            yield batch

    def iter_epoch(self: Stream) -> Iterator[dict[str, Any]]:
        """The remaining batches of the current epoch."""
        epoch = self.epoch
        while (batch := self.take(epoch)) is not None:
            yield batch

    def __enter__(self) -> Self:
        return self

    def __exit__(self: Stream, *exc: object) -> None:
        self.close()


def no_importance(job: str) -> LoaderError:
    """The error of a report on ``job``, which does not draw by its losses."""
    return LoaderError(
        f"Job {job!r} reports losses but does not draw by them; register it WITH "
        "(importance = 'loss') (or open it with importance='loss') to draw by them."
    )
