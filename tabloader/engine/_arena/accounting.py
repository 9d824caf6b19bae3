"""What the engine counts of the work done for a dataset, and the access log of its arena.

* :class:`Counters`, one per dataset (its ``Fetcher``'s), added to by the pool's threads and
  the decode processes' replies: ``reads`` (payload, that is binary, values read),
  ``decodes`` (images decoded), ``bytes_read``, and seconds of the pool's threads spent
  reading (``read_s``), decoding and resizing (``decode_s``) and copying values into the
  jobs' batches (``collate_s``), of which the jobs' own augmentation (``augment_s``).
  ``Loader.stats()`` shows them per dataset (``datasets``) and sums ``reads``, ``decodes``
  and ``bytes_read`` over the datasets.
* :class:`AccessLog`, kept when a ``Loader`` is given ``access_log`` (the service's
  ``--access-log``): every look-up of prepared values and every release of a batch's pins, in
  order, saved at close as an ``.npz`` of three equal-length int64 arrays, one entry per
  (event, row): ``kind`` (``LOOKUP`` = 1, ``RELEASE`` = 0), ``space`` (the arena space: a
  dataset's image column at one decode size) and ``row``. The benchmarks replay it through
  Belady's MIN (:func:`tests.support.cachesim.belady_pinned`) for the best any cache of
  the arena's size could have done on the same requests.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from tabloader.catalog.storage import _tier

if TYPE_CHECKING:
    from tabloader.engine._prepare.work import Work


@dataclass
class Counters(_tier.Counters[float]):
    """Work done for one dataset, in values and in seconds of the pool's threads."""

    reads: int = 0  # payload (binary) values read
    decodes: int = 0  # images decoded
    bytes_read: int = 0
    storage_bytes: int = 0  # bytes of local files the decode processes read (their readers')
    read_s: float = 0.0  # reading values from storage
    decode_s: float = 0.0  # decoding and resizing images
    collate_s: float = 0.0  # copying values into the jobs' batches (and augmenting them)
    augment_s: float = 0.0  # the jobs' own augmentation (part of collate_s)


class AccessLog:
    """Every look-up of a prepared value and every release of a batch's pins, in order.

    For offline cache bounds (Belady's MIN on the same requests, with the pins the engine
    held: ``tests.support.cachesim.belady_pinned``); a ``Loader`` keeps one when given
    ``access_log``. Event ``LOOKUP`` (space, row): a batch asks for the row and holds it from
    then on; ``RELEASE`` (space, row): the batch lets it go (its values were copied into the
    job's batch, or the loader service's client released it). One release per batch looked up.
    """

    LOOKUP = 1
    RELEASE = 0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: list[tuple[int, int, npt.NDArray[np.int64]]] = []
        self._open: set[int] = set()  # id() of the batches looked up and not yet released

    def looked_up(self, work: Work, space: int, rows: npt.NDArray[np.int64]) -> None:
        with self._lock:
            self._open.add(id(work))
            self._parts.append((self.LOOKUP, space, rows.copy()))

    def released(self, work: Work) -> None:
        """``work`` dropped its pins (a second call, or one for a batch never looked up, is
        a no-op)."""
        with self._lock:
            if id(work) not in self._open:
                return
            self._open.discard(id(work))
            for _, space in work.plan.prepared:
                self._parts.append((self.RELEASE, space, work.rows.copy()))

    def arrays(self) -> dict[str, npt.NDArray[np.int64]]:
        """The events so far: ``kind``, ``space`` and ``row``, one entry each."""
        with self._lock:
            parts = list(self._parts)
        sizes = [rows.size for _, _, rows in parts]
        return {
            "kind": np.repeat(np.array([k for k, _, _ in parts], np.int64), sizes),
            "space": np.repeat(np.array([sp for _, sp, _ in parts], np.int64), sizes),
            "row": np.concatenate([rows for _, _, rows in parts] or [np.empty(0, np.int64)]),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the events to ``path`` (``.npz``: arrays ``kind``, ``space``, ``row``)."""
        events = self.arrays()
        np.savez(path, kind=events["kind"], space=events["space"], row=events["row"])
