"""One handed-over batch: where each of its values lies, its one wire encoding, its one copy out.

A prepared batch (:mod:`tabloader.engine._deliver.collate`) is a :class:`HandedBatch`: the ids and
each column of the job, each column an object that says where its values lie in ``memory`` (the
arena's buffer in the engine's process; the read-only mapping of it in a loader service's client)
and copies them out into the job's own arrays (:meth:`HandedBatch.copy_out`, the one copy of each
payload byte, wherever the job runs):

* :class:`Held`: values this process holds already (a job of the engine's process: its ids,
  the columns gathered for it), delivered as they are;
* :class:`Raw`: a fixed-width array in ``memory``; :class:`Arrow`: values of no fixed width
  (strings, variable lists) as an Arrow IPC stream there (what ``Held`` becomes on the wire);
* :class:`Images`: prepared images of one shape, each at its start in ``memory`` (-1: a value
  the arena had no room for, in ``private`` by position); :class:`ImageList`: of several;
* :class:`Augmented`: the job's augmented images (the service's pool made them), one shape and
  dtype; :class:`Augment`: decoded images the job augments as they are copied out (in the
  engine's process: its :class:`~tabloader.engine._prepare.augment.Augmenter` never travels).

A service's batch travels as :meth:`HandedBatch.to_wire`: its small columns, its prepared
columns' indexes and any value the arena had no room for go into a *staging* slot of shared
memory (:class:`Staging`), the reply says where; :meth:`HandedBatch.from_wire` checks a reply
(a malformed one is a ``ServiceError``, never an ``IndexError`` in a copy).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypedDict

import numpy as np
import numpy.typing as npt

from tabloader.catalog._bitmaps import ID_COLUMN
from tabloader.catalog._errors import ServiceError

if TYPE_CHECKING:
    from typing_extensions import Self

    from tabloader.engine._deliver.batchmem import BatchMemory
    from tabloader.engine._prepare.augment import Augmenter

LAYOUT_VERSION = 1  # of the wire encoding: both ends read the same
WEIGHT_COLUMN = "_weight"
"""A weighted job's batch column after ``_id``: float32 ``1 / (N p_row)`` per row (a plain
job's batches have none); it travels as any held column does."""
ALIGN = 64  # bytes: where each staged piece starts
MAX_DIMS = 8  # a value's dimensions at most (a layout from the wire)
MAX_ITEMSIZE = 64  # bytes of one element at most (complex256 and datetimes included)
MAX_SIDE = 1 << 24  # an image's height or width at most (its bytes then fit an int64)

Memory = npt.NDArray[np.uint8]


class _Named(TypedDict):
    name: str
    kind: str  # the column's class (its ``kind``): which of the other keys it has


class ColumnWire(_Named, total=False):
    """A column of a batch as JSON (``Column.to_wire``); offsets are relative to the batch's
    ``base``. ``raw``: ``offset``, ``dtype`` (numpy's ``str``), ``shape``; ``arrow``:
    ``offset``, ``size``; the prepared kinds: ``rows``, ``index`` (where their int64 index
    is), ``staged_bytes``, and ``shape`` (``images``, ``augmented``), ``dtype``
    (``augmented``)."""

    offset: int
    dtype: str
    shape: list[int]
    size: int
    rows: int
    index: int
    staged_bytes: int


class BatchWire(TypedDict):
    """A batch as JSON (:meth:`HandedBatch.to_wire`): the layout's version ``v``, where its
    staging lies (``base``: set by who places it) and its columns."""

    v: int
    base: int
    columns: list[ColumnWire]


class Column(Protocol):
    """One column of a handed-over batch."""

    name: str

    def copy_out(self, memory: Memory, into: BatchMemory) -> Any:
        """The column's values as the job's own (arrays from ``into``)."""

    def to_wire(self, staging: Staging) -> ColumnWire:
        """The column as JSON, its bytes added to ``staging``."""


class Staging:
    """What a batch's wire encoding puts into shared memory: pieces at ``ALIGN``-byte starts
    relative to where the staging is placed, once its size (``used``) is known; and the rows
    of prepared columns' indexes that name a value staged here (set as it is placed).

    The indexes go as int64 in staging, not as JSON lists: 256 tiny images' offsets and shapes
    took more of the service's and the client's time to encode and parse than to copy.
    """

    __slots__ = ("_fixups", "_pieces", "used")

    def __init__(self) -> None:
        self._pieces: list[tuple[int, Any]] = []  # (start, bytes-like)
        self._fixups: list[tuple[npt.NDArray[np.int64], int, int]] = []  # (index, row, start)
        self.used = 0

    def add(self, data: Any) -> int:
        """Stage ``data`` (bytes-like); its start, relative to the staging's."""
        start = self.used
        self._pieces.append((start, data))
        self.used += -(-memoryview(data).nbytes // ALIGN) * ALIGN
        return start

    def add_index(self, index: npt.NDArray[np.int64], private: Mapping[int, Any]) -> int:
        """Stage a prepared column's ``index`` (column 0: each value's start in memory) with
        the values in ``private`` (by row), whose starts are set once the staging is placed.
        Returns the index's start; ``private``'s bytes are the column's ``staged_bytes``."""
        for k, value in private.items():
            value = np.ascontiguousarray(value)
            self._fixups.append((index, int(k), self.add(value)))
        return self.add(index)

    def write(self, target: Memory, base: int) -> None:
        """Write the staged bytes at ``target[0:]``, which is ``memory[base:]``."""
        for index, k, start in self._fixups:
            index[k, 0] = base + start
        for start, data in self._pieces:
            raw = np.frombuffer(memoryview(data).cast("B"), np.uint8)
            target[start : start + raw.size] = raw


class HandedBatch:
    """A batch of ``rows`` rows: its ids and columns in the job's order (see the module
    docstring); ``work``: the engine's record whose pins it holds (a service's batch, until
    its client has copied it out; None in the client)."""

    __slots__ = ("columns", "rows", "work")

    def __init__(self, columns: list[Column], rows: int, work: Any = None) -> None:
        self.columns, self.rows, self.work = columns, rows, work

    def __len__(self) -> int:
        return self.rows

    def copy_out(self, memory: Memory, into: BatchMemory) -> dict[str, Any]:
        """The job's batch: each column's values copied out of ``memory`` (image batches into
        arrays from ``into``).

        Raises:
            ServiceError: a column (of a batch from the wire) has another length than the
                batch's rows.
        """
        out = {col.name: col.copy_out(memory, into) for col in self.columns}
        for name, values in out.items():
            if len(values) != self.rows:
                raise _malformed(f"column {name!r} has {len(values)} rows, not {self.rows}")
        return out

    def images(self) -> tuple[int, int, int]:
        """Images, their bytes and the bytes staged of them (the arena had no room) in the
        batch's prepared columns (``RemoteLoader.copies`` counts them)."""
        count = nbytes = staged = 0
        for col in self.columns:
            if isinstance(col, _Prepared):
                count += len(col.starts)
                nbytes += col.nbytes()
                staged += col.staged_bytes
        return count, nbytes, staged

    def to_wire(self, staging: Staging) -> BatchWire:
        """The batch as JSON, its bytes added to ``staging``; offsets in it are relative to
        ``base``, which the caller sets where the staging is placed (``Staging.write``)."""
        return {
            "v": LAYOUT_VERSION,
            "base": -1,
            "columns": [col.to_wire(staging) for col in self.columns],
        }

    @classmethod
    def from_wire(cls, wire: Any, memory: Memory) -> HandedBatch:
        """The batch that ``to_wire()`` made, its offsets checked against ``memory``.

        Raises:
            ServiceError: not that form (another tabloader on the other end, or a value
                outside ``memory``).
        """
        if not isinstance(wire, Mapping) or set(wire) != {"v", "base", "columns"}:
            raise _malformed(f"not a batch layout: {str(wire)[:80]}")
        if wire["v"] != LAYOUT_VERSION or type(wire["v"]) is not int:
            raise _malformed(f"a batch layout of version {wire['v']!r}, not {LAYOUT_VERSION}")
        base, columns = wire["base"], wire["columns"]
        if type(base) is not int or not isinstance(columns, list) or not columns:
            raise _malformed(f"base {str(base)[:20]} and columns {str(columns)[:40]}")
        read: list[Column] = []
        for col in columns:
            kind = col.get("kind") if isinstance(col, Mapping) else None
            if (
                not isinstance(kind, str)
                or kind not in _KINDS
                or not isinstance(col.get("name"), str)
            ):
                raise _malformed(f"a column {str(col)[:80]}")
            read.append(_KINDS[kind](_Wire(col, base, memory.size), memory))
        first = read[0]
        if not isinstance(first, Raw) or first.name != ID_COLUMN or len(first.shape) != 1:
            raise _malformed(f"its first column is not the {ID_COLUMN} array")
        rows = first.shape[0]
        for col in read:  # (an Arrow column's are counted as it is read: ``copy_out``)
            n = len(col.starts) if isinstance(col, _Prepared) else rows
            if isinstance(col, Raw):
                n = col.shape[0] if col.shape else -1
            if n != rows:
                raise _malformed(f"column {col.name!r} has {n} rows, not {rows}")
        return cls(read, rows)


def _malformed(what: str) -> ServiceError:
    return ServiceError(
        f"The loader service sent a malformed batch ({what}); run the same tabloader on both "
        "ends (restart the service after an upgrade)."
    )


class _Wire:
    """A column's JSON being read: each field checked as it is taken."""

    __slots__ = ("base", "col", "size")

    def __init__(self, col: Mapping[str, Any], base: int, size: int) -> None:
        self.col, self.base, self.size = col, base, size

    def number(self, key: str) -> int:
        value = self.col.get(key)
        if type(value) is not int or value < 0:
            raise _malformed(f"column {self.col['name']!r}'s {key!r} is {str(value)[:20]}")
        return value

    def shape(self) -> tuple[int, ...]:
        """A value's shape: at most ``MAX_DIMS`` sizes whose product, its sizes 0 taken as 1,
        is at most the memory's bytes (a shape of no bytes, with a size 0, makes no array
        numpy refuses either)."""
        shape = self.col.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(type(n) is int and n >= 0 for n in shape)
            or math.prod(max(n, 1) for n in shape) > self.size
        ):
            raise _malformed(f"column {self.col['name']!r}'s shape is {str(shape)[:40]}")
        return tuple(shape)

    def dtype(self) -> np.dtype[Any]:
        """A plain dtype of some bytes a value: no objects, no fields or sub-arrays, not of
        size 0 (a shape of any size would fit in no bytes)."""
        text = self.col.get("dtype")
        try:
            dtype = np.dtype(text) if isinstance(text, str) and len(text) <= 16 else None
        except Exception:  # numpy raises TypeError, ValueError, SyntaxError... for text
            dtype = None
        if dtype is None or dtype.kind not in "biufcmMSV" or dtype.fields or dtype.shape:
            raise _malformed(f"column {self.col['name']!r}'s dtype is {str(text)[:20]}")
        if not 0 < dtype.itemsize <= MAX_ITEMSIZE:
            raise _malformed(f"column {self.col['name']!r}'s dtype {text} has {dtype.itemsize} B")
        return dtype

    def span(self, key: str, nbytes: int) -> int:
        """The absolute start of ``nbytes`` at ``key`` (relative to the base), in memory."""
        start = self.base + self.number(key)
        if not nbytes:  # nothing to read there (an empty batch's)
            return 0
        if not (start >= 0 and start + nbytes <= self.size):
            raise _malformed(
                f"column {self.col['name']!r}: {nbytes} bytes at {start}, outside the "
                f"{self.size} bytes of shared memory"
            )
        return start

    def index(self, memory: Memory, width: int) -> npt.NDArray[np.int64]:
        """A prepared column's index (``rows`` x ``width`` int64 in staging), copied."""
        n = self.number("rows")
        start = self.span("index", n * width * 8)
        return np.frombuffer(memory, np.int64, n * width, start).reshape(n, width).copy()

    def starts(self, starts: npt.NDArray[np.int64], nbytes: npt.NDArray[Any] | int) -> None:
        """Check that each value, ``nbytes`` from its start, lies in memory (a start of -1: a
        value the client has, never one from the wire)."""
        if isinstance(nbytes, int) and nbytes > self.size:
            raise _malformed(f"column {self.col['name']!r} has values of {nbytes} bytes")
        if starts.size and ((starts < 0) | (starts > self.size - nbytes)).any():
            raise _malformed(f"column {self.col['name']!r} has values outside shared memory")


# -- columns ------------------------------------------------------------------------------------
class Held:
    """Values this process holds (an array or a list), delivered as they are: made for this
    batch alone (the gatherer's take, a copy of the ids), so no copy is needed."""

    __slots__ = ("name", "value")

    def __init__(self, name: str, value: Any) -> None:
        self.name, self.value = name, value

    def copy_out(self, memory: Memory, into: BatchMemory) -> Any:
        return self.value

    def to_wire(self, staging: Staging) -> ColumnWire:
        value = self.value
        if isinstance(value, np.ndarray) and value.dtype != object:
            value = np.ascontiguousarray(value)
            return Raw(self.name, staging.add(value), value.dtype, value.shape).to_wire(staging)
        import pyarrow as pa

        sink = pa.BufferOutputStream()
        table = pa.table({self.name: pa.array(list(value))})
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        buf = sink.getvalue()
        return Arrow(self.name, staging.add(buf), buf.size).to_wire(staging)


class Raw:
    """A fixed-width array of ``dtype`` and ``shape`` at ``offset`` in memory."""

    __slots__ = ("dtype", "name", "offset", "shape")
    kind: ClassVar[str] = "raw"

    def __init__(self, name: str, offset: int, dtype: np.dtype[Any], shape: tuple[int, ...]):
        self.name, self.offset, self.dtype, self.shape = name, offset, dtype, shape

    def copy_out(self, memory: Memory, into: BatchMemory) -> Any:
        view = np.frombuffer(memory, self.dtype, math.prod(self.shape), self.offset)
        return view.reshape(self.shape).copy()

    def to_wire(self, staging: Staging) -> ColumnWire:
        return {
            "name": self.name,
            "kind": self.kind,
            "offset": self.offset,
            "dtype": self.dtype.str,
            "shape": list(self.shape),
        }

    @classmethod
    def read(cls, wire: _Wire, memory: Memory) -> Raw:
        dtype, shape = wire.dtype(), wire.shape()
        offset = wire.span("offset", math.prod(shape) * dtype.itemsize)
        return cls(wire.col["name"], offset, dtype, shape)


class Arrow:
    """Values of no fixed width, an Arrow IPC stream of ``size`` bytes at ``offset``."""

    __slots__ = ("name", "offset", "size")
    kind: ClassVar[str] = "arrow"

    def __init__(self, name: str, offset: int, size: int) -> None:
        self.name, self.offset, self.size = name, offset, size

    def copy_out(self, memory: Memory, into: BatchMemory) -> Any:
        import pyarrow as pa  # only where a job has such columns

        from tabloader.engine._prepare.prep import batch_column, decoder_for

        data = pa.py_buffer(memory[self.offset : self.offset + self.size])
        try:  # every offset and string checked before a value is read (else a crash)
            table = pa.ipc.open_stream(data).read_all()
            table.validate(full=True)
            values = table.column(0).combine_chunks()
            return batch_column(values, decoder_for(table.schema.field(0)))
        except (pa.ArrowException, OSError, ValueError, IndexError, TypeError) as exc:
            raise _malformed(f"column {self.name!r} is no Arrow stream: {exc}") from None

    def to_wire(self, staging: Staging) -> ColumnWire:
        return {"name": self.name, "kind": self.kind, "offset": self.offset, "size": self.size}

    @classmethod
    def read(cls, wire: _Wire, memory: Memory) -> Arrow:
        size = wire.number("size")
        return cls(wire.col["name"], wire.span("offset", size), size)


class _Prepared:
    """A prepared column: each value's start in memory (-1: in ``private``, by position)."""

    __slots__ = ("name", "private", "staged_bytes", "starts")

    def __init__(
        self,
        name: str,
        starts: npt.NDArray[np.int64],
        private: dict[int, Any],
        staged_bytes: int = 0,
    ) -> None:
        self.name, self.starts, self.private = name, starts, private
        self.staged_bytes = staged_bytes  # of its values, staged by the service

    def nbytes(self) -> int:
        raise NotImplementedError

    def _value(self, memory: Memory, k: int, shape: tuple[int, ...]) -> Any:
        start = int(self.starts[k])
        if start < 0:
            return self.private[k]
        return memory[start : start + math.prod(shape)].reshape(shape)

    def _wire(self, staging: Staging, index: npt.NDArray[np.int64], kind: str) -> ColumnWire:
        index[:, 0] = self.starts
        staged = sum(np.asarray(v).nbytes for v in self.private.values())
        return {
            "name": self.name,
            "kind": kind,
            "rows": len(index),
            "index": staging.add_index(index, self.private),
            "staged_bytes": staged,
        }


_UINT8 = np.dtype(np.uint8)


class Images(_Prepared):
    """Prepared images of one ``shape``: uint8 (:class:`Augmented`: of any ``dtype``)."""

    __slots__ = ("dtype", "shape")
    kind: ClassVar[str] = "images"

    def __init__(
        self,
        name: str,
        starts: npt.NDArray[np.int64],
        shape: tuple[int, ...],
        private: dict[int, Any],
        staged_bytes: int = 0,
        *,
        dtype: np.dtype[Any] = _UINT8,
    ) -> None:
        super().__init__(name, starts, private, staged_bytes)
        self.shape, self.dtype = shape, dtype

    def nbytes(self) -> int:
        return len(self.starts) * math.prod(self.shape) * self.dtype.itemsize

    def copy_out(self, memory: Memory, into: BatchMemory) -> Any:
        n = len(self.starts)
        out = into.empty((n, *self.shape), self.dtype)
        rows = out.reshape(n, math.prod(self.shape)).view(np.uint8)  # each value's bytes
        if n and not self.private:  # the usual case: every value in memory, one gather
            gather(memory, self.starts, rows)
            return out
        for k in range(n):
            start = int(self.starts[k])
            if start < 0:
                out[k] = self.private[k]
            else:
                rows[k] = memory[start : start + rows.shape[1]]
        return out

    def to_wire(self, staging: Staging) -> ColumnWire:
        wire = self._wire(staging, np.empty((len(self.starts), 1), np.int64), self.kind)
        wire["shape"] = list(self.shape)
        return wire

    @classmethod
    def read(cls, wire: _Wire, memory: Memory) -> Self:
        shape, dtype = wire.shape(), cls._dtype(wire)
        starts = wire.index(memory, 1)[:, 0]
        wire.starts(starts, math.prod(shape) * dtype.itemsize)
        name, staged_bytes = wire.col["name"], wire.number("staged_bytes")
        return cls(name, starts, shape, {}, staged_bytes, dtype=dtype)

    @classmethod
    def _dtype(cls, wire: _Wire) -> np.dtype[Any]:
        """The dtype of the values ``wire`` says are there: uint8 (it says none)."""
        return _UINT8


class ImageList(_Prepared):
    """Prepared images of several shapes: ``shapes`` (height, width, channels; 0: grey)."""

    __slots__ = ("shapes",)
    kind: ClassVar[str] = "image_list"

    def __init__(
        self,
        name: str,
        starts: npt.NDArray[np.int64],
        shapes: npt.NDArray[Any],
        private: dict[int, Any],
        staged_bytes: int = 0,
    ) -> None:
        super().__init__(name, starts, private, staged_bytes)
        self.shapes = shapes

    def nbytes(self) -> int:
        return int(_sizes(self.shapes).sum())

    def copy_out(self, memory: Memory, into: BatchMemory) -> Any:
        shapes = self.shapes.tolist()
        return [np.array(self._value(memory, k, image_shape(s))) for k, s in enumerate(shapes)]

    def to_wire(self, staging: Staging) -> ColumnWire:
        index = np.empty((len(self.starts), 4), np.int64)
        index[:, 1:] = self.shapes
        return self._wire(staging, index, self.kind)

    @classmethod
    def read(cls, wire: _Wire, memory: Memory) -> ImageList:
        index = wire.index(memory, 4)
        sides, channels = index[:, 1:3], index[:, 3]
        if ((sides < 0) | (sides > MAX_SIDE)).any() or ((channels < 0) | (channels > 4)).any():
            raise _malformed(f"column {wire.col['name']!r} has image shapes out of range")
        wire.starts(index[:, 0], _sizes(index[:, 1:]))
        return cls(wire.col["name"], index[:, 0], index[:, 1:], {}, wire.number("staged_bytes"))


class Augmented(Images):
    """The job's augmented images, every one ``shape`` of ``dtype`` (copied out, counted and
    checked as :class:`Images` are; the dtype travels too)."""

    __slots__ = ()
    kind: ClassVar[str] = "augmented"

    def to_wire(self, staging: Staging) -> ColumnWire:
        wire = super().to_wire(staging)
        wire["dtype"] = self.dtype.str
        return wire

    @classmethod
    def _dtype(cls, wire: _Wire) -> np.dtype[Any]:
        return wire.dtype()


class Augment(_Prepared):
    """Decoded images (``shapes`` as ``ImageList``'s) that the job's ``augmenter`` augments
    for ``epoch`` as they are copied out, each straight into its slot of the batch (the
    crop-resize is the one copy; see :mod:`tabloader.engine._prepare.augment`); ``rows`` are their
    ids (the draws' keys); ``seconds``: the time it took."""

    __slots__ = ("augmenter", "epoch", "rows", "seconds", "shapes")

    def __init__(
        self,
        name: str,
        starts: npt.NDArray[np.int64],
        shapes: npt.NDArray[Any],
        private: dict[int, Any],
        augmenter: Augmenter,
        epoch: int,
        rows: npt.NDArray[np.int64],
    ) -> None:
        super().__init__(name, starts, private)
        self.shapes, self.augmenter, self.epoch, self.rows = shapes, augmenter, epoch, rows
        self.seconds = 0.0

    def nbytes(self) -> int:
        aug = self.augmenter
        return len(self.starts) * math.prod(aug.output_shape) * aug.dtype.itemsize

    def copy_out(self, memory: Memory, into: BatchMemory) -> Any:
        t0 = time.perf_counter()
        aug, n = self.augmenter, len(self.starts)
        out = into.empty((n, *aug.output_shape), aug.dtype)
        if n and not self.private:  # the usual batch: one kernel call for it
            aug.apply_batch(memory, self.starts, self.shapes[:, :2], self.epoch, self.rows, out)
        else:
            for k, s in enumerate(self.shapes.tolist()):
                src = self._value(memory, k, image_shape(s))
                aug.apply(src, self.epoch, int(self.rows[k]), out[k])
        self.seconds += time.perf_counter() - t0
        return out

    def to_wire(self, staging: Staging) -> ColumnWire:
        raise ServiceError(  # pragma: no cover - a service augments before it hands over
            f"Column {self.name!r} is augmented as it is copied out, in this process; a "
            "service's batch carries its images augmented already (kind 'augmented')."
        )


_KINDS: dict[str, Callable[[_Wire, Memory], Column]] = {
    c.kind: c.read for c in (Raw, Arrow, Images, ImageList, Augmented)
}


def image_shape(shape: list[int]) -> tuple[int, ...]:
    """An image's array shape from its (height, width, channels) row (0 channels: grey)."""
    h, w, c = shape
    return (h, w, c) if c else (h, w)


def _sizes(shapes: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    """Each image's bytes from its (height, width, channels) row."""
    shapes = shapes.astype(np.int64)
    sizes: npt.NDArray[np.int64] = shapes[:, 0] * shapes[:, 1] * np.maximum(shapes[:, 2], 1)
    return sizes


def gather(buffer: Memory, offsets: npt.NDArray[np.int64], out: npt.NDArray[np.uint8]) -> None:
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
