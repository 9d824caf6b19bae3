"""The service's control plane: authenticated, length-prefixed JSON messages on a Unix socket.

One service per catalog listens on ``socket_path(root)``; training processes are its clients.
This module moves one JSON object per request and one per reply and keeps strangers and garbage
out; what the messages mean (the handlers) and the shared-memory data plane live elsewhere.

Security: the socket and the key sit in a directory only the owner can enter (0700); both files
are 0600. The service writes a new 32-byte key each start, and on connect each end proves it
holds the key, as ``multiprocessing.connection`` does with ``authkey`` (an HMAC challenge both
ways; here HMAC-SHA256 compared with ``hmac.compare_digest``). Nothing read from the socket is
unpickled: a message is a JSON object.

Wire format: a 4-byte big-endian length, then that many bytes of UTF-8 JSON, an object with
``"v": PROTOCOL_VERSION``; a frame over ``MAX_MESSAGE`` bytes is refused. A reply is the
handler's dict plus ``"v"``, or ``{"v": 1, "error": {"type": "JobNotFoundError", "message":
..., "attrs": {"path": ...}}}`` which the client raises as that class from ``catalog.errors``.

Faults: a failed handshake, a truncated or oversized frame, a message that is not a JSON object
or has another version closes that connection with a log line, and nothing else. Each connection
has its own thread and the handshake a timeout, so a silent client blocks nobody. A watcher
thread polls the connections whose ``handle()`` runs (it may wait for a batch), so a client that
hangs up or is killed mid-request has its handler closed at once, and one that sends a request
meanwhile (a ``leave`` while it reads a batch ahead) has it interrupted. A client sees a dead
service as EOF or a reset, at once, and raises ``ServiceError``.

One service per catalog: the service holds ``flock`` on ``runtime_dir/lock`` while it lives (the
kernel drops it when the process dies), so a socket file with no lock holder is stale and two
services started at once cannot remove each other's socket. A forked child inherits the lock
and the sockets: a service starts its worker processes with spawn or forkserver.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import itertools
import json
import logging
import os
import secrets
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from pathlib import Path
from typing import Any, NoReturn, Protocol

from catalog import errors
from catalog.errors import ServiceError, TabloaderError

__all__ = [
    "MAX_MESSAGE",
    "PROTOCOL_VERSION",
    "Client",
    "Handler",
    "Listener",
    "Session",
    "key_path",
    "runtime_dir",
    "socket_path",
]

logger = logging.getLogger(__name__)

PROTOCOL_VERSION: int = 2  # 2: batch replies carry their epoch; clients time their stalls
MAX_MESSAGE: int = 16 << 20  # bytes; a larger frame closes the connection

_HANDSHAKE_TIMEOUT = 5.0  # seconds the service waits for a new connection to authenticate
_SOCKET_PATH_MAX = 100  # bytes; AF_UNIX allows 107 and a NUL
_HEADER = struct.Struct("!I")
_ACCEPT_RETRY = {errno.ECONNABORTED, errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_CHALLENGE, _WELCOME, _FAILURE = b"#TABLOADER-CHALLENGE#", b"#WELCOME#", b"#FAILURE#"


def runtime_dir(catalog_root: Path, node: str | None = None) -> Path:
    """Return the service's private directory for a catalog, creating it (mode 0700).

    ``<catalog_root>/.service``, or ``/tmp/tabloader-<uid>/<sha256(root)[:16]>`` when a socket
    path in the former would pass the AF_UNIX length limit. The loader of Ray node ``node``
    (:mod:`tabloader.cluster.node`) has ``node-<id>`` in there: the nodes of a cluster (and of
    a cluster simulated on one machine) share the catalog directory.

    Raises:
        ServiceError: the catalog directory does not exist, or the service directory exists
            but is not ours alone (owner, mode, not a directory).
    """
    root = Path(catalog_root).resolve()
    if not root.is_dir():  # checked first: the /tmp fallback below would not notice
        raise ServiceError(f"no catalog directory at {root}; check the catalog path")
    path = root / ".service"
    if len(os.fsencode(path / "node-0123456789abcdef" / "sock")) > _SOCKET_PATH_MAX:
        base = Path("/tmp") / f"tabloader-{os.getuid()}"
        _make_private_dir(base)
        path = base / hashlib.sha256(os.fsencode(root)).hexdigest()[:16]
    _make_private_dir(path)
    if node is not None:
        path = path / f"node-{node[:16]}"
        _make_private_dir(path)
    return path


def socket_path(catalog_root: Path, node: str | None = None) -> Path:
    """Return the path of the service's Unix socket for a catalog."""
    return runtime_dir(catalog_root, node) / "sock"


def key_path(catalog_root: Path, node: str | None = None) -> Path:
    """Return the path of the service's authentication key (32 bytes, mode 0600)."""
    return runtime_dir(catalog_root, node) / "authkey"


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

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Answer one request (``msg`` has ``"v"`` and ``"op"``); raise TabloaderError to refuse."""

    def close(self) -> None:
        """The connection is gone (EOF, error, client killed, Listener closed); runs once.

        When the Listener closes, or the client hangs up while ``handle()`` runs, it runs in
        another thread while ``handle()`` may still wait: it must make that ``handle()`` return.
        """

    def interrupt(self) -> None:
        """The client sent its next request while ``handle()`` runs (it may wait): make that
        ``handle()`` return (a client waits for each reply, except a ``RemoteStream`` leaving
        while it reads ahead). Runs in another thread; the request is read next as usual.
        """


class Listener:
    """The service end: accepts connections and runs a handler per authenticated session.

    Args:
        catalog_root: the catalog this service owns.
        handler: makes the handler of each new session.
        node: the Ray node whose loader this is (None: the catalog's local service).

    Raises:
        ServiceError: a service already runs for the catalog, or the runtime dir is not private.
    """

    def __init__(
        self,
        catalog_root: Path,
        handler: Callable[[Session], Handler],
        *,
        node: str | None = None,
    ) -> None:
        self._root, self._factory = Path(catalog_root), handler
        directory = runtime_dir(self._root, node)
        self._sock_path, self._key_path = directory / "sock", directory / "authkey"
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._ids = itertools.count(1)
        self._closed = False
        # fd -> (connection, request) whose handler is running; the request's own object, so a
        # watcher with an older copy knows that request has been answered
        self._busy: dict[int, tuple[_Conn, object]] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock_fd = -1
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        threading.Thread(target=self._watch, name="tabloader-service-watch", daemon=True).start()
        try:
            self._lock_fd = _lock_service(directory / "lock", self._root)
            self._key = _write_key(self._key_path)
            if self._sock_path.exists() or self._sock_path.is_symlink():
                logger.info("removing the stale socket %s (its service is gone)", self._sock_path)
                self._sock_path.unlink()
            self._sock.bind(os.fspath(self._sock_path))
            os.chmod(self._sock_path, 0o600)
            self._sock.listen(socket.SOMAXCONN)
        except BaseException:
            self.close()
            raise
        logger.info("listening on %s for catalog %s", self._sock_path, self._root)

    @property
    def sessions(self) -> int:
        """The number of authenticated connections open now."""
        with self._lock:
            return sum(conn.handler is not None for conn in self._conns)

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

    def close(self) -> None:
        """Stop accepting, close every connection, remove the socket and key files. Idempotent."""
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
        if self._lock_fd < 0:  # refused: the files are another service's
            return
        for path in (self._sock_path, self._key_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        os.close(self._lock_fd)  # last: a new service may start once the files are gone
        logger.info("closed the service socket %s", self._sock_path)

    def _run(self, conn: _Conn) -> None:
        try:
            creds = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            pid = struct.unpack("3i", creds)[0]
            conn.sock.settimeout(_HANDSHAKE_TIMEOUT)
            try:
                _deliver_challenge(conn.sock, self._key)
                _answer_challenge(conn.sock, self._key)
            except (OSError, EOFError, ServiceError, AuthenticationError) as exc:
                if not conn.closed:
                    logger.warning(
                        "connection %d (pid %d) failed to authenticate (%s); closed",
                        *(conn.id, pid, _describe(exc)),
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
            msg = _decode(_recv(conn.sock, MAX_MESSAGE))
        except (OSError, EOFError, ServiceError) as exc:
            if conn.closed:  # the Listener closed it
                return False
            if isinstance(exc, EOFError):
                logger.info("session %d: the client closed the connection", conn.id)
                return False
            logger.warning("session %d: %s; connection closed", conn.id, _describe(exc))
            if isinstance(exc, _BadMessage):  # a whole frame was read: the client can be told
                with contextlib.suppress(OSError):
                    _send(conn.sock, _encode(_error_reply(exc)))
            return False
        self._set_busy(conn, True)
        try:
            reply = _encode({**conn.handler.handle(msg), "v": PROTOCOL_VERSION})
        except TabloaderError as exc:
            reply = _encode(_error_reply(exc))
        except Exception as exc:
            logger.exception("session %d: the handler failed on op %r", conn.id, msg.get("op"))
            error = ServiceError(f"{type(exc).__name__}: {exc} (the service logged the traceback)")
            reply = _encode(_error_reply(error))
        finally:
            self._set_busy(conn, False)
        try:
            _send(conn.sock, reply)
        except OSError as exc:
            if not conn.closed:
                logger.info("session %d: the reply was not delivered (%s)", conn.id, exc)
            return False
        return True

    def _set_busy(self, conn: _Conn, busy: bool) -> None:
        with self._lock:
            if self._closed:
                return
            if busy:
                self._busy[conn.fd] = (conn, object())
            elif self._busy.get(conn.fd, (None,))[0] is conn:
                del self._busy[conn.fd]
            with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
                os.write(self._wake_w, b"\0")

    def _watch(self) -> None:
        """Close a connection whose client hangs up while its handler runs (handle() may wait)."""
        while True:
            with self._lock:
                if self._closed:
                    os.close(self._wake_r)
                    os.close(self._wake_w)
                    return
                busy = dict(self._busy)
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            for fd in busy:
                poller.register(fd, select.POLLRDHUP | select.POLLIN)
            for fd, events in poller.poll():
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                elif not self._answered(fd, busy[fd]):
                    conn = busy[fd][0]
                    if events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR):
                        logger.info("session %d: the client hung up during a request", conn.id)
                        conn.shutdown()
                    else:  # POLLIN: a request came; unwatched until it is read
                        conn.interrupt()

    def _answered(self, fd: int, entry: tuple[_Conn, object]) -> bool:
        """Whether the request of ``entry`` (from the watcher's copy of ``_busy``) has been
        answered meanwhile (then the event on ``fd`` may be the client's next request, which
        its connection reads as usual); else it is unwatched from now on."""
        with self._lock:
            if self._busy.get(fd) is not entry:
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


class Client:
    """A connection to the service of a catalog.

    Args:
        catalog_root: the catalog whose service to connect to.
        timeout: seconds allowed to connect and authenticate (a call has no timeout).
        node: connect to the loader of this Ray node (None: the catalog's local service).

    Raises:
        ServiceError: no service runs for the catalog, or it refused the key.
    """

    def __init__(
        self, catalog_root: Path, *, timeout: float = 5.0, node: str | None = None
    ) -> None:
        self._root = Path(catalog_root)
        self._call_lock, self._sock_lock = threading.Lock(), threading.Lock()
        path, key_file = socket_path(self._root, node), key_path(self._root, node)
        none = (
            f"no tabloader service runs for catalog {self._root}; "
            f"start one with `tabloader --catalog {self._root} serve`"
        )
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            try:
                self._sock.connect(os.fspath(path))
                key = key_file.read_bytes()
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise ServiceError(none) from exc
            try:
                _answer_challenge(self._sock, key)
                _deliver_challenge(self._sock, key)
            except AuthenticationError as exc:
                raise ServiceError(
                    f"the tabloader service for catalog {self._root} and this process disagree "
                    f"on the key in {key_file} ({exc}); if the file was replaced, restart the "
                    "service"
                ) from exc
            self._sock.settimeout(None)
        except (OSError, EOFError) as exc:
            self.close()
            why = _describe(exc)
            raise ServiceError(f"cannot connect to the tabloader service at {path}: {why}") from exc
        except BaseException:
            self.close()
            raise

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """Send one request and wait for its reply (no timeout; a dead service raises at once).

        Args:
            op: the operation.
            **args: its arguments (JSON values).

        Returns:
            The handler's reply, without ``"v"``.

        Raises:
            TabloaderError: the handler raised it (the same class, from ``catalog.errors``).
            ServiceError: the service is gone, broke the protocol, or the request is too large.
        """
        with self._call_lock:
            self._send_locked(op, args)
            return self._receive_locked(None)

    def call_if_idle(self, op: str, **args: Any) -> dict[str, Any] | None:
        """``call``, unless a call is in flight in another thread (then None, sending nothing)."""
        if not self._call_lock.acquire(blocking=False):
            return None
        try:
            self._send_locked(op, args)
            return self._receive_locked(None)
        finally:
            self._call_lock.release()

    def send(self, op: str, **args: Any) -> None:
        """Send a request without waiting: its reply comes with the next ``receive()``.

        The service answers a connection's requests in order; the caller receives each reply
        before its next ``call`` (``RemoteStream`` reads the next batch ahead this way).
        """
        with self._call_lock:
            self._send_locked(op, args)

    def receive(self, timeout: float | None = None) -> dict[str, Any]:
        """The reply to the oldest request not answered yet (as ``call``).

        Raises:
            ServiceError: also when ``timeout`` seconds passed (the connection is then closed:
                a reply may still be on its way).
        """
        with self._call_lock:
            return self._receive_locked(timeout)

    def _send_locked(self, op: str, args: dict[str, Any]) -> None:
        data = _encode({"op": op, **args, "v": PROTOCOL_VERSION})
        try:
            _send(self._open_sock(), data)
        except OSError as exc:
            raise self._lost(exc) from exc

    def _receive_locked(self, timeout: float | None) -> dict[str, Any]:
        sock = self._open_sock()
        try:
            sock.settimeout(timeout)
            reply = _decode(_recv(sock, MAX_MESSAGE))
            sock.settimeout(None)
        except (OSError, EOFError, ServiceError) as exc:
            raise self._lost(exc) from exc
        reply.pop("v")
        if "error" in reply:
            _raise_remote(reply["error"])
        return reply

    def _open_sock(self) -> socket.socket:
        if self._sock is None:
            raise ServiceError(f"this Client of catalog {self._root} is closed; make a new one")
        return self._sock

    def _lost(self, exc: BaseException) -> ServiceError:
        self.close()
        return ServiceError(
            f"lost the tabloader service for catalog {self._root} ({_describe(exc)}); "
            "if it stopped, start it again and make a new Client"
        )

    def close(self) -> None:
        """Close the connection (a call in flight in another thread raises). Idempotent."""
        with self._sock_lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
                self._sock.close()
                self._sock = None


class _BadMessage(ServiceError):
    """A whole frame arrived but is not a JSON object of this protocol version."""


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_HEADER.pack(len(data)) + data, socket.MSG_NOSIGNAL)  # EPIPE, never SIGPIPE


def _recv(sock: socket.socket, limit: int) -> bytearray:
    header = _recv_exact(sock, _HEADER.size)
    if not header:
        raise EOFError
    if len(header) < _HEADER.size:
        raise ServiceError(f"truncated length prefix ({len(header)} of {_HEADER.size} bytes)")
    (size,) = _HEADER.unpack(header)
    if size > limit:
        raise ServiceError(f"a message of {size} bytes is over the limit of {limit} bytes")
    data = _recv_exact(sock, size)
    if len(data) < size:
        raise ServiceError(f"truncated message ({len(data)} of {size} bytes)")
    return data


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    """Read ``size`` bytes, or fewer if the peer closed."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return buf[:got]
        got += n
    return buf


def _encode(msg: dict[str, Any]) -> bytes:
    data = json.dumps(msg).encode()
    if len(data) > MAX_MESSAGE:
        raise ServiceError(f"a message of {len(data)} bytes is over MAX_MESSAGE ({MAX_MESSAGE})")
    return data


def _decode(data: bytes | bytearray) -> dict[str, Any]:
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise _BadMessage(f"a message is not JSON ({exc})") from None
    if not isinstance(msg, dict):
        raise _BadMessage(f"a message is a JSON {type(msg).__name__}, not an object")
    version = msg.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise _BadMessage(
            f"a message has protocol version {version!r}, this end speaks {PROTOCOL_VERSION}; "
            "run the service and its clients from the same tabloader"
        )
    return msg


def _error_reply(exc: TabloaderError) -> dict[str, Any]:
    attrs = {
        k: v
        for k, v in vars(exc).items()
        if not k.startswith("_") and isinstance(v, str | int | float | bool | None)
    }
    name = "ServiceError" if isinstance(exc, _BadMessage) else type(exc).__name__
    error = {"type": name, "message": str(exc), "attrs": attrs}
    return {"error": error, "v": PROTOCOL_VERSION}


def _raise_remote(error: Any) -> NoReturn:
    """Raise a reply's error as the class of that name in ``catalog.errors``."""
    name = error.get("type") if isinstance(error, dict) else None
    message = str(error.get("message", "")) if isinstance(error, dict) else repr(error)
    cls = getattr(errors, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, TabloaderError)):
        raise ServiceError(f"the service raised {name}: {message}")
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)  # not cls.__init__: the message is final, attrs follow
    attrs = error.get("attrs")
    for key, value in attrs.items() if isinstance(attrs, dict) else ():
        if isinstance(key, str) and not key.startswith("_"):
            setattr(exc, key, value)
    raise exc


def _deliver_challenge(sock: socket.socket, key: bytes) -> None:
    """Check that the peer holds ``key`` (``multiprocessing.connection.deliver_challenge``)."""
    nonce = secrets.token_bytes(32)
    _send(sock, _CHALLENGE + nonce)
    ok = hmac.compare_digest(_recv(sock, 256), hmac.digest(key, nonce, "sha256"))
    _send(sock, _WELCOME if ok else _FAILURE)
    if not ok:
        raise AuthenticationError("the digest received was wrong")


def _answer_challenge(sock: socket.socket, key: bytes) -> None:
    """Prove to the peer that we hold ``key`` (``multiprocessing.connection.answer_challenge``)."""
    challenge = _recv(sock, 256)
    if not challenge.startswith(_CHALLENGE):
        raise AuthenticationError("the peer sent no challenge")
    _send(sock, hmac.digest(key, bytes(challenge[len(_CHALLENGE) :]), "sha256"))
    if _recv(sock, 256) != _WELCOME:
        raise AuthenticationError("the digest sent was rejected")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, EOFError):
        return "end of file"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


def _make_private_dir(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise ServiceError(f"cannot create the service directory {path}: {exc.strerror}") from exc
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ServiceError(f"{path} is not a directory; remove it")
    if st.st_uid != os.getuid():
        raise ServiceError(f"{path} belongs to uid {st.st_uid}, not to you; remove it")
    if st.st_mode & 0o077:
        mode = stat.filemode(st.st_mode)
        raise ServiceError(f"{path} is open to others ({mode}); run `chmod 700 {path}`")


def _write_key(path: Path) -> bytes:
    """Write a new key, mode 0600, atomically (a client never reads half a key)."""
    key = secrets.token_bytes(32)
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
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ServiceError(
            f"a service already runs for catalog {root} (pid {pid}); connect to it with Client, "
            "or stop it first"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
