"""Where each value of a binary column lies in its file: small rows read one value at a time.

A record batch is the unit Arrow IPC reads: ``get_batch`` of a batch of 128 tiny JPEGs reads
all 128 (about 130 KB) to hand out one, and a random order touches a new batch for nearly
every row. Profiled on 400,000 24x24 JPEGs, those whole-batch reads were a quarter of the
decode processes' time. So for a part of at least ``INDEX_ROWS`` rows per record batch, the
first read of each batch (the checked one: ``validate(full=True)`` and the column's checksum,
as every first read is; see :mod:`tabloader.catalog.storage._reader`) also records where each of its
values lies in the file, and later reads of the batch's rows read those bytes only (a
``pread`` each, with the GIL released).

The positions come from the same batch seen through a memory map of the file (zero-copy: a
value's buffer address less the map's address is its place in the file; a reader of some of
the columns only would copy them; a store that copies every read, where a map cannot be had,
gives no positions, and its parts are read a record batch at a time); its offsets must
equal the checked batch's, value for value, or the file changed under the reader and the
batch counts as damaged. Only the map's pages holding the batch's metadata and offsets are
touched, never the values', so the map adds almost nothing to the process's resident set.

Memory: 12 bytes per row of an indexed part (400,000 rows: 4.8 MB), per reader and column.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from tabloader.catalog._arrays import is_binary

if TYPE_CHECKING:
    from tabloader.catalog.storage._stores import Store

INDEX_ROWS = 8
"""Parts with at least this many rows per record batch are indexed (larger rows have few
rows per batch: a batch read is about a value read there)."""


def is_payload(t: pa.DataType) -> bool:
    """True for types that stay out of DuckDB: binary payloads, also inside nested types."""
    return is_binary(t) or any(is_payload(t.field(i).type) for i in range(t.num_fields))


def binary_array(column: pa.Array) -> pa.Array | None:
    """``column`` as the binary array its values are (a Hugging Face image struct's ``bytes``
    field), or None if it is not one (a string, a list...)."""
    if pa.types.is_struct(column.type):
        try:
            column = column.field("bytes")
        except KeyError:
            return None
    t = column.type
    return column if pa.types.is_binary(t) or pa.types.is_large_binary(t) else None


def binary_offsets(column: pa.Array) -> tuple[npt.NDArray[Any], pa.Buffer]:
    """The ``len(column) + 1`` value offsets of a binary ``column`` and its data buffer (the
    values of row ``r``: ``data[offsets[r]:offsets[r + 1]]``)."""
    _, offset_buf, data = column.buffers()[:3]
    kind = np.int64 if pa.types.is_large_binary(column.type) else np.int32
    offsets = np.frombuffer(offset_buf, kind)[column.offset : column.offset + len(column) + 1]
    return offsets, data


class ValueIndex:
    """The file positions of one binary column's values in one part (see the module docstring).

    Args:
        store: where the part lies (:mod:`tabloader.catalog.storage._stores`).
        name: the part's file in it.
        size: its size in bytes, as recorded (each open checks it).
        num_rows: its rows.
        rows_per_batch: its rows per record batch.
        column: the column's index in the file's schema.
    """

    def __init__(
        self, store: Store, name: str, size: int, num_rows: int, rows_per_batch: int, column: int
    ) -> None:
        self.store, self.name, self.size = store, name, size
        self.rows_per_batch, self._column = rows_per_batch, column
        self.start = np.full(num_rows, -1, np.int64)  # -1: not located yet, or null
        self.length = np.full(num_rows, -1, np.int32)  # -1: null (once located)
        self.located = np.zeros(-(-num_rows // rows_per_batch), bool)  # per record batch
        self._file: pa.OSFile | None = None
        self._map: Any = None  # (memory map, its IPC reader, the map's address)
        self._lock = threading.Lock()

    def locate(self, batch: int, checked: pa.Array) -> bool:
        """Record where the values of record batch ``batch`` lie; ``checked`` is its column
        as the reader's checked first read returned it (a binary array). False: they have no
        place in the file to read them from (a compressed file: read its batches whole).

        Raises:
            ValueError: the file's batch is not the checked one (the file changed).
        """
        source, reader, base = self._mapped()
        if base is None:  # the store copies what it reads: no place in the file to be had
            return False
        mapped = binary_array(reader.get_batch(batch).column(self._column))
        if mapped is None or len(mapped) != len(checked):
            raise ValueError("the file changed while it was read")
        offsets, data = binary_offsets(mapped)
        expected, _ = binary_offsets(checked)
        if not np.array_equal(offsets, expected) or int(offsets[-1]) > data.size:
            raise ValueError("the file changed while it was read")
        at = data.address - base
        if at < 0 or at + data.size > source.size():  # not a view of the file
            return False
        first = batch * self.rows_per_batch
        rows = slice(first, first + len(checked))
        self.start[rows] = at + offsets[:-1].astype(np.int64)
        self.length[rows] = np.diff(offsets).astype(np.int32)
        if checked.null_count:
            nulls = np.asarray(checked.is_null())
            self.length[first : first + len(checked)][nulls] = -1
        self.located[batch] = True
        return True

    def read(self, rows: npt.NDArray[np.int64]) -> list[Any]:
        """The values of ``rows`` (rows of this part, in located batches): ``bytes``-like
        buffers, None for nulls; one ``pread`` per value."""
        file = self._file
        if file is None:
            with self._lock:
                if self._file is None:
                    self._file = self._open(memory_map=False)
                file = self._file
        read_at = file.read_at
        return [
            None if n < 0 else read_at(n, p)
            for p, n in zip(self.start[rows].tolist(), self.length[rows].tolist(), strict=True)
        ]

    def _open(self, *, memory_map: bool) -> pa.NativeFile:
        """The part opened through its store, checked as the store checks (local: a regular
        file of its size, never through a link)."""
        what = f"Data file '{self.store.locate(self.name)}'"
        return self.store.open_part(self.name, size=self.size, what=what, memory_map=memory_map)

    def _mapped(self) -> tuple[Any, Any, int | None]:
        with self._lock:
            if self._map is None:
                source = self._open(memory_map=True)
                first, again = _first_byte(source), _first_byte(source)
                # zero-copy (two reads of the first byte are one byte): where the map starts
                base = first.address if first.address == again.address else None
                # every column: a reader of some columns only copies them (``included_fields``)
                reader = pa.ipc.open_file(source)
                self._map = (source, reader, base)
            return self._map  # type: ignore[no-any-return]


def _first_byte(source: pa.NativeFile) -> pa.Buffer:
    source.seek(0)
    return source.read_buffer(1)
