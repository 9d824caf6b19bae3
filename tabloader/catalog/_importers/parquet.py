"""Parquet source: one file, a directory of files or a glob, streamed row group by row group."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tabloader.catalog._errors import ImportFailedError
from tabloader.catalog._importers import Source
from tabloader.catalog._importers.arrow import expand_paths


def _open(path: Path) -> pq.ParquetFile:
    try:
        # pre_buffer=False: with it, iter_batches reads every row group of the file up front
        # (measured: 1.08 GB of Arrow memory for a 1 GB file, vs 84 MB without).
        return pq.ParquetFile(str(path), pre_buffer=False)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise ImportFailedError(f"'{path}' is not a readable Parquet file ({exc}).") from exc


BATCH_BYTES = 32 * 1024 * 1024


def _batch_rows(f: pq.ParquetFile) -> int:
    """Rows per read batch so a batch holds about ``BATCH_BYTES`` (bounded import memory)."""
    md = f.metadata
    if md.num_row_groups == 0 or md.row_group(0).num_rows == 0:
        return 1024
    row_bytes = md.row_group(0).total_byte_size / md.row_group(0).num_rows
    return int(min(64 * 1024, max(1, BATCH_BYTES // max(row_bytes, 1))))


def open_parquet(path_or_glob: str | Path, *, follow_links: bool = False) -> Source:
    """Open Parquet file(s), read in batches of about 32 MiB; files must share one schema.

    ``follow_links``: read files behind symbolic links that lead out of the folder.
    """
    paths = expand_paths(path_or_glob, "Parquet", follow_links=follow_links)
    files = [_open(p) for p in paths]
    schema = files[0].schema_arrow
    for p, f in zip(paths[1:], files[1:], strict=False):
        if not f.schema_arrow.equals(schema):
            raise ImportFailedError(
                f"'{p}' has schema {f.schema_arrow} but '{paths[0]}' has {schema}; import files "
                "with one schema together."
            )
    num_rows = sum(f.metadata.num_rows for f in files)

    def batches() -> Iterator[pa.RecordBatch]:
        for p, f in zip(paths, files, strict=False):
            try:
                yield from f.iter_batches(batch_size=_batch_rows(f))
            except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
                raise ImportFailedError(f"Cannot read Parquet file '{p}': {exc}.") from exc

    return Source(schema, batches(), num_rows=num_rows, description=str(path_or_glob))
