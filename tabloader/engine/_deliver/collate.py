"""Step 3 of preparing a batch (:mod:`tabloader.engine._prepare.fetch`): the batch, received by its
job.

A prepared batch is laid out as a :class:`~tabloader.engine._deliver.handoff.HandedBatch` (its ids
and each column, where its values lie in the arena) and goes to its job's *receiver*, chosen once
when the job opens (``Loader.open``: collated; ``Loader.serve``: handed over; the job's
``Plan.receiver``), which owns the life of the batch's pins (:class:`Pins` lets them go):

* :class:`Collate` (a job of this process) copies it out at once
  (:meth:`~tabloader.engine._deliver.handoff.HandedBatch.copy_out`: the one copy of each payload
  byte into the job's own arrays, fixed-shape images into one array from
  :class:`~tabloader.engine._deliver.batchmem.BatchMemory`); the job's augmentation runs in that
  copy. A batch never aliases the arena or another job's batch, so in-place writes stay in the job.
* :class:`HandOver` (a job of the loader service's client) keeps the values pinned in the
  arena, whose shared memory the client maps; the client copies them out with the same
  ``copy_out`` and then they are released (:func:`release`). A column the job augments is
  augmented here, in the loader's threads, into slots of the batch's own (:class:`OwnSlots`):
  the service's one pool, sized to the cores, does every job's crops and flips, and a client
  process runs no threads of its own.

Rows that failed (``work.errors``, a batch that ``skip``\\ s them) are left out of both.
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tabloader.catalog._bitmaps import ID_COLUMN
from tabloader.engine._arena.accounting import AccessLog
from tabloader.engine._arena.arena import Arena
from tabloader.engine._deliver.batchmem import BatchMemory
from tabloader.engine._deliver.handoff import (
    WEIGHT_COLUMN,
    Augment,
    Augmented,
    Column,
    HandedBatch,
    Held,
    ImageList,
    Images,
    image_shape,
)

if TYPE_CHECKING:
    from tabloader.engine._prepare.augment import Augmenter
    from tabloader.engine._prepare.work import Work


class Pins:
    """Lets go of what batches hold in the arena (:func:`release`), and tells the loader's
    access log (``AccessLog``), if it keeps one."""

    def __init__(self, arena: Arena, log: AccessLog | None = None) -> None:
        self.arena, self.log = arena, log

    def release(self, work: Work) -> None:
        """Drop the pins ``work`` holds (and free its own slots); a second call does nothing."""
        self.noted(work)
        release(work, self.arena)

    def noted(self, work: Work) -> None:
        """Tell the access log that ``work`` let its looked-up values go."""
        if self.log is not None:
            self.log.released(work)


class Collate:
    """The receiver of a job of this process: its batch, copied out of the arena (None if
    every row failed), and its pins released at once."""

    pins = False  # released as soon as the batch is copied out

    def __init__(self, arena: Arena, memory: BatchMemory, pins: Pins) -> None:
        self.arena, self.memory, self._pins = arena, memory, pins

    def receive(self, work: Work) -> dict[str, Any] | None:
        try:
            return self._copy(work)
        finally:
            self._pins.release(work)

    def release(self, work: Work) -> None:
        """Nothing is left to let go (``receive`` released it all); a batch never received
        is released as any other."""
        self._pins.release(work)

    def open_already(self, job: str) -> str:
        return f"Job {job!r} is open already in this loader; close its stream first."

    def _copy(self, work: Work) -> dict[str, Any] | None:
        keep = _kept(work)
        if keep is not None and keep.size == 0:
            return None
        prepared: dict[str, Column] = {}
        for ci, (dec, _) in enumerate(work.plan.prepared):
            aug = work.plan.augment.get(dec.column)
            starts, shapes, rows = _rows(work, ci, keep)
            private = _private(work, ci, keep)
            if aug is None:
                prepared[dec.column] = _decoded(dec.column, starts, shapes, private)
            else:
                augment = Augment(dec.column, starts, shapes, private, aug, work.epoch, rows)
                prepared[dec.column] = augment
        batch = batch_of(work, keep, prepared).copy_out(self.arena.buffer, self.memory)
        if work.plan.augment:
            work.augment_s += sum(c.seconds for c in prepared.values() if isinstance(c, Augment))
        return batch


class HandOver:
    """The receiver of a job of the loader service's client: its batch for another process,
    the values pinned in the arena (its owner copies them out of shared memory and then
    releases them: :func:`release`); rows that failed are left out, and their pins released.

    A column the job augments is augmented here, by the loader's threads, into slots of the
    batch's own (``own``): the client then copies the job's images as they are, and the
    shared decodes they came from are released at once (a batch pins 150 KB per 224x224
    image, not the 600 KB decode).
    """

    pins = True  # until the client has copied the batch out

    def __init__(self, arena: Arena, own: OwnSlots, pins: Pins) -> None:
        self.arena, self.own, self._pins = arena, own, pins

    def release(self, work: Work) -> None:
        """The client has the batch (or nobody will take it): its pins go."""
        self._pins.release(work)

    def open_already(self, job: str) -> str:
        return (
            f"Job {job!r} is open already in the loader service, by another process or "
            "another stream of this one (`tabloader status` lists the clients and their "
            "jobs): close it there or end that process first, or register this one under "
            "another job name."
        )

    def receive(self, work: Work) -> HandedBatch:
        arena = self.arena
        keep = _kept(work)
        if keep is not None:
            for offsets in work.offsets:
                dropped = np.setdiff1d(np.flatnonzero(offsets >= 0), keep)
                if dropped.size:
                    arena.release(offsets[dropped])
                    offsets[dropped] = -1
        prepared: dict[str, Column] = {}
        for ci, (dec, _) in enumerate(work.plan.prepared):
            aug = work.plan.augment.get(dec.column)
            if aug is not None:
                prepared[dec.column] = _augment_over(work, ci, keep, arena, aug, self.own)
            else:
                starts, shapes, _ = _rows(work, ci, keep)
                private = _private(work, ci, keep)
                prepared[dec.column] = _decoded(dec.column, starts.copy(), shapes, private)
        if work.discard:  # the augmented images' sources were let go
            self._pins.noted(work)
        batch = batch_of(work, keep, prepared)
        batch.work = work
        return batch


def _kept(work: Work) -> npt.NDArray[np.intp] | None:
    """The positions of the rows that did not fail (None: all of them)."""
    refuse_sources(work)
    if not work.errors:
        return None
    return np.setdiff1d(np.arange(work.rows.size), np.fromiter(work.errors, np.intp))


def batch_of(
    work: Work, keep: npt.NDArray[np.intp] | None, prepared: dict[str, Column]
) -> HandedBatch:
    """The batch of the rows kept: its ids, then the job's columns in its order."""
    rows = work.rows.copy() if keep is None else work.rows[keep]
    columns: list[Column] = [Held(ID_COLUMN, rows)]
    if work.weights is not None:  # a weighted job's: after the ids, before its own columns
        weights = work.weights.copy() if keep is None else work.weights[keep]
        columns.append(Held(WEIGHT_COLUMN, weights))
    for name in work.plan.columns:
        if name in prepared:
            columns.append(prepared[name])
            continue
        value = work.values[name]
        if keep is not None:
            value = (
                value[keep] if isinstance(value, np.ndarray) else [value[i] for i in keep.tolist()]
            )
        columns.append(Held(name, value))
    return HandedBatch(columns, int(rows.size))


def _rows(
    work: Work, ci: int, keep: npt.NDArray[np.intp] | None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    """Prepared column ``ci``'s starts in the arena and shapes, and the ids, of the rows kept."""
    starts, shapes, rows = work.offsets[ci], work.shapes[ci], work.rows
    if keep is None:
        return starts, shapes, rows
    return starts[keep], shapes[keep], rows[keep]


def _decoded(
    name: str,
    starts: npt.NDArray[np.int64],
    shapes: npt.NDArray[np.int32],
    private: dict[int, Any],
) -> Images | ImageList:
    """A column of decoded images: of one shape (one array), or several (a list)."""
    if starts.size and bool((shapes == shapes[0]).all()):
        return Images(name, starts, image_shape(shapes[0].tolist()), private)
    return ImageList(name, starts, shapes, private)


def refuse_sources(work: Work) -> None:
    """Add to ``work.errors`` each row whose decoded image the job's augmentation may not take
    (:meth:`~tabloader.engine._prepare.augment.Augmenter.refusal`): it is then skipped or raised as
    the
    job's ``on_error`` says, as a row that failed to decode."""
    for ci, (dec, _) in enumerate(work.plan.prepared):
        aug = work.plan.augment.get(dec.column)
        if aug is None or not aug.grows:
            continue
        for p, (h, w) in enumerate(work.shapes[ci][:, :2].tolist()):
            if p not in work.errors:
                error = aug.refusal((h, w), int(work.rows[p]))
                if error is not None:
                    work.errors[p] = error


class OwnSlots:
    """Where batches keep values of their own in the arena (a job's augmented images, handed
    over to its client): a space of fixed-size slots under keys that are never reused while
    held (a counter around ``KEYS``)."""

    KEYS = 1 << 20

    def __init__(self, arena: Arena) -> None:
        self.space = arena.space("_own", num_rows=self.KEYS, fixed=True)
        self._next = 0
        self._lock = threading.Lock()

    def keys(self, n: int) -> npt.NDArray[np.int64]:
        """``n`` keys for fresh slots."""
        with self._lock:
            start, self._next = self._next, (self._next + n) % self.KEYS
        return (start + np.arange(n, dtype=np.int64)) % self.KEYS


def _augment_over(
    work: Work,
    ci: int,
    keep: npt.NDArray[np.intp] | None,
    arena: Arena,
    aug: Augmenter,
    own: OwnSlots,
) -> Augmented:
    """The job's own augmentation of prepared column ``ci``, into fresh slots of the arena
    (or private arrays where it has no room); the sources' pins are released."""
    t0 = time.perf_counter()
    positions = range(work.rows.size) if keep is None else keep.tolist()
    offsets, shapes = work.offsets[ci], work.shapes[ci].tolist()
    shape, dtype = aug.output_shape, aug.dtype
    nbytes = math.prod(shape) * dtype.itemsize
    slots, _ = arena.reserve(own.space, own.keys(len(positions)), (nbytes,))
    private: dict[int, Any] = {}
    try:
        for k, p in enumerate(positions):
            off = int(offsets[p])
            src = work.private[(ci, p)] if off < 0 else arena.view(off, image_shape(shapes[p]))
            slot = int(slots[k])
            if slot >= 0:
                out = arena.buffer[slot : slot + nbytes].view(dtype).reshape(shape)
            else:
                out = private[k] = np.empty(shape, dtype)
            aug.apply(src, work.epoch, int(work.rows[p]), out)
    except BaseException:
        arena.discard(slots[slots >= 0])
        raise
    held = offsets[offsets >= 0]
    if held.size:
        arena.release(held)
    offsets[:] = -1
    offsets[np.asarray(positions, np.intp)] = slots
    work.discard.add(ci)
    work.augment_s += time.perf_counter() - t0
    return Augmented(work.plan.prepared[ci][0].column, slots, shape, private, dtype=dtype)


def release(work: Work, arena: Arena) -> None:
    """Drop what a batch holds in the arena: its values' pins, and the slots of its own
    (augmented images handed over) are freed."""
    for ci, offsets in enumerate(work.offsets):
        held = offsets[offsets >= 0]
        if held.size:
            if ci in work.discard:
                arena.discard(held)
            else:
                arena.release(held)
        offsets[:] = -1


def _private(work: Work, ci: int, keep: npt.NDArray[np.intp] | None = None) -> dict[int, Any]:
    """Column ``ci``'s values handed out uncached (no room in the arena), by position among
    the rows kept (all if ``keep`` is None)."""
    if not work.private:
        return {}
    positions = range(work.rows.size) if keep is None else keep.tolist()
    return {k: work.private[(ci, p)] for k, p in enumerate(positions) if (ci, p) in work.private}
