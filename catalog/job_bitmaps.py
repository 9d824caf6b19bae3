"""Job bitmaps: a predicate evaluated to the ``BitMap`` of its rows, and the files that hold it.

A job's bitmap is derived data: the committed ``jobs`` row (dataset version, predicate, id
count and CRC-32 of the bitmap) is the truth, and the file ``jobs/<job>-<token>.roaring`` is
written (not fsynced) before that row commits. A file lost or torn by a crash is rebuilt from
the row the next time the job is read, and checked against the CRC. (A 160 KB blob in the
``jobs`` table made every REGISTER JOB commit 3-5 ms slower than a short row plus a file; an
fsync costs another ~1 ms.)
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from pathlib import Path

import numpy as np
from pyroaring import BitMap

from catalog.bitmaps import ID_COLUMN, bitmap_from_flags, set_flags
from catalog.database import Database, duckdb_errors, quote
from catalog.directory import JOBS_DIR, new_token, read_file, write_file
from catalog.errors import StatementError, StorageError
from catalog.model import Dataset

__all__ = ["JobBitmaps", "max_bitmap_bytes"]

logger = logging.getLogger(__name__)


def max_bitmap_bytes(num_ids: int, num_rows: int) -> int:
    """The most bytes a serialized bitmap of ``num_ids`` ids below ``num_rows`` can take: at
    most 2 bytes an id in its containers (an array container holds 2 bytes an id, a bitmap
    one 8 KiB for more than 4096 ids, a run one only where smaller), plus headers of at most
    16 bytes for each of its 65536-id containers, with room to spare."""
    containers = (max(num_rows, num_ids) >> 16) + 1
    return 2 * num_ids + 16 * containers + 4096


class JobBitmaps:
    """Evaluate job predicates and keep the jobs' bitmap files.

    Args:
        root: the catalog directory.
        db: its database (predicates run on its ``ids_con``).
    """

    def __init__(self, root: Path, db: Database) -> None:
        self.root, self.db = root, db
        self._paths: dict[str, str] = {}  # job -> its bitmap file, when known

    def evaluate(self, name: str, ds: Dataset, predicate: str | None) -> BitMap:
        """The bitmap of the rows of ``ds`` that satisfy ``predicate`` (None: all rows).

        Raises:
            StatementError: the predicate fails in DuckDB, or selects no row.
        """
        if predicate is None:
            return BitMap(range(ds.num_rows))
        # int64 ids scatter 25% faster than uint32 ones (numpy indexes with intp) and cost
        # no more to fetch than a cast. Rows appended after ``ds.version`` are not its rows.
        sql = (
            f"SELECT {ID_COLUMN} FROM {quote(ds.name)} "
            f"WHERE {ID_COLUMN} < {ds.num_rows} AND ({predicate})"
        )
        flags = np.zeros(ds.num_rows, dtype=bool)
        with (
            duckdb_errors(
                f"The predicate of job '{name}'",
                root=self.root,
                error=StatementError,
                limits=self.db.limits,
                arrow_stream=True,
            ),
            self.db.limits.timer(self.db.ids_con.interrupt),
        ):
            for batch in self.db.ids_con.sql(sql).to_arrow_reader(1 << 20):
                set_flags(flags, batch.column(0).to_numpy())
        bitmap = bitmap_from_flags(flags)
        if not bitmap:
            raise StatementError(
                f"Job '{name}' would have no rows: no row of '{ds.name}' satisfies {predicate}. "
                "Loosen the WHERE clause."
            )
        bitmap.run_optimize()
        return bitmap

    def new_path(self, name: str) -> str:
        """A new file for job ``name``'s bitmap, relative to the catalog directory."""
        return f"{JOBS_DIR}/{name}-{new_token()}.roaring"

    def write(self, path: str, blob: bytes) -> None:
        """Write a serialized bitmap to ``path`` (relative to the catalog directory)."""
        write_file(self.root / path, blob)

    def read(
        self, name: str, ds: Dataset, predicate: str | None, path: str, num_ids: int, crc: int
    ) -> BitMap:
        """Read a job's bitmap and check it against its row (``num_ids``, CRC-32 ``crc``).

        A file that is missing, torn or not the job's is rebuilt from the predicate at the
        job's pinned version ``ds`` when that gives the stored ids back; so is one that is a
        symbolic link, not a regular file (a FIFO, a device) or larger than ``num_ids`` ids
        can take (``max_bitmap_bytes``): it is never read (``directory.read_file``).

        Raises:
            StorageError: the file is bad and the predicate does not give the ids back; the
                message says which, and how to re-register the job.
        """
        file = self.root / path
        try:
            blob = read_file(
                file, what=f"its file {file}", max_bytes=max_bitmap_bytes(num_ids, ds.num_rows)
            )
            ids = BitMap.deserialize(blob)
        except StorageError as exc:
            problem = f"{exc}".removeprefix(f"its file {file} ").rstrip(".")
        except (OSError, ValueError) as exc:
            problem = f"is unreadable ({type(exc).__name__}: {exc})"
        else:
            if len(ids) == num_ids and zlib.crc32(ids.serialize()) == crc:
                return ids
            problem = (
                f"does not hold the job's ids ({len(ids)} ids or a CRC-32 that differs from "
                f"the stored {num_ids} ids)"
            )
        logger.warning("job '%s': rebuilding its row ids (its file %s %s)", name, file, problem)
        try:
            ids = self.evaluate(name, ds, predicate)
        except StatementError as exc:
            why = f"its predicate fails at version {ds.version}: {exc}"
        else:
            if len(ids) == num_ids and zlib.crc32(ids.serialize()) == crc:
                with contextlib.suppress(OSError):  # read-only disk: rebuilt again next time
                    write_file(file, ids.serialize())
                return ids
            other = f"{len(ids)} rows" if len(ids) != num_ids else "other rows (CRC-32 differs)"
            why = (
                f"its predicate selects {other} of '{ds.name}' version {ds.version}, not the "
                f"stored {num_ids}"
            )
        raise StorageError(
            f"The row ids of job '{name}' are lost: its file {file} {problem}, and {why}. "
            f"Register the job again: REGISTER OR REPLACE JOB {name} ...",
            path=str(file),
        )

    def remove(self, name: str, keep: str | None = None) -> None:
        """Delete the bitmap files of job ``name`` but ``keep`` (after the row changed), and
        their weights files (``directory.weights_path``)."""
        known = self._paths.pop(name, None)
        if known is not None:  # the file this process last wrote or read for the job
            files = [self.root / known]
        else:  # listing the directory costs ~0.5 ms
            files = list((self.root / JOBS_DIR).glob(f"{name}-*.roaring"))
        for f in files:
            if f.relative_to(self.root).as_posix() != keep:
                f.unlink(missing_ok=True)
                f.with_suffix(".weights").unlink(missing_ok=True)
        if keep is not None:
            self._paths[name] = keep
