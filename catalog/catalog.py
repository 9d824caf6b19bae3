"""The DuckDB catalog: the only owner of a duckdb connection.

A catalog is a directory::

    catalog.duckdb                 a real DuckDB database: one table per dataset (``_id`` plus
                                   every cheap-to-query column) and the ``_tabloader`` schema
                                   (datasets, parts, jobs)
    data/<dataset>/part-*.arrow    the rows, in Arrow IPC file format (see ``catalog.storage``)
    jobs/<job>-<token>.roaring     a job's row ids, a serialized ``BitMap`` (the ``jobs`` row
                                   names its file; a replaced job gets a new file)

Imports are atomic: rows go to a hidden ``.tmp-*`` file and into the DuckDB table inside one
transaction; the file is renamed into place just before the commit. Anything an interrupted
import leaves behind (a temp file, or a renamed file whose transaction never committed) is not
referenced by ``_tabloader.parts`` and is deleted the next time the catalog is opened. Only
files named as tabloader names them are ever deleted, and a new catalog is not created in a
directory whose ``data/`` or ``jobs/`` folder already holds files.
A job's bitmap is derived data: the committed ``jobs`` row (dataset version, predicate, id
count and CRC-32 of the bitmap) is the truth, and the file is written (not fsynced) before
that row commits. A file lost or torn by a crash is rebuilt from the row the next time the job
is read, and checked against the CRC. Unreferenced job files are deleted at open. (A 160 KB
blob in the ``jobs`` table made every REGISTER JOB commit 3-5 ms slower than a short row plus
a file; an fsync costs another ~1 ms.)

DuckDB allows one read-write process per database file. A second process gets
``CatalogLockedError``, and so does a second ``Catalog`` of the same directory in one process
(share the open one); loader workers and training processes receive bitmaps and file paths,
never a connection. User SQL runs on this connection, opened with ``enable_external_access =
false``, so no statement can read or write files, attach databases or install extensions.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import re
import threading
import uuid
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import duckdb
import numpy as np
import pyarrow as pa
from pyroaring import BitMap

from catalog._progress import progress_bar
from catalog.bitmaps import ID_COLUMN, bitmap_from_flags, set_flags
from catalog.errors import (
    AlreadyExistsError,
    CatalogError,
    CatalogLockedError,
    DatasetInUseError,
    DatasetNotFoundError,
    ImportFailedError,
    JobNotFoundError,
    StatementError,
    StorageError,
    did_you_mean,
)
from catalog.importers import Source, open_source
from catalog.storage import DatasetReader, PartInfo, PartWriter, choose_rows_per_batch
from catalog.storage.checksums import FileIdentity
from catalog.storage.verify import VerifyReport, verify_readers

if TYPE_CHECKING:
    from sqlglot import exp

__all__ = ["DEFAULT_PATH", "ENV_VAR", "Catalog", "Dataset", "Job", "connect"]

logger = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_PATH = "catalog"
ENV_VAR = "TABLOADER_CATALOG"
DB_FILE = "catalog.duckdb"
JOBS_DIR = "jobs"
META = "_tabloader"
INSERT_ROWS = 64 * 1024  # rows per INSERT into DuckDB during an import
# External access off: user SQL cannot read or write files. The oldest storage format keeps
# catalog.duckdb readable by every stock duckdb client from 1.0 on, not only the newest.
DUCKDB_CONFIG: dict[str, str | bool | int | float | list[str]] = {
    "enable_external_access": False,
    "storage_compatibility_version": "v1.0.0",
}
NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,62}")
# The catalogs this process has open, by resolved root (a collected Catalog frees its root).
_OPEN_ROOTS: weakref.WeakValueDictionary[Path, Catalog] = weakref.WeakValueDictionary()
_OPEN_LOCK = threading.Lock()
# The names of the files tabloader writes, each made unique by a token (``_new_token``).
# Garbage collection deletes nothing else: a catalog directory may hold other files.
PART_FILE_RE = re.compile(r"(part-v\d{5,}|\.tmp)-[0-9a-f]{12}\.arrow")
JOB_FILE_RE = re.compile(r"(\.tmp-)?[A-Za-z][A-Za-z0-9_]{0,62}-[0-9a-f]{12}\.roaring")

_META_DDL = f"""
CREATE SCHEMA IF NOT EXISTS {META};
CREATE TABLE IF NOT EXISTS {META}.datasets (
    name VARCHAR PRIMARY KEY, version INTEGER NOT NULL, num_rows BIGINT NOT NULL,
    schema BLOB NOT NULL, class_names VARCHAR NOT NULL, description VARCHAR,
    created TIMESTAMP DEFAULT current_timestamp);
CREATE TABLE IF NOT EXISTS {META}.parts (
    dataset VARCHAR NOT NULL, version INTEGER NOT NULL, path VARCHAR NOT NULL,
    first_id BIGINT NOT NULL, num_rows BIGINT NOT NULL, rows_per_batch INTEGER NOT NULL,
    file_size BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS {META}.jobs (
    name VARCHAR PRIMARY KEY, dataset VARCHAR NOT NULL, version INTEGER NOT NULL,
    columns VARCHAR NOT NULL, predicate VARCHAR, options VARCHAR NOT NULL,
    bitmap VARCHAR NOT NULL, num_ids BIGINT NOT NULL, crc32 BIGINT NOT NULL,
    created TIMESTAMP DEFAULT current_timestamp);
"""


def _new_token() -> str:
    """The unique part of the name of a file tabloader writes (see ``PART_FILE_RE``)."""
    return uuid.uuid4().hex[:12]


def _write_file(path: Path, data: bytes) -> None:
    """Write ``path`` through a temp file renamed into place (readers never see half a file)."""
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _disk_full_hint(exc: BaseException, root: Path) -> str:
    """The fix for an error caused by a full disk (DuckDB and Arrow keep only the text)."""
    full = getattr(exc, "errno", None) == errno.ENOSPC or "No space left on device" in str(exc)
    return f" The disk holding {root} is full: free space there and try again." if full else ""


def _synchronized(
    method: Callable[Concatenate[Catalog, P], R],
) -> Callable[Concatenate[Catalog, P], R]:
    """Run a ``Catalog`` method under the catalog's lock (a DuckDB connection is not shared)."""

    @functools.wraps(method)
    def locked(self: Catalog, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def connect(path: str | os.PathLike[str] | None = None) -> Catalog:
    """Open or create the catalog directory ``path``.

    Args:
        path: the directory; default ``$TABLOADER_CATALOG`` or ``./catalog``.

    Raises:
        CatalogLockedError: another process, or another ``Catalog`` of this process, has the
            catalog open.
    """
    return Catalog(path)


def is_payload(t: pa.DataType) -> bool:
    """True for types that stay out of DuckDB: binary payloads, also inside nested types."""
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return True
    if getattr(pa.types, "is_binary_view", lambda _: False)(t):
        return True
    return any(is_payload(t.field(i).type) for i in range(t.num_fields))


def quote(name: str) -> str:
    """Quote an identifier for DuckDB."""
    return '"' + name.replace('"', '""') + '"'


@dataclass(frozen=True)
class Dataset:
    """One version of a dataset.

    Attributes:
        name: the dataset (and DuckDB table) name.
        version: 1 at import, +1 per append.
        num_rows: rows in this version (``_id`` is ``0..num_rows-1``).
        schema: ``_id`` followed by the stored columns.
        class_names: for label columns, the class names by value.
        queryable: the columns the DuckDB table holds (usable in WHERE).
    """

    name: str
    version: int
    num_rows: int
    schema: pa.Schema
    class_names: dict[str, list[str]]
    queryable: tuple[str, ...]
    description: str
    _reader: DatasetReader = field(repr=False, compare=False)

    @property
    def columns(self) -> list[str]:
        """Column names, ``_id`` first."""
        return list(self.schema.names)

    @property
    def files(self) -> list[Path]:
        """The Arrow IPC files of this version, in ``_id`` order."""
        return [self._reader.root / p.path for p in self._reader.parts]

    @property
    def reader(self) -> DatasetReader:
        """The random-access reader over this version's files."""
        return self._reader

    def take(
        self, ids: Sequence[int] | np.ndarray | BitMap, columns: str | Sequence[str] | None = None
    ) -> pa.Table:
        """Return rows ``ids`` in that order, with ``_id`` first and ``columns`` (default all).

        Raises:
            RowIdError: an id is out of range or not an integer.
            UnknownColumnError: no such column (``columns`` may be one name or a list).
            StorageError: a data file is missing or corrupt.
        """
        if isinstance(ids, BitMap):
            ids = np.frombuffer(ids.to_array(), dtype=np.uint32)
        return self._reader.take(ids, columns)

    def __len__(self) -> int:
        return self.num_rows


@dataclass(frozen=True)
class Job:
    """A registered training job: a dataset version, columns and the bitmap of its rows.

    Attributes:
        name: job name.
        dataset: dataset name.
        dataset_version: the version the job is pinned to.
        columns: the columns the job reads (``_id`` is always delivered too).
        predicate: the normalized WHERE text, or None for all rows.
        options: the ``WITH (...)`` options.
        ids: the ``_id`` of every row of the job.
    """

    name: str
    dataset: str
    dataset_version: int
    columns: tuple[str, ...]
    predicate: str | None
    options: dict[str, Any]
    ids: BitMap = field(compare=False, repr=False)

    @property
    def num_rows(self) -> int:
        """Rows in the job's set."""
        return len(self.ids)


class Catalog:
    """A catalog directory opened by this process. Use as a context manager or ``close()``.

    Its methods are thread-safe: they take one lock around the DuckDB connection.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._lock = threading.RLock()
        self.root = Path(path or os.environ.get(ENV_VAR) or DEFAULT_PATH).absolute()
        if self.root.exists() and not self.root.is_dir():
            raise CatalogError(f"Catalog path '{self.root}' is a file; give a directory.")
        self.path = self.root / DB_FILE
        self._claim_root()
        try:
            self._open()
        except BaseException:
            self._release_root()
            raise

    def _claim_root(self) -> None:
        """Refuse a root this process has open already: the two would not see each other.

        The first would serve stale cached metadata after the second changes the catalog,
        and the second's cleanup at open would delete the first's unfinished import.
        """
        self._key = self.root.resolve()
        with _OPEN_LOCK:
            if _OPEN_ROOTS.get(self._key) is not None:
                raise CatalogLockedError(
                    f"Catalog '{self.root}' is open already in this process. Reuse that "
                    "Catalog object (pass it as catalog= to Loader or JobDataset), or close() "
                    "it before opening the catalog again."
                )
            _OPEN_ROOTS[self._key] = self

    def _release_root(self) -> None:
        with _OPEN_LOCK:
            if _OPEN_ROOTS.get(self._key) is self:
                del _OPEN_ROOTS[self._key]

    def _open(self) -> None:
        with self._os_errors():
            if not self.path.exists():
                self._check_new_root()
            for folder in ("data", JOBS_DIR):
                (self.root / folder).mkdir(parents=True, exist_ok=True)
        self._con = self._connect()
        try:
            with self._os_errors():
                self._con.execute(_META_DDL)
                self._move_bitmaps_to_files()
                # Job ids are fetched on a second connection that may return rows in any order
                # (bitmap_from_flags does not care): 30% faster than keeping the insertion order.
                self._ids_con = self._con.cursor()
                self._ids_con.execute("SET SESSION preserve_insertion_order = false")
                self._readers: dict[tuple[str, int], DatasetReader] = {}
                self._datasets: dict[tuple[str, int | None], Dataset] = {}
                self._job_paths: dict[str, str] = {}  # job -> its bitmap file, when known
                self._collect_garbage()
        except BaseException:
            self._con.close()
            raise

    @contextmanager
    def _os_errors(self) -> Iterator[None]:
        """Map a file system error while opening to ``CatalogError`` naming the path."""
        try:
            yield
        except OSError as exc:
            where = f": '{exc.filename}'" if exc.filename else ""
            raise CatalogError(
                f"Cannot use '{self.root}' as a catalog directory ({exc.strerror or exc}{where}). "
                "Give a new or empty directory you can write to, or an existing catalog."
            ) from exc

    def _connect(self) -> duckdb.DuckDBPyConnection:
        try:
            return duckdb.connect(str(self.path), config=DUCKDB_CONFIG)
        except duckdb.IOException as exc:
            if "lock" in str(exc).lower():
                pid = re.search(r"PID (\d+)", str(exc))
                owner = f" (PID {pid.group(1)})" if pid else ""
                raise CatalogLockedError(
                    f"Catalog '{self.root}' is in use by another process{owner}. Stop that "
                    "process, or send statements to it (for example through its service)."
                ) from exc
            raise CatalogError(f"Cannot open catalog '{self.path}': {exc}") from exc
        except duckdb.Error as exc:
            raise CatalogError(
                f"Cannot open catalog '{self.path}': {exc}. Is it a DuckDB database?"
            ) from exc

    # -- lifecycle ---------------------------------------------------------------------------
    @_synchronized
    def close(self) -> None:
        """Close the DuckDB connection; the catalog can then be opened again, here or elsewhere."""
        self._ids_con.close()
        self._con.close()
        self._release_root()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Catalog('{self.root}')"

    def _move_bitmaps_to_files(self) -> None:
        """Upgrade a catalog of tabloader <= 0.1.0, whose ``jobs`` table held the bitmaps."""
        columns = self._con.execute(
            "SELECT column_name FROM information_schema.columns "
            f"WHERE table_schema = '{META}' AND table_name = 'jobs'"
        ).fetchall()
        if ("ids",) not in columns:
            return
        rows = self._con.execute(f"SELECT name, ids FROM {META}.jobs").fetchall()
        paths = {name: f"{JOBS_DIR}/{name}-{_new_token()}.roaring" for name, _ in rows}
        for name, ids in rows:
            _write_file(self.root / paths[name], ids)
        with self._transaction():
            self._con.execute(f"ALTER TABLE {META}.jobs ADD COLUMN bitmap VARCHAR")
            self._con.execute(f"ALTER TABLE {META}.jobs ADD COLUMN crc32 BIGINT")
            for name, ids in rows:
                self._con.execute(
                    f"UPDATE {META}.jobs SET bitmap = ?, crc32 = ? WHERE name = ?",
                    [paths[name], zlib.crc32(ids), name],
                )
            self._con.execute(f"ALTER TABLE {META}.jobs DROP COLUMN ids")
        logger.info("moved the bitmaps of %d job(s) to %s/", len(rows), JOBS_DIR)

    def _check_new_root(self) -> None:
        """Refuse to create a catalog where ``data/`` or ``jobs/`` hold files of someone else."""
        for folder in ("data", JOBS_DIR):
            path = self.root / folder
            if path.is_dir() and any(path.iterdir()):
                raise CatalogError(
                    f"'{self.root}' is not a tabloader catalog: it has no {DB_FILE}, but its "
                    f"{folder}/ folder already holds files. Pick an empty or new directory for "
                    "the catalog."
                )

    def _collect_garbage(self) -> None:
        """Delete files that no committed row references (leftovers of interrupted imports).

        Only files named as tabloader names them (``PART_FILE_RE``, ``JOB_FILE_RE``) are
        deleted; anything else in ``data/`` or ``jobs/`` is left alone.
        """
        parts = {row[0] for row in self._con.execute(f"SELECT path FROM {META}.parts").fetchall()}
        for folder in (self.root / "data").iterdir():
            if folder.is_dir() and self._remove_leftovers(folder, PART_FILE_RE, parts):
                with contextlib.suppress(OSError):  # not empty: it holds other files
                    folder.rmdir()
        jobs = {row[0] for row in self._con.execute(f"SELECT bitmap FROM {META}.jobs").fetchall()}
        self._remove_leftovers(self.root / JOBS_DIR, JOB_FILE_RE, jobs)

    def _remove_leftovers(self, folder: Path, pattern: re.Pattern[str], keep: set[str]) -> int:
        """Delete the files in ``folder`` named like ``pattern`` but not in ``keep``; count them."""
        removed = 0
        for f in folder.iterdir():
            rel = f.relative_to(self.root).as_posix()
            if pattern.fullmatch(f.name) and f.is_file() and rel not in keep:
                logger.info("removing leftover file %s of an interrupted import or job", f)
                f.unlink()
                removed += 1
        return removed

    # -- DuckDB boundary -----------------------------------------------------------------------
    @contextmanager
    def _duckdb_errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except duckdb.Error as exc:
            raise CatalogError(f"{what} failed: {exc}.{_disk_full_hint(exc, self.root)}") from exc

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._duckdb_errors("Catalog query"):
            return self._con.execute(sql, list(params)).fetchall()

    @_synchronized
    def query(self, sql: str) -> pa.Table:
        """Run a read-only query (already validated by ``catalog.sql``) and return a table.

        It runs in a transaction that is always rolled back, so even a query that slipped past
        validation cannot change the catalog.
        """
        self._con.begin()
        try:
            return self._con.sql(sql).to_arrow_table()
        except duckdb.Error as exc:
            raise StatementError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._con.rollback()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        self._con.begin()
        try:
            yield
        except BaseException:
            self._con.rollback()
            raise
        self._con.commit()

    # -- datasets ------------------------------------------------------------------------------
    @_synchronized
    def dataset_names(self) -> list[str]:
        """Names of all datasets, sorted."""
        return [r[0] for r in self._rows(f"SELECT name FROM {META}.datasets ORDER BY name")]

    def datasets(self) -> list[Dataset]:
        """All datasets (their latest versions), sorted by name."""
        return [self.dataset(n) for n in self.dataset_names()]

    @_synchronized
    def dataset(self, name: str, *, version: int | None = None) -> Dataset:
        """Return dataset ``name`` at its latest version or at ``version``.

        Raises:
            DatasetNotFoundError: no such dataset or version.
        """
        cached = self._datasets.get((name, version))
        if cached is not None:  # this process is the only writer, so the cache stays true
            return cached
        rows = self._rows(
            f"SELECT version, schema, class_names, description FROM {META}.datasets WHERE name = ?",
            [name],
        )
        if not rows:
            raise DatasetNotFoundError(
                f"Unknown dataset '{name}'.{did_you_mean(name, self.dataset_names())} "
                "SHOW DATASETS lists them; CREATE DATASET imports one."
            )
        latest, schema_bytes, class_names, description = rows[0]
        version = latest if version is None else version
        if not 1 <= version <= latest:
            raise DatasetNotFoundError(
                f"Dataset '{name}' has versions 1..{latest}; version {version} does not exist."
            )
        stored = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
        reader = self._reader(name, version, stored)
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

    def _forget(self, name: str) -> None:
        """Drop cached datasets and readers of ``name`` (after an import, append or drop)."""
        self._datasets = {k: v for k, v in self._datasets.items() if k[0] != name}
        self._readers = {k: v for k, v in self._readers.items() if k[0] != name}

    def _reader(self, name: str, version: int, schema: pa.Schema) -> DatasetReader:
        reader = self._readers.get((name, version))
        if reader is None:
            rows = self._rows(
                f"SELECT path, first_id, num_rows, rows_per_batch, file_size, version "
                f"FROM {META}.parts WHERE dataset = ? AND version <= ? ORDER BY first_id",
                [name, version],
            )
            reader = DatasetReader(self.root, [PartInfo(*r) for r in rows], schema)
            self._readers[(name, version)] = reader
        return reader

    def _check_new_name(self, name: str, kind: str) -> None:
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise CatalogError(
                f"Invalid {kind} name {name!r}: use a letter followed by letters, digits or "
                "underscores (at most 63 characters)."
            )

    def _check_name_case(self, name: str, kind: str) -> None:
        """Refuse a name that differs only in case from a stored one (a ~0.3 ms query).

        Names ignore case, as DuckDB identifiers do (``Meta`` and ``meta`` are one table).
        """
        rows = self._rows(
            f"SELECT name FROM {META}.{kind}s WHERE lower(name) = lower(?) AND name <> ?",
            [name, name],
        )
        if rows:
            raise AlreadyExistsError(
                f"{kind.capitalize()} '{rows[0][0]}' exists already, and {kind} names ignore case "
                f"(as in DuckDB), so '{name}' is taken too. Use '{rows[0][0]}', or another name."
            )

    def import_arrow(self, name: str, data: Any, *, append: bool = False) -> Dataset:
        """Import a ``pyarrow.Table``, ``RecordBatch`` or ``RecordBatchReader``."""
        from catalog.importers.arrow import open_arrow

        return self.import_source(name, open_arrow(data), append=append)

    def import_parquet(
        self, name: str, path_or_glob: str | os.PathLike[str], *, append: bool = False
    ) -> Dataset:
        """Import a Parquet file, a directory of Parquet files or a glob."""
        return self.import_source(name, open_source("parquet", path_or_glob), append=append)

    def import_ipc(
        self, name: str, path: str | os.PathLike[str], *, append: bool = False
    ) -> Dataset:
        """Import Arrow IPC / Feather files (file or stream format; a path or a glob)."""
        return self.import_source(name, open_source("arrow", path), append=append)

    def import_hf(
        self, name: str, dataset_or_path: Any, *, split: str | None = None, append: bool = False
    ) -> Dataset:
        """Import a HuggingFace ``Dataset``, ``DatasetDict`` or ``save_to_disk`` folder.

        Args:
            name: the new dataset.
            dataset_or_path: the source.
            split: for a ``DatasetDict``, the split to import; None imports every split with a
                ``split`` column.
            append: add the rows to an existing dataset with the same schema.
        """
        return self.import_source(
            name, open_source("hf", dataset_or_path, split=split), append=append
        )

    def import_imagefolder(
        self, name: str, root: str | os.PathLike[str], *, append: bool = False
    ) -> Dataset:
        """Import ``root/<class>/<file>`` images: image, label, label_name, path."""
        return self.import_source(name, open_source("imagefolder", root), append=append)

    @_synchronized
    def import_source(self, name: str, source: Source, *, append: bool = False) -> Dataset:
        """Import a streaming ``Source`` atomically; see the module docstring."""
        self._check_new_name(name, "dataset")
        self._check_name_case(name, "dataset")
        exists = name in self.dataset_names()
        if append and not exists:
            raise DatasetNotFoundError(
                f"Cannot append to unknown dataset '{name}'."
                f"{did_you_mean(name, self.dataset_names())}"
                " Import it first without append."
            )
        if not append and exists:
            raise AlreadyExistsError(
                f"Dataset '{name}' exists already; DROP DATASET {name} first, or append to it."
            )
        tables = self._rows(
            "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' "
            "AND lower(table_name) = lower(?)",
            [name],
        )
        if not append and tables:
            raise AlreadyExistsError(
                f"A DuckDB table '{tables[0][0]}' exists already; pick another name."
            )
        if ID_COLUMN in source.schema.names:
            raise ImportFailedError(
                f"The source has a column named '{ID_COLUMN}', which tabloader assigns itself; "
                "rename or drop it before importing."
            )
        if append:
            current = self.dataset(name)
            stored = pa.schema(list(current.schema)[1:])
            if not source.schema.equals(stored):
                raise ImportFailedError(
                    f"Cannot append to '{name}': the source schema\n{source.schema}\ndiffers from "
                    f"the dataset's\n{stored}"
                )
            first_id, version = current.num_rows, current.version + 1
        else:
            first_id, version = 0, 1
        ingest = _Ingest(self, name, source, first_id=first_id, version=version, append=append)
        try:
            ingest.run()
        finally:
            self._forget(name)
        logger.info("imported %d rows into %s (version %d)", ingest.num_rows, name, version)
        return self.dataset(name)

    # -- checksums (catalog.storage.verify) --------------------------------------------------------
    def verify(self, name: str | None = None) -> VerifyReport:
        """Read every stored byte of dataset ``name`` (default: every dataset) and check it.

        Returns a report of the damaged ``_id`` ranges (``report.ok`` when there are none)
        and of files written before checksums (unverified).

        Raises:
            DatasetNotFoundError: no such dataset.
        """
        names = self.dataset_names() if name is None else [self.dataset(name).name]
        return verify_readers([self.dataset(n).reader for n in names])

    @_synchronized
    def drop_dataset(self, name: str, *, cascade: bool = False, if_exists: bool = False) -> None:
        """Drop a dataset, its table and its files.

        Raises:
            DatasetInUseError: jobs use it and ``cascade`` is false.
        """
        if name not in self.dataset_names():
            if if_exists:
                return
            self.dataset(name)  # raises DatasetNotFoundError with a suggestion
        users = [
            r[0]
            for r in self._rows(
                f"SELECT name FROM {META}.jobs WHERE dataset = ? ORDER BY name", [name]
            )
        ]
        if users and not cascade:
            raise DatasetInUseError(
                f"Dataset '{name}' is used by job(s) {', '.join(users)}; UNREGISTER JOB them "
                f"first, or DROP DATASET {name} CASCADE."
            )
        paths = [
            r[0] for r in self._rows(f"SELECT path FROM {META}.parts WHERE dataset = ?", [name])
        ]
        with self._duckdb_errors(f"DROP DATASET {name}"), self._transaction():
            self._con.execute(f"DELETE FROM {META}.jobs WHERE dataset = ?", [name])
            self._con.execute(f"DELETE FROM {META}.parts WHERE dataset = ?", [name])
            self._con.execute(f"DELETE FROM {META}.datasets WHERE name = ?", [name])
            self._con.execute(f"DROP TABLE IF EXISTS {quote(name)}")
        self._forget(name)
        for job in users:
            self._remove_job_files(job)
        for p in paths:
            (self.root / p).unlink(missing_ok=True)
        folder = self.root / "data" / name
        if folder.is_dir():
            self._remove_leftovers(folder, PART_FILE_RE, set())
            with contextlib.suppress(OSError):  # not empty: it holds files tabloader did not write
                folder.rmdir()

    # -- jobs ------------------------------------------------------------------------------------
    @_synchronized
    def job_names(self) -> list[str]:
        """Names of all jobs, sorted."""
        return [r[0] for r in self._rows(f"SELECT name FROM {META}.jobs ORDER BY name")]

    def jobs(self) -> list[Job]:
        """All registered jobs, sorted by name."""
        return [self.job(n) for n in self.job_names()]

    @_synchronized
    def job(self, name: str) -> Job:
        """Return job ``name``.

        Raises:
            JobNotFoundError: no such job.
        """
        rows = self._rows(
            f"SELECT dataset, version, columns, predicate, options, bitmap, num_ids, crc32 "
            f"FROM {META}.jobs WHERE name = ?",
            [name],
        )
        if not rows:
            raise JobNotFoundError(
                f"Unknown job '{name}'.{did_you_mean(name, self.job_names())} SHOW JOBS lists "
                "them; REGISTER JOB adds one."
            )
        dataset, version, columns, predicate, options, path, num_ids, crc = rows[0]
        ids = self._read_job_file(name, self.dataset(dataset, version=version), predicate, path)
        if ids is None or len(ids) != num_ids or zlib.crc32(ids.serialize()) != crc:
            raise StorageError(
                f"The row ids of job '{name}' ({self.root / path}) are lost: its file is "
                f"unreadable and its predicate no longer selects the same {num_ids} rows of "
                f"'{dataset}' version {version}. Register the job again: REGISTER OR REPLACE "
                f"JOB {name} ...",
                path=str(self.root / path),
            )
        return Job(
            name, dataset, version, tuple(json.loads(columns)), predicate, json.loads(options), ids
        )

    @_synchronized
    def register_job(
        self,
        name: str,
        dataset: str,
        *,
        columns: str | Sequence[str] | None = None,
        where: str | exp.Expression | None = None,
        options: dict[str, Any] | None = None,
        replace: bool = False,
    ) -> Job:
        """Register a job on the rows of ``dataset`` that satisfy ``where``.

        Args:
            name: the job name.
            dataset: the dataset; the job is pinned to its current version.
            columns: the columns the job reads (default: all).
            where: a predicate in SQL (checked against an allow-list), or None for all rows.
            options: job options (batch_size, seed, image_size, ...).
            replace: replace a job of the same name (re-registering re-pins the version).

        Raises:
            AlreadyExistsError: the job exists and ``replace`` is false.
            UnknownColumnError, ForbiddenExpressionError: bad columns or predicate.
        """
        from catalog.sql.validate import check_columns, check_predicate

        self._check_new_name(name, "job")
        ds = self.dataset(dataset)
        cols = check_columns(columns, ds)
        predicate = check_predicate(where, ds) if where is not None else None
        bitmap = self._evaluate(name, ds, predicate)
        opts = dict(options or {})
        path = f"{JOBS_DIR}/{name}-{_new_token()}.roaring"
        blob = bitmap.serialize()
        try:
            _write_file(self.root / path, blob)
        except OSError as exc:
            raise CatalogError(
                f"REGISTER JOB {name} failed: cannot write its bitmap file {path}: {exc}."
                f"{_disk_full_hint(exc, self.root)} The catalog is unchanged."
            ) from exc
        row = [ds.name, ds.version, json.dumps(cols), predicate, json.dumps(opts), path]
        row += [len(bitmap), zlib.crc32(blob), name]
        try:
            # One autocommitted statement: UPDATE of a short row is ~1.5 ms, DELETE + INSERT
            # or an upsert 3-6 ms (DuckDB rewrites the primary-key index).
            with self._duckdb_errors(f"REGISTER JOB {name}"):
                updated = (
                    replace
                    and self._con.execute(
                        f"UPDATE {META}.jobs SET dataset = ?, version = ?, columns = ?, "
                        "predicate = ?, options = ?, bitmap = ?, num_ids = ?, crc32 = ?, "
                        "created = current_timestamp WHERE name = ?",
                        row,
                    ).fetchall()[0][0]
                )
                if not updated:  # a new job (replacing one costs no name check)
                    self._check_name_case(name, "job")
                    try:
                        self._con.execute(
                            f"INSERT INTO {META}.jobs (dataset, version, columns, predicate, "
                            "options, bitmap, num_ids, crc32, name) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            row,
                        )
                    except duckdb.ConstraintException:
                        raise AlreadyExistsError(
                            f"Job '{name}' exists already; UNREGISTER JOB {name} first, or "
                            f"use REGISTER OR REPLACE JOB {name}."
                        ) from None
        except BaseException:
            (self.root / path).unlink(missing_ok=True)
            raise
        self._remove_job_files(name, keep=path)
        return Job(name, ds.name, ds.version, tuple(cols), predicate, opts, bitmap)

    def _evaluate(self, name: str, ds: Dataset, predicate: str | None) -> BitMap:
        """The bitmap of the rows of ``ds`` that satisfy ``predicate`` (None: all rows)."""
        if predicate is None:
            return BitMap(range(ds.num_rows))
        # int64 ids scatter 25% faster than uint32 ones (numpy indexes with intp) and cost
        # no more to fetch than a cast. Rows appended after ``ds.version`` are not its rows.
        sql = (
            f"SELECT {ID_COLUMN} FROM {quote(ds.name)} "
            f"WHERE {ID_COLUMN} < {ds.num_rows} AND ({predicate})"
        )
        flags = np.zeros(ds.num_rows, dtype=bool)
        try:
            for batch in self._ids_con.sql(sql).to_arrow_reader(1 << 20):
                set_flags(flags, batch.column(0).to_numpy())
        except duckdb.Error as exc:
            raise StatementError(
                f"The predicate of job '{name}' failed in DuckDB: {exc}".rstrip()
            ) from exc
        bitmap = bitmap_from_flags(flags)
        if not bitmap:
            raise StatementError(
                f"Job '{name}' would have no rows: no row of '{ds.name}' satisfies {predicate}. "
                "Loosen the WHERE clause."
            )
        bitmap.run_optimize()
        return bitmap

    def _read_job_file(
        self, name: str, ds: Dataset, predicate: str | None, path: str
    ) -> BitMap | None:
        """Read a job's bitmap; rebuild it from the predicate if the file is missing or torn."""
        file = self.root / path
        try:
            return BitMap.deserialize(file.read_bytes())
        except (OSError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        logger.warning("job '%s': rebuilding its row ids (%s)", name, problem)
        try:
            ids = self._evaluate(name, ds, predicate)
        except StatementError:
            return None
        _write_file(file, ids.serialize())
        return ids

    def _remove_job_files(self, name: str, keep: str | None = None) -> None:
        """Delete the bitmap files of job ``name`` but ``keep`` (after the row changed)."""
        known = self._job_paths.pop(name, None)
        if known is not None:  # the file this process last wrote or read for the job
            files = [self.root / known]
        else:  # listing the directory costs ~0.5 ms
            files = list((self.root / JOBS_DIR).glob(f"{name}-*.roaring"))
        for f in files:
            if f.relative_to(self.root).as_posix() != keep:
                f.unlink(missing_ok=True)
        if keep is not None:
            self._job_paths[name] = keep

    @_synchronized
    def unregister_job(self, name: str, *, if_exists: bool = False) -> None:
        """Remove job ``name``."""
        if name not in self.job_names():
            if if_exists:
                return
            self.job(name)  # raises JobNotFoundError with a suggestion
        with self._duckdb_errors(f"UNREGISTER JOB {name}"):
            self._con.execute(f"DELETE FROM {META}.jobs WHERE name = ?", [name])
        self._remove_job_files(name)

    # -- statements ------------------------------------------------------------------------------
    @_synchronized
    def sql(self, text: str) -> Any:
        """Run one statement (see ``catalog.sql``).

        Returns:
            a ``pyarrow.Table`` for SELECT, SHOW and DESCRIBE; the ``Dataset`` for CREATE
            DATASET; the ``Job`` for REGISTER JOB; None for DROP and UNREGISTER.
        """
        from catalog.sql.execute import execute

        return execute(self, text)


class _Ingest:
    """One atomic import: IPC part file + DuckDB rows + metadata, or nothing at all."""

    def __init__(
        self,
        catalog: Catalog,
        name: str,
        source: Source,
        *,
        first_id: int,
        version: int,
        append: bool,
    ) -> None:
        self.catalog, self.name, self.source = catalog, name, source
        self.first_id, self.version, self.append = first_id, version, append
        self.num_rows = 0
        self.directory = catalog.root / "data" / name
        token = _new_token()
        self.tmp = self.directory / f".tmp-{token}.arrow"
        self.final = self.directory / f"part-v{version:05d}-{token}.arrow"
        self.queryable = [f.name for f in source.schema if not is_payload(f.type)]
        self.writer: PartWriter | None = None
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0

    def run(self) -> None:
        con = self.catalog._con
        self.directory.mkdir(parents=True, exist_ok=True)
        bar = progress_bar(total=self.source.num_rows, desc=f"import {self.name}")
        renamed = False
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
            os.replace(self.tmp, self.final)
            renamed = True
            con.commit()
        except BaseException as exc:
            with contextlib.suppress(duckdb.Error):  # a failed commit has rolled back already
                con.rollback()
            if self.writer is not None:
                self.writer.abort()
            if renamed:
                self.final.unlink(missing_ok=True)
            if self.directory.exists() and not any(self.directory.iterdir()):
                self.directory.rmdir()
            hint = _disk_full_hint(exc, self.catalog.root)
            if isinstance(exc, duckdb.Error):
                raise ImportFailedError(
                    f"Import of '{self.name}' failed in DuckDB: {exc}. Nothing was stored.{hint}"
                ) from exc
            if isinstance(exc, (pa.ArrowException, OSError)):
                raise ImportFailedError(
                    f"Import of '{self.name}' failed: {exc}. Nothing was stored.{hint}"
                ) from exc
            raise
        finally:
            bar.close()

    def _create_table(self) -> None:
        empty = pa.schema(
            [
                pa.field(ID_COLUMN, pa.int64()),
                *(self.source.schema.field(n) for n in self.queryable),
            ]
        ).empty_table()
        con = self.catalog._con
        con.register("_tl_chunk", empty)
        try:
            con.execute(f"CREATE TABLE {quote(self.name)} AS SELECT * FROM _tl_chunk")
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
                self.tmp, schema, choose_rows_per_batch(avg), identity=identity
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
        ids = pa.array(np.arange(start, start + table.num_rows, dtype=np.int64))
        table = table.add_column(0, ID_COLUMN, ids)
        con = self.catalog._con
        con.register("_tl_chunk", table)
        try:
            con.execute(f"INSERT INTO {quote(self.name)} SELECT * FROM _tl_chunk")
        finally:
            # An error aborts the transaction, and then unregister fails too: keep the first.
            with contextlib.suppress(duckdb.Error):
                con.unregister("_tl_chunk")
        self.num_rows += table.num_rows
        self._pending, self._pending_rows = [], 0

    def _record(self, size: int) -> None:
        assert self.writer is not None
        con = self.catalog._con
        rel = self.final.relative_to(self.catalog.root).as_posix()
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
                "description) VALUES (?, ?, ?, ?, ?, ?)",
                [
                    self.name,
                    self.version,
                    total,
                    self.source.schema.serialize().to_pybytes(),
                    json.dumps(self.source.class_names),
                    self.source.description,
                ],
            )
