"""The loader service: one process per catalog owns the catalog and engine; jobs are clients.

``tabloader serve`` runs a :class:`Service`; ``tabloader.connect`` and ``JobDataset`` reach it (and
start one when none runs); :class:`ServiceProcess` runs one in a child process with a caller's cache
and workers (``tabloader analyze``, benchmarks). :class:`RemoteLoader` is a job process's end: the
service's arena mapped read-only, a job's batches as offsets into it, each copied out once.
:func:`service_pid` says which process serves a catalog now (None: none). A layer above plugs into
the service through :class:`Feed` (where a service's jobs' rows come from: the Ray cluster's leader)
and :class:`Locator` (which node's loader serves a Ray worker).

The names are imported on first use: the package's face imports the plug-in seam at start, and
a process that imports only the catalog must not load the service.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tabloader._lazy import lazy_names

if TYPE_CHECKING:
    from tabloader.service._client import RemoteLoader
    from tabloader.service._plugins import Feed, Locator
    from tabloader.service._process import ServiceProcess
    from tabloader.service._protocol import service_pid
    from tabloader.service._server import Service

__all__ = ["Feed", "Locator", "RemoteLoader", "Service", "ServiceProcess", "service_pid"]

_LAZY = {
    "Feed": "tabloader.service._plugins",
    "Locator": "tabloader.service._plugins",
    "RemoteLoader": "tabloader.service._client",
    "Service": "tabloader.service._server",
    "ServiceProcess": "tabloader.service._process",
    "service_pid": "tabloader.service._protocol",
}


__getattr__ = lazy_names(__name__, _LAZY)
