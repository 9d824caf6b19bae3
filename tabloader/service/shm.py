"""Named shared-memory segments (``/dev/shm/tabloader-...``) for the arena of prepared values.

A segment is a file of a memory filesystem, mapped by every process that uses it: the owner
maps it read-write, decode processes write values into their slots, clients map it read-only.
We manage the files ourselves rather than with ``multiprocessing.shared_memory``: its resource
tracker unlinks a segment when *any* process that attached it exits (bpo-39959; ``track=False``
needs Python 3.13), and a segment must outlive its decode processes.

Names carry the owner's pid (``tabloader-<pid>-<tag>-<random>``), so a new owner finds and
removes what a killed one left (:func:`remove_stale`). The whole size is allocated when the
segment is made (``posix_fallocate``): a memory filesystem that is too small fails then, with
an error naming it, instead of killing the process with SIGBUS on a later write.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
from pathlib import Path

from catalog.errors import CacheError

__all__ = ["SHM_DIR", "Segment", "remove_stale", "shm_available"]

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^tabloader-(\d+)-[a-z]+-[0-9a-f]{8}$")


def shm_available() -> bool:
    """True where named segments can be made (Linux's ``/dev/shm``)."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class Segment:
    """One named segment, mapped into this process.

    Args:
        name: the segment's name (a file of ``/dev/shm``).
        size: its size in bytes.
        create: make it (mode 0600, the size allocated); else attach to an existing one.
        readonly: map it read-only (clients).

    Raises:
        CacheError: the segment cannot be made (memory filesystem full) or opened.
    """

    def __init__(self, name: str, size: int, *, create: bool, readonly: bool = False) -> None:
        self.name, self.size = name, size
        self.path = SHM_DIR / name
        flags = os.O_RDONLY if readonly else os.O_RDWR
        try:
            fd = os.open(self.path, flags | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        except OSError as exc:
            raise CacheError(
                f"Cannot {'create' if create else 'open'} shared memory {self.path}: "
                f"{exc.strerror}."
            ) from exc
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    os.unlink(self.path)
                    raise CacheError(
                        f"Cannot allocate {size} bytes of shared memory in {SHM_DIR} "
                        f"({exc.strerror}); free space there, or lower the cache size "
                        "(cache_bytes, $TABLOADER_CACHE_BYTES)."
                    ) from exc
            elif os.fstat(fd).st_size < size:
                raise CacheError(f"Shared memory {self.path} is smaller than {size} bytes.")
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            self.buf = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)

    @classmethod
    def new(cls, tag: str, size: int) -> Segment:
        """A new segment of this process, named ``tabloader-<pid>-<tag>-<random>``."""
        return cls(f"tabloader-{os.getpid()}-{tag}-{secrets.token_hex(4)}", size, create=True)

    def close(self) -> None:
        """Unmap (views of the buffer must be gone; a lingering export is left to the GC)."""
        with contextlib.suppress(BufferError):  # a view still exports it: unmapped by the GC
            self.buf.close()

    def unlink(self) -> None:
        """Remove the name (mappings stay valid until closed)."""
        self.path.unlink(missing_ok=True)


def remove_stale() -> list[str]:
    """Remove the segments of tabloader processes that no longer run; their names."""
    gone: list[str] = []
    if not shm_available():
        return gone
    for path in SHM_DIR.glob("tabloader-*"):
        m = _NAME.match(path.name)
        if m is None or process_alive(int(m.group(1))):
            continue
        try:
            if path.stat().st_uid != os.getuid():
                continue
            path.unlink()
        except OSError:
            continue
        gone.append(path.name)
        logger.info("removed shared memory %s of a process that is gone", path.name)
    return gone


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: a zombie (exited, not yet reaped by its parent, as a
    service killed under the client that started it) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): kill() said it exists
    return state not in (b"Z", b"X")
