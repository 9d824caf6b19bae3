"""Step 1 of preparing a batch (:mod:`tabloader.engine._prepare.fetch`): the cheap columns, with no
cache.

Numbers, strings, lists and raw bytes cost less to read than to cache, so they are read
straight into the batch with vectorized takes. A fixed-width, null-free column of at most
``FLAT_BYTES`` is read whole once (in a thread of its own; from the catalog's DuckDB table, a
columnar scan), then each batch is one numpy ``take``; any other column, and such a column
until that read is done, is read with :meth:`DatasetReader.gather` (ids grouped by record
batch, each record batch read once, one Arrow ``take`` each).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from tabloader.catalog.storage import DatasetReader
from tabloader.engine._arena.accounting import Counters
from tabloader.engine._prepare.prep import DecodeKind, Decoder, batch_column

logger = logging.getLogger(__name__)

FLAT_BYTES = 64 << 20  # fixed-width columns up to this size are read whole, once
READ_WAIT_S = 0.05  # the longest a batch waits for its column's read whole


class Gatherer:
    """Reads the cheap columns of batches of one dataset.

    Args:
        table: reads the columns (for a dataset of small rows a memory map: zero-copy
            record batches).
        counters: where raw-bytes reads are counted.
        read_column: ``(column, rows) -> pyarrow.Array``, a cheap column whole from the
            catalog's table (one columnar scan: 2 ms for the labels of 2,000 images against
            30 ms through their record batches); None, or a failure, reads ``table``.
    """

    def __init__(
        self,
        table: DatasetReader,
        counters: Counters,
        read_column: Callable[[str, int], pa.Array] | None = None,
    ) -> None:
        self.table = table
        self.counters = counters
        self.read_column = read_column
        self._flat: dict[str, npt.NDArray[Any] | None] = {}
        self._reading: dict[str, threading.Event] = {}  # columns read whole, in the background
        self._threads: list[threading.Thread] = []  # their threads (joined by ``close``)
        self._lock = threading.Lock()

    def set_table(self, table: DatasetReader) -> None:
        """Read a newer version of the dataset (a column being read whole is of the old one)."""
        with self._lock:
            self.table = table
            self._flat.clear()
            self._reading.clear()  # (a read of the old version still sets its event)

    def flat(self, column: str) -> npt.NDArray[Any] | None:
        """``column``'s values read whole, by row id (None until its background read is done,
        or when it is not read whole)."""
        return self._flat.get(column)

    def all_flat(self, decoders: Sequence[Decoder]) -> bool:
        """Whether every column of ``decoders`` is read whole already (a batch of them is a
        few microseconds of numpy takes)."""
        return all(self._flat.get(d.column) is not None for d in decoders)

    def gather(self, rows: npt.NDArray[np.int64], decoders: Sequence[Decoder]) -> dict[str, Any]:
        """The values of ``rows`` in each column of ``decoders``: new arrays, the job's own."""
        out: dict[str, Any] = {}
        rest: list[Decoder] = []
        for dec in decoders:
            flat = self._flat_column(dec)
            if flat is not None:
                out[dec.column] = flat[rows]
            else:
                rest.append(dec)
        if rest:
            table = self.table.gather(rows, tuple(d.column for d in rest))
            for dec in rest:
                values = table.column(dec.column).combine_chunks()
                out[dec.column] = batch_column(values, dec)
                if dec.kind is DecodeKind.BYTES:
                    self.counters.add(
                        reads=len(values) - values.null_count,
                        bytes_read=values.buffers()[2].size if len(values) else 0,
                    )
        return out

    def _flat_column(self, dec: Decoder) -> npt.NDArray[Any] | None:
        """The whole column as one array when it is fixed-width, null-free and small; None
        for another column, and while it is being read.

        It is read in a thread of its own (from the catalog's table, a columnar scan of a few
        milliseconds, else from the files: the first read touches every record batch, 30-170
        ms for the labels of 2,000 images stored two rows a batch). A batch waits for that
        read ``READ_WAIT_S`` at most (the catalog's scan is usually done by then; gathering a
        first batch's labels through its image record batches took 50-70 ms of a pool thread
        in a service's first batch), then gathers its rows as any other column's: no pool
        thread (which decodes must land on) waits long for it.
        """
        reading = self._read_whole(dec)
        if reading is not None:
            reading.wait(READ_WAIT_S)
        return self._flat.get(dec.column)

    def reading(self, decoders: Sequence[Decoder]) -> bool:
        """Whether a column of ``decoders`` is being read whole now (its read started here if
        it was not yet): the fetcher then gathers a batch's rows after its decodes, not before
        them (a first batch's gather would hold a pool thread its decodes wait for)."""
        started = [self._read_whole(dec) for dec in decoders]  # each column's read starts
        return any(r is not None for r in started)

    def _read_whole(self, dec: Decoder) -> threading.Event | None:
        """The read of ``dec``'s column whole in flight (started now if it was not yet), or
        None when it is done."""
        if dec.column in self._flat:
            return None
        with self._lock:
            if dec.column in self._flat:
                return None
            reading = self._reading.get(dec.column)
            if reading is None:
                reading = self._reading[dec.column] = threading.Event()
                thread = threading.Thread(
                    target=self._read_flat_into,
                    args=(dec, self.table, reading),
                    name=f"tabloader-read-{dec.column}",
                    daemon=True,
                )
                self._threads.append(thread)
                thread.start()
            return reading

    def close(self) -> None:
        """Wait for the columns being read whole (no thread of a loader outlives it)."""
        with self._lock:
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join()

    def _read_flat_into(self, dec: Decoder, table: DatasetReader, done: threading.Event) -> None:
        try:
            flat = self._read_flat(dec, table)
        except Exception as exc:  # batches gather their rows and report what fails there
            logger.debug("column %r not read whole: %r", dec.column, exc)
            flat = None
        with self._lock:
            if self.table is table:  # else a newer version came meanwhile: read it again
                self._flat[dec.column] = flat
                self._reading.pop(dec.column, None)
        done.set()

    def _read_flat(self, dec: Decoder, table: DatasetReader) -> npt.NDArray[Any] | None:
        t = table.schema.field(dec.column).type
        width = _fixed_width(t)
        if width is None or width * table.num_rows > FLAT_BYTES or not table.num_rows:
            return None
        column = None
        if self.read_column is not None:
            try:
                column = self.read_column(dec.column, table.num_rows)
            except Exception as exc:  # the Arrow files then (they are checked on first read)
                logger.debug("column %r not read from the catalog: %r", dec.column, exc)
        if column is None or column.type != t or len(column) != table.num_rows:
            values = table.gather(np.arange(table.num_rows), (dec.column,))
            column = values.column(0).combine_chunks()
        if column.null_count or (pa.types.is_fixed_size_list(t) and column.flatten().null_count):
            return None
        out = batch_column(column, dec)
        return out if isinstance(out, np.ndarray) else None


def _fixed_width(t: pa.DataType) -> int | None:
    """Bytes per value of a fixed-width numeric column (or fixed-size list of one), else None."""
    if pa.types.is_fixed_size_list(t):
        inner = _fixed_width(t.value_type)
        return None if inner is None else inner * t.list_size
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return int(t.bit_width // 8)
    if pa.types.is_boolean(t):
        return 1
    return None
