"""The cluster leader: one dependent sampler per dataset, rows placed on nodes, in rounds.

The leader holds every job of a catalog that runs on the cluster (a
:class:`~tabloader.cluster._jobs.ClusterJob`: the catalog's ``Job``, its rows and stored
weights; the ``JobSpec`` its ranks opened it with, its batch size; the node of each of its
ranks) and one :class:`~tabloader.sampling.DependentSampler` per dataset version. A *step*
samples one round of up to ``round_rows`` rows for every job of a dataset whose outstanding
rows (placed and not yet acknowledged) are below ``lookahead``, places them on the jobs' ranks
(:mod:`tabloader.cluster._placement`) and appends, per node, one ``WorkList``: for each
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
from typing import Any

import numpy as np
import numpy.typing as npt
from pyroaring import BitMap

from tabloader.catalog._bitmaps import bitmap_from_array, bitmap_to_array
from tabloader.catalog._errors import SamplingError
from tabloader.catalog._model import Job
from tabloader.catalog._options import JobSpec
from tabloader.cluster._jobs import (
    Assignment,
    ClusterJob,
    EpochPart,
    IntArray,
    JobCheckpoint,
    Joining,
    LeaderState,
    LeaderStatus,
    NodeStats,
    WorkList,
    dataset_key,
)
from tabloader.cluster._membership import Membership
from tabloader.cluster._placement import DROPPED, Placer
from tabloader.sampling import DependentSampler
from tabloader.sampling._importance import ImportanceScores
from tabloader.service._protocol import job_from_wire, job_to_wire

logger = logging.getLogger(__name__)


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
        >>> from tabloader.catalog import Job
        >>> job = Job("a", "imgs", 1, ("image",), None, {"batch_size": 2}, BitMap(range(8)))
        >>> leader = Leader(seed=0, lookahead=8, round_rows=4)
        >>> leader.add_job(job, nodes=["n0", "n1"])
        >>> lists = leader.work("n0")
        >>> sum(w.num_rows for w in lists), sum(w.num_rows for w in leader.work("n1"))
        (4, 4)
        >>> leader.ack("n0", lists[-1].seq)
    """

    STATE_VERSION = 2  # 2: a job's checkpoint carries its catalog job and its spec

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
        self._jobs: dict[str, ClusterJob] = {}
        self._samplers: dict[str, DependentSampler] = {}
        self._placers: dict[str, Placer] = {}
        self._lists: dict[str, list[WorkList]] = {}  # node -> lists not acknowledged
        self._fetched: dict[str, int] = {}  # node -> highest seq handed out
        self._seq = 0
        self._round = 0
        self._members = Membership()  # ranks joining, left, and jobs gone
        self._node_stats: dict[str, NodeStats] = {}  # node -> its loader's counters

    # ------------------------------------------------------------------ jobs
    def add_job(self, job: Job, *, nodes: Sequence[str], spec: JobSpec | None = None) -> None:
        """Register ``job`` (the catalog's: its rows, dataset version and stored weights) with
        the node of each of its ranks; ``spec``: the options its ranks opened it with, which
        its sampler and placement read (default: the ones it was registered with).

        Jobs of the same dataset version (rows with the same id are the same row) share one
        sampler; jobs of different ones never share rows.

        Raises:
            SamplingError: the name is taken, ``ids`` is empty, no ranks, padded epochs
                (``drop_last = false``), or bad weights.
        """
        spec = JobSpec.from_options(job.options) if spec is None else spec
        self._add(job, spec, nodes=nodes, parts=[])

    def _add(
        self,
        job: Job,
        spec: JobSpec,
        *,
        nodes: Sequence[str],
        parts: list[EpochPart],
        epoch: int = 0,
        scores: ImportanceScores | None = None,
    ) -> None:
        name, ids, dataset = job.name, job.ids, dataset_key(job)
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
        first = parts.pop(0) if parts else EpochPart(epoch, ids, [0] * len(nodes))
        sampler.add_job(
            name,
            ids,
            spec,
            remaining=first.remaining,
            epoch=first.epoch,
            weights=job.weights,
            scores=scores,
        )
        try:
            self._placers[dataset].add_job(
                name,
                size=len(ids),
                nodes=nodes,
                spec=spec,
                counts=first.counts,
                seen=len(ids) - len(first.remaining),
            )
        except BaseException:  # (padded epochs): the sampler forgets it too
            sampler.remove_job(name)
            raise
        running = ClusterJob(job, spec, tuple(nodes), dataset, first.epoch, len(first.remaining))
        running.later = parts
        running.draws = sampler.weighted(name) and spec.replacement
        running.done[first.epoch] = np.asarray(first.counts, dtype=np.int64)
        self._jobs[name] = running
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

    def _job(self, name: str) -> ClusterJob:
        job = self._jobs.get(name)
        if job is None:
            known = ", ".join(repr(j) for j in self._jobs) or "none"
            raise SamplingError(f"Unknown job {name!r} on the leader; jobs: {known}.")
        return job

    # ------------------------------------------------------------------ membership
    def join(
        self,
        job: Job,
        *,
        rank: int,
        world_size: int,
        node: str,
        spec: Mapping[str, Any],
        epochs: int | None = None,
    ) -> bool:
        """Rank ``rank`` of ``job`` (the catalog's, as the rank's node looked it up: its rows
        and stored weights) reads on ``node``, opened with the job options ``spec``
        (``JobSpec.to_wire()``); True once every rank has joined (the job is then sampled,
        :meth:`add_job`; ``epochs``: it reads that many, then the leader samples no more for
        it).

        Raises:
            SamplingError: the rank joined already, the ranks disagree (world size, job
                options, rows, weights), or bad weights. OptionError: ``spec`` is not a job
                spec of this version.
        """
        name = job.name
        if name in self._jobs:
            raise SamplingError(
                f"Job {name!r} runs on the cluster already (all {len(self._jobs[name].nodes)} "
                f"ranks joined); rank {rank} cannot join it again: stop every rank and start "
                "them all again."
            )
        opened = JobSpec.from_wire(spec)
        joined = self._members.join(Joining(job, opened, rank, world_size, node, epochs))
        if joined is None:
            return False
        self.add_job(joined.job, nodes=[joined.nodes[r] for r in range(world_size)], spec=opened)
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

    def _start_epoch(self, job: ClusterJob, sampler: DependentSampler, placer: Placer) -> None:
        if job.later:
            part = job.later.pop(0)
            scores = sampler.importance_scores(job.name)  # kept across the re-add
            sampler.remove_job(job.name)
            sampler.add_job(
                job.name,
                job.job.ids,
                job.spec,
                remaining=part.remaining,
                epoch=part.epoch,
                weights=job.job.weights,
                scores=scores,
            )
            placer.remove_job(job.name)
            placer.add_job(
                job.name,
                size=len(job.job.ids),
                nodes=job.nodes,
                spec=job.spec,
                counts=part.counts,
                seen=len(job.job.ids) - len(part.remaining),
            )
            job.epoch, job.left = part.epoch, len(part.remaining)
            job.done[part.epoch] = np.asarray(part.counts, dtype=np.int64)
        else:  # the sampler and the placer start the next epoch on their own
            job.epoch += 1
            job.left = len(job.job.ids)
            job.done[job.epoch] = np.zeros(len(job.nodes), np.int64)

    def _step_group(
        self, sampler: DependentSampler, placer: Placer, want: list[ClusterJob]
    ) -> None:
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
    def _parts(self, job: ClusterJob) -> list[EpochPart]:
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
            first = bitmap_to_array(job.job.ids)
            counts = {e: sum(r.size for r in rows) for e, rows in owed.items()}
            owed = {e: [first[:n]] for e, n in counts.items()}
        parts: dict[int, BitMap] = {
            e: bitmap_from_array(np.concatenate(rows)) for e, rows in owed.items()
        }
        if job.left > 0 and not job.draws:
            rest = self._samplers[job.group].remaining(job.name)
            parts[job.epoch] = parts.get(job.epoch, BitMap()) | rest
        out = [
            EpochPart(e, rem, job.done.get(e, np.zeros(len(job.nodes), np.int64)).tolist())
            for e, rem in sorted(parts.items())
            if rem
        ]
        out.extend(EpochPart(p.epoch, BitMap(p.remaining), list(p.counts)) for p in job.later)
        return out

    def _scores_state(self, job: ClusterJob) -> Mapping[str, object] | None:
        """An importance job's scores for the checkpoint (None: not one)."""
        scores = self._samplers[job.group].importance_scores(job.name)
        return None if scores is None else scores.state_dict()

    def state_dict(self) -> LeaderState:
        """Each job's epochs not complete (rows owed, rows per rank done; draws owed for a job
        with replacement), its catalog job (with a weighted job's weights) and spec, and an
        importance job's scores, as plain values."""
        jobs: list[JobCheckpoint] = []
        for job in self._jobs.values():
            saved: JobCheckpoint = {
                **job_to_wire(job.job),
                "spec": job.spec.to_wire(),
                "nodes": list(job.nodes),
                "left": sorted(self._members.left.get(job.name, ())),
                "last_epoch": job.last_epoch,
                "importance": self._scores_state(job),
                # the epoch that starts next when no epoch is owed
                "epoch": job.epoch + 1 if job.left == 0 else job.epoch,
                "epochs": [
                    {"epoch": p.epoch, "remaining": p.remaining.serialize(), "counts": p.counts}
                    for p in self._parts(job)
                ],
            }
            jobs.append(saved)
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
            SamplingError: ``state`` is not a leader state (of this version).
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
                EpochPart(int(p["epoch"]), BitMap.deserialize(p["remaining"]), list(p["counts"]))
                for p in j["epochs"]
            ]
            scores = j.get("importance")
            leader._add(
                job_from_wire(j),
                JobSpec.from_wire(j["spec"]),
                nodes=j["nodes"],
                parts=parts,
                epoch=int(j["epoch"]),
                scores=None if scores is None else ImportanceScores.from_state(scores),
            )
            leader._members.left[j["name"]] = set(j.get("left", ()))
            leader._jobs[j["name"]].last_epoch = j.get("last_epoch")
        leader._members.gone = dict(state.get("gone", {}))
        return leader
