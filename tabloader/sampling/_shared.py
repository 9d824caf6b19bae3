"""What both samplers do alike: :class:`SamplerBase` (a job joins plain or weighted, the
lookups of a job, the check of a state), on which
:class:`~tabloader.sampling.DependentSampler` and :class:`~tabloader.sampling.IndependentSampler`
implement :class:`~tabloader.sampling._base.Sampler`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, ClassVar, Generic, Protocol, TypeVar

import numpy as np
from pyroaring import BitMap

from tabloader.catalog._bitmaps import bitmap_to_array
from tabloader.catalog._errors import SamplingError
from tabloader.sampling._base import check_ids, check_remaining, unknown_job

if TYPE_CHECKING:
    from tabloader.catalog._options import JobSpec
    from tabloader.sampling._importance import ImportanceScores
    from tabloader.sampling._states import Drawn
    from tabloader.sampling._weighted import WeightedJobs


class PlainJob(Protocol):
    """What :class:`SamplerBase` reads of a sampler's plain job."""

    seq: int  # registration number: jobs() is in this order
    epoch: int


J = TypeVar("J", bound=PlainJob)


class SamplerBase(Generic[J]):
    """What both samplers do alike: a job joins plain or weighted, and the lookups of a job.

    A sampler keeps its plain jobs in ``_jobs`` and its weighted jobs in one or more
    :class:`~tabloader.sampling._weighted.WeightedJobs` (its *homes*); it says where a job's
    home is (:meth:`_own`), where a new weighted job goes (:meth:`_home_for`) and how a plain
    job joins and what it has left (:meth:`_add_plain`, :meth:`_plain_remaining`).
    """

    VERSION = 1
    KIND: ClassVar[str]  # the ``kind`` of its state_dict
    shares_rounds: ClassVar[bool] = False  # its jobs' rounds hand out the same rows
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
        drawn: Drawn | None = None,
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
                weighted (:mod:`tabloader.sampling._weighted`; how it shares rows with the
                other jobs: the sampler's module docstring).
            scores: an importance job's scores to resume with (default: the prior).
            drawn: a weighted job's draws to resume with (``Drawn``: ``drawn`` of the run
                it resumes): they are taken as drawn, and a job alone in its stream of
                uniforms draws on as that run would have.

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
            from tabloader.sampling._importance import ImportanceScores

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
            drawn=drawn,
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

    def drawn(self, name: str, since: int) -> dict[str, object] | None:
        """Where weighted job ``name``'s draws stand, for a state to resume exactly with
        (``WeightedJobs.drawn``; None: a plain job)."""
        own = self._own(name)
        if own is None:
            self._job(name)  # unknown: that error
            return None
        return own.drawn(name, since)

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
    def _check_state(self, state: Mapping[str, object]) -> None:
        """Raise unless ``state`` is this kind of sampler's, of this version."""
        if state.get("kind") != self.KIND or state.get("version") != self.VERSION:
            raise SamplingError(
                f"Not a state of the {type(self).__name__} (kind={state.get('kind')!r}, "
                f"version={state.get('version')!r}); use the sampler that saved it."
            )
