"""Raw sockets to a service: to send it what no ``Client`` would."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

from tabloader.service import _protocol as protocol
from tabloader.service._protocol import key_path, socket_path

TIMEOUT = 10.0  # seconds a socket operation may take before the test fails


def authenticated_socket(root: Path, node: str | None = None) -> socket.socket:
    """A connection to the service of ``root`` past the key check, with a timeout."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(TIMEOUT)
    sock.connect(str(socket_path(root, node)))
    key = key_path(root, node).read_bytes()
    protocol.answer_challenge(sock, key)
    protocol.deliver_challenge(sock, key)
    return sock


def read_to_eof(sock: socket.socket) -> bytes:
    """Everything the service sends until it closes (the socket's timeout bounds each read)."""
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:  # the service closed with our bytes unread
        pass
    return data


def frame(data: bytes) -> bytes:
    """``data`` with the protocol's length prefix."""
    return struct.pack("!I", len(data)) + data
