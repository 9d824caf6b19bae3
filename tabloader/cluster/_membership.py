"""The leader's membership book: which ranks of each job have joined, left normally, or failed.

A job's ranks join one by one from their nodes (:class:`~tabloader.cluster._jobs.Joining`:
the catalog's ``Job`` and the ``JobSpec`` it opened with); the job starts once all of them have
(DDP's rendezvous), and every rank must join with the same world size, job options and rows
(and stored weights). A rank
that leaves normally loses its share (the job ends with its last rank); one that fails takes
its job off the leader, and the job is listed as *gone*, with the reason, so that its other
ranks, on every node, fail with it instead of waiting. A job that joins again under the name
is no longer gone. The leader (:class:`~tabloader.cluster._leader.Leader`) acts on what this
book answers: it starts and removes the jobs.

Example:
    >>> from pyroaring import BitMap
    >>> from tabloader.catalog import Job, JobSpec
    >>> job = Job("j", "imgs", 1, ("image",), None, {}, BitMap(range(8)))
    >>> book, spec = Membership(), JobSpec({"batch_size": 4})
    >>> book.join(Joining(job, spec, rank=1, world_size=2, node="n1"))
    >>> book.join(Joining(job, spec, rank=0, world_size=2, node="n0")).nodes
    {1: 'n1', 0: 'n0'}
    >>> book.leave("j", rank=0, ranks=2), book.leave("j", rank=1, ranks=2)
    (False, True)
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tabloader.catalog._errors import SamplingError
from tabloader.cluster._jobs import Joining, Pending


class Membership:
    """Jobs whose ranks are joining, ranks of running jobs that left, and jobs gone."""

    def __init__(self) -> None:
        self.pending: dict[str, Pending] = {}  # jobs waiting for ranks to join
        self.left: dict[str, set[int]] = {}  # running job -> ranks that left normally
        self.gone: dict[str, str] = {}  # jobs taken off because a rank or node failed

    def join(self, joining: Joining) -> Pending | None:
        """A rank joins its job; the job's ranks once every rank has joined (the job then
        runs), else None.

        Raises:
            SamplingError: the rank joined already, or the ranks disagree (world size, job
                options, rows, weights).
        """
        job, rank, world_size = joining.job, joining.rank, joining.world_size
        name, ids = job.name, job.ids
        self.gone.pop(name, None)
        pending = self.pending.setdefault(
            name, Pending(job, joining.spec, world_size, joining.epochs)
        )
        mine = {"world_size": pending.world_size, **pending.spec.resolved()}
        theirs = {"world_size": world_size, **joining.spec.resolved()}
        differ = [f"{k}={theirs[k]!r} (others: {v!r})" for k, v in mine.items() if theirs[k] != v]
        if ids != pending.job.ids:
            differ.append(f"{len(ids)} rows (others: {len(pending.job.ids)}, or other rows)")
        if not _same(job.weights, pending.job.weights):
            differ.append("other row weights (the job was registered again meanwhile?)")
        if differ:
            raise SamplingError(
                f"Rank {rank} of job {name!r} joined with {', '.join(differ)}: every rank must "
                "open the job the same way."
            )
        if not 0 <= rank < world_size or rank in pending.nodes:
            raise SamplingError(
                f"Rank {rank} of job {name!r} (world_size {world_size}) joined already or is "
                "out of range; give each rank its own RANK in 0..WORLD_SIZE-1."
            )
        pending.nodes[rank] = joining.node
        if len(pending.nodes) < world_size:
            return None
        del self.pending[name]
        self.left[name] = set()
        return pending

    def leave(
        self, name: str, *, rank: int, ranks: int | None, failed: bool = False, reason: str = ""
    ) -> bool:
        """Rank ``rank`` of ``name`` is gone, normally or ``failed`` (the job is then gone with
        ``reason``). ``ranks``: the running job's number of ranks (None: it does not run).

        Returns True if the running job must be taken off: a rank failed, or its last rank left.
        """
        why = reason or f"rank {rank} of job {name!r} failed"
        pending = self.pending.get(name)
        if pending is not None:
            pending.nodes.pop(rank, None)
            if failed or not pending.nodes:
                del self.pending[name]
            if failed:
                self.gone[name] = why
            return False
        if ranks is None:
            return False  # the job ended already
        if failed:
            self.gone[name] = why
            return True
        left = self.left.setdefault(name, set())
        left.add(rank)
        return len(left) >= ranks

    def ended(self, name: str) -> None:
        """The running job ``name`` was taken off the leader."""
        self.left.pop(name, None)

    def pending_on(self, node: str) -> list[str]:
        """The jobs waiting for ranks of which one joined from ``node``."""
        return [n for n, p in self.pending.items() if node in p.nodes.values()]


def _same(a: npt.NDArray[np.float64] | None, b: npt.NDArray[np.float64] | None) -> bool:
    """Whether two ranks' weights are the same (both None: a plain job)."""
    if a is None or b is None:
        return a is None and b is None
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))
