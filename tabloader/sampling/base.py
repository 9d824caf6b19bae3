"""The interface every sampler implements, and small helpers shared by the samplers.

A sampler holds the registered jobs of one dataset and, for each, the rows ``R_j`` it
still has to read in its current epoch. :class:`Sampler` is the ``Protocol`` the engine
(and the cache simulator) program against; :class:`~tabloader.sampling.DependentSampler`
and :class:`~tabloader.sampling.IndependentSampler` implement it, on :class:`SamplerBase`:
what they do alike (jobs join, plain or weighted; the lookups of a job).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np
from pyroaring import BitMap

from catalog.bitmaps import bitmap_to_array
from catalog.errors import SamplingError

if TYPE_CHECKING:
    from catalog.options import JobSpec
    from tabloader.sampling.importance import ImportanceScores
    from tabloader.sampling.weighted import WeightedJobs

__all__ = [
    "PlainJob",
    "Sampler",
    "SamplerBase",
    "Uniforms",
    "check_ids",
    "check_remaining",
    "check_round",
    "unknown_job",
]


@runtime_checkable
class Sampler(Protocol):
    """What a sampler offers: jobs join and leave, rounds hand out one row per job.

    A sampler whose jobs share rounds also has ``give_back(name, rows)``: a job puts rows it
    was handed and never read back into its epoch, so a job that joins late shares them
    (:meth:`~tabloader.sampling.DependentSampler.give_back`; the engine looks for it).
    """

    def add_job(
        self,
        name: str,
        ids: BitMap,
        spec: JobSpec | None = None,
        *,
        remaining: BitMap | None = None,
        epoch: int = 0,
        weights: np.ndarray | None = None,
        scores: ImportanceScores | None = None,
    ) -> None:
        """Register ``name``; its first epoch is all of ``ids`` (or ``remaining`` of them,
        epoch ``epoch``, when it resumes). ``spec``: the job's options (``importance`` and
        ``replacement`` are read). ``weights`` (float64, aligned with ``ids`` ascending) or
        ``spec.importance == 'loss'`` make the job *weighted*: it draws from its own
        distribution (:mod:`tabloader.sampling.weighted`). ``scores``: an importance job
        resumes with these (``importance_scores`` of the run saved) instead of the prior."""

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

    def row_weights(self, name: str, epoch: int, rows: np.ndarray) -> np.ndarray | None:
        """The ``_weight`` column of ``rows`` handed to ``name`` in ``epoch`` (float32), or
        None for a plain job."""

    def state_dict(self) -> dict[str, Any]:
        """A plain dict to resume from exactly (bitmaps as serialized bytes)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
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

    def state_dict(self) -> dict[str, Any]:
        """Generator state plus the unread part of the buffer."""
        return {
            "bit_generator": self.rng.bit_generator.state,
            "buffer": np.asarray(self.buf[self.i :], dtype=np.float64).tobytes(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
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


class PlainJob(Protocol):
    """What :class:`SamplerBase` reads of a sampler's plain job."""

    seq: int  # registration number: jobs() is in this order
    epoch: int


J = TypeVar("J", bound=PlainJob)


class SamplerBase(Generic[J]):
    """What both samplers do alike: a job joins plain or weighted, and the lookups of a job.

    A sampler keeps its plain jobs in ``_jobs`` and its weighted jobs in one or more
    :class:`~tabloader.sampling.weighted.WeightedJobs` (its *homes*); it says where a job's
    home is (:meth:`_own`), where a new weighted job goes (:meth:`_home_for`) and how a plain
    job joins and what it has left (:meth:`_add_plain`, :meth:`_plain_remaining`).
    """

    VERSION = 1
    KIND: ClassVar[str]  # the ``kind`` of its state_dict
    _jobs: dict[str, J]
    _next_seq: int

    # -- what a sampler says ---------------------------------------------------------------------
    def _own(self, name: str) -> WeightedJobs | None:
        """The home of weighted job ``name`` (None: not a weighted job)."""
        raise NotImplementedError

    def _homes(self) -> Iterable[WeightedJobs]:
        raise NotImplementedError

    def _home_for(self, name: str) -> WeightedJobs:
        """Where weighted job ``name`` is added (:meth:`_keep` once it is)."""
        raise NotImplementedError

    def _keep(self, name: str, home: WeightedJobs) -> None:
        """Weighted job ``name`` was added to ``home``."""

    def _add_plain(self, name: str, ids: BitMap, start: BitMap, epoch: int) -> None:
        raise NotImplementedError

    def _plain_remaining(self, job: J) -> BitMap:
        raise NotImplementedError

    # -- jobs ------------------------------------------------------------------------------------
    def add_job(
        self,
        name: str,
        ids: BitMap,
        spec: JobSpec | None = None,
        *,
        remaining: BitMap | None = None,
        epoch: int = 0,
        weights: np.ndarray | None = None,
        scores: ImportanceScores | None = None,
    ) -> None:
        """Register ``name`` now; its first epoch is all of ``ids``.

        Args:
            name: the job.
            ids: the job's rows (every epoch of a plain job is a permutation of them).
            spec: the job's options: ``importance = 'loss'`` makes it weighted by its reported
                losses, ``replacement`` (default true) picks how a weighted job draws.
            remaining: resume mid-epoch: the rows of the current epoch still to read (a
                non-empty subset of ``ids``; for a weighted job with replacement, its draws
                left are ``len(remaining)``); default all of ``ids``.
            epoch: the number of the current epoch (when resuming).
            weights: static weights, one per row of ``ids`` in ascending order: the job is
                weighted (:mod:`tabloader.sampling.weighted`; how it shares rows with the
                other jobs: the sampler's module docstring).
            scores: an importance job's scores to resume with (default: the prior).

        Raises:
            SamplingError: ``name`` is already registered, ``ids`` is empty, ``remaining``
                is not a non-empty subset of ``ids``, or the weights are bad (not one finite
                non-negative number per row, all zero, or given with ``importance``).
        """
        if name in self._jobs or self._own(name) is not None:
            raise SamplingError(
                f"Job {name!r} is already registered; remove_job({name!r}) first or use "
                "another name."
            )
        bm = check_ids(name, ids)
        start = check_remaining(name, bm, remaining)
        importance = getattr(spec, "importance", None) == "loss"
        if weights is None and not importance:
            self._add_plain(name, bm, start, epoch)
            return
        if weights is not None and importance:
            raise SamplingError(
                f"Job {name!r} has both weights and importance = 'loss'; give one of them."
            )
        if not importance:
            scores = None
        elif scores is None:
            from tabloader.sampling.importance import ImportanceScores

            scores = ImportanceScores(bitmap_to_array(bm).astype(np.int64))
        home = self._home_for(name)
        home.add(
            name,
            self._next_seq,
            bm,
            weights=weights,
            scores=scores,
            replacement=bool(getattr(spec, "replacement", True)),
            remaining=remaining,
            epoch=epoch,
        )
        self._keep(name, home)
        self._next_seq += 1

    def jobs(self) -> list[str]:
        """The registered job names, in registration order."""
        seqs = {name: job.seq for name, job in self._jobs.items()}
        for home in self._homes():
            seqs.update((name, job.seq) for name, job in home.jobs.items())
        return sorted(seqs, key=seqs.__getitem__)

    def _job(self, name: str) -> J:
        job = self._jobs.get(name)
        if job is None:
            raise unknown_job(self._jobs, name)
        return job

    def weighted(self, name: str) -> bool:
        """Whether ``name`` draws from a distribution of its own (weights or importance)."""
        if self._own(name) is not None:
            return True
        self._job(name)  # unknown: that error
        return False

    def report(self, name: str, ids: np.ndarray, losses: np.ndarray) -> None:
        """One reported batch of ``name``'s losses, for its importance scores (its next
        epoch draws from them).

        Raises:
            SamplingError: ``name`` is unknown or not an ``importance = 'loss'`` job, or the
                report is bad (``ImportanceScores.report``).
        """
        scores = self.importance_scores(name)
        if scores is None:
            raise SamplingError(
                f"Job {name!r} takes no loss reports: register it WITH (importance = 'loss') "
                "to draw by its losses."
            )
        scores.report(np.asarray(ids), np.asarray(losses))

    def importance_scores(self, name: str) -> ImportanceScores | None:
        """The live importance scores of ``name`` (None: not an ``importance = 'loss'`` job):
        what a job's state saves, and ``add_job(scores=)`` resumes with."""
        own = self._own(name)
        if own is None:
            self._job(name)  # unknown: that error
            return None
        return own.jobs[name].scores

    # -- queries ---------------------------------------------------------------------------------
    def remaining(self, name: str) -> BitMap:
        """The rows ``name`` still has to read in its current epoch (a weighted job with
        replacement: all its rows while it has draws left, any of them may come)."""
        own = self._own(name)
        if own is not None:
            return own.remaining(name)
        return self._plain_remaining(self._job(name))

    def epoch(self, name: str) -> int:
        """The current epoch of ``name`` (0 for the first)."""
        own = self._own(name)
        return own.jobs[name].epoch if own is not None else self._job(name).epoch

    def refcount(self, row_id: int) -> int:
        """How many plain jobs still need ``row_id`` this epoch (weighted jobs need no row
        for sure: :meth:`expected_draws` counts them)."""
        return int(self.refcounts(np.array([row_id]))[0])

    def refcounts(self, ids: np.ndarray) -> np.ndarray:
        """:meth:`refcount` of every row of ``ids`` (int64 array)."""
        raise NotImplementedError

    def expected_draws(self, ids: np.ndarray, *, repeats_only: bool = False) -> np.ndarray:
        """Per row of ``ids`` (float64): its expected draws left in the weighted jobs'
        epochs, ``q_row x draws left`` for a job with replacement and 1 for a row not drawn
        yet by a job without (0: no weighted job's). Beside :meth:`refcounts`, the expected
        reads of a row left this epoch. ``repeats_only``: of the jobs with replacement only
        (the engine counts the others' rows as it counts a plain job's: once an epoch)."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.zeros(ids.size, dtype=np.float64)
        for home in self._homes():
            out += home.expected_draws(ids, repeats_only=repeats_only)
        return out

    def row_weights(self, name: str, epoch: int, rows: np.ndarray) -> np.ndarray | None:
        """The batch column ``_weight`` of ``rows`` handed to ``name`` in ``epoch``: float32
        ``1 / (N p_row)`` for a weighted job with replacement (mean 1 under its distribution:
        a loss weighted by it is unbiased for the plain mean), 1.0 for one without (every row
        once an epoch); None for a plain job (its batches have no ``_weight``)."""
        own = self._own(name)
        if own is None:
            self._job(name)
            return None
        return own.row_weights(name, epoch, np.asarray(rows, dtype=np.int64))

    # -- state -----------------------------------------------------------------------------------
    def _check_state(self, state: dict[str, Any]) -> None:
        """Raise unless ``state`` is this kind of sampler's, of this version."""
        if state.get("kind") != self.KIND or state.get("version") != self.VERSION:
            raise SamplingError(
                f"Not a state of the {type(self).__name__} (kind={state.get('kind')!r}, "
                f"version={state.get('version')!r}); use the sampler that saved it."
            )
