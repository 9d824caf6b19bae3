"""``tabloader.connect``: a catalog, the same to its user whether its loader service runs or not.

A :class:`Connection` talks to the catalog's running service (which holds it: DuckDB allows one
owner), or opens the catalog in this process when none runs; a catalog that another process holds
meanwhile is waited for, in turns (:mod:`tabloader.service._turns`; ``docs/many-processes.md``). A
``Connection`` is the catalog API (:class:`tabloader.catalog._api.CatalogAPI`): each operation of
its table either calls the ``Catalog`` of this process or goes to the service as one request
(:mod:`tabloader.service._catalog_ops`, which says how values cross). Every method returns the same
types either way: ``sql`` a ``pyarrow.Table``, a ``Dataset``, a ``Job`` or None; ``dataset`` a
``catalog.Dataset`` whose ``take`` reads the storage files in this process (the service sends where
they are, never their bytes); ``job`` a ``catalog.Job`` (its bitmap travels serialized). Errors are
the same classes too (the service's are raised here as theirs).

What cannot be the same is said in one line with the fix: ``verify`` reads the catalog itself,
so it needs the service stopped; the service refuses DROP DATASET of a dataset its open jobs
read.

``catalog.open_catalog`` stays the low-level catalog of this process only.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

from tabloader import catalog
from tabloader.catalog._api import CatalogAPI, Operation, Wire
from tabloader.catalog._directory import is_open, resolve_root
from tabloader.catalog._errors import CatalogLockedError, ServiceError, ServiceStuckError
from tabloader.catalog._model import Job
from tabloader.catalog._options import default_cache_problem
from tabloader.service._catalog_ops import request
from tabloader.service._client import dial
from tabloader.service._protocol import Client, service_pid
from tabloader.service._turns import LockWait, Turn

if TYPE_CHECKING:
    from tabloader.catalog import Catalog


def connect(path: str | os.PathLike[str] | None = None, **options: Any) -> Connection:
    """The catalog at ``path`` (default as ``catalog.open_catalog``), through its service while one
    runs; ``options`` as ``catalog.open_catalog`` (they apply when this process opens it).

    A catalog that another process holds for a moment (a statement, an import, a service
    starting or stopping) is waited for, up to ``$TABLOADER_LOCK_WAIT`` seconds (default 60;
    see :mod:`tabloader.service._turns`): many processes that connect at once take turns.

    Raises:
        CatalogLockedError: another process held the catalog for all that time (it names that
            process and the ways out), or this process has it open already.
        ServiceStuckError: its service holds it but does not answer.
    """
    return Connection(path, **options)


def _warn_default_cache(job: Job) -> None:
    """Say here what ``Catalog.register_job`` said in the service (into its log), at the
    caller of the operation (past ``Connection._perform`` and ``tabloader.catalog._api``'s
    dispatch)."""
    problem = default_cache_problem(job.name, job.options, job.num_rows)
    if problem is not None:
        warnings.warn(problem, stacklevel=4)


class Connection(CatalogAPI):
    """A catalog seen from this process, with or without its service (see the module).

    Attributes:
        root: the catalog directory.
        service_pid: the pid of the service its calls go through, or None (opened here).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, **options: Any) -> None:
        self._local: Catalog | None = None
        self._ctl: Client | None = None
        self.service_pid: int | None = None
        self.root = resolve_root(path)
        self._turn = Turn(self.root)  # kept while the catalog is open here
        waiting = LockWait(self.root)
        try:
            while not self._try_open(path, options, waiting):
                pass
        except BaseException:
            self._turn.release()
            raise
        if self._local is not None:
            return
        self._turn.release()
        assert self._ctl is not None
        try:
            self.service_pid = int(self._ctl.call("hello")["pid"])
        except BaseException:
            self._ctl.close()
            raise

    def _try_open(self, path: Any, options: dict[str, Any], waiting: LockWait) -> bool:
        """One try (see :mod:`tabloader.service._turns`): open the catalog here (``_local``),
        or connect to its service (``_ctl``); else pause before the next (False)."""
        running = service_pid(self.root)
        if running is None:
            # (this process has it open: the open below says so at once, whoever has the turn)
            holder = None if is_open(self.root) else self._turn.take()
            if holder is not None:  # another process opens the catalog, or has it open
                waiting.pause(holder, cheap=True)
                return False
            try:
                self._local = catalog.open_catalog(path, **options)
                self.root = self._local.root
                return True
            except CatalogLockedError as locked:
                if locked.pid is None and is_open(self.root):  # this process has it
                    raise
                why = locked
        else:  # the catalog is its service's: this process takes no turn
            self._turn.release()
        try:
            self._ctl = dial(self.root, start=False)
            return True
        except ServiceStuckError:
            raise
        except ServiceError:  # no service, or one starting or stopping
            pass
        if running is not None:
            waiting.pause(running, service=True, cheap=True)
        else:
            waiting.pause(why.pid)
        return False

    def _perform(self, op: Operation, arguments: dict[str, Any]) -> Any:
        """Every operation of the API: by the catalog of this process, or by the service."""
        if self._local is not None:
            return op.call(self._local, arguments)
        if op.result is Wire.LOCAL:
            pid = self.service_pid
            raise CatalogLockedError(
                f"{op.name} reads catalog {self.root} itself, and its loader service (pid {pid}) "
                f"holds it: stop the service (`kill {pid}`; one started by a job also ends 30 s "
                f"after its last client leaves), then run {op.name} again."
            )
        if self._ctl is None:
            raise ServiceError(f"This connection to catalog {self.root} is closed; connect again.")
        result = request(self._ctl, self.root, op, arguments)
        if op.writes and isinstance(result, Job):  # REGISTER JOB, register_job
            _warn_default_cache(result)
        return result

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

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Close the catalog, or the connection to its service. Idempotent."""
        if self._local is not None:
            self._local.close()
            self._turn.release()  # after the catalog: the next process finds it free
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
