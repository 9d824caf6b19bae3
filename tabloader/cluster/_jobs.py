"""The cluster's records of its jobs: one name per concept, each carrying the catalog's ``Job``
and the ``JobSpec`` its ranks opened it with (never a parallel copy of their fields).

* :class:`Joining`: a rank joins its job from a node; :class:`Pending`: a job whose ranks are
  joining (:mod:`tabloader.cluster._membership`).
* :class:`ClusterJob`: a job running on the leader (:mod:`tabloader.cluster._leader`): its
  rows, dataset version and stored weights are its ``Job``'s, its batch size and
  ``drop_last`` its ``JobSpec``'s; beside them, the node of each rank and where its sampling
  stands. :class:`EpochPart`: an epoch of it not complete (restored, or checkpointed).
* :class:`Assignment` and :class:`WorkList`: what the leader hands a node's loader.
* As plain values: what a node reports (:class:`NodeStats`), the leader's status
  (:class:`LeaderStatus`, :class:`JobStatus`), its options (:class:`LeaderOptions`) and its
  checkpoint (:class:`LeaderState`, one :class:`JobCheckpoint` per job, one
  :class:`EpochCheckpoint` per epoch owed).

(The leader's *address record*, the file ``tabloader status`` finds a cluster by, is another
thing: :mod:`tabloader.cluster._record`.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NotRequired, TypedDict

import numpy as np
import numpy.typing as npt
from pyroaring import BitMap

from tabloader.catalog._model import Job
from tabloader.catalog._options import JobSpec
from tabloader.service._protocol import JobWire

IntArray = npt.NDArray[np.int64]


def dataset_key(job: Job) -> str:
    """The dataset version ``job`` reads, as the leader groups jobs (rows with the same id in
    one key are the same row; jobs of one key share a sampler)."""
    return f"{job.dataset}@{job.dataset_version}"


# -- ranks joining ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Joining:
    """Rank ``rank`` of ``world_size`` joins ``job`` (the catalog's, as its node looked it up)
    from ``node``, opened with ``spec``; ``epochs``: the job reads that many."""

    job: Job
    spec: JobSpec
    rank: int
    world_size: int
    node: str
    epochs: int | None = None


@dataclass
class Pending:
    """A job whose ranks are joining: as its first rank joined it, and the node of each rank
    joined so far."""

    job: Job
    spec: JobSpec
    world_size: int
    epochs: int | None = None
    nodes: dict[int, str] = field(default_factory=dict)


# -- a running job -----------------------------------------------------------------------------
@dataclass
class EpochPart:
    """A job's epoch that is not complete: rows owed (restored, not yet started) and rows
    done per rank."""

    epoch: int
    remaining: BitMap
    counts: list[int]


@dataclass
class ClusterJob:
    """A job running on the leader.

    Attributes:
        job: the catalog's job (its rows, dataset version and stored weights).
        spec: the options its ranks opened it with (its batch size, ``drop_last``, what its
            sampler reads).
        nodes: the node of each rank (``len(nodes)`` is the world size).
        group: its dataset version (``dataset_key``): the jobs of one share a sampler.
        epoch: the epoch being sampled; ``left``: rows of it not sampled yet.
        outstanding: rows placed and not acknowledged, all epochs.
        last_epoch: the job reads epochs up to this one (None: no end).
        done: epoch -> rows acknowledged per rank.
        later: restored epochs after ``epoch``.
        draws: weighted with replacement: an epoch is ``len(ids)`` draws, not rows.
    """

    job: Job
    spec: JobSpec
    nodes: tuple[str, ...]
    group: str
    epoch: int
    left: int
    outstanding: int = 0
    last_epoch: int | None = None
    done: dict[int, IntArray] = field(default_factory=dict)
    later: list[EpochPart] = field(default_factory=list)
    draws: bool = False

    @property
    def name(self) -> str:
        return self.job.name


# -- what the leader hands the nodes -----------------------------------------------------------
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


# -- status, as plain values -------------------------------------------------------------------
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
    """A :class:`~tabloader.cluster._leader.Leader`'s options (its constructor's)."""

    seed: int
    lookahead: int
    round_rows: int
    slack: int | None


# -- the checkpoint, as plain values -----------------------------------------------------------
class EpochCheckpoint(TypedDict):
    """An epoch of a job not complete, in the leader's checkpoint."""

    epoch: int
    remaining: bytes  # a serialized bitmap
    counts: list[int]  # rows done per rank


class JobCheckpoint(JobWire):
    """A running job in the leader's checkpoint: its catalog job as a message carries it
    (``job_to_wire``), the spec its ranks opened it with, its ranks and what it is owed."""

    spec: Mapping[str, object]  # JobSpec.to_wire()
    nodes: list[str]
    left: list[int]
    last_epoch: int | None
    importance: Mapping[str, object] | None  # ImportanceScores.state_dict()
    epoch: int  # the epoch that starts next when no epoch is owed
    epochs: list[EpochCheckpoint]


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
    jobs: list[JobCheckpoint]
