"""A job and its ranks: what the scheduler keeps of each open job (:class:`JobState`).

* **A job** is one open job of a dataset: its rows (``ids``), its plan (the columns to gather
  or prepare), its options (``batch_size``, ``prefetch``, ``epochs``, ``on_error``) and its
  *queue* (:class:`~tabloader.engine._queue.jobqueue.JobQueue`, ``job.queue``: the rows sampled for
  it and not yet cut into batches, the sampler's place, the horizon: rows sampled ahead). Its
  :class:`~tabloader.engine._queue.dealer.Dealer` cuts the batches and deals them to the ranks.
* **Ranks.** A data-parallel job has ``world_size`` ranks (:class:`RankState`) sharing its
  queue, a plain job one. Each has its own batches in preparation, its position (``epoch``,
  ``taken``: batches taken of that epoch) and counters; it is pending until its stream opens
  (it has no state yet, and the job samples and deals nothing until every rank has opened:
  a ``world_size`` whose ranks never come costs nothing), then open, then closed.
* **Epochs.** Each rank gets ``batches_per_rank(epoch)`` batches of an epoch: every row,
  the last batch maybe short, with one rank; with several, each rank gets
  :func:`~tabloader.engine._queue.ranks.rank_share` rows of an epoch in full batches and the rest is
  dropped, as ``DistributedSampler(drop_last=True)`` does; or, with the job option
  ``drop_last = false`` (evaluation), ``ceil(n / world_size)`` rows, the last batch of each
  rank maybe short, the shares padded with the epoch's first rows repeated (fewer than
  ``world_size`` of them), as ``DistributedSampler(drop_last=False)`` does. A resumed job's
  first epoch has only the rows it had left; how many rows an epoch has is its row source's
  (``RowSource.epoch_rows``: a fed rank's epochs have its share of the cluster job's).
* **Its row source and its receiver**, chosen once when it opens: where its rows come from
  (:class:`RowSource`: this loader's sampler, or a leader that feeds them; the two are in
  :mod:`tabloader.engine._queue.sources`) and who receives its batches (the plan's
  ``receiver``: :mod:`tabloader.engine._deliver.collate`). The scheduler and the dealer call
  them and never ask which a job has.
* **Stalls.** Per rank, seconds blocked in ``take`` (``wait_s``: waiting for data) vs seconds
  between batches (``compute_s``: its own compute); a job's ``stats`` sum its ranks'.
* **Pace.** The rows a job takes per second, measured (:class:`Pace`): its share of the
  lookahead (:mod:`tabloader.engine._queue.queues`).
* **Regime.** Whether the job waits on the loader or on its own step (:class:`Regime`), measured
  as it takes its batches; ``stats()`` says which (DESIGN §17: what pacing by epoch size would
  act on).

How queues are filled: :mod:`tabloader.engine._queue.queues`; batches cut and dealt:
:mod:`tabloader.engine._queue.dealer`; the whole: :mod:`tabloader.engine._queue.scheduler`.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
from pyroaring import BitMap

from tabloader.catalog._errors import LoaderError
from tabloader.catalog._options import JobSpec
from tabloader.catalog._settings import format_bytes
from tabloader.engine._arena.arena import values_that_fit
from tabloader.engine._prepare.fetch import MIN_PROCESS_ROWS
from tabloader.engine._prepare.work import Plan, Work
from tabloader.engine._queue.jobqueue import NO_ROWS, JobQueue
from tabloader.engine.decode import Fit

if TYPE_CHECKING:
    from tabloader.sampling._base import Sampler
    from tabloader.sampling._importance import ImportanceScores
    from tabloader.sampling._states import Drawn

Rows = npt.NDArray[np.int64]
Weights = npt.NDArray[np.float32] | None  # a batch's ``_weight`` column (None: a plain job's)

MAX_UNDELIVERED = 2
"""The most batches a ``state_dict`` may count as taken but not trained on: a service
client's batch read ahead, and one a framework fetched before training on the last."""
PREFETCH_BYTES = 1 << 20  # batches of small images: at least this many bytes of them ahead
PREFETCH_MAX = 8


class OnError(enum.Enum):
    """What a job does with a row that fails to read or decode."""

    RAISE = "raise"
    SKIP = "skip"


class Pace:
    """Rows taken per second over the last ``WINDOW_S`` seconds (a job's measured speed).

    Example:
        >>> pace = Pace()
        >>> pace.add(256, now=0.0), pace.add(256, now=1.0), pace.rate(now=2.0)
        (None, None, 256.0)
    """

    WINDOW_S = 4.0
    MIN_SPAN_S = 0.5  # less than that measured: no rate yet

    def __init__(self) -> None:
        self.total = 0
        self._marks: deque[tuple[float, int]] = deque()  # (time, rows taken before it)

    def add(self, rows: int, *, now: float | None = None) -> None:
        """``rows`` were taken (now)."""
        now = time.monotonic() if now is None else now
        self._marks.append((now, self.total))
        self.total += rows
        while len(self._marks) > 2 and now - self._marks[1][0] > self.WINDOW_S:
            self._marks.popleft()

    def rate(self, *, now: float | None = None) -> float | None:
        """Rows per second since the oldest mark in the window (None: too little measured)."""
        if not self._marks:
            return None
        now = time.monotonic() if now is None else now
        since, before = self._marks[0]
        span = now - since
        return None if span < self.MIN_SPAN_S else (self.total - before) / span


class Regime:
    """Whether a job waits on the loader or on its own step, over its last ``WINDOW_S``
    seconds: ``loader`` when it spent at least ``LOADER_BOUND`` of them blocked waiting for
    data (``wait_s`` against ``compute_s``, as its consumer reports them), else ``step``. A
    job not measured yet (it waits for its first batches) is ``loader``.

    Example:
        >>> regime = Regime()
        >>> regime.update(0.0, 0.0, now=0.0), regime.update(0.1, 0.9, now=1.0)
        ('loader', 'step')
    """

    WINDOW_S = 1.0
    LOADER_BOUND = 0.5

    def __init__(self) -> None:
        self.name = "loader"
        self._mark: tuple[float, float, float] | None = None  # (time, wait_s, compute_s)

    def update(self, wait_s: float, compute_s: float, *, now: float | None = None) -> str:
        """The job's regime, its totals being ``wait_s`` and ``compute_s`` now."""
        now = time.monotonic() if now is None else now
        if self._mark is None:
            self._mark = (now, wait_s, compute_s)
        elif now - self._mark[0] >= self.WINDOW_S:
            waited, computed = wait_s - self._mark[1], compute_s - self._mark[2]
            if waited + computed > 0:
                loader = waited >= self.LOADER_BOUND * (waited + computed)
                self.name = "loader" if loader else "step"
            self._mark = (now, wait_s, compute_s)
        return self.name


@dataclass(frozen=True)
class FedRows:
    """Rows of one epoch that a leader sent a fed job, with the rounds (the leader's) they
    are used in and, for a weighted job, each row's ``_weight``."""

    epoch: int
    rows: npt.NDArray[np.int64]
    rounds: npt.NDArray[np.int64]
    weights: npt.NDArray[np.float32] | None = None


class Seat(NamedTuple):
    """Where an open takes its place in this loader (``RowSource.seat``): the job's name,
    rank and world size here, and its row source."""

    name: str
    rank: int
    world_size: int
    source: RowSource


class RowSource(Protocol):
    """Where an open job's rows come from, chosen once when it opens (the two there are:
    :mod:`tabloader.engine._queue.sources`). A new feed is one more class of these methods.

    ``sampler`` is the sampler of this loader that draws the job's rows, which groups jobs
    in its rounds (None: they come from elsewhere, and take no part in rounds here).
    """

    sampler: Sampler | None

    @classmethod
    def seat(
        cls, name: str, spec: JobSpec, *, rank: int, world_size: int, share: int, resumes: bool
    ) -> Seat:
        """Where rank ``rank`` of ``world_size`` of job ``name`` (opened with ``spec``; each
        rank reads ``share`` rows of an epoch; ``resumes``: from a state) sits in this loader,
        and its source (made here: nothing is registered yet).

        Raises:
            LoaderError: what the source cannot do.
        """

    def open(
        self, job: JobState, sampler: Sampler, *, remaining: BitMap | None, epoch: int
    ) -> BitMap | None:
        """Start handing out ``job``'s rows (``sampler``: this loader's for its columns),
        fresh or resumed (``remaining`` rows of ``epoch``); the job's queue is at its first
        epoch after. Returns the rows of that epoch to count as future uses now (None: each
        is counted as it comes)."""

    def close(self, job: JobState) -> None:
        """``job`` leaves: the source forgets it."""

    def remaining(self, job: JobState) -> BitMap:
        """The rows of the job's current epoch the source has still to hand out here, and
        counted as future uses (``open``)."""

    def epoch_rows(self, job: JobState, epoch: int) -> int:
        """Rows each rank of ``job`` gets in ``epoch`` (padding included)."""

    def hungry(self, job: JobState) -> bool:
        """Whether ``job`` wants a sampling round of this loader now."""

    def weights(self, job: JobState, epoch: int, rows: Rows, sent: Weights) -> Weights:
        """The ``_weight`` column of a batch of ``rows`` of ``epoch`` (``sent``: the weights
        that came with them into the queue); None for a plain job."""

    def accept(self, job: JobState, sent: FedRows) -> Weights:
        """Check rows a leader sent ``job`` and move its queue to their epoch; their
        ``_weight``s, checked (None: a plain job's).

        Raises:
            LoaderError: the job is not fed, or the rows disagree with it.
        """

    def fail(self, reason: str) -> None:
        """No more rows come (the leader's job is gone, ``reason``)."""

    def check_going(self, job: JobState) -> None:
        """Raise why no more rows come for ``job``, if so (its rank then has no batch left).

        Raises:
            LoaderError: the source failed (``fail``).
        """

    def report(self, job: JobState, ids: Rows, losses: Any) -> None:
        """Per-row losses of a batch of ``job``, to whoever draws its rows.

        Raises:
            LoaderError: not taken here, or refused.
        """

    def progress(self, job: JobState) -> Sampler:
        """The sampler that keeps ``job``'s progress here (its ``state_dict`` is made from
        it).

        Raises:
            LoaderError: the job's progress is kept elsewhere.
        """


@dataclass(eq=False)
class JobState:
    """One open job of a dataset: its queue of rows, its ranks (one unless data-parallel).

    ``world_size`` ranks share the queue and take turns (see
    :mod:`tabloader.engine._queue.scheduler`); each :class:`RankState` has its own batches in
    preparation and counters.
    """

    name: str
    ids: BitMap
    plan: Plan
    batch_size: int
    prefetch: int  # batches prepared ahead, per rank
    queue: JobQueue  # its rows sampled ahead and not cut yet (``queues`` writes it)
    on_error: OnError
    source: RowSource  # where its rows come from, chosen at its open
    epochs: int | None = None  # stop after this many epochs (None: never)
    world_size: int = 1
    id_array: npt.NDArray[np.int64] = field(default_factory=lambda: NO_ROWS)
    closed: bool = False
    # the ranks that have opened (and maybe left since), by number: made as each opens, so
    # a job's world costs nothing before its ranks come (``open_rank``)
    ranks: dict[int, RankState] = field(init=False)
    pending: int = field(init=False)  # ranks not opened yet
    num_ids: int = field(init=False)
    spec: JobSpec = field(default_factory=JobSpec)  # the options it was opened with
    # a weighted job's weight of each row (option weight), aligned with ``id_array``
    weights: npt.NDArray[np.float64] | None = None
    # an importance job resumed from a state: the scores it had (its sampler draws from them)
    scores: ImportanceScores | None = None
    # a weighted job resumed from a state: the draws its run had made (``Dealer._drawn``)
    drawn: Drawn | None = None
    gone: str | None = None  # why a rank is gone: the others fail with it
    gone_from: int | None = None  # the first epoch they fail at
    # why the job failed in the loader (its own sampling, queueing or dealing raised): every
    # rank raises it; the other jobs of the dataset go on (``DatasetScheduler.fail_job``)
    failed: str | None = None
    pace: Pace = field(default_factory=Pace)
    regime: Regime = field(default_factory=Regime)

    def __post_init__(self) -> None:
        self.num_ids = len(self.ids)
        self.ranks = {}
        self.pending = self.world_size

    def open_rank(self, rank: int, lock: threading.RLock | threading.Lock) -> RankState:
        """Rank ``rank`` opens (its consumer waits on a condition of ``lock``, the
        scheduler's); its state is made now."""
        opened = self.ranks[rank] = RankState(self, rank, opened=True)
        opened.cond = threading.Condition(lock)
        opened.epoch = self.queue.first_epoch
        self.pending -= 1
        return opened

    def in_flight(self) -> int:
        return sum(w.rows.size for r in self.ranks.values() for w in r.batches)

    def all_joined(self) -> bool:
        """True once every rank has opened (or left): before, the job samples nothing and no
        rank gets a batch (a world that never comes costs nothing), and a rank that finishes
        early never leaves the job before the others have joined it."""
        return self.pending == 0

    def missing(self) -> list[int]:
        """The ranks that have not opened yet."""
        return [r for r in range(self.world_size) if r not in self.ranks]

    def batches_per_rank(self, epoch: int) -> int:
        """Batches each rank gets in ``epoch`` (the last may be short with a single rank, or
        when the job ``pads``)."""
        return -(-self.rank_rows_of(epoch) // self.batch_size)

    def rank_rows_of(self, epoch: int) -> int:
        """Rows each rank gets in ``epoch`` (padding included): its source's."""
        return self.source.epoch_rows(self, epoch)

    def done_sampling(self) -> bool:
        """True once the sampler has handed out the job's last epoch."""
        q = self.queue
        return q.left == 0 and self.epochs is not None and q.epoch + 1 >= self.epochs

    def room(self) -> int:
        """Rows below the horizon (negative: up to one batch over it; see ``_sample_locked``)."""
        if self.done_sampling():
            return 0
        return self.queue.horizon - self.queue.q_rows.size - self.in_flight()

    def measure_regime(self) -> str:
        """The job's regime now (:class:`Regime`), from its ranks' stalls."""
        ranks = self.ranks.values()
        return self.regime.update(sum(r.wait_s for r in ranks), sum(r.compute_s for r in ranks))

    def hungry(self) -> bool:
        """True if the job wants a sampling round now (its source says: ``RowSource.hungry``)."""
        return self.source.hungry(self)

    def wants_rows(self) -> bool:
        """True if the open job has fewer rows queued and in flight than its horizon (a fed
        job's feed then asks its leader for more)."""
        q = self.queue
        return not self.closed and q.q_rows.size + self.in_flight() < q.horizon

    def options(self) -> dict[str, Any]:
        """What every rank of the job must open it with."""
        return {
            **self.spec.resolved(),
            "prefetch": self.prefetch,
            "lookahead": self.queue.lookahead,
            "epochs": self.epochs,
        }

    def spaces(self) -> list[int]:
        """The arena spaces of the job's prepared columns."""
        return [space for _, space in self.plan.prepared]

    def joining(self, asked: JobState, rank: int) -> None:
        """Check that rank ``rank`` of this open job may open with ``asked`` (the options it is
        opened with; its state is the dealer's to check: ``Dealer.check_state``).

        Raises:
            LoaderError: the job is open as a plain job, or that rank is open or left, or it
                is asked for with another world size or other options.
        """
        name = self.name
        if self.world_size == 1 and asked.world_size == 1:
            raise LoaderError(asked.plan.receiver.open_already(name))
        if self.world_size != asked.world_size:
            raise LoaderError(
                f"Job {name!r} is open already in this loader with world_size={self.world_size}"
                f", and this open asks for world_size={asked.world_size}: every rank of a job "
                "must pass the same world_size (or close the job's streams first)."
            )
        joined = self.ranks.get(rank)
        if joined is not None and joined.is_open():
            raise LoaderError(
                f"Rank {rank} of job {name!r} is open already in this loader: each rank opens "
                "the job once (close that stream first, or pass another rank)."
            )
        if joined is not None:
            raise LoaderError(
                f"Rank {rank} of job {name!r} left while its other ranks go on; a rank cannot "
                "rejoin mid-run: close every rank, then open them all again (with the same "
                "state_dict() to resume)."
            )
        mine = self.options()
        theirs = asked.options()
        differ = [k for k in mine if mine[k] != theirs[k]]
        if differ or self.ids != asked.ids:
            what = ", ".join(f"{k}={theirs[k]!r} (rank 0's: {mine[k]!r})" for k in differ)
            raise LoaderError(
                f"Rank {rank} of job {name!r} was opened with other options than its ranks "
                f"open already: {what or 'the job rows changed (re-registered?)'}; every rank "
                "must open the job the same way."
            )

    def stats(self) -> dict[str, Any]:
        """The job's counters: its rank's, or the sum over its ranks opened (and each under
        ``ranks``)."""
        per_rank = [self.ranks[r].stats() for r in sorted(self.ranks)]
        if self.world_size == 1:
            return {**per_rank[0], "regime": self.regime.name}
        total = {
            key: sum(s[key] for s in per_rank)
            for key in (
                "batches",
                "rows",
                "skipped",
                "abandoned_rows",
                "requests",
                "loaded",
                "decoded",
                "shared",
                "wait_s",
                "compute_s",
                "augment_s",
                "rows_per_s",
            )
        }
        going = [r for r in self.ranks.values() if not r.closed] or list(self.ranks.values())
        busy = total["wait_s"] + total["compute_s"]
        return {
            "job": self.name,
            **total,
            "epoch": min(r.next_epoch() for r in going),
            "waiting": total["wait_s"] / busy if busy > 0 else 0.0,
            "regime": self.regime.name,
            "world_size": self.world_size,
            "ranks": per_rank,
        }


@dataclass(eq=False)
class RankState:
    """One rank of a job (a plain job has one): its consumer's batches and counters.

    Its position is (``epoch``, ``taken``): batches taken of that epoch. A rank is made as its
    stream opens (``JobState.open_rank``: before, it is *pending* and the others wait for it),
    then closed.
    """

    job: JobState = field(repr=False)
    rank: int
    batches: deque[Work] = field(default_factory=deque)  # preparing or ready, in order
    # its consumer waits here, on the scheduler's lock (set by ``DatasetScheduler.add``)
    cond: threading.Condition = field(init=False, repr=False)
    opened: bool = False
    closed: bool = False
    abandoned: bool = False  # its stream was garbage-collected without close()
    abandoning: int | None = None  # the epoch whose rest it is giving up (``abandon``)
    epoch: int = 0
    taken: int = 0
    # counters
    delivered: int = 0
    rows: int = 0
    skipped: int = 0
    abandoned_rows: int = 0  # rows of epochs given up mid-way (a new iteration began)
    requests: int = 0
    loaded: int = 0
    decoded: int = 0  # of ``loaded``: the images this rank's batches decoded themselves
    wait_s: float = 0.0  # blocked in take(): waiting for data
    compute_s: float = 0.0  # between batches: the job's own work
    augment_s: float = 0.0  # the job's own augmentation (part of its waiting, or a client's)
    last_return: float | None = None
    started: float = field(default_factory=time.perf_counter)

    def label(self) -> str:
        """The job's name, and the rank when there are several."""
        job = self.job
        if job.world_size == 1:
            return repr(job.name)
        return f"{job.name!r} (rank {self.rank} of {job.world_size})"

    def is_open(self) -> bool:
        return self.opened and not self.closed

    def next_epoch(self) -> int:
        """The epoch of the rank's next batch."""
        job = self.job
        while self.taken >= job.batches_per_rank(self.epoch):
            if self.epoch != job.queue.first_epoch and job.batches_per_rank(self.epoch) == 0:
                break  # an empty job: no epoch has a batch
            self.epoch, self.taken = self.epoch + 1, 0
        return self.epoch

    def position(self, back: int = 0) -> tuple[int, int]:
        """(epoch, batches of it taken) of the rank, ``back`` batches ago (``back`` <=
        ``MAX_UNDELIVERED``: the log keeps that many turns)."""
        epoch, taken = self.next_epoch(), self.taken
        while back > taken and epoch > self.job.queue.first_epoch:
            back -= taken
            epoch -= 1
            taken = self.job.batches_per_rank(epoch)
        return epoch, max(taken - back, 0)

    def share_done(self, back: int = 0) -> int | None:
        """The epoch whose whole share the rank had taken ``back`` batches ago, and nothing
        of the next (None: it was mid-epoch, or had taken nothing yet)."""
        epoch, taken = self.position(back)
        if taken and taken >= self.job.batches_per_rank(epoch):
            return epoch
        if taken == 0 and epoch > self.job.queue.first_epoch:
            return epoch - 1
        return None

    def give_up(self, rows: int) -> None:
        """Count a batch of the epoch being abandoned as taken, its ``rows`` as given up."""
        self.taken += 1
        self.abandoned_rows += rows

    def finished(self) -> bool:
        """True once the next batch would belong to epoch ``epochs`` (counted from 0)."""
        return self.job.epochs is not None and self.next_epoch() >= self.job.epochs

    def stats(self) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.started
        busy = self.wait_s + self.compute_s
        return {
            "job": self.job.name,
            "rank": self.rank,
            "world_size": self.job.world_size,
            "batches": self.delivered,
            "rows": self.rows,
            "epoch": self.next_epoch(),
            "skipped": self.skipped,
            "abandoned_rows": self.abandoned_rows,
            "requests": self.requests,
            "loaded": self.loaded,
            "decoded": self.decoded,
            "shared": self.requests - self.loaded,
            "wait_s": self.wait_s,
            "compute_s": self.compute_s,
            "augment_s": self.augment_s,
            "waiting": self.wait_s / busy if busy > 0 else 0.0,
            "rows_per_s": self.rows / elapsed if elapsed > 0 else 0.0,
        }


def _area(size: Any) -> int:
    """Pixels of one prepared image of ``size``; for an aspect-kept decode (``Fit``) an
    estimate: a 4:3 image at its least shorter side (a larger source decodes larger)."""
    if isinstance(size, Fit):
        return size.least * size.least * 4 // 3
    return int(size * size if isinstance(size, int) else math.prod(size))


def fit_prefetch(capacity: int, plan: Plan, rows: int, prefetch: int, given: int | None) -> int:
    """The prefetch of a service's job: its batches of ``rows`` rows (over its ranks) stay
    pinned in a cache of ``capacity`` bytes from prepared to released (``prefetch`` ahead,
    one at the client, one it reads ahead). A default ``prefetch`` (``given`` None) is lowered
    to fit; a job whose batches do not fit is refused (``LoaderError``)."""
    sizes = [d.image_size for d, _ in plan.prepared if d.image_size is not None]
    one = rows * sum(3 * _area(s) for s in sizes)
    fits = capacity // one - 2 if one else prefetch
    if fits >= (prefetch if given is not None else 1):
        return min(prefetch, fits)
    shared = (
        f" It reads decodes larger than it needs, shared with jobs open now: "
        f"{'; '.join(plan.larger)}."
        if plan.larger
        else ""
    )
    held = f"{(given or 1) + 2} of them are held at once"
    raise LoaderError(
        f"A batch of this job takes {format_bytes(one)} of decoded images (over its ranks); "
        f"{held}, more than the service's cache of {format_bytes(capacity)}: lower batch_size, "
        f"image_size or prefetch, or start the service with a larger --cache-bytes.{shared}"
    )


def cache_rows(capacity: int, plan: Plan) -> int:
    """The capacity of an arena of ``capacity`` bytes in values of ``plan``'s prepared columns
    (of its largest; an aspect-kept decode estimated), 0 if it prepares none or full-size
    images (no estimate): how far a job's lookahead reaches."""
    sizes = [3 * _area(d.image_size) for d, _ in plan.prepared if d.image_size is not None]
    if not sizes or len(sizes) < len(plan.prepared):
        return 0
    return values_that_fit(capacity, max(sizes))


def batch_bytes(plan: Plan, rows: int) -> int | None:
    """The bytes of a batch of ``rows`` rows of ``plan``'s prepared values (an aspect-kept
    decode estimated); None where a column is decoded at full size (no estimate)."""
    sizes = [d.image_size for d, _ in plan.prepared]
    if any(s is None for s in sizes):
        return None
    return rows * sum(3 * _area(s) for s in sizes)


def default_prefetch(workers: int, batch_size: int, plan: Plan | int | None) -> int:
    """The batches a job prepares ahead, per rank, unless it says: a few decode tasks per
    worker in flight (measured: 2 left 16 decode processes 25% idle, waiting for the last
    group of each batch), and for batches of small images (``plan``'s, or their bytes) at
    least ``PREFETCH_BYTES`` of them, up to ``PREFETCH_MAX`` batches: there a batch's
    hand-offs between threads and processes, not its decodes, set the pace (measured on
    400,000 tiny JPEGs, batches of 256 at 16x16, one job: 30,600 rows/s with 2 batches ahead,
    43,600 with 4, 47,400 with 8)."""
    ahead = max(2, -(-4 * workers * MIN_PROCESS_ROWS // batch_size))
    one = plan if isinstance(plan, int) or plan is None else batch_bytes(plan, batch_size)
    if one:
        ahead = max(ahead, min(PREFETCH_MAX, -(-PREFETCH_BYTES // one)))
    return ahead
