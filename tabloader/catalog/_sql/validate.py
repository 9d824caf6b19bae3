"""Checks for untrusted statement text: columns resolve, predicates stay inside an allow-list.

A job predicate may use only the node types in ``PREDICATE_NODES`` (comparisons, boolean logic,
IN lists, BETWEEN, LIKE, IS NULL, arithmetic, casts and a short list of pure scalar functions)
over the dataset's queryable columns. Subqueries, table functions, ``read_*``, ``getenv`` and
anything else are refused with the position and the fix. Read-only SELECT pass-through may use
any expression but no table function, and it runs on a connection whose external access is off
(see ``tabloader.catalog._database``), inside a transaction that is rolled back.

SELECT reads dataset tables and the CTEs in scope, nothing else. Each table reference is
resolved as DuckDB binds it (``bound_cte``) and checked against sqlglot's scope analysis, so
a CTE named after a system view unlocks that name only where DuckDB would read the CTE: not
outside the subquery that defines it, not in its own body, not in an earlier CTE, and not in
the anchor of a recursive one.
"""

from __future__ import annotations

from collections.abc import Collection

from sqlglot import exp
from sqlglot.errors import OptimizeError
from sqlglot.optimizer.scope import traverse_scope

from tabloader.catalog._bitmaps import ID_COLUMN
from tabloader.catalog._errors import (
    ForbiddenExpressionError,
    StatementError,
    UnknownColumnError,
    did_you_mean,
)
from tabloader.catalog._limits import Limits
from tabloader.catalog._model import Dataset
from tabloader.catalog._sql.dialect import first_token, parse_predicate
from tabloader.catalog._sql.sizes import check_sizes

PREDICATE_NODES: tuple[type[exp.Expression], ...] = (
    # leaves
    exp.Column,
    exp.Identifier,
    exp.Literal,
    exp.Boolean,
    exp.Null,
    exp.DataType,
    exp.Tuple,
    exp.Paren,
    # boolean logic and comparisons
    exp.And,
    exp.Or,
    exp.Not,
    exp.Xor,
    exp.EQ,
    exp.NEQ,
    exp.GT,
    exp.GTE,
    exp.LT,
    exp.LTE,
    exp.NullSafeEQ,
    exp.NullSafeNEQ,
    exp.Is,
    exp.In,
    exp.Between,
    exp.Like,
    exp.ILike,
    # arithmetic and casts
    exp.Add,
    exp.Sub,
    exp.Mul,
    exp.Div,
    exp.IntDiv,
    exp.Mod,
    exp.Neg,
    exp.Pow,
    exp.BitwiseAnd,
    exp.BitwiseOr,
    exp.BitwiseXor,
    exp.Cast,
    exp.TryCast,
    exp.Case,
    exp.If,
    exp.DPipe,
)
# The pure scalar functions a predicate may call, as users write them. sqlglot parses most to
# a node type of its own (``contains`` to ``Contains``, ``array_length`` to ``ArraySize``,
# ``len`` to ``Length``) and the rest to ``Anonymous``: both are derived below by parsing each
# name, so the allow-list matches the parser, whatever it does with a name.
PREDICATE_FUNCTION_CALLS: dict[str, str] = {
    "abs": "abs(x)",
    "round": "round(x, 2)",
    "floor": "floor(x)",
    "ceil": "ceil(x)",
    "greatest": "greatest(x, 1)",
    "least": "least(x, 1)",
    "coalesce": "coalesce(x, 0)",
    "lower": "lower(s)",
    "upper": "upper(s)",
    "length": "length(s)",
    "len": "len(s)",
    "substring": "substring(s, 1, 2)",
    "starts_with": "starts_with(s, 'a')",
    "ends_with": "ends_with(s, 'a')",
    "contains": "contains(s, 'a')",
    "regexp_matches": "regexp_matches(s, 'a')",
    "trim": "trim(s)",
    "concat": "concat(s, 'a')",
    "strpos": "strpos(s, 'a')",
    "year": "year(d)",
    "month": "month(d)",
    "day": "day(d)",
    "isnan": "isnan(x)",
    "isinf": "isinf(x)",
    "array_length": "array_length(l)",
    "hash": "hash(x)",
}


def _function_nodes() -> tuple[tuple[type[exp.Expr], ...], frozenset[str]]:
    types: set[type[exp.Expr]] = set()
    anonymous: set[str] = set()
    for call in PREDICATE_FUNCTION_CALLS.values():
        node = parse_predicate(call)
        if isinstance(node, exp.Anonymous):
            anonymous.add(node.name.upper())
        else:
            types.add(type(node))
    return tuple(types), frozenset(anonymous)


PREDICATE_FUNCTION_NODES, PREDICATE_FUNCTIONS = _function_nodes()
_FUNCTION_LIST = ", ".join(PREDICATE_FUNCTION_CALLS)

# What SELECT may not call: DuckDB's settings, environment, internals and files.
FORBIDDEN_FUNCTIONS = frozenset(
    {
        "CURRENT_SETTING",
        "GETENV",
        "GETVARIABLE",
        "CURRENT_DATABASE",
        "CURRENT_CATALOG",
        "CURRENT_SCHEMA",
        "CURRENT_SCHEMAS",
        "CURRENT_USER",
        "SESSION_USER",
        "USER",
        "CURRENT_ROLE",
        "VERSION",
        "CURRENT_VERSION",
        "WHICH_SECRET",
        "GLOB",
        "QUERY",
        "QUERY_TABLE",
    }
)
FORBIDDEN_PREFIXES = ("READ_", "DUCKDB_", "PRAGMA_", "SQLITE_", "PG_")


def position(node: exp.Expr) -> tuple[int | None, int | None]:
    """Line and 1-based start column of ``node`` (or of its first descendant that has one).

    sqlglot records the column of a token's last character; we report where it starts.
    """
    for n in node.walk():
        for candidate in (n, n.args.get("this")):
            meta = getattr(candidate, "_meta", None) or {}
            if "line" in meta:
                width = meta.get("end", 0) - meta.get("start", 0)
                return meta["line"], max(1, meta["col"] - width)
    return None, None


def _forbid(node: exp.Expr, what: str, fix: str) -> ForbiddenExpressionError:
    line, col = position(node)
    return ForbiddenExpressionError(f"{what} {fix}", line=line, col=col)


def check_predicate(
    where: str | exp.Expression,
    ds: Dataset,
    *,
    limits: Limits | None = None,
    what: str = "a job predicate",
) -> str:
    """Check a job predicate against the allow-list and ``ds``'s columns (and ``limits``).

    A job's ``weight`` expression is checked by the same rules (``what``: "a job's weight",
    as the errors name it).

    Returns:
        the normalized predicate SQL (unqualified columns, DuckDB syntax).

    Raises:
        UnknownColumnError: a column is not in ``ds`` (with a suggestion).
        ForbiddenExpressionError: a node outside the allow-list, or a payload column.
    """
    expr = parse_predicate(where) if isinstance(where, str) else where.copy()
    for node in expr.walk():
        if isinstance(node, exp.Subquery | exp.Select | exp.Query):
            raise _forbid(
                node,
                f"Subqueries are not allowed in {what}.",
                "Filter with comparisons on the dataset's own columns.",
            )
        if isinstance(node, exp.Anonymous):
            if node.name.upper() in PREDICATE_FUNCTIONS:
                continue
            raise _forbid(
                node,
                f"Function {node.name}() is not allowed in {what}.",
                "Use comparisons, IN, BETWEEN, LIKE, arithmetic, casts or one of the "
                f"functions {_FUNCTION_LIST}.",
            )
        if not isinstance(node, PREDICATE_NODES + PREDICATE_FUNCTION_NODES):
            name = node.sql(dialect="duckdb") if isinstance(node, exp.Func) else node.key.upper()
            raise _forbid(
                node,
                f"'{name[:40]}' is not allowed in {what}.",
                "Use comparisons, boolean logic, IN, BETWEEN, LIKE, IS NULL, arithmetic,"
                f" casts and the functions {_FUNCTION_LIST} on the dataset's columns.",
            )
        if isinstance(node, exp.Column):
            _check_column(node, ds, what)
    if limits is not None:
        check_sizes(expr, limits)
    return expr.sql(dialect="duckdb")


def _check_column(node: exp.Column, ds: Dataset, what: str) -> None:
    line, col = position(node)
    if node.table and node.table != ds.name:
        raise UnknownColumnError(
            f"Column '{node.sql()}' refers to '{node.table}', but the job reads '{ds.name}'; "
            "drop the qualifier.",
            line=line,
            col=col,
        )
    node.set("table", None)
    name = node.name
    if name not in ds.columns:
        raise UnknownColumnError(
            f"Unknown column '{name}' in dataset '{ds.name}'.{did_you_mean(name, ds.columns)}",
            line=line,
            col=col,
        )
    if name not in ds.queryable:
        use = (
            ("filtered on", "Filter on")
            if what == "a job predicate"
            else (f"used in {what}", "Use")
        )
        raise ForbiddenExpressionError(
            f"Column '{name}' holds binary payload, which is not stored in DuckDB and cannot be "
            f"{use[0]}. {use[1]} {', '.join(c for c in ds.queryable if c != ID_COLUMN)} "
            "instead.",
            line=line,
            col=col,
        )


def check_query(
    query: exp.Expr,
    *,
    text: str | None = None,
    tables: Collection[str] | None = None,
    limits: Limits | None = None,
) -> str:
    """Check a read-only SELECT for pass-through to DuckDB; return its DuckDB SQL.

    It may read the dataset tables (and its own CTEs) only: no table function, no schema
    (``information_schema``, ``_tabloader``...), no function that reads settings, the
    environment, DuckDB's internals or files.

    Args:
        query: the parsed statement.
        text: the statement as written, to name its first word if it is refused.
        tables: the dataset names; None allows any unqualified table name.
        limits: the statement limits (see ``tabloader.catalog._sql.sizes.check_sizes``).
    """
    if not isinstance(query, exp.Query):
        # sqlglot's node type misleads ('@@@' parses as ABS, CHECKPOINT as a column): name
        # what the statement starts with instead.
        first = first_token(text if text is not None else query.sql(dialect="duckdb"))
        raise ForbiddenExpressionError(
            f"Statements starting with '{first}' are not allowed. tabloader runs CREATE "
            "DATASET, APPEND TO DATASET, REGISTER JOB, UNREGISTER JOB, SHOW DATASETS, SHOW JOBS, "
            "DESCRIBE, DROP DATASET and read-only SELECT."
        )
    if isinstance(query, exp.Select) and query.args.get("into"):
        raise StatementError("SELECT ... INTO is not allowed; SELECT is read-only.")
    check_tables(query, tables)
    for node in query.walk():
        if isinstance(node, exp.Func):
            name = node.name if isinstance(node, exp.Anonymous) else node.sql_name()
            if name.upper() in FORBIDDEN_FUNCTIONS or name.upper().startswith(FORBIDDEN_PREFIXES):
                raise _forbid(
                    node,
                    f"Function {name.lower()}() is not allowed.",
                    "tabloader SQL reads the dataset tables only, not files, the environment, "
                    "settings or DuckDB's internals.",
                )
    if limits is not None:
        check_sizes(query, limits)
    return query.sql(dialect="duckdb")


def check_tables(query: exp.Query, tables: Collection[str] | None) -> None:
    """Refuse ``query`` unless every table it names is a dataset table or a CTE in scope.

    Each reference is resolved as DuckDB binds it (``bound_cte``) and by sqlglot's scope
    analysis (``traverse_scope``): it may be a CTE only where both find that CTE in scope;
    otherwise it must be a dataset, by its name alone (no schema). System views
    (``pg_settings``, ``duckdb_tables``...), other schemas, table functions, files and any
    table that sqlglot cannot place in a scope are refused.

    Args:
        query: the parsed SELECT.
        tables: the dataset names; None allows any unqualified table name.
    """
    datasets = None if tables is None else {t.lower() for t in tables}
    try:
        scopes = traverse_scope(query)
    except OptimizeError as exc:
        raise ForbiddenExpressionError(
            f"Cannot tell which tables this query reads ({exc}). {_TABLES_FIX}"
        ) from exc
    placed: set[int] = set()
    for scope in scopes:
        ctes = {name.lower() for name in scope.cte_sources}
        for table in scope.tables:
            placed.add(id(table))
            _check_table(table, table.name.lower() in ctes, datasets)
    for table in query.find_all(exp.Table):
        if id(table) not in placed:
            raise _forbid(
                table,
                f"Cannot tell which table '{table.sql(dialect='duckdb')[:60]}' refers to here.",
                _TABLES_FIX,
            )


_TABLES_FIX = "Query the dataset tables by name (SHOW DATASETS lists them)."


def bound_cte(table: exp.Table) -> exp.CTE | None:
    """The CTE that DuckDB binds the unqualified ``table`` to, or None for a catalog table.

    DuckDB's rules: the CTEs of a WITH are visible in the query it prefixes (subqueries
    included) and in the bodies of the CTEs after them in the same WITH; the nearest WITH
    wins. A CTE does not see itself, except in ``WITH RECURSIVE`` when its body is
    ``anchor UNION [ALL] step``: ``step`` sees it, ``anchor`` does not (it reads the table
    of that name; so does every arm of INTERSECT or EXCEPT).
    """
    name = table.name.lower()
    child: exp.Expr = table
    inside: exp.CTE | None = None  # the CTE whose body ``child`` is in, one level down
    node = table.parent
    while node is not None:
        if isinstance(node, exp.CTE):
            inside = node
        with_ = node.args.get("with_")
        if isinstance(with_, exp.With):
            ctes: list[exp.CTE] = list(with_.expressions)
            if child is with_ and inside is not None:  # in the body of one of its CTEs
                before = ctes[: next(i for i, c in enumerate(ctes) if c is inside)]
                if inside.alias.lower() == name and _in_recursive_step(table, inside, with_):
                    return inside
                ctes = before
            for cte in reversed(ctes):
                if cte.alias.lower() == name:
                    return cte
        child, node = node, node.parent
    return None


def _in_recursive_step(table: exp.Table, cte: exp.CTE, with_: exp.With) -> bool:
    body = cte.this
    if not with_.args.get("recursive") or not isinstance(body, exp.Union):
        return False
    node: exp.Expr | None = table
    while node is not None and node.parent is not body:
        node = node.parent
    return node is not None and node is body.expression


def _check_table(node: exp.Table, scoped_cte: bool, datasets: set[str] | None) -> None:
    """Accept ``node`` as a CTE (both resolutions agree) or a dataset table, else refuse it."""
    if not isinstance(node.this, exp.Identifier):
        raise _forbid(node, "Table functions are not allowed.", _TABLES_FIX)
    name = node.name.lower()
    if node.args.get("catalog") or node.args.get("db"):
        bare = datasets is not None and name in datasets and node.db.lower() == "main"
        raise _forbid(
            node,
            f"Table '{node.sql(dialect='duckdb')}' names a schema; schemas are off limits.",
            f"Write the dataset name alone ('{node.name}')." if bare else _TABLES_FIX,
        )
    if datasets is None or name in datasets:
        return  # a dataset table; or, if a CTE shadows it, that CTE: either is allowed
    cte = bound_cte(node)
    if cte is not None and scoped_cte:
        return
    if (cte is not None) != scoped_cte:
        raise _forbid(
            node,
            f"Cannot tell whether '{node.name}' means a CTE or a table here.",
            "Give the CTE a name that no table has, and refer to it only after its "
            "definition (in WITH RECURSIVE, from the step after UNION).",
        )
    raise _forbid(
        node,
        f"Unknown dataset '{node.name}': no dataset, and no CTE in scope here, has that "
        f"name.{did_you_mean(node.name, sorted(datasets))}",
        _TABLES_FIX,
    )
