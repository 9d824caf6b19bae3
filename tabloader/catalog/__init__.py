"""catalog: the dataset table engine (DuckDB catalog, Arrow IPC storage, imports, statements).

Example:
    >>> import pyarrow as pa, tempfile
    >>> from tabloader import catalog
    >>> cat = catalog.open_catalog(tempfile.mkdtemp())
    >>> ds = cat.import_arrow("numbers", pa.table({"x": list(range(10))}))
    >>> cat.sql("REGISTER JOB evens SELECT x FROM numbers WHERE x % 2 = 0").num_rows
    5
    >>> cat.close()
"""

from __future__ import annotations

import typing

if typing.TYPE_CHECKING:
    from tabloader.catalog._catalog import Catalog, Dataset, Job, open_catalog
    from tabloader.catalog._catalog import connect as connect  # deprecated: open_catalog
from tabloader.catalog._errors import (
    AlreadyExistsError,
    CacheError,
    CatalogError,
    CatalogLockedError,
    DatasetInUseError,
    DatasetNotFoundError,
    ForbiddenExpressionError,
    ImportFailedError,
    JobNotFoundError,
    LoaderError,
    NotFoundError,
    OptionError,
    RowIdError,
    RowReadError,
    SamplingError,
    ServiceError,
    StatementError,
    StorageError,
    TabloaderError,
    UnknownColumnError,
)

__all__ = [
    "AlreadyExistsError",
    "CacheError",
    "Catalog",
    "CatalogError",
    "CatalogLockedError",
    "Dataset",
    "DatasetInUseError",
    "DatasetNotFoundError",
    "ForbiddenExpressionError",
    "ImportFailedError",
    "Job",
    "JobNotFoundError",
    "LoaderError",
    "NotFoundError",
    "OptionError",
    "RowIdError",
    "RowReadError",
    "SamplingError",
    "ServiceError",
    "StatementError",
    "StorageError",
    "TabloaderError",
    "UnknownColumnError",
    "open_catalog",
]


def __getattr__(name: str) -> typing.Any:
    """The catalog's classes and ``open_catalog``, imported on first use (DuckDB, sqlglot: a
    process that reads only files, such as a decode process, never needs them); ``connect``,
    its deprecated name, warns at each call."""
    if name in ("Catalog", "Dataset", "Job", "open_catalog", "connect"):
        from tabloader.catalog import _catalog as module

        value = getattr(module, name)
        if name != "connect":  # not a public name any more
            globals()[name] = value  # once
        return value
    raise AttributeError(f"module 'catalog' has no attribute {name!r}")
