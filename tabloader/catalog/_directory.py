"""The catalog directory: where it is, its layout, atomic file writes, and the upkeep done at
open.

::

    catalog.duckdb               the DuckDB database (``tabloader.catalog._database``)
    data/<dataset>/part-*.arrow  the rows, in Arrow IPC file format (``tabloader.catalog.storage``)
    jobs/<job>-<token>.roaring   a job's row ids (``tabloader.catalog._job_bitmaps``)
    jobs/<job>-<token>.weights   a weighted job's row weights (``tabloader.catalog._job_weights``)

Permissions: what tabloader creates in a catalog is private to its owner, whatever the umask,
like the service's ``.service`` folder: folders 0700 (``make_private_dir``; the catalog
directory itself when tabloader creates it), files 0600 (``FILE_MODE``: the DuckDB file, data
files, bitmaps). Modes of what exists already are left as they are: a catalog its owner made
group-readable (``chmod -R g+rX``) stays so, but files written later are 0600 again.

Dataset and job names (``NAME_RE``) name folders and files. At open, files that no committed
row references (leftovers of an interrupted import or job) are deleted (``collect_garbage``),
and a catalog of an older tabloader is upgraded (``migrate``). Only files named as tabloader
names them are ever deleted, and a new catalog is not created in a directory whose ``data/``
or ``jobs/`` folder already holds files. A process opens a directory once (``claim_root``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import threading
import uuid
import weakref
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tabloader.catalog._errors import CatalogError, CatalogLockedError, StorageError

if TYPE_CHECKING:  # a job process resolves a catalog's path without DuckDB (0.1 s to import)
    from tabloader.catalog._database import Database

logger = logging.getLogger(__name__)

ENV_VAR = "TABLOADER_CATALOG"  # the default catalog directory
DB_FILE = "catalog.duckdb"
FILE_MODE = 0o600  # every file tabloader creates in a catalog (see the module docstring)
DIR_MODE = 0o700  # every folder
DATA_DIR = "data"
JOBS_DIR = "jobs"
NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,62}")  # a dataset's or a job's
# The names of the files tabloader writes, each made unique by a token (``new_token``).
# Garbage collection deletes nothing else: a catalog directory may hold other files.
PART_FILE_RE = re.compile(r"(part-v\d{5,}|\.tmp)-[0-9a-f]{12}\.arrow")
JOB_FILE_RE = re.compile(rf"(\.tmp-)?{NAME_RE.pattern}-[0-9a-f]{{12}}\.(roaring|weights)")

# The catalogs this process has open, by resolved root (a collected Catalog frees its root).
_OPEN_ROOTS: weakref.WeakValueDictionary[Path, Any] = weakref.WeakValueDictionary()
_OPEN_LOCK = threading.Lock()


def default_root() -> Path:
    """The default catalog: ``$TABLOADER_CATALOG``, else ``$XDG_DATA_HOME/tabloader/catalog``
    (``~/.local/share/tabloader/catalog``): one place, whatever the working directory, and
    never a source folder."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).absolute()
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return (Path(data) / "tabloader" / "catalog").absolute()


def resolve_root(path: str | os.PathLike[str] | None) -> Path:
    """The absolute catalog directory for ``path`` (None: ``default_root()``)."""
    return Path(path).absolute() if path else default_root()


def claim_root(root: Path, owner: object) -> Path:
    """Record that ``owner`` (a ``Catalog``) has ``root`` open; returns the key to release.

    A root this process has open already is refused: the two would not see each other. The
    first would serve stale cached metadata after the second changes the catalog, and the
    second's cleanup at open would delete the first's unfinished import.

    Raises:
        CatalogLockedError: another ``Catalog`` of this process has ``root`` open.
    """
    key = root.resolve()
    with _OPEN_LOCK:
        if _OPEN_ROOTS.get(key) is not None:
            raise CatalogLockedError(
                f"Catalog '{root}' is open already in this process. Reuse that "
                "Catalog object (pass it as catalog= to Loader or JobDataset), or close() "
                "it before opening the catalog again."
            )
        _OPEN_ROOTS[key] = owner
    return key


def is_open(root: Path) -> bool:
    """Whether a ``Catalog`` of this process has ``root`` open."""
    with _OPEN_LOCK:
        return _OPEN_ROOTS.get(root.resolve()) is not None


def release_root(key: Path, owner: object) -> None:
    """``owner`` closed the root it claimed as ``key`` (no-op if it holds none)."""
    with _OPEN_LOCK:
        if _OPEN_ROOTS.get(key) is owner:
            del _OPEN_ROOTS[key]


def weights_path(bitmap: str) -> str:
    """The weights file of the job whose bitmap file is ``bitmap`` (both relative to the
    catalog directory): the same name and token, so the row names both."""
    return bitmap.removesuffix(".roaring") + ".weights"


def check_name(name: str, kind: str) -> None:
    """Refuse a new dataset or job (``kind``) name that is not a letter followed by letters,
    digits or underscores (at most 63 characters).

    Raises:
        CatalogError: it is not.
    """
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise CatalogError(
            f"Invalid {kind} name {name!r}: use a letter followed by letters, digits or "
            "underscores (at most 63 characters)."
        )


def not_a_catalog(root: Path) -> CatalogError:
    """The error for a read of a directory that holds no catalog."""
    where = "does not exist" if not root.exists() else f"has no {DB_FILE}"
    return CatalogError(
        f"'{root}' is not a tabloader catalog (it {where}). Give the catalog's directory "
        f"(--catalog DIR or ${ENV_VAR}), or create one there by importing data: tabloader "
        f"--catalog {root} import NAME PATH, CREATE DATASET name FROM 'path', or "
        f"catalog.open_catalog('{root}', create=True)."
    )


def not_writable(*paths: Path) -> str | None:
    """Why this process may not write the first of ``paths`` it cannot (a read-only file
    system, or no permission), or None if it may write them all (those that exist)."""
    for path in paths:
        if path.exists() and not os.access(path, os.W_OK):
            if os.statvfs(path).f_flag & os.ST_RDONLY:
                return f"'{path}' is on a read-only file system"
            return f"this user may not write '{path}'"
    return None


def new_token() -> str:
    """The unique part of the name of a file tabloader writes (see ``PART_FILE_RE``)."""
    return uuid.uuid4().hex[:12]


def make_private_dir(path: Path) -> None:
    """Create folder ``path`` (and its parents) if missing, ``DIR_MODE`` whatever the umask;
    a folder that exists keeps its mode."""
    if path.is_dir():
        return
    try:
        path.mkdir(DIR_MODE, parents=True)
    except FileExistsError:
        if path.is_dir():  # made meanwhile: not ours to chmod
            return
        raise
    os.chmod(path, DIR_MODE)  # mkdir's mode goes through the umask


def write_file(path: Path, data: bytes) -> None:
    """Write ``path`` (``FILE_MODE``) through a temp file renamed into place (readers never
    see half a file)."""
    tmp = path.with_name(f".tmp-{path.name}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        with os.fdopen(os.open(tmp, flags, FILE_MODE), "wb") as f:
            os.fchmod(f.fileno(), FILE_MODE)  # open's mode goes through the umask
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


def open_file(
    path: Path, *, what: str, size: int | None = None, max_bytes: int | None = None
) -> int:
    """Open a file the catalog recorded (a data file, a bitmap, a leader record) to read it,
    as the catalog wrote it: a regular file, never through a symbolic link, of ``size`` bytes
    (where the catalog recorded the size) or at most ``max_bytes``. It is opened without
    blocking and checked with ``fstat`` before any read, so a FIFO or a link to ``/dev/zero``
    put in its place is refused at once instead of blocking or reading for ever.

    Args:
        path: the file.
        what: the file as the error names it ("Data file 'x' of dataset 'd'").
        size: its recorded size, if any.
        max_bytes: the most it can hold, where no size is recorded.

    Returns:
        A descriptor open for reading (the caller closes it).

    Raises:
        FileNotFoundError, OSError: it cannot be opened (missing, no permission).
        StorageError: it is a link, not a regular file, or of another size; the message
            says which (the caller adds the fix).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        target = ""
        with contextlib.suppress(OSError):
            target = f" (to '{os.readlink(path)}')"
        raise StorageError(
            f"{what} is a symbolic link{target}; catalog files are never read through links.",
            path=str(path),
        ) from None
    try:
        st = os.fstat(fd)
        kind = stat.S_IFMT(st.st_mode)
        if kind != stat.S_IFREG:
            raise StorageError(
                f"{what} is {_KINDS.get(kind, 'not a regular file')}, not a regular file.",
                path=str(path),
            )
        if size is not None and st.st_size != size:
            raise StorageError(
                f"{what} has {st.st_size} bytes, expected {size} (truncated or replaced).",
                path=str(path),
            )
        if max_bytes is not None and st.st_size > max_bytes:
            raise StorageError(
                f"{what} has {st.st_size} bytes, more than the {max_bytes} it can hold.",
                path=str(path),
            )
    except BaseException:
        os.close(fd)
        raise
    os.set_blocking(fd, True)  # a regular file: reads never block anyway
    return fd


def opened_path(fd: int, path: Path) -> str:
    """A path that opens the file behind ``fd`` itself (``/proc/self/fd/N``), for libraries
    that open by path (Arrow): not whatever ``path`` names by then; ``path`` where there is
    no ``/proc``."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else str(path)


def read_file(
    path: Path, *, what: str, size: int | None = None, max_bytes: int | None = None
) -> bytes:
    """The whole of a file the catalog recorded, checked as ``open_file`` checks it.

    Raises:
        FileNotFoundError, OSError, StorageError: as ``open_file``.
    """
    fd = open_file(path, what=what, size=size, max_bytes=max_bytes)
    with os.fdopen(fd, "rb") as f:
        limit = size if size is not None else max_bytes
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:  # it grew since fstat
        raise StorageError(f"{what} grew while it was read.", path=str(path))
    return data


def check_new_root(root: Path) -> None:
    """Refuse to create a catalog where ``data/`` or ``jobs/`` hold files of someone else."""
    for folder in (DATA_DIR, JOBS_DIR):
        path = root / folder
        if path.is_dir() and any(path.iterdir()):
            raise CatalogError(
                f"'{root}' is not a tabloader catalog: it has no {DB_FILE}, but its "
                f"{folder}/ folder already holds files. Pick an empty or new directory for "
                "the catalog."
            )


def collect_garbage(root: Path, db: Database) -> None:
    """Delete files that no committed row references (leftovers of interrupted imports).

    Only files named as tabloader names them (``PART_FILE_RE``, ``JOB_FILE_RE``) are
    deleted; anything else in ``data/`` or ``jobs/`` is left alone.
    """
    from tabloader.catalog._database import META

    parts = {row[0] for row in db.con.execute(f"SELECT path FROM {META}.parts").fetchall()}
    for folder in (root / DATA_DIR).iterdir():
        if folder.is_dir() and not folder.is_symlink():
            remove_leftovers(root, folder, PART_FILE_RE, parts)
            # A killed import may leave its folder empty; a dataset's folder never is.
            with contextlib.suppress(OSError):  # not empty: it holds other files
                folder.rmdir()
    jobs = {row[0] for row in db.con.execute(f"SELECT bitmap FROM {META}.jobs").fetchall()}
    remove_leftovers(root, root / JOBS_DIR, JOB_FILE_RE, jobs | {weights_path(b) for b in jobs})


def remove_leftovers(root: Path, folder: Path, pattern: re.Pattern[str], keep: set[str]) -> int:
    """Delete the files in ``folder`` named like ``pattern`` but not in ``keep``; count them.

    ``keep`` holds paths relative to the catalog directory ``root``.
    """
    removed = 0
    for f in folder.iterdir():
        rel = f.relative_to(root).as_posix()
        if pattern.fullmatch(f.name) and f.is_file() and rel not in keep:
            logger.info("removing leftover file %s of an interrupted import or job", f)
            f.unlink()
            removed += 1
    return removed


def migrate(root: Path, db: Database) -> None:
    """Upgrade a catalog of an older tabloader in place (each step is a no-op when done)."""
    _move_bitmaps_to_files(root, db)
    for table, column, sql_type, reader in _ADDED_COLUMNS:
        _add_column(db, table, column, sql_type, reader)


_ADDED_COLUMNS = (
    # tabloader <= 0.2: jobs had no weights (``weights_crc32``: NULL for each of them)
    ("jobs", "weights_crc32", "BIGINT", "weights_column"),
    # datasets all lay in the catalog directory (``storage``: NULL for each)
    ("datasets", "storage", "VARCHAR", "storage_column"),
)
"""The columns later tabloaders added: (table, column, its SQL type, the ``Database``
attribute that reads it)."""


def _add_column(db: Database, table: str, column: str, sql_type: str, reader: str) -> None:
    """Upgrade a catalog whose ``table`` lacks ``column`` (NULL for each row). A catalog opened
    read-only is left as it is: ``Database`` reads NULL in its place (its attribute
    ``reader``: ``Database.weights_column``, ``Database.storage_column``)."""
    from tabloader.catalog._database import META

    columns = db.con.execute(
        "SELECT column_name FROM information_schema.columns "
        f"WHERE table_schema = '{META}' AND table_name = '{table}'"
    ).fetchall()
    if (column,) in columns:
        return
    if db.read_only is not None:
        setattr(db, reader, "NULL")
        return
    db.con.execute(f"ALTER TABLE {META}.{table} ADD COLUMN {column} {sql_type}")


def _move_bitmaps_to_files(root: Path, db: Database) -> None:
    """Upgrade a catalog of tabloader <= 0.1.0, whose ``jobs`` table held the bitmaps."""
    from tabloader.catalog._database import META

    con = db.con
    columns = con.execute(
        "SELECT column_name FROM information_schema.columns "
        f"WHERE table_schema = '{META}' AND table_name = 'jobs'"
    ).fetchall()
    if ("ids",) not in columns:
        return
    db.check_writable(f"Upgrading catalog '{root}' (written by tabloader <= 0.1.0)")
    rows = con.execute(f"SELECT name, ids FROM {META}.jobs").fetchall()
    paths = {name: f"{JOBS_DIR}/{name}-{new_token()}.roaring" for name, _ in rows}
    for name, ids in rows:
        write_file(root / paths[name], ids)
    with db.transaction():
        con.execute(f"ALTER TABLE {META}.jobs ADD COLUMN bitmap VARCHAR")
        con.execute(f"ALTER TABLE {META}.jobs ADD COLUMN crc32 BIGINT")
        for name, ids in rows:
            con.execute(
                f"UPDATE {META}.jobs SET bitmap = ?, crc32 = ? WHERE name = ?",
                [paths[name], zlib.crc32(ids), name],
            )
        con.execute(f"ALTER TABLE {META}.jobs DROP COLUMN ids")
    logger.info("moved the bitmaps of %d job(s) to %s/", len(rows), JOBS_DIR)
