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

from tabloader._lazy import lazy_names
from tabloader.catalog._progress import disable_progress_bars

if typing.TYPE_CHECKING:
    from tabloader.catalog._augment import from_torchvision, parse_augment
    from tabloader.catalog._catalog import Catalog, open_catalog
    from tabloader.catalog._model import Dataset, Job
    from tabloader.catalog._options import JobOptions, JobSpec
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
    "JobOptions",
    "JobSpec",
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
    "disable_progress_bars",
    "from_torchvision",
    "open_catalog",
    "parse_augment",
]


_LAZY = {
    "Catalog": "tabloader.catalog._catalog",
    "Dataset": "tabloader.catalog._model",
    "Job": "tabloader.catalog._model",
    "JobOptions": "tabloader.catalog._options",
    "JobSpec": "tabloader.catalog._options",
    "from_torchvision": "tabloader.catalog._augment",
    "open_catalog": "tabloader.catalog._catalog",
    "parse_augment": "tabloader.catalog._augment",
}


__getattr__ = lazy_names(__name__, _LAZY)
