"""``tabloader.connect``: a catalog, the same to its user whether its loader service runs or not.

A :class:`Connection` opens the catalog in this process when no other process holds it, and
otherwise talks to the catalog's running service (which holds it: DuckDB allows one owner).
Every method returns the same types either way: ``sql`` a ``pyarrow.Table``, a ``Dataset``, a
``Job`` or None; ``dataset`` a ``catalog.Dataset`` whose ``take`` reads the storage files in
this process (the service sends where they are, never their bytes); ``job`` a ``catalog.Job``
(its bitmap travels serialized). Errors are the same classes too (the service's are raised
here as theirs).

What cannot be the same is said in one line with the fix: ``verify`` reads the catalog itself,
so it needs the service stopped; the service refuses DROP DATASET of a dataset its open jobs
read. Data in memory (``import_arrow``, a HuggingFace ``Dataset``) is spooled to an Arrow IPC
file in the catalog's private service directory and imported from there; paths go absolute.

``catalog.connect`` stays the low-level catalog of this process only.
"""

from __future__ import annotations

import os
import re
import time
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

import catalog
from catalog.directory import resolve_root
from catalog.errors import CatalogLockedError, ServiceError, ServiceStuckError
from catalog.model import Job
from catalog.options import default_cache_problem
from catalog.sql.dialect import absolute_paths
from tabloader.service.client import dial
from tabloader.service.protocol import (
    Client,
    dataset_from_wire,
    job_from_wire,
    result_from_wire,
    runtime_dir,
    service_pid,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from sqlglot import exp

    from catalog import Catalog, Dataset
    from catalog.importers import Source
    from catalog.storage.verify import VerifyReport

__all__ = ["Connection", "connect"]


def connect(path: str | os.PathLike[str] | None = None, **options: Any) -> Connection:
    """The catalog at ``path`` (default as ``catalog.connect``), through its service while one
    runs; ``options`` as ``catalog.connect`` (they apply when this process opens it).

    Raises:
        CatalogLockedError: another process holds the catalog and it is not a service.
        ServiceStuckError: its service holds it but does not answer.
    """
    return Connection(path, **options)


RACE_S = 10.0
"""Seconds a connection waits for a service that holds the catalog but has no socket (it is
starting, or stopping): then it goes through the service, or opens the catalog itself."""
RACE_POLL_S = 0.05


def _service_holds(root: Path, locked: CatalogLockedError) -> bool:
    """Whether the process that holds ``root`` (``locked`` names its pid) is its service: one
    holds the service lock, or the DuckDB lock's holder runs ``serve`` (a service that let
    its service lock go, closing its catalog)."""
    if service_pid(root) is not None:
        return True
    pid = re.search(r"\(PID (\d+)\)", str(locked))
    if pid is None:  # another Catalog of this process
        return False
    try:
        with open(f"/proc/{pid.group(1)}/cmdline", "rb") as f:
            return b"serve" in f.read(1 << 16).split(b"\0")
    except FileNotFoundError:  # it exited meanwhile: the next try opens the catalog
        return True
    except OSError:
        return False


def _warn_default_cache(job: Job) -> None:
    """Say here what ``Catalog.register_job`` said in the service (into its log)."""
    problem = default_cache_problem(job.name, job.options, job.num_rows)
    if problem is not None:
        warnings.warn(problem, stacklevel=3)


class Connection:
    """A catalog seen from this process, with or without its service (see the module).

    Attributes:
        root: the catalog directory.
        service_pid: the pid of the service its calls go through, or None (opened here).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, **options: Any) -> None:
        self._local: Catalog | None = None
        self._ctl: Client | None = None
        self.service_pid: int | None = None
        deadline = time.monotonic() + RACE_S
        while self._ctl is None:
            try:
                self._local = catalog.connect(path, **options)
                self.root = self._local.root
                return
            except CatalogLockedError as locked:
                self.root = resolve_root(path)
                try:
                    self._ctl = dial(self.root, start=False)
                except ServiceStuckError:
                    raise
                except ServiceError:  # no socket: a service starting or stopping, or no service
                    if time.monotonic() > deadline or not _service_holds(self.root, locked):
                        raise locked from None
                    time.sleep(RACE_POLL_S)
        try:
            self.service_pid = int(self._ctl.call("hello")["pid"])
        except BaseException:
            self._ctl.close()
            raise

    def _call(self, op: str, **args: Any) -> dict[str, Any]:
        if self._ctl is None:
            raise ServiceError(f"This connection to catalog {self.root} is closed; connect again.")
        return self._ctl.call(op, **args)

    @property
    def catalog(self) -> Catalog:
        """The catalog opened in this process (what ``tabloader.Loader`` reads).

        Raises:
            CatalogLockedError: the service holds it (read jobs with ``JobDataset`` or
                ``RemoteLoader``, which go through the service).
        """
        if self._local is None:
            raise CatalogLockedError(
                f"Catalog {self.root} is held by its loader service (pid {self.service_pid}), "
                "so this process cannot open it: read jobs through the service "
                "(tabloader.torch.JobDataset, or RemoteLoader), or stop the service first."
            )
        return self._local

    @property
    def exists(self) -> bool:
        """Whether the directory holds a catalog (a service runs only for one)."""
        return self._local.exists if self._local is not None else True

    # -- statements --------------------------------------------------------------------------
    def sql(self, statement: str) -> Any:
        """Run one statement: a ``pyarrow.Table`` (SELECT, SHOW, DESCRIBE), the ``Dataset``
        (CREATE DATASET), the ``Job`` (REGISTER JOB), or None. A relative path in it means one
        in this process's working directory."""
        if self._local is not None:
            return self._local.sql(statement)
        result = result_from_wire(self._call("sql", statement=absolute_paths(statement)))
        if isinstance(result, Job):  # REGISTER JOB
            _warn_default_cache(result)
        return result

    # -- datasets ----------------------------------------------------------------------------
    def dataset_names(self) -> list[str]:
        """Names of all datasets, sorted."""
        if self._local is not None:
            return self._local.dataset_names()
        return list(self._call("names", kind="datasets")["names"])

    def datasets(self) -> list[Dataset]:
        """All datasets (their latest versions), sorted by name."""
        return [self.dataset(n) for n in self.dataset_names()]

    def dataset(self, name: str, *, version: int | None = None) -> Dataset:
        """Dataset ``name`` at its latest version or at ``version`` (``take`` reads here)."""
        if self._local is not None:
            return self._local.dataset(name, version=version)
        return dataset_from_wire(self._call("dataset", name=name, version=version)["dataset"])

    def drop_dataset(self, name: str, *, cascade: bool = False, if_exists: bool = False) -> None:
        """Drop a dataset (refused by a service while its open jobs read it)."""
        if self._local is not None:
            return self._local.drop_dataset(name, cascade=cascade, if_exists=if_exists)
        self._call("drop_dataset", name=name, cascade=cascade, if_exists=if_exists)
        return None

    def verify(self, name: str | None = None) -> VerifyReport:
        """Check every stored byte of dataset ``name`` (default all); see ``Catalog.verify``.

        Raises:
            CatalogLockedError: a service holds the catalog (stop it first).
        """
        if self._local is None:
            pid = self.service_pid
            raise CatalogLockedError(
                f"verify reads catalog {self.root} itself, and its loader service (pid {pid}) "
                f"holds it: stop the service (`kill {pid}`; one started by a job also ends 30 s "
                "after its last client leaves), then run verify again."
            )
        return self._local.verify(name)

    # -- jobs --------------------------------------------------------------------------------
    def job_names(self) -> list[str]:
        """Names of all jobs, sorted."""
        if self._local is not None:
            return self._local.job_names()
        return list(self._call("names", kind="jobs")["names"])

    def jobs(self) -> list[Job]:
        """All registered jobs, sorted by name."""
        return [self.job(n) for n in self.job_names()]

    def job(self, name: str) -> Job:
        """Job ``name``, with its bitmap of row ids."""
        if self._local is not None:
            return self._local.job(name)
        return job_from_wire(self._call("job", name=name)["job"])

    def register_job(
        self,
        name: str,
        dataset: str,
        *,
        columns: str | Sequence[str] | None = None,
        where: str | exp.Expression | None = None,
        options: dict[str, Any] | None = None,
        replace: bool = False,
    ) -> Job:
        """Register a job (see ``Catalog.register_job``)."""
        if self._local is not None:
            return self._local.register_job(
                name, dataset, columns=columns, where=where, options=options, replace=replace
            )
        cols = columns if columns is None or isinstance(columns, str) else list(columns)
        text = where if where is None or isinstance(where, str) else where.sql("duckdb")
        reply = self._call(
            "register_job",
            name=name,
            dataset=dataset,
            columns=cols,
            where=text,
            options=options,
            replace=replace,
        )
        job = job_from_wire(reply["job"])
        _warn_default_cache(job)
        return job

    def unregister_job(self, name: str, *, if_exists: bool = False) -> None:
        """Remove job ``name``."""
        if self._local is not None:
            return self._local.unregister_job(name, if_exists=if_exists)
        self._call("unregister_job", name=name, if_exists=if_exists)
        return None

    # -- imports -----------------------------------------------------------------------------
    def _import_path(self, fmt: str, name: str, path: Any, **options: Any) -> Dataset:
        """Import from a path, here or in the service (given absolute)."""
        if self._local is not None:
            from catalog.importers import open_source

            append = options.pop("append")
            source = open_source(fmt, path, **options)
            return self._local.import_source(name, source, append=append)
        options = {k: v for k, v in options.items() if v is not None}
        path = str(Path(path).absolute())
        return result_from_wire(self._call("import", name=name, path=path, format=fmt, **options))  # type: ignore[no-any-return]

    def _import_memory(self, source: Source, name: str, append: bool) -> Dataset:
        """Import data this process holds: spooled to a private file the service reads."""
        if self._local is not None:
            return self._local.import_source(name, source, append=append)
        spool = runtime_dir(self.root) / f"import-{uuid.uuid4().hex}.arrows"
        try:
            with pa.OSFile(str(spool), "wb") as out, pa.ipc.new_stream(out, source.schema) as w:
                for batch in source.batches:
                    w.write_batch(batch)
            reply = self._call(
                "import_spooled",
                name=name,
                path=str(spool),
                append=append,
                class_names=source.class_names,
                description=source.description,
            )
        finally:
            spool.unlink(missing_ok=True)
        return result_from_wire(reply)  # type: ignore[no-any-return]

    def import_arrow(self, name: str, data: Any, *, append: bool = False) -> Dataset:
        """Import a ``pyarrow.Table``, ``RecordBatch`` or ``RecordBatchReader``."""
        from catalog.importers.arrow import open_arrow

        return self._import_memory(open_arrow(data), name, append)

    def import_parquet(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        append: bool = False,
        follow_links: bool = False,
    ) -> Dataset:
        """Import a Parquet file, directory or glob (see ``Catalog.import_parquet``)."""
        return self._import_path("parquet", name, path, append=append, follow_links=follow_links)

    def import_ipc(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        append: bool = False,
        follow_links: bool = False,
    ) -> Dataset:
        """Import Arrow IPC / Feather files (a path or a glob)."""
        return self._import_path("arrow", name, path, append=append, follow_links=follow_links)

    def import_imagefolder(
        self,
        name: str,
        root: str | os.PathLike[str],
        *,
        append: bool = False,
        follow_links: bool = False,
    ) -> Dataset:
        """Import ``root/<class>/<file>`` images: image, label, label_name, path."""
        return self._import_path(
            "imagefolder", name, root, append=append, follow_links=follow_links
        )

    def import_hf(
        self,
        name: str,
        dataset_or_path: Any,
        *,
        split: str | None = None,
        append: bool = False,
        follow_links: bool = False,
    ) -> Dataset:
        """Import a HuggingFace ``Dataset``, ``DatasetDict`` or ``save_to_disk`` folder."""
        if isinstance(dataset_or_path, (str, os.PathLike)):
            return self._import_path(
                "hf", name, dataset_or_path, split=split, append=append, follow_links=follow_links
            )
        from catalog.importers import open_source

        return self._import_memory(open_source("hf", dataset_or_path, split=split), name, append)

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Close the catalog, or the connection to its service. Idempotent."""
        if self._local is not None:
            self._local.close()
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        how = "in this process" if self.service_pid is None else f"service pid {self.service_pid}"
        return f"Connection('{self.root}', {how})"
