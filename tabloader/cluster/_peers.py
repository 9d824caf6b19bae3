"""A cache partitioned across the nodes of a Ray cluster (CoorDL's): storage read once for all.

Each node's loader has its own storage tier (:mod:`tabloader.catalog.storage._tier`, in its
own folder, ``node_cache_dir``), and each record batch of a dataset in object storage has one
*owner* node: rendezvous hashing of (part name, batch) over the nodes alive (the highest
``xxh64(node, key)`` wins), so every node names the same owner and a node that joins or
leaves moves only the keys it wins or held. A node's reader looks for a batch
(:class:`PeerCache`, the readers' :class:`~tabloader.catalog.storage._tier.BatchCache`):

* a batch it owns: in its own tier (then, on a miss, the bucket; the batch is offered to its
  tier once read, as on one machine);
* a batch another node owns: asks that node's loader actor (``NodeLoader.storage_batch``, a
  Ray call), which answers from its tier or fetches the batch from the bucket itself and keeps
  it (its share); only if the peer cannot answer (gone, timed out) does the node fetch the
  batch itself. Batches of others' shares are never kept here.

So on N nodes whose tiers together hold the dataset, the bucket is read once for the whole run.
The bytes a peer sends are checked as fetched ones are (the reader checks every batch; one that
fails is fetched again from the bucket). Counters: bytes and requests served by peers, and the
peer calls that failed (``snapshot``; ``tabloader status --ray`` shows them per node).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import xxhash

from tabloader.catalog.storage._tier import StorageTier
from tabloader.cluster._names import NAMESPACE, loader_name

logger = logging.getLogger(__name__)

PEER_TIMEOUT_S = 30.0  # a peer's answer (it may fetch from the bucket, with retries)
NODES_S = 5.0  # how long the list of alive nodes is kept


def owner_of(nodes: list[str], key: tuple[str, int]) -> str:
    """The node that keeps ``key`` (part name, batch) among ``nodes`` (rendezvous hashing)."""
    text = f"{key[0]}\0{key[1]}"
    return max(nodes, key=lambda n: xxhash.xxh64_intdigest(f"{n}\0{text}".encode()))


class PeerCache:
    """A node's view of the partitioned cache (see the module docstring).

    Args:
        root: the catalog directory (names the peers' loader actors).
        node: this node's id.
        tier: this node's own tier (None: it keeps nothing; its share is read from the bucket).
    """

    def __init__(self, root: Path, node: str, tier: StorageTier | None) -> None:
        self.root, self.node, self.tier = root, node, tier
        self.peer_bytes = 0
        self.peer_requests = 0
        self.peer_failures = 0
        self._nodes: list[str] = [node]
        self._nodes_at = -NODES_S
        self._peers: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _alive(self) -> list[str]:
        now = time.monotonic()
        if now - self._nodes_at > NODES_S:
            import ray

            try:
                found = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
            except Exception as exc:  # (the GCS restarting): the last list stays
                logger.warning("partitioned cache: cannot list the nodes: %s", exc)
                found = self._nodes
            with self._lock:
                self._nodes = found or [self.node]
                self._nodes_at = now
        return self._nodes

    def owner(self, part: Any, batch: int) -> str:
        """The node that keeps batch ``batch`` of ``part``."""
        return owner_of(self._alive(), (part.name, batch))

    def get(self, part: Any, batch: int) -> memoryview | None:
        owner = self.owner(part, batch)
        if owner == self.node:
            return None if self.tier is None else self.tier.get(part, batch)
        data = self._ask(owner, part, batch)
        return None if data is None else memoryview(data)

    def _ask(self, owner: str, part: Any, batch: int) -> bytes | None:
        import ray

        try:
            peer = self._peers.get(owner)
            if peer is None:
                peer = ray.get_actor(loader_name(self.root, owner), namespace=NAMESPACE)
                self._peers[owner] = peer
            ref = peer.storage_batch.remote(part.uri, part.name, part.size, batch)
            data: bytes = ray.get(ref, timeout=PEER_TIMEOUT_S)
        except Exception as exc:  # gone, restarting, timed out: the bucket instead
            self._peers.pop(owner, None)
            with self._lock:
                self.peer_failures += 1
            logger.warning("partitioned cache: node %s did not answer (%s)", owner[:16], exc)
            return None
        with self._lock:
            self.peer_requests += 1
            self.peer_bytes += len(data)
        return data

    def offer(self, part: Any, batch: int, data: Any) -> None:
        if self.tier is not None and self.owner(part, batch) == self.node:
            self.tier.offer(part, batch, data)

    def drop(self, part: Any, batch: int) -> None:
        if self.tier is not None:
            self.tier.drop(part, batch)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "peer_bytes": self.peer_bytes,
                "peer_requests": self.peer_requests,
                "peer_failures": self.peer_failures,
            }
