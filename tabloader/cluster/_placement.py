"""Row-to-rank placement: which rank (and so which node) reads each sampled row.

The cluster leader samples rounds for every job of a dataset with the dependent sampler, then
gives every ``(job, row)`` of the round to one of the job's ranks. Two goals pull apart:

* **Sharing.** A row several jobs sampled in one round should be read and decoded on one node
  for all of them, wherever each of those jobs has a rank on that node.
* **Balance.** Every rank of a job gets the same number of rows per epoch (DDP ranks step in
  lockstep), and about the same number at every moment of the epoch.

Preferred node (rendezvous hashing, better than JOADER's double hashing, appendix E.4): for a
row ``x`` of a round and a node ``n``, ``share(x, n)`` counts the jobs that sampled ``x`` in the
round and have a rank on ``n``; a job prefers, among its own nodes, the node with the largest
``(share(x, n), hash(x, n))``. Every job that has a rank on a node common to all the jobs of
``x`` therefore picks the same node (the common node with the largest hash: the key is the same
for every job), and when no node is common the jobs that can meet still meet on the node that
gathers most of them. Jobs alone on a row have no preference worth keeping but follow the hash.
The hash is xxh64 of the node id mixed with the row id (splitmix64), so it is stable across
processes and restarts, and a node joining moves only the rows it now wins.

Capacity: a job of ``W`` ranks, ``n`` rows per epoch and batch size ``B`` (its ``JobSpec``'s)
keeps ``quota = n // (B * W) * B`` rows per rank and epoch and drops the last ``n % (B * W)``
rows in the sampler's order, as the local engine and ``DistributedSampler(drop_last=True)`` do
(with one rank nothing is dropped: ``quota = n``, the last batch is short). After a round that
brings the job's placed rows to ``T``, no rank may hold more than
``min(quota, ceil(T / W) + slack // (W - 1))`` rows, so every rank stays within
``slack + W - 1`` rows of ``T / W`` at each round's end and all hold exactly ``quota`` at the
epoch's end. Rows go to their preferred node while it has room (rows more jobs share first),
then to their next-preferred node, and so on; within a node, to its least-loaded ranks.

Everything runs on arrays: the Python loops are over jobs, nodes and preference levels, never
over rows.

Example:
    >>> import numpy as np
    >>> from tabloader.catalog import JobSpec
    >>> p, spec = Placer(), JobSpec({"batch_size": 2})
    >>> p.add_job("a", size=8, nodes=["n0", "n1"], spec=spec)
    >>> p.add_job("b", size=8, nodes=["n1"], spec=spec)
    >>> rows = np.arange(8)
    >>> out = p.place({"a": rows, "b": rows})
    >>> np.bincount(out["a"], minlength=2).tolist()  # equal rows per rank
    [4, 4]
    >>> p.node_of("a", out["a"]).tolist().count("n1") >= 4
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt
import xxhash

from tabloader.catalog._errors import SamplingError
from tabloader.catalog._options import JobSpec
from tabloader.engine._queue.ranks import rank_share

DROPPED = -1
"""The rank of a row that no rank reads: an epoch's remainder (see the module docstring)."""

_SHARE_SHIFT = np.uint64(56)  # share count in the top byte, hash below
_MAX_SHARE = 255

IntArray = npt.NDArray[np.int64]


def node_key(node: str) -> int:
    """A node's stable 64-bit hash key (xxh64 of its id)."""
    return int(xxhash.xxh64_intdigest(node.encode()))


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finalizer: a bijection of uint64 that scrambles every bit."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _scores(rows: npt.NDArray[Any], keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """``hash(row, node)`` for every row and node: a ``(len(rows), len(keys))`` array."""
    r = _mix(np.asarray(rows).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    return _mix(r[:, None] ^ keys[None, :])


def preferred_nodes(
    rows: Mapping[str, npt.NDArray[Any]], nodes: Mapping[str, Sequence[str]]
) -> tuple[list[str], dict[str, npt.NDArray[np.uint64]]]:
    """Every job's node preference keys for its rows of one round (no capacity).

    Args:
        rows: per job, its row ids of the round.
        nodes: per job, the node of each of its ranks.

    Returns:
        The job-independent node list (sorted) and, per job, a ``(len(rows), len(job
        nodes))`` array of keys over the job's distinct nodes in sorted order: the larger,
        the more preferred (``share`` in the top byte, the rendezvous hash below).
    """
    names = list(rows)
    all_nodes = sorted({n for name in names for n in nodes[name]})
    col = {n: i for i, n in enumerate(all_nodes)}
    keys = np.array([node_key(n) for n in all_nodes], dtype=np.uint64)
    arrays = [np.asarray(rows[name], dtype=np.int64) for name in names]
    if not arrays or not all_nodes:
        return all_nodes, {
            name: np.zeros((a.size, 0), np.uint64) for name, a in zip(names, arrays, strict=True)
        }
    uniq, inverse = np.unique(np.concatenate(arrays), return_inverse=True)
    inverse = inverse.reshape(-1)
    has = np.zeros((len(names), len(all_nodes)), dtype=np.int32)  # job x node: has a rank
    member = np.zeros((uniq.size, len(names)), dtype=np.int32)  # row x job: sampled it
    inv_of: list[IntArray] = []
    start = 0
    for j, (name, a) in enumerate(zip(names, arrays, strict=True)):
        has[j, [col[n] for n in set(nodes[name])]] = 1
        inv = inverse[start : start + a.size]
        start += a.size
        member[inv, j] = 1
        inv_of.append(inv)
    share = np.minimum(member @ has, _MAX_SHARE).astype(np.uint64)
    key = (share << _SHARE_SHIFT) | (_scores(uniq, keys) >> np.uint64(8))
    out: dict[str, npt.NDArray[np.uint64]] = {}
    for j, name in enumerate(names):
        own = np.flatnonzero(has[j])  # sorted, so the job's node order is sorted too
        out[name] = key[np.ix_(inv_of[j], own)]
    return all_nodes, out


class PlacementState(TypedDict):
    """A job's placement in its epoch, as plain values (``JobPlacement.state_dict``)."""

    counts: list[int]  # rows placed on each rank
    seen: int  # rows of the epoch placed or dropped


@dataclass
class JobPlacement:
    """One job's ranks and its placement progress in the current epoch.

    Attributes:
        size: rows per epoch (the job's id count).
        nodes: the node of each rank (``len(nodes)`` is the world size).
        spec: the job's options (its batch size and ``drop_last``).
        slack: how far (in rows) a rank may run ahead of the others within an epoch.
        counts: rows placed on each rank this epoch.
        seen: rows of this epoch placed or dropped so far.
    """

    size: int
    nodes: tuple[str, ...]
    spec: JobSpec
    slack: int
    counts: IntArray = field(default_factory=lambda: np.zeros(0, np.int64))
    seen: int = 0

    def __post_init__(self) -> None:
        if not self.counts.size:
            self.counts = np.zeros(len(self.nodes), np.int64)

    @property
    def world_size(self) -> int:
        """Ranks of the job."""
        return len(self.nodes)

    @property
    def batch_size(self) -> int:
        """Rows per batch."""
        return int(self.spec.batch_size)

    @property
    def quota(self) -> int:
        """Rows each rank gets per epoch."""
        return rank_share(self.size, self.batch_size, self.world_size, self.spec.drop_last)

    @property
    def placed(self) -> int:
        """Rows of this epoch given to a rank so far."""
        return int(self.counts.sum())

    def cap(self, total: int) -> int:
        """The most rows a rank may hold once the job has placed ``total`` rows this epoch."""
        w = self.world_size
        if w == 1:
            return self.quota
        return min(self.quota, -(-total // w) + self.slack // (w - 1))

    def distinct_nodes(self) -> list[str]:
        """The job's nodes, sorted (the column order of :func:`preferred_nodes`)."""
        return sorted(set(self.nodes))

    def state_dict(self) -> PlacementState:
        """The progress of the epoch as plain values."""
        return {"counts": self.counts.tolist(), "seen": self.seen}


class Placer:
    """Places each round's rows of a dataset's jobs on the jobs' ranks.

    Args:
        slack: how far (rows) a rank may run ahead of the others within an epoch; default
            each job's batch size.
    """

    def __init__(self, *, slack: int | None = None) -> None:
        self.slack = slack
        self.jobs: dict[str, JobPlacement] = {}

    def add_job(
        self,
        name: str,
        *,
        size: int,
        nodes: Sequence[str],
        spec: JobSpec,
        counts: Sequence[int] | None = None,
        seen: int = 0,
    ) -> None:
        """Register ``name`` with ``size`` rows per epoch, one rank per entry of ``nodes`` and
        the options ``spec`` (its batch size and ``drop_last``).

        ``counts`` and ``seen`` resume an epoch (rows already placed on each rank, rows
        already placed or dropped).

        Raises:
            SamplingError: no ranks, a bad batch size, or ``counts`` not one per rank.
        """
        if not nodes:
            raise SamplingError(f"Job {name!r} has no ranks; give the node of each rank.")
        if size < 1:
            raise SamplingError(f"Job {name!r}: size ({size}) must be >= 1.")
        if not spec.drop_last:
            raise SamplingError(
                f"Job {name!r}: drop_last = false (padded epochs) is not supported on a Ray "
                "cluster yet; open it there with drop_last = true (the default)."
            )
        job = JobPlacement(
            size=size,
            nodes=tuple(nodes),
            spec=spec,
            slack=int(spec.batch_size) if self.slack is None else self.slack,
            seen=seen,
        )
        if counts is not None:
            if len(counts) != len(nodes):
                raise SamplingError(
                    f"Job {name!r}: {len(counts)} rank counts for {len(nodes)} ranks."
                )
            job.counts = np.asarray(counts, dtype=np.int64).copy()
        self.jobs[name] = job

    def remove_job(self, name: str) -> None:
        """Forget ``name``."""
        del self.jobs[name]

    def node_of(self, name: str, ranks: IntArray) -> npt.NDArray[np.str_]:
        """The node of each rank in ``ranks`` (``''`` for dropped rows)."""
        table = np.array([*self.jobs[name].nodes, ""])
        return table[np.asarray(ranks)]

    def place(self, rows: Mapping[str, npt.NDArray[Any]]) -> dict[str, IntArray]:
        """Place one round: per job, the rank of each of its rows (:data:`DROPPED`: none).

        A job's rows of one call must not run past the end of its epoch (cut calls at epoch
        ends, as the leader does); the next call after an epoch's last row starts the next
        epoch.

        Raises:
            SamplingError: an unknown job, or more rows than the job's epoch has left.
        """
        for name, r in rows.items():
            job = self.jobs.get(name)
            if job is None:
                raise SamplingError(f"Unknown job {name!r}; add_job() it first.")
            if job.seen == job.size:
                job.counts[:] = 0
                job.seen = 0
            if np.asarray(r).size > job.size - job.seen:
                raise SamplingError(
                    f"Job {name!r} has {job.size - job.seen} rows left in its epoch and the "
                    f"round has {np.asarray(r).size}; cut rounds at epoch ends."
                )
        _, prefs = preferred_nodes(rows, {name: self.jobs[name].nodes for name in rows})
        return {name: self._place_job(self.jobs[name], prefs[name]) for name in rows}

    @staticmethod
    def _place_job(job: JobPlacement, pref: npt.NDArray[np.uint64]) -> IntArray:
        k = pref.shape[0]
        out = np.full(k, DROPPED, dtype=np.int64)
        keep = min(k, job.quota * job.world_size - job.placed)
        job.seen += k
        if keep <= 0:
            return out
        pref = pref[:keep]
        node_names = job.distinct_nodes()
        node_col = {n: i for i, n in enumerate(node_names)}
        rank_node = np.array([node_col[n] for n in job.nodes], dtype=np.int64)
        cap = job.cap(job.placed + keep)
        rank_room = cap - job.counts
        node_room = np.bincount(rank_node, weights=rank_room, minlength=len(node_names))
        node_of_row = _fill_nodes(pref, node_room.astype(np.int64))
        ranks = _fill_ranks(node_of_row, rank_node, job.counts, rank_room)
        job.counts += np.bincount(ranks, minlength=job.world_size)
        out[:keep] = ranks
        return out


def _fill_nodes(pref: npt.NDArray[np.uint64], room: IntArray) -> IntArray:
    """Each row's node: its most preferred one with room, rows with a larger key first.

    ``sum(room) >= len(pref)``, so every row finds a node by the last preference level (a row
    turned away everywhere would mean every node filled up, by other rows: more than
    ``sum(room)`` rows).
    """
    k, m = pref.shape
    room = room.copy()
    out = np.full(k, -1, dtype=np.int64)
    order = np.argsort(pref, axis=1)[:, ::-1]  # node columns, most preferred first
    for level in range(m):
        todo = np.flatnonzero(out < 0)
        if not todo.size:
            break
        cand = order[todo, level]
        prio = pref[todo, cand] >> _SHARE_SHIFT  # shared rows take the room first
        by = np.lexsort((todo, -prio.astype(np.int64), cand))
        sc = cand[by]
        within = np.arange(sc.size) - np.searchsorted(sc, sc, side="left")
        ok = within < room[sc]
        out[todo[by[ok]]] = sc[ok]
        room -= np.bincount(sc[ok], minlength=m)
    assert (out >= 0).all(), "node capacity below the rows to place"
    return out


def _fill_ranks(
    node_of_row: IntArray, rank_node: IntArray, counts: IntArray, rank_room: IntArray
) -> IntArray:
    """Deal each node's rows to its ranks, least-loaded first (interleaved, in row order)."""
    w = rank_node.size
    room = np.maximum(rank_room, 0)
    slot_rank = np.repeat(np.arange(w), room)
    first = np.cumsum(room) - room
    slot_val = counts[slot_rank] + np.arange(slot_rank.size) - np.repeat(first, room)
    slot_node = rank_node[slot_rank]
    slots = np.lexsort((slot_rank, slot_val, slot_node))
    starts = np.searchsorted(slot_node[slots], np.arange(int(rank_node.max()) + 1))
    by = np.argsort(node_of_row, kind="stable")
    rn = node_of_row[by]
    within = np.arange(rn.size) - np.searchsorted(rn, rn, side="left")
    ranks = np.empty(node_of_row.size, dtype=np.int64)
    ranks[by] = slot_rank[slots[starts[rn] + within]]
    return ranks
