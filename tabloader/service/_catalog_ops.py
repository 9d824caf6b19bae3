"""The catalog's operations over the service's socket: one request, dispatched from one table.

``tabloader.catalog._api.OPERATIONS`` lists the operations and how each argument and result crosses
the wire; this module holds those codecs and both ends of the one request:

* :func:`request` (the client, ``tabloader.connect``'s ``Connection``): sends
  ``{"op": "catalog", "call": name, "args": {...}}`` and decodes the reply's ``result``;
* :meth:`CatalogOps.op_catalog` (the server's ``_Handler`` inherits it): checks each argument
  against its kind, runs the operation on :class:`ServiceCatalog` under the service's catalog
  lock, and encodes the result.

A dataset travels as its files' description (:func:`~tabloader.service._protocol.dataset_to_wire`),
so a client reads ``take`` rows from storage itself; a job travels with its bitmap serialized.
Data in memory (``import_arrow``, a HuggingFace ``Dataset``) is spooled by the client to an
Arrow IPC file in the catalog's private service directory and imported from there; paths go
absolute, and so do the relative paths of a statement.

Exclusive access: statements that would pull data from under the service's open jobs are
refused with the fix (:class:`ServiceCatalog`): DROP DATASET of a dataset an open job reads.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from tabloader.catalog._api import OPERATIONS, Arg, Operation, StatementTarget, Wire
from tabloader.catalog._errors import DatasetInUseError, ServiceError, StorageError
from tabloader.service._protocol import (
    Client,
    JobFieldsWire,
    Message,
    dataset_from_wire,
    dataset_to_wire,
    job_fields_from_wire,
    job_fields_to_wire,
    job_from_wire,
    job_to_wire,
    result_from_wire,
    result_to_wire,
    runtime_dir,
    string_value,
    table_from_wire,
    table_to_wire,
)

if TYPE_CHECKING:
    import pyarrow as pa

    from tabloader.catalog._limits import Limits
    from tabloader.catalog._model import JobInfo
    from tabloader.engine import Loader


class ServiceView(Protocol):
    """What these handlers use of the server's ``Service`` (no import of the server: it
    imports this module)."""

    catalog: StatementTarget
    loader: Loader
    lock: threading.RLock | threading.Lock


# -- the codecs: each kind of argument and result of tabloader.catalog._api
# ---------------------------------
class Spool:
    """The files a request's data in memory was written to, for the service to read; removed
    once the request is answered."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: list[Path] = []

    def new_file(self) -> Path:
        path = runtime_dir(self.root) / f"import-{uuid.uuid4().hex}.arrows"
        self.files.append(path)
        return path

    def remove(self) -> None:
        for path in self.files:
            path.unlink(missing_ok=True)


@dataclass(frozen=True)
class ArgCodec:
    """An argument kind: ``send`` makes the client's value a JSON value (``Spool`` for data
    written to files); ``receive`` checks the request's value in the service and makes it
    the operation's (raising ``ServiceError`` that names the argument)."""

    send: Callable[[Any, Spool], Any]
    receive: Callable[[Any, str], Any]


def _as_is(value: Any, _: Spool) -> Any:
    return value


def _typed(*kinds: type) -> Callable[[Any, str], Any]:
    """A check that the value is one of ``kinds`` (with ``type(None)``: it may be None); a
    bool is not an int."""

    def check(value: Any, key: str) -> Any:
        if isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool)):
            return value
        raise ServiceError(f"The request's {key!r} has the wrong type: {value!r}.")

    return check


class SourceWire(TypedDict):
    """Data a client had in memory, in a request: the Arrow IPC stream it wrote to ``path``,
    with its source's class names and description."""

    path: str
    class_names: dict[str, list[str]]
    description: str


# The disk faults of writing a spool file, each with its fix (the folder is named with it).
_SPOOL_FAULTS = {
    errno.ENOSPC: "the disk is full: free space on the disk that holds {folder}",
    errno.EDQUOT: "this user's disk quota is used up: free some of it on the disk that holds "
    "{folder}",
    errno.EROFS: "the disk is read-only: remount the disk that holds {folder} read-write",
}


def _send_source(source: Any, spool: Spool) -> SourceWire:
    import pyarrow as pa

    path = spool.new_file()
    try:
        with pa.OSFile(str(path), "wb") as out, pa.ipc.new_stream(out, source.schema) as writer:
            for batch in source.batches:
                writer.write_batch(batch)
    except OSError as exc:
        fault = _SPOOL_FAULTS.get(exc.errno or 0)
        if fault is None:
            raise
        raise StorageError(
            f"Importing data held in memory through the loader service failed writing it to "
            f"{path}, for the service to read: {os.strerror(exc.errno or 0)}. Nothing was "
            f"imported; {fault.format(folder=path.parent)}, and import again.",
            path=str(path),
        ) from exc
    return {
        "path": str(path),
        "class_names": source.class_names,
        "description": source.description,
    }


def _receive_source(value: Any, key: str) -> Any:
    """The Arrow IPC stream a client wrote (data it had in memory), with the class names and
    description of its source."""
    from tabloader.catalog._importers import open_source

    value = _typed(dict)(value, key)
    source = open_source("arrow", string_value(value.get("path"), f"{key}.path"))
    return dataclasses.replace(
        source,
        class_names=_typed(dict, type(None))(value.get("class_names"), key) or {},
        description=_typed(str, type(None))(value.get("description"), key) or source.description,
    )


def _receive_dataset(value: Any, key: str) -> Any:
    if value is None:
        return None
    try:
        return dataset_from_wire(_typed(dict)(value, key))
    except (KeyError, TypeError, ValueError) as exc:
        raise ServiceError(f"The request's {key!r} is not a dataset: {exc!r}.") from exc


def _absolute_path(path: Any, _: Any) -> str:
    """A local path made absolute; a URI (``s3://bucket/prefix``) as it is."""
    text = str(path)
    return text if "://" in text else str(Path(path).absolute())


ARGS: dict[Arg, ArgCodec] = {
    Arg.STR: ArgCodec(_as_is, string_value),
    Arg.STR_OR_NONE: ArgCodec(_as_is, _typed(str, type(None))),
    Arg.INT: ArgCodec(_as_is, _typed(int)),
    Arg.INT_OR_NONE: ArgCodec(_as_is, _typed(int, type(None))),
    Arg.BOOL: ArgCodec(_as_is, _typed(bool)),
    Arg.STATEMENT: ArgCodec(lambda text, _: absolute_paths(text), string_value),
    Arg.PATH: ArgCodec(_absolute_path, string_value),
    Arg.COLUMNS: ArgCodec(
        lambda cols, _: cols if cols is None or isinstance(cols, str) else list(cols),
        _typed(str, list, type(None)),
    ),
    Arg.WHERE: ArgCodec(
        lambda where, _: where if where is None or isinstance(where, str) else where.sql("duckdb"),
        _typed(str, type(None)),
    ),
    Arg.OPTIONS: ArgCodec(_as_is, _typed(dict, type(None))),
    Arg.DATASET_OR_NONE: ArgCodec(
        lambda ds, _: None if ds is None else dataset_to_wire(ds), _receive_dataset
    ),
    Arg.SOURCE: ArgCodec(_send_source, _receive_source),
}
"""The codec of each kind of argument."""


def absolute_paths(statement: str) -> str:
    """The statement a client sends: its relative FROM path made absolute (``absolute_paths``).
    Only CREATE and APPEND TO DATASET carry one: a text without either word is sent as it is,
    unparsed, so a client's REGISTER JOB does not import the parser (sqlglot: 0.15-0.35 s of
    a fresh process's first statement); the service parses every statement it runs."""
    lowered = statement.lower()
    if "create" not in lowered and "append" not in lowered:
        return statement
    from tabloader.catalog._sql.dialect import absolute_paths  # sqlglot

    return absolute_paths(statement)


@dataclass(frozen=True)
class ResultCodec:
    """A result kind: ``to_wire`` in the service, ``from_wire`` in the client."""

    to_wire: Callable[[Any], Any]
    from_wire: Callable[[Any], Any]


def _array_to_wire(array: pa.Array) -> str:
    import pyarrow as pa

    return table_to_wire(pa.table({"values": array}))


def _array_from_wire(text: str) -> pa.Array:
    return table_from_wire(text).column(0).combine_chunks()


class JobInfoWire(JobFieldsWire):
    """A ``JobInfo`` in a reply (``SHOW JOBS``)."""

    num_rows: int


def _infos_to_wire(infos: list[JobInfo]) -> list[JobInfoWire]:
    return [{**job_fields_to_wire(i), "num_rows": i.num_rows} for i in infos]


def _infos_from_wire(wire: list[JobInfoWire]) -> list[JobInfo]:
    from tabloader.catalog._model import JobInfo

    return [JobInfo(*job_fields_from_wire(i), i["num_rows"]) for i in wire]


def _local(_: Any) -> Any:
    raise ServiceError("This operation reads the catalog itself: it never crosses the wire.")


RESULTS: dict[Wire, ResultCodec] = {
    Wire.NONE: ResultCodec(lambda _: None, lambda _: None),
    Wire.NAMES: ResultCodec(list, list),
    Wire.DATASET: ResultCodec(dataset_to_wire, dataset_from_wire),
    Wire.JOB: ResultCodec(job_to_wire, job_from_wire),
    Wire.JOB_INFOS: ResultCodec(_infos_to_wire, _infos_from_wire),
    Wire.ARRAY: ResultCodec(
        _array_to_wire, lambda t: table_from_wire(t).column(0).combine_chunks()
    ),
    Wire.RESULT: ResultCodec(result_to_wire, result_from_wire),
    Wire.LOCAL: ResultCodec(_local, _local),
}
"""The codec of each kind of result."""


# -- the client's end --------------------------------------------------------------------------
def request(client: Client, root: Path, op: Operation, arguments: dict[str, Any]) -> Any:
    """Run ``op`` in the service of catalog ``root`` that ``client`` is connected to: the
    one request of every catalog operation."""
    spool = Spool(root)
    try:
        args = {name: ARGS[kind].send(arguments[name], spool) for name, kind in op.args}
        reply = client.call("catalog", call=op.name, args=args)
    finally:
        spool.remove()
    return RESULTS[op.result].from_wire(reply.get("result"))


# -- the service's end -------------------------------------------------------------------------
class ServiceCatalog(StatementTarget):
    """The service's catalog as statements and clients see it: every operation goes to the
    catalog, but a DROP DATASET of a dataset that jobs open in this service read is refused
    (their readers would lose their files mid-epoch)."""

    def __init__(self, service: ServiceView) -> None:
        self._service = service
        self.root = service.catalog.root
        self.limits: Limits = service.catalog.limits

    def _perform(self, op: Operation, arguments: dict[str, Any]) -> Any:
        return op.call(self._service.catalog, arguments)

    @property
    def exists(self) -> bool:
        return self._service.catalog.exists

    def close(self) -> None:
        """Nothing: the service closes its catalog."""

    def query(self, sql: str) -> pa.Table:
        return self._service.catalog.query(sql)

    def sql(self, statement: str) -> Any:
        from tabloader.catalog._sql.execute import execute

        return execute(self, statement)

    def drop_dataset(self, name: str, *, cascade: bool = False, if_exists: bool = False) -> None:
        jobs = self._service.loader.stats()["jobs"]
        readers = sorted(j for j, s in jobs.items() if s.get("dataset") == name)
        if readers:
            pid = os.getpid()
            raise DatasetInUseError(
                f"Dataset '{name}' is read by job(s) {', '.join(readers)} open in the loader "
                f"service (pid {pid}); drop it once they are closed, or stop the service "
                f"(`kill {pid}`) first."
            )
        self._service.catalog.drop_dataset(name, cascade=cascade, if_exists=if_exists)


class CatalogReply(TypedDict):
    """The reply to a catalog operation: its result, as ``RESULTS`` puts it on the wire."""

    result: object


class CatalogOps:
    """The catalog's one request handler of a service connection (see the module)."""

    service: Any  # the server's Service (this module cannot import it; see ServiceView)

    def op_catalog(self, msg: Message) -> CatalogReply:
        name = msg.get("call")
        op = OPERATIONS.get(name) if isinstance(name, str) else None
        if op is None or op.result is Wire.LOCAL:
            raise ServiceError(
                f"Unknown catalog operation {name!r}; is the client another tabloader version?"
            )
        given = _typed(dict, type(None))(msg.get("args"), "args") or {}
        unknown = sorted(set(given) - {n for n, _ in op.args})
        if unknown:
            raise ServiceError(f"{op.name} takes no argument(s) {', '.join(map(repr, unknown))}.")
        args = {n: ARGS[kind].receive(given.get(n, op.defaults.get(n)), n) for n, kind in op.args}
        with self.service.lock:
            result = op.call(ServiceCatalog(self.service), args)
        return {"result": RESULTS[op.result].to_wire(result)}
