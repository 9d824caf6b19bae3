"""Step 3 of preparing a batch (:mod:`tabloader.engine.fetch`): its values, out of the arena.

* :func:`collate` (a job of this process): copy each prepared value out of the arena into the
  job's own arrays, the one copy of each payload byte. A batch never aliases the arena or
  another job's batch, so in-place writes stay in the job. Fixed-shape images land in one
  array from :class:`~tabloader.engine.batchmem.BatchMemory` (recycled blocks, no page faults),
  variable-size ones in a list of arrays.
* :func:`hand_over` (a job of the loader service's client): the values stay pinned in the
  arena, whose shared memory the client maps; it copies them out and then releases them
  (:func:`release`). A column the job augments is augmented here, in the loader's threads,
  into slots of the batch's own (:class:`OwnSlots`): the service's one pool, sized to the
  cores, does every job's crops and flips, and a client process runs no threads of its own.

Rows that failed (``work.errors``, a batch that ``skip``\\ s them) are left out of both.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from catalog.bitmaps import ID_COLUMN
from tabloader.engine.arena import Arena
from tabloader.engine.batchmem import BatchMemory

if TYPE_CHECKING:
    from tabloader.engine.augment import Augmenter
    from tabloader.engine.work import Work

__all__ = ["Handed", "OwnSlots", "collate", "hand_over", "refuse_sources", "release"]


def collate(work: Work, arena: Arena, memory: BatchMemory) -> dict[str, Any] | None:
    """The job's own batch of ``work`` (None if every row failed); the pins stay for the caller
    to release."""
    refuse_sources(work)
    keep = None
    if work.errors:
        keep = np.setdiff1d(np.arange(work.rows.size), np.fromiter(work.errors, np.intp))
        if keep.size == 0:
            return None
    batch: dict[str, Any] = {ID_COLUMN: work.rows.copy() if keep is None else work.rows[keep]}
    prepared = {dec.column: ci for ci, (dec, _) in enumerate(work.plan.prepared)}
    for name in work.plan.columns:
        if name in prepared and name in work.plan.augment:
            t0 = time.perf_counter()
            batch[name] = _augment_out(work, prepared[name], keep, arena, memory)
            work.augment_s += time.perf_counter() - t0
        elif name in prepared:
            batch[name] = _copy_out(work, prepared[name], keep, arena, memory)
        else:
            value = work.values[name]
            if keep is not None:
                value = (
                    value[keep]
                    if isinstance(value, np.ndarray)
                    else [value[i] for i in keep.tolist()]
                )
            batch[name] = value
    return batch


def refuse_sources(work: Work) -> None:
    """Add to ``work.errors`` each row whose decoded image the job's augmentation may not take
    (:meth:`~tabloader.engine.augment.Augmenter.refusal`): it is then skipped or raised as the
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


def _copy_out(
    work: Work,
    ci: int,
    keep: npt.NDArray[np.intp] | None,
    arena: Arena,
    memory: BatchMemory,
) -> Any:
    """The values of prepared column ``ci``, copied into new arrays (one copy per byte)."""
    offsets, shapes = work.offsets[ci], work.shapes[ci]
    if keep is not None:  # the rows kept (a batch that skips failed rows gathers the rest)
        offsets, shapes = offsets[keep], shapes[keep]
    one_shape = bool((shapes == shapes[0]).all())
    shape = tuple(shapes[0].tolist())
    if one_shape and (offsets >= 0).all():
        # the usual case: every value in the arena, one shape: a gather of slots
        batch = memory.empty((offsets.size, *shape))
        _gather(arena.buffer, offsets, batch.reshape(offsets.size, math.prod(shape)))
        return batch
    positions = range(work.rows.size) if keep is None else keep.tolist()
    out: Any = memory.empty((len(positions), *shape)) if one_shape else []
    for k, (_, src) in enumerate(_values(work, ci, positions, arena)):
        if one_shape:
            out[k] = src
        else:
            out.append(src.copy())
    return out


def _augment_out(
    work: Work,
    ci: int,
    keep: npt.NDArray[np.intp] | None,
    arena: Arena,
    memory: BatchMemory,
) -> Any:
    """The job's own augmentation of prepared column ``ci``, each image written straight into
    its slot of a new batch (the crop-resize is the one copy; see
    :mod:`tabloader.engine.augment`)."""
    aug = work.plan.augment[work.plan.prepared[ci][0].column]
    positions = range(work.rows.size) if keep is None else keep.tolist()
    out = memory.empty((len(positions), *aug.output_shape), aug.dtype)
    offsets, shapes, rows = work.offsets[ci], work.shapes[ci], work.rows
    if keep is not None:  # the rows kept (a batch that skips failed rows)
        offsets, shapes, rows = offsets[keep], shapes[keep], rows[keep]
    if offsets.size and (offsets >= 0).all():  # the usual batch: one kernel call for it
        aug.apply_batch(arena.buffer, offsets, shapes[:, :2], work.epoch, rows, out)
        return out
    for k, (p, src) in enumerate(_values(work, ci, positions, arena)):
        aug.apply(src, work.epoch, int(work.rows[p]), out[k])
    return out


def _values(
    work: Work, ci: int, positions: Iterable[int], arena: Arena
) -> Iterator[tuple[int, npt.NDArray[np.uint8]]]:
    """(position, value) of prepared column ``ci`` at ``positions``: a view of its arena slot,
    or the value handed out uncached."""
    offsets, shapes = work.offsets[ci], work.shapes[ci]
    for p in positions:
        off = int(offsets[p])
        yield p, work.private[(ci, p)] if off < 0 else arena.view(off, tuple(shapes[p].tolist()))


def _gather(
    buffer: npt.NDArray[np.uint8], offsets: npt.NDArray[np.int64], out: npt.NDArray[np.uint8]
) -> None:
    """``out[k] = buffer[offsets[k] : offsets[k] + n]`` for each ``k`` (``out`` is ``(k, n)``).

    Where every offset lies on one grid of ``n`` bytes, the buffer seen from there is a
    ``(rows, n)`` array and the batch is one ``np.take`` of its rows, the GIL released for the
    whole copy: 9% faster than a copy per row for 64 x 224 x 224 x 3, 25% for
    256 x 112 x 112 x 3 here. Slots of one slab are on such a grid when the slot size is ``n``
    (a fixed shape of a multiple of 64 bytes, as those two); slots of several slabs only when
    the slab size is a multiple of ``n`` too, which it usually is not. Otherwise a copy per
    row (about 0.3 us of Python each).
    """
    n = out.shape[1]
    start = int(offsets[0]) % n if n else 0
    # the last offset first: off the grid, as most batches spanning slabs are, costs 0.3 us
    if n and int(offsets[-1]) % n == start and not ((offsets - start) % n).any():
        rows = (buffer.size - start) // n
        grid = buffer[start : start + rows * n].reshape(rows, n)
        # "clip" as the indices are slots of this buffer; "raise" would copy ``out`` first
        np.take(grid, (offsets - start) // n, axis=0, out=out, mode="clip")
        return
    for k, off in enumerate(offsets.tolist()):
        out[k] = buffer[off : off + n]


class Handed(NamedTuple):
    """A prepared column of a batch handed over to another process: each value's slot in the
    arena (-1: in ``private`` instead, by position), and its shape; for a column the job
    augments (``dtype`` set), every value is one ``shape`` of ``dtype`` (a slot of the batch's
    own, freed on release) and ``shapes`` is unused."""

    offsets: npt.NDArray[np.int64]
    shapes: npt.NDArray[np.int32]
    private: dict[int, Any]
    dtype: np.dtype[Any] | None = None
    shape: tuple[int, ...] = ()


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


def hand_over(work: Work, arena: Arena, own: OwnSlots) -> dict[str, Any]:
    """``work`` for another process: the values stay pinned in the arena (its owner copies
    them out of shared memory and then releases them: :func:`release`); rows that failed are
    left out, and their pins released.

    A column the job augments is augmented here, by the loader's threads, into slots of the
    batch's own (``own``): the
    client then copies the job's images as they are, and the shared decodes they came from
    are released at once (a batch pins 150 KB per 224x224 image, not the 600 KB decode).
    """
    refuse_sources(work)
    keep = None
    if work.errors:
        keep = np.setdiff1d(np.arange(work.rows.size), np.fromiter(work.errors, np.intp))
        for ci in range(len(work.plan.prepared)):
            offsets = work.offsets[ci]
            dropped = np.setdiff1d(np.flatnonzero(offsets >= 0), keep)
            if dropped.size:
                arena.release(offsets[dropped])
                offsets[dropped] = -1
    prepared = {}
    for ci, (dec, _) in enumerate(work.plan.prepared):
        aug = work.plan.augment.get(dec.column)
        if aug is not None:
            prepared[dec.column] = _augment_over(work, ci, keep, arena, aug, own)
        elif keep is None:
            prepared[dec.column] = Handed(
                work.offsets[ci].copy(), work.shapes[ci].copy(), _private(work, ci)
            )
        else:
            prepared[dec.column] = Handed(
                work.offsets[ci][keep], work.shapes[ci][keep], _private(work, ci, keep)
            )
    gathered = work.values
    if keep is not None:
        gathered = {
            name: value[keep] if isinstance(value, np.ndarray) else [value[i] for i in keep]
            for name, value in work.values.items()
        }
    rows = work.rows if keep is None else work.rows[keep]
    return {ID_COLUMN: rows, "gathered": gathered, "prepared": prepared, "work": work}


def _augment_over(
    work: Work,
    ci: int,
    keep: npt.NDArray[np.intp] | None,
    arena: Arena,
    aug: Augmenter,
    own: OwnSlots,
) -> Handed:
    """The job's own augmentation of prepared column ``ci``, into fresh slots of the arena
    (or private arrays where it has no room); the sources' pins are released."""
    t0 = time.perf_counter()
    positions = range(work.rows.size) if keep is None else keep.tolist()
    shape, dtype = aug.output_shape, aug.dtype
    nbytes = math.prod(shape) * dtype.itemsize
    slots, _ = arena.reserve(own.space, own.keys(len(positions)), (nbytes,))
    private: dict[int, Any] = {}
    try:
        for k, (p, src) in enumerate(_values(work, ci, positions, arena)):
            slot = int(slots[k])
            if slot >= 0:
                out = arena.buffer[slot : slot + nbytes].view(dtype).reshape(shape)
            else:
                out = private[k] = np.empty(shape, dtype)
            aug.apply(src, work.epoch, int(work.rows[p]), out)
    except BaseException:
        arena.discard(slots[slots >= 0])
        raise
    sources = work.offsets[ci]
    held = sources[sources >= 0]
    if held.size:
        arena.release(held)
    sources[:] = -1
    sources[np.asarray(positions, np.intp)] = slots
    work.discard.add(ci)
    work.augment_s += time.perf_counter() - t0
    empty = np.zeros((0, 3), np.int32)
    return Handed(slots, empty, private, dtype, shape)


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
