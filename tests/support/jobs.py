"""Catalog jobs made by hand, for the cluster's tests: the leader takes the catalog's ``Job``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from pyroaring import BitMap

from tabloader.catalog import Job

__all__ = ["catalog_job"]


def catalog_job(
    name: str,
    ids: Iterable[int],
    *,
    dataset: str = "imgs@1",
    weights: np.ndarray | None = None,
    **options: Any,
) -> Job:
    """A registered job ``name`` of rows ``ids`` of ``dataset`` (``name@version``), with the
    options it was registered with (``batch_size=`` and so on) and stored ``weights``."""
    table, _, version = dataset.partition("@")
    rows = ids if isinstance(ids, BitMap) else BitMap(ids)
    return Job(name, table, int(version or 0), ("image",), None, options, rows, weights)
