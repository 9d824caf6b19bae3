"""Preparing batches: a job's planned batch of row ids becomes the job's own batch of arrays.

One pool task per batch (:meth:`Fetcher.submit`), then one per group of rows to decode (the
task looks up and dispatches first, step 2, and gathers while the decodes run, step 1):

1. **Gather** the cheap columns (numbers, strings, lists, raw bytes) with vectorized reads,
   straight into the batch and with no cache (for these a read costs less than caching; see
   :mod:`tabloader.engine._prepare.gather`).
2. **Look up** the prepared columns (decoded images) in the
:class:`~tabloader.engine._arena.arena.Arena`:
   found rows are pinned; a row that another batch is decoding now is waited for (one decode
   for every job that wants it: request merging); the rest are claimed and decoded in groups
   of at least ``MIN_DECODE_ROWS`` rows and ``MIN_TASK_BYTES`` (a batch's claimed rows split
   over the workers), one pool task per group, each reading its rows together. Decode and
   resize run with the GIL released (libjpeg-turbo through simplejpeg, torch).
3. **Collate** when the last group a batch waits for lands: the job's receiver (its plan's,
   :mod:`tabloader.engine._deliver.collate`) copies each value out of the arena into the job's own
   arrays (the one copy of each payload byte: a batch never aliases the arena or another
   job's batch, so in-place writes stay in the job) and the pins are released, or hands it
   over pinned to a service's client; then the batch goes to its job (``on_done``).

Errors: a row that fails to read or decode is recorded for every batch that wanted it
(``RowReadError`` names the row); the batch leaves it out (``skip``) or its job raises it.
A failing gather fails the whole batch. Nothing failed is cached. A row whose own bytes
failed (``RowReadError``: undecodable, over the pixel limit, null, fatal to a decode process)
is remembered for the column, while this dataset is read (its appended versions keep their
rows; one imported again after a drop gets a new fetcher): every later look-up of it, in any
epoch of any job, fails at once with its first message and it is never read or decoded
again. Other failures (a damaged record batch, a decode process that died, out of memory)
are not the row's: the next request retries.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from tabloader.catalog._errors import LoaderError, RowReadError
from tabloader.catalog.storage import DatasetReader
from tabloader.engine._arena.accounting import AccessLog, Counters
from tabloader.engine._arena.arena import Arena
from tabloader.engine._deliver.batchmem import BatchMemory
from tabloader.engine._deliver.collate import Pins
from tabloader.engine._prepare.decoding import DecodePool, decode_rows
from tabloader.engine._prepare.gather import Gatherer
from tabloader.engine._prepare.pool import PriorityPool
from tabloader.engine._prepare.prep import Decoder
from tabloader.engine._prepare.readahead import ReadAhead
from tabloader.engine._prepare.work import Work
from tabloader.engine.decode import Fit

logger = logging.getLogger(__name__)

NO_ROWS = np.empty(0, np.int64)
MIN_DECODE_ROWS = 4  # rows per decode task at least: its bookkeeping is amortized
MIN_PROCESS_ROWS = 8  # the same for a decode process's task (a round trip through a pipe)
# and at least this many bytes of fixed-shape values: a task's hand-offs (a dozen thread
# wake-ups through the process pool) cost ~0.3 ms of the loader's CPU; tiny images (16x16:
# 768 B) in tasks of half a batch of 256 spent 12 us a row on them, in one task 9 us
MIN_TASK_BYTES = 256 << 10
# rows decoded ahead of their batch (``_ahead``) hold slots while their task runs: at most this
# share of the arena's slots for their size, so that a cache sized for the batches in flight
# (a 20-slot arena for two jobs' two batches of four) is not filled by them
AHEAD_SHARE = 8


class _Load:
    """One task's decode of a group of rows (sorted) of one arena space."""

    __slots__ = ("decoder", "id", "priority", "rows", "space", "waiters")

    def __init__(self, id_: int, space: int, decoder: Decoder, rows: npt.NDArray[np.int64]):
        self.id = id_
        self.space = space
        self.decoder = decoder
        self.rows = rows
        self.priority = 0  # the pool's order: its first batch's (``Work.seq``)
        # (batch, its prepared column, positions in the batch, indices into ``rows``)
        self.waiters: list[tuple[Work, int, npt.NDArray[np.intp], npt.NDArray[np.intp]]] = []


class Fetcher:
    """Prepares the batches of every job of one dataset; see the module docstring.

    Args:
        reader: reads payload columns (``pread``: pages do not stay resident).
        table: reads gathered columns (``reader`` itself beside payloads; for a dataset of
            small rows a memory map: zero-copy record batches).
        arena: where prepared values live, shared by every dataset of the loader.
        pool: the loader's thread pool.
        workers: its threads (a batch's decodes are split into about that many tasks).
        procs: decode processes for fixed-shape images (None: decode in the pool's threads).
        memory: where the batches' image arrays are allocated (recycled blocks).
        read_column: ``(column, rows) -> pyarrow.Array``, a cheap column whole from the
            catalog's table (one columnar scan: 2 ms for the labels of 2,000 images against
            30 ms through their record batches); None, or a failure, reads ``table``.
        on_done: called with each finished ``Work`` (its ``result`` or error set).
    """

    def __init__(
        self,
        reader: DatasetReader,
        table: DatasetReader,
        arena: Arena,
        pool: PriorityPool,
        on_done: Callable[[Work], None],
        *,
        workers: int,
        procs: DecodePool | None = None,
        memory: BatchMemory | None = None,
        read_column: Callable[[str, int], pa.Array] | None = None,
        pins: Pins | None = None,
        access_log: AccessLog | None = None,
    ) -> None:
        self.procs = procs
        self.memory = memory or BatchMemory()
        self.reader = reader
        self.workers = workers
        self.arena = arena
        self.pool = pool
        self.on_done = on_done
        self.counters = Counters()
        self.gatherer = Gatherer(table, self.counters, read_column)
        self._lock = threading.Lock()
        self._loading: dict[int, npt.NDArray[np.int64]] = {}  # space -> row -> load id (-1)
        # space -> row -> batches submitted whose look-up has not pinned the row yet: their
        # scheduler no longer counts them as future uses, the arena must not evict them
        self._starting: dict[int, npt.NDArray[np.int32]] = {}
        self._starting_lock = threading.Lock()  # never held while calling the arena
        self._loads: dict[int, _Load] = {}
        self._next_load = 0
        self.access_log = access_log  # a Loader asked to record one
        # lets go of a batch's values where its receiver has none (it failed first)
        self.pins = pins or Pins(arena, access_log)
        # column -> row -> why: rows whose own bytes failed, never read again (docstring)
        self._failed: dict[str, dict[int, str]] = {}
        # a dataset in object storage: its record batches fetched ahead of the decodes
        # (``readahead``); a batch submitted holds its rows' batches until it is done
        self.readahead: ReadAhead | None = None

    def failed_rows(self, column: str) -> dict[int, str]:
        """The rows of ``column`` remembered as bad data, with their errors' messages."""
        with self._lock:
            return dict(self._failed.get(column, {}))

    def set_readers(self, reader: DatasetReader, table: DatasetReader) -> None:
        """Read a newer version of the dataset (rows were appended)."""
        self.gatherer.set_table(table)
        with self._lock:
            self.reader = reader
            for space, loading in self._loading.items():
                grown = np.full(reader.num_rows, -1, np.int64)
                grown[: loading.size] = loading
                self._loading[space] = grown
        with self._starting_lock:
            for space, starting in self._starting.items():
                more = np.zeros(reader.num_rows, np.int32)
                more[: starting.size] = starting
                self._starting[space] = more

    def submit(self, work: Work) -> None:
        """Prepare ``work``; ``on_done(work)`` follows.

        A batch of cheap columns that are all read whole already (a numpy take each, a few
        microseconds) is prepared right here: handing it to a pool thread would cost more,
        and with many threads the handoffs contend for the GIL. So is a service's batch of
        such columns and prepared ones (looked up and pinned, its misses sent to decode,
        nothing copied: its client copies): two thread wake-ups fewer per batch; unless its
        job augments them, which the pool does.
        """
        plan = work.plan
        self._mark_starting(work, +1)
        if self.readahead is not None and plan.prepared:
            self.readahead.pin(work)
        inline = not plan.prepared or (plan.receiver.pins and not plan.augment)
        if inline and self.gatherer.all_flat(plan.gathered):
            self._start(work)
            return
        try:
            self.pool.submit(self._start, work, priority=work.seq)
        except BaseException:
            self._mark_starting(work, -1)
            if self.readahead is not None:
                self.readahead.unpin(work)
            raise

    def _mark_starting(self, work: Work, delta: int) -> None:
        """Count ``work``'s rows as waiting for their look-up (+1) or past it (-1)."""
        if not work.plan.prepared:
            return
        with self._starting_lock:
            for _, space in work.plan.prepared:
                starting = self._starting.get(space)
                if starting is None:
                    starting = self._starting[space] = np.zeros(self.reader.num_rows, np.int32)
                np.add.at(starting, work.rows, np.int32(delta))

    def starting(self, space: int, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
        """Per row of ``space``, the batches submitted that will look it up and have not yet
        (lock-free: the arena asks with its lock held).

        The scheduler stops counting a row as a future use when it cuts the row into a batch;
        the batch pins it only at its look-up, on a pool thread, later. In between the row is
        needed next of all, and an eviction then would decode it again at once.
        """
        starting = self._starting.get(space)
        if starting is None:
            return np.zeros(rows.size, np.int32)
        if rows.size == 0 or rows.max() < starting.size:
            return starting.take(rows)
        out = np.zeros(rows.size, np.int32)
        ok = rows < starting.size
        out[ok] = starting[rows[ok]]
        return out

    # -- step 1 and 2: gather, look up, claim ------------------------------------------------
    def _start(self, work: Work) -> None:
        loads: list[_Load] = []
        try:
            for ci, (dec, space) in enumerate(work.plan.prepared):
                loads += self._lookup(work, ci, dec, space)
        except BaseException as exc:  # the batch fails, its job raises; nothing hangs
            work.error = exc
        self._mark_starting(work, -1)  # its rows are pinned now, or claimed for decoding
        if self.readahead is not None:
            self.readahead.started(work)
        for load in loads:
            try:
                self._dispatch(load)
            except BaseException as exc:  # every batch waiting for these rows fails with it
                self._fail(load, exc)
        if work.error is None and not (loads and self.gatherer.reading(work.plan.gathered)):
            self._gather(work)  # while the decodes run; else after them (``_finish``): a
            # column being read whole is usually done by then
        with self._lock:
            work.waiting -= 1
            ready = work.waiting == 0
        if ready:
            self._finish(work)

    def _gather(self, work: Work) -> None:
        """The batch's cheap columns (a failure fails the batch)."""
        work.gathered = True
        try:
            t0 = time.perf_counter()
            work.values = self.gatherer.gather(work.rows, work.plan.gathered)
            self.counters.add(read_s=time.perf_counter() - t0)
        except BaseException as exc:
            work.error = exc

    def _lookup(self, work: Work, ci: int, dec: Decoder, space: int) -> list[_Load]:
        rows = work.rows
        if self.access_log is not None:
            self.access_log.looked_up(work, space, rows)
        found = self.arena.get(space, rows)
        work.offsets[ci][:] = found.offsets
        work.shapes[ci][:] = found.shapes
        miss = np.flatnonzero(found.offsets < 0)
        if miss.size == 0:
            return []
        new: list[_Load] = []
        with self._lock:
            known = self._failed.get(dec.column)
            if known:  # bad rows fail at once, never read again
                bad = np.fromiter((r in known for r in rows[miss].tolist()), bool, miss.size)
                for p in miss[bad].tolist():
                    row = int(rows[p])
                    work.errors[p] = RowReadError(
                        f"{known[row]} (It failed when first read; it is not read again.)",
                        row_id=row,
                        column=dec.column,
                    )
                miss = miss[~bad]
                if miss.size == 0:
                    return new
            loading = self._loading.get(space)
            if loading is None:
                loading = self._loading[space] = np.full(self.reader.num_rows, -1, np.int64)
            lid = loading[rows[miss]]
            merged = lid >= 0
            self.arena.in_flight(int(merged.sum()))
            for load_id in np.unique(lid[merged]).tolist():  # another batch decodes them
                load = self._loads[load_id]
                pos = miss[lid == load_id]
                load.waiters.append((work, ci, pos, np.searchsorted(load.rows, rows[pos])))
                work.waiting += 1
            rest = miss[~merged]
            if rest.size:  # a load may have landed since the lookup
                again = self.arena.get(space, rows[rest], again=True)
                hit = again.offsets >= 0
                work.offsets[ci][rest[hit]] = again.offsets[hit]
                work.shapes[ci][rest[hit]] = again.shapes[hit]
                claim = rest[~hit]
                claim = claim[np.argsort(rows[claim], kind="stable")]  # a record batch together
                in_procs = self.procs is not None and self.procs.ready and dec.in_processes
                least, most_ahead = (MIN_PROCESS_ROWS if in_procs else MIN_DECODE_ROWS), 0
                if dec.image_size is not None and not isinstance(dec.image_size, Fit):
                    value = math.prod(_fixed_shape(dec.image_size))  # small ones: fewer tasks
                    least = max(least, -(-MIN_TASK_BYTES // value))
                    most_ahead = self.arena.holds(space, value) // AHEAD_SHARE
                step = max(least, -(-claim.size // self.workers))
                ahead, want = NO_ROWS, min(least - claim.size, most_ahead)
                if in_procs and 2 * claim.size < least and want > 0:  # a short task: fill it
                    ahead = self._ahead(work, dec, space, loading, rows[claim], want)
                for start in range(0, claim.size, step):
                    pos = claim[start : start + step]
                    if start == 0 and ahead.size:  # a load's rows are sorted
                        both = np.sort(np.concatenate((rows[pos], ahead)))
                        load = _Load(self._next_load, space, dec, both)
                        idx = np.searchsorted(both, rows[pos])
                    else:
                        load = _Load(self._next_load, space, dec, rows[pos])
                        idx = np.arange(pos.size)
                    load.priority = work.seq
                    self._next_load += 1
                    load.waiters.append((work, ci, pos, idx))
                    loading[load.rows] = load.id
                    self._loads[load.id] = load
                    work.waiting += 1
                    new.append(load)
                work.loaded += int(claim.size + ahead.size)
        return new

    def _ahead(
        self,
        work: Work,
        dec: Decoder,
        space: int,
        loading: npt.NDArray[np.int64],
        claimed: npt.NDArray[np.int64],
        want: int,
    ) -> npt.NDArray[np.int64]:
        """Up to ``want`` rows the batch's job cuts next (the head of its queue) that are
        neither stored, nor being decoded, nor ``claimed`` (``_lock`` held): decoded in the
        same task as this batch's misses.

        A decode process's task costs the loader a dozen thread wake-ups whatever its size, so
        a task has at least ``MIN_TASK_BYTES`` of values. A batch whose misses are fewer (jobs
        that cut the same rows at other batch boundaries leave each other a batch's tail or
        head: four tiny-row jobs made tasks of 86 rows on average, three times one job's)
        decodes the rows its job asks for next with them. They are queued, so the arena
        knows their next use and keeps them until then; a batch of any job that needs one
        while it is decoded waits for this task, as for any load in flight.
        """
        head: npt.NDArray[np.int64] = work.job.job.queue.q_rows[: 4 * want]
        if head.size == 0:
            return NO_ROWS
        head = head[(loading[head] < 0) & ~np.isin(head, claimed)]
        if head.size:
            head = head[~self.arena.stored(space, head)]
        known = self._failed.get(dec.column) if head.size else None
        if known:
            head = head[[r not in known for r in head.tolist()]]
        _, first = np.unique(head, return_index=True)  # a queue spanning epochs repeats rows
        return head[np.sort(first)][:want]

    # -- decoding (one task per group of rows) ------------------------------------------------
    def _dispatch(self, load: _Load) -> None:
        size = load.decoder.image_size
        if self.procs is None or not load.decoder.in_processes or not self.procs.ready:
            # a decode process fills slots reserved for a known shape: fixed sizes only (of a
            # backend that runs there); until they run, such loads are decoded here, and the
            # first one to be decoded starts them (``_run_load``)
            self.pool.submit(self._run_load, load, priority=load.priority)
            return
        offsets, fresh = self.arena.reserve(load.space, load.rows, _fixed_shape(size))
        todo = np.flatnonzero(fresh)
        try:
            if todo.size == 0:
                self.pool.submit(
                    self._landed_elsewhere, load, offsets, todo, None, priority=load.priority
                )
                return
            future = self.procs.submit(self.reader, load.decoder, load.rows[todo], offsets[todo])
        except BaseException:  # the slots go back: fresh ones freed, stored ones unpinned
            self.arena.discard(offsets[todo])
            self.arena.release(offsets[(offsets >= 0) & ~fresh])
            raise
        future.add_done_callback(
            lambda f: self._submit_or_run(
                self._landed_elsewhere, load, offsets, todo, f, priority=load.priority
            )
        )

    def _submit_or_run(self, fn: Callable[..., None], *args: Any, priority: int) -> None:
        try:
            self.pool.submit(fn, *args, priority=priority)
        except RuntimeError:  # the loader is closing: land here (the pins are released)
            fn(*args)

    def _run_load(self, load: _Load) -> None:
        """Decode ``load`` in this thread and store the values in the arena.

        An aspect-kept decode (a :class:`Fit`) goes straight into its slot, reserved once its
        decoded shape is known (:func:`tabloader.engine.decode.decode_image`'s ``into``): no
        copy of 0.6 MB a 500x375 image into the arena, and no new memory per image to fault
        in and free (0.1-0.15 ms of a 1 ms decode, measured as the arena's put).
        """
        placed: dict[int, npt.NDArray[np.uint8]] = {}  # value k -> its reserved slot
        slots = np.full(load.rows.size, -1, np.int64)

        def into(k: int, shape: tuple[int, int, int]) -> npt.NDArray[np.uint8] | None:
            offsets, fresh = self.arena.reserve(load.space, load.rows[k : k + 1], shape)
            slot = int(offsets[0])
            if slot < 0:
                return None  # no room: a value of its own, handed out uncached
            if not fresh[0]:  # a racing load stored the row: ours is put as any other
                self.arena.release(offsets)
                return None
            slots[k] = slot
            placed[k] = self.arena.buffer[slot : slot + math.prod(shape)].reshape(shape)
            return placed[k]

        fit = isinstance(load.decoder.image_size, Fit)
        try:
            values, errors, counters = decode_rows(
                self.reader, load.decoder, load.rows, into if fit else None
            )
        except BaseException as exc:  # not a row's error (those are in ``errors``): the
            self.arena.discard(slots[slots >= 0])  # batches waiting fail, none hangs
            self._fail(load, exc)
            return
        self.counters.add(**counters)
        if self.procs is not None and load.decoder.in_processes:
            # Started once the first such load is decoded, not when it was dispatched: their
            # start (a forkserver: an interpreter and its imports, 0.25-0.5 s of a core) took
            # a core from the first batch's decodes, which a cold service's first batch
            # waited for (0.5-1 s more than with the threads alone, on a loaded 2-core machine)
            self.procs.start()  # (once; in the background)
        offsets, shapes = self._store(load, values, placed, slots)  # outside the fetcher's lock
        self._land(load, offsets, shapes, values, errors)

    def _store(
        self,
        load: _Load,
        values: list[npt.NDArray[np.uint8] | None],
        placed: dict[int, npt.NDArray[np.uint8]] | None = None,
        slots: npt.NDArray[np.int64] | None = None,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        """Put a group's decoded values into the arena: their offsets (pinned; -1 where not
        stored) and shapes. Values decoded into their reserved slots (``placed``, at
        ``slots``) are published there; a slot whose value did not land in it (its decode
        failed, or fell back to another decoder) is freed.

        Fixed-shape values (``image_size``) take one ``reserve`` and one ``publish`` for the
        group, then a copy each: an arena ``put`` per value spent 25-55 us a row here besides
        the copy, with the GIL held; the group's two calls 4-28 us a row. Values of other
        shapes (full-size images) are put one at a time.
        """
        n = load.rows.size
        offsets = np.full(n, -1, np.int64)
        shapes = np.zeros((n, 3), np.int32)
        rest = [(i, value) for i, value in enumerate(values) if value is not None]
        if placed and slots is not None:
            landed = [
                i for i, value in rest if i in placed and value.ctypes.data == placed[i].ctypes.data
            ]
            lost = [i for i in placed if i not in set(landed)]
            if lost:
                self.arena.discard(slots[lost])
            if landed:
                at = np.array(landed, np.intp)
                offsets[at] = self.arena.publish(load.space, load.rows[at], slots[at])
                for i in landed:
                    shapes[i] = placed[i].shape
                done = set(landed)
                rest = [(i, value) for i, value in rest if i not in done]
        size = load.decoder.image_size
        if size is not None and not isinstance(size, Fit):
            shape = _fixed_shape(size)
            same = [(i, v) for i, v in rest if v.shape == shape and v.dtype == np.uint8]
            rest = [(i, v) for i, v in rest if v.shape != shape or v.dtype != np.uint8]
            if same:
                at = np.array([i for i, _ in same], np.intp)
                rows = load.rows[at]
                slots, fresh = self.arena.reserve(load.space, rows, shape)
                try:
                    buffer, nbytes = self.arena.buffer, math.prod(shape)
                    for k in np.flatnonzero(fresh).tolist():  # not those stored already
                        slot = int(slots[k])
                        buffer[slot : slot + nbytes] = same[k][1].reshape(-1)
                except BaseException:  # the slots go back: fresh ones freed, others unpinned
                    self.arena.discard(slots[fresh])
                    self.arena.release(slots[(slots >= 0) & ~fresh])
                    raise
                slots[fresh] = self.arena.publish(load.space, rows[fresh], slots[fresh])
                offsets[at] = slots
                shapes[at] = shape
        for i, value in rest:
            offsets[i] = self.arena.put(load.space, int(load.rows[i]), value)
            shapes[i, : value.ndim] = value.shape
        return offsets, shapes

    def _landed_elsewhere(
        self,
        load: _Load,
        offsets: npt.NDArray[np.int64],
        todo: npt.NDArray[np.intp],
        future: Future[Any] | None,
    ) -> None:
        """A decode process filled the reserved slots ``offsets[todo]`` (or failed)."""
        errors: dict[int, BaseException] = {}
        if future is not None:
            try:
                failed, counters = future.result()
                self.counters.add(**counters)
            except BaseException as exc:  # the process died, or the loader is closing
                reason = LoaderError(
                    f"A decode process failed ({exc!r}); the rows are decoded again when "
                    "asked for next time."
                )
                failed = dict.fromkeys(range(todo.size), reason)
            errors = {int(todo[i]): e for i, e in failed.items()}
            bad = np.fromiter(errors, np.intp, len(errors))
            if bad.size:
                self.arena.discard(offsets[bad])
                offsets[bad] = -1
            good = np.setdiff1d(todo, bad)
            offsets[good] = self.arena.publish(load.space, load.rows[good], offsets[good])
        shapes = np.zeros((load.rows.size, 3), np.int32)
        shapes[:] = _fixed_shape(load.decoder.image_size)
        values: list[npt.NDArray[np.uint8] | None] = [None] * load.rows.size
        local = np.array([i for i in np.flatnonzero(offsets < 0).tolist() if i not in errors])
        if local.size:  # no room in the arena: decoded here, handed out uncached
            decoded, errs, counters = decode_rows(self.reader, load.decoder, load.rows[local])
            self.counters.add(**counters)
            for k, i in enumerate(local.tolist()):
                values[i] = decoded[k]
                if k in errs:
                    errors[i] = errs[k]
        self._land(load, offsets, shapes, values, errors)

    def _fail(self, load: _Load, exc: BaseException) -> None:
        """``load`` could not start: the batches waiting for it fail with ``exc``."""
        done: list[Work] = []
        with self._lock:
            self._loading[load.space][load.rows] = -1
            del self._loads[load.id]
            for work, *_ in load.waiters:
                if work.error is None:
                    work.error = exc
                work.waiting -= 1
                if work.waiting == 0:
                    done.append(work)
        for work in done:
            self._finish(work)

    def _land(
        self,
        load: _Load,
        offsets: npt.NDArray[np.int64],
        shapes: npt.NDArray[np.int32],
        values: list[npt.NDArray[np.uint8] | None],
        errors: dict[int, BaseException],
    ) -> None:
        """Hand a group's values to every batch waiting for them, then finish those done.

        ``offsets`` hold one pin each (ours): each waiter gets its own, then ours go.
        """
        done: list[Work] = []
        held = offsets >= 0
        with self._lock:
            for _, _, _, idx in load.waiters:
                mine = offsets[idx]
                self.arena.pin(mine[mine >= 0])
            self.arena.release(offsets[held])
            for i, exc in errors.items():
                if isinstance(exc, RowReadError):  # its own bytes: remembered
                    column = self._failed.setdefault(load.decoder.column, {})
                    column[int(load.rows[i])] = str(exc)
            self._loading[load.space][load.rows] = -1
            del self._loads[load.id]
            for work, ci, pos, idx in load.waiters:
                work.offsets[ci][pos] = offsets[idx]
                work.shapes[ci][pos] = shapes[idx]
                if errors or not held.all():  # usually not: nothing per row
                    self._note_misses(work, ci, pos, idx, held, values, errors)
                work.waiting -= 1
                if work.waiting == 0:
                    done.append(work)
        for work in done:
            self._finish(work)

    @staticmethod
    def _note_misses(
        work: Work,
        ci: int,
        pos: npt.NDArray[np.intp],
        idx: npt.NDArray[np.intp],
        held: npt.NDArray[np.bool_],
        values: list[npt.NDArray[np.uint8] | None],
        errors: dict[int, BaseException],
    ) -> None:
        """Rows of a landed group that are not in the arena: failed, or handed out uncached."""
        for p, i in zip(pos.tolist(), idx.tolist(), strict=True):
            if i in errors:
                work.errors[p] = errors[i]
            elif not held[i]:
                work.private[(ci, p)] = values[i]

    # -- step 3: collate -------------------------------------------------------------------------
    def _finish(self, work: Work) -> None:
        if self.readahead is not None:
            self.readahead.unpin(work)  # its rows are decoded (or failed)
        if work.error is None and not work.gathered:
            self._gather(work)
        t0 = time.perf_counter()
        try:
            if work.error is None and not (work.errors and not work.skip):
                # its receiver keeps pinned what the job's client will copy, the rest goes
                work.result = work.plan.receiver.receive(work)
        except BaseException as exc:
            work.error = exc
        finally:
            if work.result is None:  # nothing received: nothing stays pinned
                self.pins.release(work)
            self.counters.add(collate_s=time.perf_counter() - t0, augment_s=work.augment_s)
        self.on_done(work)


def _fixed_shape(size: Any) -> tuple[int, int, int]:
    """The (H, W, 3) of images resized to ``image_size`` ``size`` (an int: a square)."""
    return (size, size, 3) if isinstance(size, int) else (*size, 3)
