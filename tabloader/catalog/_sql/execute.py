"""Run one parsed statement: one handler per statement type, dispatched from ``HANDLERS``.

The handlers talk to a ``StatementTarget`` (``tabloader.catalog._api``: the catalog API, its limits
and its read-only queries), not to ``Catalog`` itself, so this module does not import the catalog
that imports it; the loader service gives them its own view of its catalog.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa
from sqlglot import exp

from tabloader.catalog._api import StatementTarget
from tabloader.catalog._arrays import from_values
from tabloader.catalog._errors import ForbiddenExpressionError, StatementError, UnknownColumnError
from tabloader.catalog._importers import detect_format, open_source
from tabloader.catalog._sql.dialect import (
    MAX_NESTING,
    AppendDataset,
    CreateDataset,
    DescribeDataset,
    DropDataset,
    RegisterJob,
    ShowDatasets,
    ShowJobs,
    UnregisterJob,
    parse,
)
from tabloader.catalog._sql.validate import check_query, position


def execute(catalog: StatementTarget, text: str) -> Any:
    """Parse ``text`` (exactly one statement) and run it; see ``Catalog.sql``."""
    try:
        stmt = parse(text)
        handler = HANDLERS.get(type(stmt))
        if handler is None:
            if not isinstance(stmt, exp.Query):
                check_query(stmt, text=text)  # refuses it, naming what is allowed
            sql = check_query(
                stmt, text=text, tables=catalog.dataset_names(), limits=catalog.limits
            )
            return catalog.query(sql)
        return handler(catalog, stmt)
    except RecursionError:
        raise StatementError(
            f"The statement is nested too deeply to check; write it with at most "
            f"{MAX_NESTING} levels of parentheses and shorter chains of NOT or operators."
        ) from None


def _import(catalog: StatementTarget, stmt: exp.Expression, *, append: bool) -> Any:
    path = stmt.args["path"].name
    fmt = stmt.args.get("format")
    name = fmt.name.lower() if fmt else detect_format(path)
    options = _import_options(_options(stmt.args.get("options")), name)
    storage = options.pop("storage", None)
    source = open_source(name, path, **options)
    return catalog.import_source(stmt.this.name, source, append=append, storage=storage)


def _import_options(options: dict[str, Any], fmt: str) -> dict[str, Any]:
    """Check the WITH options of CREATE / APPEND TO DATASET for FORMAT ``fmt``."""
    known = ["follow_links", "storage", *(["split"] if fmt == "hf" else [])]
    for key, value in options.items():
        if key not in known:
            raise StatementError(
                f"Unknown option '{key}' for an import of FORMAT {fmt}; use {' or '.join(known)}."
            )
        if key == "follow_links" and not isinstance(value, bool):
            raise StatementError(f"Option follow_links must be TRUE or FALSE, not {value!r}.")
        if key in ("split", "storage") and not isinstance(value, str):
            raise StatementError(f"Option {key} must be a 'string', not {value!r}.")
    return options


def _register(catalog: StatementTarget, stmt: RegisterJob) -> Any:
    query = stmt.args["query"]
    if not isinstance(query, exp.Select):
        raise StatementError("REGISTER JOB takes one SELECT columns FROM dataset [WHERE ...].")
    extra = [
        "JOIN" if k == "joins" else k.upper()
        for k, v in query.args.items()
        if v and k not in ("expressions", "from_", "where", "kind")
    ]
    if extra:
        line, col = position(query)
        raise ForbiddenExpressionError(
            f"REGISTER JOB takes SELECT columns FROM dataset [WHERE ...]; remove "
            f"{', '.join(extra)}.",
            line=line,
            col=col,
        )
    source = query.args.get("from_")
    if (
        source is None
        or not isinstance(source.this, exp.Table)
        or not isinstance(source.this.this, exp.Identifier)
    ):
        raise StatementError("REGISTER JOB needs FROM <dataset>.")
    table = source.this
    dataset = table.name
    columns: list[str] = []
    places: dict[str, tuple[int | None, int | None]] = {}  # for errors: where each column is
    for proj in query.expressions:
        if isinstance(proj, exp.Star):
            columns.append("*")
        elif isinstance(proj, exp.Column) and isinstance(proj.this, exp.Identifier):
            if proj.table and proj.table not in (dataset, table.alias):
                raise StatementError(f"Column '{proj.sql()}' does not belong to '{dataset}'.")
            columns.append(proj.name)
            places.setdefault(proj.name, position(proj))
        else:
            line, col = position(proj)
            raise ForbiddenExpressionError(
                f"Projections must be plain columns or *; '{proj.sql(dialect='duckdb')}' is an "
                "expression. Select the column and compute in your training code.",
                line=line,
                col=col,
            )
    if "*" in columns and len(columns) > 1:
        raise StatementError("Use either * or a list of columns, not both.")
    where = query.args.get("where")
    predicate = where.this if where is not None else None
    if predicate is not None and table.alias:
        for col_node in predicate.find_all(exp.Column):
            if col_node.table == table.alias:
                col_node.set("table", None)
    options = _options(stmt.args.get("options"))
    try:
        return catalog.register_job(
            stmt.this.name,
            dataset,
            columns=columns,
            where=predicate,
            options=options,
            replace=bool(stmt.args.get("replace")),
        )
    except UnknownColumnError as exc:  # in the SELECT list: say where, as for WHERE
        line, col = places.get(exc.column or "", (None, None))
        if exc.line is not None or line is None:
            raise
        err = UnknownColumnError(str(exc), line=line, col=col)
        err.column = exc.column
        raise err from None


def _options(node: exp.Tuple | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for eq in node.expressions if node is not None else []:
        key, value = eq.this.name.lower(), eq.expression
        if key in options:
            raise StatementError(f"Option '{key}' is given twice in WITH (...).")
        if isinstance(value, exp.Boolean) or (isinstance(value, exp.Literal) and value.is_string):
            options[key] = value.this
        elif isinstance(value, exp.Literal):
            options[key] = (
                float(value.this) if any(c in value.this for c in ".eE") else int(value.this)
            )
        elif isinstance(value, exp.Neg) and isinstance(value.this, exp.Literal):
            options[key] = (
                -float(value.this.this) if "." in value.this.this else -int(value.this.this)
            )
        else:
            raise StatementError(
                f"Option '{key}' must be a number, a 'string', TRUE or FALSE, not "
                f"{value.sql(dialect='duckdb')}."
            )
    return options


def _listing(columns: dict[str, pa.DataType], rows: Iterable[tuple[Any, ...]]) -> pa.Table:
    """A table of ``columns`` (each name and type) holding ``rows`` (values in that order)."""
    values = list(zip(*rows, strict=True)) or [()] * len(columns)
    arrays = [from_values(v, t) for v, t in zip(values, columns.values(), strict=True)]
    return pa.Table.from_arrays(arrays, schema=pa.schema(list(columns.items())))


def _show_datasets(catalog: StatementTarget, _: exp.Expression) -> pa.Table:
    jobs = catalog.job_infos()
    return _listing(
        {
            "name": pa.string(),
            "version": pa.int64(),
            "rows": pa.int64(),
            "columns": pa.string(),
            "jobs": pa.int64(),
            "source": pa.string(),
        },
        (
            (
                ds.name,
                ds.version,
                ds.num_rows,
                ", ".join(ds.columns[1:]),
                sum(j.dataset == ds.name for j in jobs),
                ds.description,
            )
            for ds in catalog.datasets()
        ),
    )


def _show_jobs(catalog: StatementTarget, _: exp.Expression) -> pa.Table:
    return _listing(
        {
            "name": pa.string(),
            "dataset": pa.string(),
            "version": pa.int64(),
            "rows": pa.int64(),
            "columns": pa.string(),
            "predicate": pa.string(),
            "options": pa.string(),
        },
        (
            (
                j.name,
                j.dataset,
                j.dataset_version,
                j.num_rows,
                ", ".join(j.columns),
                j.predicate,
                ", ".join(f"{k}={v}" for k, v in j.options.items()),
            )
            for j in catalog.job_infos()
        ),
    )


def _describe(catalog: StatementTarget, stmt: DescribeDataset) -> pa.Table:
    ds = catalog.dataset(stmt.this.name)
    return _listing(
        {
            "column": pa.string(),
            "type": pa.string(),
            "queryable": pa.bool_(),
            "classes": pa.int64(),
        },
        (
            (
                f.name,
                str(f.type),
                f.name in ds.queryable,
                len(ds.class_names.get(f.name, [])) or None,
            )
            for f in ds.schema
        ),
    )


def _unregister(catalog: StatementTarget, stmt: UnregisterJob) -> None:
    catalog.unregister_job(stmt.this.name, if_exists=bool(stmt.args.get("exists")))


def _drop(catalog: StatementTarget, stmt: DropDataset) -> None:
    catalog.drop_dataset(
        stmt.this.name,
        cascade=bool(stmt.args.get("cascade")),
        if_exists=bool(stmt.args.get("exists")),
    )


HANDLERS: dict[type[exp.Expr], Callable[[StatementTarget, Any], Any]] = {
    CreateDataset: lambda c, s: _import(c, s, append=False),
    AppendDataset: lambda c, s: _import(c, s, append=True),
    RegisterJob: _register,
    UnregisterJob: lambda c, s: _unregister(c, s),
    ShowDatasets: _show_datasets,
    ShowJobs: _show_jobs,
    DescribeDataset: _describe,
    DropDataset: lambda c, s: _drop(c, s),
}
