"""The service's catalog operations: what ``tabloader.connect`` sends while a service runs.

:class:`CatalogOps` holds the ``op_*`` handlers of a connection (the server's ``_Handler``
inherits them) for the catalog calls of :class:`tabloader.service.connection.Connection`:
datasets and jobs by name, their names, registering and dropping, and imports of data the
client spooled to a file. Each runs under the service's catalog lock, as ``op_sql`` does.

A dataset travels as its files' description (:func:`~tabloader.service.protocol.dataset_to_wire`),
so a client reads ``take`` rows from storage itself; a job travels with its bitmap serialized.

Exclusive access: statements that would pull data from under the service's open jobs are
refused with the fix (:class:`Statements`): DROP DATASET of a dataset an open job reads.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import TYPE_CHECKING, Any, Protocol, cast

from catalog.errors import DatasetInUseError, ServiceError
from tabloader.service.protocol import dataset_to_wire, job_to_wire, result_to_wire

if TYPE_CHECKING:
    from catalog import Catalog
    from catalog.sql.execute import StatementTarget
    from tabloader.engine import Loader


class ServiceView(Protocol):
    """What these handlers use of the server's ``Service`` (no import of the server: it
    imports this module)."""

    catalog: Catalog
    loader: Loader
    lock: threading.RLock | threading.Lock


__all__ = ["CatalogOps", "Statements", "string_arg"]


def string_arg(msg: dict[str, Any], key: str) -> str:
    """Request argument ``key``, which must be a string."""
    value = msg.get(key)
    if not isinstance(value, str):
        raise ServiceError(f"The request needs a string {key!r}, got {value!r}.")
    return value


def _optional(msg: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = msg.get(key)
    if value is None or (isinstance(value, kind) and (kind is bool or not isinstance(value, bool))):
        return value
    raise ServiceError(f"The request's {key!r} has the wrong type: {value!r}.")


class Statements:
    """The service's catalog as statements see it: every call goes to the catalog, but a
    DROP DATASET of a dataset that jobs open in this service read is refused (their readers
    would lose their files mid-epoch)."""

    def __init__(self, service: ServiceView) -> None:
        self._service = service

    def __getattr__(self, name: str) -> Any:
        return getattr(self._service.catalog, name)

    def sql(self, text: str) -> Any:
        from catalog.sql.execute import execute

        return execute(cast("StatementTarget", self), text)

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


class CatalogOps:
    """The catalog's ``op_*`` handlers of one service connection (see the module docstring)."""

    service: Any  # the server's Service (this module cannot import it; see ServiceView)

    def op_dataset(self, msg: dict[str, Any]) -> dict[str, Any]:
        name, version = string_arg(msg, "name"), _optional(msg, "version", int)
        with self.service.lock:
            return {"dataset": dataset_to_wire(self.service.catalog.dataset(name, version=version))}

    def op_job(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self.service.lock:
            return {"job": job_to_wire(self.service.catalog.job(string_arg(msg, "name")))}

    def op_names(self, msg: dict[str, Any]) -> dict[str, Any]:
        kind = msg.get("kind")
        if kind not in ("datasets", "jobs"):
            raise ServiceError(f"'kind' is 'datasets' or 'jobs', got {kind!r}.")
        with self.service.lock:
            cat = self.service.catalog
            return {"names": cat.dataset_names() if kind == "datasets" else cat.job_names()}

    def op_register_job(self, msg: dict[str, Any]) -> dict[str, Any]:
        columns = _optional(msg, "columns", (str, list))
        with self.service.lock:
            job = self.service.catalog.register_job(
                string_arg(msg, "name"),
                string_arg(msg, "dataset"),
                columns=columns,
                where=_optional(msg, "where", str),
                options=_optional(msg, "options", dict),
                replace=bool(_optional(msg, "replace", bool)),
            )
        return {"job": job_to_wire(job)}

    def op_unregister_job(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self.service.lock:
            self.service.catalog.unregister_job(
                string_arg(msg, "name"), if_exists=bool(_optional(msg, "if_exists", bool))
            )
        return {}

    def op_drop_dataset(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self.service.lock:
            Statements(self.service).drop_dataset(
                string_arg(msg, "name"),
                cascade=bool(_optional(msg, "cascade", bool)),
                if_exists=bool(_optional(msg, "if_exists", bool)),
            )
        return {}

    def op_import_spooled(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Import the Arrow IPC stream a client wrote to ``path`` (data it had in memory), with
        the class names and description of its source."""
        from catalog.importers import open_source

        source = open_source("arrow", string_arg(msg, "path"))
        source = dataclasses.replace(
            source,
            class_names=_optional(msg, "class_names", dict) or {},
            description=_optional(msg, "description", str) or source.description,
        )
        with self.service.lock:
            dataset = self.service.catalog.import_source(
                string_arg(msg, "name"), source, append=bool(_optional(msg, "append", bool))
            )
        return result_to_wire(dataset)
