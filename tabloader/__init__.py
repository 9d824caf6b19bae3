"""tabloader: several training jobs on one machine share reading and decoding of their data.

Example:
    >>> import tabloader, pyarrow as pa, tempfile
    >>> cat = tabloader.connect(tempfile.mkdtemp())
    >>> _ = cat.import_arrow("numbers", pa.table({"x": list(range(10))}))
    >>> cat.sql("REGISTER JOB odd SELECT x FROM numbers WHERE x % 2 = 1").num_rows
    5
    >>> cat.close()
"""

from __future__ import annotations

from catalog import (
    AlreadyExistsError,
    CacheError,
    Catalog,
    CatalogError,
    CatalogLockedError,
    Dataset,
    DatasetInUseError,
    DatasetNotFoundError,
    ForbiddenExpressionError,
    ImportFailedError,
    Job,
    JobNotFoundError,
    LoaderError,
    NotFoundError,
    RowReadError,
    SamplingError,
    StatementError,
    StorageError,
    TabloaderError,
    UnknownColumnError,
    connect,
)
from tabloader.engine import JobStream, Loader, OnError, default_loader

__version__ = "0.1.0"

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
    "JobStream",
    "Loader",
    "LoaderError",
    "NotFoundError",
    "OnError",
    "RowReadError",
    "SamplingError",
    "StatementError",
    "StorageError",
    "TabloaderError",
    "UnknownColumnError",
    "__version__",
    "connect",
    "default_loader",
]
