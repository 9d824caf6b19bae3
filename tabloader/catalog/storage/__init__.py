"""Arrow IPC storage: one file per import or append ("part"), fixed rows per record batch.

``_id`` is not stored: row ``i`` of part ``p`` has ``_id = p.first_id + i``, so
``_id -> (part, record batch, row)`` is a binary search over parts and two integer divisions.
Every file records its dataset and part, and every record batch its columns' checksums
(``tabloader.catalog.storage._checksums``); ``tabloader.catalog.storage._verify`` checks them all.
"""

from __future__ import annotations

from tabloader.catalog.storage._reader import DatasetReader, ReaderSpec
from tabloader.catalog.storage._stores import (
    LocalStore,
    Store,
    open_store,
    register_store,
    unregister_store,
)
from tabloader.catalog.storage._verify import Damage, VerifyReport, verify_readers
from tabloader.catalog.storage._writer import PartInfo, PartWriter, choose_rows_per_batch

__all__ = [
    "Damage",
    "DatasetReader",
    "LocalStore",
    "PartInfo",
    "PartWriter",
    "ReaderSpec",
    "Store",
    "VerifyReport",
    "choose_rows_per_batch",
    "open_store",
    "register_store",
    "unregister_store",
    "verify_readers",
]
