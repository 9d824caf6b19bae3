"""An S3 server on loopback (moto's server mode) behind a fault-injecting HTTP proxy of ours.

The proxy (:class:`S3Proxy`) forwards each HTTP/1.1 request of its clients to the server (a
new upstream connection per request, so a keep-alive client connection outlives any fault)
and can, per request:

* add latency (``Faults.latency`` seconds before the request is forwarded: every request);
* answer ``503 SlowDown`` without forwarding it (``Faults.slowdown``, a fraction);
* cut the response's body midway and close the connection (``Faults.cut``);
* flip one byte of the response's body (``Faults.corrupt``);
* refuse the methods of ``Faults.deny`` with ``403 AccessDenied`` (a read-only bucket).

Which requests get a fault is deterministic for a seed: each fault is drawn from a generator
seeded by (seed, method, range, how many times such a request came before; not the path,
since buckets and part names are random),
so the draws do not depend on the order of concurrent requests, and a retried request draws
again (a fault of rate ``r`` hits the k-th try of a request with probability ``r``; at most
``Faults.budget`` faults in all). Faults
apply to the methods in ``Faults.methods`` (GET by default) whose path contains
``Faults.path``. ``S3Proxy.stats`` counts requests, faults and body bytes per object path.

Nothing leaves loopback: the proxy and the server listen on 127.0.0.1 only.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

__all__ = ["Faults", "LoopbackS3", "S3Proxy", "loopback_s3"]

TIMEOUT = 30.0  # seconds any socket operation of the proxy may take
DENIED_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied</Message><RequestId>tl-proxy</RequestId></Error>"
)
SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>tl-proxy</RequestId>"
    b"</Error>"
)


@dataclass
class Faults:
    """What the proxy does to the requests that pass it (see the module docstring)."""

    seed: int = 0
    latency: float = 0.0
    slowdown: float = 0.0
    cut: float = 0.0
    corrupt: float = 0.0
    methods: frozenset[str] = frozenset({"GET"})
    path: str = ""  # only requests whose path contains this (e.g. one object's key)
    budget: int | None = None  # at most this many faults in all (None: no bound)
    deny: frozenset[str] = frozenset()  # methods answered 403 AccessDenied (a read-only bucket)


@dataclass
class Stats:
    """What passed the proxy: requests, faults (by kind) and body bytes, per object path."""

    requests: collections.Counter[str] = field(default_factory=collections.Counter)
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    body_bytes: collections.Counter[str] = field(default_factory=collections.Counter)

    def gets(self, contains: str = "") -> int:
        """GET requests of paths containing ``contains``."""
        return sum(n for k, n in self.requests.items() if k.startswith("GET ") and contains in k)


class _Request:
    def __init__(self, head: bytes, body: bytes) -> None:
        line, *lines = head.decode("latin-1").split("\r\n")
        self.method, self.target, _ = line.split(" ", 2)
        self.headers = [tuple(h.split(":", 1)) for h in lines if h]
        self.body = body

    def header(self, name: str) -> str:
        for k, v in self.headers:
            if k.strip().lower() == name:
                return v.strip()
        return ""

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    def upstream(self) -> bytes:
        lines = [f"{self.method} {self.target} HTTP/1.1"]
        hop = ("connection", "expect")  # the proxy answered the client's expectation itself
        lines += [f"{k}:{v}" for k, v in self.headers if k.strip().lower() not in hop]
        lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


def _read_head(f: BinaryIO) -> bytes | None:
    """The head of an HTTP message (without its blank line); None at a clean end."""
    lines = []
    while True:
        line = f.readline(65537)
        if not line:
            if lines:
                raise ConnectionError("the connection closed inside a message's head")
            return None
        if line in (b"\r\n", b"\n"):
            if lines:
                return b"".join(lines).rstrip(b"\r\n")
            continue  # a stray blank line between messages
        lines.append(line)


def _read_body(f: BinaryIO, headers: list[tuple[str, ...]], *, to_eof: bool) -> bytes:
    """The body of a message with ``headers``: by Content-Length, chunked, or (a response of
    a closed connection, ``to_eof``) to the end."""
    values = {k.strip().lower(): v.strip() for k, v in headers}
    if values.get("transfer-encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            size = int(f.readline().split(b";", 1)[0], 16)
            if size == 0:
                while f.readline() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return bytes(out)
            out += f.read(size)
            f.readline()
    if "content-length" in values:
        n = int(values["content-length"])
        data = f.read(n)
        if len(data) != n:
            raise ConnectionError("the connection closed inside a body")
        return data
    return f.read() if to_eof else b""


class S3Proxy:
    """A loopback HTTP proxy to ``upstream`` (host, port) that injects ``faults``.

    Args:
        upstream: the server's address.
        faults: what to inject (``proxy.faults`` may be replaced at any time).

    Attributes:
        url: ``http://127.0.0.1:<port>``, the endpoint to give clients.
        stats: what passed (:class:`Stats`; ``reset()`` starts it anew).
    """

    def __init__(self, upstream: tuple[str, int], faults: Faults | None = None) -> None:
        self.upstream = upstream
        self.faults = faults or Faults()
        self.stats = Stats()
        self._seen: collections.Counter[tuple[str, ...]] = collections.Counter()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._clients: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="s3proxy", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        """Forget the counts (stats and the draws' occurrence numbers)."""
        with self._lock:
            self.stats = Stats()
            self._seen.clear()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # (wakes the accept; a close alone does not)
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            clients = list(self._clients)
        for sock in clients:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=TIMEOUT)

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.settimeout(TIMEOUT)
            with self._lock:
                self._clients.add(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            with sock, sock.makefile("rb") as f:
                while (head := _read_head(f)) is not None:
                    request = _Request(head, b"")
                    if request.header("expect").lower() == "100-continue":
                        sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    request.body = _read_body(f, request.headers, to_eof=False)
                    if not self._handle(sock, request):
                        return
        except (OSError, ConnectionError, ValueError):
            return  # the client went away, or sent what no client of ours sends
        finally:
            with self._lock:
                self._clients.discard(sock)

    def _draw(self, request: _Request) -> tuple[float, ...]:
        """Three draws in [0, 1) for (slowdown, cut, corrupt), and a fourth for where."""
        # (not the path: buckets and part files have random names, the ranges do not)
        key = (request.method, request.header("range"))
        with self._lock:
            n = self._seen[key]
            self._seen[key] += 1
            self.stats.requests[f"{request.method} {request.path}"] += 1
        rng = random.Random(f"{self.faults.seed}|{'|'.join(key)}|{n}")
        return tuple(rng.random() for _ in range(4))

    def _count(self, kind: str) -> bool:
        """Count a fault of ``kind``; False (no fault) once the budget is spent."""
        with self._lock:
            budget = self.faults.budget
            if budget is not None and sum(self.stats.faults.values()) >= budget:
                return False
            self.stats.faults[kind] += 1
            return True

    def _handle(self, sock: socket.socket, request: _Request) -> bool:
        """Answer one request; False when the connection is to close."""
        faults = self.faults
        slow, cut, corrupt, where = self._draw(request)
        if faults.latency:
            time.sleep(faults.latency)
        faulty = request.method in faults.methods and faults.path in request.path
        denied = request.method in faults.deny and faults.path in request.path
        if denied or (faulty and slow < faults.slowdown and self._count("slowdown")):
            if denied:
                self._count("denied")
            status, body = (
                (b"403 Forbidden", DENIED_BODY) if denied else (b"503 Slow Down", SLOWDOWN_BODY)
            )
            sock.sendall(
                b"HTTP/1.1 "
                + status
                + b"\r\nContent-Type: application/xml\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            return request.header("connection").lower() != "close"
        status, headers, body = self._forward(request)
        ok = status in (200, 206) and request.method == "GET" and body
        if faulty and ok and corrupt < faults.corrupt and self._count("corrupt"):
            at = int(where * len(body))
            body = body[:at] + bytes([body[at] ^ 0xFF]) + body[at + 1 :]
        with self._lock:
            self.stats.body_bytes[request.path] += len(body)
        head = [headers[0]]
        hop = ("connection", "transfer-encoding")
        for k, v in (h.split(":", 1) for h in headers[1:]):
            name = k.strip().lower()
            if name not in hop and (name != "content-length" or request.method == "HEAD"):
                head.append(f"{k}:{v}")  # (a HEAD's length is the object's)
        if request.method != "HEAD":
            head.append(f"Content-Length: {len(body)}")
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        if faulty and ok and cut < faults.cut and len(body) > 1 and self._count("cut"):
            sock.sendall(data + body[: len(body) // 2])
            sock.shutdown(socket.SHUT_RDWR)
            return False
        sock.sendall(data + (b"" if request.method == "HEAD" else body))
        return request.header("connection").lower() != "close"

    def _forward(self, request: _Request) -> tuple[int, list[str], bytes]:
        """The server's answer to ``request``: (status, head lines, body)."""
        with socket.create_connection(self.upstream, timeout=TIMEOUT) as up:
            up.sendall(request.upstream())
            with up.makefile("rb") as f:
                status = 100
                while status < 200:  # (a 100 Continue the server sent all the same)
                    head = _read_head(f)
                    if head is None:
                        raise ConnectionError("the server closed without an answer")
                    lines = head.decode("latin-1").split("\r\n")
                    status = int(lines[0].split(" ", 2)[1])
                headers = [tuple(h.split(":", 1)) for h in lines[1:] if h]
                bodiless = request.method == "HEAD" or status in (204, 304)
                body = b"" if bodiless else _read_body(f, headers, to_eof=True)
        return status, lines, body


@dataclass
class LoopbackS3:
    """A moto server and the proxy in front of it (``loopback_s3``)."""

    server: object
    server_url: str
    proxy: S3Proxy

    @property
    def url(self) -> str:
        """The proxy's endpoint: what clients are given."""
        return self.proxy.url


@contextlib.contextmanager
def loopback_s3(faults: Faults | None = None) -> Iterator[LoopbackS3]:
    """A moto S3 server in this process (threads) on loopback, behind an :class:`S3Proxy`."""
    from moto.server import ThreadedMotoServer

    # werkzeug logs every request it serves (a handler of its own, at INFO) unless told not to
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    proxy = S3Proxy((host, port), faults)
    try:
        yield LoopbackS3(server, f"http://{host}:{port}", proxy)
    finally:
        proxy.close()
        server.stop()
