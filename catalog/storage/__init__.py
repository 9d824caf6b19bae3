"""Arrow IPC storage: one file per import or append ("part"), fixed rows per record batch.

``_id`` is not stored: row ``i`` of part ``p`` has ``_id = p.first_id + i``, so
``_id -> (part, record batch, row)`` is a binary search over parts and two integer divisions.
"""

from __future__ import annotations

from catalog.storage.reader import DatasetReader
from catalog.storage.writer import PartInfo, PartWriter, choose_rows_per_batch

__all__ = ["DatasetReader", "PartInfo", "PartWriter", "choose_rows_per_batch"]
