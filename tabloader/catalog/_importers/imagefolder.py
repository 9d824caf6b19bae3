"""Image folder source: ``root/<class>/<file>`` as ``image``, ``label``, ``label_name``, ``path``.

The layout is torchvision's ``ImageFolder``: every non-hidden sub-folder of ``root`` is a class,
labelled by its index in sorted order, and every image file below it (at any depth) belongs to
that class. Rows come in sorted order (class, then relative path), so two imports of one folder
store the same rows in the same order.

Listing is cheap, so ``num_rows`` is known up front; file contents are read one batch at a time
(bounded memory) and stored as they are. Nothing is decoded or re-encoded here: keeping the
original bytes is what makes the import fast and lossless, and a corrupt image is reported when it
is decoded later (``RowReadError``), not at import.

Decisions on unusual layouts:

- Hidden files and folders (name starting with ``.``) are skipped at every depth.
- Files whose extension is not in ``extensions`` (compared case-insensitively) are skipped.
- Image files directly in ``root`` belong to no class. They are an error, with or without class
  folders: a flat folder of images has no labels to import, and silently dropping files would
  make the row count wrong.
- A class folder without images keeps its label index (so labels match across folders that share
  class names, e.g. train/ and val/) and is logged.
- A symbolic link (a class folder, a sub-folder or a file) is followed only if it resolves inside
  ``root``; one that leads out is an error naming it, unless ``follow_links=True``. A folder link
  to a folder that contains it is an error (it would be listed endlessly). Each file is checked
  again when it is read, so a file swapped for a link during the import is refused too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from tabloader.catalog._arrays import from_values
from tabloader.catalog._errors import ImportFailedError
from tabloader.catalog._importers import Source, check_folder, check_inside, read_regular_file

logger = logging.getLogger(__name__)

DEFAULT_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")

SCHEMA = pa.schema(
    [
        pa.field("image", pa.binary()),
        pa.field("label", pa.int64()),
        pa.field("label_name", pa.string()),
        pa.field("path", pa.string()),
    ]
)


def open_imagefolder(
    root: str | os.PathLike[str],
    *,
    extensions: Iterable[str] = DEFAULT_EXTENSIONS,
    batch_size: int = 64,
    follow_links: bool = False,
) -> Source:
    """Open an image folder ``root/<class>/<file>`` as a streaming ``Source``.

    Args:
        root: the folder whose sub-folders are the classes.
        extensions: file extensions to import, with or without the dot, any case.
        batch_size: rows (files) per record batch.
        follow_links: follow symbolic links that lead out of ``root`` (refused by default).

    Returns:
        A source with columns ``image`` (the raw file bytes), ``label`` (index of the class
        folder in sorted order), ``label_name`` (the class folder name) and ``path`` (relative to
        ``root``, with ``/``); ``class_names["label"]`` lists the class folders.

    Raises:
        ImportFailedError: ``root`` is missing, not a folder, empty, has no class folders, has
            images directly in it, or has no image with one of ``extensions``; a symbolic link
            leads out of it; or a file cannot be read during the import.

    Example:
        >>> import tempfile, pathlib
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> (root / "cat").mkdir(); _ = (root / "cat" / "a.jpg").write_bytes(b"...")
        >>> src = open_imagefolder(root)
        >>> src.num_rows, src.class_names, next(src.batches).column("path").to_pylist()
        (1, {'label': ['cat']}, ['cat/a.jpg'])
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ImportFailedError(f"batch_size must be a positive integer, not {batch_size!r}.")
    exts = _normalize_extensions(extensions)
    base = Path(root)
    check_folder(base, root, "; FORMAT imagefolder needs a folder laid out as root/<class>/<file>.")
    classes = _class_folders(base, root, exts, follow_links)
    files: list[tuple[int, str]] = []
    for label, name in enumerate(classes):
        found = _list_class(base, name, exts, follow_links)
        if not found:
            logger.info(
                "class folder %s/%s has no images; its label %d stays unused", base, name, label
            )
        files.extend((label, rel) for rel in found)
    if not files:
        raise ImportFailedError(
            f"No image files with extension {', '.join(sorted(exts))} in the class folders of "
            f"'{root}' ({_shown(classes)}). Check the folder, or pass extensions=."
        )
    logger.info("found %d images in %d classes under %s", len(files), len(classes), base)
    return Source(
        SCHEMA,
        _batches(base, classes, files, batch_size, follow_links),
        num_rows=len(files),
        class_names={"label": classes},
        description=str(root),
    )


def _class_folders(
    base: Path, root: str | os.PathLike[str], exts: frozenset[str], follow_links: bool
) -> list[str]:
    """The class folders of the image folder ``base`` (``root`` as given), sorted.

    Raises:
        ImportFailedError: it is empty, has images directly in it or no class folders, or a
            symbolic link leads out of it.
    """
    entries = sorted(p for p in base.iterdir() if not p.name.startswith("."))
    if not entries:
        raise ImportFailedError(
            f"The folder '{root}' is empty; put images in root/<class>/<file> before importing."
        )
    for p in entries:  # the links that would be read: class folders (and loose images)
        if p.is_symlink() and (p.is_dir() or p.suffix.lower() in exts):
            check_inside(p, base, follow_links=follow_links)
    classes = [p.name for p in entries if p.is_dir()]
    loose = [p.name for p in entries if p.is_file() and p.suffix.lower() in exts]
    if loose:
        shown = ", ".join(loose[:3]) + (", ..." if len(loose) > 3 else "")
        where = (
            f"besides the class folders {_shown(classes)}" if classes else "and no class folders"
        )
        raise ImportFailedError(
            f"'{root}' has {len(loose)} image file(s) directly in it ({shown}) {where}; an image "
            "folder must be root/<class>/<file>, the class folder giving the label. Move the "
            "images into class folders (one folder, e.g. root/all/, if they have no class)."
        )
    if not classes:
        raise ImportFailedError(
            f"'{root}' has no class folders (found only {_shown([p.name for p in entries])}); an "
            "image folder must be root/<class>/<file>. Pass the folder that holds the class "
            "folders."
        )
    return classes


def _normalize_extensions(extensions: Iterable[str]) -> frozenset[str]:
    if isinstance(extensions, str):
        extensions = [extensions]
    exts = frozenset(
        (e if e.startswith(".") else f".{e}").lower()
        for e in extensions
        if isinstance(e, str) and e
    )
    if not exts:
        raise ImportFailedError(
            f"extensions={extensions!r} names no file extension; pass e.g. ('.jpg', '.png')."
        )
    return exts


def _shown(names: list[str]) -> str:
    return ", ".join(f"'{n}'" for n in names[:3]) + (", ..." if len(names) > 3 else "")


def _list_class(base: Path, name: str, exts: frozenset[str], follow_links: bool) -> list[str]:
    """Relative posix paths of the image files under ``base/name``, sorted, hidden ones skipped.

    Folder links are followed (once ``check_inside`` allows them), except into a folder that
    contains them.
    """
    found: list[tuple[tuple[str, ...], str]] = []
    real_base = os.path.realpath(base)
    pending: list[tuple[Path, tuple[str, ...]]] = [
        (base / name, (real_base, os.path.realpath(base / name)))
    ]
    while pending:
        folder, ancestors = pending.pop()
        with os.scandir(folder) as it:
            children = [e for e in it if not e.name.startswith(".")]
        for entry in children:
            path = folder / entry.name
            image = os.path.splitext(entry.name)[1].lower() in exts
            if entry.is_symlink() and (image or entry.is_dir()):  # a link that would be read
                real = str(check_inside(path, base, follow_links=follow_links))
                if entry.is_dir() and real in ancestors:
                    raise ImportFailedError(
                        f"'{path}' is a symbolic link to '{real}', a folder that contains it, so "
                        "the folder would be listed endlessly; remove the link."
                    )
            if entry.is_dir():
                pending.append((path, (*ancestors, os.path.realpath(path))))
            elif image:
                rel = path.relative_to(base)
                found.append((rel.parts, rel.as_posix()))
    found.sort()
    return [rel for _, rel in found]


def _batches(
    base: Path,
    classes: list[str],
    files: list[tuple[int, str]],
    batch_size: int,
    follow_links: bool,
) -> Iterator[pa.RecordBatch]:
    for start in range(0, len(files), batch_size):
        chunk = files[start : start + batch_size]
        images = []
        for _, rel in chunk:
            # Checked again as it is read: the folder may have changed since it was listed.
            real = check_inside(base / rel, base, follow_links=follow_links)
            images.append(read_regular_file(real, follow_links=follow_links))
        yield image_batch(images, [label for label, _ in chunk], classes, [r for _, r in chunk])


def image_batch(
    images: list[bytes], labels: list[int], classes: list[str], paths: list[str]
) -> pa.RecordBatch:
    """A record batch of ``SCHEMA``: each image's bytes, label, its class name and path."""
    values: list[Sequence[Any]] = [images, labels, [classes[label] for label in labels], paths]
    columns = [from_values(v, f.type) for v, f in zip(values, SCHEMA, strict=True)]
    return pa.RecordBatch.from_arrays(columns, schema=SCHEMA)
