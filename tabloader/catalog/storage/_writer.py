"""Write one Arrow IPC *file* (footer-indexed, random access) with fixed rows per batch.

Why fixed rows per batch: a reader maps ``_id`` to a record batch by division, so opening a dataset
never scans. Why small batches for large rows: ``get_batch`` reads the whole batch (every column,
every row) to return one row, and a slice keeps the batch alive; 1-64 rows per batch for 10-100 KB
rows gave the best random reads (``python -m benchmarks catalog``). We aim for about
``TARGET_BATCH_BYTES`` per batch, rounded down to a power of two.

Given a ``FileIdentity``, the file's schema metadata records it and every record batch carries its
columns' checksums (``tabloader.catalog.storage._checksums``). Crash safety is unchanged: the file
is written under a temporary name, fsynced, and only then renamed and committed by the catalog; the
checksums travel inside the file, so there is no second file to keep in step.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from tabloader.catalog._directory import FILE_MODE
from tabloader.catalog.storage._checksums import FileIdentity, digests_metadata

TARGET_BATCH_BYTES = 256 * 1024
MAX_ROWS_PER_BATCH = 64 * 1024
# Flush to disk every this many bytes on a background thread while writing, so the fsync that
# makes an import durable waits for the last stretch only (fsync costs ~0.4 ms per MB here: a
# 1 GiB import spent 0.48 of its 1.2 s in its final fsync).
SYNC_EVERY_BYTES = 64 << 20


RANGED_BATCH_BYTES = 32 * 1024
"""The target of a part stored in object storage: there a record batch is what one request
fetches and one checksum checks, and a uniform order wants one row of a batch at a time, so
every other row of it is fetched for nothing (or held, in memory, until its turn). Rows of
this size or more get a batch each (bytes fetched: the rows'); smaller rows share one of
about this size, which costs a request's latency more than its bytes. Measured (``python -m
benchmarks storage``, 36 KB JPEGs, 4 a batch at ``TARGET_BATCH_BYTES``): one job through 10 ms
requests fetched 1.4-1.7x the dataset an epoch with 4 a batch, 1.0x with one."""


def choose_rows_per_batch(avg_row_bytes: float, *, ranged: bool = False) -> int:
    """Return the rows per record batch for rows of ``avg_row_bytes`` (a power of two); of a
    part stored in object storage (``ranged``), for reads of one row (``RANGED_BATCH_BYTES``)."""
    target = RANGED_BATCH_BYTES if ranged else TARGET_BATCH_BYTES
    rows = max(1, int(target // max(avg_row_bytes, 1.0)))
    return min(MAX_ROWS_PER_BATCH, 1 << (rows.bit_length() - 1))


@dataclass(frozen=True)
class PartInfo:
    """Where one part's rows live.

    Attributes:
        path: file path relative to the catalog directory.
        first_id: ``_id`` of the part's first row.
        num_rows: rows in the part.
        rows_per_batch: rows in every record batch but the last.
        file_size: bytes, checked at open to catch truncated files without a scan.
        version: the dataset version that added this part.
    """

    path: str
    first_id: int
    num_rows: int
    rows_per_batch: int
    file_size: int
    version: int

    @property
    def end_id(self) -> int:
        """One past the ``_id`` of the part's last row."""
        return self.first_id + self.num_rows

    @property
    def num_batches(self) -> int:
        """Record batches in the file."""
        return -(-self.num_rows // self.rows_per_batch)


class PartWriter:
    """Stream record batches into one IPC file, re-cut to ``rows_per_batch`` rows each.

    With ``identity`` (as the catalog always passes), the file records it and a checksum per
    record batch and column; without, it is a plain file of the format before checksums.
    """

    def __init__(
        self,
        path: Path,
        schema: pa.Schema,
        rows_per_batch: int,
        *,
        identity: FileIdentity | None = None,
    ) -> None:
        self.path = path
        self.schema = schema
        self.rows_per_batch = rows_per_batch
        self.identity = identity
        self.num_rows = 0
        self._sink = pa.OSFile(str(path), "wb")
        os.chmod(path, FILE_MODE)  # private, whatever the umask (see tabloader.catalog._directory)
        stored = schema
        if identity is not None:
            stored = schema.with_metadata({**(schema.metadata or {}), **identity.metadata()})
        self._writer = pa.ipc.new_file(self._sink, stored)
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._synced = 0  # bytes that the last background flush covers
        self._flush: threading.Thread | None = None

    def write(self, batch: pa.RecordBatch) -> None:
        """Buffer ``batch`` and write every full record batch."""
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        while self._pending_rows >= self.rows_per_batch:
            self._emit(self.rows_per_batch)

    def _emit(self, rows: int) -> None:
        first = self._pending[0]
        if first.num_rows >= rows:  # the common case: a slice of one batch, no copy
            self._write_batch(first.slice(0, rows))
            self._pending[0] = first.slice(rows)
        else:
            table = pa.Table.from_batches(self._pending, self.schema)
            head = table.slice(0, rows).combine_chunks()
            self._write_batch(head.to_batches(max_chunksize=rows)[0])
            self._pending = table.slice(rows).to_batches()
        self._pending_rows -= rows
        self.num_rows += rows
        written = self._sink.tell()
        if written - self._synced >= SYNC_EVERY_BYTES and not self._flushing():
            self._synced = written
            self._flush = threading.Thread(
                target=os.fdatasync, args=(self._sink.fileno(),), name="tabloader-flush"
            )
            self._flush.start()

    def _write_batch(self, batch: pa.RecordBatch) -> None:
        if self.identity is None:
            self._writer.write_batch(batch)
        else:
            self._writer.write_batch(batch, custom_metadata=digests_metadata(batch))

    def _flushing(self) -> bool:
        """True while a background flush runs."""
        return self._flush is not None and self._flush.is_alive()

    def _join_flush(self) -> None:
        if self._flush is not None:
            self._flush.join()
            self._flush = None

    def close(self) -> int:
        """Write the last short batch and the footer, fsync, and return the file size."""
        if self._pending_rows:
            self._emit(self._pending_rows)
        self._writer.close()
        self._sink.flush()
        self._join_flush()
        os.fsync(self._sink.fileno())
        self._sink.close()
        return self.path.stat().st_size

    def abort(self) -> None:
        """Close and delete the file after a failure."""
        with contextlib.suppress(Exception):  # the writer may be in a broken state already
            self._writer.close()
        self._join_flush()
        self._sink.close()
        self.path.unlink(missing_ok=True)
