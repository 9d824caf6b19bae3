"""Sources in object storage: ``FROM 's3://bucket/prefix' FORMAT imagefolder|parquet|arrow``.

The same sources as the local importers, listed and read through the store of the URI's scheme
(:mod:`tabloader.catalog.storage._s3`): an image folder is the objects ``<prefix>/<class>/…/<file>``
(hidden names, a part starting with ``.``, skipped; images right under the prefix refused, as
locally), each image one request, a batch's images in flight together; Parquet and Arrow IPC are one
object, or every object under a prefix with the format's extension, sorted, read through ranged
reads of at least ``ranged.READAHEAD_BYTES`` (bounded memory). There are no links in object storage,
so ``follow_links`` has nothing to do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import PurePosixPath
from typing import Any

import pyarrow as pa

from tabloader.catalog._errors import ImportFailedError, StorageError
from tabloader.catalog._importers import Source
from tabloader.catalog.storage._ranged import ObjectFile

EXTENSIONS = {"parquet": (".parquet", ".pq"), "arrow": (".arrow", ".feather", ".ipc", ".arrows")}


def _store(uri: str) -> Any:
    from tabloader.catalog.storage._stores import open_store

    try:
        return open_store(uri)
    except StorageError as exc:
        raise ImportFailedError(str(exc)) from None


def _listed(uri: str, exts: Iterable[str] | None) -> tuple[Any, list[tuple[str, int]]]:
    """The store of ``uri``'s bucket, and ``(key, size)`` of ``uri`` itself if it is an
    object, else of the objects under it (of extensions ``exts``; hidden ones skipped).

    Raises:
        ImportFailedError: nothing there (a prefix without a dataset), or unreadable.
    """
    bucket_uri = "/".join(uri.split("/", 3)[:3])
    store = _store(bucket_uri)
    prefix = uri[len(bucket_uri) :].strip("/")
    try:
        size = store.size_of(prefix) if prefix and not uri.endswith("/") else None
        if size is not None:  # an object
            return store, [(prefix, size)]
        found = store.list(prefix)
    except StorageError as exc:
        raise ImportFailedError(str(exc)) from None
    under = [
        (k, n)
        for k, n in found
        if k.startswith(f"{prefix}/" if prefix else "")
        and not any(p.startswith(".") for p in PurePosixPath(k[len(prefix) :]).parts)
    ]
    matched = [(k, n) for k, n in under if exts is None or k.lower().endswith(tuple(exts))]
    if not matched:
        what = "objects" if exts is None else f"objects ending {'/'.join(exts)}"
        raise ImportFailedError(
            f"No {what} under {uri} ({len(under)} object(s) there). Check the bucket and prefix, "
            "and the FORMAT."
        )
    return store, matched


def open_remote(fmt: str, uri: str, **options: Any) -> Source:
    """The source of ``uri`` in ``fmt`` (``imagefolder``, ``parquet`` or ``arrow``)."""
    options.pop("follow_links", None)
    if fmt == "imagefolder":
        return _imagefolder(uri, **options)
    if fmt not in EXTENSIONS or options:
        raise ImportFailedError(
            f"FORMAT {fmt} {('with ' + ', '.join(options)) if options else ''} cannot read from "
            f"{uri}; object storage holds imagefolder, parquet and arrow sources (copy a "
            "HuggingFace folder to local disk first)."
        )
    store, objects = _listed(uri, EXTENSIONS[fmt])
    files = [(key, ObjectFile(_reader(store, key), size)) for key, size in objects]
    return (_parquet if fmt == "parquet" else _ipc)(uri, files)


def _reader(store: Any, key: str) -> Any:
    return lambda offset, length: store.read_range(key, offset, length)


def _parquet(uri: str, files: list[tuple[str, ObjectFile]]) -> Source:
    import pyarrow.parquet as pq

    from tabloader.catalog._importers.parquet import _batch_rows

    opened = []
    for key, f in files:
        try:
            opened.append(pq.ParquetFile(f.file(), pre_buffer=False))
        except (pa.ArrowException, OSError) as exc:
            raise ImportFailedError(
                f"'{key}' of {uri} is not a readable Parquet file ({exc})."
            ) from exc
    schema = opened[0].schema_arrow
    for (key, _), f in zip(files, opened, strict=True):
        if not f.schema_arrow.equals(schema):
            raise ImportFailedError(
                f"'{key}' has schema {f.schema_arrow}, not {schema}; import objects with one "
                "schema together."
            )

    def batches() -> Iterator[pa.RecordBatch]:
        for (key, _), f in zip(files, opened, strict=True):
            try:
                yield from f.iter_batches(batch_size=_batch_rows(f))
            except (pa.ArrowException, OSError) as exc:
                raise ImportFailedError(f"Cannot read '{key}' of {uri}: {exc}.") from exc

    num_rows = sum(f.metadata.num_rows for f in opened)
    return Source(schema, batches(), num_rows=num_rows, description=uri)


def _ipc(uri: str, files: list[tuple[str, ObjectFile]]) -> Source:
    def opened(key: str, f: ObjectFile) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
        try:
            reader = pa.ipc.open_file(f.file())
            return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            pass
        try:
            stream = pa.ipc.open_stream(f.file())
            return stream.schema, iter(stream)
        except pa.ArrowInvalid as exc:
            raise ImportFailedError(
                f"'{key}' of {uri} is not an Arrow IPC file or stream ({exc})."
            ) from exc

    schema, first = opened(*files[0])

    def batches() -> Iterator[pa.RecordBatch]:
        yield from first
        for key, f in files[1:]:
            other, rest = opened(key, f)
            if not other.equals(schema):
                raise ImportFailedError(
                    f"'{key}' has schema {other}, not {schema}; import objects with one schema "
                    "together."
                )
            yield from rest

    def checked() -> Iterator[pa.RecordBatch]:
        try:
            yield from batches()
        except (pa.ArrowException, OSError) as exc:
            raise ImportFailedError(f"Cannot read {uri}: {exc}.") from exc

    return Source(schema, checked(), description=uri)


def _imagefolder(
    uri: str, *, extensions: Iterable[str] | None = None, batch_size: int = 64
) -> Source:
    from tabloader.catalog._importers.imagefolder import (
        DEFAULT_EXTENSIONS,
        SCHEMA,
        _normalize_extensions,
        image_batch,
    )

    exts = _normalize_extensions(DEFAULT_EXTENSIONS if extensions is None else extensions)
    store, objects = _listed(uri, exts)
    prefix = uri.split("/", 3)[3].strip("/") if uri.count("/") >= 3 else ""
    rels = [k[len(prefix) :].lstrip("/") for k, _ in objects]
    loose = [r for r in rels if "/" not in r]
    if loose:
        raise ImportFailedError(
            f"{uri} has {len(loose)} image(s) right under it ({', '.join(loose[:3])}); an image "
            "folder is <prefix>/<class>/<file>, the class folder giving the label. Move them "
            "under class prefixes, or give the prefix that holds the class folders."
        )
    classes = sorted({r.split("/", 1)[0] for r in rels})
    label = {c: i for i, c in enumerate(classes)}
    files = sorted((label[r.split("/", 1)[0]], tuple(r.split("/")), r) for r in rels)

    def batches() -> Iterator[pa.RecordBatch]:
        for start in range(0, len(files), batch_size):
            chunk = files[start : start + batch_size]
            keys = [f"{prefix}/{rel}" if prefix else rel for _, _, rel in chunk]
            try:
                images = store.read_objects(keys)
            except (StorageError, FileNotFoundError) as exc:
                raise ImportFailedError(
                    f"Cannot read an image of {uri} ({exc}); the objects changed during the "
                    "import? Import again."
                ) from exc
            labels = [lab for lab, _, _ in chunk]
            yield image_batch(images, labels, classes, [rel for _, _, rel in chunk])

    return Source(
        SCHEMA, batches(), num_rows=len(files), class_names={"label": classes}, description=uri
    )
