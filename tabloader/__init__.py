"""tabloader: several training jobs on one machine share reading and decoding of their data.

The catalog's public names (``Catalog``, the errors...) are tabloader's too, but for
``catalog.open_catalog``: ``connect`` is how tabloader opens a catalog. It returns a
``Connection``: the catalog opened in this process, or, while its loader service runs (which
owns it), the same methods answered by the service. The loading engine adds ``Loader`` and
``JobStream`` (``tabloader.torch`` adds ``JobDataset``).

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

import sys
import typing

from tabloader._lazy import lazy_names
from tabloader.catalog import __all__ as _catalog_names
from tabloader.service._plugins import set_locator as _set_locator

if typing.TYPE_CHECKING:
    from pathlib import Path

    from tabloader.catalog import *  # noqa: F403
    from tabloader.engine import JobStream as JobStream
    from tabloader.engine import Loader as Loader
    from tabloader.engine import OnError as OnError
    from tabloader.engine import default_loader as default_loader
    from tabloader.service._connection import Connection as Connection
    from tabloader.service._connection import connect as connect


class _RayLocator:
    """A rank in a Ray worker of a cluster serving its catalog reads from its node's loader
    (:class:`tabloader.cluster._node.RayNodes`, imported only by a process that imported Ray:
    the cluster layer costs every job process 35 ms to import otherwise)."""

    def node(self, root: Path) -> str | None:
        if "ray" not in sys.modules:
            return None
        from tabloader.cluster._node import RayNodes

        return RayNodes().node(root)

    def missing(self, node: str, root: Path) -> typing.Any:
        from tabloader.cluster._node import RayNodes

        return RayNodes().missing(node, root)


_set_locator(_RayLocator())

# one way to open: connect; the augment grammar stays the catalog's
_catalog_all = [
    n for n in _catalog_names if n not in ("open_catalog", "parse_augment", "from_torchvision")
]

# Imported on first use: a decode process (which imports tabloader.engine._prepare.decoding, so this
# package) reads files and decodes, and never needs DuckDB, sqlglot or the engine (0.2 s of a core
# in every service start's forkserver, on the path to the first batch).
_LAZY = {
    **dict.fromkeys(_catalog_all, "tabloader.catalog"),
    **dict.fromkeys(("JobStream", "Loader", "OnError", "default_loader"), "tabloader.engine"),
    **dict.fromkeys(("Connection", "connect"), "tabloader.service._connection"),
}


__getattr__ = lazy_names(__name__, _LAZY)


__version__ = "0.1.0"

__all__ = sorted(
    [
        *_catalog_all,
        "Connection",
        "JobStream",
        "Loader",
        "OnError",
        "__version__",
        "connect",
        "default_loader",
    ]
)
