"""Imports: ``Ingest``, one atomic import (the ``import_*`` methods: ``tabloader.catalog._api``).

Imports are atomic: rows go to a hidden ``.tmp-*`` file and into the DuckDB table inside one
transaction; the file is renamed into place just before the commit. Anything an interrupted
import leaves behind (a temp file, or a renamed file whose transaction never committed) is not
referenced by ``_tabloader.parts`` and is deleted the next time the catalog is opened (see
``tabloader.catalog._directory``).

A dataset stored elsewhere (``storage``: a
:class:`~tabloader.catalog.storage._stores.WritableStore`, e.g. ``s3://bucket/prefix``) is written
the same way, then its file is uploaded to ``<storage>/data/<dataset>/part-….arrow`` (whole or not
at all: an object appears only when its upload completes) just before the commit, and the local file
is deleted after it. The store is checked writable first (a small object written and deleted), so a
read-only bucket fails before the import spends its time. A failed commit deletes the uploaded
object; a process killed between the upload and the commit leaves an object no catalog references
(its name has a random token, so it never collides with a later import).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from tabloader.catalog._arrays import empty_table, id_array
from tabloader.catalog._bitmaps import ID_COLUMN
from tabloader.catalog._database import META, Database, disk_full_hint, quote, translate
from tabloader.catalog._directory import DATA_DIR, make_private_dir, new_token
from tabloader.catalog._errors import ImportFailedError, StorageError
from tabloader.catalog._importers import Source
from tabloader.catalog._progress import progress_bar
from tabloader.catalog.storage import PartWriter, choose_rows_per_batch
from tabloader.catalog.storage._checksums import FileIdentity
from tabloader.catalog.storage._stores import WritableStore
from tabloader.catalog.storage._values import is_payload

INSERT_ROWS = 64 * 1024  # rows per INSERT into DuckDB during an import


class Ingest:
    """One atomic import: IPC part file + DuckDB rows + metadata, or nothing at all.

    Args:
        root: the catalog directory.
        db: its database.
        name: the dataset.
        source: the rows.
        first_id: the ``_id`` of the first row (the dataset's size for an append).
        version: the dataset version this import makes.
        append: add to an existing dataset (its table exists).
        store: where the part goes (None: the catalog directory).
    """

    def __init__(
        self,
        root: Path,
        db: Database,
        name: str,
        source: Source,
        *,
        first_id: int,
        version: int,
        append: bool,
        store: WritableStore | None = None,
    ) -> None:
        self.root, self.db, self.name, self.source = root, db, name, source
        self.store = store
        self.first_id, self.version, self.append = first_id, version, append
        self.num_rows = 0
        self.directory = root / DATA_DIR / name
        token = new_token()
        self.tmp = self.directory / f".tmp-{token}.arrow"
        self.final = self.directory / f"part-v{version:05d}-{token}.arrow"
        self.queryable = [f.name for f in source.schema if not is_payload(f.type)]
        self.writer: PartWriter | None = None
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0

    def run(self) -> None:
        con = self.db.con
        rel = self.final.relative_to(self.root).as_posix()
        if self.store is not None:
            try:
                self.store.check_writable(f"{DATA_DIR}/{self.name}/{self.tmp.stem}.probe")
            except StorageError as exc:
                what = f"Import of '{self.name}'"
                raise ImportFailedError(f"{what}: {exc} Nothing was stored.") from exc
        make_private_dir(self.directory)
        bar = progress_bar(total=self.source.num_rows, desc=f"import {self.name}")
        renamed = uploaded = False
        try:
            con.begin()
            if not self.append:
                self._create_table()
            for batch in self.source.batches:
                self._write(batch)
                bar.update(batch.num_rows)
            if self.writer is None:
                raise ImportFailedError(
                    f"The source of '{self.name}' has no rows; nothing was imported."
                )
            self._flush()
            size = self.writer.close()
            self._record(size)
            if self.store is None:
                os.replace(self.tmp, self.final)
                renamed = True
            else:
                self.store.upload(rel, self.tmp)
                uploaded = True
            con.commit()
            if self.store is not None:
                self._remove_local()
        except BaseException as exc:
            with contextlib.suppress(duckdb.Error):  # a failed commit has rolled back already
                con.rollback()
            if self.writer is not None:
                self.writer.abort()
            if renamed:
                self.final.unlink(missing_ok=True)
            if uploaded and self.store is not None:
                with contextlib.suppress(Exception):  # (else left unreferenced: see above)
                    self.store.delete(rel)
            self._remove_local()
            what, fix = f"Import of '{self.name}'", "Nothing was stored."
            if isinstance(exc, StorageError):
                raise ImportFailedError(f"{what}: {exc} {fix}") from exc
            if isinstance(exc, duckdb.Error):
                raise translate(
                    exc, what, root=self.root, error=ImportFailedError, fix=fix
                ) from exc
            if isinstance(exc, (pa.ArrowException, OSError)):
                raise ImportFailedError(
                    f"{what} failed: {exc}. {fix}{disk_full_hint(exc, self.root)}"
                ) from exc
            raise
        finally:
            bar.close()

    def _remove_local(self) -> None:
        """Delete the local temp file (of a stored part) and the dataset's folder if empty."""
        self.tmp.unlink(missing_ok=True)
        if self.directory.exists() and not any(self.directory.iterdir()):
            self.directory.rmdir()

    def _create_table(self) -> None:
        empty = empty_table(
            pa.schema(
                [
                    pa.field(ID_COLUMN, pa.int64()),
                    *(self.source.schema.field(n) for n in self.queryable),
                ]
            )
        )
        self._from_chunk(empty, f"CREATE TABLE {quote(self.name)} AS SELECT * FROM _tl_chunk")

    def _from_chunk(self, table: pa.Table, sql: str) -> None:
        """Run ``sql``, which reads ``table`` as ``_tl_chunk``."""
        con = self.db.con
        con.register("_tl_chunk", table)
        try:
            con.execute(sql)
        finally:
            # An error aborts the transaction, and then unregister fails too: keep the first.
            with contextlib.suppress(duckdb.Error):
                con.unregister("_tl_chunk")

    def _write(self, batch: pa.RecordBatch) -> None:
        schema = self.source.schema
        if not batch.schema.equals(schema):
            try:
                batch = batch.cast(schema)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
                raise ImportFailedError(
                    f"A batch of the source has schema {batch.schema}, not {schema}: {exc}"
                ) from exc
        if batch.num_rows == 0:
            return
        if self.writer is None:
            avg = batch.nbytes / batch.num_rows
            identity = FileIdentity(self.name, self.version, self.final.name, self.first_id)
            self.writer = PartWriter(
                self.tmp,
                schema,
                choose_rows_per_batch(avg, ranged=self.store is not None),
                identity=identity,
            )
        self.writer.write(batch)
        self._pending.append(batch.select(self.queryable))
        self._pending_rows += batch.num_rows
        if self._pending_rows >= INSERT_ROWS:
            self._flush()

    def _flush(self) -> None:
        if not self._pending_rows:
            return
        table = pa.Table.from_batches(self._pending)
        start = self.first_id + self.num_rows
        ids = id_array(np.arange(start, start + table.num_rows))
        table = table.add_column(0, ID_COLUMN, ids)
        self._from_chunk(table, f"INSERT INTO {quote(self.name)} SELECT * FROM _tl_chunk")
        self.num_rows += table.num_rows
        self._pending, self._pending_rows = [], 0

    def _record(self, size: int) -> None:
        assert self.writer is not None
        con = self.db.con
        rel = self.final.relative_to(self.root).as_posix()  # under the store's root too
        con.execute(
            f"INSERT INTO {META}.parts VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                self.name,
                self.version,
                rel,
                self.first_id,
                self.num_rows,
                self.writer.rows_per_batch,
                size,
            ],
        )
        total = self.first_id + self.num_rows
        if self.append:
            con.execute(
                f"UPDATE {META}.datasets SET version = ?, num_rows = ? WHERE name = ?",
                [self.version, total, self.name],
            )
        else:
            # Building the index once after the bulk insert is ~3x faster than maintaining it.
            con.execute(f"ALTER TABLE {quote(self.name)} ADD PRIMARY KEY ({ID_COLUMN})")
            con.execute(
                f"INSERT INTO {META}.datasets (name, version, num_rows, schema, class_names, "
                "description, storage) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    self.name,
                    self.version,
                    total,
                    self.source.schema.serialize().to_pybytes(),
                    json.dumps(self.source.class_names),
                    self.source.description,
                    None if self.store is None else self.store.uri,
                ],
            )
