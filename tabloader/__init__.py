"""tabloader: several training jobs on one machine share reading and decoding of their data.

The catalog's public names (``Catalog``, the errors...) are tabloader's too; the loading engine
adds ``Loader`` and ``JobStream`` (``tabloader.torch`` adds ``JobDataset``). ``connect`` returns
a ``Connection``: the catalog opened in this process, or, while its loader service runs (which
owns it), the same methods answered by the service.

Example:
    >>> import tabloader, pyarrow as pa, tempfile
    >>> cat = tabloader.connect(tempfile.mkdtemp())
    >>> _ = cat.import_arrow("numbers", pa.table({"x": list(range(10))}))
    >>> _ = cat.sql("REGISTER JOB odd SELECT x FROM numbers WHERE x % 2 = 1")
    >>> with tabloader.Loader(cat.catalog, cache_bytes=1 << 20) as loader:
    ...     sorted(int(i) for b in loader.open("odd", batch_size=2, epochs=1) for i in b["_id"])
    [1, 3, 5, 7, 9]
    >>> cat.close()
"""

from __future__ import annotations

from catalog import *  # noqa: F403  (re-exported: the catalog's public names)
from catalog import __all__ as _catalog_all
from tabloader.cluster.node import RayNodes as _RayNodes
from tabloader.engine import JobStream as JobStream
from tabloader.engine import Loader as Loader
from tabloader.engine import OnError as OnError
from tabloader.engine import default_loader as default_loader
from tabloader.service.connection import Connection as Connection
from tabloader.service.connection import connect as connect  # type: ignore[assignment]  # (replaces catalog's)
from tabloader.service.plugins import set_locator as _set_locator

# A rank in a Ray worker of a cluster serving its catalog reads from its node's loader.
_set_locator(_RayNodes())

__version__ = "0.1.0"

__all__ = sorted(
    [*_catalog_all, "Connection", "JobStream", "Loader", "OnError", "__version__", "default_loader"]
)
