"""The whole tabloader exception hierarchy (``tabloader`` re-exports it).

::

    TabloaderError
      CatalogError
        CatalogLockedError        the catalog is open in another process or Catalog
        NotFoundError(LookupError)
          DatasetNotFoundError
          JobNotFoundError
          RowIdError(IndexError)  a row id out of range or not an integer
        AlreadyExistsError
        DatasetInUseError         DROP DATASET while jobs use it
      ImportFailedError           a source could not be imported; nothing stored
      StatementError(ValueError)  .line .col - bad SQL-ish input
        UnknownColumnError
        ForbiddenExpressionError
        OptionError               a job option unknown, mistyped or out of range
      StorageError                .path .dataset .rows - missing, corrupt or swapped file
      SamplingError
      CacheError
      LoaderError                 a job's batch could not be produced
        RowReadError              .row_id - one row failed to read or decode
      ServiceError                the loader service is unreachable, refused us, or broke protocol

Every message names the bad value and the fix.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable
from typing import Any


class TabloaderError(Exception):
    """Base class of every error tabloader raises on purpose."""


class CatalogError(TabloaderError):
    """The catalog cannot do what was asked."""


class CatalogLockedError(CatalogError):
    """Another process (DuckDB allows one writer per file) or ``Catalog`` has the catalog open.

    Attributes:
        pid: the process that holds it, when known (None: another ``Catalog`` of this
            process, or a holder DuckDB did not name).
    """

    def __init__(self, message: str, *, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid

    def __reduce__(self) -> tuple[Any, ...]:  # keyword-only fields: pickled across processes
        return (functools.partial(type(self), pid=self.pid), self.args)


class NotFoundError(CatalogError, LookupError):
    """A named object does not exist."""

    def __str__(self) -> str:  # LookupError would otherwise be fine; keep plain text
        return str(self.args[0]) if self.args else ""


class DatasetNotFoundError(NotFoundError):
    """No dataset by that name."""


class JobNotFoundError(NotFoundError):
    """No job by that name."""


class RowIdError(NotFoundError, IndexError):
    """No row with that ``_id`` in the dataset version, or the id is not an integer."""


class AlreadyExistsError(CatalogError):
    """A dataset or job by that name exists already."""


class DatasetInUseError(CatalogError):
    """The dataset is used by registered jobs."""


class ImportFailedError(TabloaderError):
    """A source could not be imported; nothing was stored."""


class StatementError(TabloaderError, ValueError):
    """A statement could not be parsed or is not allowed.

    Attributes:
        line: 1-based line of the problem, or None.
        col: 1-based column of the problem, or None.
    """

    def __init__(self, message: str, *, line: int | None = None, col: int | None = None) -> None:
        if line is not None and col is not None:
            message = f"{message} (line {line}, col {col})"
        super().__init__(message)
        self.line = line
        self.col = col


class UnknownColumnError(StatementError):
    """A statement names a column the dataset does not have.

    Attributes:
        column: the unknown name, where known.
    """

    column: str | None = None


class ForbiddenExpressionError(StatementError):
    """A statement uses an expression outside the allow-list."""


class OptionError(StatementError):
    """A job option is unknown, of the wrong type or out of range (see ``JOB_OPTIONS``)."""


class StorageError(TabloaderError):
    """A data file (Arrow IPC, or a job's row ids) is missing, corrupt or not the right file.

    Attributes:
        path: the file at fault.
        dataset: the dataset whose rows cannot be read, when known.
        rows: the ``_id`` range that cannot be read, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        dataset: str | None = None,
        rows: range | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.dataset = dataset
        self.rows = rows

    def __reduce__(self) -> tuple[Any, ...]:  # keyword-only fields: pickled across processes
        rebuild = functools.partial(
            type(self), path=self.path, dataset=self.dataset, rows=self.rows
        )
        return (rebuild, self.args)


class SamplingError(TabloaderError):
    """The sampler was asked something it cannot do (unknown job, empty set...)."""


class CacheError(TabloaderError):
    """The cache cannot hold what it must (capacity too small for the pinned rows...)."""


class LoaderError(TabloaderError):
    """A job's batch could not be produced."""


class RowReadError(LoaderError):
    """One row failed to read or decode.

    Attributes:
        row_id: the ``_id`` of the row.
        column: the column at fault, or None.
    """

    def __init__(self, message: str, *, row_id: int, column: str | None = None) -> None:
        super().__init__(message)
        self.row_id = row_id
        self.column = column

    def __reduce__(self) -> tuple[Any, ...]:  # keyword-only fields: pickled across processes
        return (functools.partial(type(self), row_id=self.row_id, column=self.column), self.args)


class ServiceError(TabloaderError):
    """The loader service cannot be reached, refused the connection, or broke the protocol."""


class ServiceStuckError(ServiceError):
    """The loader service runs (it holds the catalog's service lock) but does not answer."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return `` Did you mean 'x'?`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""
