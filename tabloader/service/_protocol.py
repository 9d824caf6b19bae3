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
..., "attrs": {"path": ...}}}`` which the client raises as that class of
``tabloader.catalog._errors``.
Every message read (``decode``) is a :class:`Message`, whose readers check a field once; each
reply a handler makes is a TypedDict of this module (``OpenReply``, ``BatchReply``, ...).

Descriptors: a reply may carry open file descriptors (``FDS``: the service's shared memory,
read-only), sent with the first bytes of its frame (``SCM_RIGHTS``); only the peer of this
authenticated connection receives them, and no name is ever made for them.

Faults: a failed handshake, a truncated or oversized frame, a message that is not a JSON object
or has another version is refused; a client sees a dead service as EOF or a reset, at once, and
raises ``ServiceError``. The service end, its connections and their faults:
:mod:`tabloader.service._listener`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import stat
import struct
import threading
from collections.abc import Iterator, Mapping
from multiprocessing import AuthenticationError
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn, TypedDict

import numpy as np

from tabloader.catalog import _errors as errors
from tabloader.catalog._directory import read_file
from tabloader.catalog._errors import (
    ServiceError,
    ServiceStuckError,
    StorageError,
    TabloaderError,
)
from tabloader.sampling._importance import REPORT_ROWS_MAX, report_arrays

if TYPE_CHECKING:
    import pyarrow as pa

    from tabloader.catalog._model import Dataset, Job, JobInfo

logger = logging.getLogger(__name__)

PROTOCOL_VERSION: int = 7  # 7: an open is one OpenRequest, its reply maps the memory and
# reads the first batch ahead; 6: the catalog's operations as one request, "catalog"; 5: an
# open's job options as one JobSpec; 4: datasets and jobs as results; 3: shared memory by
# descriptor
MAX_MESSAGE: int = 16 << 20  # bytes; a larger frame closes the connection
CONNECT_TIMEOUT_S: float = 5.0  # a service that does not answer by then is stopped or hung

_SOCKET_PATH_MAX = 100  # bytes; AF_UNIX allows 107 and a NUL
_HEADER = struct.Struct("!I")
FDS: Final = "_fds"  # a handler's reply: the descriptors to send with it (the listener closes them)
_MAX_FDS = 4
_CHALLENGE, _WELCOME, _FAILURE = b"#TABLOADER-CHALLENGE#", b"#WELCOME#", b"#FAILURE#"


RELEASE_MAX = 256  # tickets one request releases at most
LOG_FILE = "service.log"  # the service's log, in its runtime_dir (<catalog>/.service)


def runtime_dir(catalog_root: Path, node: str | None = None, *, create: bool = True) -> Path:
    """Return the service's private directory for a catalog, creating it (mode 0700).

    ``<catalog_root>/.service``; or ``/tmp/tabloader-<uid>/<sha256(root)[:16]>`` when a socket
    path in the former would pass the AF_UNIX length limit, or when this user may not write
    the catalog directory (a read-only catalog: its service, and every client, use the
    fallback; nothing is written in the catalog). The loader of Ray node ``node``
    (:mod:`tabloader.cluster._node`) has ``node-<id>`` in there: the nodes of a cluster (and of
    a cluster simulated on one machine) share the catalog directory.

    Args:
        catalog_root: the catalog directory.
        node: the Ray node whose loader's directory it is (None: the catalog's service).
        create: create what is missing; False only finds where it is (a client looking for a
            service: a missing directory means none runs, and nothing is created).

    Raises:
        ServiceError: the catalog directory does not exist, the service directory cannot be
            created (with the fix), or it exists but is not ours alone (owner, mode, not a
            directory).
    """
    root = Path(catalog_root).resolve()
    if not root.is_dir():  # checked first: the /tmp fallback below would not notice
        raise ServiceError(f"no catalog directory at {root}; check the catalog path")
    path = root / ".service"
    long = len(os.fsencode(path / "node-0123456789abcdef" / "sock")) > _SOCKET_PATH_MAX
    if long or not _writable(path if os.path.lexists(path) else root):
        base = Path("/tmp") / f"tabloader-{os.getuid()}"
        _private_dir(base, create)
        path = base / hashlib.sha256(os.fsencode(root)).hexdigest()[:16]
    _private_dir(path, create)
    if node is not None:
        path = path / f"node-{node[:16]}"
        _private_dir(path, create)
    return path


def _writable(path: Path) -> bool:
    """Whether this user may create files in folder ``path`` (not on a read-only mount)."""
    return os.access(path, os.W_OK | os.X_OK)


def socket_path(catalog_root: Path, node: str | None = None) -> Path:
    """Return the path of the service's Unix socket for a catalog (creating nothing)."""
    return runtime_dir(catalog_root, node, create=False) / "sock"


KEY_BYTES = 32
"""The size of the service's authentication key."""


def key_path(catalog_root: Path, node: str | None = None) -> Path:
    """Return the path of the service's authentication key (``KEY_BYTES``, mode 0600;
    creating nothing)."""
    return runtime_dir(catalog_root, node, create=False) / "authkey"


def service_pid(catalog_root: Path, node: str | None = None) -> int | None:
    """The pid of the process that holds the catalog's service lock (a service that lives,
    answering or not), else None."""
    try:
        fd = os.open(  # never through a link, never blocking (a FIFO put in its place)
            runtime_dir(catalog_root, node, create=False) / "lock",
            os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
        )
    except (OSError, ServiceError):  # no service directory (or none we would talk to)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # held: read the pid the holder wrote
        text = os.read(fd, 32).decode(errors="replace").strip()
        return int(text) if text.isdigit() else None
    finally:
        os.close(fd)  # also drops our shared lock, if we got it
    return None


class Client:
    """A connection to the service of a catalog.

    Args:
        catalog_root: the catalog whose service to connect to.
        timeout: seconds allowed to connect and authenticate (default ``CONNECT_TIMEOUT_S``;
            a call has no timeout).
        node: connect to the loader of this Ray node (None: the catalog's local service).

    Raises:
        ServiceError: no service runs for the catalog, or it refused the key.
    """

    def __init__(
        self, catalog_root: Path, *, timeout: float | None = None, node: str | None = None
    ) -> None:
        self._root = Path(catalog_root)
        self._call_lock, self._sock_lock = threading.Lock(), threading.Lock()
        self._closed = False  # by close(): a request that then fails lost nothing
        path, key_file = socket_path(self._root, node), key_path(self._root, node)
        none = (
            f"no tabloader service runs for catalog {self._root}; "
            f"start one with `tabloader --catalog {self._root} serve`"
        )
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(CONNECT_TIMEOUT_S if timeout is None else timeout)
            try:
                self._sock.connect(os.fspath(path))
                key = read_file(key_file, what=f"The service's key {key_file}", size=KEY_BYTES)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise ServiceError(none) from exc
            except StorageError as exc:  # a link, a FIFO, another size: never read
                raise ServiceError(
                    f"{exc} Restart the service (`tabloader --catalog {self._root} serve`): it "
                    "writes a new key."
                ) from None
            try:
                answer_challenge(self._sock, key)
                deliver_challenge(self._sock, key)
            except AuthenticationError as exc:
                raise ServiceError(
                    f"the tabloader service for catalog {self._root} and this process disagree "
                    f"on the key in {key_file} ({exc}); if the file was replaced, restart the "
                    "service"
                ) from exc
            self._sock.settimeout(None)
        except (OSError, EOFError) as exc:
            self.close()
            pid = service_pid(self._root, node) if isinstance(exc, TimeoutError) else None
            if pid is not None:  # it holds the lock but does not answer: stopped or hung
                raise ServiceStuckError(
                    f"The tabloader service of catalog {self._root}: pid {pid} does not answer "
                    f"(stopped or hung); resume it with `kill -CONT {pid}`, or end it with "
                    f"`kill {pid}` (a new one starts with the next job)"
                ) from exc
            why = describe(exc)
            raise ServiceError(f"cannot connect to the tabloader service at {path}: {why}") from exc
        except BaseException:
            self.close()
            raise

    def call(self, op: str, **args: Any) -> Message:
        """Send one request and wait for its reply (no timeout; a dead service raises at once).

        Args:
            op: the operation.
            **args: its arguments (JSON values).

        Returns:
            The handler's reply, without ``"v"``.

        Raises:
            TabloaderError: the handler raised it (the same class, from
            ``tabloader.catalog._errors``). ServiceError: the service is gone, broke the protocol,
            or the request is too large.
        """
        with self._call_lock:
            self._send_locked(op, args)
            return self._receive_locked(None)

    def send(self, op: str, **args: Any) -> None:
        """Send a request without waiting: its reply comes with the next ``receive()``.

        The service answers a connection's requests in order; the caller receives each reply
        before its next ``call`` (``RemoteStream`` reads the next batch ahead this way).
        """
        with self._call_lock:
            self._send_locked(op, args)

    def receive(self, timeout: float | None = None, fds: list[int] | None = None) -> Message:
        """The reply to the oldest request not answered yet (as ``call``); the descriptors
        it carries are appended to ``fds`` (the caller's to close; None: closed unread).

        Raises:
            ServiceError: also when ``timeout`` seconds passed (the connection is then closed:
                a reply may still be on its way).
        """
        with self._call_lock:
            return self._receive_locked(timeout, fds)

    def call_fds(self, op: str, **args: Any) -> tuple[Message, list[int]]:
        """``call``, for a reply that carries descriptors: the reply and them (the caller's
        to close)."""
        fds: list[int] = []
        with self._call_lock:
            self._send_locked(op, args)
            try:
                return self._receive_locked(None, fds), fds
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise

    def _send_locked(self, op: str, args: Mapping[str, object]) -> None:
        data = encode({"op": op, **args, "v": PROTOCOL_VERSION})
        try:
            send_frame(self._open_sock(), data)
        except OSError as exc:
            raise self._lost(exc) from exc

    def _receive_locked(self, timeout: float | None, fds: list[int] | None = None) -> Message:
        sock = self._open_sock()
        try:
            sock.settimeout(timeout)
            reply = decode(recv_frame(sock, MAX_MESSAGE, fds))
            sock.settimeout(None)
        except (OSError, EOFError, ServiceError) as exc:
            raise self._lost(exc) from exc
        reply.fields.pop("v")
        if "error" in reply:
            _raise_remote(reply["error"])
        return reply

    def _open_sock(self) -> socket.socket:
        if self._sock is None:
            raise ServiceError(f"this Client of catalog {self._root} is closed; make a new one")
        return self._sock

    def _lost(self, exc: BaseException) -> ServiceError:
        closed = self._closed
        self.close()
        if closed:  # close() of this process, from another thread: the service is fine
            return ServiceError(
                f"this connection to the tabloader service of catalog {self._root} was "
                "closed (close() from another thread) while a request waited for its "
                "reply; connect again to go on"
            )
        return ServiceError(
            f"lost the tabloader service for catalog {self._root} ({describe(exc)}); the "
            "jobs' places in their epochs went with it. Make a new JobDataset or RemoteLoader "
            "(it starts a new service), with state= a state_dict() you saved to resume"
        )

    def close(self) -> None:
        """Close the connection (a call in flight in another thread raises). Idempotent."""
        self._closed = True
        with self._sock_lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
                self._sock.close()
                self._sock = None


class BadMessage(ServiceError):
    """A whole frame arrived but is not a JSON object of this protocol version."""


def send_frame(sock: socket.socket, data: bytes, fds: list[int] | None = None) -> None:
    """Send one message's bytes (``encode``) with its length prefix, and ``fds`` with them."""
    frame = _HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [frame], fds, socket.MSG_NOSIGNAL) if fds else 0
    sock.sendall(frame[sent:], socket.MSG_NOSIGNAL)  # EPIPE, never SIGPIPE


def recv_frame(sock: socket.socket, limit: int, fds: list[int] | None = None) -> bytearray:
    """Read one frame of at most ``limit`` bytes (EOFError: the peer closed before it); the
    descriptors sent with it are appended to ``fds`` (None: any are closed unread)."""
    if fds is None:
        header = _recv_exact(sock, _HEADER.size)
    else:
        first, got, flags, _ = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
        fds += got
        if flags & socket.MSG_CTRUNC:
            raise ServiceError("a reply carried more descriptors than this client takes")
        header = bytearray(first) + _recv_exact(sock, _HEADER.size - len(first))
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


# -- values in messages (JSON has no bytes: those travel as hex) ---------------------------------
def report_to_wire(values: np.ndarray) -> str:
    """A report's ids (int64) or losses (float64) for a message: little-endian bytes, in hex
    (exact, and 20x faster to encode than a JSON list of floats)."""
    return values.astype(values.dtype.newbyteorder("<"), copy=False).tobytes().hex()


def report_from_wire(msg: Mapping[str, object]) -> tuple[np.ndarray, np.ndarray]:
    """The ids and losses of a ``report`` request, bounded and checked (``report_arrays``).

    Raises:
        ServiceError: a field is missing, not hex of whole 8-byte values, or over the bound.
        LoaderError: the arrays themselves are bad (lengths, non-finite losses).
    """
    limit = REPORT_ROWS_MAX * 16  # hex digits of the most rows one report carries
    arrays = []
    for key, dtype in (("ids", "<i8"), ("losses", "<f8")):
        text = msg.get(key)
        if not isinstance(text, str) or len(text) > limit or len(text) % 16:
            what = f"{len(text)} hex digits" if isinstance(text, str) else type(text).__name__
            raise ServiceError(
                f"A report's {key!r} must be hex of at most {REPORT_ROWS_MAX} 8-byte values, "
                f"got {what}; is the client another tabloader version?"
            )
        try:
            arrays.append(np.frombuffer(bytes.fromhex(text), dtype=dtype))
        except ValueError:
            raise ServiceError(f"A report's {key!r} is not hex.") from None
    return report_arrays(arrays[0], arrays[1])


def table_to_wire(table: pa.Table) -> str:
    """A statement's result table for a message: an Arrow IPC stream, in hex."""
    import pyarrow as pa  # here: a job process that only reads batches never needs it

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return str(sink.getvalue().to_pybytes().hex())


def table_from_wire(text: str) -> pa.Table:
    """The table that ``table_to_wire`` put in a message."""
    import pyarrow as pa

    return pa.ipc.open_stream(pa.py_buffer(bytes.fromhex(text))).read_all()


class DatasetWire(TypedDict):
    """A dataset version in a message (``dataset_to_wire``)."""

    name: str
    version: int
    stored: str  # its stored schema, Arrow IPC in hex
    class_names: dict[str, list[str]]
    description: str
    root: str  # the store's URI
    parts: list[Mapping[str, Any]]  # each PartInfo's fields (dataclasses.asdict)


def dataset_to_wire(ds: Dataset) -> DatasetWire:
    """A dataset version for a message: what a client needs to read its files itself (the
    parts and schema; no payload byte crosses the socket)."""
    reader = ds.reader
    return {
        "name": ds.name,
        "version": ds.version,
        "stored": reader.schema.serialize().to_pybytes().hex(),
        "class_names": ds.class_names,
        "description": ds.description,
        "root": reader.store.uri,
        "parts": [dataclasses.asdict(p) for p in reader.parts],
    }


def dataset_from_wire(wire: DatasetWire) -> Dataset:
    """The ``Dataset`` that ``dataset_to_wire`` put in a message, with a reader of its own."""
    import pyarrow as pa

    from tabloader.catalog._bitmaps import ID_COLUMN
    from tabloader.catalog._model import Dataset
    from tabloader.catalog.storage import DatasetReader, PartInfo
    from tabloader.catalog.storage._values import is_payload

    stored = pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(wire["stored"])))
    parts = [PartInfo(**p) for p in wire["parts"]]
    reader = DatasetReader(str(wire["root"]), parts, stored)
    schema = pa.schema([pa.field(ID_COLUMN, pa.int64(), nullable=False), *stored])
    queryable = tuple(f.name for f in schema if not is_payload(f.type))
    return Dataset(
        wire["name"],
        int(wire["version"]),
        reader.num_rows,
        schema,
        dict(wire["class_names"]),
        queryable,
        str(wire["description"]),
        reader,
    )


class JobFieldsWire(TypedDict):
    """What a ``Job`` and a ``JobInfo`` both say, in a message."""

    name: str
    dataset: str
    dataset_version: int
    columns: list[str]
    predicate: str | None
    options: Mapping[str, object]


class JobWire(JobFieldsWire):
    """A job in a message (``job_to_wire``)."""

    ids: str  # the bitmap, serialized, in hex
    weights: str | None  # float64 little-endian, in hex


def job_fields_to_wire(job: Job | JobInfo) -> JobFieldsWire:
    """The fields a job and its info share, for a message."""
    return {
        "name": job.name,
        "dataset": job.dataset,
        "dataset_version": job.dataset_version,
        "columns": list(job.columns),
        "predicate": job.predicate,
        "options": job.options,
    }


def job_fields_from_wire(
    wire: JobFieldsWire,
) -> tuple[str, str, int, tuple[str, ...], str | None, dict[str, object]]:
    """The fields that ``job_fields_to_wire`` put in a message, in ``Job``'s order."""
    return (
        wire["name"],
        wire["dataset"],
        wire["dataset_version"],
        tuple(wire["columns"]),
        wire["predicate"],
        dict(wire["options"]),
    )


def job_to_wire(job: Job) -> JobWire:
    """A job for a message: its bitmap serialized, and its weights (float64 little-endian, or
    None), in hex."""
    weights = None if job.weights is None else job.weights.astype("<f8").tobytes().hex()
    return {**job_fields_to_wire(job), "ids": job.ids.serialize().hex(), "weights": weights}


def job_from_wire(wire: JobWire) -> Job:
    """The ``Job`` that ``job_to_wire`` put in a message."""
    import numpy as np
    from pyroaring import BitMap

    from tabloader.catalog._model import Job

    ids = BitMap.deserialize(bytes.fromhex(wire["ids"]))
    hex_weights, weights = wire.get("weights"), None
    if hex_weights is not None:
        weights = np.frombuffer(bytes.fromhex(hex_weights), dtype="<f8").astype(np.float64)
    return Job(*job_fields_from_wire(wire), ids, weights)


class ResultWire(TypedDict, total=False):
    """A statement's or import's result in a message (``result_to_wire``): its ``kind``
    and the one field that kind has."""

    kind: str  # "table", "dataset", "job", "none" or "text"
    ipc: str
    dataset: DatasetWire
    job: JobWire
    text: str


def result_to_wire(result: Any) -> ResultWire:
    """A statement's or import's result for a message: a table (Arrow IPC), a dataset, a job,
    None, or text."""
    import pyarrow as pa

    from tabloader.catalog._model import Dataset, Job

    if isinstance(result, pa.Table):
        return {"kind": "table", "ipc": table_to_wire(result)}
    if isinstance(result, Dataset):
        return {"kind": "dataset", "dataset": dataset_to_wire(result)}
    if isinstance(result, Job):
        return {"kind": "job", "job": job_to_wire(result)}
    if result is None:
        return {"kind": "none"}
    return {"kind": "text", "text": str(result)}


def result_from_wire(reply: ResultWire) -> Any:
    """The result that ``result_to_wire`` put in a message (the same types as in-process)."""
    kind = reply.get("kind")
    if kind == "table":
        return table_from_wire(reply["ipc"])
    if kind == "dataset":
        return dataset_from_wire(reply["dataset"])
    if kind == "job":
        return job_from_wire(reply["job"])
    return reply.get("text")


def encode(msg: Mapping[str, object]) -> bytes:
    """``msg`` (with its ``"v"``) as a frame's bytes."""
    data = json.dumps(msg).encode()
    if len(data) > MAX_MESSAGE:
        raise ServiceError(f"a message of {len(data)} bytes is over MAX_MESSAGE ({MAX_MESSAGE})")
    return data


def decode(data: bytes | bytearray) -> Message:
    """The message in a frame's bytes (BadMessage: not a JSON object of this version)."""
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BadMessage(f"a message is not JSON ({exc})") from None
    if not isinstance(msg, dict):
        raise BadMessage(f"a message is a JSON {type(msg).__name__}, not an object")
    version = msg.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise BadMessage(
            f"a message has protocol version {version!r}, this end speaks {PROTOCOL_VERSION}; "
            "run the service and its clients from the same tabloader"
        )
    return Message(msg)


class Message(Mapping[str, Any]):
    """One message as it entered (``decode``): a request to the service, or a reply to a
    client. Its fields are JSON values as they came; the readers here check a field and
    raise the one-line ``ServiceError`` that a malformed request gets."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def __repr__(self) -> str:
        return f"Message({self.fields!r})"

    def string(self, key: str) -> str:
        """Field ``key``, which must be a string."""
        return string_value(self.fields.get(key), key)

    def stalls(self) -> tuple[float, float, float]:
        """The client's own stall times since its last request: ``wait_s``, ``compute_s``
        and ``augment_s`` (seconds; 0 when not sent)."""
        get = self.fields.get
        times = (get("wait_s", 0.0), get("compute_s", 0.0), get("augment_s", 0.0))
        if not all(isinstance(v, (int, float)) and 0 <= v < 1e9 for v in times):
            raise ServiceError(f"Stall times must be seconds, got {times!r}.")
        return float(times[0]), float(times[1]), float(times[2])

    def tickets(self) -> list[int]:
        """The tickets of the batches a client is done with (``release``): at most
        ``RELEASE_MAX`` whole numbers (a client holds a few batches at a time).

        Raises:
            ServiceError: anything else, in one line (no traceback in the service's log).
        """
        tickets = self.fields.get("release")
        if tickets is None:
            return []
        if (
            not isinstance(tickets, list)
            or len(tickets) > RELEASE_MAX
            or not all(type(t) is int and 0 <= t < 1 << 32 for t in tickets)
        ):
            raise ServiceError(
                f"'release' lists the tickets of batches a client is done with, at most "
                f"{RELEASE_MAX} whole numbers; got {str(tickets)[:60]}. Is the client another "
                "tabloader version?"
            )
        return tickets


def string_value(value: object, key: str) -> str:
    """A request's ``value`` of field ``key``, which must be a string."""
    if not isinstance(value, str):
        raise ServiceError(f"The request needs a string {key!r}, got {value!r}.")
    return value


class Empty(TypedDict):
    """A reply with nothing to say but that the request was done."""


class HelloReply(TypedDict):
    """``hello``: the service's pid, catalog and shared memory's name."""

    pid: int
    catalog: str
    segment: str


class SegmentReply(TypedDict):
    """``segment``: the arena's shared memory, and a read-only descriptor of it."""

    segment: str
    size: int
    pid: int
    _fds: list[int]


class _Opened(TypedDict):
    job: str
    epoch: int
    spec: Mapping[str, object]  # JobSpec.to_wire()
    segment: str
    size: int
    pid: int


class OpenReply(_Opened, total=False):
    """``open``: the job, its epoch and spec, and the service's memory (a descriptor of it
    when the client maps none yet)."""

    _fds: list[int]


class BatchReply(TypedDict):
    """``next``: a batch, laid out in shared memory (``HandedBatch.to_wire``)."""

    ticket: int
    epoch: int
    batch: Mapping[str, object]


class EndReply(TypedDict):
    """``next`` after the job's last epoch."""

    end: bool
    epoch: int


class OptionsReply(TypedDict):
    options: Mapping[str, object]


class RowsReply(TypedDict):
    rows: int


class EpochReply(TypedDict):
    epoch: int


class StateReply(TypedDict):
    state: Mapping[str, object]  # state_to_wire()


class StatsReply(TypedDict):
    stats: Mapping[str, object]  # the engine's counters, as JSON values


class ErrorReply(TypedDict):
    """The reply that a client raises as the handler's error (``error_reply``)."""

    error: dict[str, object]  # type (a class of tabloader.catalog._errors), message, attrs
    v: int


def error_reply(exc: TabloaderError) -> ErrorReply:
    """The reply that the client raises as ``exc`` (its class, message and plain attributes)."""
    attrs = {
        k: v
        for k, v in vars(exc).items()
        if not k.startswith("_") and isinstance(v, str | int | float | bool | None)
    }
    name = "ServiceError" if isinstance(exc, BadMessage) else type(exc).__name__
    return {"error": {"type": name, "message": str(exc), "attrs": attrs}, "v": PROTOCOL_VERSION}


def _raise_remote(error: Any) -> NoReturn:
    """Raise a reply's error as the class of that name in ``tabloader.catalog._errors``."""
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


def deliver_challenge(sock: socket.socket, key: bytes) -> None:
    """Check that the peer holds ``key`` (``multiprocessing.connection.deliver_challenge``)."""
    nonce = secrets.token_bytes(32)
    send_frame(sock, _CHALLENGE + nonce)
    ok = hmac.compare_digest(recv_frame(sock, 256), hmac.digest(key, nonce, "sha256"))
    send_frame(sock, _WELCOME if ok else _FAILURE)
    if not ok:
        raise AuthenticationError("the digest received was wrong")


def answer_challenge(sock: socket.socket, key: bytes) -> None:
    """Prove to the peer that we hold ``key`` (``multiprocessing.connection.answer_challenge``)."""
    challenge = recv_frame(sock, 256)
    if not challenge.startswith(_CHALLENGE):
        raise AuthenticationError("the peer sent no challenge")
    send_frame(sock, hmac.digest(key, bytes(challenge[len(_CHALLENGE) :]), "sha256"))
    if recv_frame(sock, 256) != _WELCOME:
        raise AuthenticationError("the digest sent was rejected")


def describe(exc: BaseException) -> str:
    """A connection's fault in a few words, for a log line or an error message."""
    if isinstance(exc, EOFError):
        return "end of file"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


def _private_dir(path: Path, create: bool) -> None:
    """Check that ``path`` is a folder of this user's alone (mode 0700), creating it first
    with ``create``; without, a missing folder is no error (the caller finds nothing in it)."""
    if not os.path.lexists(path):
        if not create:
            return
        _make_private_dir(path)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ServiceError(f"{path} is not a directory; remove it")
    if st.st_uid != os.getuid():
        raise ServiceError(f"{path} belongs to uid {st.st_uid}, not to you; remove it")
    if st.st_mode & 0o077:
        mode = stat.filemode(st.st_mode)
        raise ServiceError(f"{path} is open to others ({mode}); run `chmod 700 {path}`")


def _make_private_dir(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask
    except FileExistsError:  # made meanwhile: checked as any other
        pass
    except OSError as exc:
        raise ServiceError(
            f"cannot create the service directory {path}: {exc.strerror}. The loader service "
            f"keeps its socket there (in the catalog directory, or in /tmp for a catalog this "
            f"user may not write): make {path.parent} writable for this user, or free space "
            "there."
        ) from exc
