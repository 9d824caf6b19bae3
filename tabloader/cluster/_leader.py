"""The cluster leader: one dependent sampler per dataset, rows placed on nodes, in rounds.

The leader holds every job of a catalog that runs on the cluster (its rows, from the
catalog's bitmap; the node of each of its ranks; its batch size) and one
:class:`~tabloader.sampling.DependentSampler` per dataset version. A *step* samples one round
of up to ``round_rows`` rows for every job of a dataset whose outstanding rows (placed and
not yet acknowledged) are below ``lookahead``, places them on the jobs' ranks
(:mod:`tabloader.cluster._placement`) and appends, per node, one :class:`WorkList`: for each
rank on the node, its rows in order and each row's global round number (the node's cache
evicts by next use).

Each node's loader pulls its lists (:meth:`Leader.work`) and acknowledges them in order
(:meth:`Leader.ack`) once their rows are delivered to the ranks. Lookahead is the
back-pressure: a job whose rows are not acknowledged stops being sampled, and only it.

Checkpoint (:meth:`Leader.state_dict`): per job, every epoch not yet complete with the rows
still owed (not acknowledged: sampled or not) and the rows each rank already got. A leader
restored from it (:meth:`Leader.from_state_dict`) resamples exactly the owed rows: each job
still sees each row once per epoch, and its ranks still end the epoch with equal counts. Rows
handed out and not acknowledged are sampled again, so a node's loader must drop the lists it
had not acknowledged when the leader restarts (the lists carry the leader's ``generation``).
Rounds never straddle an epoch: a job's rows of one step all belong to one epoch.

Weighted jobs (static ``weight``, ``importance = 'loss'``): the leader's sampler draws them as
a local one does (it gets the job's stored weights, and the losses its ranks report), and each
row of an assignment carries its batch weight ``_weight`` (``row_weights`` asked as the rows are
sampled: the epoch's distribution is the sampler's then), which the node queues with the row.
A job drawing with replacement owes *draws*, not rows: its checkpoint keeps how many (the draws
placed and not acknowledged, and those not sampled yet), and a restored leader draws that many
from the job's distribution (the weights are in the checkpoint, an importance job's scores too:
its restored epoch draws the rest from the scores as checkpointed, reports of the epoch so far
included, where the leader before drew the whole epoch from the scores at the epoch's start).

Membership (what the node loaders report; :mod:`tabloader.cluster._membership`): each rank joins
(:meth:`join`) from its node and the job starts once all its ranks have joined (DDP's
rendezvous). A rank that leaves (:meth:`leave`) normally loses its share (as a local rank does);
one that failed takes its job off the leader, and the job is listed as *gone* (:meth:`poll`) so
that its other ranks, on every node, fail with the reason instead of waiting. A node that leaves
the cluster (:meth:`remove_node`) takes the jobs with a rank on it; the others go on.
:meth:`acked` lets a node that lost an acknowledgement's answer (the leader restarted) tell
whether it took effect.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, NotRequired, TypedDict

import numpy as np
import numpy.typing as npt
from pyroaring import BitMap

from tabloader.catalog._bitmaps import bitmap_from_array, bitmap_to_array
from tabloader.catalog._errors import SamplingError
from tabloader.catalog._options import JobSpec
from tabloader.cluster._membership import Joining, Membership
from tabloader.cluster._placement import DROPPED, Placer
from tabloader.sampling import DependentSampler
from tabloader.sampling._importance import ImportanceScores

if TYPE_CHECKING:
    from tabloader.catalog import Job

__all__ = [
    "Assignment",
    "JobStatus",
    "Leader",
    "LeaderOptions",
    "LeaderState",
    "LeaderStatus",
    "NodeStats",
    "WorkList",
]

logger = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]


class Assignment(NamedTuple):
    """Rows of one epoch of a job for one of its ranks, in the order the rank reads them."""

    job: str
    rank: int
    epoch: int
    rows: IntArray
    rounds: IntArray  # each row's global round number: when it is used (eviction by next use)
    weights: npt.NDArray[np.float32] | None = None  # a weighted job's ``_weight`` of each row


@dataclass(frozen=True)
class WorkList:
    """What one node's ranks read from one leader step.

    Attributes:
        node: the node id.
        seq: the leader step that made it (increasing per node; acknowledge in order).
        generation: the leader incarnation (a restored leader has a larger one).
        items: one entry per (job, rank) on the node that got rows in the step.
    """

    node: str
    seq: int
    generation: int
    items: tuple[Assignment, ...]

    @property
    def num_rows(self) -> int:
        """Rows in the list, over all its ranks."""
        return sum(a.rows.size for a in self.items)


class CacheCounts(TypedDict):
    """A node loader's cache counters."""

    entries: int
    hits: int
    misses: int
    evictions: int


class NodeJobCounts(TypedDict):
    """A job's counters on a node (those its loader has)."""

    epoch: int
    rows: int
    batches: int
    wait_s: float


class NodeStats(TypedDict):
    """What a node reports of its loader with each poll (``node.node_stats``); ``storage``:
    bytes from the bucket, the node's tier and its peers (``Loader.stats()["storage"]``)."""

    reads: int
    decodes: int
    cache: CacheCounts
    jobs: dict[str, NodeJobCounts]
    clients: int
    storage: NotRequired[dict[str, Any]]


class JobStatus(TypedDict):
    """A running job in the leader's status."""

    job: str
    dataset: str
    epoch: int
    last_epoch: int | None  # None: no end
    ranks: list[str]  # each rank's node
    outstanding: int  # rows placed and not acknowledged
    left: list[int]  # ranks that left normally


class LeaderStatus(TypedDict):
    """``Leader.status()``: jobs, jobs waiting for ranks (ranks joined), jobs gone (their
    reasons), and each node's loader counters as it last reported them."""

    generation: int
    jobs: list[JobStatus]
    pending: dict[str, int]
    gone: dict[str, str]
    nodes: dict[str, NodeStats]


class LeaderOptions(TypedDict, total=False):
    """A :class:`Leader`'s options (its constructor's)."""

    seed: int
    lookahead: int
    round_rows: int
    slack: int | None


class EpochState(TypedDict):
    """An epoch of a job not complete, in the leader's checkpoint."""

    epoch: int
    remaining: bytes  # a serialized bitmap
    counts: list[int]  # rows done per rank


class JobState(TypedDict):
    """A job in the leader's checkpoint."""

    name: str
    dataset: str
    nodes: list[str]
    batch_size: int
    left: list[int]
    last_epoch: int | None
    ids: bytes  # a serialized bitmap
    spec: Mapping[str, object] | None  # JobSpec.to_wire()
    weights: bytes | None  # float64
    importance: Mapping[str, object] | None  # ImportanceScores.state_dict()
    epoch: int  # the epoch that starts next when no epoch is owed
    epochs: list[EpochState]


class LeaderState(TypedDict):
    """``Leader.state_dict()``: the leader's checkpoint, as plain values."""

    kind: str  # "leader"
    version: int
    seed: int
    generation: int
    lookahead: int
    round_rows: int
    slack: int | None
    gone: dict[str, str]
    jobs: list[JobState]


@dataclass
class _EpochPart:
    """A job's epoch that is not complete: owed rows (restored, not yet started) and counts."""

    epoch: int
    remaining: BitMap
    counts: list[int]


@dataclass
class _Job:
    name: str
    ids: BitMap
    group: str
    nodes: tuple[str, ...]
    batch_size: int
    epoch: int
    left: int  # rows of ``epoch`` not sampled yet
    outstanding: int = 0  # rows placed and not acknowledged, all epochs
    last_epoch: int | None = None  # the job reads epochs up to this one (None: no end)
    done: dict[int, IntArray] = field(default_factory=dict)  # epoch -> rows acked per rank
    later: list[_EpochPart] = field(default_factory=list)  # restored epochs after ``epoch``
    spec: JobSpec | None = None  # the options its ranks opened it with (its sampler's)
    weights: npt.NDArray[np.float64] | None = None  # static weights, aligned with ``ids``
    draws: bool = False  # weighted with replacement: an epoch is ``len(ids)`` draws, not rows


class Leader:
    """Samples for every job, places rows on nodes and hands each node its work lists.

    Args:
        seed: seed of the samplers (each dataset's sampler derives its own).
        lookahead: rows per job sampled ahead of the acknowledgements.
        round_rows: rows per job and step (at most).
        slack: how far (rows) a rank may run ahead of its job's others within an epoch;
            default the job's batch size.

    Example:
        >>> from pyroaring import BitMap
        >>> leader = Leader(seed=0, lookahead=8, round_rows=4)
        >>> leader.add_job("a", BitMap(range(8)), nodes=["n0", "n1"], batch_size=2)
        >>> lists = leader.work("n0")
        >>> sum(w.num_rows for w in lists), sum(w.num_rows for w in leader.work("n1"))
        (4, 4)
        >>> leader.ack("n0", lists[-1].seq)
    """

    STATE_VERSION = 1

    def __init__(
        self,
        *,
        seed: int = 0,
        lookahead: int = 4096,
        round_rows: int = 256,
        slack: int | None = None,
        generation: int = 0,
    ) -> None:
        if lookahead < 1 or round_rows < 1:
            raise SamplingError(
                f"lookahead ({lookahead}) and round_rows ({round_rows}) must be >= 1."
            )
        self.seed = seed
        self.lookahead = lookahead
        self.round_rows = round_rows
        self.slack = slack
        self.generation = generation
        self._jobs: dict[str, _Job] = {}
        self._samplers: dict[str, DependentSampler] = {}
        self._placers: dict[str, Placer] = {}
        self._lists: dict[str, list[WorkList]] = {}  # node -> lists not acknowledged
        self._fetched: dict[str, int] = {}  # node -> highest seq handed out
        self._seq = 0
        self._round = 0
        self._members = Membership()  # ranks joining, left, and jobs gone
        self._node_stats: dict[str, NodeStats] = {}  # node -> its loader's counters

    # ------------------------------------------------------------------ jobs
    def add_job(
        self,
        name: str,
        ids: BitMap,
        *,
        nodes: Sequence[str],
        batch_size: int,
        dataset: str = "",
        spec: JobSpec | None = None,
        weights: npt.NDArray[np.float64] | None = None,
    ) -> None:
        """Register ``name``: its rows, the node of each of its ranks and its batch size
        (``spec``: its options, which the sampler reads: ``importance`` for ``report``,
        ``replacement``; ``weights``: a weighted job's, one per row of ``ids`` ascending).

        Jobs of the same ``dataset`` (a dataset version: rows with the same id are the same
        row) share one sampler; jobs of different datasets never share rows.

        Raises:
            SamplingError: the name is taken, ``ids`` is empty, no ranks, or bad weights.
        """
        self._add(
            name,
            ids,
            nodes=nodes,
            batch_size=batch_size,
            dataset=dataset,
            parts=[],
            spec=spec,
            weights=weights,
        )

    def add_catalog_job(self, job: Job, *, nodes: Sequence[str], batch_size: int) -> None:
        """:meth:`add_job` for a catalog :class:`~catalog.Job` (its rows, dataset version,
        options and stored weights)."""
        self.add_job(
            job.name,
            job.ids,
            nodes=nodes,
            batch_size=batch_size,
            dataset=f"{job.dataset}@{job.dataset_version}",
            spec=JobSpec.from_options(job.options),
            weights=job.weights,
        )

    def _add(
        self,
        name: str,
        ids: BitMap,
        *,
        nodes: Sequence[str],
        batch_size: int,
        dataset: str,
        parts: list[_EpochPart],
        epoch: int = 0,
        spec: JobSpec | None = None,
        scores: ImportanceScores | None = None,
        weights: npt.NDArray[np.float64] | None = None,
    ) -> None:
        if name in self._jobs:
            raise SamplingError(f"Job {name!r} is already on the leader; remove_job() it first.")
        if not nodes:
            raise SamplingError(f"Job {name!r} has no ranks; give the node of each rank.")
        sampler = self._samplers.get(dataset)
        if sampler is None:
            seed = [self.seed, self.generation, len(self._samplers)]
            sampler = self._samplers[dataset] = DependentSampler(
                seed=int(np.random.SeedSequence(seed).generate_state(1)[0])
            )
            self._placers[dataset] = Placer(slack=self.slack)
        first = parts.pop(0) if parts else _EpochPart(epoch, ids, [0] * len(nodes))
        sampler.add_job(
            name,
            ids,
            spec,
            remaining=first.remaining,
            epoch=first.epoch,
            weights=weights,
            scores=scores,
        )
        self._placers[dataset].add_job(
            name,
            size=len(ids),
            nodes=nodes,
            batch_size=batch_size,
            counts=first.counts,
            seen=len(ids) - len(first.remaining),
        )
        job = _Job(
            name=name,
            ids=ids,
            group=dataset,
            nodes=tuple(nodes),
            batch_size=batch_size,
            epoch=first.epoch,
            left=len(first.remaining),
            later=parts,
            spec=spec,
            weights=weights,
            draws=sampler.weighted(name) and (spec is None or spec.replacement),
        )
        job.done[first.epoch] = np.asarray(first.counts, dtype=np.int64)
        self._jobs[name] = job
        for node in nodes:
            self._lists.setdefault(node, [])
            self._fetched.setdefault(node, -1)
        logger.debug("leader: job %s with %d rows on %s", name, len(ids), ",".join(nodes))

    def remove_job(self, name: str) -> None:
        """Unregister ``name``: its rows leave the sampler and the work lists not acknowledged."""
        job = self._job(name)
        self._samplers[job.group].remove_job(name)
        self._placers[job.group].remove_job(name)
        del self._jobs[name]
        self._members.ended(name)
        for node, lists in self._lists.items():
            self._lists[node] = [
                WorkList(w.node, w.seq, w.generation, tuple(a for a in w.items if a.job != name))
                for w in lists
            ]

    def jobs(self) -> list[str]:
        """The jobs on the leader, in registration order."""
        return list(self._jobs)

    def nodes(self) -> list[str]:
        """Every node that runs a rank of some job, sorted."""
        return sorted({n for job in self._jobs.values() for n in job.nodes})

    def report(self, name: str, ids: IntArray, losses: npt.NDArray[np.float64]) -> None:
        """A rank of ``name`` scored rows by their losses (``importance = 'loss'``): to the
        sampler of the job's dataset (``DependentSampler.report``).

        Raises:
            SamplingError: an unknown job, one without ``importance = 'loss'``, or rows not
                of the job.
        """
        job = self._job(name)
        self._samplers[job.group].report(name, ids, losses)

    def epoch(self, name: str) -> int:
        """The epoch ``name`` is sampling now."""
        return self._job(name).epoch

    def _job(self, name: str) -> _Job:
        job = self._jobs.get(name)
        if job is None:
            known = ", ".join(repr(j) for j in self._jobs) or "none"
            raise SamplingError(f"Unknown job {name!r} on the leader; jobs: {known}.")
        return job

    # ------------------------------------------------------------------ membership
    def join(
        self,
        name: str,
        *,
        rank: int,
        world_size: int,
        node: str,
        spec: Mapping[str, Any],
        ids: BitMap,
        dataset: str = "",
        epochs: int | None = None,
        weights: npt.NDArray[np.float64] | None = None,
    ) -> bool:
        """Rank ``rank`` of job ``name`` reads on ``node``, opened with the job options
        ``spec`` (``JobSpec.to_wire()``); True once every rank has joined (the job is then
        sampled, :meth:`add_job`; ``epochs``: it reads that many, then the leader samples no
        more for it; ``weights``: a weighted job's stored weights, ``Job.weights``).

        Raises:
            SamplingError: the rank joined already, the ranks disagree (world size, job
                options, rows, weights), or bad weights. OptionError: ``spec`` is not a job
                spec of this version.
        """
        if name in self._jobs:
            raise SamplingError(
                f"Job {name!r} runs on the cluster already (all {len(self._jobs[name].nodes)} "
                f"ranks joined); rank {rank} cannot join it again: stop every rank and start "
                "them all again."
            )
        spec_ = JobSpec.from_wire(spec)
        joined = self._members.join(
            Joining(name, rank, world_size, node, spec_, ids, dataset, epochs, weights)
        )
        if joined is None:
            return False
        nodes = [joined.nodes[r] for r in range(world_size)]
        self.add_job(
            name,
            joined.ids,
            nodes=nodes,
            batch_size=joined.batch_size,
            dataset=dataset,
            spec=joined.spec,
            weights=joined.weights,
        )
        if epochs is not None:
            self._jobs[name].last_epoch = epochs - 1
        return True

    def leave(self, name: str, *, rank: int, failed: bool = False, reason: str = "") -> None:
        """Rank ``rank`` of ``name`` is gone: normally (its share of the epoch is dropped; the
        job ends with its last rank) or ``failed`` (the job leaves and its other ranks fail
        with ``reason``). Unknown jobs are ignored (the job ended already)."""
        job = self._jobs.get(name)
        ranks = None if job is None else len(job.nodes)
        if self._members.leave(name, rank=rank, ranks=ranks, failed=failed, reason=reason):
            self.remove_job(name)

    def remove_node(self, node: str, reason: str = "") -> list[str]:
        """``node`` left the cluster: every job with a rank on it leaves (listed as gone with
        ``reason``); the others go on. Returns the jobs taken off."""
        why = reason or f"node {node} left the cluster"
        names = [n for n, j in self._jobs.items() if node in j.nodes]
        names += self._members.pending_on(node)
        for name in names:
            self.leave(name, rank=-1, failed=True, reason=why)
        self._lists.pop(node, None)
        self._fetched.pop(node, None)
        self._node_stats.pop(node, None)
        return names

    def poll(
        self, node: str, stats: NodeStats | None = None
    ) -> tuple[list[WorkList], dict[str, str]]:
        """What a node's loader asks, in one call: its new work lists (:meth:`work`; none if
        no job has a rank on it yet) and the jobs gone with their reasons. ``stats``: the
        node's loader counters, kept for :meth:`status`."""
        if stats is not None:
            self._node_stats[node] = stats
        lists = self.work(node) if node in self._lists else []
        return lists, dict(self._members.gone)

    def acked(self, node: str) -> dict[tuple[str, int, int], int]:
        """Rows acknowledged per ``(job, rank, epoch)`` for the ranks on ``node``."""
        out = {}
        for job in self._jobs.values():
            for epoch, counts in job.done.items():
                for rank, n in enumerate(job.nodes):
                    if n == node:
                        out[(job.name, rank, epoch)] = int(counts[rank])
        return out

    def status(self) -> LeaderStatus:
        """Jobs (epoch, the last epoch it reads (None: no end), ranks and their nodes, rows
        ``outstanding``: placed and not acknowledged), jobs waiting for ranks, jobs gone, and
        each node's loader counters as it last reported them."""
        return {
            "generation": self.generation,
            "jobs": [
                {
                    "job": j.name,
                    "dataset": j.group,
                    "epoch": j.epoch,
                    "last_epoch": j.last_epoch,
                    "ranks": list(j.nodes),
                    "outstanding": j.outstanding,
                    "left": sorted(self._members.left.get(j.name, ())),
                }
                for j in self._jobs.values()
            ],
            "pending": {n: len(p.nodes) for n, p in self._members.pending.items()},
            "gone": dict(self._members.gone),
            "nodes": dict(self._node_stats),
        }

    # ------------------------------------------------------------------ rounds
    def step(self) -> bool:
        """One round for every job below its lookahead; False if no job could take part."""
        any_sampled = False
        for group, sampler in self._samplers.items():
            want = [
                j
                for j in self._jobs.values()
                if j.group == group
                and j.outstanding < self.lookahead
                and not (j.left == 0 and j.last_epoch is not None and j.epoch >= j.last_epoch)
            ]
            if want:
                self._step_group(sampler, self._placers[group], want)
                any_sampled = True
        if any_sampled:
            self._seq += 1
        return any_sampled

    def _start_epoch(self, job: _Job, sampler: DependentSampler, placer: Placer) -> None:
        if job.later:
            part = job.later.pop(0)
            scores = sampler.importance_scores(job.name)  # kept across the re-add
            sampler.remove_job(job.name)
            sampler.add_job(
                job.name,
                job.ids,
                job.spec,
                remaining=part.remaining,
                epoch=part.epoch,
                weights=job.weights,
                scores=scores,
            )
            placer.remove_job(job.name)
            placer.add_job(
                job.name,
                size=len(job.ids),
                nodes=job.nodes,
                batch_size=job.batch_size,
                counts=part.counts,
                seen=len(job.ids) - len(part.remaining),
            )
            job.epoch, job.left = part.epoch, len(part.remaining)
            job.done[part.epoch] = np.asarray(part.counts, dtype=np.int64)
        else:  # the sampler and the placer start the next epoch on their own
            job.epoch += 1
            job.left = len(job.ids)
            job.done[job.epoch] = np.zeros(len(job.nodes), np.int64)

    def _step_group(self, sampler: DependentSampler, placer: Placer, want: list[_Job]) -> None:
        for job in want:
            if job.left == 0:
                self._start_epoch(job, sampler, placer)
        k = min(
            self.round_rows,
            *(j.left for j in want),
            *(self.lookahead - j.outstanding for j in want),
        )
        rows = sampler.sample_many([j.name for j in want], k)
        ranks = placer.place(rows)
        rounds = np.arange(self._round, self._round + k, dtype=np.int64)
        self._round += k
        per_node: dict[str, list[Assignment]] = {}
        for job in want:
            job.left -= k
            r = ranks[job.name]
            # a weighted job's ``_weight``s, from the epoch's distribution the rows came from
            weights = sampler.row_weights(job.name, job.epoch, rows[job.name])
            for rank in np.unique(r[r != DROPPED]).tolist():
                sel = r == rank
                item = Assignment(
                    job.name,
                    rank,
                    job.epoch,
                    rows[job.name][sel],
                    rounds[sel],
                    None if weights is None else weights[sel],
                )
                per_node.setdefault(job.nodes[rank], []).append(item)
                job.outstanding += item.rows.size
        for node, items in per_node.items():
            self._lists[node].append(WorkList(node, self._seq, self.generation, tuple(items)))

    def work(self, node: str) -> list[WorkList]:
        """The lists of ``node`` not handed out yet, sampling rounds until the jobs with a rank
        on ``node`` reach their lookahead (or the node got something and nobody can sample).

        Raises:
            SamplingError: no job has a rank on ``node``.
        """
        if node not in self._lists:
            raise SamplingError(
                f"No job has a rank on node {node!r}; nodes: {', '.join(self.nodes()) or 'none'}."
            )
        mine = [j for j in self._jobs.values() if node in j.nodes]
        while any(j.outstanding < self.lookahead for j in mine) and self.step():
            pass
        fresh = [w for w in self._lists[node] if w.seq > self._fetched[node]]
        if fresh:
            self._fetched[node] = fresh[-1].seq
        return fresh

    def ack(self, node: str, seq: int) -> None:
        """``node`` delivered every row of its lists up to step ``seq`` (inclusive).

        Lists not handed out yet (by :meth:`work`) are not acknowledged.
        """
        seq = min(seq, self._fetched.get(node, -1))
        lists = self._lists.get(node, [])
        done = [w for w in lists if w.seq <= seq]
        self._lists[node] = [w for w in lists if w.seq > seq]
        for w in done:
            for a in w.items:
                job = self._jobs.get(a.job)
                if job is None:
                    continue
                job.outstanding -= a.rows.size
                counts = job.done.setdefault(a.epoch, np.zeros(len(job.nodes), np.int64))
                counts[a.rank] += a.rows.size

    # ------------------------------------------------------------------ state
    def _parts(self, job: _Job) -> list[_EpochPart]:
        """The job's epochs not complete: rows owed (not acknowledged) and rows done per rank.

        A job that draws with replacement owes draws: ``n`` of them are its first ``n`` ids
        (which ones does not matter: ``add_job(remaining=)`` takes their number)."""
        owed: dict[int, list[IntArray]] = {}
        for lists in self._lists.values():
            for w in lists:
                for a in w.items:
                    if a.job == job.name:
                        owed.setdefault(a.epoch, []).append(a.rows)
        if job.draws:
            if job.left > 0:
                owed.setdefault(job.epoch, []).append(np.empty(job.left, np.int64))
            first = bitmap_to_array(job.ids)
            counts = {e: sum(r.size for r in rows) for e, rows in owed.items()}
            owed = {e: [first[:n]] for e, n in counts.items()}
        parts: dict[int, BitMap] = {
            e: bitmap_from_array(np.concatenate(rows)) for e, rows in owed.items()
        }
        if job.left > 0 and not job.draws:
            rest = self._samplers[job.group].remaining(job.name)
            parts[job.epoch] = parts.get(job.epoch, BitMap()) | rest
        out = [
            _EpochPart(e, rem, job.done.get(e, np.zeros(len(job.nodes), np.int64)).tolist())
            for e, rem in sorted(parts.items())
            if rem
        ]
        out.extend(_EpochPart(p.epoch, BitMap(p.remaining), list(p.counts)) for p in job.later)
        return out

    def _scores_state(self, job: _Job) -> Mapping[str, object] | None:
        """An importance job's scores for the checkpoint (None: not one)."""
        scores = self._samplers[job.group].importance_scores(job.name)
        return None if scores is None else scores.state_dict()

    def state_dict(self) -> LeaderState:
        """Each job's epochs not complete (rows owed, rows per rank done; draws owed for a job
        with replacement), its options, a weighted job's weights and an importance job's
        scores, as plain values."""
        jobs: list[JobState] = []
        for job in self._jobs.values():
            parts = self._parts(job)
            jobs.append(
                {
                    "name": job.name,
                    "dataset": job.group,
                    "nodes": list(job.nodes),
                    "batch_size": job.batch_size,
                    "left": sorted(self._members.left.get(job.name, ())),
                    "last_epoch": job.last_epoch,
                    "ids": job.ids.serialize(),
                    "spec": None if job.spec is None else job.spec.to_wire(),
                    "weights": None if job.weights is None else job.weights.tobytes(),
                    "importance": self._scores_state(job),
                    # the epoch that starts next when no epoch is owed
                    "epoch": job.epoch + 1 if job.left == 0 else job.epoch,
                    "epochs": [
                        {"epoch": p.epoch, "remaining": p.remaining.serialize(), "counts": p.counts}
                        for p in parts
                    ],
                }
            )
        return {
            "kind": "leader",
            "version": self.STATE_VERSION,
            "seed": self.seed,
            "generation": self.generation,
            "lookahead": self.lookahead,
            "round_rows": self.round_rows,
            "slack": self.slack,
            "gone": dict(self._members.gone),
            "jobs": jobs,
        }

    @classmethod
    def from_state_dict(cls, state: LeaderState) -> Leader:
        """A new leader (next generation) that owes each job exactly what ``state`` says.

        Raises:
            SamplingError: ``state`` is not a leader state.
        """
        if state.get("kind") != "leader" or state.get("version") != cls.STATE_VERSION:
            raise SamplingError(
                f"Not a Leader state (kind={state.get('kind')!r}, "
                f"version={state.get('version')!r}); pass what Leader.state_dict() returned."
            )
        leader = cls(
            seed=int(state["seed"]),
            lookahead=int(state["lookahead"]),
            round_rows=int(state["round_rows"]),
            slack=state["slack"],
            generation=int(state["generation"]) + 1,
        )
        for j in state["jobs"]:
            parts = [
                _EpochPart(int(p["epoch"]), BitMap.deserialize(p["remaining"]), list(p["counts"]))
                for p in j["epochs"]
            ]
            spec, scores, weights = j.get("spec"), j.get("importance"), j.get("weights")
            leader._add(
                j["name"],
                BitMap.deserialize(j["ids"]),
                nodes=j["nodes"],
                batch_size=int(j["batch_size"]),
                dataset=j["dataset"],
                parts=parts,
                epoch=int(j["epoch"]),
                spec=None if spec is None else JobSpec.from_wire(spec),
                scores=None if scores is None else ImportanceScores.from_state(scores),
                weights=None if weights is None else np.frombuffer(weights, np.float64).copy(),
            )
            leader._members.left[j["name"]] = set(j.get("left", ()))
            leader._jobs[j["name"]].last_epoch = j.get("last_epoch")
        leader._members.gone = dict(state.get("gone", {}))
        return leader
