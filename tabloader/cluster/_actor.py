"""The leader as a named Ray actor: one per catalog, found by every node's loader by name.

The actor wraps a :class:`~tabloader.cluster._leader.Leader`; its name is derived from the
catalog's resolved path (:mod:`tabloader.cluster._names`), so every process of the cluster that
knows the catalog finds the same leader, and :func:`start_leader` started twice returns the
running one. It asks for no CPU (sampling is light and the node's CPUs are the
loaders' and the trainers'). Ray is imported only when these functions run, so the rest of
tabloader works without it (``pip install 'tabloader[ray]'``).

Jobs are the catalog's (``Job``): a node sends the one it looked up with each rank's join, and
``add_job`` takes one or a job's name (the actor then opens the catalog for the moment it reads
the job).

Checkpoint: the actor writes the leader's ``state_dict()`` to ``leader-state.json`` in the
catalog's private service directory after every change a node relies on (acknowledgements,
ranks joining and leaving, nodes leaving), atomically; Ray restarts a dead leader
(``max_restarts``) and the new one resumes from that file, owing each job exactly the rows
not acknowledged (the nodes' side: :mod:`tabloader.cluster._node`). :func:`start_cluster`
removes the file of an earlier cluster's leader before starting a new one.

Address record: while ``tabloader serve --ray`` (:func:`serve_cluster`) serves the catalog,
``ray-leader.json`` in the same directory says where, so ``tabloader status`` finds the cluster
without ``--ray``; it is verified before it is trusted (:mod:`tabloader.cluster._record`).
:func:`cluster_status` dials only a checked ``host:port`` address, with a short timeout, and
never starts a Ray instance.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tabloader.catalog._directory import read_file
from tabloader.cluster._jobs import LeaderOptions, LeaderState, LeaderStatus, NodeStats, WorkList
from tabloader.cluster._leader import Leader
from tabloader.cluster._names import NAMESPACE, get_leader, leader_name, loader_name
from tabloader.cluster._record import DIAL_TIMEOUT_S, dial, record_leader

if TYPE_CHECKING:
    import numpy as np

    from tabloader.catalog import Job
    from tabloader.catalog._options import JobSpec
    from tabloader.cluster._node import NodeInfo

logger = logging.getLogger(__name__)


class LeaderActor:
    """The body of the Ray actor: a :class:`Leader` for one catalog (see the module docs)."""

    def __init__(self, catalog: str, options: LeaderOptions) -> None:
        self.catalog = catalog
        self.path = checkpoint_path(catalog)
        if self.path.exists() or self.path.is_symlink():
            # a recorded file: never through a link, never a FIFO (``read_file``)
            text = read_file(self.path, what=f"The leader's checkpoint {self.path}")
            self.leader = Leader.from_state_dict(decode_bytes(json.loads(text)))
            logger.warning(
                "leader of %s restarted from its checkpoint (generation %d)",
                catalog,
                self.leader.generation,
            )
        else:
            self.leader = Leader(**options)
        self._save()

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(state_json(self.leader))
        os.replace(tmp, self.path)

    def join(self, job: Job, **kw: Any) -> bool:
        """A rank of ``job`` (the catalog's, as its node looked it up) joins
        (:meth:`Leader.join`)."""
        done = self.leader.join(job, **kw)
        self._save()
        return done

    def leave(self, name: str, **kw: Any) -> None:
        """A rank leaves (:meth:`Leader.leave`)."""
        self.leader.leave(name, **kw)
        self._save()

    def report(self, name: str, ids: np.ndarray, losses: np.ndarray) -> None:
        """A rank scored rows by their losses (:meth:`Leader.report`); checkpointed with the
        next acknowledgement (a restarted leader loses at most the reports since)."""
        self.leader.report(name, ids, losses)

    def remove_node(self, node: str, reason: str = "") -> list[str]:
        """A node left the cluster (:meth:`Leader.remove_node`)."""
        gone = self.leader.remove_node(node, reason)
        self._save()
        return gone

    def poll(
        self, node: str, stats: NodeStats | None = None
    ) -> tuple[list[WorkList], dict[str, str]]:
        """A node's new work lists and the jobs gone (:meth:`Leader.poll`)."""
        return self.leader.poll(node, stats)

    def acked(self, node: str) -> dict[tuple[str, int, int], int]:
        """Rows acknowledged per (job, rank, epoch) on ``node`` (:meth:`Leader.acked`)."""
        return self.leader.acked(node)

    def status(self) -> LeaderStatus:
        """Jobs, ranks and each node's counters (:meth:`Leader.status`)."""
        return self.leader.status()

    def add_job(self, job: Job | str, *, nodes: Sequence[str], spec: JobSpec | None = None) -> None:
        """Register ``job`` (:meth:`Leader.add_job`): the catalog's, or its name (read from
        the catalog, opened for the moment)."""
        if isinstance(job, str):
            from tabloader import catalog

            with catalog.open_catalog(self.catalog) as cat:
                job = cat.job(job)
        self.leader.add_job(job, nodes=nodes, spec=spec)

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
        """``node`` delivered its lists up to ``seq`` (checkpointed before it returns)."""
        self.leader.ack(node, seq)
        self._save()

    def state_dict(self) -> LeaderState:
        """The leader's checkpoint (see :meth:`Leader.state_dict`)."""
        return self.leader.state_dict()

    def load_state_dict(self, state: LeaderState) -> None:
        """Replace the leader by one restored from ``state`` (the next generation)."""
        self.leader = Leader.from_state_dict(state)
        self._save()


def checkpoint_path(catalog: str | os.PathLike[str]) -> Path:
    """Where the leader of ``catalog`` checkpoints its state."""
    from tabloader.service._protocol import runtime_dir

    return runtime_dir(Path(catalog).expanduser().resolve()) / "leader-state.json"


def state_json(leader: Leader) -> str:
    """The leader's checkpoint as JSON (what the actor writes after each acknowledgement)."""
    return json.dumps(encode_bytes(leader.state_dict()))


def encode_bytes(value: Any) -> Any:
    """``value`` with its bytes as ``{"b64": ...}`` (JSON has no bytes)."""
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {k: encode_bytes(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode_bytes(v) for v in value]
    return value


def decode_bytes(value: Any) -> Any:
    """``value`` with each ``{"b64": ...}`` back to its bytes (the inverse of ``encode_bytes``)."""
    if isinstance(value, dict):
        if set(value) == {"b64"}:
            return base64.b64decode(value["b64"])
        return {k: decode_bytes(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_bytes(v) for v in value]
    return value


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
        max_restarts=-1,  # a dead leader comes back from its checkpoint
        num_cpus=0,
        resources=resources or {},
    ).remote(path, options)


PEER_CALLS = 32
"""Calls a node's loader actor serves at once: its peers ask it for record batches of its share
of the partitioned cache (``NodeLoader.storage_batch``), up to 16 in flight from each."""

LEADER_DEFAULTS: LeaderOptions = {"lookahead": 512, "round_rows": 64}
"""A cluster leader's defaults: rows sampled ahead per job, rows per job and round."""


class Cluster:
    """``tabloader serve --ray``: the leader of a catalog and one loader per alive node.

    Args:
        catalog: the catalog directory (the same path on every node).
        leader_options: :class:`Leader` options.
        **service: each node's ``Service`` options (``cache_bytes``, ``workers``).

    Call :meth:`sync` now and then (``serve --ray`` does, every second): it starts a loader on
    each node that joined and takes the nodes that left off the leader (their jobs with them).
    """

    def __init__(
        self,
        catalog: str | os.PathLike[str],
        *,
        leader_options: LeaderOptions | None = None,
        **service: Any,
    ) -> None:
        self.root = str(Path(catalog).expanduser().resolve())
        stale = checkpoint_path(self.root)
        if stale.exists():  # an earlier cluster's: its ranks and nodes are gone
            logger.info("removing the checkpoint of an earlier leader, %s", stale)
            stale.unlink()
        options: LeaderOptions = {**LEADER_DEFAULTS, **(leader_options or {})}
        self.leader = start_leader(self.root, **options)
        self.service = service
        self.loaders: dict[str, Any] = {}  # node id -> its NodeLoader actor
        self.sync()

    def sync(self) -> None:
        """Start loaders on new nodes; take the nodes that left off the leader."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from tabloader.cluster._node import NodeLoader

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        for node in sorted(alive - set(self.loaders)):
            self.loaders[node] = (
                ray.remote(NodeLoader)
                .options(
                    name=loader_name(self.root, node),
                    namespace=NAMESPACE,
                    get_if_exists=True,
                    num_cpus=0,
                    max_restarts=-1,  # a loader that dies comes back (its jobs there fail)
                    max_concurrency=PEER_CALLS,  # its peers' storage_batch calls at once
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                )
                .remote(self.root, self.service)
            )
        for node in sorted(set(self.loaders) - alive):
            del self.loaders[node]
            gone = ray.get(self.leader.remove_node.remote(node))
            logger.warning("node %s left the cluster; jobs taken off: %s", node, gone or "none")

    def wait_ready(self, timeout: float = 120.0) -> dict[str, NodeInfo]:
        """Each node's loader ``info()`` once all have started."""
        import ray

        nodes = list(self.loaders)
        infos = ray.get([self.loaders[n].info.remote() for n in nodes], timeout=timeout)
        return dict(zip(nodes, infos, strict=True))

    def status(self) -> ClusterStatus:
        """The leader's status with cluster totals (``"decodes"``, ``"reads"``: integers)."""
        import ray

        status: LeaderStatus = ray.get(self.leader.status.remote(), timeout=60)
        return with_totals(status)

    def close(self, timeout: float = 60.0) -> None:
        """Stop every node's loader and the leader."""
        import ray

        stops = [a.stop.remote() for a in self.loaders.values()]
        deadline = time.monotonic() + timeout
        for ref in stops:
            try:
                ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except Exception as exc:  # a node that died meanwhile
                logger.warning("a node loader did not stop cleanly: %s", exc)
        for actor in [*self.loaders.values(), self.leader]:
            ray.kill(actor, no_restart=True)
        self.loaders.clear()
        checkpoint_path(self.root).unlink(missing_ok=True)


class ClusterStatus(LeaderStatus):
    """The leader's status with the cluster's totals over its nodes."""

    reads: int
    decodes: int
    storage: dict[str, int]


def with_totals(status: LeaderStatus) -> ClusterStatus:
    """``status`` plus the cluster's total ``reads`` and ``decodes`` over its nodes, and the
    bytes its nodes read from the bucket, their tiers and each other (``storage``)."""
    nodes = status.get("nodes", {})
    stores = [n.get("storage") or {} for n in nodes.values()]
    return {
        **status,
        "reads": int(sum(n.get("reads", 0) for n in nodes.values())),
        "decodes": int(sum(n.get("decodes", 0) for n in nodes.values())),
        "storage": {
            "bucket_bytes": sum(int(s.get("bucket_bytes", 0)) for s in stores),
            "tier_bytes": sum(int((s.get("tier") or {}).get("hit_bytes", 0)) for s in stores),
            "peer_bytes": sum(int((s.get("peers") or {}).get("peer_bytes", 0)) for s in stores),
        },
    }


def _init_ray(address: str) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)


def serve_cluster(
    catalog: str | os.PathLike[str],
    address: str = "auto",
    *,
    ready: Callable[[int], object] = lambda n: None,
    **service: Any,
) -> None:
    """``tabloader serve --ray``: run a :class:`Cluster` until SIGTERM or SIGINT, starting
    loaders on nodes that join and taking nodes that leave off the leader (every second).
    ``ready(nodes)`` is called once every node's loader runs."""
    import signal
    import threading

    import ray

    root = Path(catalog).expanduser().resolve()
    _init_ray(address)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    cluster = Cluster(root, **service)
    try:
        record_leader(root, ray.get_runtime_context().gcs_address)
        ready(len(cluster.wait_ready()))
        while not stop.wait(1.0):
            cluster.sync()
    finally:
        record_leader(root, None)
        cluster.close()
        ray.shutdown()


def cluster_status(
    catalog: str | os.PathLike[str], address: str = "auto", *, timeout: float = DIAL_TIMEOUT_S
) -> ClusterStatus:
    """``tabloader status --ray``: the leader's status with the cluster's totals.

    It never starts a Ray instance: ``address`` must be ``host:port`` or ``ray://host:port``
    (``auto``: the running cluster Ray finds, as ``ray status`` does), and something must
    accept connections there within ``timeout`` seconds before Ray is asked; the leader gets
    ``10 * timeout`` seconds to answer.

    Raises:
        ServiceError: a malformed address, ``auto`` finding none, nothing answers there, or
            no leader serves ``catalog`` on that cluster.
    """
    from tabloader.catalog._errors import ServiceError

    root = Path(catalog).expanduser().resolve()
    address = _running_address(address)
    dial(address, timeout)
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    try:
        leader = get_leader(root)
    except ValueError:
        raise ServiceError(
            f"No tabloader leader serves catalog {root} on the Ray cluster at {address}; "
            f"start one with `tabloader --catalog {root} serve --ray {address}`."
        ) from None
    status: LeaderStatus = ray.get(leader.status.remote(), timeout=10 * timeout)
    return with_totals(status)


def _running_address(address: str) -> str:
    """The ``host:port`` of the running cluster ``address`` names (``auto``: as Ray finds it,
    ``$RAY_ADDRESS`` first); any other address as it is.

    Raises:
        ServiceError: ``auto`` names no running cluster (or ``local``, a new one).
    """
    if address != "auto":
        return address
    from tabloader.catalog._errors import ServiceError

    fix = "give its address: tabloader status --ray HOST:PORT"
    try:
        from ray._private.services import canonicalize_bootstrap_address

        found = canonicalize_bootstrap_address("auto")
    except (ImportError, ConnectionError) as exc:  # ImportError: Ray moved the function
        raise ServiceError(f"Found no running Ray cluster ({exc}); {fix}.") from None
    if found is None:
        raise ServiceError(f"$RAY_ADDRESS says to start a local Ray instance; {fix}.")
    return str(found)
