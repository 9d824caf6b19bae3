"""The interface every sampler implements, and small helpers shared by the samplers.

A sampler holds the registered jobs of one dataset and, for each, the rows ``R_j`` it
still has to read in its current epoch. :class:`Sampler` is the ``Protocol`` the engine
(and the cache simulator) program against; :class:`~tabloader.sampling.DependentSampler`
and :class:`~tabloader.sampling.IndependentSampler` implement it, on
:class:`~tabloader.sampling._shared.SamplerBase` (what they do alike).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, TypedDict, runtime_checkable

import numpy as np
from pyroaring import BitMap

from tabloader.catalog._errors import SamplingError
from tabloader.sampling._states import SamplerState, UniformsState

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from tabloader.catalog._options import JobSpec
    from tabloader.sampling._importance import ImportanceScores
    from tabloader.sampling._states import Drawn


class JobStart(TypedDict, total=False):
    """Where a job starts in a sampler (``Sampler.add_job``'s keywords; none: a fresh plain
    job, its first epoch all of its rows)."""

    remaining: BitMap | None  # resumed: the rows of its epoch still to read
    epoch: int  # resumed: that epoch's number
    weights: np.ndarray | None  # a weighted job's static weights (float64, ids ascending)
    scores: ImportanceScores | None  # an importance job's scores to resume with
    drawn: Drawn | None  # a weighted job's draws to resume with


@runtime_checkable
class Sampler(Protocol):
    """What a sampler offers: jobs join and leave, rounds hand out one row per job.

    A sampler whose jobs share rounds (``shares_rounds``) takes rows back: a job puts rows it
    was handed and never read back into its epoch (``give_back``), so a job that joins late
    shares them (:meth:`~tabloader.sampling.DependentSampler.give_back`).
    """

    shares_rounds: ClassVar[bool]  # its jobs share rounds: it takes rows back (``give_back``)

    def add_job(
        self, name: str, ids: BitMap, spec: JobSpec | None = None, **start: Unpack[JobStart]
    ) -> None:
        """Register ``name``; its first epoch is all of ``ids`` (or ``remaining`` of them,
        epoch ``epoch``, when it resumes: :class:`JobStart`). ``spec``: the job's options
        (``importance`` and ``replacement`` are read). ``weights`` (float64, aligned with
        ``ids`` ascending) or ``spec.importance == 'loss'`` make the job *weighted*: it draws
        from its own distribution (:mod:`tabloader.sampling._weighted`). ``scores``: an
        importance job resumes with these (``importance_scores`` of the run saved) instead of
        the prior; ``drawn``: a weighted job with the draws of that run (``drawn``)."""

    def remove_job(self, name: str) -> None:
        """Unregister ``name``; no other job gains, loses or repeats a row."""

    def jobs(self) -> list[str]:
        """The registered job names, in registration order."""

    def sample(self, jobs: Sequence[str]) -> dict[str, int]:
        """One round for ``jobs``: one row id per listed job."""

    def sample_many(self, jobs: Sequence[str], n: int) -> dict[str, np.ndarray]:
        """``n`` rounds for ``jobs`` at once; equal to ``n`` calls of :meth:`sample`."""

    def remaining(self, name: str) -> BitMap:
        """The rows ``name`` still has to read this epoch."""

    def give_back(self, name: str, rows: np.ndarray) -> None:
        """Return ``rows``, handed out to ``name`` this epoch and not read, to its epoch (a
        sampler that ``shares_rounds``; the others raise ``SamplingError``)."""

    def epoch(self, name: str) -> int:
        """The current epoch of ``name`` (0 for its first)."""

    def refcount(self, row_id: int) -> int:
        """How many jobs still need ``row_id`` this epoch."""

    def refcounts(self, ids: np.ndarray) -> np.ndarray:
        """:meth:`refcount` for many rows (int64 array)."""

    def expected_draws(self, ids: np.ndarray, *, repeats_only: bool = False) -> np.ndarray:
        """Per row, its expected draws left in the weighted jobs' epochs (float64);
        ``repeats_only``: of the jobs drawing with replacement only."""

    def weighted(self, name: str) -> bool:
        """Whether ``name`` is a weighted job."""

    def report(self, name: str, ids: np.ndarray, losses: np.ndarray) -> None:
        """One reported batch of losses of an ``importance = 'loss'`` job."""

    def importance_scores(self, name: str) -> ImportanceScores | None:
        """The live importance scores of ``name`` (None: not an ``importance = 'loss'`` job):
        what a job's state saves, and ``add_job(scores=)`` resumes with."""

    def drawn(self, name: str, since: int) -> dict[str, object] | None:
        """Where weighted job ``name``'s draws stand (None: a plain job): what a job's state
        saves beside the rows it drew ahead, and ``add_job(drawn=)`` resumes with."""

    def row_weights(self, name: str, epoch: int, rows: np.ndarray) -> np.ndarray | None:
        """The ``_weight`` column of ``rows`` handed to ``name`` in ``epoch`` (float32), or
        None for a plain job."""

    def state_dict(self) -> SamplerState:
        """A plain dict to resume from exactly (bitmaps as serialized bytes)."""

    def load_state_dict(self, state: SamplerState) -> None:
        """Restore what :meth:`state_dict` returned."""


class Uniforms:
    """A buffered stream of uniform floats in ``[0, 1)`` from a numpy ``Generator``.

    The samplers draw floats one at a time in Python loops; drawing them in blocks and
    reading a list is ~10x cheaper than calling the generator each time. The buffer and the
    generator state are both part of :meth:`state_dict`, so resume is exact.
    """

    BLOCK = 8192

    def __init__(self, seed: int | np.random.SeedSequence | None) -> None:
        self.rng = np.random.default_rng(seed)
        self.buf: list[float] = []
        self.i = 0

    def ensure(self, k: int) -> None:
        """Make at least ``k`` floats available from ``buf[i:]``."""
        if len(self.buf) - self.i < k:
            self.buf = self.buf[self.i :] + self.rng.random(max(self.BLOCK, k)).tolist()
            self.i = 0

    def take(self, k: int) -> np.ndarray:
        """The next ``k`` floats as an array: the rest of ``buf``, then straight from the
        generator (one draw per float, so the stream is the same as through ``buf``)."""
        head = self.buf[self.i : self.i + k]
        self.i += len(head)
        if self.i == len(self.buf):
            self.buf, self.i = [], 0
        if len(head) == k:
            return np.asarray(head, dtype=np.float64)
        return np.concatenate((np.asarray(head, dtype=np.float64), self.rng.random(k - len(head))))

    def state_dict(self) -> UniformsState:
        """Generator state plus the unread part of the buffer."""
        return {
            "bit_generator": self.rng.bit_generator.state,
            "buffer": np.asarray(self.buf[self.i :], dtype=np.float64).tobytes(),
        }

    def load_state_dict(self, state: UniformsState) -> None:
        """Restore from :meth:`state_dict`."""
        self.rng.bit_generator.state = state["bit_generator"]
        self.buf = np.frombuffer(state["buffer"], dtype=np.float64).tolist()
        self.i = 0


def check_ids(name: str, ids: BitMap | Iterable[int]) -> BitMap:
    """Validate a job's id set and return it as a ``BitMap``.

    Raises:
        SamplingError: ``name`` is not a non-empty string or ``ids`` is empty.
    """
    if not isinstance(name, str) or not name:
        raise SamplingError(f"Job name must be a non-empty string, got {name!r}.")
    bm = ids if isinstance(ids, BitMap) else BitMap(ids)
    if len(bm) == 0:
        raise SamplingError(
            f"Job {name!r} has an empty id set; register it with at least one row "
            "(check the job's predicate)."
        )
    return bm


def check_remaining(name: str, ids: BitMap, remaining: BitMap | None) -> BitMap:
    """The rows a (resuming) job starts with: ``remaining``, checked, or all of ``ids``."""
    if remaining is None:
        return ids
    if not isinstance(remaining, BitMap) or not remaining or not remaining.issubset(ids):
        raise SamplingError(
            f"remaining rows of job {name!r} must be a non-empty BitMap subset of its ids; "
            "pass what remaining() returned for this job, or None for a full epoch."
        )
    return remaining


def check_round(registered: Collection[str], jobs: Sequence[str]) -> None:
    """Validate the job list of a round.

    Raises:
        SamplingError: a job is unknown or listed twice.
    """
    seen: set[str] = set()
    for name in jobs:
        if name not in registered:
            known = ", ".join(repr(j) for j in registered) or "none"
            raise SamplingError(
                f"Unknown job {name!r}; registered jobs: {known}. Call add_job() first."
            )
        if name in seen:
            raise SamplingError(f"Job {name!r} is listed twice in one round; list it once.")
        seen.add(name)


def unknown_job(registered: Collection[str], name: str) -> SamplingError:
    """The error for a lookup of an unregistered job."""
    known = ", ".join(repr(j) for j in registered) or "none"
    return SamplingError(f"Unknown job {name!r}; registered jobs: {known}.")
