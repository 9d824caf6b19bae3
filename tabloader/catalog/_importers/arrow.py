"""Arrow sources: in-memory tables and readers, and Arrow IPC files (file or stream format)."""

from __future__ import annotations

import glob
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from tabloader.catalog._errors import ImportFailedError
from tabloader.catalog._importers import Source, check_inside, check_regular_file

BATCH_ROWS = 64 * 1024


def open_arrow(data: Any) -> Source:
    """Open a ``pa.Table``, ``pa.RecordBatch``, ``pa.RecordBatchReader`` or list of batches."""
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    if isinstance(data, pa.Table):
        return Source(
            data.schema,
            iter(data.to_batches(max_chunksize=BATCH_ROWS)),
            num_rows=data.num_rows,
            description="pyarrow.Table",
        )
    if isinstance(data, pa.RecordBatchReader):
        return Source(data.schema, iter(data), description="pyarrow.RecordBatchReader")
    if hasattr(data, "__arrow_c_stream__"):
        reader = pa.RecordBatchReader.from_stream(data)
        return Source(reader.schema, iter(reader), description=type(data).__name__)
    raise ImportFailedError(
        f"Cannot import a {type(data).__name__} as Arrow; pass a pyarrow.Table, RecordBatch or "
        "RecordBatchReader (or use import_parquet / import_hf / import_imagefolder)."
    )


def expand_paths(path_or_glob: str | Path, kind: str, *, follow_links: bool = False) -> list[Path]:
    """Expand a path, a directory (its files, sorted) or a glob into a non-empty list of files.

    A file of the directory, or a match of the glob, that is (or lies under) a symbolic link
    leading out of the directory (for a glob: the folder before its first wildcard) is refused,
    unless ``follow_links``; see ``check_inside``. A single file given by name is read as given.
    """
    text = str(path_or_glob)
    if any(ch in text for ch in "*?["):
        paths = sorted(Path(p) for p in glob.glob(text, recursive=True))
        root = _glob_root(text)
    elif Path(text).is_dir():
        paths = sorted(
            p for p in Path(text).iterdir() if p.is_file() and not p.name.startswith(".")
        )
        root = Path(text)
    else:
        paths, root = [Path(text)], None
    if not paths:
        raise ImportFailedError(f"No {kind} files match '{text}'. Check the path or the glob.")
    for p in paths:
        if root is not None:
            check_inside(p, root, follow_links=follow_links)
        if not p.exists():
            raise ImportFailedError(f"No such {kind} file: '{p}'. Check the path.")
        check_regular_file(p)  # a directory matched by a glob, a FIFO, a device: refused
    return paths


def _glob_root(pattern: str) -> Path:
    """The folder a glob searches: its path up to the first part with a wildcard."""
    parts = Path(pattern).parts
    fixed = list(itertools.takewhile(lambda x: not any(c in x for c in "*?["), parts))
    return Path(*fixed) if fixed else Path()


def _open_one_ipc(path: Path) -> tuple[pa.Schema, int | None, Iterator[pa.RecordBatch]]:
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        return reader.schema, None, (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        pass
    try:
        stream = pa.ipc.open_stream(pa.memory_map(str(path), "r"))
        return stream.schema, None, iter(stream)
    except pa.ArrowInvalid as exc:
        raise ImportFailedError(
            f"'{path}' is not an Arrow IPC file or stream ({exc}). Check the file, or give the "
            "right FORMAT."
        ) from exc


def open_ipc(path_or_glob: str | Path, *, follow_links: bool = False) -> Source:
    """Open Arrow IPC / Feather v2 files (file or stream format), in sorted path order.

    ``follow_links``: read files behind symbolic links that lead out of the folder.
    """
    paths = expand_paths(path_or_glob, "Arrow IPC", follow_links=follow_links)
    schema, _, first = _open_one_ipc(paths[0])

    def batches() -> Iterator[pa.RecordBatch]:
        yield from first
        for p in paths[1:]:
            other, _, rest = _open_one_ipc(p)
            if not other.equals(schema):
                raise ImportFailedError(
                    f"'{p}' has schema {other} but '{paths[0]}' has {schema}; import files with "
                    "one schema together."
                )
            yield from rest

    return Source(schema, _checked(batches(), path_or_glob), description=str(path_or_glob))


def _checked(batches: Iterator[pa.RecordBatch], where: Any) -> Iterator[pa.RecordBatch]:
    """Turn Arrow read errors in the middle of a stream into ``ImportFailedError``."""
    try:
        yield from batches
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise ImportFailedError(f"Cannot read '{where}': {exc}. Check the file.") from exc
