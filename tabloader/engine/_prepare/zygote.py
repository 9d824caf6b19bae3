"""The decode processes' forkserver as a fork of the service, not a fresh interpreter.

multiprocessing's forkserver is a new interpreter that imports the decode module before it forks
the first decode process: 0.3-0.4 s of a core at every service start, taken from the first
batch's decodes on a 2-core machine. A service forks one process (the *zygote*) as it starts,
before any thread of its own and before it opens anything: it has every module imported already,
and it waits. When the first decode pool starts, the service hands it a forkserver's listening
socket and "alive" pipe (``SCM_RIGHTS``), as ``ForkServer.ensure_running`` would hand them to the
interpreter it starts, and the zygote runs multiprocessing's own forkserver loop
(``multiprocessing.forkserver.main``). The pool, its processes and their restarts stay
multiprocessing's: if the zygote dies, ``ensure_running`` starts an interpreter as before.

Only where multiprocessing's forkserver is the one this module knows (its ``main``'s parameters
and the ``ForkServer`` fields it sets); elsewhere nothing is forked and the interpreter starts.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pickle
import socket
import sys
import threading
import warnings
from multiprocessing import connection, forkserver, resource_tracker

#: ``multiprocessing.forkserver.main``'s parameters where this module knows the forkserver
#: (CPython 3.10-3.13).
_MAIN_PARAMETERS = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")
_FIELDS = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_lock")

_zygote: tuple[int, socket.socket] | None = None  # (pid, the service's end of its socket)
_taking = threading.Lock()  # two pools adopting at once: one takes the zygote


def known() -> bool:
    """Whether this Python's forkserver is the one this module can hand a zygote to."""
    server = getattr(forkserver, "_forkserver", None)
    return (
        sys.platform.startswith("linux")
        and hasattr(socket, "send_fds")
        and all(hasattr(server, f) for f in _FIELDS)
        and tuple(inspect.signature(forkserver.main).parameters) == _MAIN_PARAMETERS
    )


def fork() -> bool:
    """Fork the zygote now: once, in a process that runs no Python thread but this one and no
    forkserver yet (``tabloader serve`` as it starts). True if it did."""
    global _zygote
    if _zygote is not None or threading.active_count() > 1 or not known():
        return False
    if forkserver._forkserver._forkserver_pid is not None:  # type: ignore[attr-defined]
        return False
    # one message, whole or not at all (a stream could split the fds from the preload list)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with warnings.catch_warnings():  # (3.12+: the libraries' threads, as a forkserver's)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:  # no process to spare now: multiprocessing starts an interpreter later
        ours.close()
        theirs.close()
        return False
    if pid == 0:  # the zygote: it never returns, and never runs the service's exit handlers
        code = 1  # its exit status says what went wrong; it has no one to tell
        try:
            ours.close()
            code = _wait(theirs)
        finally:
            os._exit(code)
    theirs.close()
    _zygote = (pid, ours)
    return True


def waiting() -> int | None:
    """The pid of the zygote this process forked, while no pool has adopted it (else None)."""
    return None if _zygote is None else _zygote[0]


def _wait(sock: socket.socket) -> int:
    """In the zygote: close what the service had open, wait for the forkserver's socket and
    pipe, then serve as multiprocessing's forkserver until every process that may ask is gone."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != sock.fileno():
            with contextlib.suppress(OSError):
                os.close(fd)
    try:
        message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 2)
    except OSError:
        return 0
    sock.close()
    if len(fds) != 2:  # the service ended, or started no decode process
        return 0
    preload = pickle.loads(message)
    with contextlib.suppress(SystemExit):  # every process that could ask is gone
        forkserver.main(fds[0], fds[1], preload)
    return 0


def adopt(preload: list[str]) -> bool:
    """Make the zygote this process's forkserver, if it forked one and no forkserver runs yet:
    the next process a forkserver context starts is forked by it. True if it did."""
    global _zygote
    with _taking:
        if _zygote is None:
            return False
        pid, sock = _zygote
        _zygote = None
    server: forkserver.ForkServer = forkserver._forkserver
    with server._lock, sock:  # type: ignore[attr-defined]
        if server._forkserver_pid is not None:  # type: ignore[attr-defined]
            _reap(sock, pid)
            return False
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            try:
                socket.send_fds(sock, [pickle.dumps(preload)], [listener.fileno(), alive_r])
            except OSError:  # the zygote is gone: multiprocessing starts an interpreter
                os.close(alive_w)
                _reap(sock, pid)
                return False
            finally:
                os.close(alive_r)
        server._forkserver_address = address  # type: ignore[attr-defined]
        server._forkserver_alive_fd = alive_w  # type: ignore[attr-defined]
        server._forkserver_pid = pid  # type: ignore[attr-defined]
    return True


def _reap(sock: socket.socket, pid: int) -> None:
    """End a zygote that is not needed (its socket's end) and reap it."""
    sock.close()
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
