"""``Catalog``: a catalog directory opened by this process, the only owner of its DuckDB connection.

The catalog's work is split by concern; this module composes it:

* ``tabloader.catalog._directory``: the directory layout and names, cleanup and migration at open,
and
  the one ``Catalog`` of a directory in a process;
* ``tabloader.catalog._database``: the DuckDB connection and the one boundary that translates its
errors;
* ``tabloader.catalog._cache``: the ``Dataset`` cache;
* ``tabloader.catalog._imports``: the ``import_*`` methods and the atomic import;
* ``tabloader.catalog._job_bitmaps``: job predicates evaluated to bitmaps, and the bitmap files;
* ``tabloader.catalog._job_weights``: job ``weight`` expressions evaluated to weights, and their
files;
* ``tabloader.catalog._sql``: statements, dispatched from a table.

DuckDB allows one read-write process per database file. A second process gets
``CatalogLockedError``, and so does a second ``Catalog`` of the same directory in one process
(share the open one); loader workers and training processes receive bitmaps and file paths,
never a connection. User SQL runs on this connection, opened with ``enable_external_access =
false``, so no statement can read or write files, attach databases or install extensions.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import duckdb
import pyarrow as pa

from tabloader.catalog._api import StatementTarget
from tabloader.catalog._bitmaps import ID_COLUMN
from tabloader.catalog._cache import DatasetCache
from tabloader.catalog._database import (
    DAMAGED_FIX,
    META,
    Database,
    disk_full_hint,
    duckdb_errors,
    quote,
)
from tabloader.catalog._directory import (
    DATA_DIR,
    DB_FILE,
    FILE_MODE,
    JOBS_DIR,
    PART_FILE_RE,
    check_name,
    check_new_root,
    claim_root,
    collect_garbage,
    make_private_dir,
    migrate,
    not_a_catalog,
    not_writable,
    release_root,
    remove_leftovers,
    resolve_root,
    weights_path,
)
from tabloader.catalog._errors import (
    AlreadyExistsError,
    CatalogError,
    DatasetInUseError,
    DatasetNotFoundError,
    ImportFailedError,
    JobNotFoundError,
    StorageError,
    UnknownColumnError,
    did_you_mean,
)
from tabloader.catalog._importers import Source
from tabloader.catalog._imports import Ingest
from tabloader.catalog._job_bitmaps import JobBitmaps
from tabloader.catalog._job_weights import WEIGHT, JobWeights, weights_crc
from tabloader.catalog._limits import Limits
from tabloader.catalog._model import Dataset, Job, JobInfo, check_columns
from tabloader.catalog._options import check_options, default_cache_problem
from tabloader.catalog.storage._stores import WritableStore, open_store
from tabloader.catalog.storage._values import is_payload
from tabloader.catalog.storage._verify import VerifyReport, verify_readers

if TYPE_CHECKING:
    from sqlglot import exp

logger = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


def _synchronized(
    method: Callable[Concatenate[Catalog, P], R],
) -> Callable[Concatenate[Catalog, P], R]:
    """Run a ``Catalog`` method under the catalog's lock (a DuckDB connection is not shared)."""

    @functools.wraps(method)
    def locked(self: Catalog, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def open_catalog(
    path: str | os.PathLike[str] | None = None,
    *,
    create: bool = False,
    memory_limit: int | str | None = None,
    statement_timeout: float | None = None,
) -> Catalog:
    """Open the catalog directory ``path`` in this process (``tabloader.connect`` goes through
    the catalog's loader service while one runs, and opens it here otherwise).

    A directory that holds no catalog is created as one by the first import (or CREATE
    DATASET), or at once with ``create=True``; until then, reads (SHOW, DESCRIBE, SELECT,
    jobs) raise ``CatalogError`` naming the directory, so a mistyped path does not look like
    an empty catalog.

    Args:
        path: the directory; default ``default_root()`` (``$TABLOADER_CATALOG``, else
            ``~/.local/share/tabloader/catalog``).
        create: create the catalog now if the directory holds none.
        memory_limit: the memory user statements may take (bytes, or e.g. ``'2GB'``); default
            ``$TABLOADER_MEMORY_LIMIT``, else the smaller of 4 GiB and half the memory.
        statement_timeout: seconds a user statement may run; default
            ``$TABLOADER_STATEMENT_TIMEOUT``, else 60.

    Raises:
        CatalogLockedError: another process, or another ``Catalog`` of this process, has the
            catalog open.
    """
    return Catalog(
        path, create=create, memory_limit=memory_limit, statement_timeout=statement_timeout
    )


"""Deprecated for one release: ``open_catalog``."""


@dataclass(frozen=True)
class _Opened:
    """What an opened (existing) catalog holds."""

    db: Database
    cache: DatasetCache
    bitmaps: JobBitmaps
    weights: JobWeights


class Catalog(StatementTarget):
    """A catalog directory opened by this process. Use as a context manager or ``close()``.

    Its methods are thread-safe: they take one lock around the DuckDB connection. User
    statements run within ``limits`` (see ``tabloader.catalog._limits`` and ``open_catalog``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        create: bool = False,
        memory_limit: int | str | None = None,
        statement_timeout: float | None = None,
    ) -> None:
        self._lock = threading.RLock()
        self.limits = Limits.resolve(memory_limit, statement_timeout)
        self.root = resolve_root(path)
        if self.root.exists() and not self.root.is_dir():
            raise CatalogError(f"Catalog path '{self.root}' is a file; give a directory.")
        self.path = self.root / DB_FILE
        self._state: _Opened | None = None
        self._key = claim_root(self.root, self)  # one Catalog per directory in a process
        try:
            if create or self.path.exists():
                self._open()
        except BaseException:
            release_root(self._key, self)
            raise

    @property
    def exists(self) -> bool:
        """Whether the directory holds a catalog (False until the first import creates it)."""
        return self._state is not None

    @property
    def _opened(self) -> _Opened:
        """The catalog's parts (its database, dataset cache, job bitmaps and weights),
        opened now if another process created the catalog since."""
        if self._state is None:
            if self.path.exists():  # created by another process since
                self._open()
                assert self._state is not None
            else:
                raise not_a_catalog(self.root)
        return self._state

    def _open(self) -> None:
        new = not self.path.exists()
        with self._os_errors():
            if new:
                check_new_root(self.root)
            for folder in (self.root, self.root / DATA_DIR, self.root / JOBS_DIR):
                make_private_dir(folder)  # a read-only catalog has them
        # the file, the folder its write-ahead log goes in, the folders of data and bitmaps
        folders = (self.root, self.root / DATA_DIR, self.root / JOBS_DIR)
        db = Database(
            self.path, self.root, self.limits, read_only=not_writable(self.path, *folders)
        )
        try:
            with (
                self._os_errors(),
                duckdb_errors(f"Opening catalog '{self.path}'", root=self.root, fix=DAMAGED_FIX),
            ):
                migrate(self.root, db)
                self._state = _Opened(
                    db,
                    DatasetCache(self.root, db),
                    JobBitmaps(self.root, db),
                    JobWeights(self.root, db),
                )
                if db.read_only is None:
                    if new:
                        os.chmod(self.path, FILE_MODE)  # private (see tabloader.catalog._directory)
                    self._collect_garbage()
                else:
                    logger.info("catalog %s opened read-only: %s", self.root, db.read_only)
        except BaseException:
            self._state = None
            db.close()
            raise

    def _collect_garbage(self) -> None:
        collect_garbage(self.root, self._opened.db)

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

    @property
    def connection(self) -> duckdb.DuckDBPyConnection:
        """The catalog's read-write DuckDB connection, for inspection and repair (benchmarks,
        tests). It bypasses every check of :meth:`sql`: statements go through ``sql``."""
        return self._opened.db.con

    @connection.setter
    def connection(self, con: duckdb.DuckDBPyConnection) -> None:
        self._opened.db.con = con

    # -- lifecycle ---------------------------------------------------------------------------
    @_synchronized
    def close(self) -> None:
        """Close the DuckDB connection; the catalog can then be opened again, here or elsewhere."""
        if self._state is not None:
            self._state.db.close()
        release_root(self._key, self)

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Catalog('{self.root}')"

    # -- statements ----------------------------------------------------------------------------
    @_synchronized
    def sql(self, text: str) -> Any:
        """Run one statement (see ``tabloader.catalog._sql``).

        Returns:
            a ``pyarrow.Table`` for SELECT, SHOW and DESCRIBE; the ``Dataset`` for CREATE
            DATASET; the ``Job`` for REGISTER JOB; None for DROP and UNREGISTER.
        """
        from tabloader.catalog._sql.execute import (
            execute,  # sqlglot: not before the first statement
        )

        return execute(self, text)

    @_synchronized
    def query(self, sql: str) -> pa.Table:
        """Run a read-only query (already validated by ``tabloader.catalog._sql``) and return a
        table.

        It runs in a transaction that is always rolled back, so even a query that slipped past
        validation cannot change the catalog.
        """
        return self._opened.db.query(sql)

    # -- names ---------------------------------------------------------------------------------
    def _check_name_case(self, name: str, kind: str) -> None:
        """Refuse a name that differs only in case from a stored one (a ~0.3 ms query).

        Names ignore case, as DuckDB identifiers do (``Meta`` and ``meta`` are one table).
        """
        rows = self._opened.db.rows(
            f"SELECT name FROM {META}.{kind}s WHERE lower(name) = lower(?) AND name <> ?",
            [name, name],
        )
        if rows:
            raise AlreadyExistsError(
                f"{kind.capitalize()} '{rows[0][0]}' exists already, and {kind} names ignore case "
                f"(as in DuckDB), so '{name}' is taken too. Use '{rows[0][0]}', or another name."
            )

    # -- datasets ------------------------------------------------------------------------------
    @_synchronized
    def dataset_names(self) -> list[str]:
        """Names of all datasets, sorted."""
        return self._opened.cache.names()

    @_synchronized
    def dataset(self, name: str, *, version: int | None = None) -> Dataset:
        """Return dataset ``name`` at its latest version or at ``version``.

        Raises:
            DatasetNotFoundError: no such dataset or version.
        """
        return self._opened.cache.get(name, version)

    @_synchronized
    def import_source(
        self, name: str, source: Source, *, append: bool = False, storage: str | None = None
    ) -> Dataset:
        """Import a streaming ``Source`` atomically; see ``tabloader.catalog._imports``.

        The first import into a directory that holds no catalog creates it. ``storage``: see
        ``CatalogAPI.import_source``.
        """
        check_name(name, "dataset")
        if self._state is None and not append:
            self._open()
        self._opened.db.check_writable(f"Import of '{name}'")
        self._check_name_case(name, "dataset")
        exists = name in self.dataset_names()
        if append and not exists:
            raise DatasetNotFoundError(
                f"Cannot append to unknown dataset '{name}' in catalog '{self.root}'."
                f"{did_you_mean(name, self.dataset_names())}"
                " Import it first without append."
            )
        if not append and exists:
            raise AlreadyExistsError(
                f"Dataset '{name}' exists already; DROP DATASET {name} first, or append to it."
            )
        tables = self._opened.db.rows(
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
        ingest = Ingest(
            self.root,
            self._opened.db,
            name,
            source,
            first_id=first_id,
            version=version,
            append=append,
            store=self._import_store(name, storage, append=append),
        )
        try:
            ingest.run()
        finally:
            self._opened.cache.forget(name)
        logger.info("imported %d rows into %s (version %d)", ingest.num_rows, name, version)
        return self.dataset(name)

    def _import_store(
        self, name: str, storage: str | None, *, append: bool
    ) -> WritableStore | None:
        """The store an import of ``name`` writes to (None: the catalog directory); an append
        goes where the dataset is.

        Raises:
            ImportFailedError: ``storage`` is not a store that can be written, or an append
                names another store than the dataset's.
        """
        if append:
            recorded = self._opened.cache.storage_of(name)
            if storage is not None and recorded != open_store(storage).uri:
                raise ImportFailedError(
                    f"Dataset '{name}' is stored in {recorded or 'the catalog directory'}; "
                    "append to it without storage (its rows go where it is)."
                )
            storage = recorded
        if storage is None:
            return None
        try:
            store = open_store(storage)
        except StorageError as exc:
            raise ImportFailedError(f"Import of '{name}': {exc}") from None
        if not isinstance(store, WritableStore):
            raise ImportFailedError(
                f"storage = {storage!r} is not a store tabloader can write a dataset to; give an "
                "object storage location (s3://bucket/prefix), or leave storage out to keep the "
                "dataset in the catalog directory."
            )
        return store

    def import_path(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        format: str,
        append: bool = False,
        follow_links: bool = False,
        split: str | None = None,
        storage: str | None = None,
    ) -> Dataset:
        """Import the files at ``path`` in ``format`` (see ``CatalogAPI.import_path``)."""
        from tabloader.catalog._importers import open_source

        options: dict[str, Any] = {"follow_links": follow_links}
        if split is not None:
            options["split"] = split
        source = open_source(format, path, **options)
        return self.import_source(name, source, append=append, storage=storage)

    # -- checksums (tabloader.catalog.storage._verify)
    # --------------------------------------------------------
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
    def column(self, name: str, column: str, *, rows: int, of: Dataset | None = None) -> pa.Array:
        """Queryable column ``column`` of dataset ``name``, ids ``0..rows-1`` in order, as
        stored (from DuckDB: the loading engine reads a small column of images whole this way,
        1 ms for 2,000 labels against 30 ms from record batches of two rows each). ``of``:
        the version the caller reads; the values must be that version's (the table may have
        been appended to since, not dropped and imported again).

        Raises:
            DatasetNotFoundError, UnknownColumnError: no such dataset or queryable column.
            StorageError: the table does not have those rows, or ``of``'s files are gone.
        """
        ds = self.dataset(name)
        if of is not None and ds.files[: len(of.files)] != of.files:
            raise StorageError(
                f"Dataset {name} was dropped and imported again since version {of.version} "
                "was read; open the job again to read the new one."
            )
        check_columns([column], ds)
        field = ds.schema.field(column)
        if is_payload(field.type):
            raise UnknownColumnError(f"Column '{column}' of {name} holds bytes, not in DuckDB.")
        values = self._opened.db.column(name, column, rows)
        if values.type != field.type:
            values = values.cast(field.type)
        if len(values) != rows:
            raise StorageError(
                f"The table of dataset {name} has {len(values)} rows below _id {rows}; "
                "run `tabloader verify` and re-import the dataset."
            )
        return values

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
        self._opened.db.check_writable(f"DROP DATASET {name}")
        users = [
            r[0]
            for r in self._opened.db.rows(
                f"SELECT name FROM {META}.jobs WHERE dataset = ? ORDER BY name", [name]
            )
        ]
        if users and not cascade:
            raise DatasetInUseError(
                f"Dataset '{name}' is used by job(s) {', '.join(users)}; UNREGISTER JOB them "
                f"first, or DROP DATASET {name} CASCADE."
            )
        paths = [
            r[0]
            for r in self._opened.db.rows(
                f"SELECT path FROM {META}.parts WHERE dataset = ?", [name]
            )
        ]
        storage = self._opened.cache.storage_of(name)
        with duckdb_errors(f"DROP DATASET {name}", root=self.root), self._opened.db.transaction():
            self.connection.execute(f"DELETE FROM {META}.jobs WHERE dataset = ?", [name])
            self.connection.execute(f"DELETE FROM {META}.parts WHERE dataset = ?", [name])
            self.connection.execute(f"DELETE FROM {META}.datasets WHERE name = ?", [name])
            self.connection.execute(f"DROP TABLE IF EXISTS {quote(name)}")
        self._opened.cache.forget(name)
        for job in users:
            self._opened.bitmaps.remove(job)
        if storage is not None:
            self._delete_stored(storage, paths)
        for p in paths:
            (self.root / p).unlink(missing_ok=True)
        folder = self.root / DATA_DIR / name
        if folder.is_dir():
            remove_leftovers(self.root, folder, PART_FILE_RE, set())
            with contextlib.suppress(OSError):  # not empty: it holds files tabloader did not write
                folder.rmdir()

    @staticmethod
    def _delete_stored(storage: str, paths: list[str]) -> None:
        """Delete a dropped dataset's parts from its store (the drop is done already: a part
        that cannot be deleted is left there, with a warning naming it)."""
        try:
            store = open_store(storage)
            if isinstance(store, WritableStore):
                for p in paths:
                    store.delete(p)
        except (StorageError, OSError) as exc:
            warnings.warn(
                f"The dataset is dropped, but its parts in {storage} could not be deleted "
                f"({exc}); delete them there yourself.",
                stacklevel=3,
            )

    # -- jobs ------------------------------------------------------------------------------------
    @_synchronized
    def job_names(self) -> list[str]:
        """Names of all jobs, sorted."""
        return [r[0] for r in self._opened.db.rows(f"SELECT name FROM {META}.jobs ORDER BY name")]

    @_synchronized
    def job(self, name: str) -> Job:
        """Return job ``name``.

        Raises:
            JobNotFoundError: no such job.
            StorageError: its bitmap or weights file is bad and cannot be rebuilt, or its row
                is damaged (a ``weight`` without the CRC-32 of its weights, or the reverse).
        """
        rows = self._opened.db.rows(
            f"SELECT dataset, version, columns, predicate, options, bitmap, num_ids, crc32, "
            f"{self._opened.db.weights_column} FROM {META}.jobs WHERE name = ?",
            [name],
        )
        if not rows:
            raise JobNotFoundError(
                f"Unknown job '{name}' in catalog '{self.root}'."
                f"{did_you_mean(name, self.job_names())} SHOW JOBS lists them; REGISTER JOB "
                "adds one."
            )
        dataset, version, columns, predicate, options, path, num_ids, crc, weighted = rows[0]
        ds = self.dataset(dataset, version=version)
        ids = self._opened.bitmaps.read(name, ds, predicate, path, num_ids, crc)
        opts = json.loads(options)
        weights = None
        if (opts.get("weight") is None) != (weighted is None):
            raise _damaged_weights(name, opts.get("weight"), weights_path(path))
        if weighted is not None:
            weights = self._opened.weights.read(
                name, ds, predicate, opts["weight"], ids, weights_path(path), weighted
            )
        cols = tuple(json.loads(columns))
        return Job(name, dataset, version, cols, predicate, opts, ids, weights)

    @_synchronized
    def job_infos(self) -> list[JobInfo]:
        """What is stored about every job, sorted by name, without reading any bitmap."""
        rows = self._opened.db.rows(
            f"SELECT name, dataset, version, columns, predicate, options, num_ids "
            f"FROM {META}.jobs ORDER BY name"
        )
        return [
            JobInfo(n, d, v, tuple(json.loads(c)), p, json.loads(o), k)
            for n, d, v, c, p, o, k in rows
        ]

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
        """Register a job: see ``CatalogAPI.register_job``. Its bitmap file is written
        first and removed if its row is not: the catalog never names a missing bitmap."""
        check_name(name, "job")
        self._opened.db.check_writable(f"REGISTER JOB {name}")
        ds = self.dataset(dataset)
        from tabloader.catalog._sql.validate import (
            check_predicate,  # sqlglot: at the first REGISTER
        )

        cols = check_columns(columns, ds)
        predicate = check_predicate(where, ds, limits=self.limits) if where is not None else None
        bitmap = self._opened.bitmaps.evaluate(name, ds, predicate)
        opts = check_options(options)
        weights = None
        if opts.get("weight") is not None:
            opts["weight"] = check_predicate(opts["weight"], ds, limits=self.limits, what=WEIGHT)
            weights = self._opened.weights.evaluate(name, ds, predicate, opts["weight"], bitmap)
        path = self._opened.bitmaps.new_path(name)
        blob = bitmap.serialize()
        try:
            self._opened.bitmaps.write(path, blob)
            if weights is not None:
                self._opened.weights.write(weights_path(path), weights)
        except OSError as exc:
            (self.root / path).unlink(missing_ok=True)
            raise CatalogError(
                f"REGISTER JOB {name} failed: cannot write its files ({path}): {exc}."
                f"{disk_full_hint(exc, self.root)} The catalog is unchanged."
            ) from exc
        row = [ds.name, ds.version, json.dumps(cols), predicate, json.dumps(opts), path]
        row += [len(bitmap), zlib.crc32(blob)]
        row += [None if weights is None else weights_crc(weights), name]
        exists = (
            f"Job '{name}' exists already; UNREGISTER JOB {name} first, or use REGISTER OR "
            f"REPLACE JOB {name}."
        )
        try:
            # One autocommitted statement: UPDATE of a short row is ~1.5 ms, DELETE + INSERT
            # or an upsert 3-6 ms (DuckDB rewrites the primary-key index).
            with duckdb_errors(f"REGISTER JOB {name}", root=self.root, exists=exists):
                updated = (
                    replace
                    and self.connection.execute(
                        f"UPDATE {META}.jobs SET dataset = ?, version = ?, columns = ?, "
                        "predicate = ?, options = ?, bitmap = ?, num_ids = ?, crc32 = ?, "
                        "weights_crc32 = ?, created = current_timestamp WHERE name = ?",
                        row,
                    ).fetchall()[0][0]
                )
                if not updated:  # a new job (replacing one costs no name check)
                    self._check_name_case(name, "job")
                    self.connection.execute(
                        f"INSERT INTO {META}.jobs (dataset, version, columns, predicate, "
                        "options, bitmap, num_ids, crc32, weights_crc32, name) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        row,
                    )
        except BaseException:
            (self.root / path).unlink(missing_ok=True)
            (self.root / weights_path(path)).unlink(missing_ok=True)
            raise
        self._opened.bitmaps.remove(name, keep=path)
        problem = default_cache_problem(name, opts, len(bitmap))
        if problem is not None:  # the job is fine in-process, or with a larger cache
            warnings.warn(problem, stacklevel=3)
        return Job(name, ds.name, ds.version, tuple(cols), predicate, opts, bitmap, weights)

    @_synchronized
    def unregister_job(self, name: str, *, if_exists: bool = False) -> None:
        """Remove job ``name``."""
        if name not in self.job_names():
            if if_exists:
                return
            self.job(name)  # raises JobNotFoundError with a suggestion
        self._opened.db.check_writable(f"UNREGISTER JOB {name}")
        with duckdb_errors(f"UNREGISTER JOB {name}", root=self.root):
            self.connection.execute(f"DELETE FROM {META}.jobs WHERE name = ?", [name])
        self._opened.bitmaps.remove(name)


def _damaged_weights(name: str, weight: str | None, path: str) -> StorageError:
    """The error of job ``name`` whose row has a ``weight`` and no CRC-32 of its weights (or
    a CRC-32 and no weight): a hand-edited or damaged catalog. Its weights cannot be checked,
    and drawing it uniformly (or by weights it no longer declares) would be silently wrong."""
    if weight is None:
        what = "a CRC-32 of weights (weights_crc32) and no weight option"
    else:
        shown = weight if len(weight) <= 60 else weight[:57] + "..."
        what = f"a weight ({shown}) and no CRC-32 of its weights (weights_crc32 is NULL)"
    return StorageError(
        f"Job '{name}' is damaged: its row in the catalog has {what}, so it can be drawn "
        f"neither by its weights nor uniformly. Register the job again: REGISTER OR REPLACE "
        f"JOB {name} ... (with its WITH (weight = '...'), or without one).",
        path=path,
    )
