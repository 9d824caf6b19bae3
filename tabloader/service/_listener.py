"""The service end of the control plane: accepts connections, authenticates them and runs a
handler per session (the wire format and the client: :mod:`tabloader.service._protocol`).

Faults: a failed handshake, a truncated or oversized frame, a message that is not a JSON object
or has another version closes that connection with a log line, and nothing else. Each connection
has its own thread and the handshake a timeout, so a silent client blocks nobody. A watcher
thread polls the connections whose ``handle()`` has run ``WATCH_AFTER_S`` (it may wait for a
batch), so a client that hangs up or is killed mid-request has its handler closed at once, and
one that sends a request meanwhile (a ``leave`` while it reads a batch ahead) has it
interrupted. Requests answered sooner (most) cost the watcher nothing: while requests come, it
looks at the busy ones every ``WATCH_AFTER_S`` (at most 20 wake-ups a second, whatever the
rate of batches); only the first request after ``IDLE_S`` with none wakes it. Waking it for
each request cost the service 0.1-0.2 ms of CPU per batch.

One service per catalog: the service holds ``flock`` on ``runtime_dir/lock`` while it lives (the
kernel drops it when the process dies), so a socket file with no lock holder is stale and two
services started at once cannot remove each other's socket. A forked child inherits the lock
and the sockets: a service starts its worker processes with spawn or forkserver.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from pathlib import Path
from typing import Protocol

from tabloader.catalog._errors import ServiceError, TabloaderError
from tabloader.service._protocol import (
    FDS,
    KEY_BYTES,
    MAX_MESSAGE,
    PROTOCOL_VERSION,
    BadMessage,
    Message,
    answer_challenge,
    decode,
    deliver_challenge,
    describe,
    encode,
    error_reply,
    recv_frame,
    runtime_dir,
    send_frame,
)

logger = logging.getLogger(__name__)

STARTER_ENV = "TABLOADER_SERVICE_STARTER"
"""Set, to its pid, by a client in the environment of the service it starts in the background
(:func:`tabloader.service._client.dial`): such a service that finds another one serving has
lost a race, not met an error (see ``tabloader.service._server.Service``)."""

LOCK_PROBE_S = 0.2
"""How long a new service retries the catalog's service lock: ``service_pid`` holds it shared
for an instant to read the pid of a service that runs, which is no service."""


class ServiceRunningError(ServiceError):
    """Another service holds the catalog's service lock: ``pid`` (None: it wrote none yet)."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


HANDSHAKE_TIMEOUT = 5.0  # seconds the service waits for a new connection to authenticate
# a request is watched (its client hanging up or sending its next request) once it has run this
# long: most are answered sooner, and watching one costs a wake-up of the watcher thread
WATCH_AFTER_S = 0.05
# with no request for this long, the watcher waits with no timeout: the next request wakes it
IDLE_S = 1.0
_ACCEPT_RETRY = {errno.ECONNABORTED, errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


@dataclass(frozen=True)
class Session:
    """One authenticated connection, as its handler sees it.

    Attributes:
        id: a number unique within the Listener.
        pid: the client's process id (``SO_PEERCRED``, at connect time).
    """

    id: int
    pid: int


class Handler(Protocol):
    """The server logic of one connection (``Listener``'s factory makes one per session)."""

    def handle(self, msg: Message) -> Mapping[str, object]:
        """Answer one request (``msg`` has ``"v"`` and ``"op"``); raise TabloaderError to refuse."""

    def close(self) -> None:
        """The connection is gone (EOF, error, client killed, Listener closed); runs once.

        When the Listener closes, or the client hangs up while ``handle()`` runs, it runs in
        another thread while ``handle()`` may still wait: it must make that ``handle()`` return.
        """

    def interrupt(self) -> None:
        """The client sent its next request while an ``interruptible`` request is handled (it
        may wait): make that ``handle()`` return (a ``RemoteStream`` leaving while it reads
        ahead). Runs in another thread; the request is read next as usual.
        """

    def interruptible(self, msg: Message) -> bool:
        """Whether a request that comes while ``msg`` is handled means the client gave it up
        (``interrupt``); else it was sent behind it (a client may send its first ``next``
        behind its ``open``) and waits its turn."""


class Listener:
    """The service end: accepts connections and runs a handler per authenticated session.

    Args:
        catalog_root: the catalog this service owns.
        handler: makes the handler of each new session.
        node: the Ray node whose loader this is (None: the catalog's local service).
        listen: make the socket now; False: only take the service lock and write the key,
            and ``listen()`` later (a service that must open its catalog first: clients find
            no socket until it can answer, rather than one that does not answer).

    Raises:
        ServiceRunningError: a service already runs for the catalog.
        ServiceError: the runtime dir is not private.
    """

    def __init__(
        self,
        catalog_root: Path,
        handler: Callable[[Session], Handler],
        *,
        node: str | None = None,
        listen: bool = True,
    ) -> None:
        self._root, self._factory = Path(catalog_root), handler
        directory = runtime_dir(self._root, node)
        self._sock_path, self._key_path = directory / "sock", directory / "authkey"
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._ids = itertools.count(1)
        self._closed = False
        # fd -> the request whose handler is running; each its own object, so a watcher with an
        # older copy knows that request has been answered
        self._busy: dict[int, _Request] = {}
        # the watcher waits with no timeout (no request for IDLE_S): a new request wakes it
        self._wake_on_request = False
        self._last_request = 0.0  # time.monotonic() when the last request started
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock_fd = -1
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        threading.Thread(target=self._watch, name="tabloader-service-watch", daemon=True).start()
        try:
            self._lock_fd = _lock_service(directory / "lock", self._root)
            self._key = _write_key(self._key_path)
            if listen:
                self.listen()
        except BaseException:
            self.close()
            raise

    def listen(self) -> None:
        """Make the socket (a stale one of a service that died is removed first): clients
        connect from now on, and wait in its backlog until ``serve_forever`` accepts them."""
        if self._sock_path.exists() or self._sock_path.is_symlink():
            logger.info("removing the stale socket %s (its service is gone)", self._sock_path)
            self._sock_path.unlink()
        self._sock.bind(os.fspath(self._sock_path))
        os.chmod(self._sock_path, 0o600)
        self._sock.listen(socket.SOMAXCONN)
        logger.info("listening on %s for catalog %s", self._sock_path, self._root)

    @property
    def sessions(self) -> int:
        """The number of authenticated connections open now."""
        with self._lock:
            return sum(conn.handler is not None for conn in self._conns)

    def handlers(self) -> list[Handler]:
        """The handlers of the authenticated connections open now."""
        with self._lock:
            return [conn.handler for conn in self._conns if conn.handler is not None]

    def serve_forever(self) -> None:
        """Accept connections until ``close()``; each one gets its own daemon thread."""
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                if exc.errno not in _ACCEPT_RETRY:
                    raise
                logger.warning("accept on %s failed (%s); retrying", self._sock_path, exc)
                time.sleep(0.1)
                continue
            conn = _Conn(next(self._ids), sock)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns.add(conn)
            name = f"tabloader-session-{conn.id}"
            threading.Thread(target=self._run, args=(conn,), name=name, daemon=True).start()

    def stop(self) -> None:
        """Stop accepting and close every connection, but keep the service's lock and files
        (no other service starts yet: the owner frees what it must first). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
            os.write(self._wake_w, b"\0")  # the watcher closes the pipe, after this
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes serve_forever's accept()
        self._sock.close()
        for conn in conns:
            conn.shutdown()

    def close(self) -> None:
        """``stop()``, then remove the socket and key files and drop the service's lock.
        Idempotent."""
        self.stop()
        with self._lock:
            lock_fd, self._lock_fd = self._lock_fd, -1
        if lock_fd < 0:  # refused (the files are another service's), or closed already
            return
        for path in (self._sock_path, self._key_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        os.close(lock_fd)  # last: a new service may start once the files are gone
        logger.info("closed the service socket %s", self._sock_path)

    def _run(self, conn: _Conn) -> None:
        try:
            creds = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            pid = struct.unpack("3i", creds)[0]
            conn.sock.settimeout(HANDSHAKE_TIMEOUT)
            try:
                deliver_challenge(conn.sock, self._key)
                answer_challenge(conn.sock, self._key)
            except (OSError, EOFError, ServiceError, AuthenticationError) as exc:
                if not conn.closed:
                    logger.warning(
                        "connection %d (pid %d) failed to authenticate (%s); closed",
                        *(conn.id, pid, describe(exc)),
                    )
                return
            conn.sock.settimeout(None)
            if not conn.attach(self._factory(Session(conn.id, pid))):
                return
            logger.info("session %d: pid %d connected", conn.id, pid)
            while self._serve_one(conn):
                pass
        except Exception:
            logger.exception("session %d failed; connection closed", conn.id)
        finally:
            conn.shutdown()
            conn.close()
            with self._lock:
                self._conns.discard(conn)

    def _serve_one(self, conn: _Conn) -> bool:
        assert conn.handler is not None
        try:
            msg = decode(recv_frame(conn.sock, MAX_MESSAGE))
        except (OSError, EOFError, ServiceError) as exc:
            if conn.closed:  # the Listener closed it
                return False
            if isinstance(exc, EOFError):
                logger.info("session %d: the client closed the connection", conn.id)
                return False
            logger.warning("session %d: %s; connection closed", conn.id, describe(exc))
            if isinstance(exc, BadMessage):  # a whole frame was read: the client can be told
                with contextlib.suppress(OSError):
                    send_frame(conn.sock, encode(error_reply(exc)))
            return False
        self._set_busy(conn, True, conn.handler.interruptible(msg))
        fds: list[int] = []  # descriptors that go with the reply: ours to close
        try:
            answer = dict(conn.handler.handle(msg))
            sent = answer.pop(FDS, None)
            fds = sent if isinstance(sent, list) else []
            reply = encode({**answer, "v": PROTOCOL_VERSION})
        except TabloaderError as exc:
            reply = encode(error_reply(exc))
        except Exception as exc:
            logger.exception("session %d: the handler failed on op %r", conn.id, msg.get("op"))
            error = ServiceError(f"{type(exc).__name__}: {exc} (the service logged the traceback)")
            reply = encode(error_reply(error))
        finally:
            self._set_busy(conn, False)
        try:
            send_frame(conn.sock, reply, fds)
        except OSError as exc:
            if not conn.closed:
                logger.info("session %d: the reply was not delivered (%s)", conn.id, exc)
            return False
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def _set_busy(self, conn: _Conn, busy: bool, interruptible: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            if busy:
                self._last_request = time.monotonic()
                self._busy[conn.fd] = _Request(conn, self._last_request, interruptible)
                if self._wake_on_request:  # else it looks at the busy ones again in time
                    self._wake_on_request = False
                    with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending
                        os.write(self._wake_w, b"\0")
            elif (mine := self._busy.get(conn.fd)) is not None and mine.conn is conn:
                del self._busy[conn.fd]

    def _watch(self) -> None:
        """Close a connection whose client hangs up while its handler runs (handle() may wait),
        interrupt one whose client sends a request meanwhile: for requests that have run
        ``WATCH_AFTER_S``."""
        while True:
            with self._lock:
                if self._closed:
                    os.close(self._wake_r)
                    os.close(self._wake_w)
                    return
                now = time.monotonic()
                watched, young = {}, []
                for fd, request in self._busy.items():
                    if now - request.since >= WATCH_AFTER_S:
                        watched[fd] = request
                    else:
                        young.append(request.since)
                # look again when the oldest young request comes of age; while requests come,
                # every WATCH_AFTER_S (at least 1 ms); else when one comes
                timeout: float | None = None
                if young:
                    timeout = max(0.0, min(young) + WATCH_AFTER_S - now)
                elif now - self._last_request < IDLE_S:
                    timeout = max(WATCH_AFTER_S, 0.001)
                self._wake_on_request = timeout is None
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            for fd, request in watched.items():  # a request sent behind another waits its turn
                poller.register(fd, select.POLLRDHUP | (select.POLLIN * request.interruptible))
            for fd, events in poller.poll(None if timeout is None else timeout * 1000):
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                elif not self._answered(fd, watched[fd]):
                    conn = watched[fd].conn
                    if events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR):
                        logger.info("session %d: the client hung up during a request", conn.id)
                        conn.shutdown()
                    else:  # POLLIN: a request came; unwatched until it is read
                        conn.interrupt()

    def _answered(self, fd: int, request: _Request) -> bool:
        """Whether ``request`` (from the watcher's copy of ``_busy``) has been answered
        meanwhile (then the event on ``fd`` may be the client's next request, which its
        connection reads as usual); else it is unwatched from now on."""
        with self._lock:
            if self._busy.get(fd) is not request:
                return True
            del self._busy[fd]
            return False


class _Conn:
    """A server-side connection: its socket, its handler, and closing it once from any thread."""

    def __init__(self, id: int, sock: socket.socket) -> None:
        self.id, self.sock, self.fd = id, sock, sock.fileno()
        self.handler: Handler | None = None
        self.closed = False
        self._lock = threading.Lock()

    def attach(self, handler: Handler) -> bool:
        with self._lock:
            if not self.closed:
                self.handler = handler
                return True
        handler.close()  # the Listener closed during the handshake
        return False

    def interrupt(self) -> None:
        """A request came while the handler runs: the handler's ``interrupt()``."""
        handler = self.handler
        if handler is not None:
            try:
                handler.interrupt()
            except Exception:
                logger.exception("session %d: the handler's interrupt() failed", self.id)

    def shutdown(self) -> None:
        """Wake the connection's thread (EOF) and run the handler's close(), once."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
        if self.handler is not None:
            try:
                self.handler.close()
            except Exception:
                logger.exception("session %d: the handler's close() failed", self.id)

    def close(self) -> None:
        with self._lock:  # never while shutdown() uses the descriptor
            self.sock.close()


@dataclass(eq=False)
class _Request:
    """A request being handled (compared by identity: each is its own)."""

    conn: _Conn
    since: float  # time.monotonic() when its handler started
    interruptible: bool = False  # a request that comes meanwhile interrupts it (``Handler``)


def _write_key(path: Path) -> bytes:
    """Write a new key, mode 0600, atomically (a client never reads half a key)."""
    key = secrets.token_bytes(KEY_BYTES)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, key)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return key


def _lock_service(path: Path, root: Path) -> int:
    """Take the catalog's service lock (held until the fd closes) and write our pid in it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + LOCK_PROBE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            text = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            raise ServiceRunningError(
                f"a service already runs for catalog {root} (pid {text or '?'}); connect to it "
                "with Client, or stop it first",
                int(text) if text.isdigit() else None,
            ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
