"""catalog: the dataset table engine (DuckDB catalog, Arrow IPC storage, imports, statements).

Example:
    >>> import catalog, pyarrow as pa, tempfile
    >>> cat = catalog.connect(tempfile.mkdtemp())
    >>> ds = cat.import_arrow("numbers", pa.table({"x": list(range(10))}))
    >>> cat.sql("REGISTER JOB evens SELECT x FROM numbers WHERE x % 2 = 0").num_rows
    5
    >>> cat.close()
"""

from __future__ import annotations

from catalog.catalog import Catalog, Dataset, Job, connect
from catalog.errors import (
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
    "connect",
]
