"""Random-access reads of a dataset's rows from its Arrow IPC files.

The files are opened through the reader's store (:mod:`tabloader.catalog.storage._stores`): local
files, or a store registered for its root's URI scheme; the reader's ``spec()`` names it by URI.
Opening a part reads only its footer (``pa.ipc.open_file``); the file size, batch count and the
identity the file records (dataset, part, file name, first ``_id``; see
``tabloader.catalog.storage._checksums``) are checked against the catalog, so a truncated, replaced
or swapped file is reported at open, not as wrong rows later. The first read of each record batch in
a reader also checks its values (``validate(full=True)``) and the checksums of the columns read;
later reads of that batch trust it (a bool per batch, per set of columns).

Rows are located by arithmetic (see ``tabloader.catalog.storage``); a batched ``take`` groups ids by
record batch so each batch is touched once, then restores the caller's order with one
``take`` on a single-chunk table (never on a chunked binary column, which would concatenate
every chunk).

Two ways to read, chosen per reader (``memory_map``):

* memory map (default, for ``Dataset.take``): zero-copy, the fastest single-row reads;
* ``pread`` (``pa.OSFile``, for the loading engine's threads): with a map, every page an epoch
  touches stays in the process's resident set (an 800 MB dataset read once made a 1 GB RSS in
  ``bench e2e``), and a fault on a cold page blocks while holding the GIL, so reader threads
  stall each other; ``get_batch`` on a file reads with the GIL released and copies one batch
  (33 us vs 27 us per warm single-row batch of ~80 KB images).
"""

from __future__ import annotations

import operator
import os
import sys
import threading
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from tabloader.catalog._arrays import empty_table, id_array
from tabloader.catalog._bitmaps import ID_COLUMN
from tabloader.catalog._errors import RowIdError, StorageError, UnknownColumnError, did_you_mean
from tabloader.catalog._settings import STORAGE_ENV
from tabloader.catalog.storage._checksums import FileIdentity, column_digest, parse_digests
from tabloader.catalog.storage._ranged import PartFile
from tabloader.catalog.storage._stores import (
    LocalStore,
    RangedStore,
    Store,
    open_store,
)
from tabloader.catalog.storage._values import (
    INDEX_ROWS,
    ValueIndex,
    binary_array,
    binary_offsets,
    is_payload,
)
from tabloader.catalog.storage._writer import PartInfo

if TYPE_CHECKING:
    from tabloader.catalog.storage._tier import BatchCache

ID_FIELD = pa.field(ID_COLUMN, pa.int64(), nullable=False)
_INT64 = pa.int64()
Fields = tuple[int, ...] | None  # the field indices a file reader reads (None: all)
ReaderSpec = tuple[str, list[PartInfo], pa.Schema, bool]
"""What another process needs to open a reader again: its store's URI, parts, schema and
whether it verifies (picklable; ``DatasetReader.spec``)."""


def _check_part_path(part: PartInfo, root: str | os.PathLike[str]) -> None:
    """Refuse a part whose recorded path is not a plain path under the storage root (the
    catalog records ``data/<dataset>/<file>``): an absolute one, or one with ``..``, names a
    file anywhere, which the reader would read as the dataset's rows.

    Raises:
        StorageError: the catalog recorded such a path (it is damaged).
    """
    path = part.path
    if not isinstance(path, str) or not path:
        why = "not a path"
    elif PurePosixPath(path).is_absolute():
        why = "absolute"
    elif ".." in PurePosixPath(path).parts or "\\" in path or "\0" in path:
        why = "outside the storage root (it has '..', a backslash or a NUL)"
    else:
        return
    raise StorageError(
        f"The catalog is damaged: it records part {path!r} (rows "
        f"{_rows(part.first_id, part.end_id)}), which is {why}; a part's path is relative to "
        f"the dataset's storage ({root}), as data/<dataset>/<file>. Restore catalog.duckdb "
        "from a backup, or re-import the dataset (DROP DATASET, then CREATE DATASET).",
        path=str(path),
        rows=range(part.first_id, part.end_id),
    )


class DatasetReader:
    """Read rows by ``_id`` from the parts of one dataset version.

    Args:
        root: where the parts lie (their paths are relative to it): the catalog directory, or
            the URI of a store (:mod:`tabloader.catalog.storage._stores`).
        parts: the parts, in ``_id`` order.
        schema: the stored schema (without ``_id``).
        memory_map: read through memory maps (True) or with ``pread`` (False); see above.
        verify: check record batch checksums on first read (default; False only to measure
            their cost). File identities are checked either way.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        parts: Sequence[PartInfo],
        schema: pa.Schema,
        *,
        memory_map: bool = True,
        verify: bool = True,
    ) -> None:
        self.root = root
        self.store: Store = open_store(root)
        self.memory_map = memory_map
        self.verify = verify
        self.parts = list(parts)
        for part in self.parts:
            _check_part_path(part, root)
        self.schema = schema
        self.num_rows = sum(p.num_rows for p in self.parts)
        self._first_list = [p.first_id for p in self.parts]
        self._rpb_list = [p.rows_per_batch for p in self.parts]
        self._first_ids = np.array(self._first_list, dtype=np.int64)
        self._rows_per_batch = np.array(self._rpb_list, dtype=np.int64)
        # An open file per (part, columns read): None reads every column; a tuple of field
        # indices reads only those columns' bytes (``IpcReadOptions.included_fields``).
        self._files: dict[tuple[int, Fields], pa.ipc.RecordBatchFileReader] = {}
        self._fields: dict[tuple[str, ...], Fields] = {}
        # Batches whose values passed ``validate(full=True)``, per (part, fields): a damaged
        # offset would otherwise make a gather read out of bounds (a crash, not an error).
        self._checked: dict[tuple[int, Fields], np.ndarray] = {}
        # Per part: True when its file carries checksums (format 2), False for an older file.
        self._checksummed: dict[int, bool] = {}
        # Where the values of a binary column lie, per (part, fields) of small rows
        # (``binary_values``); None: that part is read a record batch at a time.
        self._values: dict[tuple[int, Fields], ValueIndex | None] = {}
        self._lock = threading.Lock()
        # Object storage: batches fetched by ranged reads, checked at every fetch (ranged.py)
        self._ranged = isinstance(self.store, RangedStore)
        self._whole: dict[Fields, bool] = {}
        # where fetched batches are looked for first and offered once read (the loader's
        # storage tier; ``tabloader.catalog.storage._tier``); None: none
        self.tier: BatchCache | None = None
        # bytes of local files read through this reader (record batches' buffers, values
        # read alone): what an epoch reads from a local disk (object storage: the store's
        # counters)
        self.bytes_read = 0
        self._count_lock = threading.Lock()

    @property
    def ranged(self) -> bool:
        """Whether the parts are read by ranged reads (object storage)."""
        return self._ranged

    def _count(self, nbytes: int) -> None:
        with self._count_lock:
            self.bytes_read += nbytes

    def spec(self) -> ReaderSpec:
        """What another process needs to open this reader again (``from_spec``): picklable,
        the store named by its URI."""
        return (self.store.uri, self.parts, self.schema, self.verify)

    def locate_part(self, index: int) -> str:
        """Where part ``index``'s file lies (a local path, or its store's URL)."""
        return self.store.locate(self.parts[index].path)

    @classmethod
    def from_spec(cls, spec: ReaderSpec, *, memory_map: bool) -> DatasetReader:
        """A reader of ``spec`` (``spec()``): the same files, its own caches and checks."""
        root, parts, schema, verify = spec
        return cls(root, parts, schema, memory_map=memory_map, verify=verify)

    @property
    def dataset(self) -> str:
        """The dataset's name (its folder under ``data/``)."""
        return Path(self.parts[0].path).parent.name if self.parts else ""

    def checksummed(self, index: int) -> bool:
        """Whether part ``index``'s file carries checksums (opens it)."""
        self._file(index)
        return self._checksummed[index]

    # -- opening ---------------------------------------------------------------------------
    def _file(self, index: int, fields: Fields = None) -> pa.ipc.RecordBatchFileReader:
        reader = self._files.get((index, fields))
        if reader is None:
            with self._lock:
                reader = self._files.get((index, fields))
                if reader is None:
                    reader = self._open(index, fields)
                    self._files[(index, fields)] = reader
        return reader

    def _open(self, index: int, fields: Fields = None) -> pa.ipc.RecordBatchFileReader:
        part = self.parts[index]
        path = self.locate_part(index)
        fix = "Restore the file or re-import the dataset (DROP DATASET, then CREATE DATASET)."
        of = f"'{path}' of dataset '{self.dataset}' (rows {_rows(part.first_id, part.end_id)})"

        def fail(message: str) -> StorageError:
            return StorageError(
                f"{message} {fix}",
                path=str(path),
                dataset=self.dataset,
                rows=range(part.first_id, part.end_id),
            )

        try:  # local: a regular file of its recorded size, never through a link (open_file)
            source = self.store.open_part(
                part.path, size=part.file_size, what=f"Data file {of}", memory_map=self.memory_map
            )
        except FileNotFoundError:
            where = (
                ""
                if isinstance(self.store, LocalStore)
                else (
                    f" Nothing is stored at that key: is {self.store.uri} where the dataset lives "
                    f"(the catalog's storage URI, ${STORAGE_ENV})?"
                )
            )
            raise fail(f"Missing data file {of}.{where}") from None
        except StorageError as exc:
            raise fail(str(exc)) from None
        except OSError as exc:
            raise fail(f"Cannot read data file {of}: {exc.strerror or exc}.") from exc
        size = source.size()
        if size != part.file_size:  # (for a store that cannot tell before it opens)
            source.close()
            raise fail(
                f"Data file {of} has {size} bytes, expected {part.file_size} "
                "(truncated or replaced)."
            )
        try:
            options = (
                None if fields is None else pa.ipc.IpcReadOptions(included_fields=list(fields))
            )
            reader = pa.ipc.open_file(source, options=options)
        except (pa.ArrowException, OSError) as exc:
            source.close()
            raise fail(f"Corrupt data file {of}: {exc}.") from exc
        if reader.num_record_batches != part.num_batches:
            raise fail(
                f"Data file {of} has {reader.num_record_batches} record batches, expected "
                f"{part.num_batches}."
            )
        try:
            found = FileIdentity.from_metadata(reader.schema.metadata)
        except ValueError as exc:
            raise fail(f"Corrupt data file {of}: {exc}.") from None
        if found is not None:
            expected = FileIdentity.of_part(part.path, part.version, part.first_id)
            if found != expected:
                raise fail(
                    f"Data file {of} holds {found.describe()}, not {expected.describe()}: it "
                    "was swapped or copied over, so those rows cannot be read."
                )
        self._checksummed[index] = found is not None  # False: written before checksums
        return reader

    def open_all(self) -> None:
        """Open every part now (footers only), raising ``StorageError`` on a bad file."""
        for i in range(len(self.parts)):
            self._file(i)

    # -- locating --------------------------------------------------------------------------
    def _out_of_range(self, row: int) -> RowIdError:
        return RowIdError(
            f"Row id {row} is out of range; this dataset version has ids 0..{self.num_rows - 1}."
        )

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Map ids to (part index, record batch index, row in batch) arrays."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_rows):
            raise self._out_of_range(int(ids[(ids < 0) | (ids >= self.num_rows)][0]))
        part = np.searchsorted(self._first_ids, ids, side="right") - 1
        local = ids - self._first_ids[part]
        rpb = self._rows_per_batch[part]
        return part, local // rpb, local % rpb

    def record_batch(self, part: int, batch: int, fields: Fields = None) -> pa.RecordBatch:
        """Record batch ``batch`` of part ``part``: one read of that batch's ``fields`` only.

        Checked before use: its row count, and ``validate()`` (buffer sizes against lengths,
        which the IPC reader does not check; ~0.2 us). The first read of each batch (per
        reader and set of columns) also checks its values (``full=True``: offsets in bounds;
        ~17 us per 4096 rows with strings, 0.3 us for a 2-row image batch) and the checksums
        of the columns read (~2 us per 100 KB); later reads of the batch skip both.

        Raises:
            StorageError: the batch is damaged; names the dataset, file and rows.
        """
        if self._ranged:
            return self._fetched_batch(part, batch, fields)
        try:
            rb = self._decode(part, batch, fields)
        except _Damage as damage:
            raise self._damaged(part, batch, damage.exc, damage.column) from damage.exc
        self._count(rb.get_total_buffer_size())
        return rb

    def _decode(self, part: int, batch: int, fields: Fields) -> pa.RecordBatch:
        """Record batch ``batch`` of part ``part``, checked (``record_batch``); a batch of
        object storage is checked whole at every read: its bytes were fetched anew.

        Raises:
            _Damage: it is damaged.
        """
        info = self.parts[part]
        column = None
        try:
            file = self._file(part, fields)
            checked = self._checked.get((part, fields))
            if checked is None:
                checked = self._checked[(part, fields)] = np.zeros(info.num_batches, dtype=bool)
            if checked[batch] and not self._ranged:
                rb = file.get_batch(batch)
                rb.validate()
            else:
                rb, metadata = file.get_batch_with_custom_metadata(batch)
                rb.validate(full=True)
                if self.verify and self._checksummed[part]:
                    column = self._verify(rb, metadata, fields)
                    if column is not None:
                        raise ValueError("checksum mismatch")
            expected = min(info.rows_per_batch, info.num_rows - batch * info.rows_per_batch)
            if rb.num_rows != expected:
                raise pa.ArrowInvalid(f"it has {rb.num_rows} rows, expected {expected}")
            checked[batch] = True
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise _Damage(exc, column) from exc
        return rb

    def _fetched_batch(self, part: int, batch: int, fields: Fields) -> pa.RecordBatch:
        """Record batch ``batch`` of part ``part`` of object storage: its bytes fetched in one
        ranged read (unless a caller loaded them ahead, ``_ahead``), checked; a batch that
        fails its check is fetched once more before it counts as damaged."""
        self._file(part, fields)  # opened and checked (size, identity) first
        file = self.part_file(part)
        whole = self._is_whole(fields)
        if whole:
            file.load([batch], self.tier)
        try:
            try:
                return self._decode(part, batch, fields)
            except _Damage:
                self.store.counters.add(refetches=1)  # type: ignore[attr-defined]
                if whole:
                    file.refetch(batch, self.tier)
                return self._decode(part, batch, fields)  # (not loaded: its reads go again)
        except _Damage as damage:
            raise self._damaged(part, batch, damage.exc, damage.column) from damage.exc
        finally:
            if whole:
                file.release([batch], self.tier)

    def part_file(self, part: int) -> PartFile:
        """Part ``part`` of object storage for ranged reads (its footer read: from the tier
        where it holds it)."""
        info = self.parts[part]
        what = f"Data file '{self.locate_part(part)}' of dataset '{self.dataset}'"
        store: RangedStore = self.store  # type: ignore[assignment]
        return store.part(info.path, size=info.file_size, what=what, cache=self.tier)

    def _is_whole(self, fields: Fields) -> bool:
        """Whether a read of ``fields`` fetches its record batches whole: all columns, or a
        column of bytes among them (the bulk of a batch); a read of small columns only
        fetches the bytes Arrow reads (each a request)."""
        whole = self._whole.get(fields)
        if whole is None:
            indices = range(len(self.schema)) if fields is None else fields
            whole = fields is None or any(is_payload(self.schema.field(i).type) for i in indices)
            self._whole[fields] = whole
        return whole

    def ahead(self, part: int, batches: Sequence[int], fields: Fields = None) -> Iterator[int]:
        """``batches`` of part ``part``, as they are; on object storage, their bytes fetched
        ahead a window (``ranged.WINDOW_BYTES``) at a time, all of a window's requests in
        flight together, and released once the caller asks for the next window (read each
        with ``record_batch`` as it comes). A part or window that cannot be fetched is
        yielded unfetched: ``record_batch`` then reports it, batch by batch."""
        if not self._ranged or not self._is_whole(fields):
            yield from batches
            return
        try:
            self._file(part, fields)  # opened and checked (size, identity) first
            file = self.part_file(part)
        except StorageError:
            yield from batches
            return
        for window in file.windows(batches):
            try:
                file.load(window, self.tier)
            except StorageError:
                yield from window
                continue
            try:
                yield from window
            finally:
                file.release(window, self.tier)

    def _ahead(
        self, groups: Iterator[tuple[np.ndarray, int, int, Fields, np.ndarray]]
    ) -> Iterator[tuple[np.ndarray, int, int, Fields, np.ndarray]]:
        """``groups`` (``batch_groups``), their record batches fetched ahead (``ahead``)."""
        if not self._ranged:
            yield from groups
            return
        items = list(groups)
        for part in sorted({g[1] for g in items}):
            mine = [g for g in items if g[1] == part]
            fetched = self.ahead(part, [g[2] for g in mine], mine[0][3])
            for _, group in zip(fetched, mine, strict=True):  # (fetched first: it releases)
                yield group

    def _verify(self, rb: pa.RecordBatch, metadata: Any, fields: Fields) -> str | None:
        """The name of the first column of ``rb`` whose checksum does not match, or None."""
        digests = parse_digests(metadata, len(self.schema))
        indices = range(len(self.schema)) if fields is None else sorted(fields)  # file order
        for array, i in zip(rb.columns, indices, strict=True):
            if column_digest(array) != digests[i]:
                return str(self.schema.field(i).name)
        return None

    def _damaged(self, part: int, batch: int, exc: Exception, column: str | None) -> StorageError:
        info = self.parts[part]
        path = self.locate_part(part)
        first = info.first_id + batch * info.rows_per_batch
        end = min(first + info.rows_per_batch, info.first_id + info.num_rows)
        where = f"dataset '{self.dataset}', rows {_rows(first, end)}"
        if column is not None:
            message = (
                f"Checksum mismatch in record batch {batch} of '{path}' ({where}, column "
                f"'{column}'): the stored bytes changed after import."
            )
        else:
            message = f"Corrupt record batch {batch} in '{path}' ({where}): {exc}."
        return StorageError(
            f"{message} Re-import the dataset (DROP DATASET, then CREATE DATASET), or restore "
            "the file.",
            path=str(path),
            dataset=self.dataset,
            rows=range(first, end),
        )

    # -- reading ---------------------------------------------------------------------------
    SMALL_TAKE = 1024  # up to this many ids, slice row by row (no numpy, no sort, no gather)

    def take(
        self, ids: Sequence[int] | np.ndarray, columns: str | Sequence[str] | None = None
    ) -> pa.Table:
        """Return the rows ``ids`` (in that order) as a table whose first column is ``_id``.

        ``columns`` (default all) may be one column name or a list of them.

        Raises:
            RowIdError: an id is out of range or not an integer.
            UnknownColumnError: no such column.
            StorageError: a data file is missing or corrupt.
        """
        try:
            return self._take(ids, columns)
        except pa.ArrowException as exc:  # assembling rows of batches that passed validate()
            raise self._corrupt(exc) from exc

    def _corrupt(self, exc: Exception) -> StorageError:
        folder = self.store.locate(str(PurePosixPath(self.parts[0].path).parent))
        return StorageError(
            f"Corrupt data in '{folder}': {exc}. Re-import the dataset (DROP DATASET, then "
            "CREATE DATASET).",
            path=str(folder),
        )

    def _take(
        self, ids: Sequence[int] | np.ndarray, columns: str | Sequence[str] | None
    ) -> pa.Table:
        if len(ids) == 1 and columns is None:
            return self._take_one(_row_id(ids[0]))
        ids = _row_ids(ids)
        names = self._columns(columns)
        if ids.size == 0:
            fields = [self.schema.field(n) for n in names]
            return empty_table(pa.schema([ID_FIELD, *fields]))
        if ids.size <= self.SMALL_TAKE:
            table = self._take_small(ids.tolist())
        else:
            table = self._gather(ids, None)
        if len(names) != len(self.schema):
            table = table.select(names)
        return table.add_column(0, ID_FIELD, id_array(ids))

    def row(self, i: int, columns: tuple[str, ...] | None = None) -> tuple[pa.RecordBatch, int]:
        """The record batch that holds row ``i``, and the row's index in it (one read).

        With ``columns``, the batch has (and the read fetches) only those columns.
        """
        if not 0 <= i < self.num_rows:
            raise self._out_of_range(i)
        p = bisect_right(self._first_list, i) - 1
        b, row = divmod(i - self._first_list[p], self._rpb_list[p])
        return self.record_batch(
            p, b, None if columns is None else self._field_indices(columns)
        ), row

    def _field_indices(self, columns: tuple[str, ...]) -> Fields:
        fields = self._fields.get(columns)
        if fields is None:
            fields = self._fields[columns] = tuple(
                self.schema.get_field_index(c) for c in self._columns(columns)
            )
        return fields

    def _take_one(self, i: int) -> pa.Table:
        """The hot path of random single-row reads: no numpy, one slice, no copy."""
        batch, row = self.row(i)
        # from_buffers: 3.5 us; pa.array([i]) takes 6-8 us, a quarter of the whole take.
        id_bytes = pa.py_buffer(i.to_bytes(8, sys.byteorder))
        id_array = pa.Array.from_buffers(_INT64, 1, [None, id_bytes])
        table = pa.Table.from_batches([batch.slice(row, 1)], self.schema)  # no file metadata
        return table.add_column(0, ID_FIELD, id_array)

    def _take_small(self, ids: list[int]) -> pa.Table:
        """One zero-copy slice per id from its record batch, then one copy into one chunk."""
        n = self.num_rows
        first, rpb = self._first_list, self._rpb_list
        batches: dict[tuple[int, int], pa.RecordBatch] = {}
        pieces = []
        for i in ids:
            if not 0 <= i < n:
                raise self._out_of_range(i)
            p = bisect_right(first, i) - 1
            b, row = divmod(i - first[p], rpb[p])
            rb = batches.get((p, b))
            if rb is None:
                rb = batches[(p, b)] = self.record_batch(p, b)
            pieces.append(rb.slice(row, 1))
        table = pa.Table.from_batches(pieces, schema=self.schema)
        return table if len(pieces) == 1 else table.combine_chunks()

    def gather(self, ids: np.ndarray, columns: tuple[str, ...] | None) -> pa.Table:
        """The rows ``ids`` (int64) of ``columns`` (None: all), in that order, without ``_id``.

        The loading engine's batch read: ids are grouped by record batch (vectorized), each
        batch is read once and only for ``columns``, the rows are gathered with one ``take``
        per batch and put back in the callers' order with one more.

        Raises:
            RowIdError: an id is out of range. StorageError: a data file is missing or corrupt.
        """
        try:
            return self._gather(ids, columns)
        except pa.ArrowException as exc:
            raise self._corrupt(exc) from exc

    def _gather(self, ids: np.ndarray, columns: tuple[str, ...] | None) -> pa.Table:
        schema = self.schema
        if columns is not None:  # a file reads its columns in the file's order
            schema = pa.schema(
                [schema.field(i) for i in sorted(self._field_indices(columns) or ())]
            )
        order_parts, pieces = [], []
        for positions, rb, rows in self.groups(ids, columns):
            order_parts.append(positions)
            pieces.append(rb.take(id_array(rows)))
        gathered = pa.Table.from_batches(pieces, schema=schema).combine_chunks()
        if columns is not None and list(columns) != schema.names:
            gathered = gathered.select(list(columns))
        order = np.concatenate(order_parts) if order_parts else np.empty(0, np.intp)
        if (order[1:] > order[:-1]).all():  # already in the callers' order
            return gathered
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        return gathered.take(id_array(inverse))

    def groups(
        self, ids: np.ndarray, columns: tuple[str, ...] | None
    ) -> Iterator[tuple[np.ndarray, pa.RecordBatch, np.ndarray]]:
        """``ids`` grouped by record batch: (positions in ``ids``, the batch, rows in it).

        Each record batch is read once, with ``columns`` only (vectorized grouping; the
        batch is read lazily, as the caller reaches its group).

        Raises:
            RowIdError: an id is out of range. StorageError: a data file is missing or corrupt.
        """
        for positions, part, batch, fields, rows in self._ahead(self.batch_groups(ids, columns)):
            yield positions, self.record_batch(part, batch, fields), rows

    def batch_groups(
        self, ids: np.ndarray, columns: tuple[str, ...] | None
    ) -> Iterator[tuple[np.ndarray, int, int, Fields, np.ndarray]]:
        """As ``groups``, but without reading: (positions, part, batch, fields, rows in it),
        for a caller that reads each group with ``record_batch`` and handles its errors
        group by group (a damaged batch fails its own rows only)."""
        fields = None if columns is None else self._field_indices(columns)
        part, batch, row = self.locate(ids)
        key = (part << 40) | batch
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        cuts = (np.flatnonzero(sorted_key[1:] != sorted_key[:-1]) + 1).tolist()
        for s, e in zip([0, *cuts], [*cuts, sorted_key.size], strict=True):
            first = order[s]
            positions = order[s:e]
            yield positions, int(part[first]), int(batch[first]), fields, row[positions]

    def binary_values(self, ids: np.ndarray, column: str) -> tuple[list[Any], dict[int, Exception]]:
        """The values of ``column`` of rows ``ids`` as bytes-like buffers (None for nulls),
        and failures by position: a damaged record batch (``StorageError``) fails its own rows only.
        For a binary column (or a Hugging Face image struct's ``bytes``) of a part of small rows,
        each record batch is read whole once (checked) and each value after that on its own
        (:mod:`tabloader.catalog.storage._values`); otherwise a record batch per group of rows.

        Raises:
            RowIdError: an id is out of range. UnknownColumnError: no such column.
        """
        ids = np.asarray(ids, np.int64)
        fields = self._field_indices((column,))
        values: list[Any] = [None] * ids.size
        errors: dict[int, Exception] = {}
        part, batch, _ = self.locate(ids)
        parts = [int(part[0])] if ids.size and (part == part[0]).all() else np.unique(part)
        for p in parts.tolist() if isinstance(parts, np.ndarray) else parts:
            sel = np.flatnonzero(part == p) if len(parts) > 1 else np.arange(ids.size)
            index = self._value_index(p, fields)
            if index is not None:
                self._locate_values(index, p, fields, sel, batch[sel], errors)
                located = index.located[batch[sel]]
                here = sel[located]
                got = index.read(ids[here] - self.parts[p].first_id)
                self._count(sum(len(v) for v in got if v is not None))
                for i, value in zip(here.tolist(), got, strict=True):
                    values[i] = value
                rest = sel[~located]  # failed (errors set), or not locatable: whole batches
                sel = rest[~np.isin(rest, np.fromiter(errors, np.int64, len(errors)))]
                if sel.size == 0:
                    continue
            for positions, _, b, _, rows in self._ahead(self.batch_groups(ids[sel], (column,))):
                at = sel[positions]
                try:
                    rb = self.record_batch(p, b, fields)
                except StorageError as exc:
                    errors.update(dict.fromkeys(at.tolist(), exc))
                    continue
                value_of = _value_reader(rb.column(0))
                for i, r in zip(at.tolist(), rows.tolist(), strict=True):
                    values[i] = value_of(r)
        return values, errors

    def _value_index(self, part: int, fields: Fields) -> ValueIndex | None:
        """The value index of ``part``'s column ``fields`` (None: the part is not indexed)."""
        key = (part, fields)
        if key not in self._values:
            info = self.parts[part]
            index = None
            column = (
                # (pa.nulls: an empty array of the type; pa.array would wake pyarrow's pandas
                # shim, 0.2-0.4 s of a cold service's first batch)
                binary_array(pa.nulls(0, self.schema.field(fields[0]).type)) if fields else None
            )
            small = info.rows_per_batch >= INDEX_ROWS and not self._ranged  # (no positions)
            if fields and small and column is not None:
                self._file(part, fields)  # opened and checked (size, identity) first
                index = ValueIndex(
                    self.store,
                    info.path,
                    info.file_size,
                    info.num_rows,
                    info.rows_per_batch,
                    fields[0],
                )
            self._values[key] = index
        return self._values[key]

    def _locate_values(
        self,
        index: ValueIndex,
        part: int,
        fields: Fields,
        sel: np.ndarray,
        batches: np.ndarray,
        errors: dict[int, Exception],
    ) -> None:
        """Locate the values of the record batches of ``sel`` (positions of rows of ``part``;
        their batches ``batches``) not located yet, each with its checked first read; the
        rows of a damaged batch fail (``errors``)."""
        new = batches[~index.located[batches]]
        for b in np.unique(new).tolist():
            try:
                rb = self.record_batch(part, b, fields)
                try:
                    located = index.locate(b, binary_array(rb.column(0)))
                except ValueError as exc:
                    raise self._damaged(part, b, exc, None) from exc
            except StorageError as exc:
                errors.update(dict.fromkeys(sel[batches == b].tolist(), exc))
                continue
            if not located:  # a compressed file: read a record batch at a time
                self._values[(part, fields)] = None
                return

    def _columns(self, columns: str | Sequence[str] | None) -> list[str]:
        if columns is None:
            return list(self.schema.names)
        if isinstance(columns, str):  # one column, not its letters
            columns = [columns]
        names = [c for c in columns if c != ID_COLUMN]
        for name in names:
            if name not in self.schema.names:
                raise UnknownColumnError(
                    f"Unknown column '{name}'.{did_you_mean(name, self.schema.names)} "
                    f"Columns: {', '.join(self.schema.names)}."
                )
        return names


class _Damage(Exception):
    """A record batch failed its checks (``exc``; ``column``: the column whose checksum did
    not match)."""

    def __init__(self, exc: Exception, column: str | None) -> None:
        super().__init__(str(exc))
        self.exc, self.column = exc, column


def _value_reader(column: pa.Array) -> Any:
    """``row -> its bytes`` (a zero-copy ``pa.Buffer``, None if null) of a column of bytes.

    Slicing the data buffer at the offsets skips a ``pa.Scalar`` per value (in threads the GIL
    is the bottleneck on images: every microsecond held per row is one no thread overlaps).
    """
    binary = binary_array(column)
    if binary is None or binary.null_count:
        if pa.types.is_struct(column.type):
            column = column.field("bytes")
        return lambda r: column[r].as_buffer() if column[r].is_valid else None
    offsets, data = binary_offsets(binary)

    def value(r: int) -> Any:
        start, end = offsets[r : r + 2].tolist()
        return data.slice(start, end - start)

    return value


def _rows(first: int, end: int) -> str:
    """``first..last`` of the ids ``range(first, end)``."""
    return f"{first}..{end - 1}"


def _row_id(i: Any) -> int:
    """``i`` as a row id: any integer (Python or numpy), never a float rounded down."""
    try:
        return operator.index(i)
    except TypeError:
        raise RowIdError(
            f"Row id {i!r} is not an integer ({type(i).__name__}); pass integer ids."
        ) from None


def _row_ids(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``ids`` as a flat int64 array; floats, strings and other non-integers are refused."""
    array = np.asarray(ids).reshape(-1)
    if array.dtype.kind not in "iu":  # an empty list is float64 too
        exact = [_row_id(i) for i in array.tolist()]
        try:
            array = np.array(exact, dtype=np.int64)
        except OverflowError:
            big = next(i for i in exact if not -(2**63) <= i < 2**63)
            raise RowIdError(f"Row id {big} is out of range; ids are below 2**63.") from None
    if array.dtype == np.uint64 and array.size and array.max() >= 2**63:
        raise RowIdError(f"Row id {int(array.max())} is out of range; ids are below 2**63.")
    return array.astype(np.int64, copy=False)
