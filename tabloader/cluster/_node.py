"""A node's loader on a Ray cluster: the loader service of the node, fed by the leader.

Each node runs one :class:`NodeLoader` Ray actor (pinned to it with node affinity). It runs the
loader service (:mod:`tabloader.service._server`: the engine, its shared-memory arena and the
Unix socket) for the catalog, in a runtime directory of its own node
(``<catalog>/.service/node-<id>``), so the ranks and trials on the node read from it through
shared memory exactly as from a local service; payload never crosses Ray or the network, and
each node reads the catalog's storage itself.

What differs from a local service is where rows come from: every job opened on a node is
*fed*. When a rank opens its job, the node registers it with the leader (:meth:`Leader.join`)
and opens it in its engine as a job of its own (``Loader.serve(source=Fed)``); a :class:`NodeFeed`
thread polls the leader for the node's work lists while some fed rank has fewer rows ahead than
its horizon, acknowledges them, and queues each rank's rows with the leader's rounds (the arena
evicts by next use; a weighted job's rows come with their ``_weight``s, which its batches
carry as a local job's do). Acknowledge first, queue after: the leader checkpoints on every
ack, so a restarted leader never hands a node the rows it queued. If the ack's answer is lost
(the leader died), the node asks the restarted leader which ``(job, rank, epoch)`` counts it
recorded (:meth:`Leader.acked`) and queues the lists it had whose ack took effect, dropping the
others, which the restored leader owes again: each rank still sees each of its rows once per
epoch.

A rank that leaves normally (its stream closed, or all its epochs read) leaves the leader's
job with its share (as a local rank does); a rank whose process dies mid-run fails its job on
the leader, and its ranks on every node raise that reason once they would wait for rows. The
catalog is opened only for the moment of a lookup (:class:`SnapshotCatalog`): many nodes and
the leader read one catalog, which allows one opener at a time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from tabloader import catalog
from tabloader.catalog._api import Operation, StatementTarget, Wire
from tabloader.catalog._errors import CatalogLockedError, LoaderError, ServiceError, TabloaderError
from tabloader.cluster._jobs import NodeStats, WorkList
from tabloader.cluster._names import get_leader, node_key
from tabloader.cluster._peers import PeerCache

if TYPE_CHECKING:
    import pyarrow as pa

    from tabloader.catalog import Catalog, Job
    from tabloader.engine._deliver.stream import ServedStream
    from tabloader.service._server import Service

logger = logging.getLogger(__name__)

POLL_S = 0.02  # how often the feed asks the leader while a rank is hungry
STATS_S = 1.0  # how often a node reports its counters (and learns of gone jobs) when idle
LOCK_WAIT_S = 30.0  # how long a lookup waits for another opener of the catalog
LEADER_WAIT_S = 60.0  # how long a node waits for a restarted leader


class SnapshotCatalog(StatementTarget):
    """The catalog API, each operation run on the catalog opened for that moment.

    Every node of a cluster and the leader read one catalog, and a ``Catalog`` holds the
    catalog's single lock while open; so this opens it for each operation (a service's
    statements, a ``Loader``'s look-ups). A read that only looks at the catalog database
    (names, datasets, jobs) is answered again from memory until the database changes.
    """

    CACHED = (Wire.NAMES, Wire.DATASET, Wire.JOB, Wire.JOB_INFOS)
    """The results that are kept (small, and read from the catalog database alone)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        from tabloader.catalog._directory import DB_FILE
        from tabloader.catalog._limits import Limits

        self.root = Path(root).expanduser().resolve()
        self.limits = Limits.resolve(None, None)  # what each opening gets
        self._files = [self.root / DB_FILE, self.root / f"{DB_FILE}.wal"]
        self._cache: dict[Any, tuple[Any, Any]] = {}  # (op, arguments) -> stamp, value
        self._cache_lock = threading.Lock()
        self._exists: bool = self._with(lambda c: c.exists)

    @property
    def exists(self) -> bool:
        """Whether the directory held a catalog when this was made."""
        return self._exists

    def _stamp(self) -> tuple[tuple[int, int], ...]:
        """The catalog database's files as they are now: any write changes this."""
        out = []
        for f in self._files:
            try:
                st = f.stat()
                out.append((st.st_mtime_ns, st.st_size))
            except FileNotFoundError:
                out.append((0, 0))
        return tuple(out)

    def _perform(self, op: Operation, arguments: dict[str, Any]) -> Any:
        """Run ``op`` on the catalog opened for it; a read of ``CACHED`` results is run
        again only if the catalog changed since (an open costs ~0.1 s and every rank of the
        node asks)."""
        if op.writes or op.result not in self.CACHED:
            return self._with(lambda c: op.call(c, arguments))
        key = (op.name, *arguments.items())
        stamp = self._stamp()
        with self._cache_lock:
            hit = self._cache.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        value = self._with(lambda c: op.call(c, arguments))
        with self._cache_lock:
            self._cache[key] = (stamp, value)
        return value

    def _with(self, fn: Callable[[Catalog], Any]) -> Any:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                with catalog.open_catalog(self.root) as cat:
                    return fn(cat)
            except CatalogLockedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def query(self, sql: str) -> pa.Table:
        """A validated read-only query (``Catalog.query``)."""
        table: pa.Table = self._with(lambda c: c.query(sql))
        return table

    def close(self) -> None:
        """Nothing is held open."""


class NodeFeed:
    """Feeds the fed jobs of one node's engine from the leader (see the module docstring).

    Args:
        leader: the leader actor's handle.
        node: this node's Ray id.
        stats: the node loader's counters, reported to the leader with each poll.
    """

    def __init__(self, leader: Any, node: str, stats: Callable[[], NodeStats]) -> None:
        self.leader = leader
        self.node = node
        self._stats = stats
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], ServedStream] = {}  # (job, rank) -> its fed stream here
        # the ranks whose join the leader has answered: a poll sent before that may list the
        # job as gone from an earlier run of it, which must not fail the new rank
        self._joined: set[tuple[str, int]] = set()
        self._fed: dict[tuple[str, int, int], int] = {}  # rows queued per (job, rank, epoch)
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tabloader-node-feed", daemon=True)
        self._thread.start()

    # -- ranks -------------------------------------------------------------------------------
    def join(self, stream: ServedStream, job: Job, *, rank: int, world_size: int) -> None:
        """Rank ``rank`` of ``job`` opened ``stream`` (a fed stream) on this node."""
        import ray

        with self._lock:
            self._ranks[(job.name, rank)] = stream
        try:
            ray.get(
                self.leader.join.remote(
                    job,  # its rows, dataset version and a weighted job's stored weights
                    rank=rank,
                    world_size=world_size,
                    node=self.node,
                    spec=stream.spec.to_wire(),
                    epochs=stream.epochs,
                ),
                timeout=LEADER_WAIT_S,
            )
        except BaseException as exc:
            with self._lock:
                self._ranks.pop((job.name, rank), None)
            cause = getattr(exc, "cause", None)  # the leader's own error, raised there
            if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, TabloaderError):
                raise cause from None
            raise
        with self._lock:
            if (job.name, rank) in self._ranks:  # not closed meanwhile
                self._joined.add((job.name, rank))

    def leave(self, job: str, rank: int, *, failed: bool, reason: str = "") -> None:
        """Rank ``rank`` of ``job`` left this node (``failed``: its process died mid-run)."""
        with self._lock:
            self._ranks.pop((job, rank), None)
            self._joined.discard((job, rank))
            for key in [k for k in self._fed if k[:2] == (job, rank)]:
                del self._fed[key]
        import ray

        for attempt in range(2):  # once more if the leader was restarting
            try:
                ray.get(
                    self.leader.leave.remote(job, rank=rank, failed=failed, reason=reason),
                    timeout=LEADER_WAIT_S,
                )
                return
            except (ray.exceptions.RayError, TimeoutError) as exc:
                if attempt or not self._wait_for_leader():
                    logger.error(
                        "could not tell the leader that job %s rank %d left: %s", job, rank, exc
                    )
                    return

    def report(self, job: str, ids: np.ndarray, losses: np.ndarray) -> None:
        """A rank of ``job`` on this node scored rows by their losses: to the leader's sampler
        (which draws the job's rows), whose error is raised here as it raised it there."""
        import ray

        try:
            ray.get(self.leader.report.remote(job, ids, losses), timeout=LEADER_WAIT_S)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)  # the leader's own error, raised there
            if isinstance(cause, TabloaderError):
                raise LoaderError(f"{cause}") from None
            raise
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise LoaderError(
                f"Job {job!r}: the cluster leader did not take the losses reported ({exc}); "
                "report the next batch's (the leader may be restarting)."
            ) from None

    # -- the feed thread -----------------------------------------------------------------------
    def _hungry(self) -> bool:
        with self._lock:
            streams = list(self._ranks.values())
        return any(stream.wants_rows() for stream in streams)

    def _run(self) -> None:
        import ray

        last = 0.0
        while not self._stop.is_set():
            hungry = self._hungry()
            if not hungry and time.monotonic() - last < STATS_S:
                self._stop.wait(POLL_S)
                continue
            last = time.monotonic()
            stats = self._stats()
            with self._lock:
                joined = set(self._joined)  # before the poll: the leader saw their joins
            try:
                lists, gone = ray.get(
                    self.leader.poll.remote(self.node, stats), timeout=LEADER_WAIT_S
                )
                self._fail_gone(gone, joined)
                if lists:
                    self._ack_and_feed(lists)
                elif hungry:
                    self._stop.wait(POLL_S)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                if self._stop.is_set():
                    return
                logger.warning("node %s: the leader did not answer (%s); retrying", self.node, exc)
                if not self._wait_for_leader():
                    self.error = exc
                    self._fail_all(f"the cluster leader is gone ({exc})")
                    return
            except BaseException as exc:  # a bug here: every rank of the node must hear it
                logger.exception("node %s: the feed from the leader failed", self.node)
                self.error = exc
                self._fail_all(f"the node's feed from the cluster leader failed ({exc!r})")
                return

    def _fail_gone(self, gone: dict[str, str], joined: set[tuple[str, int]]) -> None:
        with self._lock:
            hit = [(k, v) for k, v in self._ranks.items() if k[0] in gone and k in joined]
        for (name, _), stream in hit:
            stream.fail(gone[name])

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            streams = list(self._ranks.values())
        for stream in streams:
            stream.fail(reason)

    def _ack_and_feed(self, lists: list[WorkList]) -> None:
        import ray

        try:
            ray.get(self.leader.ack.remote(self.node, lists[-1].seq), timeout=LEADER_WAIT_S)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            logger.warning("node %s: acknowledgement lost (%s); asking the leader", self.node, exc)
            if not self._wait_for_leader():
                raise
            recorded = ray.get(self.leader.acked.remote(self.node), timeout=LEADER_WAIT_S)
            lists = self._took_effect(lists, recorded)
        for w in lists:
            for item in w.items:
                with self._lock:
                    found = self._ranks.get((item.job, item.rank))
                    key = (item.job, item.rank, item.epoch)
                    self._fed[key] = self._fed.get(key, 0) + item.rows.size
                if found is None:  # the rank left: its share is dropped
                    continue
                try:
                    found.feed(item.epoch, item.rows.astype(np.int64), item.rounds, item.weights)
                except LoaderError as exc:
                    found.fail(str(exc))

    def _took_effect(
        self, lists: list[WorkList], recorded: dict[tuple[str, int, int], int]
    ) -> list[WorkList]:
        """The items of ``lists`` that the (restarted) leader recorded as acknowledged."""

        kept = []
        with self._lock:
            have = dict(self._fed)
        for w in lists:
            items = []
            for item in w.items:
                key = (item.job, item.rank, item.epoch)
                if recorded.get(key, 0) >= have.get(key, 0) + item.rows.size:
                    items.append(item)
                    have[key] = have.get(key, 0) + item.rows.size
            kept.append(WorkList(w.node, w.seq, w.generation, tuple(items)))
        dropped = sum(w.num_rows for w in lists) - sum(w.num_rows for w in kept)
        logger.info("node %s: %d rows the leader owes again were dropped", self.node, dropped)
        return kept

    def _wait_for_leader(self) -> bool:
        """True once the leader answers again (Ray restarts it from its checkpoint)."""
        import ray

        deadline = time.monotonic() + LEADER_WAIT_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                ray.get(self.leader.jobs.remote(), timeout=5)
                return True
            except Exception:
                self._stop.wait(0.5)
        return False

    def close(self) -> None:
        """Stop polling."""
        self._stop.set()
        self._thread.join(timeout=LEADER_WAIT_S)


class ServiceOptions(TypedDict, total=False):
    """The options of a node's ``Service`` (its constructor's)."""

    cache_bytes: int
    workers: int | None
    idle_exit: float | None
    access_log: str | None
    max_image_megapixels: int | None
    storage_cache_bytes: int | None


class NodeInfo(TypedDict):
    """A node's loader: its node, the pid and the socket of its service."""

    node: str
    pid: int
    socket: str


class NodeLoader:
    """The body of the per-node Ray actor: the node's loader service (module docstring).

    Args:
        catalog_root: the catalog directory (the same path on every node).
        options: ``Service`` options (``cache_bytes``, ``workers``).
    """

    def __init__(self, catalog_root: str, options: ServiceOptions) -> None:
        import ray

        from tabloader.service._server import Service

        context = ray.get_runtime_context()
        self.node = context.get_node_id()
        self.root = Path(catalog_root)
        leader = get_leader(self.root)
        if context.was_current_actor_reconstructed:  # Ray restarted us: our ranks lost us
            reason = f"the loader of node {node_key(self.node)} died and restarted"
            ray.get(leader.remove_node.remote(self.node, reason), timeout=LEADER_WAIT_S)
        self.service: Service = Service(
            self.root,
            node=self.node,
            opened=SnapshotCatalog(self.root),
            feed=lambda service: NodeFeed(leader, self.node, lambda: node_stats(service)),
            # its tier keeps its share of a partitioned cache; the others' shares are asked of
            # their nodes before the bucket (tabloader.cluster._peers)
            storage_share=lambda tier: PeerCache(self.root, self.node, tier),
            **options,
        )
        self._thread = threading.Thread(target=self.service.serve, daemon=True)
        self._thread.start()

    def info(self) -> NodeInfo:
        """The node, the pid and the socket of its service."""
        return {"node": self.node, "pid": os.getpid(), "socket": str(self.service.listener)}

    def stats(self) -> NodeStats:
        """The node's loader counters."""
        return node_stats(self.service)

    def storage_batch(self, uri: str, name: str, size: int, batch: int) -> bytes:
        """A record batch of this node's share of the partitioned cache, for a peer: from
        this node's tier, else fetched from the bucket and kept (``PeerCache``)."""
        return self.service.loader.storage_batch(uri, name, size, batch)

    def stop(self) -> None:
        """Stop the service (its socket, processes and shared memory go)."""
        self.service.stop()
        self._thread.join(timeout=LEADER_WAIT_S)


def node_stats(service: Service) -> NodeStats:
    """What a node reports of its loader: reads, decodes, cache, jobs (plain values)."""
    s = service.loader.stats()
    cache = s["cache"]
    storage = s["storage"]
    return {
        "reads": s["reads"],
        "decodes": s["decodes"],
        "storage": {
            "bucket_bytes": int(storage["bucket_bytes"]),
            "bucket_requests": int(storage["bucket_requests"]),
            "tier": storage["tier"],
            "peers": storage["peers"],
            "local_bytes": int(storage["local_bytes"]),
        },
        "cache": {
            "entries": cache.entries,
            "hits": cache.hits,
            "misses": cache.misses,
            "evictions": cache.evictions,
        },
        "jobs": {
            name: {
                "epoch": j["epoch"],
                "rows": j["rows"],
                "batches": j["batches"],
                "wait_s": j["wait_s"],
            }
            for name, j in s["jobs"].items()
        },
        "clients": service.listener.sessions,
    }


class RayNodes:
    """The service clients' :class:`~tabloader.service._plugins.Locator` on a Ray cluster: a
    rank in a Ray worker reads from its node's loader (``tabloader`` registers it)."""

    def node(self, root: Path) -> str | None:
        """This process's node id if it runs in a Ray worker of a cluster whose leader serves
        ``root`` (its ranks then read from the node's loader), else None."""
        import sys

        if "ray" not in sys.modules:  # never import Ray for a process that does not use it
            return None
        import ray

        if not ray.is_initialized():
            return None
        try:
            get_leader(root)
        except ValueError:
            return None
        return str(ray.get_runtime_context().get_node_id())

    def missing(self, node: str, root: Path) -> ServiceError:
        """The error of a rank whose node has no loader."""
        return ServiceError(
            f"No tabloader loader runs on this Ray node ({node_key(node)}) for catalog {root}; "
            f"`tabloader --catalog {root} serve --ray` starts one on every node."
        )
