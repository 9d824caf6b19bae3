"""Shared memory with no name: the arena of prepared values, in an unnamed file of ``/dev/shm``.

A segment is a file of the memory filesystem that was never linked into it (``O_TMPFILE``): nothing
in ``/dev/shm`` names it, so nothing is left to remove when its owner dies, even by SIGKILL (the OOM
killer's signal); the memory goes back to the system when the last process that maps it or holds its
descriptor is gone. Processes reach it by descriptor only: decode processes inherit one as they
start (:mod:`tabloader.engine._prepare.decoding`), clients receive a read-only one over the
service's authenticated socket (:mod:`tabloader.service._protocol`, ``SCM_RIGHTS``).

``/dev/shm`` rather than an anonymous ``memfd_create``: a memfd lives in the kernel's internal
memory filesystem, which has no size limit, so allocating a cache larger than the machine's
memory would wake the OOM killer instead of failing. In ``/dev/shm`` a segment is checked
against the filesystem's free space when it is made: one that is too small fails then, with an
error naming it, instead of killing the process with SIGBUS on a later write. The whole size is
then allocated (``posix_fallocate``) in a background thread of the lowest priority: zeroing
1 GiB takes 0.1-0.3 s of a core, which a service's first batch would otherwise wait for (pages
written meanwhile are allocated as they are touched). If that allocation fails (the filesystem
filled up in between), the failure is logged.

Layout and contract
-------------------
One segment per loader (the service's, or an in-process ``Loader`` decoding in processes)::

    0                                     capacity                      capacity + staging
    |<- the arena: slabs of slots ------->|<- staging blocks (service) ->|
         (engine._arena: arena, slabs)          (service._server)

* **Writers.** The loader's process owns the layout: only it decides what a byte range holds
  (the arena's ``reserve``/``put``/``publish``/``discard``; the service's staging blocks and
  staging runs). A decode process writes a value only into slots the loader *reserved* for
  exactly those rows and handed to it, before the loader *publishes* them; it never reads the
  arena and never writes anywhere else. Staging (ids and small columns of a batch handed to a
  client) is written by the service into a block (or an arena run) it took for that batch's
  ticket.
* **Readers** (the service's clients, mapping the segment read-only) may assume: every
  ``(offset, shape)`` in a batch reply is a published value (or the reply's own staging), and
  stays unchanged and in place until the client releases that reply's ticket: the slots are
  pinned (never evicted, never rewritten) and the staging is the ticket's alone. After the
  release nothing may be read from those offsets. Values are ``uint8`` arrays, C-contiguous,
  of the reply's shape.
* **Identity.** A client compares the segment's ``name`` with the one its service reports:
  a client of a dead service never reads a new service's memory.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import threading
from pathlib import Path

from tabloader.catalog._errors import CacheError

SHM_DIR = Path("/dev/shm")

logger = logging.getLogger(__name__)


def shm_available() -> bool:
    """True where unnamed segments can be made (Linux's ``/dev/shm``)."""
    return hasattr(os, "O_TMPFILE") and SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class Segment:
    """One segment, mapped into this process; see the module docstring.

    Made by :meth:`new` (its owner keeps the descriptor, to hand it on) or mapped from a
    descriptor received with :meth:`attach`. ``name`` tells segments apart (clients compare it
    with the service's); it names no file.
    """

    def __init__(self, fd: int, size: int, name: str, *, readonly: bool) -> None:
        self.name, self.size, self.fd = name, size, fd
        if os.fstat(fd).st_size < size:
            raise CacheError(f"Shared memory segment {name} is smaller than {size} bytes.")
        prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
        self.buf = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        self._allocating: threading.Thread | None = None  # ``new``'s, while it allocates
        self._stop_allocating = threading.Event()

    @classmethod
    def new(cls, tag: str, size: int) -> Segment:
        """A new segment of ``size`` bytes, named ``<tag>-<pid>-<random>``, allocated in the
        background (see the module docstring).

        Raises:
            CacheError: ``/dev/shm`` cannot hold it (or cannot be written).
        """
        try:
            fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise CacheError(f"Cannot create shared memory in {SHM_DIR}: {exc.strerror}.") from exc
        try:
            try:
                free = os.fstatvfs(fd)
                if size > free.f_bavail * free.f_frsize:
                    raise OSError(28, os.strerror(28))  # ENOSPC, as fallocate would say
                os.ftruncate(fd, size)
            except OSError as exc:
                raise CacheError(_no_room(size, exc.strerror)) from exc
            segment = cls(fd, size, f"{tag}-{os.getpid()}-{secrets.token_hex(4)}", readonly=False)
        except BaseException:
            os.close(fd)
            raise
        segment._allocating = threading.Thread(
            target=_allocate,
            args=(os.dup(fd), size, segment._stop_allocating),
            name="tabloader-shm-allocate",
            daemon=True,
        )
        segment._allocating.start()
        return segment

    @classmethod
    def attach(cls, fd: int, size: int, name: str = "", *, readonly: bool = False) -> Segment:
        """Map the segment of descriptor ``fd`` (received; closed here: the mapping is enough).

        Raises:
            CacheError: it is smaller than ``size``.
        """
        try:
            segment = cls(fd, size, name, readonly=readonly)
        finally:
            os.close(fd)
        segment.fd = -1
        return segment

    def readonly_fd(self) -> int:
        """A new read-only descriptor of this segment (for a client; the caller closes it)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        """Unmap (views of the buffer must be gone; a lingering export is left to the GC) and
        close the descriptor: the memory is freed once no other process maps it."""
        if self._allocating is not None:  # no thread of ours outlives the segment
            self._stop_allocating.set()
            self._allocating.join()
        with contextlib.suppress(BufferError):  # a view still exports it: unmapped by the GC
            self.buf.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _no_room(size: int, why: str | None) -> str:
    return (
        f"Cannot allocate {size} bytes of shared memory in {SHM_DIR} ({why}); free space "
        "there, or lower the cache size (cache_bytes, $TABLOADER_CACHE_BYTES)."
    )


ALLOCATE_CHUNK = 16 << 20
ALLOCATE_PAUSE_S = 0.01


def _allocate(fd: int, size: int, stop: threading.Event) -> None:
    """Allocate a new segment's pages (its own descriptor ``fd``, closed here), at the lowest
    priority (this thread only), ``ALLOCATE_CHUNK`` bytes at a time with a pause after each
    (``stop``: the segment closes first). Zeroing a 1 GiB cache in one call took the cores a
    cold service's first batch decodes on: 0.18-0.23 s to that batch instead of 0.10-0.16 s."""
    try:
        with contextlib.suppress(AttributeError, OSError):  # setpriority: Unix; a thread: Linux
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        for start in range(0, size, ALLOCATE_CHUNK):
            os.posix_fallocate(fd, start, min(ALLOCATE_CHUNK, size - start))
            if stop.wait(ALLOCATE_PAUSE_S):
                return
    except OSError as exc:
        logger.error(
            "%s Writes past the room left may crash (SIGBUS).", _no_room(size, exc.strerror)
        )
    finally:
        os.close(fd)


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
