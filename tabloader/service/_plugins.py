"""What a layer above plugs into the loader service, which knows nothing of what plugs in.

Two plugs, both used by the Ray cluster (:mod:`tabloader.cluster._node`) and by nothing else:

* A :class:`Feed` gives the rows of every job opened in a service (``Service(feed=...)``): a
  node's loader is fed by the cluster's leader instead of sampling its jobs itself. The service
  opens each job fed (``Loader.serve(source=Fed)``) and tells the feed when a rank joins or leaves.
* A :class:`Locator` tells a client which node's loader serves a catalog for this process (a
  Ray worker of a cluster serving it), registered with :func:`set_locator` when the cluster
  layer is imported; without one, a client uses the catalog's local service.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from tabloader.catalog import Job
    from tabloader.catalog._errors import ServiceError
    from tabloader.engine._deliver.stream import ServedStream


class Feed(Protocol):
    """The rows of a service's jobs, from elsewhere (the cluster's leader)."""

    def join(self, stream: ServedStream, job: Job, *, rank: int, world_size: int) -> None:
        """Rank ``rank`` of ``job`` opened ``stream`` (a fed stream): feed it from now on."""

    def leave(self, job: str, rank: int, *, failed: bool, reason: str = "") -> None:
        """Rank ``rank`` of ``job`` left (``failed``: its process died mid-run, ``reason``)."""

    def report(self, job: str, ids: np.ndarray, losses: np.ndarray) -> None:
        """A rank of ``job`` scored rows by their losses (``importance = 'loss'``): to the
        sampler that draws the job's rows."""

    def close(self) -> None:
        """Stop feeding (the service is closing)."""


class Locator(Protocol):
    """Which node loader serves a catalog for this process."""

    def node(self, root: Path) -> str | None:
        """The node whose loader serves ``root`` for this process, or None (no cluster)."""

    def missing(self, node: str, root: Path) -> ServiceError:
        """The error of a process whose node has no loader for ``root``."""


_locator: Locator | None = None


def set_locator(found: Locator) -> None:
    """Make ``found`` the locator every client of this process asks."""
    global _locator
    _locator = found


def locator() -> Locator | None:
    """The registered locator, if any."""
    return _locator
