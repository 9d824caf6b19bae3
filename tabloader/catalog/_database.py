"""The DuckDB boundary: the catalog's connection, its metadata schema, and the one place
where DuckDB's exceptions become tabloader's.

A catalog this process may not write (a read-only file system, or another user's catalog it
may only read) opens read-only (``read_only=True``): reads work, and every write is refused
by ``Database.check_writable`` with the reason and the fix, never reported as damage.

Every DuckDB call of the catalog runs inside ``duckdb_errors`` (as httpx's transport runs
httpcore inside ``map_httpcore_exceptions``), so a caller sees a ``TabloaderError`` whose
message names what failed and, where there is one, the fix; the DuckDB exception stays
attached as ``__cause__``. ``translate`` holds the mapping.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import duckdb
import pyarrow as pa

from tabloader.catalog._errors import (
    AlreadyExistsError,
    CatalogError,
    CatalogLockedError,
    StatementError,
    TabloaderError,
)
from tabloader.catalog._limits import Limits

if TYPE_CHECKING:
    from typing_extensions import Required, Unpack

META = "_tabloader"
DAMAGED_FIX = (
    "The file is damaged or is not a DuckDB database: restore it from a backup, or move the "
    "catalog directory away and import the data again into a new one."
)
# DuckDB's error text (it keeps no errno) when it may not open a file for writing, and why
READ_ONLY_ERRORS = {
    "Read-only file system": "is on a read-only file system",
    "Permission denied": "may not be written by this user",
}
# External access off: user SQL cannot read or write files. The oldest storage format keeps
# catalog.duckdb readable by every stock duckdb client from 1.0 on, not only the newest.
DUCKDB_CONFIG: dict[str, str | bool | int | float | list[str]] = {
    "enable_external_access": False,
    "storage_compatibility_version": "v1.0.0",
}

META_DDL = f"""
CREATE SCHEMA IF NOT EXISTS {META};
CREATE TABLE IF NOT EXISTS {META}.datasets (
    name VARCHAR PRIMARY KEY, version INTEGER NOT NULL, num_rows BIGINT NOT NULL,
    schema BLOB NOT NULL, class_names VARCHAR NOT NULL, description VARCHAR,
    created TIMESTAMP DEFAULT current_timestamp, storage VARCHAR);
CREATE TABLE IF NOT EXISTS {META}.parts (
    dataset VARCHAR NOT NULL, version INTEGER NOT NULL, path VARCHAR NOT NULL,
    first_id BIGINT NOT NULL, num_rows BIGINT NOT NULL, rows_per_batch INTEGER NOT NULL,
    file_size BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS {META}.jobs (
    name VARCHAR PRIMARY KEY, dataset VARCHAR NOT NULL, version INTEGER NOT NULL,
    columns VARCHAR NOT NULL, predicate VARCHAR, options VARCHAR NOT NULL,
    bitmap VARCHAR NOT NULL, num_ids BIGINT NOT NULL, crc32 BIGINT NOT NULL,
    created TIMESTAMP DEFAULT current_timestamp, weights_crc32 BIGINT);
"""


def _not_writable_reason(exc: duckdb.Error, path: Path) -> str | None:
    """Why DuckDB could not open ``path`` for writing, if that is what ``exc`` says."""
    text = str(exc)
    for marker, why in READ_ONLY_ERRORS.items():
        if isinstance(exc, duckdb.IOException) and marker in text:
            return f"'{path}' {why} ({marker})"
    return None


def quote(name: str) -> str:
    """Quote an identifier for DuckDB."""
    return '"' + name.replace('"', '""') + '"'


def disk_full_hint(exc: BaseException, root: Path) -> str:
    """The fix for an error caused by a full disk (DuckDB and Arrow keep only the text)."""
    full = getattr(exc, "errno", None) == errno.ENOSPC or "No space left on device" in str(exc)
    return f" The disk holding {root} is full: free space there and try again." if full else ""


class Failure(TypedDict, total=False):
    """How a DuckDB error becomes a tabloader error (``translate``, ``duckdb_errors``).

    Attributes:
        root: the catalog directory (named when its disk is full); always given.
        error: the class for an error with no more specific mapping (default
            ``CatalogError``).
        fix: a sentence appended to the message (what to do, or what state is left).
        exists: the message of an ``AlreadyExistsError`` for a constraint violation (a
            duplicate primary key); without it, that is any other error.
        limits: the statement limits, named when one was reached.
    """

    root: Required[Path]
    error: type[TabloaderError]
    fix: str
    exists: str | None
    limits: Limits | None


def translate(exc: Exception, what: str, **how: Unpack[Failure]) -> TabloaderError:
    """The tabloader error for DuckDB's ``exc`` raised while doing ``what`` (the message's
    subject: "Import of 'x'", "REGISTER JOB j"); ``how``: see :class:`Failure`."""
    root, error = how["root"], how.get("error", CatalogError)
    fix, exists, limits = how.get("fix", ""), how.get("exists"), how.get("limits")
    text = str(exc).split("\n", 1)[0].rstrip().rstrip(".")
    # A DuckDB error met while reading a result as an Arrow stream arrives as an Arrow one.
    interrupted = isinstance(exc, duckdb.InterruptException) or text.startswith("INTERRUPT")
    out_of_memory = isinstance(exc, duckdb.OutOfMemoryException) or text.startswith("Out of Memory")
    if interrupted and limits is not None:
        return error(f"{what} was stopped: it ran too long; {limits.time_fix}.")
    if out_of_memory and limits is not None:
        return error(f"{what} ran out of memory ({text}); {limits.memory_fix}.")
    if isinstance(exc, duckdb.ConstraintException) and exists is not None:
        return AlreadyExistsError(exists)
    if isinstance(exc, duckdb.IOException) and "lock" in text.lower():
        pid = re.search(r"PID (\d+)", text)
        owner = f" (PID {pid.group(1)})" if pid else ""
        return CatalogLockedError(
            f"Catalog '{root}' is in use by another process{owner}. If that is its tabloader "
            f"service (`tabloader --catalog {root} status` shows it), send statements through "
            f"it: `tabloader.connect('{root}')` returns it in Python (`catalog.open_catalog` opens "
            "the catalog in this process only), and `tabloader sql` uses it. Else stop that "
            "process.",
            pid=int(pid.group(1)) if pid else None,
        )
    fix = f" {fix}" if fix else ""
    return error(f"{what} failed in DuckDB: {text}.{fix}{disk_full_hint(exc, root)}")


@contextmanager
def duckdb_errors(
    what: str, *, arrow_stream: bool = False, **how: Unpack[Failure]
) -> Iterator[None]:
    """Translate a ``duckdb.Error`` raised in the block (see ``translate``).

    With ``arrow_stream``, the block reads a DuckDB result as an Arrow stream, whose errors
    are Arrow exceptions carrying DuckDB's message: those are translated too.
    """
    caught: tuple[type[Exception], ...] = (duckdb.Error,)
    if arrow_stream:
        caught += (pa.ArrowException, OSError)  # pyarrow raises DuckDB's errors as OSError
    try:
        yield
    except caught as exc:
        raise translate(exc, what, **how) from exc


class Database:
    """The catalog's DuckDB connection (``con``) and a cursor for bulk id scans (``ids_con``).

    Args:
        path: the ``catalog.duckdb`` file.
        root: the catalog directory, for messages.
        limits: the bounds of user statements (DuckDB's ``memory_limit`` is set from them).
        read_only: why this process may not write the catalog (``directory.not_writable``),
            or None to open it read-write (read-only all the same if DuckDB may not write it).

    Attributes:
        read_only: why the catalog is open read-only, or None.
        weights_column: what reads ``jobs.weights_crc32`` (NULL in a catalog of an older
            tabloader opened read-only, which has no such column: ``directory.migrate``).
        storage_column: what reads ``datasets.storage``, the URI of the store that holds a
            dataset's parts (NULL: the catalog directory), likewise.
    """

    weights_column = "weights_crc32"
    storage_column = "storage"

    def __init__(
        self, path: Path, root: Path, limits: Limits, *, read_only: str | None = None
    ) -> None:
        self.path, self.root, self.limits = path, root, limits
        config = {**DUCKDB_CONFIG, "memory_limit": f"{limits.memory_limit}B"}
        opening = f"Opening catalog '{path}'"
        self.read_only = read_only
        if self.read_only is None:
            try:
                self.con = duckdb.connect(str(path), config=config)
            except duckdb.Error as exc:
                self.read_only = _not_writable_reason(exc, path)
                if self.read_only is None:
                    raise translate(exc, opening, root=root, fix=DAMAGED_FIX) from exc
        if self.read_only is not None:
            try:
                self.con = duckdb.connect(str(path), read_only=True, config=config)
            except duckdb.Error as exc:
                if isinstance(exc, duckdb.IOException) and "Permission denied" in str(exc):
                    raise CatalogError(
                        f"{opening} failed: this user may not read it (Permission denied). "
                        f"Its owner can share it (chmod -R g+rX {root}, for the group), or "
                        "use a catalog of your own."
                    ) from exc
                raise translate(exc, opening, root=root, fix=DAMAGED_FIX) from exc
        try:
            with duckdb_errors(opening, root=root, fix=DAMAGED_FIX):
                if self.read_only is None:
                    self.con.execute(META_DDL)
                # Job ids are fetched on a second connection that may return rows in any order
                # (bitmap_from_flags does not care): 30% faster than keeping insertion order.
                self.ids_con = self.con.cursor()
                self.ids_con.execute("SET SESSION preserve_insertion_order = false")
        except BaseException:
            self.con.close()
            raise

    def close(self) -> None:
        self.ids_con.close()
        self.con.close()

    def check_writable(self, what: str) -> None:
        """Refuse ``what`` (a write: "REGISTER JOB j") on a catalog opened read-only.

        Raises:
            CatalogError: the catalog is read-only; says why and what to do.
        """
        if self.read_only is not None:
            raise CatalogError(
                f"{what} failed: catalog '{self.root}' is read-only: {self.read_only}. "
                "Writes (imports, REGISTER, DROP) need write access there: remount it "
                "read-write, get write permission from its owner, or copy the catalog "
                "directory to a place you can write and use the copy. Reads (SHOW, SELECT, "
                "DESCRIBE, verify, loading jobs) work as it is."
            )

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run a catalog query (tabloader's own SQL) and return its rows."""
        with duckdb_errors("Catalog query", root=self.root):
            return self.con.execute(sql, list(params)).fetchall()

    def column(self, table: str, column: str, rows: int) -> pa.Array:
        """Column ``column`` of dataset table ``table`` for ids ``0..rows-1``, in id order:
        one columnar scan (tabloader's own SQL, on names the caller checked)."""
        sql = f"SELECT {quote(column)} FROM {quote(table)} WHERE _id < ? ORDER BY _id"
        with duckdb_errors("Catalog query", root=self.root):
            values = self.con.sql(sql, params=[rows]).to_arrow_table()
        return values.column(0).combine_chunks()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Run the block in a transaction: committed at the end, rolled back on any error."""
        self.con.begin()
        try:
            yield
        except BaseException:
            self.con.rollback()
            raise
        self.con.commit()

    def query(self, sql: str) -> pa.Table:
        """Run a read-only query in a transaction that is always rolled back, within the
        statement limits."""
        self.con.begin()
        try:
            with (
                duckdb_errors("SELECT", root=self.root, error=StatementError, limits=self.limits),
                self.limits.timer(self.con.interrupt),
            ):
                return self.con.sql(sql).to_arrow_table()
        finally:
            self.con.rollback()
