"""A loader's side of object storage: its storage tier, its read-ahead per dataset, their counters.

One :class:`StorageReads` per ``Loader``. The datasets it reads from object storage
(``DatasetReader.ranged``) get

* the **storage tier** (:class:`~tabloader.catalog.storage._tier.StorageTier`, created at the
  first such dataset, under the catalog's ``cache/storage/``, of ``storage_cache_bytes``; none
  with 0), which their readers look in before fetching and offer batches to once read; on a Ray
  cluster the node's tier is wrapped by a partitioned cache (``share``: a batch another node
  keeps is read from it before the bucket, :mod:`tabloader.cluster._peers`);
* a :class:`~tabloader.engine._prepare.readahead.ReadAhead`, which fetches the batches their jobs
  decode next.

The tier ranks its entries through :meth:`StorageReads.rank`: by the next use the read-ahead of
the entry's dataset knows (:func:`~tabloader.engine._prepare.readahead.rank_keys`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tabloader.catalog._errors import StorageError
from tabloader.catalog.storage import DatasetReader, open_store
from tabloader.catalog.storage._tier import BatchCache, StorageTier
from tabloader.engine._prepare.readahead import MAX_PLAN_ROWS, ReadAhead, queue_heads, rank_keys

logger = logging.getLogger(__name__)

CACHE_DIR = Path("cache") / "storage"  # the tier's folder under the catalog directory


def node_cache_dir(node: str) -> Path:
    """The tier's folder of a Ray node's loader under the catalog directory (each node keeps
    its own share, on its own disk where ``cache/`` is local)."""
    return CACHE_DIR.parent / f"storage-node-{node[:16]}"


Share = Callable[[StorageTier | None], BatchCache | None]
"""``share(tier) -> cache``: what the readers use instead of the node's own ``tier`` (a Ray
cluster's partitioned cache around it); it may keep counters (``snapshot()``)."""


class StorageReads:
    """The tier and read-ahead of one loader (see the module docstring).

    Args:
        directory: the tier's folder (None: no tier).
        capacity: the tier's bytes (0: no tier).
        budget: each dataset's read-ahead bytes (``readahead_bytes``).
        share: wraps the tier (a Ray node's share of a partitioned cache), or None.
    """

    def __init__(
        self, directory: Path | None, capacity: int, budget: int, *, share: Share | None = None
    ) -> None:
        self.directory, self.capacity, self.budget = directory, capacity, budget
        self.share = share
        self.tier: StorageTier | None = None
        self.cache: BatchCache | None = None
        self._opened = False
        self._lock = threading.Lock()
        self._ahead: dict[str, ReadAhead] = {}  # dataset -> its read-ahead
        self._parts: dict[str, tuple[ReadAhead, int]] = {}  # part name -> (read-ahead, index)
        self._readers: dict[str, DatasetReader] = {}  # dataset -> the reader read now

    def _open(self) -> BatchCache | None:
        """The tier and the cache around it, made at the first dataset of object storage."""
        with self._lock:
            if not self._opened:
                self._opened = True
                if self.directory is not None and self.capacity > 0:
                    try:
                        self.tier = StorageTier(self.directory, self.capacity, rank=self.rank)
                    except StorageError as exc:
                        logger.warning("%s Reading without a storage tier.", exc)
                self.cache = self.share(self.tier) if self.share is not None else self.tier
            return self.cache

    def attach(self, sched: Any, reader: DatasetReader, arena: Any) -> None:
        """Read ``reader``'s dataset (of ``sched``, a ``DatasetScheduler``) through the tier,
        its batches fetched ahead; nothing for a dataset of local files."""
        if not reader.ranged:
            return
        reader.tier = self._open()
        name = sched.name
        self._readers[name] = reader
        ahead = self._ahead.get(name)
        if ahead is None:
            ahead = self._ahead[name] = ReadAhead(
                reader,
                heads=partial(queue_heads, sched),
                stored=arena.stored,
                future=sched.queues.future,
                budget=self.budget,
            )
        else:  # a newer version (rows appended): its reader from here on
            ahead.reader = reader
        for i, part in enumerate(reader.parts):
            self._parts[part.path] = (ahead, i)
        sched.fetcher.readahead = ahead

    def ahead_rows(self, reader: DatasetReader) -> int:
        """The rows a job of ``reader``'s dataset should have sampled ahead for the read-ahead
        to fetch its budget (0: local files, no read-ahead)."""
        if not reader.ranged or reader.num_rows == 0:
            return 0
        row_bytes = max(1.0, sum(p.file_size for p in reader.parts) / reader.num_rows)
        return min(MAX_PLAN_ROWS, int(self.budget // row_bytes))

    def detach(self, dataset: str) -> None:
        """``dataset``'s scheduler is gone (dropped and imported again)."""
        ahead = self._ahead.pop(dataset, None)
        self._readers.pop(dataset, None)
        if ahead is not None:
            self._parts = {k: v for k, v in self._parts.items() if v[0] is not ahead}
            ahead.close()

    def rank(self, keys: Sequence[tuple[str, int]], ages: npt.NDArray[np.float64]) -> Any:
        """The tier's ranks (:func:`~tabloader.engine._prepare.readahead.rank_keys`)."""
        return rank_keys(self._parts.get, keys, ages)

    def read_batch(self, uri: str, name: str, size: int, batch: int) -> bytes:
        """Record batch ``batch`` (or the tail) of part ``name`` (``size`` bytes) of the store at
        ``uri``: from this node's own tier, else fetched (and offered to it). What a Ray node
        answers a peer that asked for a batch of its share.

        Raises:
            StorageError: it cannot be fetched.
        """
        self._open()
        tier = self.tier
        store: Any = open_store(uri)
        part = store.part(name, size=size, what=f"Data file '{store.locate(name)}'", cache=tier)
        if batch < 0:  # the tail (read, or found in the tier, as the part was opened)
            return bytes(part.tail())
        part.load([batch], tier)
        try:
            start, length = part.footer.batch_range(batch)
            return bytes(part.read(start, length))
        finally:
            part.release([batch], tier)

    def stats(self) -> dict[str, Any]:
        """The buckets' counters (per store), the tier's, the peers' and the read-aheads'."""
        stores: dict[str, dict[str, int]] = {}
        for reader in list(self._readers.values()):
            counters = getattr(reader.store, "counters", None)
            if counters is not None:
                stores[reader.store.uri] = counters.snapshot()
        share = getattr(self.cache, "snapshot", None) if self.cache is not self.tier else None
        return {
            "bucket_bytes": sum(s["bytes"] for s in stores.values()),
            "bucket_requests": sum(s["requests"] for s in stores.values()),
            "stores": stores,
            "tier": None if self.tier is None else self.tier.snapshot(),
            "peers": None if share is None else share(),
            "readahead": {
                name: {"fetched": a.fetched, "held_bytes": a.held_bytes(), "peak": a.peak_bytes}
                for name, a in self._ahead.items()
            },
        }

    def flush(self) -> None:
        """Write the tier's index if it changed."""
        if self.tier is not None:
            self.tier.flush()

    def close(self) -> None:
        """Stop the read-aheads (their batches offered to the tier), then close the tier."""
        for name in list(self._ahead):
            self.detach(name)
        if self.tier is not None:
            self.tier.close()
