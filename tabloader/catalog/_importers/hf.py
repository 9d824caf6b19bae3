"""HuggingFace ``datasets`` source: a ``Dataset``, a ``DatasetDict`` or a ``save_to_disk`` folder.

A ``datasets.Dataset`` is already an Arrow table (memory-mapped from its cache files), so the
import streams its record batches as they are, ``batch_size`` rows at a time, and never builds
Python objects for rows. Two feature types are rewritten on the way:

- ``ClassLabel`` columns stay ``int64`` and their names go to ``Source.class_names``.
- ``Image`` columns (stored by HF as ``struct<bytes, path>``) become a ``binary`` column of the
  encoded image bytes. When only a path is stored, the file's bytes are read; nothing is decoded,
  so a corrupt image is found when it is decoded for training, not here. Imports read only what
  they were given: for a ``save_to_disk`` folder such a path (a relative one is resolved against
  the folder) must lead inside the folder; for an in-memory dataset it must be relative and stay
  inside the current directory (no absolute path, no ``..`` or link out of it). Other paths are
  refused, naming the row, the column, the path and where it leads, unless ``follow_links=True``.

Both rewrites also apply inside ``List``/``Sequence`` and dict features. A shuffled or selected
dataset (one with an indices mapping) is read in its visible order, one batch of indices at a
time, instead of ``flatten_indices()`` which would write (or hold) a full copy.

A ``DatasetDict`` imports one split (``split="train"``) or, with ``split=None``, every split one
after the other with an extra string column ``split``; this needs every split to have the same
features. ``datasets`` is imported lazily: it is an optional dependency (``tabloader[hf]``).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tabloader.catalog._errors import ImportFailedError, did_you_mean
from tabloader.catalog._importers import (
    FOLLOW_LINKS_FIX,
    Source,
    check_folder,
    check_inside,
    is_inside,
    read_regular_file,
)

if TYPE_CHECKING:
    from types import ModuleType

logger = logging.getLogger(__name__)

SPLIT_COLUMN = "split"


def open_hf(
    source: Any, *, split: str | None = None, batch_size: int = 256, follow_links: bool = False
) -> Source:
    """Open a HuggingFace dataset as a streaming ``Source``.

    Args:
        source: a ``datasets.Dataset``, a ``datasets.DatasetDict``, or the path of a folder
            written by ``save_to_disk`` (holding either).
        split: for a ``DatasetDict``, the split to import. None imports every split, in the
            dict's order, with an extra string column ``split`` naming the split of each row.
            For a ``Dataset`` it must match the dataset's own split, if the dataset knows it.
        batch_size: rows per record batch.
        follow_links: read what lies outside what was given: for a folder, files behind
            symbolic links, data files named by its ``state.json`` and image files named by
            path that lead out of it; for an in-memory dataset, image files named by an
            absolute path or by a relative one that leads out of the current directory.
            Refused by default.

    Returns:
        The source. ``class_names`` holds the names of every ``ClassLabel`` column.

    Raises:
        ImportFailedError: ``datasets`` is not installed, the path is not a ``save_to_disk``
            folder, the object is not a dataset, the split is unknown, the splits of a
            ``DatasetDict`` differ in features, or an image file referenced by path is missing
            or (without ``follow_links``) outside the folder or the current directory. These
            last two are raised while the batches are read.

    Example:
        >>> import datasets
        >>> ds = datasets.Dataset.from_dict(
        ...     {"label": [0, 1, 1]},
        ...     features=datasets.Features({"label": datasets.ClassLabel(names=["cat", "dog"])}),
        ... )
        >>> src = open_hf(ds)
        >>> src.class_names, [b.num_rows for b in src.batches]
        ({'label': ['cat', 'dog']}, [3])
    """
    hf = _import_datasets()
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ImportFailedError(f"batch_size must be a positive integer, not {batch_size!r}.")
    description = ""
    paths = _Paths(None, follow_links)
    if isinstance(source, (str, Path)):
        description = str(source)
        paths = _Paths(Path(source), follow_links)
        source = _load_from_disk(hf, Path(source), follow_links)
    if isinstance(source, hf.Dataset):
        return _open_dataset(source, split, batch_size, description, paths)
    if isinstance(source, hf.DatasetDict):
        return _open_dataset_dict(source, split, batch_size, description, paths)
    if isinstance(source, (hf.IterableDataset, hf.IterableDatasetDict)):
        raise ImportFailedError(
            f"Cannot import a streaming datasets.{type(source).__name__}: its rows are not known "
            "before they are read. Load it without streaming=True, or write it to disk first "
            "(datasets.Dataset.from_generator or save_to_disk) and import that."
        )
    raise ImportFailedError(
        f"Cannot import a {type(source).__module__}.{type(source).__name__} as a HuggingFace "
        "dataset; pass a datasets.Dataset, a datasets.DatasetDict or the path of a save_to_disk "
        "folder (for pyarrow tables use FORMAT arrow)."
    )


@dataclass(frozen=True)
class _Paths:
    """Where image files named by path may be read from, and which rows are being read.

    ``root`` is the ``save_to_disk`` folder (None for an in-memory dataset); ``split`` names
    the split in errors.
    """

    root: Path | None
    follow_links: bool
    split: str | None = None


def _import_datasets() -> ModuleType:
    try:
        datasets = importlib.import_module("datasets")
    except ImportError as exc:
        raise ImportFailedError(
            "Importing HuggingFace datasets needs the 'datasets' package, which is not "
            f"installed ({exc}); pip install 'tabloader[hf]'."
        ) from exc
    return datasets


def _load_from_disk(hf: ModuleType, path: Path, follow_links: bool) -> Any:
    check_folder(
        path,
        path,
        ", not a folder written by datasets' save_to_disk; pass that folder (or use FORMAT "
        "parquet/arrow for a single file).",
    )
    for folder, dirs, files in os.walk(path):  # links are not followed: each is checked
        for name in dirs + files:
            if os.path.islink(os.path.join(folder, name)):
                check_inside(Path(folder, name), path, follow_links=follow_links)
    try:
        loaded = hf.load_from_disk(str(path), keep_in_memory=False)
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as exc:
        raise ImportFailedError(
            f"'{path}' is not a HuggingFace dataset folder ({exc}). Pass a folder written by "
            "Dataset.save_to_disk or DatasetDict.save_to_disk."
        ) from exc
    # The data files its state.json names ('../x.arrow' would leave the folder), by split.
    cache_files = loaded.cache_files
    groups = cache_files.values() if isinstance(cache_files, dict) else [cache_files]
    for group in groups:
        for entry in group:
            data = Path(entry["filename"])
            if not follow_links and not is_inside(data, path):
                raise ImportFailedError(
                    f"'{path}' names the data file '{data}', outside the folder; imports read "
                    f"only what they were given. {FOLLOW_LINKS_FIX}"
                )
    return loaded


def _open_dataset(
    ds: Any, split: str | None, batch_size: int, description: str, paths: _Paths
) -> Source:
    own = None if ds.split is None else str(ds.split)
    if split is not None and own is not None and split != own:
        raise ImportFailedError(
            f"split={split!r} was asked, but this Dataset is the '{own}' split; pass "
            f"split='{own}' or split=None (or pass the DatasetDict that holds '{split}')."
        )
    paths = _Paths(paths.root, paths.follow_links, own)
    schema = _convert_batch(_empty_batch(ds), ds.features, paths, 0).schema
    description = description or f"datasets.Dataset ({ds.num_rows} rows)"
    if own is not None and not description.endswith(f"[{own}]"):
        description = f"{description} [{own}]"
    return Source(
        schema,
        _guarded(_converted(ds, batch_size, None, paths), description),
        num_rows=ds.num_rows,
        class_names=_class_names(ds.features),
        description=description,
    )


def _open_dataset_dict(
    dd: Any, split: str | None, batch_size: int, description: str, paths: _Paths
) -> Source:
    names = [str(name) for name in dd]
    where = description or "datasets.DatasetDict"
    if not names:
        raise ImportFailedError(
            f"The DatasetDict {where} has no splits; there is nothing to import."
        )
    if split is not None:
        if split not in names:
            raise ImportFailedError(
                f"Unknown split '{split}' in {where}.{did_you_mean(split, names)} Its splits are: "
                f"{', '.join(names)}."
            )
        return _open_dataset(dd[split], None, batch_size, f"{where} [{split}]", paths)
    first = dd[names[0]]
    for name in names[1:]:
        if dd[name].features != first.features:
            raise ImportFailedError(
                f"The splits '{names[0]}' and '{name}' of {where} have different features "
                f"({dict(first.features)} vs {dict(dd[name].features)}), so they cannot be "
                f"imported together; pass split= one of {', '.join(names)}, or cast the splits "
                "to the same features first (DatasetDict.cast)."
            )
    if SPLIT_COLUMN in first.column_names:
        raise ImportFailedError(
            f"{where} already has a column '{SPLIT_COLUMN}', which the import of every split "
            f"adds; rename that column, or pass split= one of {', '.join(names)}."
        )
    base = _convert_batch(_empty_batch(first), first.features, paths, 0).schema
    schema = base.append(pa.field(SPLIT_COLUMN, pa.string()))
    description = f"{where} [{', '.join(names)}]"

    def batches() -> Iterator[pa.RecordBatch]:
        for name in names:
            yield from _converted(dd[name], batch_size, name, paths)

    return Source(
        schema,
        _guarded(batches(), description),
        num_rows=sum(dd[name].num_rows for name in names),
        class_names=_class_names(first.features),
        description=description,
    )


def _empty_batch(ds: Any) -> pa.RecordBatch:
    schema = ds.data.table.schema.remove_metadata()
    return pa.RecordBatch.from_arrays([pa.array([], type=f.type) for f in schema], schema=schema)


def _raw_batches(ds: Any, batch_size: int) -> Iterator[pa.RecordBatch]:
    """The record batches of ``ds`` in its visible order, at most ``batch_size`` rows each."""
    if ds._indices is None:
        # No indices mapping: the table's own batches, sliced without a copy.
        yield from ds.data.table.to_batches(max_chunksize=batch_size)
        return
    # Shuffled/selected: gather one batch of indices at a time (a bounded copy).
    for table in ds.with_format("arrow").iter(batch_size):
        yield from table.combine_chunks().to_batches(max_chunksize=batch_size)


def _converted(
    ds: Any, batch_size: int, split: str | None, paths: _Paths
) -> Iterator[pa.RecordBatch]:
    features = ds.features
    if split is not None:
        paths = _Paths(paths.root, paths.follow_links, split)
    first_row = 0
    for raw in _raw_batches(ds, batch_size):
        if raw.num_rows == 0:
            continue
        batch = _convert_batch(raw.replace_schema_metadata(None), features, paths, first_row)
        first_row += raw.num_rows
        if split is not None:
            batch = batch.append_column(
                SPLIT_COLUMN, pa.repeat(pa.scalar(split, pa.string()), batch.num_rows)
            )
        yield batch


def _guarded(batches: Iterator[pa.RecordBatch], where: str) -> Iterator[pa.RecordBatch]:
    """Turn read errors in the middle of the stream into ``ImportFailedError``."""
    try:
        yield from batches
    except (pa.ArrowException, OSError) as exc:
        raise ImportFailedError(f"Cannot read {where}: {exc}. Check the dataset files.") from exc


def _class_names(features: Any) -> dict[str, list[str]]:
    """Names of top-level ``ClassLabel`` columns and of lists of them."""
    import datasets

    names: dict[str, list[str]] = {}
    for column, feature in features.items():
        inner = getattr(feature, "feature", None)
        if isinstance(feature, datasets.ClassLabel):
            names[column] = list(feature.names)
        elif isinstance(inner, datasets.ClassLabel):
            names[column] = list(inner.names)
    return names


def _convert_batch(
    batch: pa.RecordBatch, features: Any, paths: _Paths, first_row: int
) -> pa.RecordBatch:
    """Convert one batch whose first row is row ``first_row`` of the dataset."""
    names = batch.schema.names
    rows = pa.array(np.arange(first_row, first_row + batch.num_rows, dtype=np.int64))
    columns = [
        _convert(batch.column(i), features.get(name), name, paths, rows)
        for i, name in enumerate(names)
    ]
    return pa.RecordBatch.from_arrays(columns, names=names)


def _convert(array: pa.Array, feature: Any, column: str, paths: _Paths, rows: pa.Array) -> pa.Array:
    """Rewrite ``Image`` to binary and ``ClassLabel`` to int64, recursively in lists and dicts.

    ``rows`` holds the dataset row of each value of ``array`` (for errors).
    """
    import datasets

    if feature is None:
        return array
    if isinstance(feature, datasets.Image):
        return _image_bytes(array, column, paths, rows)
    if isinstance(feature, datasets.ClassLabel):
        return array.cast(pa.int64())
    if isinstance(feature, dict) and pa.types.is_struct(array.type):
        children = array.flatten()
        names = [array.type.field(i).name for i in range(array.type.num_fields)]
        converted = [
            _convert(child, feature.get(name), f"{column}.{name}", paths, rows)
            for child, name in zip(children, names, strict=True)
        ]
        return pa.StructArray.from_arrays(converted, names=names, mask=array.is_null())
    inner = getattr(feature, "feature", None)
    if inner is not None and (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
        if not _needs_conversion(inner):
            return array
        inner_rows = rows.take(pc.list_parent_indices(array))
        values = _convert(array.flatten(), inner, column, paths, inner_rows)
        offsets = pc.subtract(array.offsets, array.offsets[0])
        cls = pa.LargeListArray if pa.types.is_large_list(array.type) else pa.ListArray
        return cls.from_arrays(offsets, values, mask=array.is_null())
    return array


def _needs_conversion(feature: Any) -> bool:
    import datasets

    if isinstance(feature, (datasets.Image, datasets.ClassLabel)):
        return True
    if isinstance(feature, dict):
        return any(_needs_conversion(f) for f in feature.values())
    inner = getattr(feature, "feature", None)
    return inner is not None and _needs_conversion(inner)


def _image_bytes(array: pa.Array, column: str, paths: _Paths, rows: pa.Array) -> pa.Array:
    """HF image storage ``struct<bytes, path>`` -> ``binary`` of the encoded image bytes."""
    if pa.types.is_binary(array.type) or pa.types.is_large_binary(array.type):
        return array.cast(pa.binary())
    if not pa.types.is_struct(array.type) or array.type.get_field_index("bytes") < 0:
        raise ImportFailedError(
            f"Image column '{column}' is stored as {array.type}, not struct<bytes, path>; "
            "cast it to datasets.Image() or to binary before importing."
        )
    names = [array.type.field(i).name for i in range(array.type.num_fields)]
    children = dict(zip(names, array.flatten(), strict=True))
    data = children["bytes"]
    stored = children.get("path")
    if stored is None:
        return data.cast(pa.binary())
    need = pc.and_(data.is_null(), stored.is_valid())
    if not pc.any(need).as_py():
        return data.cast(pa.binary())
    values = data.to_pylist()
    for i, path in enumerate(stored.to_pylist()):
        if values[i] is None and path is not None:
            values[i] = _read_image_file(path, _where(column, rows[i].as_py(), paths), paths)
    return pa.array(values, pa.binary())


def _inside_cwd(given: Path, target: Path, cwd: Path) -> bool:
    return not given.is_absolute() and is_inside(target, cwd)


def _where(column: str, row: int, paths: _Paths) -> str:
    split = "" if paths.split is None else f" of split '{paths.split}'"
    return f"Image column '{column}', row {row}{split},"


def _read_image_file(path: str, where: str, paths: _Paths) -> bytes:
    """The bytes of the image file ``path``, which must lead where ``paths`` allows."""
    given = Path(path)
    base = paths.root if paths.root is not None else Path.cwd()
    target = Path(os.path.realpath(base / given))  # an absolute ``given`` replaces ``base``
    outside_root = paths.root is not None and not is_inside(target, paths.root)
    if not paths.follow_links and outside_root:
        raise ImportFailedError(
            f"{where} stores only the path '{path}', which leads to '{target}', outside the "
            f"imported folder '{paths.root}'; imports read only what they were given. Embed the "
            "image bytes in the dataset or copy the file into the folder, or read it on purpose "
            "with WITH (follow_links = true) (follow_links=True in Python, --follow-links on "
            "the command line)."
        )
    if not paths.follow_links and paths.root is None and not _inside_cwd(given, target, base):
        kind = "an absolute path" if given.is_absolute() else "out of the current directory"
        raise ImportFailedError(
            f"{where} stores only the path '{path}', {kind}, which leads to '{target}'; imports "
            "of an in-memory dataset read only relative paths inside the current directory. "
            "Embed the image bytes in the dataset (images as bytes or PIL images, not paths), "
            "or read such paths on purpose with follow_links=True."
        )
    try:
        os.stat(target)
    except OSError as exc:
        raise ImportFailedError(
            f"{where} stores only the path '{path}', which cannot be read "
            f"({exc.strerror or exc}). Restore the file, or embed the image bytes in the dataset "
            "before importing."
        ) from exc
    return read_regular_file(target, follow_links=paths.follow_links)
