"""The local storage tier: encoded record batches of object storage kept on local disk.

CoorDL's MinIO cache, made better by knowing next uses: a dataset read from a bucket is
fetched a record batch at a time (:mod:`tabloader.catalog.storage._ranged`); the batches are
kept here, under the catalog's cache directory (``cache/storage/``), so that later epochs, other
jobs and a restarted service read them from local disk instead of the bucket.

* **Keys** are (part name, record batch), the part's tail (its footer) as batch ``TAIL``. A
  part's name carries a random token (``part-v00001-<token>.arrow``) and parts are never
  rewritten, so the bytes of a key never change: nothing here is ever stale.
* **Bounded** by ``capacity`` bytes (``tabloader serve --storage-cache-bytes``,
  ``$TABLOADER_STORAGE_CACHE_BYTES``; 0: no tier). A batch is offered when its reader lets go
  of it (:meth:`PartFile.release`): after its use, so its rank is that of its *next* use.
* **Eviction by next use.** Whoever reads knows what comes next: the loader installs a
  ``Ranker`` (the engine's, from its jobs' queues and remaining rows) that ranks entries,
  higher first out. Without one (or for the rows it knows nothing of) the least recently used
  goes first. An offered batch that ranks below every entry it would displace is not admitted
  (Belady: with a tier smaller than the dataset, a batch whose next use is the next epoch must
  not push out one that this epoch still reads). Ranks are computed for every entry at once and
  kept ``RERANK_S`` seconds (a stale rank only makes one choice less good).
* **Kept across restarts.** ``index.json`` lists the entries; it is written atomically (a
  temporary file renamed) at most every ``FLUSH_S`` seconds while entries change, and at
  ``close``. It says whether the tier was closed cleanly; after a crash, files the index does
  not list (written after its last write) are deleted at open.
* **Checked when read back.** Each file starts with a header: magic, the data's length and its
  xxHash3; a file that is missing, short or fails its hash is dropped and the batch fetched
  again (the reader also checks the batch's own checksums, as at every fetch).
* **One owner.** A process holds the directory's lock (``flock``) while it has the tier open;
  another process opening it gets ``StorageError`` (the loader then runs without a tier).

Files: ``<dir>/<2 hex>/<20 hex>`` named by a hash of the key (256 folders), mode 0600.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import xxhash

from tabloader.catalog._directory import FILE_MODE, make_private_dir, write_file
from tabloader.catalog._errors import StorageError

logger = logging.getLogger(__name__)

TAIL = -1  # the batch number of a part's tail (its footer and schema)
INDEX_FILE = "index.json"
LOCK_FILE = ".lock"
FLUSH_S = 5.0  # the index is written at most this often while entries change (and at close)
RERANK_S = 1.0  # ranks computed for an eviction are reused this long
_MAGIC = b"TLT1"
_HEADER = struct.Struct("<4sQQ")  # magic, data length, xxh3_64 of the data

Key = tuple[str, int]

Ranker = Callable[[Sequence[Key], npt.NDArray[np.float64]], npt.NDArray[np.float64]]
"""``ranker(keys, ages) -> ranks``: per key (part name, batch), how soon it goes (higher:
sooner); ``ages`` are seconds since each was last used (the least recently used first, for
keys nothing else is known of: :func:`lru_ranks`)."""


def lru_ranks(keys: Sequence[Key], ages: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """The least recently used first (a part's tail last)."""
    ranks = ages.astype(np.float64, copy=True)
    tails = np.fromiter((b == TAIL for _, b in keys), bool, len(keys))
    ranks[tails] = -1.0
    return ranks


def entry_path(directory: Path, key: Key) -> Path:
    """The file of ``key`` in the tier at ``directory``."""
    h = hashlib.blake2b(f"{key[0]}\0{key[1]}".encode(), digest_size=11).hexdigest()
    return Path(directory) / h[:2] / h[2:]


class BatchCache(Protocol):
    """Where a ranged reader looks for a record batch before it fetches it, and offers it
    once read (:class:`StorageTier`; on a Ray cluster, the node's share of a partitioned
    cache).

    ``part`` is the :class:`~tabloader.catalog.storage._ranged.PartFile` (``name``, ``uri``
    of its store, ``size``); ``batch`` a record batch, or ``TAIL``.
    """

    def get(self, part: Any, batch: int) -> memoryview | None:
        """The batch's bytes, checked, or None."""
        ...

    def offer(self, part: Any, batch: int, data: Any) -> None:
        """Keep the batch's bytes if they rank well enough (its reader is done with them)."""
        ...

    def drop(self, part: Any, batch: int) -> None:
        """Forget the batch (its bytes failed the reader's checks)."""
        ...


N = TypeVar("N", int, float)


@dataclass
class Counters(Generic[N]):
    """Counters (integers, or seconds too) added to from several threads (``add``) and read
    together (``snapshot``); subclasses declare them as fields (the tier's, a store's, the
    engine's per dataset: ``tabloader.engine._arena.accounting.Counters``)."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: N) -> None:
        """Add to several counters at once."""
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict[str, N]:
        """The counters as a dict."""
        with self._lock:
            return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "_lock"}


@dataclass
class TierCounters(Counters[int]):
    """What the tier served and kept."""

    hits: int = 0
    hit_bytes: int = 0
    misses: int = 0
    admitted: int = 0
    admitted_bytes: int = 0
    rejected: int = 0  # offered, ranked below everything it would displace
    evicted: int = 0
    evicted_bytes: int = 0
    dropped: int = 0  # found damaged (or gone) when read back


class _Entry:
    __slots__ = ("size", "used")

    def __init__(self, size: int, used: float) -> None:
        self.size, self.used = size, used


class StorageTier:
    """Record batches of object storage on local disk (see the module docstring).

    Args:
        directory: where (created 0700 if missing).
        capacity: bytes of batches it may hold (the headers aside).
        rank: ranks entries for eviction (default: least recently used first).

    Raises:
        StorageError: the directory cannot be created or written, or another process has
            the tier open.
    """

    def __init__(self, directory: Path, capacity: int, *, rank: Ranker | None = None) -> None:
        self.directory, self.capacity = Path(directory), int(capacity)
        self.rank: Ranker = rank or lru_ranks
        self.counters = TierCounters()
        self._entries: dict[Key, _Entry] = {}
        self.used = 0
        self._lock = threading.Lock()
        self._victims: list[Key] = []  # the current eviction order (``_evict``), from _pos
        self.victims_at, self._pos = -1.0e9, 0
        self._victim_rank: dict[Key, float] = {}
        self._dirty = False
        self._flushed = time.monotonic()
        self.closed = False
        try:
            make_private_dir(self.directory)
            self.lockfd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, FILE_MODE)
        except OSError as exc:
            raise StorageError(
                f"Cannot use {self.directory} for the storage tier: {exc.strerror or exc}. "
                "Make it writable, or turn the tier off (--storage-cache-bytes 0).",
                path=str(self.directory),
            ) from None
        try:
            fcntl.flock(self.lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self.lockfd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise StorageError(
                f"The storage tier {self.directory} is in use by another process; one loader "
                "(service) per catalog uses it.",
                path=str(self.directory),
            ) from None
        try:
            self._load()
        except BaseException:
            os.close(self.lockfd)
            raise

    # -- the index ---------------------------------------------------------------------------------
    def _load(self) -> None:
        """The entries of the index; after an unclean close, files it does not list go."""
        index = self.directory / INDEX_FILE
        clean = False
        try:
            doc = json.loads(index.read_bytes())
            clean = bool(doc.get("clean"))
            now = time.monotonic()
            for name, batches in doc.get("parts", {}).items():
                for batch, size, age in batches:
                    self._entries[(name, int(batch))] = _Entry(int(size), now - float(age))
                    self.used += int(size)
        except FileNotFoundError:
            pass
        except (ValueError, TypeError, AttributeError) as exc:
            logger.warning("storage tier %s: unreadable index (%s); starting empty", index, exc)
            self._entries.clear()
            self.used = 0
        if not clean:
            self._collect_orphans()
        while self.used > self.capacity and self._entries:  # a smaller capacity than before
            key = next(iter(self._entries))
            self._remove(key)
        self._write_index(clean=False)  # a crash from here on is seen at the next open

    def _collect_orphans(self) -> None:
        known = {self.path_of(k).relative_to(self.directory) for k in self._entries}
        removed = 0
        for folder in self.directory.iterdir():
            if not folder.is_dir() or len(folder.name) != 2:
                continue
            for f in folder.iterdir():
                if f.relative_to(self.directory) not in known:
                    f.unlink(missing_ok=True)
                    removed += 1
        if removed:
            logger.info(
                "storage tier %s: removed %d files not in its index", self.directory, removed
            )

    def _write_index(self, *, clean: bool) -> None:
        now = time.monotonic()
        with self._lock:
            parts: dict[str, list[list[float]]] = {}
            for (name, batch), e in self._entries.items():
                parts.setdefault(name, []).append([batch, e.size, round(now - e.used, 3)])
            self._dirty = False
            self._flushed = now
        doc = {"version": 1, "clean": clean, "capacity": self.capacity, "parts": parts}
        write_file(self.directory / INDEX_FILE, json.dumps(doc).encode())

    def flush(self) -> None:
        """Write the index now if entries changed since it was last written."""
        if self._dirty and not self.closed:
            self._write_index(clean=False)

    def _maybe_flush(self) -> None:
        if self._dirty and time.monotonic() - self._flushed > FLUSH_S:
            try:
                self.flush()
            except OSError as exc:  # a full disk: the entries stay, the index is older
                logger.warning("storage tier %s: index not written: %s", self.directory, exc)

    def close(self) -> None:
        """Write the index (marked clean) and let go of the directory."""
        if self.closed:
            return
        try:
            self._write_index(clean=True)
        except OSError as exc:
            logger.warning("storage tier %s: index not written: %s", self.directory, exc)
        self.closed = True
        os.close(self.lockfd)

    # -- entries -----------------------------------------------------------------------------------
    def path_of(self, key: Key) -> Path:
        return entry_path(self.directory, key)

    @property
    def entries(self) -> int:
        return len(self._entries)

    def keys(self) -> list[Key]:
        """The keys held, in no particular order."""
        with self._lock:
            return list(self._entries)

    def get(self, part: Any, batch: int) -> memoryview | None:
        return self.get_key((part.name, batch))

    def get_key(self, key: Key) -> memoryview | None:
        """The bytes of ``key``, checked; None if not held (or dropped: damaged, gone)."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            self.counters.add(misses=1)
            return None
        data = self._read(key, entry.size)
        if data is None:
            with self._lock:
                if self._entries.get(key) is entry:
                    self._remove(key)
            self.counters.add(dropped=1, misses=1)
            return None
        entry.used = time.monotonic()
        self.counters.add(hits=1, hit_bytes=entry.size)
        return data

    def _read(self, key: Key, size: int) -> memoryview | None:
        try:
            with open(self.path_of(key), "rb", buffering=0) as f:
                raw = f.read(_HEADER.size + size + 1)
        except OSError:
            return None
        if len(raw) != _HEADER.size + size:
            return None
        magic, length, digest = _HEADER.unpack_from(raw)
        view = memoryview(raw)[_HEADER.size :]
        if magic != _MAGIC or length != size or xxhash.xxh3_64_intdigest(view) != digest:
            logger.warning(
                "storage tier %s: entry %s failed its check; fetching it again", self.directory, key
            )
            return None
        return view

    def offer(self, part: Any, batch: int, data: Any) -> None:
        self.offer_key((part.name, batch), data)

    def offer_key(self, key: Key, data: Any) -> None:
        """Keep ``data`` as ``key`` if it ranks well enough; a key held already is touched."""
        size = memoryview(data).nbytes
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.used = time.monotonic()
                return
            if self.closed or size > self.capacity:
                return
            if self.used + size > self.capacity and not self._evict(key, size):
                self.counters.add(rejected=1)
                return
            self._entries[key] = _Entry(size, time.monotonic())
            self.used += size  # counted now: concurrent offers see the room taken
        try:
            self._write(key, data, size)
        except OSError as exc:
            with self._lock:
                if key in self._entries:
                    self._remove(key)
            logger.warning("storage tier %s: cannot write an entry: %s", self.directory, exc)
            return
        self.counters.add(admitted=1, admitted_bytes=size)
        self._dirty = True
        self._maybe_flush()

    def _write(self, key: Key, data: Any, size: int) -> None:
        path = self.path_of(key)
        make_private_dir(path.parent)
        view = memoryview(data).cast("B")
        header = _HEADER.pack(_MAGIC, size, xxhash.xxh3_64_intdigest(view))
        write_file(path, header + bytes(view))

    def drop(self, part: Any, batch: int) -> None:
        self.drop_key((part.name, batch))

    def drop_key(self, key: Key) -> None:
        """Forget ``key`` (and delete its file)."""
        with self._lock:
            if key in self._entries:
                self._remove(key)

    def _remove(self, key: Key) -> None:
        """(lock held) Delete ``key``'s entry and file."""
        entry = self._entries.pop(key)
        self.used -= entry.size
        self._dirty = True
        with contextlib.suppress(OSError):
            os.unlink(self.path_of(key))

    def _evict(self, key: Key, size: int) -> bool:
        """(lock held) Make room for ``size`` bytes of ``key``: evict the entries that rank
        highest, unless ``key`` ranks above them (False: it is not admitted)."""
        need = self.used + size - self.capacity
        now = time.monotonic()
        if self._pos >= len(self._victims) or now - self.victims_at > RERANK_S:
            self._rerank(now)
        mine = float(self.rank([key], np.zeros(1))[0])
        freed, plan, pos = 0, [], self._pos
        while freed < need and pos < len(self._victims):
            k = self._victims[pos]
            pos += 1
            entry = self._entries.get(k)
            if entry is None:  # gone since the ranks were computed
                continue
            if self._victim_rank[k] < mine:  # it would stay longer than the newcomer
                return False
            plan.append(k)
            freed += entry.size
        if freed < need:
            return False
        self._pos = pos
        for k in plan:
            self.counters.add(evicted=1, evicted_bytes=self._entries[k].size)
            self._remove(k)
        return True

    def _rerank(self, now: float) -> None:
        keys = list(self._entries)
        ages = np.fromiter((now - self._entries[k].used for k in keys), np.float64, len(keys))
        ranks = self.rank(keys, ages) if keys else np.zeros(0)
        order = np.argsort(-ranks, kind="stable")
        self._victims = [keys[i] for i in order.tolist()]
        self._victim_rank = dict(zip(keys, ranks.tolist(), strict=True))
        self.victims_at, self._pos = now, 0

    def snapshot(self) -> dict[str, int]:
        """Counters, and the bytes, entries and capacity now."""
        return {
            **self.counters.snapshot(),
            "capacity_bytes": self.capacity,
            "used_bytes": self.used,
            "entries": len(self._entries),
        }
