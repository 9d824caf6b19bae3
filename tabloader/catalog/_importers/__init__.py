"""Importers: one module per source format, each turning a source into a streaming ``Source``.

An importer never writes anything: it opens its source and yields record batches. The catalog
(``tabloader.catalog._imports.Ingest``) numbers the rows, writes Arrow IPC, fills the DuckDB table
and commits atomically. ``IMPORTERS`` maps a ``FORMAT`` name of ``CREATE DATASET`` to the
function that opens such a source; ``detect_format`` guesses it from a path.
"""

from __future__ import annotations

import importlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from tabloader.catalog._errors import ImportFailedError

MAX_FILE_BYTES = 1 << 30
"""The largest file read whole into one value (an image): a bigger one is refused."""

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def check_folder(path: Path, shown: object, not_a_file: str) -> None:
    """Raise unless ``path`` (named ``shown`` in the message) is a folder; ``not_a_file``
    follows "'<path>' is a file" and says what to pass instead.

    Raises:
        ImportFailedError: ``path`` is missing or not a folder.
    """
    if not path.exists():
        raise ImportFailedError(f"No such directory: '{shown}'. Check the path.")
    if not path.is_dir():
        raise ImportFailedError(f"'{shown}' is a file{not_a_file}")


def _not_regular(path: Path, mode: int) -> ImportFailedError:
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return ImportFailedError(
        f"'{path}' is {kind}, not a regular file; imports read regular files only. Remove it, "
        "or give a path or glob that matches files only (e.g. '/data/*.parquet')."
    )


def check_regular_file(path: Path) -> int:
    """The size of ``path``, which must be a regular file (``stat``: never opens a FIFO).

    Raises:
        ImportFailedError: it is missing, or a directory, FIFO, device or socket.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ImportFailedError(
            f"Cannot read '{path}' ({exc.strerror or exc}). Check the path."
        ) from exc
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode)
    return st.st_size


FOLLOW_LINKS_FIX = (
    "Copy what it points to into the folder, or follow links on purpose with WITH "
    "(follow_links = true) (follow_links=True in Python, --follow-links on the command line)."
)


def check_inside(path: Path, root: Path, *, follow_links: bool) -> Path:
    """The real path of ``path``, a path below ``root``, which must stay inside ``root``.

    Imports read only what they were given: a symbolic link below ``root`` (to a file or a
    folder, at any depth) that resolves outside ``root`` is refused, unless ``follow_links``.
    ``root`` itself may be a link: the user named it.

    Raises:
        ImportFailedError: naming the link, its target and the fix.
    """
    real = Path(os.path.realpath(path))
    if follow_links or is_inside(real, root):
        return real
    link = path
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        parts = ()
    step = root
    for part in parts:  # the first link on the way that leads out names the culprit
        step = step / part
        if step.is_symlink() and not is_inside(step, root):
            link = step
            break
    raise ImportFailedError(
        f"'{link}' is a symbolic link to '{os.path.realpath(link)}', outside the imported "
        f"folder '{root}'; imports read only what they were given. {FOLLOW_LINKS_FIX}"
    )


def is_inside(path: Path, root: Path) -> bool:
    """Whether ``path`` resolves (links followed) to ``root`` or below it."""
    real, real_root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return real == real_root or real_root in real.parents


def read_regular_file(
    path: Path, *, max_bytes: int = MAX_FILE_BYTES, follow_links: bool = True
) -> bytes:
    """Read a regular file of at most ``max_bytes`` whole.

    It is opened non-blocking and checked with ``fstat`` before reading, so a FIFO (or a file
    swapped for one) is refused instead of blocking the import. Without ``follow_links`` a
    ``path`` that is a symbolic link (a file swapped for one after it was checked) is refused.

    Raises:
        ImportFailedError: not a regular file, larger than ``max_bytes``, or unreadable.
    """
    try:
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags if follow_links else flags | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ImportFailedError(
            f"Cannot read '{path}' ({exc.strerror or exc}); the folder changed during the "
            "import or the file is not readable. Fix it and import again."
        ) from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        if st.st_size > max_bytes:
            raise ImportFailedError(
                f"'{path}' is {st.st_size / 2**30:.1f} GiB, over the limit of "
                f"{max_bytes / 2**30:.1f} GiB for one file read whole (an image); remove it "
                "from the folder, or import it another way."
            )
        try:
            return f.read()
        except OSError as exc:
            raise ImportFailedError(
                f"Cannot read '{path}' ({exc.strerror or exc}); fix the file and import again."
            ) from exc


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
    "arrow": "tabloader.catalog._importers.arrow:open_ipc",
    "parquet": "tabloader.catalog._importers.parquet:open_parquet",
    "hf": "tabloader.catalog._importers.hf:open_hf",
    "imagefolder": "tabloader.catalog._importers.imagefolder:open_imagefolder",
}


#: Sources in object storage (``s3://bucket/prefix``), of any FORMAT it holds: "module:function".
REMOTE = "tabloader.catalog._importers.remote:open_remote"


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
    """Open ``source`` with the importer registered for ``fmt`` (a URI of object storage,
    ``s3://bucket/prefix``: with ``tabloader.catalog._importers.remote``)."""
    if isinstance(source, str) and "://" in source and not source.startswith("file://"):
        _importer(fmt)  # (an unknown format: the same error)
        module, func = REMOTE.split(":")
        return getattr(importlib.import_module(module), func)(fmt, source, **options)  # type: ignore[no-any-return]
    return _importer(fmt)(source, **options)


def detect_format(path: str | Path) -> str:
    """Guess the FORMAT of a path: a directory of class folders, HF, Parquet or Arrow IPC."""
    p = Path(path)
    text = str(path)
    if "://" in text and not text.startswith("file://"):  # object storage: by extension only
        for fmt, exts in (("parquet", (".parquet", ".pq")), ("arrow", (".arrow", ".feather"))):
            if text.lower().endswith(exts):
                return fmt
        raise ImportFailedError(
            f"Cannot tell the format of '{path}'; add FORMAT imagefolder|parquet|arrow."
        )
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
