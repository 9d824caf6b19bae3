"""Many processes, one catalog, no service: they take turns, and wait a bounded time.

DuckDB lets one process at a time open a database file for writing, and a catalog is one
file. While a script's ``tabloader.connect()``, a CLI statement or an import holds it, a second
process cannot open it; such holds are short (a statement), so the second one waits instead of
failing: ``tabloader.connect`` (and so the CLI) and a loader service that starts.

**Turns.** A process that opens a writable catalog itself first takes the catalog's *turn*, an
exclusive ``flock`` on ``runtime_dir/turn`` (:class:`Turn`), and keeps it while the catalog
is open (the kernel drops it when the process dies). The others poll the turn, a system call,
every 5-30 ms, instead of trying DuckDB's open (7 ms of a core each, on the cores the holder's
statement needs): sixteen processes that connect at once cost the holder nothing and start
within milliseconds of each other's close. Only the process that has the turn tries DuckDB; a
holder that took no turn (``catalog.open_catalog``, the ``duckdb`` CLI, a service stopping)
is polled through DuckDB with a jittered backoff from 10 ms to 250 ms. A read-only catalog
takes no turn: DuckDB lets its readers in side by side.

**A service.** While a service holds the service lock (:func:`~tabloader.service._protocol.
service_pid`) the catalog is its own: clients wait for its socket and go through it, and take
no turn, so a service that starts (and waits for the catalog itself, :func:`open_catalog`)
never waits for clients that keep taking the catalog in turn.

**The bound.** Waiting ends with ``CatalogLockedError`` once one process has held the catalog
(or the turn, or a service its lock without answering) for ``lock_wait`` seconds
(``$TABLOADER_LOCK_WAIT``, default 60: a statement runs for at most ``statement_timeout``, 60 s
by default). The clock starts again when the holder changes: processes taking turns are
progress, however many there are; one that holds on is not. The error names the holder (pid
and command line) and the ways out.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import time
import weakref
from pathlib import Path

from tabloader import catalog
from tabloader.catalog._directory import DB_FILE, not_writable
from tabloader.catalog._errors import CatalogLockedError, ServiceError
from tabloader.catalog._settings import setting
from tabloader.service._protocol import runtime_dir

logger = logging.getLogger(__name__)

TURN_FILE = "turn"
CHEAP_PAUSE_S = (0.005, 0.03)  # between polls of a lock or a socket (a system call)
FIRST_PAUSE_S, MAX_PAUSE_S = 0.01, 0.25  # between tries of DuckDB's open (7 ms of a core)


def describe_process(pid: int | None) -> str:
    """``pid 12 (`python train.py`)``: a process by its pid and command line (cut at 120
    characters), as far as ``/proc`` tells; ``an unknown process`` without a pid."""
    if not pid:
        return "an unknown process"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(1 << 12).rstrip(b"\0").split(b"\0")
    except OSError:
        return f"pid {pid}"
    line = " ".join(" ".join(a.decode(errors="replace") for a in argv).split())
    return f"pid {pid} (`{line[:117]}...`)" if len(line) > 120 else f"pid {pid} (`{line}`)"


class Turn:
    """This process's turn at a catalog that no service holds (see the module).

    Args:
        root: the catalog directory.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fd: int | None = None
        self._closer: weakref.finalize[[int], Turn] | None = None  # collected unreleased
        self._held = False
        # no catalog yet (its first import creates it: no folder is made in a directory that
        # may be a mistyped path), a read-only one (readers go in side by side), or no folder
        # for the turn: DuckDB decides alone
        db = root / DB_FILE
        self._none = not db.is_file() or not_writable(root, db) is not None

    def take(self) -> int | None:
        """Take the turn: None when this process has it (or there is none to take), else the
        pid of the process that has it (0: unknown)."""
        if self._held or self._none:
            return None
        if self._fd is None:
            try:
                self._fd = os.open(
                    runtime_dir(self.root) / TURN_FILE,
                    os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                    0o600,
                )
            except (OSError, ServiceError):  # not a directory yet (created by the open)
                self._none = True
                return None
            self._closer = weakref.finalize(self, os.close, self._fd)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(self._fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        self._held = True
        _HELD.add(self)
        return None

    def _forget_in_child(self) -> None:
        """In a child forked while this turn is held: close the child's copy of the file,
        which shares the parent's lock (unlocking would drop the parent's)."""
        if self._closer is not None:
            self._closer.detach()
            self._closer = None
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._held = None, False

    def release(self) -> None:
        """Give the turn up (idempotent)."""
        closer, self._closer, self._fd, self._held = self._closer, None, None, False
        _HELD.discard(self)
        if closer is not None:
            closer()  # closes the file: the lock goes with it


_HELD: weakref.WeakSet[Turn] = weakref.WeakSet()  # the turns this process holds


def _after_fork_in_child() -> None:
    """A forked child does not hold its parent's turns (it never opened the catalog): it
    closes its copies of their files, so the turn goes when the parent releases it."""
    for turn in list(_HELD):
        turn._forget_in_child()
    _HELD.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class LockWait:
    """The pauses between tries to open a catalog another process holds, and the error once
    one process has held it for ``seconds`` (see the module).

    Args:
        root: the catalog directory.
        seconds: the longest one holder is waited for (default: the ``lock_wait`` setting).
    """

    def __init__(self, root: Path, seconds: float | None = None) -> None:
        self.root = root
        self.seconds = float(setting("lock_wait") if seconds is None else seconds)
        self._holder: tuple[int | None, bool] | None = None
        self._since = time.monotonic()
        self._next = FIRST_PAUSE_S
        self._random = random.Random()

    def pause(self, pid: int | None, *, service: bool = False, cheap: bool = False) -> None:
        """Sleep before the next try, which process ``pid`` kept from succeeding (None:
        unknown); ``service``: it is the catalog's service, which holds its service lock but
        does not answer yet; ``cheap``: the next try is a system call, not DuckDB's open.

        Raises:
            CatalogLockedError: that process has held the catalog for ``seconds``; names it
                and the ways out.
        """
        now = time.monotonic()
        if (pid, service) != self._holder:  # another holder: progress, the clock starts again
            self._holder, self._since = (pid, service), now
        if now - self._since >= self.seconds:
            raise self._expired(pid, service)
        if cheap:
            pause = self._random.uniform(*CHEAP_PAUSE_S)
        else:
            pause = self._next * self._random.uniform(0.5, 1.0)
            self._next = min(MAX_PAUSE_S, self._next * 1.5)
        time.sleep(min(pause, self._since + self.seconds - now))

    def _expired(self, pid: int | None, service: bool) -> CatalogLockedError:
        root, waited = self.root, f"{self.seconds:g} s"
        holder = describe_process(pid)
        if service:
            return CatalogLockedError(
                f"Catalog '{root}': its loader service, {holder}, has held the service lock "
                f"for {waited} without answering ($TABLOADER_LOCK_WAIT); see "
                f"{runtime_dir(root, create=False) / 'service.log'}. If it is still starting, "
                f"try again; else end it (`kill {pid}`).",
                pid=pid,
            )
        return CatalogLockedError(
            f"Catalog '{root}' is held by {holder}, which did not let it go within {waited} "
            "($TABLOADER_LOCK_WAIT). DuckDB lets one process at a time open a catalog, and a "
            "tabloader.connect() or catalog.open_catalog() holds it until close(): close it "
            "there (or end that process), or let a loader service hold it for every process "
            f"(`tabloader --catalog {root} serve`, or any JobDataset, started while no "
            "process holds it: every connect(), CLI statement and job then goes through it); "
            "or wait longer with $TABLOADER_LOCK_WAIT.",
            pid=pid,
        )


def open_catalog(root: Path) -> catalog.Catalog:
    """The catalog of a service that starts, opened once no process holds it (its turn
    taken, DuckDB's open retried; see the module). The caller holds the service lock, so no
    client takes a turn meanwhile.

    Raises:
        CatalogLockedError: one process held the catalog for ``lock_wait`` seconds.
    """
    waiting, turn = LockWait(root), Turn(root)
    told: int | None = None
    try:
        while True:
            holder = turn.take()
            if holder is not None:
                waiting.pause(holder, cheap=True)
                continue
            try:
                return catalog.open_catalog(root)
            except CatalogLockedError as locked:
                if locked.pid != told:  # once per holder
                    told = locked.pid
                    logger.info("catalog %s is held by %s: waiting", root, describe_process(told))
                waiting.pause(locked.pid)
    finally:
        with contextlib.suppress(OSError):
            turn.release()
