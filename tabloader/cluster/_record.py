"""The leader record: which ``tabloader serve --ray`` serves a catalog, and on which cluster.

While ``tabloader serve --ray`` serves a catalog (:func:`~tabloader.cluster._actor.serve_cluster`),
``ray-leader.json`` in the catalog's private service directory holds the Ray address, the pid of
the serving process and that process's start time (written at start, removed at close), so that
``tabloader status`` finds the cluster without ``--ray``.

The file is a claim that ``status`` acts on (it dials the address), so it is trusted only when:

* its process runs and started when the record says (``/proc/<pid>/stat``, field 22): a pid
  reused by a later process, or a process gone, makes the record stale, and it is removed;
* that process is a ``tabloader serve --ray`` of this catalog (``/proc/<pid>/cmdline``: the
  ``serve`` command, a ``--ray`` flag, and ``--catalog`` naming this catalog, or no
  ``--catalog`` where the process's ``$TABLOADER_CATALOG`` or default names it);
* its address is ``host:port`` or ``ray://host:port``: never ``local`` or ``auto`` (with those
  ``ray.init`` starts a Ray instance or searches for one).

A record that fails a check is ignored with one warning naming the file and why. Where
``/proc`` is missing (not Linux) no record can be checked, and none is trusted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
from pathlib import Path
from typing import Any, TypedDict

from tabloader.catalog._directory import ENV_VAR, default_root, read_file
from tabloader.catalog._errors import ServiceError, StorageError

logger = logging.getLogger(__name__)

RECORD_BYTES = 4096
"""The most a leader record holds (an address, a pid and a start time take ~100 bytes)."""
DIAL_TIMEOUT_S = 3.0
"""Seconds ``status`` waits for a recorded (or given) Ray address to accept a connection."""
_ADDRESS_RE = re.compile(
    r"(?:ray://)?(?P<host>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>\d{1,5})"
)


def record_path(catalog: str | os.PathLike[str], *, create: bool = True) -> Path:
    """Where the leader record of ``catalog`` lives (its private service directory, created
    unless ``create`` is False: a reader finds no record where there is no directory)."""
    from tabloader.service._protocol import runtime_dir

    root = Path(catalog).expanduser().resolve()
    return runtime_dir(root, create=create) / "ray-leader.json"


def check_address(address: str) -> tuple[str, int]:
    """The host and port of a Ray address ``host:port`` or ``ray://host:port``.

    Raises:
        ServiceError: any other form (``local``, ``auto``, a URL with a path...), naming it.
    """
    match = _ADDRESS_RE.fullmatch(address) if isinstance(address, str) else None
    if match is None or not 0 < int(match["port"]) < 65536:
        raise ServiceError(
            f"Ray address {address!r} is not host:port or ray://host:port; give the address "
            "of the running cluster's head (`ray status` prints it), e.g. 10.0.0.1:6379."
        )
    return match["host"].strip("[]"), int(match["port"])


def dial(address: str, timeout: float = DIAL_TIMEOUT_S) -> None:
    """Check that something accepts connections at Ray ``address`` within ``timeout``
    seconds, so that ``ray.init`` is never left to retry an address where nothing answers.

    Raises:
        ServiceError: the address is malformed (:func:`check_address`), or nothing accepts
            there within the timeout.
    """
    host, port = check_address(address)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise ServiceError(
            f"Nothing answers at Ray address {address} within {timeout:g} s "
            f"({exc.strerror or exc}); is the cluster up? `ray status` shows its address."
        ) from None


def process_started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot: ``/proc/<pid>/stat`` field 22),
    or None: no such process, or no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])  # field 22; fields[0] is field 3 (the state)
    except (OSError, IndexError, ValueError):
        return None


def record_leader(catalog: str | os.PathLike[str], address: str | None) -> None:
    """Record that this process serves ``catalog`` on the Ray cluster at ``address`` (None:
    remove the record).

    Raises:
        ServiceError: ``address`` is not ``host:port`` or ``ray://host:port``.
    """
    path = record_path(catalog)
    if address is None:
        path.unlink(missing_ok=True)
        return
    check_address(address)
    record = {"address": address, "pid": os.getpid(), "started": process_started(os.getpid())}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record))
    tmp.replace(path)


class LeaderRecord(TypedDict):
    """The ``tabloader serve --ray`` that serves a catalog: its Ray address and pid."""

    address: str
    pid: int


def recorded_leader(catalog: str | os.PathLike[str]) -> LeaderRecord | None:
    """``{"address", "pid"}`` of the ``tabloader serve --ray`` that serves ``catalog``
    (:func:`record_leader`), or None: no record, a stale or damaged one (then removed), or one
    that fails a check of the module docstring (then ignored with a warning)."""
    path = record_path(catalog, create=False)
    try:
        record = json.loads(read_file(path, what=f"Leader record {path}", max_bytes=RECORD_BYTES))
        address, pid, started = record["address"], record["pid"], record.get("started")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise TypeError(pid)
    except FileNotFoundError:
        return None
    except (StorageError, OSError) as exc:  # a link, a FIFO, too large: never read
        _distrust(path, str(exc))
        return None
    except (ValueError, KeyError, TypeError, AttributeError):  # damaged: nobody can use it
        path.unlink(missing_ok=True)
        return None
    now = process_started(pid)
    if now is None and os.path.isdir("/proc/self"):  # its process is gone
        path.unlink(missing_ok=True)
        return None
    why = _untrusted(catalog, pid, started, now, address)
    if why == "stale":
        path.unlink(missing_ok=True)
        return None
    if why is not None:
        _distrust(path, why)
        return None
    return {"address": address, "pid": pid}


def _distrust(path: Path, why: str) -> None:
    logger.warning("ignoring the Ray leader record %s: %s", path, why)


def _untrusted(
    catalog: str | os.PathLike[str], pid: int, started: Any, now: int | None, address: Any
) -> str | None:
    """Why the record of ``pid`` (started at ``started``; ``now``: its start time now) is not
    to be trusted: "stale" (its pid is another process's by now), another reason, or None."""
    if now is None:
        return "no /proc to check its process against (only Linux can)"
    if not isinstance(started, int):
        return f"it records no start time of process {pid} (written by an older tabloader)"
    if started != now:
        return "stale"
    if not isinstance(address, str):
        return f"its address {address!r} is not a string"
    try:
        check_address(address)
    except ServiceError:
        return f"its address {address!r} is not host:port or ray://host:port"
    root = Path(catalog).expanduser().resolve()
    served = _served_catalog(pid)
    if served is None:
        return f"process {pid} is not a `tabloader serve --ray`"
    if served != root:
        return f"process {pid} is a `tabloader serve --ray` of {served}, not of {root}"
    return None


def _served_catalog(pid: int) -> Path | None:
    """The catalog that process ``pid`` serves with ``tabloader serve --ray``, as its command
    line (and its working directory and environment, where that names it) says; None if it is
    no such process or cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read(1 << 20).split(b"\0")]
    except OSError:
        return None
    if "serve" not in argv or not any(a == "--ray" or a.startswith("--ray=") for a in argv):
        return None
    given = None
    for i, arg in enumerate(argv):
        if arg == "--catalog" and i + 1 < len(argv):
            given = argv[i + 1]
        elif arg.startswith("--catalog="):
            given = arg.split("=", 1)[1]
    if given is None:  # $TABLOADER_CATALOG, else the default catalog
        env = _environment(pid).get(ENV_VAR)
        if not env:
            return default_root().resolve()
        given = env
    path = Path(given).expanduser()
    if not path.is_absolute():  # relative to its working directory
        try:
            path = Path(os.readlink(f"/proc/{pid}/cwd")) / path
        except OSError:
            return None
    return path.resolve()


def _environment(pid: int) -> dict[str, str]:
    """Process ``pid``'s environment as it started (readable for one's own processes)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = f.read(1 << 20).split(b"\0")
    except OSError:
        return {}
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)
