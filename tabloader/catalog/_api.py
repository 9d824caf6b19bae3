"""The catalog API: one table of the catalog's operations, and the protocol they make.

Each operation is one stub of :class:`CatalogAPI` marked ``@operation``: its signature and
docstring are the API; the decorator adds its row to ``OPERATIONS`` (its name, its arguments
and how each crosses the wire, read from their types, whether it writes, how its result
crosses the wire), as sqlglot's and DuckDB's tables of functions do. Every implementation is
driven by that table:

* ``Catalog`` implements each operation (the catalog opened in this process);
* a class that subclasses ``CatalogAPI`` and defines ``_perform(op, arguments)`` gets every
  operation as a method that calls it with the operation's row and its arguments by name:
  ``tabloader.connect``'s ``Connection`` (the ``Catalog`` of this process, or one generic
  request to the catalog's service, which dispatches it from the same table), the service's
  view of its catalog for statements, and a Ray node's catalog opened for each look-up.

Adding an operation: its stub here (signature, docstring, ``@operation`` row) and its
implementation in ``Catalog``; an argument of a new type needs its kind in ``ARG_OF_TYPE``, and
a new kind of argument or result its wire codec (``tabloader.service._catalog_ops``).

``Arg`` and ``Wire`` only name how values cross the wire; the codecs live with the service
protocol, which this package does not import.
"""

from __future__ import annotations

import enum
import functools
import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, ParamSpec, Protocol, TypeVar

if TYPE_CHECKING:
    from pathlib import Path

    import pyarrow as pa
    from sqlglot import exp

    from tabloader.catalog._importers import Source
    from tabloader.catalog._limits import Limits
    from tabloader.catalog._model import Dataset, Job, JobInfo
    from tabloader.catalog.storage._verify import VerifyReport

P = ParamSpec("P")
R = TypeVar("R")


class Arg(enum.Enum):
    """How an argument crosses the wire (its codec: ``tabloader.service._catalog_ops``)."""

    STR = "a string"
    STR_OR_NONE = "a string or None"
    INT = "an integer"
    INT_OR_NONE = "an integer or None"
    BOOL = "true or false"
    STATEMENT = "a statement (its relative paths made absolute by the client)"
    PATH = "a path (made absolute by the client)"
    COLUMNS = "a column, a list of columns, or None"
    WHERE = "a predicate in SQL (an expression goes as its text), or None"
    OPTIONS = "an object of job options, or None"
    DATASET_OR_NONE = "a dataset's files and schema, or None"
    SOURCE = "data in memory (spooled by the client to a private file the service reads)"


ARG_OF_TYPE: dict[str, Arg] = {
    "str": Arg.STR,
    "str | None": Arg.STR_OR_NONE,
    "int": Arg.INT,
    "int | None": Arg.INT_OR_NONE,
    "bool": Arg.BOOL,
    "str | os.PathLike[str]": Arg.PATH,
    "str | Sequence[str] | None": Arg.COLUMNS,
    "str | exp.Expression | None": Arg.WHERE,
    "dict[str, Any] | None": Arg.OPTIONS,
    "Dataset | None": Arg.DATASET_OR_NONE,
    "Source": Arg.SOURCE,
}
"""How an argument of each type (its annotation, as the stub writes it) crosses the wire."""


class Wire(enum.Enum):
    """How a result crosses the wire (its codec: ``tabloader.service._catalog_ops``)."""

    NONE = "nothing"
    NAMES = "a list of names"
    DATASET = "a dataset's files and schema (the client reads its rows itself)"
    JOB = "a job, its bitmap serialized"
    JOB_INFOS = "what is stored about each job"
    ARRAY = "an Arrow array"
    RESULT = "a statement's result: a table, a dataset, a job or nothing"
    LOCAL = "does not cross: it reads the catalog's files itself, so runs where it is open"


@dataclass(frozen=True)
class Operation:
    """One row of the table: a catalog operation.

    Attributes:
        name: the method's name, and the operation's name on the wire.
        args: each argument's name and how it crosses the wire, in the signature's order.
        positional: how many of them come before the ``*`` (passed by position, so an
            implementation may name them otherwise).
        defaults: the arguments' defaults (what a request that leaves one out means).
        writes: whether it may change the catalog (a read's answer can be cached until the
            catalog changes).
        result: how its result crosses the wire.
    """

    name: str
    args: tuple[tuple[str, Arg], ...]
    positional: int
    defaults: dict[str, Any]
    writes: bool
    result: Wire

    def call(self, target: CatalogAPI, arguments: dict[str, Any]) -> Any:
        """Run this operation on ``target`` (an implementation of its own)."""
        names = [name for name, _ in self.args]
        given = [arguments[name] for name in names[: self.positional]]
        keywords = {name: arguments[name] for name in names[self.positional :]}
        return getattr(target, self.name)(*given, **keywords)


OPERATIONS: dict[str, Operation] = {}
"""The table: every catalog operation by name (filled by ``@operation``)."""


def operation(
    result: Wire, *, writes: bool = False, **kinds: Arg
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Add the stub below to ``OPERATIONS`` and make it call ``self._perform(op, arguments)``.

    Each argument crosses the wire as its type says (``ARG_OF_TYPE``, read from the stub's
    annotations at import: the signature is the one place an argument's type is written);
    ``kinds`` names the kind of an argument whose type does not say it (a statement is a
    ``str``).
    """

    def register(stub: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(stub)
        params = list(signature.parameters.values())[1:]  # after self
        unknown = sorted(set(kinds) - {p.name for p in params})
        if unknown:
            raise TypeError(f"@operation of {stub.__name__}: it has no argument {unknown}")
        args = tuple((p.name, kinds.get(p.name) or _kind_of(stub, p)) for p in params)
        defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        positional = sum(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
        op = Operation(stub.__name__, args, positional, defaults, writes, result)
        OPERATIONS[op.name] = op
        names = [name for name, _ in args]

        @functools.wraps(stub)
        def perform(*given: P.args, **by_name: P.kwargs) -> R:
            bound = signature.bind(*given, **by_name)
            bound.apply_defaults()
            target, *values = bound.arguments.values()
            out: R = target._perform(op, dict(zip(names, values, strict=True)))
            return out

        return perform

    return register


def _kind_of(stub: Callable[..., Any], param: inspect.Parameter) -> Arg:
    kind = ARG_OF_TYPE.get(str(param.annotation))
    if kind is None:
        raise TypeError(
            f"@operation of {stub.__name__}: argument {param.name}'s type "
            f"{param.annotation!r} says no wire kind; give one (ARG_OF_TYPE's types: "
            f"{', '.join(ARG_OF_TYPE)}), or name its kind in the row ({param.name}=Arg....)."
        )
    return kind


def _performed() -> NoReturn:
    """The body of an operation's stub, which ``@operation`` replaces (a stub of only ``...``
    would be abstract to mypy in the classes that inherit it)."""
    raise AssertionError("@operation replaces this body")


class CatalogAPI(Protocol):
    """A catalog: the table's operations, and what is built on them.

    ``Catalog`` implements it in this process; ``tabloader.connect`` returns one that goes
    through the catalog's service while one runs (see the module).

    Attributes:
        root: the catalog directory.
    """

    root: Path

    @property
    def exists(self) -> bool:
        """Whether the directory holds a catalog."""
        ...

    def close(self) -> None:
        """Close the catalog (or what leads to it). Idempotent."""
        ...

    # -- statements ----------------------------------------------------------------------------
    @operation(Wire.RESULT, writes=True, statement=Arg.STATEMENT)
    def sql(self, statement: str) -> Any:
        """Run one statement (see ``tabloader.catalog._sql``).

        Returns:
            a ``pyarrow.Table`` for SELECT, SHOW and DESCRIBE; the ``Dataset`` for CREATE
            DATASET; the ``Job`` for REGISTER JOB; None for DROP and UNREGISTER.
        """
        _performed()

    # -- datasets ------------------------------------------------------------------------------
    @operation(Wire.NAMES)
    def dataset_names(self) -> list[str]:
        """Names of all datasets, sorted."""
        _performed()

    @operation(Wire.DATASET)
    def dataset(self, name: str, *, version: int | None = None) -> Dataset:
        """Return dataset ``name`` at its latest version or at ``version`` (its ``take`` reads
        the storage files in this process).

        Raises:
            DatasetNotFoundError: no such dataset or version.
        """
        _performed()

    @operation(Wire.NONE, writes=True)
    def drop_dataset(self, name: str, *, cascade: bool = False, if_exists: bool = False) -> None:
        """Drop a dataset, its table and its files (a service refuses while its open jobs
        read it).

        Raises:
            DatasetInUseError: jobs use it and ``cascade`` is false.
        """
        _performed()

    @operation(Wire.ARRAY)
    def column(self, name: str, column: str, *, rows: int, of: Dataset | None = None) -> pa.Array:
        """Queryable column ``column`` of dataset ``name``, ids ``0..rows-1`` in order, as
        stored; ``of``: the version the caller reads (see ``Catalog.column``).

        Raises:
            DatasetNotFoundError, UnknownColumnError: no such dataset or queryable column.
            StorageError: the table does not have those rows, or ``of``'s files are gone.
        """
        _performed()

    @operation(Wire.LOCAL)
    def verify(self, name: str | None = None) -> VerifyReport:
        """Read every stored byte of dataset ``name`` (default: every dataset) and check it.

        Returns a report of the damaged ``_id`` ranges (``report.ok`` when there are none)
        and of files written before checksums (unverified).

        Raises:
            DatasetNotFoundError: no such dataset.
            CatalogLockedError: a service holds the catalog (stop it first).
        """
        _performed()

    # -- jobs ------------------------------------------------------------------------------------
    @operation(Wire.NAMES)
    def job_names(self) -> list[str]:
        """Names of all jobs, sorted."""
        _performed()

    @operation(Wire.JOB)
    def job(self, name: str) -> Job:
        """Return job ``name``, with its bitmap of row ids.

        Raises:
            JobNotFoundError: no such job.
        """
        _performed()

    @operation(Wire.JOB_INFOS)
    def job_infos(self) -> list[JobInfo]:
        """What is stored about every job, sorted by name, without reading any bitmap."""
        _performed()

    @operation(Wire.JOB, writes=True)
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
        """Register a job on the rows of ``dataset`` that satisfy ``where``.

        Args:
            name: the job name.
            dataset: the dataset; the job is pinned to its current version.
            columns: the columns the job reads (default: all).
            where: a predicate in SQL (checked against an allow-list), or None for all rows.
            options: job options, checked against ``tabloader.catalog._options.JOB_OPTIONS``.
            replace: replace a job of the same name (re-registering re-pins the version).

        Warns:
            UserWarning: a loader service with the default cache could not serve the job
                (``tabloader.catalog._options.default_cache_problem``).

        Raises:
            AlreadyExistsError: the job exists and ``replace`` is false.
            UnknownColumnError, ForbiddenExpressionError: bad columns or predicate.
            OptionError: an unknown option, or a value of the wrong type or out of range.
        """
        _performed()

    @operation(Wire.NONE, writes=True)
    def unregister_job(self, name: str, *, if_exists: bool = False) -> None:
        """Remove job ``name``."""
        _performed()

    # -- imports ---------------------------------------------------------------------------------
    @operation(Wire.DATASET, writes=True)
    def import_source(
        self, name: str, source: Source, *, append: bool = False, storage: str | None = None
    ) -> Dataset:
        """Import a streaming ``Source`` atomically (see ``tabloader.catalog._imports``).

        The first import into a directory that holds no catalog creates it. ``storage``: the
        store the dataset's parts go to (``s3://bucket/prefix``; default: the catalog
        directory); an append goes where the dataset is.
        """
        _performed()

    @operation(Wire.DATASET, writes=True)
    def import_path(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        format: str,
        append: bool = False,
        follow_links: bool = False,
        split: str | None = None,
        storage: str | None = None,
    ) -> Dataset:
        """Import the files at ``path`` (a file, folder or glob, or an ``s3://`` location of
        parquet, arrow or imagefolder files) in ``format`` (``parquet``, ``arrow``,
        ``imagefolder``, ``hf``), read where the catalog is open: the ``import_*`` methods of
        a path call it. ``split``: a HuggingFace ``DatasetDict``'s split. ``storage``: as for
        ``import_source``."""
        _performed()

    # -- built on the operations -----------------------------------------------------------------
    def datasets(self) -> list[Dataset]:
        """All datasets (their latest versions), sorted by name."""
        return [self.dataset(n) for n in self.dataset_names()]

    def jobs(self) -> list[Job]:
        """All registered jobs, sorted by name."""
        return [self.job(n) for n in self.job_names()]

    def import_arrow(
        self, name: str, data: Any, *, append: bool = False, storage: str | None = None
    ) -> Dataset:
        """Import a ``pyarrow.Table``, ``RecordBatch`` or ``RecordBatchReader``."""
        from tabloader.catalog._importers.arrow import open_arrow

        return self.import_source(name, open_arrow(data), append=append, storage=storage)

    def import_parquet(
        self,
        name: str,
        path_or_glob: str | os.PathLike[str],
        *,
        append: bool = False,
        follow_links: bool = False,
        storage: str | None = None,
    ) -> Dataset:
        """Import a Parquet file, a directory of Parquet files or a glob.

        A symbolic link that leads out of the directory (or the glob's folder) is refused
        unless ``follow_links``; so for every ``import_*`` that takes a path. ``storage``:
        where the dataset's parts go (``import_source``); so for every ``import_*``.
        """
        return self.import_path(
            name,
            path_or_glob,
            format="parquet",
            append=append,
            follow_links=follow_links,
            storage=storage,
        )

    def import_ipc(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        append: bool = False,
        follow_links: bool = False,
        storage: str | None = None,
    ) -> Dataset:
        """Import Arrow IPC / Feather files (file or stream format; a path or a glob)."""
        return self.import_path(
            name, path, format="arrow", append=append, follow_links=follow_links, storage=storage
        )

    def import_hf(
        self,
        name: str,
        dataset_or_path: Any,
        *,
        split: str | None = None,
        append: bool = False,
        follow_links: bool = False,
        storage: str | None = None,
    ) -> Dataset:
        """Import a HuggingFace ``Dataset``, ``DatasetDict`` or ``save_to_disk`` folder.

        Args:
            name: the new dataset.
            dataset_or_path: the source.
            split: for a ``DatasetDict``, the split to import; None imports every split with a
                ``split`` column.
            append: add the rows to an existing dataset with the same schema.
            follow_links: read what lies outside what was given: what the folder's symbolic
                links lead to outside it, and image files named by path outside the folder
                (for an in-memory dataset: absolute paths, or relative ones leading out of the
                current directory). See ``tabloader.catalog._importers.hf.open_hf``.
        """
        if isinstance(dataset_or_path, (str, os.PathLike)):
            return self.import_path(
                name,
                dataset_or_path,
                format="hf",
                append=append,
                follow_links=follow_links,
                split=split,
                storage=storage,
            )
        from tabloader.catalog._importers import open_source

        source = open_source("hf", dataset_or_path, split=split, follow_links=follow_links)
        return self.import_source(name, source, append=append, storage=storage)

    def import_imagefolder(
        self,
        name: str,
        root: str | os.PathLike[str],
        *,
        append: bool = False,
        follow_links: bool = False,
        storage: str | None = None,
    ) -> Dataset:
        """Import ``root/<class>/<file>`` images: image, label, label_name, path (``root``
        may be an ``s3://bucket/prefix``)."""
        return self.import_path(
            name,
            root,
            format="imagefolder",
            append=append,
            follow_links=follow_links,
            storage=storage,
        )


class StatementTarget(CatalogAPI, Protocol):
    """What statements need of a catalog (``tabloader.catalog._sql.execute``): the API, the limits
    of user statements, and validated read-only queries (which never cross the wire).

    Attributes:
        limits: what user statements may take (``tabloader.catalog._limits``).
    """

    limits: Limits

    def query(self, sql: str) -> pa.Table:
        """Run a validated read-only query."""
        ...
