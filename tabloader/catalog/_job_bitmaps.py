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
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

import numpy as np
from pyroaring import BitMap

from tabloader.catalog._arrays import to_numpy
from tabloader.catalog._bitmaps import ID_COLUMN, bitmap_from_flags, set_flags
from tabloader.catalog._database import Database, duckdb_errors, quote
from tabloader.catalog._directory import JOBS_DIR, new_token, read_file, write_file
from tabloader.catalog._errors import StatementError, StorageError
from tabloader.catalog._model import Dataset

PREDICATE = "a job predicate"
"""What the allow-list's errors call a job's ``WHERE`` (``check_predicate``'s ``what``)."""

logger = logging.getLogger(__name__)


def max_bitmap_bytes(num_ids: int, num_rows: int) -> int:
    """The most bytes a serialized bitmap of ``num_ids`` ids below ``num_rows`` can take: at
    most 2 bytes an id in its containers (an array container holds 2 bytes an id, a bitmap
    one 8 KiB for more than 4096 ids, a run one only where smaller), plus headers of at most
    16 bytes for each of its 65536-id containers, with room to spare."""
    containers = (max(num_rows, num_ids) >> 16) + 1
    return 2 * num_ids + 16 * containers + 4096


T = TypeVar("T")


class JobFiles(Generic[T]):
    """A job's derived data (its bitmap, its weights) kept in a file: the job's row in
    ``jobs`` (its CRC-32) is the truth, and a file lost or torn is evaluated again.

    Args:
        root: the catalog directory.
        db: its database (predicates and expressions run on its ``ids_con``).
    """

    what: ClassVar[str]  # what the file holds, in messages
    log: ClassVar[logging.Logger]

    def __init__(self, root: Path, db: Database) -> None:
        self.root, self.db = root, db

    def checked(self, text: str, ds: Dataset, what: str) -> str:
        """A stored predicate or weight ``text`` checked again against the allow-list before
        it is evaluated again (``check_predicate``; ``what`` names it): the catalog's file
        can be edited by hand, and must not run arbitrary SQL.

        Raises:
            StatementError: it is not allowed (``ForbiddenExpressionError``, naming why).
        """
        from tabloader.catalog._sql.validate import check_predicate  # sqlglot: only to rebuild

        return check_predicate(text, ds, limits=self.db.limits, what=what)

    def _read_or_rebuild(
        self,
        name: str,
        file: Path,
        load: Callable[[], T | str],
        rebuild: Callable[[], T | str],
        fails: str,
        save: Callable[[T], None],
    ) -> T:
        """Job ``name``'s value from its ``file``: ``load()`` (the file's value, or what is
        wrong with it), else ``rebuild()`` (its value evaluated again, or why it is not the
        stored one; a ``StatementError``: ``fails``), saved.

        Raises:
            StorageError: the file is bad and the value evaluated again is not the stored
                one; the message says which, and how to re-register the job.
        """
        try:
            loaded = load()
        except StorageError as exc:
            loaded = f"{exc}".removeprefix(f"its file {file} ").rstrip(".")
        except (OSError, ValueError) as exc:
            loaded = f"is unreadable ({type(exc).__name__}: {exc})"
        if not isinstance(loaded, str):
            return loaded
        self.log.warning(
            "job '%s': rebuilding its %s (its file %s %s)", name, self.what, file, loaded
        )
        try:
            rebuilt = rebuild()
        except StatementError as exc:
            rebuilt = f"{fails}: {exc}"
        if not isinstance(rebuilt, str):
            with contextlib.suppress(OSError):  # read-only disk: rebuilt again next time
                save(rebuilt)
            return rebuilt
        raise StorageError(
            f"The {self.what} of job '{name}' are lost: its file {file} {loaded}, and {rebuilt}. "
            f"Register the job again: REGISTER OR REPLACE JOB {name} ...",
            path=str(file),
        )


class JobBitmaps(JobFiles[BitMap]):
    """Evaluate job predicates and keep the jobs' bitmap files (:class:`JobFiles`)."""

    what = "row ids"
    log = logger

    def __init__(self, root: Path, db: Database) -> None:
        super().__init__(root, db)
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
                # not pyarrow's to_numpy: its first call imports pandas (0.2-0.8 s, with
                # the catalog held, that other processes wait for)
                set_flags(flags, to_numpy(batch.column(0), copy=False))
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
        can take (``max_bitmap_bytes``): it is never read (``directory.read_file``). The
        stored predicate is checked against the allow-list again before it is evaluated.

        Raises:
            StorageError: the file is bad and the predicate does not give the ids back; the
                message says which, and how to re-register the job.
        """
        file = self.root / path

        def load() -> BitMap | str:
            most = max_bitmap_bytes(num_ids, ds.num_rows)
            ids = BitMap.deserialize(read_file(file, what=f"its file {file}", max_bytes=most))
            if len(ids) == num_ids and zlib.crc32(ids.serialize()) == crc:
                return ids
            return (
                f"does not hold the job's ids ({len(ids)} ids or a CRC-32 that differs from "
                f"the stored {num_ids} ids)"
            )

        def rebuild() -> BitMap | str:
            checked = None if predicate is None else self.checked(predicate, ds, PREDICATE)
            ids = self.evaluate(name, ds, checked)
            if len(ids) == num_ids and zlib.crc32(ids.serialize()) == crc:
                return ids
            other = f"{len(ids)} rows" if len(ids) != num_ids else "other rows (CRC-32 differs)"
            return (
                f"its predicate selects {other} of '{ds.name}' version {ds.version}, not the "
                f"stored {num_ids}"
            )

        fails = f"its predicate fails at version {ds.version}"
        save = lambda ids: write_file(file, ids.serialize())  # noqa: E731
        return self._read_or_rebuild(name, file, load, rebuild, fails, save)

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
