"""Parquet source: one file, a directory of files or a glob, streamed row group by row group."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from catalog.errors import ImportFailedError
from catalog.importers import Source
from catalog.importers.arrow import expand_paths

__all__ = ["open_parquet"]


def _open(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(str(path))
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise ImportFailedError(f"'{path}' is not a readable Parquet file ({exc}).") from exc


def open_parquet(path_or_glob: str | Path, *, batch_size: int = 16 * 1024) -> Source:
    """Open Parquet file(s); files must share one schema."""
    paths = expand_paths(path_or_glob, "Parquet")
    files = [_open(p) for p in paths]
    schema = files[0].schema_arrow
    for p, f in zip(paths[1:], files[1:]):
        if not f.schema_arrow.equals(schema):
            raise ImportFailedError(
                f"'{p}' has schema {f.schema_arrow} but '{paths[0]}' has {schema}; import files "
                "with one schema together."
            )
    num_rows = sum(f.metadata.num_rows for f in files)

    def batches() -> Iterator[pa.RecordBatch]:
        for p, f in zip(paths, files):
            try:
                yield from f.iter_batches(batch_size=batch_size)
            except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
                raise ImportFailedError(f"Cannot read Parquet file '{p}': {exc}.") from exc

    return Source(schema, batches(), num_rows=num_rows, description=str(path_or_glob))
