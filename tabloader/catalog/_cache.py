"""The catalog's cache of ``Dataset`` objects and their readers.

This process is the only writer of its catalog (DuckDB's lock), so a cached dataset stays
true until this process changes it; ``forget`` drops a dataset's entries after an import,
append or drop.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from tabloader.catalog._bitmaps import ID_COLUMN
from tabloader.catalog._database import META, Database
from tabloader.catalog._errors import DatasetNotFoundError, did_you_mean
from tabloader.catalog._model import Dataset
from tabloader.catalog.storage import DatasetReader, PartInfo
from tabloader.catalog.storage._stores import storage_uri
from tabloader.catalog.storage._values import is_payload


class DatasetCache:
    """Datasets by (name, version) and their readers, loaded from the catalog on first use.

    Args:
        root: the catalog directory.
        db: its database.

    The readers read their parts from ``$TABLOADER_STORAGE`` where it was set when the
    catalog was opened (:func:`~tabloader.catalog.storage._stores.storage_uri`), else from the store
    the dataset was imported into (``datasets.storage``), else from ``root``.
    """

    def __init__(self, root: Path, db: Database) -> None:
        self.root, self.db = root, db
        self.storage = storage_uri(root)
        # (name, None) is the latest version, also cached under its number by the reader.
        self._datasets: dict[tuple[str, int | None], Dataset] = {}
        self._readers: dict[tuple[str, int], DatasetReader] = {}

    def names(self) -> list[str]:
        """Names of all datasets, sorted."""
        return [r[0] for r in self.db.rows(f"SELECT name FROM {META}.datasets ORDER BY name")]

    def get(self, name: str, version: int | None = None) -> Dataset:
        """Dataset ``name`` at its latest version or at ``version``.

        Raises:
            DatasetNotFoundError: no such dataset or version.
        """
        cached = self._datasets.get((name, version))
        if cached is not None:
            return cached
        rows = self.db.rows(
            f"SELECT version, schema, class_names, description, {self.db.storage_column} "
            f"FROM {META}.datasets WHERE name = ?",
            [name],
        )
        if not rows:
            raise DatasetNotFoundError(
                f"Unknown dataset '{name}' in catalog '{self.root}'."
                f"{did_you_mean(name, self.names())} SHOW DATASETS lists them; CREATE DATASET "
                "imports one."
            )
        latest, schema_bytes, class_names, description, storage = rows[0]
        version = latest if version is None else version
        if not 1 <= version <= latest:
            raise DatasetNotFoundError(
                f"Dataset '{name}' in catalog '{self.root}' has versions 1..{latest}; version "
                f"{version} does not exist."
            )
        stored = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
        reader = self._reader(name, version, stored, storage)
        schema = pa.schema([pa.field(ID_COLUMN, pa.int64(), nullable=False), *stored])
        queryable = tuple(f.name for f in schema if not is_payload(f.type))
        ds = self._datasets[(name, version if version != latest else None)] = Dataset(
            name,
            version,
            reader.num_rows,
            schema,
            json.loads(class_names),
            queryable,
            description or "",
            reader,
        )
        return ds

    def forget(self, name: str) -> None:
        """Drop the cached datasets and readers of ``name``."""
        self._datasets = {k: v for k, v in self._datasets.items() if k[0] != name}
        self._readers = {k: v for k, v in self._readers.items() if k[0] != name}

    def storage_of(self, name: str) -> str | None:
        """The URI of the store that holds dataset ``name``'s parts (None: the catalog
        directory), as its import recorded it."""
        rows = self.db.rows(
            f"SELECT {self.db.storage_column} FROM {META}.datasets WHERE name = ?", [name]
        )
        return rows[0][0] if rows else None

    def _reader(
        self, name: str, version: int, schema: pa.Schema, storage: str | None
    ) -> DatasetReader:
        reader = self._readers.get((name, version))
        if reader is None:
            rows = self.db.rows(
                f"SELECT path, first_id, num_rows, rows_per_batch, file_size, version "
                f"FROM {META}.parts WHERE dataset = ? AND version <= ? ORDER BY first_id",
                [name, version],
            )
            # $TABLOADER_STORAGE (a copy of every dataset's parts) wins over where they were
            # written
            root = self.storage if self.storage != self.root else storage or self.root
            reader = DatasetReader(root, [PartInfo(*r) for r in rows], schema)
            self._readers[(name, version)] = reader
        return reader
