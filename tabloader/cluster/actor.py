"""The leader as a named Ray actor: one per catalog, found by every node's loader by name.

The actor wraps a :class:`~tabloader.cluster.leader.Leader`; its name is derived from the
catalog's resolved path (:func:`leader_name`), so every process of the cluster that knows the
catalog finds the same leader with :func:`get_leader`, and :func:`start_leader` started twice
returns the running one. It asks for no CPU (sampling is light and the node's CPUs are the
loaders' and the trainers'). Ray is imported only when these functions run, so the rest of
tabloader works without it (``pip install 'tabloader[ray]'``).

Jobs come from the catalog (the actor opens it for the moment it reads a job's bitmap) or, when
the catalog is open elsewhere (the catalog allows one opener), with their ids as serialized
bitmaps.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash
from pyroaring import BitMap

from tabloader.cluster.leader import Leader, WorkList

__all__ = ["NAMESPACE", "LeaderActor", "get_leader", "leader_name", "start_leader"]

NAMESPACE = "tabloader"
"""The Ray namespace of the leader actors (named actors are found within a namespace)."""


def leader_name(catalog: str | os.PathLike[str]) -> str:
    """The actor name of the leader of ``catalog``: ``tabloader-leader-<hash of its path>``."""
    path = str(Path(catalog).expanduser().resolve())
    return f"tabloader-leader-{xxhash.xxh64_hexdigest(path.encode())[:12]}"


class LeaderActor:
    """The body of the Ray actor: a :class:`Leader` for one catalog (see the module docs)."""

    def __init__(self, catalog: str, options: dict[str, Any]) -> None:
        self.catalog = catalog
        self.leader = Leader(**options)

    def add_job(
        self,
        name: str,
        *,
        nodes: Sequence[str],
        batch_size: int,
        ids: bytes | None = None,
        dataset: str = "",
    ) -> None:
        """Register job ``name`` of the catalog (or with ``ids``, a serialized bitmap)."""
        if ids is not None:
            self.leader.add_job(
                name, BitMap.deserialize(ids), nodes=nodes, batch_size=batch_size, dataset=dataset
            )
            return
        import catalog

        with catalog.connect(self.catalog) as cat:
            job = cat.job(name)
        self.leader.add_catalog_job(job, nodes=nodes, batch_size=batch_size)

    def remove_job(self, name: str) -> None:
        """Unregister ``name``."""
        self.leader.remove_job(name)

    def jobs(self) -> list[str]:
        """The jobs on the leader."""
        return self.leader.jobs()

    def nodes(self) -> list[str]:
        """The nodes that run a rank."""
        return self.leader.nodes()

    def work(self, node: str) -> list[WorkList]:
        """``node``'s new work lists (see :meth:`Leader.work`)."""
        return self.leader.work(node)

    def ack(self, node: str, seq: int) -> None:
        """``node`` delivered its lists up to ``seq``."""
        self.leader.ack(node, seq)

    def state_dict(self) -> dict[str, Any]:
        """The leader's checkpoint (see :meth:`Leader.state_dict`)."""
        return self.leader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the leader by one restored from ``state`` (the next generation)."""
        self.leader = Leader.from_state_dict(state)


def start_leader(
    catalog: str | os.PathLike[str],
    *,
    resources: dict[str, float] | None = None,
    **options: Any,
) -> Any:
    """Start the leader actor of ``catalog`` (or return the running one) on the Ray cluster.

    Args:
        catalog: the catalog directory (every node sees it at the same path).
        resources: custom Ray resources the actor needs (to place it on a given node).
        **options: :class:`Leader` options (``seed``, ``lookahead``, ``round_rows``, ``slack``).

    Returns:
        The actor handle (``handle.work.remote(node)`` and so on).
    """
    import ray

    path = str(Path(catalog).expanduser().resolve())
    remote = ray.remote(LeaderActor)
    return remote.options(
        name=leader_name(path),
        namespace=NAMESPACE,
        get_if_exists=True,
        num_cpus=0,
        resources=resources or {},
    ).remote(path, options)


def get_leader(catalog: str | os.PathLike[str]) -> Any:
    """The running leader actor of ``catalog``.

    Raises:
        ValueError: no leader runs for ``catalog`` (Ray's error: start one with
            :func:`start_leader`).
    """
    import ray

    return ray.get_actor(leader_name(catalog), namespace=NAMESPACE)
