"""The catalog's value objects: ``Dataset`` (one version of a dataset) and ``Job``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from pyroaring import BitMap

from tabloader.catalog._bitmaps import ID_COLUMN
from tabloader.catalog._errors import UnknownColumnError, did_you_mean
from tabloader.catalog.storage import DatasetReader


@dataclass(frozen=True)
class Dataset:
    """One version of a dataset.

    Attributes:
        name: the dataset (and DuckDB table) name.
        version: 1 at import, +1 per append.
        num_rows: rows in this version (``_id`` is ``0..num_rows-1``).
        schema: ``_id`` followed by the stored columns.
        class_names: for label columns, the class names by value.
        queryable: the columns the DuckDB table holds (usable in WHERE).
    """

    name: str
    version: int
    num_rows: int
    schema: pa.Schema
    class_names: dict[str, list[str]]
    queryable: tuple[str, ...]
    description: str
    _reader: DatasetReader = field(repr=False, compare=False)

    @property
    def columns(self) -> list[str]:
        """Column names, ``_id`` first."""
        return list(self.schema.names)

    @property
    def files(self) -> list[Path]:
        """The Arrow IPC files of this version, in ``_id`` order (where a store other than
        local files holds them: their URLs, as paths)."""
        return [Path(self._reader.locate_part(i)) for i in range(len(self._reader.parts))]

    @property
    def reader(self) -> DatasetReader:
        """The random-access reader over this version's files."""
        return self._reader

    def take(
        self, ids: Sequence[int] | np.ndarray | BitMap, columns: str | Sequence[str] | None = None
    ) -> pa.Table:
        """Return rows ``ids`` in that order, with ``_id`` first and ``columns`` (default all).

        Raises:
            RowIdError: an id is out of range or not an integer.
            UnknownColumnError: no such column (``columns`` may be one name or a list).
            StorageError: a data file is missing or corrupt.
        """
        if isinstance(ids, BitMap):
            ids = np.frombuffer(ids.to_array(), dtype=np.uint32)
        return self._reader.take(ids, columns)

    def __len__(self) -> int:
        return self.num_rows


@dataclass(frozen=True)
class _JobRow:
    """What the catalog's ``jobs`` row says of a job: what ``Job`` and ``JobInfo`` share."""

    name: str
    dataset: str
    dataset_version: int
    columns: tuple[str, ...]
    predicate: str | None
    options: dict[str, Any]


@dataclass(frozen=True)
class Job(_JobRow):
    """A registered training job: a dataset version, columns and the bitmap of its rows.

    Attributes:
        name: job name.
        dataset: dataset name.
        dataset_version: the version the job is pinned to.
        columns: the columns the job reads (``_id`` is always delivered too).
        predicate: the normalized WHERE text, or None for all rows.
        options: the ``WITH (...)`` options.
        ids: the ``_id`` of every row of the job.
        weights: a weighted job's weight of each row (option ``weight``), float64 aligned
            with ``ids`` in ascending order; None for any other job.
    """

    ids: BitMap = field(compare=False, repr=False)
    weights: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def num_rows(self) -> int:
        """Rows in the job's set."""
        return len(self.ids)


@dataclass(frozen=True)
class JobInfo(_JobRow):
    """What the catalog stores about a job, without its bitmap (for listings: a damaged bitmap
    file of one job does not stop SHOW JOBS or SHOW DATASETS).

    Attributes: as ``Job``; ``num_rows`` is the stored id count.
    """

    num_rows: int


def check_columns(columns: str | Sequence[str] | None, ds: Dataset) -> list[str]:
    """Resolve a job's columns (None or ``*`` for all) against ``ds``; ``_id`` is implicit."""
    stored = [c for c in ds.columns if c != ID_COLUMN]
    if isinstance(columns, str):  # one column, not its letters
        columns = [columns]
    if columns is None or list(columns) == ["*"]:
        return stored
    out: list[str] = []
    for c in columns:
        if c == ID_COLUMN:
            continue
        if c not in stored:
            err = UnknownColumnError(
                f"Unknown column '{c}' in dataset '{ds.name}'.{did_you_mean(c, stored)} "
                f"Columns: {', '.join(stored)}."
            )
            err.column = c  # a statement's caller adds where it is (line, col)
            raise err
        if c not in out:
            out.append(c)
    return out
