"""Where part files are read from: a store, chosen by the scheme of a URI.

A reader names its parts by their paths under a root (``data/<dataset>/part-….arrow``, as the
catalog records them) and opens them through the store of the root's URI, as litdata picks a
downloader by URL scheme: a bare path or ``file://`` is local files (:class:`LocalStore`);
any other scheme is the store :func:`register_store` registered for it. The URI is a string,
so what another process needs to read the same parts (a reader's ``spec()``: the decode
processes, a service's clients through JSON) carries it as it is, and opens the store there.

Adding a store is one module: a class with :class:`Store`'s three members, registered by
scheme (``register_store("mem", MemStore)``) in each process that reads (a decode process
imports the factory's module itself: :func:`store_factory`). ``s3://`` is built in
(:mod:`tabloader.catalog.storage._s3`, imported at the first such URI, ``BUILTIN_STORES``).

A store whose reads are requests (object storage) is also a :class:`RangedStore`: the reader then
fetches a record batch's bytes in one ranged read before decoding it, many batches in flight, checks
them on every fetch and fetches a batch that fails its check once more
(:mod:`tabloader.catalog.storage._ranged`). A store that can be written (``WritableStore``) can hold
a dataset's parts: ``CREATE DATASET ... WITH (storage = 's3://bucket/prefix')`` writes them to
``<prefix>/data/<dataset>/`` (``tabloader.catalog._imports``); else imports write into the catalog
directory. ``$TABLOADER_STORAGE`` (:func:`storage_uri`) makes the catalogs a process opens read all
their parts from another root that holds a copy of their ``data/`` folders (a path: relative
ones mean the reading process's working directory).
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from urllib.parse import unquote, urlsplit

import pyarrow as pa

from tabloader.catalog._directory import open_file, opened_path
from tabloader.catalog._errors import CatalogError, StorageError
from tabloader.catalog._settings import STORAGE_ENV

if TYPE_CHECKING:
    from tabloader.catalog.storage._ranged import PartFile
    from tabloader.catalog.storage._tier import BatchCache


class Store(Protocol):
    """Random-access reads of part files under one root.

    Attributes:
        uri: the root, as a URI or a local path: what ``open_store`` opens this store again
            from, in this process or another.
    """

    uri: str

    def locate(self, name: str) -> str:
        """Where part ``name`` (a path under the root, ``/``-separated) lies, for messages
        and comparisons: a local path, or a URL."""
        ...

    def open_part(self, name: str, *, size: int, what: str, memory_map: bool) -> pa.NativeFile:
        """Part ``name`` opened to read at any offset, of ``size`` bytes as the catalog
        recorded it (a store that can tell refuses another size; the reader checks it too).

        ``memory_map``: zero-copy reads are wanted (a memory map, a buffer), for small reads
        of many rows; else reads that copy (``pread``), whose pages do not stay resident.
        A store may return either kind for either.

        Raises:
            FileNotFoundError: no such part.
            StorageError: it is not the catalog's file (a link, of another size); ``what``
                ("Data file 'x' of dataset 'd'") is the subject of its message.
            OSError: it cannot be read.
        """
        ...


@runtime_checkable
class RangedStore(Protocol):
    """A store whose reads are requests: the reader fetches record batches through
    ``part(...)`` (:class:`~tabloader.catalog.storage._ranged.PartFile`: ``load``/``release`` of
    batches, many in flight) and counts refetches in ``counters``."""

    uri: str
    counters: Any

    def part(self, name: str, *, size: int, what: str, cache: BatchCache | None = None) -> PartFile:
        """Part ``name`` for ranged reads (its footer read, or found in ``cache``), shared by
        its readers."""
        ...

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[Any]:
        """The ``(offset, length)`` ranges of ``name``, each one request, all in flight."""
        ...


@runtime_checkable
class WritableStore(Protocol):
    """A store an import can write a dataset's parts to."""

    uri: str

    def locate(self, name: str) -> str: ...

    def check_writable(self, name: str) -> None:
        """Refuse (``StorageError`` naming the fix) unless ``name`` can be written."""
        ...

    def upload(self, name: str, path: Path) -> None:
        """Write local file ``path`` as ``name``, whole or not at all."""
        ...

    def delete(self, name: str) -> None:
        """Delete ``name`` (nothing if it does not exist)."""
        ...


StoreFactory = Callable[[str], Store]
"""``factory(uri) -> Store``: the store of a URI of its scheme."""

# RFC 3986's scheme, of two letters at least: ``C:`` is a drive, never a scheme
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+)://")
_STORES: dict[str, StoreFactory] = {}
_LOCAL = "file"
#: Stores of tabloader's own, by scheme: ``module:factory``, imported at the first URI of it.
BUILTIN_STORES = {"s3": "tabloader.catalog.storage._s3:open_s3"}


def _factory(scheme: str) -> StoreFactory | None:
    """The factory registered for ``scheme``, else the built-in one, else None."""
    factory = _STORES.get(scheme)
    if factory is None and scheme in BUILTIN_STORES:
        module, name = BUILTIN_STORES[scheme].split(":")
        factory = getattr(importlib.import_module(module), name)
    return factory


class LocalStore:
    """Part files in a local directory, opened as the catalog wrote them: a regular file,
    never through a symbolic link, of its recorded size
    (``tabloader.catalog._directory.open_file``), then by Arrow through ``/proc/self/fd`` (the file
    checked, not whatever the path names by then).

    Args:
        root: the directory (a catalog's).
        uri: how it was named (default: ``root`` as a string).
    """

    def __init__(self, root: Path, uri: str | None = None) -> None:
        self.root = root
        self.uri = str(root) if uri is None else uri

    def locate(self, name: str) -> str:
        return str(self.root / name)

    def open_part(self, name: str, *, size: int, what: str, memory_map: bool) -> pa.NativeFile:
        path = self.root / name
        fd = open_file(path, what=what, size=size)
        try:
            opened = opened_path(fd, path)
            return pa.memory_map(opened, "r") if memory_map else pa.OSFile(opened)
        finally:
            os.close(fd)  # Arrow opened the same file again


def register_store(scheme: str, factory: StoreFactory) -> None:
    """Read URIs ``scheme://…`` through ``factory(uri)`` in this process (replacing what was
    registered for ``scheme``).

    Raises:
        CatalogError: ``scheme`` is not a URI scheme of two characters or more, or is
            ``file`` (local files are built in), or ``factory`` is not callable.
    """
    if not _SCHEME.fullmatch(f"{scheme}://"):
        raise CatalogError(
            f"{scheme!r} is not a URI scheme; give letters, digits, '+', '-' or '.', starting "
            "with a letter, two characters at least (e.g. 's3')."
        )
    if not callable(factory):
        raise CatalogError(
            f"The store factory for {scheme!r} is {factory!r}, not callable; give a function "
            "(or class) that takes a URI and returns the store."
        )
    if scheme.lower() == _LOCAL:
        raise CatalogError(
            "The 'file' scheme is local files, built in; register your store under a scheme "
            "of its own."
        )
    _STORES[scheme.lower()] = factory


def unregister_store(scheme: str) -> None:
    """Forget the store registered for ``scheme`` (nothing if none is)."""
    _STORES.pop(scheme.lower(), None)


def store_factory(uri: str | os.PathLike[str]) -> StoreFactory | None:
    """The factory registered for ``uri``'s scheme; None for local files. (The decode
    processes get it pickled, by its qualified name, beside a reader's spec: a store
    registered at its module's import is then registered in them too.)"""
    if not isinstance(uri, str) or (m := _SCHEME.match(uri)) is None:
        return None
    return _factory(m.group(1).lower())


def open_store(uri: str | os.PathLike[str]) -> Store:
    """The store of ``uri``: a local path or ``file://`` URI, or a URI of a registered scheme.

    Raises:
        StorageError: no store is registered for its scheme, with the fix.
    """
    if not isinstance(uri, str):
        return LocalStore(Path(uri))
    m = _SCHEME.match(uri)
    if m is None:
        return LocalStore(Path(uri))
    scheme = m.group(1).lower()
    if scheme == _LOCAL:
        return LocalStore(_file_path(uri), uri)
    factory = _factory(scheme)
    if factory is None:
        known = ", ".join(sorted({_LOCAL, *_STORES, *BUILTIN_STORES}))
        raise StorageError(
            f"No store reads {scheme}:// URIs ({uri!r}; known: {known}). Register one in every "
            "process that reads it with tabloader.catalog.storage.register_store("
            f"{scheme!r}, factory), "
            f"or unset ${STORAGE_ENV} to read the catalog's own files.",
            path=uri,
        )
    return factory(uri)


def _file_path(uri: str) -> Path:
    """The local path of a ``file://`` URI: ``file:///path`` or ``file://localhost/path``.

    Raises:
        StorageError: it names another host (this machine's files are all a file URI reads).
    """
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost"):
        raise StorageError(
            f"File URI {uri!r} names host {parts.netloc!r}, but file:// reads this machine's "
            f"files only: give file:///path (three slashes; file://{parts.netloc}/... is not "
            f"the path /{parts.netloc}/...), a plain path, or mount that host's files here.",
            path=uri,
        )
    return Path(unquote(parts.path))


def storage_uri(root: Path) -> str | Path:
    """The root the parts of the catalog at ``root`` are read from: ``$TABLOADER_STORAGE``
    where set (a copy of the catalog's ``data/`` folder lies under it), else ``root``. A
    relative path there means one in the working directory of the process that reads the
    variable (it is made absolute here: the URI travels to other processes, a service runs
    in ``/``)."""
    uri = os.environ.get(STORAGE_ENV)
    if not uri:
        return root
    return uri if _SCHEME.match(uri) else Path(uri).absolute()
