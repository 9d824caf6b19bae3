"""What every consumer of a job's batches programs against: the :class:`Stream` protocol.

Two streams implement it: :class:`~tabloader.engine.stream.JobStream` (a loader in this
process) and :class:`~tabloader.service.client.RemoteStream` (a job of the loader service).
``tabloader.torch`` and the integrations take either. This module imports nothing of the
engine, so a job process of the service can name the type without loading it.

:func:`report_arrays` checks a job's reported losses (``Stream.report``) the same way on
each side of the service: before they leave the job's process, and where they arrive.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from catalog.errors import LoaderError, TabloaderError

if TYPE_CHECKING:
    from typing_extensions import Self

    from catalog.options import JobSpec

__all__ = ["REPORT_ROWS_MAX", "Stream", "no_importance", "report_arrays"]

REPORT_ROWS_MAX = 65_536
"""The most rows one report may carry: a minibatch's, never an epoch's (bounds the message)."""


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


def report_arrays(
    ids: Any, losses: Any, error: type[TabloaderError] = LoaderError
) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` (a batch's ``_id``) and their per-row ``losses`` as int64 and float64 arrays,
    checked: 1-D, equally long, at most ``REPORT_ROWS_MAX`` rows, integer ids, finite real
    losses (``ImportanceScores.report`` checks them so too, raising ``SamplingError``).

    Raises:
        error: one of those does not hold (the message names the fix).
    """
    ids, losses = np.asarray(ids), np.asarray(losses)
    if ids.ndim != 1 or losses.ndim != 1:
        raise error(
            f"report takes 1-D ids and losses (1-D arrays, one loss per row); got shapes "
            f"{ids.shape} and {losses.shape}: compute the loss per row (reduction='none') and "
            "flatten it."
        )
    if ids.size != losses.size:
        raise error(
            f"report got {ids.size} ids and {losses.size} losses; pass batch['_id'] and one "
            "loss per row of that batch."
        )
    if ids.size > REPORT_ROWS_MAX:
        raise error(
            f"report got {ids.size} rows, more than {REPORT_ROWS_MAX}; report each batch on "
            "its own."
        )
    if ids.size and ids.dtype.kind not in "iu":
        raise error(
            f"report ids must be integers: pass integer ids (batch['_id']), got dtype {ids.dtype}."
        )
    if ids.size and losses.dtype.kind not in "iuf":
        raise error(
            f"report losses must be real numbers, got dtype {losses.dtype}; pass the per-row "
            "loss as floats."
        )
    if ids.dtype.kind == "u" and ids.size and int(ids.max()) > np.iinfo(np.int64).max:
        raise error(
            f"report names rows above {np.iinfo(np.int64).max}, which no job has; pass "
            "batch['_id'] of this job's own batches."
        )
    ids, losses = ids.astype(np.int64), losses.astype(np.float64)
    finite = np.isfinite(losses)
    if not bool(finite.all()):
        raise error(
            f"report got non-finite losses (NaN or inf) for rows {ids[~finite][:3].tolist()}; "
            "report finite per-row losses (a diverged step: skip its report)."
        )
    return ids, losses


def no_importance(job: str) -> LoaderError:
    """The error of a report on ``job``, which does not draw by its losses."""
    return LoaderError(
        f"Job {job!r} reports losses but does not draw by them; register it WITH "
        "(importance = 'loss') (or open it with importance='loss') to draw by them."
    )
