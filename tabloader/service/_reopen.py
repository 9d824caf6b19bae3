"""Streams a process dropped without ``close()``: they leave before the job opens again.

A notebook that rebinds ``ds = JobDataset("j")`` drops the old stream; its connection used to
close whenever the garbage collector got to it, and the service noticed that later still, so
the new open raced the old stream's leave ("Job 'j' is open already in this loader", 61 times
in 150). Here each open stream of the process is registered by (catalog, node, job, rank).
A stream collected without ``close()`` says "leave" at once (a send, nothing waited for) and
parks its connection; the next open in the process waits for the service's answer to that
leave first (and closes the connection), so the service has closed the old stream before the
new one opens. If the registered stream still exists (unreachable in a reference cycle, not
collected yet) the open collects garbage once; a stream still in use is left alone (the
service refuses the open).
At interpreter exit nothing is sent: a process that ends mid-epoch is a rank that died.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from typing import Any

from tabloader.catalog._errors import TabloaderError
from tabloader.service._protocol import Client

WAIT_S = 2.0  # for the service's answer to a dropped stream's leave

Key = tuple[Any, ...]

_lock = threading.RLock()  # a finalizer may run in any thread, this one included
_open: dict[Key, weakref.ref[Any]] = {}
_parked: dict[Key, list[tuple[Client, bool]]] = {}


class Ahead:
    """Whether a stream has a ``next`` request out whose reply it has not read (its
    finalizer reads this after the stream is gone)."""

    value = False


def register(key: Key, stream: Any, conn: Client, ahead: Ahead) -> weakref.finalize[Any, Any]:
    """Register ``stream``, open on ``conn``; detach the finalizer returned at ``close()``."""
    with _lock:
        _open[key] = weakref.ref(stream)
    finalizer = weakref.finalize(stream, _dropped, key, conn, ahead)
    finalizer.atexit = False
    return finalizer


def forget(key: Key, stream: Any) -> None:
    """``stream`` closed: it is no longer the open stream of ``key``."""
    with _lock:
        ref = _open.get(key)
        if ref is not None and ref() in (stream, None):
            del _open[key]


def settle(key: Key) -> None:
    """Before ``key`` opens: every dropped stream (of it, and any other) has left the service."""
    with _lock:
        ref = _open.get(key)
        pending = ref is not None and ref() is not None
    if pending:  # unreachable in a cycle, maybe: its finalizer runs if so
        gc.collect()
    with _lock:  # every key's: a parked connection is kept only until the next open
        parked = [c for conns in _parked.values() for c in conns]
        _parked.clear()
    for conn, ahead in parked:
        with contextlib.suppress(TabloaderError, OSError):
            if ahead:
                conn.receive(timeout=WAIT_S)  # the batch read ahead, given up
            conn.receive(timeout=WAIT_S)  # the leave's answer: the old stream is closed
        conn.close()


def _dropped(key: Key, conn: Client, ahead: Ahead) -> None:
    try:
        conn.send("leave")
    except (TabloaderError, OSError):
        conn.close()
        return
    with _lock:
        ref = _open.get(key)
        if ref is not None and ref() is None:
            del _open[key]
        _parked.setdefault(key, []).append((conn, ahead.value))
