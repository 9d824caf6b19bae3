"""The shared loading engine: jobs on threads, one sampler and one cache for all of them.

Data flow, per dataset::

    scheduler --sample_many(every job below its horizon)--> slots (row, epoch) queued per job
    the first ``prefetch`` batches of a job's queue are loaded by the worker pool:
        RowCache.get_or_load((row, "dataset/column@params")) -> read from IPC, decode once
    job's consumer (next(stream)) waits for its next batch_size slots, collates, unpins.

* **Rounds with many jobs.** A job that needs rows (its queue is shorter than ``prefetch``
  batches) triggers a round, and every job whose queue is shorter than its *horizon*
  (``lookahead`` rows, several batches) takes part. So jobs consuming at about the same pace
  take part in the same rounds and get the same rows, even though their consumers wake up at
  different moments; ids are cheap, so sampling ahead costs nothing but a queue.
* **Loading lazily.** Only the first ``prefetch`` batches of a queue are loaded (and pinned);
  a row further back counts as a reference for the cache and its next use is known (the
  round that sampled it), so the cache evicts the farthest next use first (Belady inside the
  horizon), then the lowest reference count: a row that one job has loaded stays cached for
  the job that will ask for it later.
* **Own pace.** A slow job's queue reaches its horizon and it stops taking part in rounds;
  the fast jobs go on alone. Nobody waits for anybody.
* **Pins.** A loaded row is pinned for its job until the job consumes it, so rows handed out
  but not yet consumed are never evicted.
* **Epochs.** Batches never straddle an epoch; the last batch of an epoch may be short.
* **Errors.** A row that fails to read or decode raises ``RowReadError`` (with its ``_id``)
  in every job that reaches it, in the consumer's thread with the worker's traceback; the
  batch is dropped and the stream stays usable. With ``on_error="skip"`` the row is left out
  of the batch and counted in ``stats()``. Other jobs never see another job's failures.

The engine does not know how jobs are attached: the in-process ``JobStream`` here, and
``tabloader.torch.JobDataset`` on top of it, use the same ``Loader``.
"""

from __future__ import annotations

import atexit
import bisect
import enum
import functools
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from pyroaring import BitMap

from catalog import Catalog, connect
from catalog.bitmaps import bitmap_to_array
from catalog.errors import LoaderError
from catalog.storage import DatasetReader
from tabloader.cache import CacheKey, RowCache
from tabloader.prep import DecodeKind, Decoder, collate, decoder_for
from tabloader.sampling import SAMPLERS

if TYPE_CHECKING:
    from catalog import Dataset, Job

__all__ = ["JobStream", "Loader", "OnError", "default_loader"]

logger = logging.getLogger(__name__)

ID = "_id"
ROUNDS_PER_CALL = 32  # rounds the scheduler samples at once (bounded by the jobs' room)
LOOKAHEAD_BATCHES = 4  # default horizon, in batches
ABANDONED_CHECK_S = 1.0  # how often an idle scheduler looks for streams dropped without close()


class OnError(enum.Enum):
    """What a job does with a row that fails to read or decode."""

    RAISE = "raise"
    SKIP = "skip"


class _Slot:
    """One sampled row of one job: filled by a worker, consumed by the job."""

    __slots__ = ("done", "epoch", "error", "keys", "round", "row", "submitted", "values")

    def __init__(self, row: int, epoch: int, round_: int) -> None:
        self.row = row
        self.epoch = epoch
        self.round = round_  # the scheduler's round that sampled it: when it will be used
        self.submitted = False
        self.values: dict[str, Any] | None = None
        self.keys: list[CacheKey] = []
        self.error: BaseException | None = None
        self.done = threading.Event()


@dataclass
class _JobState:
    name: str
    ids: BitMap
    decoders: list[Decoder]
    batch_size: int
    window: int  # rows loaded ahead (prefetch batches)
    horizon: int  # rows sampled ahead
    on_error: OnError
    id_array: np.ndarray = field(default_factory=lambda: np.empty(0, np.intp))  # ``ids``
    epochs: int | None = None  # stop sampling after this many epochs (None: never)
    epoch: int = 0  # epoch of the rows the sampler hands out next
    left: int = 0  # rows of that epoch the sampler still has to hand out
    pending: deque[_Slot] = field(default_factory=deque)
    closed: bool = False
    abandoned: bool = False  # its stream was garbage-collected without close()
    # statistics
    batches: int = 0
    rows: int = 0
    skipped: int = 0
    requests: int = 0  # values (row x column) its fetches asked the cache for
    loaded: int = 0  # of those, values it read and prepared itself (no other job had)
    wait_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def next_epoch(self) -> int:
        """The epoch of the job's next batch (call under the group's lock)."""
        if self.pending:
            return self.pending[0].epoch
        return self.epoch + 1 if self.left == 0 else self.epoch

    def stats(self) -> dict[str, Any]:
        """Counters of the job (call under the group's lock); see ``JobStream.stats``."""
        elapsed = time.perf_counter() - self.started
        return {
            "job": self.name,
            "batches": self.batches,
            "rows": self.rows,
            "epoch": self.next_epoch(),
            "skipped": self.skipped,
            "requests": self.requests,
            "loaded": self.loaded,
            "shared": self.requests - self.loaded,
            "wait_s": self.wait_s,
            "rows_per_s": self.rows / elapsed if elapsed > 0 else 0.0,
        }

    def room(self) -> int:
        """Rows the scheduler may sample for this job now (up to its horizon)."""
        if self.left == 0 and self.epochs is not None and self.epoch + 1 >= self.epochs:
            return 0
        return self.horizon - len(self.pending)

    def finished(self) -> bool:
        """True once the next batch would belong to epoch ``epochs`` (counted from 0)."""
        return self.epochs is not None and self.next_epoch() >= self.epochs

    def hungry(self) -> bool:
        """True if the job has fewer rows queued than it loads ahead (it triggers a round)."""
        return self.room() > 0 and len(self.pending) < self.window


class _Group:
    """One dataset: its reader, sampler, jobs and scheduler thread."""

    def __init__(self, loader: Loader, dataset: Dataset, sampler: Any) -> None:
        self.loader = loader
        self.name = dataset.name
        # Future uses of each row, per decoder key: one per open job reading the key that still
        # needs the row this epoch (in the sampler's remaining set, or sampled and queued but
        # not loading yet). Kept up to date under ``cond`` and read without it by the cache's
        # eviction (a stale count only makes one eviction choice slightly worse): scoring had
        # to wait for ``cond`` and held it, and the workers queued behind it.
        self.uses: dict[str, np.ndarray] = {}
        # Lookahead: the round of each row's next queued (sampled, not loading) use, per
        # decoder key, inf if none; the cache evicts the farthest (Belady inside the horizon,
        # RefCnt beyond it). ``queued`` holds the rounds behind it (ascending).
        self.next_round: dict[str, np.ndarray] = {}
        self.queued: dict[str, dict[int, list[int]]] = {}
        self.round = 0
        self.set_dataset(dataset)
        self.sampler = sampler
        self.jobs: dict[str, _JobState] = {}
        self.cond = threading.Condition()
        self.closed = False
        self.error: BaseException | None = None
        self.reads = 0
        self.decodes = 0
        self.bytes_read = 0
        self.counters_lock = threading.Lock()  # reads/decodes, off the hot condition
        self.thread = threading.Thread(
            target=self._schedule, name=f"tabloader-sched-{self.name}", daemon=True
        )
        self.thread.start()

    def set_dataset(self, dataset: Dataset) -> None:
        """Read ``dataset`` (a version at least as new as every open job's) with ``pread``."""
        self.dataset = dataset
        for arrays, fill in ((self.uses, 0), (self.next_round, np.inf)):
            for key, old in arrays.items():  # appended rows: no uses yet
                grown = np.full(dataset.num_rows, fill, dtype=old.dtype)
                grown[: old.size] = old
                arrays[key] = grown
        self.reader = DatasetReader(
            dataset.reader.root, dataset.reader.parts, dataset.reader.schema, memory_map=False
        )

    # -- scheduling ----------------------------------------------------------------------------
    def _schedule(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.closed and not any(j.hungry() for j in self.jobs.values()):
                        if self._close_abandoned_locked():
                            continue
                        self.cond.wait(ABANDONED_CHECK_S)
                    if self.closed:
                        return
                    self._sample_locked()
                    for job in self.jobs.values():
                        self.activate_locked(job)
                    self.cond.notify_all()  # consumers waiting for their next batch's rows
        except BaseException as exc:  # surfaces in every consumer of this dataset
            logger.exception("scheduler of %s failed", self.name)
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def _close_abandoned_locked(self) -> bool:
        """Close the jobs whose streams were dropped without close(); True if there were."""
        gone = [j for j in self.jobs.values() if j.abandoned]
        for job in gone:
            logger.warning("job %s: its stream was dropped without close(); closing it", job.name)
            self.loader._close_job(self, job)
        return bool(gone)

    def _sample_locked(self) -> None:
        """One call of ``sample_many`` for every job below its horizon."""
        want = [j for j in self.jobs.values() if j.room() > 0]
        for j in want:
            if j.left == 0:  # the sampler starts the job's next epoch on this call
                j.epoch += 1
                j.left = len(j.ids)
                self.count_uses_locked(j, j.id_array, +1)
        k = min(ROUNDS_PER_CALL, *(j.room() for j in want), *(j.left for j in want))
        ids = self.sampler.sample_many([j.name for j in want], k)
        base, self.round = self.round, self.round + k
        for j in want:
            j.left -= k
            for r, row in enumerate(ids[j.name].tolist()):  # remaining -> queued: same uses
                slot = _Slot(row, j.epoch, base + r)
                j.pending.append(slot)
                for dec in j.decoders:
                    rounds = self.queued[dec.key].setdefault(row, [])
                    bisect.insort(rounds, slot.round)  # jobs of one call share rounds
                    self.next_round[dec.key][row] = rounds[0]

    def activate_locked(self, job: _JobState) -> None:
        """Submit loads for the slots in the job's first ``window`` rows (under the lock)."""
        for i, slot in enumerate(job.pending):
            if i == job.window:
                break
            if not slot.submitted:
                slot.submitted = True
                self.unqueue_locked(job, slot)  # loading now: pinned, not a future use
                self.loader._pool.submit(self._fetch, job, slot)

    def unqueue_locked(self, job: _JobState, slot: _Slot) -> None:
        """A queued slot leaves the queue (it is loading, or its job left)."""
        row = slot.row
        for dec in job.decoders:
            self.uses[dec.key][row] -= 1
            queued = self.queued[dec.key]
            rounds = queued[row]
            rounds.remove(slot.round)
            if not rounds:
                del queued[row]
            self.next_round[dec.key][row] = rounds[0] if rounds else np.inf

    def count_uses_locked(self, job: _JobState, rows: np.ndarray, delta: int) -> None:
        """Add ``delta`` future uses of ``rows`` for every column ``job`` reads."""
        for dec in job.decoders:
            counts = self.uses.get(dec.key)
            if counts is None:
                counts = self.uses[dec.key] = np.zeros(self.dataset.num_rows, dtype=np.int32)
                self.next_round[dec.key] = np.full(self.dataset.num_rows, np.inf)
                self.queued[dec.key] = {}
            counts[rows.astype(np.intp, copy=False)] += delta

    # -- loading (worker threads) ----------------------------------------------------------------
    def _fetch(self, job: _JobState, slot: _Slot) -> None:
        cache, row = self.loader._cache, slot.row
        try:
            values: dict[str, Any] = {}
            for dec in job.decoders:  # a missing column is read alone: a cached one is not
                key = (row, f"{self.name}/{dec.key}")
                values[dec.column] = cache.get_or_load(
                    key, functools.partial(self._load, job, row, dec)
                )
                slot.keys.append(key)
            slot.values = values
        except BaseException as exc:
            slot.error = exc
        with self.cond:  # not notified: the consumer waits on ``done`` (10k wake-ups saved)
            job.requests += len(slot.keys)
            closed = job.closed
            slot.done.set()
        if closed:
            cache.release(slot.keys)

    def _load(self, job: _JobState, row: int, dec: Decoder) -> tuple[Any, int]:
        batch, index = self.reader.row(row, (dec.column,))
        value = batch.column(0)[index]
        payload = isinstance(value, pa.BinaryScalar | pa.LargeBinaryScalar) and value.is_valid
        prepared = dec(value, row_id=row)
        with self.counters_lock:  # reads count payload (binary) values: the I/O that matters
            self.reads += payload
            self.bytes_read += value.as_buffer().size if payload else 0
            self.decodes += dec.kind is DecodeKind.IMAGE
            job.loaded += 1
        return prepared

    # -- reference counts and next uses (called by the cache, lock-free) --------------------------
    def refcounts(self, rows: np.ndarray, key: str) -> np.ndarray:
        """Uses of each row still to come (see ``uses``)."""
        counts = self.uses.get(key)
        if counts is None:
            return np.zeros(len(rows), dtype=np.int64)
        return counts[np.asarray(rows, dtype=np.intp)].astype(np.int64)

    def next_uses(self, rows: np.ndarray, key: str) -> np.ndarray:
        """Round of each row's next queued use (inf: none queued; see ``next_round``)."""
        nxt = self.next_round.get(key)
        if nxt is None:
            return np.full(len(rows), np.inf)
        return nxt[np.asarray(rows, dtype=np.intp)]

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join()


class JobStream:
    """The batches of one job; iterate it, or call ``next_batch()``.

    Iterating yields batches until ``epochs`` epochs are done (forever if None); ``iter_epoch``
    yields the batches of the current epoch only. Close it (or use ``with``) to leave: its pins
    are released and the other jobs are not disturbed.
    """

    def __init__(self, loader: Loader, group: _Group, job: _JobState) -> None:
        self._loader = loader
        self._group = group
        self._job = job
        # A stream dropped without close() (its training thread died): the scheduler closes
        # the job. The finalizer only sets a flag: it may run inside any lock, on any thread.
        weakref.finalize(self, setattr, job, "abandoned", True)

    @property
    def name(self) -> str:
        """The job name."""
        return self._job.name

    @property
    def epoch(self) -> int:
        """The epoch of the next batch (0-based)."""
        with self._group.cond:
            return self._job.next_epoch()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while (batch := self._take_batch(None)) is not None:
            yield batch

    def iter_epoch(self) -> Iterator[dict[str, Any]]:
        """Yield the remaining batches of the current epoch."""
        epoch = self.epoch
        while (batch := self._take_batch(epoch)) is not None:
            yield batch

    def next_batch(self) -> dict[str, Any]:
        """Return the next batch: a dict of column -> array (``_id`` included).

        Raises:
            LoaderError: the stream is closed (also while waiting), its scheduler failed, or
                it has delivered the ``epochs`` it was opened for.
            RowReadError: a row of the batch failed (``on_error="raise"``).
        """
        batch = self._take_batch(None)
        if batch is None:
            raise LoaderError(
                f"Job stream {self._job.name!r} has delivered its {self._job.epochs} epoch(s); "
                "open the job again (or with epochs=None) to read on."
            )
        return batch

    def _take_batch(self, epoch: int | None) -> dict[str, Any] | None:
        """The next batch, or None at the end of ``epoch`` (if given) or of the last epoch.

        A batch whose rows were all skipped (``on_error="skip"``) is not returned: the next one
        of the same epoch is.
        """
        job, group = self._job, self._group
        while True:
            t0 = time.perf_counter()
            with group.cond:
                while True:
                    self._check_open()
                    if group.error is not None:
                        raise LoaderError(
                            f"The scheduler of dataset {group.name!r} failed: {group.error!r}"
                        ) from group.error
                    if job.finished() or (epoch is not None and self._job.next_epoch() != epoch):
                        return None
                    slots = self._next_slots()
                    if slots is not None:
                        break
                    group.cond.wait()
            for slot in slots:  # loading already (the first ``window`` slots are submitted)
                while not slot.done.wait(0.5):
                    self._check_open()
            with group.cond:
                self._check_open()
                for _ in slots:
                    job.pending.popleft()
                group.activate_locked(job)
                group.cond.notify_all()  # room for the scheduler
            job.wait_s += time.perf_counter() - t0
            batch = self._collate(slots)
            if batch is not None:
                return batch

    def _collate(self, slots: list[_Slot]) -> dict[str, Any] | None:
        """The batch of ``slots`` (None if every row was skipped); releases their pins."""
        job = self._job
        rows, keys, errors = [], [], []
        for slot in slots:
            keys += slot.keys
            if slot.error is not None:
                errors.append(slot.error)
            elif slot.values is not None:
                rows.append({ID: slot.row, **slot.values})
        try:
            batch = collate(rows) if rows else None
        finally:
            self._loader._cache.release(keys)
        if errors:
            if job.on_error is OnError.RAISE:
                raise errors[0]
            job.skipped += len(errors)
            for e in errors:
                logger.warning("job %s skipped a row: %s", job.name, e)
        job.batches += batch is not None
        job.rows += len(rows)
        return batch

    def _check_open(self) -> None:
        if self._job.closed:
            raise LoaderError(f"Job stream {self._job.name!r} is closed; open the job again.")

    def _next_slots(self) -> list[_Slot] | None:
        """The next batch's slots once they are all sampled, else None (call under the lock).

        A batch is the first ``batch_size`` queued rows of one epoch, or fewer when they are
        the last rows of their epoch (the sampler has handed out the whole epoch).
        """
        job = self._job
        if not job.pending:
            return None
        epoch = job.pending[0].epoch
        slots: list[_Slot] = []
        for slot in job.pending:
            if slot.epoch != epoch or len(slots) == job.batch_size:
                break
            slots.append(slot)
        last = epoch < job.epoch or job.left == 0
        if len(slots) < job.batch_size and not last:
            return None
        return slots

    def state_dict(self) -> dict[str, Any]:
        """Where the job is: its epoch and the rows of that epoch it has not received yet."""
        job, group = self._job, self._group
        with group.cond:
            epoch = self._job.next_epoch()
            rows = BitMap(s.row for s in job.pending if s.epoch == epoch)
            if epoch == job.epoch and job.left > 0:
                rows |= group.sampler.remaining(job.name)
            elif epoch > job.epoch:  # nothing of the next epoch handed out yet
                rows = BitMap(job.ids)
        return {"job": job.name, "epoch": epoch, "remaining": rows.serialize()}

    def stats(self) -> dict[str, Any]:
        """The job's counters so far.

        ``batches``, ``rows`` and ``skipped`` rows delivered; the ``epoch`` of the next batch;
        ``requests``: values (row x column) fetched for the job, ``loaded``: those it read and
        prepared itself, ``shared``: those another job's read served (cached or in flight);
        ``wait_s``: seconds spent waiting for batches; ``rows_per_s``.
        """
        with self._group.cond:
            return self._job.stats()

    def close(self) -> None:
        """Leave: unregister from sampling and release this job's pins."""
        self._loader._close_job(self._group, self._job)

    def __enter__(self) -> JobStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Loader:
    """One engine for every job of this process: a sampler per dataset, one cache, one pool.

    Args:
        catalog: a ``Catalog`` or its directory (default: ``$TABLOADER_CATALOG`` or
            ``./catalog``).
        cache_bytes: the cache capacity in bytes.
        workers: reader/decoder threads (default: the number of CPUs, at least 2).
        sampler: ``"dependent"`` (shared order) or ``"independent"`` (the baseline).
        seed: seed of the samplers (same seed, same calls: same order).
        sample_size: eviction candidates per eviction (None: exact, O(n)).

    Example:
        >>> loader = Loader(cat, cache_bytes=1 << 30)              # doctest: +SKIP
        >>> for batch in loader.open("resnet18", batch_size=64):   # doctest: +SKIP
        ...     train_step(batch["image"], batch["label"])
    """

    def __init__(
        self,
        catalog: Catalog | str | os.PathLike[str] | None = None,
        *,
        cache_bytes: int = 1 << 30,
        workers: int | None = None,
        sampler: str = "dependent",
        seed: int | None = 0,
        sample_size: int | None = 32,
    ) -> None:
        if sampler not in SAMPLERS:
            raise LoaderError(
                f"Unknown sampler {sampler!r}; use one of {', '.join(sorted(SAMPLERS))}."
            )
        self._owns_catalog = not isinstance(catalog, Catalog)
        self.catalog = (
            catalog
            if isinstance(catalog, Catalog)
            else connect(Path(catalog) if catalog is not None else None)
        )
        self._sampler_cls = SAMPLERS[sampler]
        self._seed = seed
        self._cache = RowCache(
            cache_bytes,
            refcount=functools.partial(self._score, _Group.refcounts),
            next_use=functools.partial(self._score, _Group.next_uses),
            sample_size=sample_size,
        )
        self._pool = ThreadPoolExecutor(
            max_workers=workers or max(2, os.cpu_count() or 2), thread_name_prefix="tabloader-io"
        )
        self._groups: dict[str, _Group] = {}
        self._lock = threading.Lock()
        self._closed = False
        _LIVE_LOADERS.add(self)

    def _score(
        self, fn: Callable[[_Group, np.ndarray, str], np.ndarray], rows: np.ndarray, column: str
    ) -> np.ndarray:
        """The cache's ``refcount``/``next_use``: ``column`` is ``dataset/decoder key``."""
        dataset, _, key = column.partition("/")
        group = self._groups.get(dataset)
        if group is None:  # a dataset no job reads any more: nothing to come
            return np.zeros(len(rows)) if fn is _Group.refcounts else np.full(len(rows), np.inf)
        return fn(group, rows, key)

    def open(
        self,
        job: str | Job,
        *,
        batch_size: int | None = None,
        prefetch: int = 2,
        lookahead: int | None = None,
        image_size: int | tuple[int, int] | None = None,
        on_error: str | OnError = OnError.RAISE,
        epochs: int | None = None,
        state: dict[str, Any] | None = None,
    ) -> JobStream:
        """Start consuming a registered job.

        Args:
            job: the job name (or ``Job``).
            batch_size: rows per batch (default: the job's ``batch_size`` option, else 32).
            prefetch: batches loaded ahead of consumption (pinned in the cache).
            lookahead: rows sampled ahead (default 4 batches); more lets jobs at different
                moments share rounds, at the cost of a longer queue of ids.
            image_size: shared deterministic resize of image columns (default: the job's
                ``image_size`` option, else full size).
            on_error: ``"raise"`` (default) or ``"skip"`` rows that fail to read or decode.
            epochs: stop iterating after this many epochs (None: never).
            state: a ``JobStream.state_dict()`` to resume from, mid-epoch.

        Raises:
            JobNotFoundError: no such job. LoaderError: bad options, or the job is open already.
        """
        if self._closed:
            raise LoaderError("The loader is closed; create a new Loader.")
        with self._lock:
            info = job if not isinstance(job, str) else self.catalog.job(job)
            options = info.options
            batch_size = int(options.get("batch_size", 32) if batch_size is None else batch_size)
            if batch_size < 1 or prefetch < 1:
                raise LoaderError(
                    f"batch_size ({batch_size}) and prefetch ({prefetch}) must be at least 1."
                )
            size = image_size if image_size is not None else options.get("image_size")
            try:
                mode = OnError(on_error)
            except ValueError:
                raise LoaderError(
                    f"on_error={on_error!r} is not a policy; use 'raise' or 'skip'."
                ) from None
            group = self._groups.get(info.dataset)
            if group is None or group.dataset.version < info.dataset_version:
                dataset = self.catalog.dataset(info.dataset)
                if group is None:
                    group = _Group(self, dataset, self._sampler_cls(seed=self._seed))
                    self._groups[info.dataset] = group
                else:
                    group.set_dataset(dataset)
            schema = group.dataset.schema
            decoders = [
                decoder_for(
                    schema.field(c), image_size=size if _is_image(schema.field(c)) else None
                )
                for c in info.columns
            ]
        state_obj = _JobState(
            info.name,
            info.ids,
            decoders,
            batch_size,
            window=batch_size * prefetch,
            horizon=max(lookahead or LOOKAHEAD_BATCHES * batch_size, batch_size * prefetch),
            on_error=mode,
            id_array=bitmap_to_array(info.ids),
            epochs=epochs,
        )
        with group.cond:
            if info.name in group.jobs:
                raise LoaderError(
                    f"Job {info.name!r} is open already in this loader; close its stream first."
                )
            if state is None:
                group.sampler.add_job(info.name, info.ids)
                remaining = info.ids
            else:
                remaining, epoch = _check_state(state, info)
                group.sampler.add_job(info.name, info.ids, remaining=remaining, epoch=epoch)
                state_obj.epoch = epoch
            state_obj.left = len(remaining)
            group.count_uses_locked(state_obj, bitmap_to_array(remaining), +1)
            group.jobs[info.name] = state_obj
            group.cond.notify_all()
        logger.info("job %s opened on %s (%d rows)", info.name, info.dataset, len(info.ids))
        return JobStream(self, group, state_obj)

    def _close_job(self, group: _Group, job: _JobState) -> None:
        with group.cond:
            if job.closed:
                return
            job.closed = True
            group.jobs.pop(job.name, None)
            for slot in job.pending:
                if not slot.submitted:
                    group.unqueue_locked(job, slot)
            if job.left:  # the rows of this epoch that the sampler still had for the job
                group.count_uses_locked(job, bitmap_to_array(group.sampler.remaining(job.name)), -1)
            group.sampler.remove_job(job.name)
            done = [s for s in job.pending if s.done.is_set()]
            job.pending.clear()
            group.cond.notify_all()
        self._cache.release([k for s in done for k in s.keys])

    def stats(self) -> dict[str, Any]:
        """Counters, overall and per open job.

        ``cache``: the cache's (requests, hits, reads, merged, evictions, bytes...);
        ``reads``: payload (binary) values read; ``decodes``: images decoded; ``bytes_read``;
        ``jobs``: per open job, its dataset and ``JobStream.stats()``.
        """
        cache = self._cache.stats()
        groups = list(self._groups.values())
        jobs = {}
        for g in groups:
            with g.cond:
                jobs.update({name: {"dataset": g.name, **j.stats()} for name, j in g.jobs.items()})
        return {
            "cache": cache,
            "reads": sum(g.reads for g in groups),
            "decodes": sum(g.decodes for g in groups),
            "bytes_read": sum(g.bytes_read for g in groups),
            "jobs": jobs,
        }

    def close(self) -> None:
        """Stop every scheduler and worker thread; open streams become unusable."""
        if self._closed:
            return
        self._closed = True
        for group in self._groups.values():
            for job in list(group.jobs.values()):
                self._close_job(group, job)
            group.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._owns_catalog:
            self.catalog.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_state(state: dict[str, Any], job: Job) -> tuple[BitMap, int]:
    try:
        remaining = BitMap.deserialize(state["remaining"])
        epoch = int(state["epoch"])
    except (KeyError, TypeError, ValueError) as exc:
        raise LoaderError(
            f"Not a job state: {exc!r}; pass what JobStream.state_dict() returned."
        ) from exc
    if state.get("job") != job.name:
        raise LoaderError(f"The state is of job {state.get('job')!r}, not {job.name!r}.")
    if not remaining or not remaining.issubset(job.ids):
        raise LoaderError(
            f"The state's rows are not a non-empty subset of job {job.name!r}'s rows; was the "
            "job re-registered since? Start it without a state."
        )
    return remaining, epoch


def _is_image(f: Any) -> bool:
    return decoder_for(f).kind is DecodeKind.IMAGE


_DEFAULT_LOADERS: dict[Path, Loader] = {}
_DEFAULT_LOCK = threading.Lock()
_LIVE_LOADERS: weakref.WeakSet[Loader] = weakref.WeakSet()  # closed at exit


def _close_live_loaders() -> None:
    """At exit: stop every open loader's threads and close the catalogs they opened."""
    for loader in list(_LIVE_LOADERS):
        loader.close()


# ``concurrent.futures`` stops accepting tasks in ``threading``'s exit hooks, which run before
# ``atexit``'s: a scheduler still loading rows for an open stream then failed with "cannot
# schedule new futures after interpreter shutdown". Those hooks run last-registered first, and
# this module imported the thread pool above, so the loaders close before the pools refuse work.
getattr(threading, "_register_atexit", atexit.register)(_close_live_loaders)


def default_loader(catalog: Catalog | str | os.PathLike[str] | None = None) -> Loader:
    """The process-wide ``Loader`` of a catalog, created on first use.

    Every ``JobDataset`` of a process that names the same catalog shares it, so their jobs
    share one sampler and one cache. Its cache size is ``$TABLOADER_CACHE_BYTES`` (default
    1 GiB); build a ``Loader`` yourself for other settings.
    """
    if isinstance(catalog, Catalog):
        root = catalog.root
    else:
        root = Path(catalog or os.environ.get("TABLOADER_CATALOG") or "catalog").absolute()
    with _DEFAULT_LOCK:
        loader = _DEFAULT_LOADERS.get(root)
        if loader is None or loader._closed:
            cache = int(os.environ.get("TABLOADER_CACHE_BYTES", 1 << 30))
            loader = Loader(catalog if isinstance(catalog, Catalog) else root, cache_bytes=cache)
            _DEFAULT_LOADERS[root] = loader
        return loader
