"""Importers: one module per source format, each turning a source into a streaming ``Source``.

An importer never writes anything: it opens its source and yields record batches. The catalog
(``catalog.imports.Ingest``) numbers the rows, writes Arrow IPC, fills the DuckDB table
and commits atomically. ``IMPORTERS`` maps a ``FORMAT`` name of ``CREATE DATASET`` to the
function that opens such a source; ``detect_format`` guesses it from a path.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from catalog.errors import ImportFailedError

__all__ = ["IMPORTERS", "Source", "detect_format", "open_source"]


@dataclass
class Source:
    """A streaming source of rows.

    Attributes:
        schema: the schema of every batch (without ``_id``).
        batches: record batches in storage order; consumed once.
        num_rows: total rows if known cheaply (for the progress bar), else None.
        class_names: for label columns, the class names by integer value.
        description: what was imported (a path or a type), for SHOW DATASETS.
    """

    schema: pa.Schema
    batches: Iterator[pa.RecordBatch]
    num_rows: int | None = None
    class_names: dict[str, list[str]] = field(default_factory=dict)
    description: str = ""


# FORMAT name -> "module:function"; the function takes (source, **options) and returns a Source.
IMPORTERS: dict[str, str] = {
    "arrow": "catalog.importers.arrow:open_ipc",
    "parquet": "catalog.importers.parquet:open_parquet",
    "hf": "catalog.importers.hf:open_hf",
    "imagefolder": "catalog.importers.imagefolder:open_imagefolder",
}


def _importer(fmt: str) -> Callable[..., Source]:
    try:
        target = IMPORTERS[fmt]
    except KeyError:
        raise ImportFailedError(
            f"Unknown format {fmt!r}; use one of {', '.join(sorted(IMPORTERS))}."
        ) from None
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)  # type: ignore[no-any-return]


def open_source(fmt: str, source: Any, **options: Any) -> Source:
    """Open ``source`` with the importer registered for ``fmt``."""
    return _importer(fmt)(source, **options)


def detect_format(path: str | Path) -> str:
    """Guess the FORMAT of a path: a directory of class folders, HF, Parquet or Arrow IPC."""
    p = Path(path)
    text = str(path)
    if any(ch in text for ch in "*?["):
        return "parquet" if text.endswith((".parquet", ".pq")) else "arrow"
    if not p.exists():
        raise ImportFailedError(f"No such file or directory: '{path}'. Check the path.")
    if p.is_dir():
        if (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists():
            return "hf"
        if any(child.suffix in (".parquet", ".pq") for child in p.iterdir()):
            return "parquet"
        return "imagefolder"
    if p.suffix in (".parquet", ".pq"):
        return "parquet"
    if p.suffix in (".arrow", ".feather", ".ipc", ".arrows"):
        return "arrow"
    raise ImportFailedError(
        f"Cannot tell the format of '{path}'; add FORMAT imagefolder|parquet|arrow|hf."
    )
