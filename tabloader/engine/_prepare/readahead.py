"""Reads planned from the jobs' lookahead: a dataset in object storage, fetched before it is asked.

A record batch of object storage costs a request (~10 ms and more) before its rows can be
decoded. The sampler samples ahead of consumption (each job's queue of row ids, its *horizon*:
:mod:`tabloader.engine._queue.queues`), so which rows every open job takes next is known. A
:class:`ReadAhead` per such dataset reads those queues and fetches their record batches before a
decode asks for them:

* **Merged across jobs, in order of use.** The heads of the queues of every job that decodes
  from the dataset are merged by round (the sampler's clock: jobs that share a round share its
  rows), rows whose values the arena holds already are left out, and the rows' record batches
  taken in that order, each once: the *plan*.
* **Coalesced per record batch, many in flight.** Each batch is one ranged read (adjacent
  batches fetched in one pass: one read; or a hit in the storage tier,
  :mod:`tabloader.catalog.storage._tier`), up to ``IN_FLIGHT`` at once, each
  held in memory (``PartFile.load``) where the decode's read finds it (a read of a batch still
  in flight waits for that fetch: one request per batch, whoever asks).
* **Ahead by a part of the budget, kept with the rest.** Batches are fetched as far as the
  plan's first ``budget / REACH`` bytes; what was fetched stays held after its rows are decoded
  while the budget (the ``readahead_bytes`` setting, 64 MiB by default) has room, and a fetch
  that needs room lets go of the held batch used last (Belady's MIN as far as the plan
  reaches: beyond it, a batch no open job reads again this epoch first, then the least
  recently used), never one used before the batch fetched. Fetching as far as the whole
  budget would push out, before their use, batches kept for a use sooner (simulated over a
  uniform order of 4-row batches, a budget of 40% of them: ~1.7x the fetches of MIN; half of
  it within 10%; a quarter within 5%, but there the decodes of 64-row batches outran it).
* **Released when it leaves.** A batch let go (or every batch, once no job has read the
  dataset for ``IDLE_RELEASE_S``) is released and offered to the storage tier, which keeps it
  if its next use ranks well enough (:func:`rank_keys`). A batch of rows submitted for
  preparation holds its record batches (:meth:`pin` at ``Fetcher.submit``, :meth:`unpin` when
  that batch is done: its rows decoded or failed) and is never let go before.

Retries, backoff and checksum re-fetches are the store's and the reader's
(:mod:`tabloader.catalog.storage._s3`, ``DatasetReader.record_batch``): a batch the plan could not
fetch is left to the decode's own read, which reports a damaged batch's rows.

**Ranks for the tier** (:func:`rank_keys`): a kept batch goes sooner the later its next use: a
use in the lookahead ranks by its round; a batch that an open job still reads this epoch
(its remaining rows: ``FutureUses.uses``) but beyond the lookahead ranks after those; a batch
no open job reads again this epoch ranks last, least recently used first, as does any batch of
a dataset no job has open.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from tabloader.catalog._errors import StorageError
from tabloader.catalog.storage import DatasetReader
from tabloader.catalog.storage._tier import TAIL

logger = logging.getLogger(__name__)

IN_FLIGHT = 64  # fetches at once per dataset (each a request, or a read of the tier)
REACH = 2  # the plan's first budget / REACH bytes are fetched ahead (module docstring)
IDLE_RELEASE_S = 2.0  # batches are let go after this long with no job reading the dataset
MAX_PLAN_ROWS = 1 << 15  # rows of each job's queue a plan looks at, at most
IDLE_S = 0.05  # a pass at least this often while jobs are open (else when poked)
RETRY_S = 1.0  # a batch whose fetch failed is left to the decode's own read this long
_LATER = 1.0e15  # ranks (rank_keys): used this epoch, beyond the lookahead
_FAR = 2.0e15  # not used again this epoch (or nothing known): least recently used first

Head = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], list[int]]
"""A job's queue head: its next rows, their rounds, and its arena spaces."""

_PART_SHIFT = 40  # a batch's key: its part << _PART_SHIFT | its batch in the part


def _key(part: Any, batch: Any) -> Any:
    """The key of batch ``batch`` of part ``part`` (ints, or numpy arrays of them)."""
    return (part << _PART_SHIFT) | batch


def _split(key: Any) -> tuple[Any, Any]:
    """(part, batch) of a key (an int, or a numpy array of them)."""
    return key >> _PART_SHIFT, key & ((1 << _PART_SHIFT) - 1)


def queue_heads(sched: Any, limit: int) -> list[Head]:
    """The queue heads (``limit`` rows at most) of the jobs of ``sched`` (a
    ``DatasetScheduler``) that decode values (those read the payload from storage), copied
    under its lock."""
    with sched.cond:
        heads = []
        for job in sched.jobs.values():
            spaces = [space for _, space in job.plan.prepared]
            q = job.queue
            if spaces and q.q_rows.size:
                heads.append((q.q_rows[:limit].copy(), q.q_rounds[:limit].copy(), spaces))
        return heads


class ReadAhead:
    """Fetches the record batches a dataset's jobs decode next (see the module docstring).

    Args:
        reader: the dataset's reader (object storage: ``reader.ranged``), with its tier.
        heads: ``heads(limit)`` -> the jobs' queue heads (:func:`queue_heads`).
        stored: ``stored(space, rows)`` -> which rows the arena holds in ``space``.
        future: the dataset's ``FutureUses`` (ranks for the tier), or None.
        budget: bytes of batches held ahead and in flight at most.
    """

    def __init__(
        self,
        reader: DatasetReader,
        *,
        heads: Callable[[int], list[Head]],
        stored: Callable[[int, npt.NDArray[np.int64]], npt.NDArray[np.bool_]],
        future: Any = None,
        budget: int = 64 << 20,
    ) -> None:
        self.reader, self.heads, self.stored = reader, heads, stored
        self.future, self.budget = future, budget
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._held: dict[int, int] = {}  # key (_key) -> its bytes, held by us
        self._flying: dict[int, int] = {}  # key -> bytes, being fetched by us
        self._pins: dict[int, int] = {}  # key -> batches of rows submitted that need it
        self._work_keys: dict[int, npt.NDArray[np.int64]] = {}  # id(work) -> its keys
        # id(work) -> (its seq, rows, arena spaces): batches submitted, not looked up yet
        self._waiting: dict[int, tuple[int, npt.NDArray[np.int64], list[int]]] = {}
        self._failed: dict[int, float] = {}  # key -> when its fetch failed
        self._sizes: dict[int, float] = {}  # part -> mean batch bytes (before it is opened)
        self._last: dict[int, float] = {}  # key -> when a batch of rows last needed it
        self._busy = time.monotonic()  # when a job last had rows planned or pinned
        self.fetched = 0  # batches fetched ahead (from the store or the tier)
        self.peak_bytes = 0  # the most held and in flight at once
        self._closed = False
        self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="tabloader-readahead")
        self._thread = threading.Thread(target=self._run, name="tabloader-readahead", daemon=True)
        self._thread.start()

    # -- the engine's side ---------------------------------------------------------------------
    def poke(self) -> None:
        """Plan again soon (a batch was cut, a fetch landed)."""
        self._wake.set()

    def pin(self, work: Any) -> None:
        """``work``'s rows will be read: hold their batches (if held) until :meth:`unpin`, and
        fetch them first of all until :meth:`started`."""
        keys = self._keys(work.rows)
        spaces = [space for _, space in work.plan.prepared]
        with self._lock:
            self._work_keys[id(work)] = keys
            self._waiting[id(work)] = (work.seq, work.rows, spaces)
            now = time.monotonic()
            for k in keys.tolist():
                self._pins[k] = self._pins.get(k, 0) + 1
                self._last[k] = now
        self.poke()

    def started(self, work: Any) -> None:
        """``work``'s rows were looked up (found, or claimed for their decode): its batches
        are no longer fetched ahead (still held until :meth:`unpin`)."""
        with self._lock:
            self._waiting.pop(id(work), None)

    def unpin(self, work: Any) -> None:
        """``work`` is done (its rows decoded, or failed): its batches may go."""
        with self._lock:
            self._waiting.pop(id(work), None)
            keys = self._work_keys.pop(id(work), None)
            if keys is None:
                return
            for k in keys.tolist():
                n = self._pins.pop(k) - 1
                if n:
                    self._pins[k] = n
                elif k not in self._held:
                    self._last.pop(k, None)
        self.poke()

    def held_bytes(self) -> int:
        """Bytes held ahead and in flight now."""
        with self._lock:
            return sum(self._held.values()) + sum(self._flying.values())

    def close(self) -> None:
        """Stop planning; let go of every batch held."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            held, self._held = list(self._held), {}
        self._release(held)

    # -- planning -----------------------------------------------------------------------------
    def _keys(self, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        if rows.size == 0:
            return np.empty(0, np.int64)
        part, batch, _ = self.reader.locate(rows)
        return np.unique(_key(part, batch))

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(IDLE_S)
            self._wake.clear()
            if self._closed:
                return
            try:
                self._pass()
            except Exception:  # planning is an optimization: reads still happen without it
                logger.exception("read-ahead of %s failed; retrying", self.reader.dataset)
                time.sleep(IDLE_S)

    def _plan(self) -> list[int]:
        """The batches of the jobs' next rows, in order of first use, each once."""
        limit = min(MAX_PLAN_ROWS, max(64, int(self.budget // self._row_bytes())))
        with self._lock:  # batches submitted first (before any queued row), in their order
            waiting = sorted(self._waiting.values(), key=lambda w: int(w[0]))
        base = -(len(waiting) + 1)  # rounds before every queued one
        heads = [
            (rows, np.full(rows.size, base + i, np.int64), spaces)
            for i, (_, rows, spaces) in enumerate(waiting)
        ]
        heads += self.heads(limit)
        if not heads:
            return []
        rows_all, rounds_all = [], []
        for rows, rounds, spaces in heads:
            need = np.zeros(rows.size, bool)
            for space in spaces:  # a row the arena holds for every space needs no read
                need |= ~self.stored(space, rows)
            rows_all.append(rows[need])
            rounds_all.append(rounds[need])
        rows = np.concatenate(rows_all)
        if rows.size == 0:
            return []
        rows = rows[np.argsort(np.concatenate(rounds_all), kind="stable")]
        part, batch, _ = self.reader.locate(rows)
        keys = _key(part, batch)
        uniq, first = np.unique(keys, return_index=True)
        return uniq[np.argsort(first)].tolist()  # type: ignore[no-any-return]

    def _row_bytes(self) -> float:
        parts = self.reader.parts
        return max(1.0, sum(p.file_size for p in parts) / max(1, self.reader.num_rows))

    def _pass(self) -> None:
        planned = self._plan()
        now = time.monotonic()
        todo: list[int] = []
        gone: list[int] = []
        with self._lock:
            if planned or self._pins:
                self._busy = now
            elif now - self._busy > IDLE_RELEASE_S:  # no job reads the dataset: let all go
                gone, self._held = list(self._held), {}
                self._last.clear()  # (recency of batches no longer held)
            total = float(sum(self._held.values()) + sum(self._flying.values()))
            victims: list[tuple[int, float]] | None = None  # held, the farthest next use last
            at_of: set[int] | None = None  # the planned batches
            reach = 0.0
            for at, key in enumerate(planned):
                size = self._size_of(key)
                if reach >= self.budget / REACH or len(self._flying) >= IN_FLIGHT:
                    break
                reach += size
                if not self._idle(key, now):
                    continue
                if total + size > self.budget:
                    if victims is None:
                        victims = self._victims(planned)
                    while victims and total + size > self.budget:
                        victim, use = victims[-1]
                        if use <= at:  # every batch held is used before this one
                            break
                        victims.pop()
                        total -= self._held.pop(victim)
                        self._last.pop(victim, None)
                        gone.append(victim)
                    if total + size > self.budget:
                        break
                self._flying[key] = int(size)
                total += size
                todo.append(key)
                if at_of is None:
                    at_of = set(planned)
                for nb in (key - 1, key + 1):  # planned later, but one request with this one
                    nb_size = self._size_of(nb) if nb in at_of else 0.0
                    if nb_size and total + nb_size <= self.budget and self._idle(nb, now):
                        self._flying[nb] = int(nb_size)
                        total += nb_size
                        todo.append(nb)
            self.peak_bytes = max(self.peak_bytes, int(total))
        self._release(gone)
        for run in _runs(todo):
            try:
                self._pool.submit(self._fetch, run)
            except RuntimeError:  # closing
                with self._lock:
                    for key in run:
                        self._flying.pop(key, None)

    def _idle(self, key: int, now: float) -> bool:
        """(lock held) Whether batch ``key`` may be fetched now: not held, not in flight, and
        not failed within ``RETRY_S``."""
        if key in self._held or key in self._flying:
            return False
        return now - self._failed.get(key, -RETRY_S) >= RETRY_S

    def _victims(self, planned: list[int]) -> list[tuple[int, float]]:
        """(lock held) The held batches no batch of rows submitted needs, with their next use
        (a place in ``planned``), the farthest last: beyond the plan, one no open job reads
        again this epoch before one it does, least recently used first."""
        at = {key: i for i, key in enumerate(planned)}
        free = [k for k in self._held if not self._pins.get(k)]
        later = [k for k in free if k not in at]
        again = self._used_again(later)
        far = float(len(planned))
        uses = {k: float(at[k]) for k in free if k in at}
        order = sorted(later, key=lambda k: (k not in again, -self._last.get(k, 0.0)))
        for i, k in enumerate(order):
            uses[k] = far + 1 + i
        return sorted(uses.items(), key=lambda kv: kv[1])

    def _used_again(self, keys: list[int]) -> set[int]:
        """(lock held) Those of ``keys`` whose rows an open job reads later this epoch."""
        if self.future is None or not keys:
            return set()
        arr = np.array(keys, np.int64)
        out: set[int] = set()
        parts, batches = _split(arr)
        for part in np.unique(parts).tolist():
            mine = parts == part
            ranks = self.ranks(part, batches[mine])
            out.update(arr[mine][ranks < _FAR].tolist())
        return out

    def _size_of(self, key: int) -> float:
        """(lock held) A batch's bytes: exact once its part is open, else its part's mean."""
        part = _split(key)[0]
        size = self._sizes.get(part)
        if size is None:
            info = self.reader.parts[part]
            size = self._sizes[part] = info.file_size / max(1, info.num_batches)
        return size

    def _fetch(self, keys: list[int]) -> None:
        """Fetch ``keys``, adjacent batches of one part (one request: ``PartFile.load``
        merges them), and hold them."""
        part, batches = _split(keys[0])[0], [_split(k)[1] for k in keys]
        try:
            file = self.reader.part_file(part)
            file.load(batches, self.reader.tier)
        except Exception as exc:  # the decode's own read tries again, and reports it
            logger.debug(
                "read-ahead of %s part %d batches %s failed: %s",
                self.reader.dataset,
                part,
                batches,
                exc,
            )
            with self._lock:
                now = time.monotonic()
                for key in keys:
                    self._flying.pop(key, None)
                    self._failed[key] = now
            return
        with self._lock:
            for key, batch in zip(keys, batches, strict=True):
                self._flying.pop(key, None)
                self._failed.pop(key, None)
                self._held[key] = file.batch_bytes(batch)
            self.fetched += len(keys)
            closed = self._closed
        if closed:
            with self._lock:
                for key in keys:
                    self._held.pop(key, None)
            file.release(batches, self.reader.tier)
        self.poke()

    def _release(self, keys: Sequence[int]) -> None:
        for key in keys:
            part, batch = _split(key)
            with contextlib.suppress(StorageError, OSError):  # (open since it was fetched)
                self.reader.part_file(part).release([batch], self.reader.tier)

    # -- ranks for the tier ----------------------------------------------------------------------
    def ranks(self, part: int, batches: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        """How soon each of ``batches`` of part ``part`` may leave the tier (module
        docstring), least recently used aside (``rank_keys`` adds it)."""
        out = np.full(batches.size, _FAR)
        future = self.future
        if future is None or batches.size == 0:
            return out
        info = self.reader.parts[part]
        first = info.first_id + batches * info.rows_per_batch
        ends = np.minimum(first + info.rows_per_batch, info.end_id)
        counts = np.maximum(ends - first, 1)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        rows = np.repeat(first - starts, counts) + np.arange(int(counts.sum()))
        nxt = np.full(rows.size, np.inf)
        uses = np.zeros(rows.size)
        for space in list(future.next_round):
            n, u = future.of(space, rows)
            nxt = np.minimum(nxt, n)
            uses = np.maximum(uses, u)
        nxt_b = np.minimum.reduceat(nxt, starts)
        uses_b = np.maximum.reduceat(uses, starts)
        out[uses_b > 0] = _LATER
        known = np.isfinite(nxt_b)
        out[known] = np.maximum(nxt_b[known], 0)
        return out


def _runs(keys: list[int]) -> list[list[int]]:
    """``keys`` in runs of adjacent batches of one part (each run one request)."""
    runs: list[list[int]] = []
    for key in sorted(keys):
        if runs and key == runs[-1][-1] + 1 and _split(key)[0] == _split(runs[-1][-1])[0]:
            runs[-1].append(key)
        else:
            runs.append([key])
    return runs


def rank_keys(
    owners: Callable[[str], tuple[ReadAhead, int] | None],
    keys: Sequence[tuple[str, int]],
    ages: npt.NDArray[np.float64],
) -> npt.NDArray[np.float64]:
    """The tier's ranks of ``keys`` (part name, batch), higher out sooner: a use in the
    lookahead by its round, a use later this epoch after those, no use again this epoch (or
    no open job's dataset: ``owners(name)`` is None) last; ties least recently used first
    (``ages``); a part's tail never before a batch."""
    ranks = _FAR + ages
    by_name: dict[str, list[int]] = {}
    for i, (name, batch) in enumerate(keys):
        if batch == TAIL:
            ranks[i] = -1.0
        else:
            by_name.setdefault(name, []).append(i)
    for name, idx in by_name.items():
        owner = owners(name)
        if owner is None:
            continue
        ahead, part = owner
        at = np.array(idx, np.intp)
        batches = np.array([keys[i][1] for i in idx], np.int64)
        base = ahead.ranks(part, batches)
        ranks[at] = np.where(base >= _LATER, base + ages[at], base)
    return ranks
