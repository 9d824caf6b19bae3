"""SELECT reads dataset tables and in-scope CTEs only, for random shadowing and nesting shapes.

The generator builds queries whose every relation has one column ``v``: the dataset ``ds`` holds
'dataset', every CTE leaf selects 'cte'. CTEs are named after system views, catalog tables and the
dataset, at any depth; references name them inside and outside their scope, quoted, in other case,
schema-qualified. The generator knows what each reference binds to under DuckDB's scoping rules (its
own model, independent of ``tabloader.catalog._sql.validate``), so:

- a query is accepted exactly when every reference is the dataset or a CTE in scope;
- an accepted query runs in the real catalog and returns 'dataset' and 'cte' values only
  (a reference bound to a system view has no column ``v`` and fails to bind).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tabloader.catalog import ForbiddenExpressionError


@dataclass(frozen=True)
class Name:
    """A table name as written, and what it names (lower case; None: schema-qualified)."""

    sql: str
    key: str | None


DATASETS = {"ds"}
# Table references: the dataset (plain, quoted, other case), DuckDB's system views, the
# catalog's own schema, other schemas, and a name nothing has.
REFS = [
    Name("ds", "ds"),
    Name('"DS"', "ds"),
    Name("pg_settings", "pg_settings"),
    Name('"PG_Settings"', "pg_settings"),
    Name("pg_class", "pg_class"),
    Name("duckdb_tables", "duckdb_tables"),
    Name("sqlite_master", "sqlite_master"),
    Name("c1", "c1"),
    Name("nowhere", "nowhere"),
    Name("main.ds", None),
    Name("main.pg_settings", None),
    Name("pg_catalog.pg_settings", None),
    Name("information_schema.tables", None),
    Name("_tabloader.datasets", None),
    Name('"main"."pg_class"', None),
]
# CTE and derived-table names: system views, the dataset, a fresh name.
CTE_NAMES = [
    Name("pg_settings", "pg_settings"),
    Name('"PG_SETTINGS"', "pg_settings"),
    Name("pg_class", "pg_class"),
    Name("duckdb_tables", "duckdb_tables"),
    Name("sqlite_master", "sqlite_master"),
    Name("ds", "ds"),
    Name("c1", "c1"),
]
LEAF = "SELECT 'cte' AS v"


@dataclass(frozen=True)
class Shape:
    """Generated SQL and whether every table reference in it binds to ``ds`` or a CTE."""

    sql: str
    safe: bool


def _resolves(ref: Name, visible: frozenset[str]) -> bool:
    """The model: a schema-qualified name is refused; a bare one is a CTE in scope or ``ds``."""
    return ref.key is not None and (ref.key in visible or ref.key in DATASETS)


@st.composite
def relation(draw: st.DrawFn, visible: frozenset[str], depth: int) -> tuple[Shape, Name | None]:
    """A FROM item: a table reference, or (deeper) a derived table and its alias."""
    if depth > 0 and draw(st.booleans()):
        inner = draw(query(visible, depth - 1))
        alias = draw(st.sampled_from(CTE_NAMES))  # an alias is no CTE: it names no table
        return Shape(f"({inner.sql})", inner.safe), alias
    # Half of the references name what is in scope (as written in any of its ways), so that
    # many queries are refused for one subtle reference only.
    in_scope = REFS[:2] + [n for n in CTE_NAMES if n.key in visible]
    ref = draw(st.sampled_from(REFS) | st.sampled_from(in_scope))
    return Shape(ref.sql, _resolves(ref, visible)), None


@st.composite
def select(draw: st.DrawFn, visible: frozenset[str], depth: int) -> Shape:
    """``SELECT a.v FROM x AS a [, y AS b WHERE b.v IS NOT NULL] [AND EXISTS (...)]``."""
    parts, conds, safe, aliases = [], [], True, []
    for i in range(draw(st.integers(1, 2))):
        item, alias = draw(relation(visible, depth))
        if alias is None or alias.key in {a.key for a in aliases}:
            alias = Name(f"r{i}", f"r{i}")
        parts.append(f"{item.sql} AS {alias.sql}")
        conds.append(f"{alias.sql}.v IS NOT NULL")
        safe = safe and item.safe
        aliases.append(alias)
    if depth > 0 and draw(st.booleans()):
        sub = draw(query(visible, depth - 1))
        conds.append(f"EXISTS ({sub.sql})")
        safe = safe and sub.safe
    return Shape(
        f"SELECT {aliases[0].sql}.v FROM {', '.join(parts)} WHERE {' AND '.join(conds)}", safe
    )


@st.composite
def query(draw: st.DrawFn, visible: frozenset[str], depth: int) -> Shape:
    """A SELECT, maybe with a WITH [RECURSIVE] of one to three CTEs in front."""
    if depth == 0 or draw(st.booleans()):
        if depth == 0 and draw(st.booleans()):
            return Shape(LEAF, True)
        return draw(select(visible, depth))
    recursive = draw(st.booleans())
    names = draw(st.lists(st.sampled_from(CTE_NAMES), min_size=1, max_size=3, unique_by=_key))
    ctes, safe, scope = [], True, visible
    for name in names:
        if recursive and draw(st.booleans()):
            # anchor UNION ALL step: only the step sees the CTE itself
            anchor = draw(query(scope, depth - 1) | reading(names, scope))
            step = draw(st.sampled_from(REFS + names))
            sees_itself = scope | {_key(name)}
            body = Shape(
                f"({anchor.sql}) UNION ALL SELECT r0.v FROM {step.sql} AS r0 WHERE false",
                anchor.safe and _resolves(step, sees_itself),
            )
        else:  # a body sees the CTEs before it, never itself nor the ones after it
            body = draw(
                st.just(Shape(LEAF, True)) | query(scope, depth - 1) | reading(names, scope)
            )
        ctes.append(f"{name.sql} AS ({body.sql})")
        safe = safe and body.safe
        scope = scope | {_key(name)}
    main = draw(select(scope, depth - 1))
    keyword = "WITH RECURSIVE" if recursive else "WITH"
    return Shape(f"{keyword} {', '.join(ctes)} {main.sql}", safe and main.safe)


def reading(names: list[Name], visible: frozenset[str]) -> st.SearchStrategy[Shape]:
    """A SELECT from one of ``names`` (the CTEs of the WITH being written: itself, later ones)."""
    return st.sampled_from(names).map(
        lambda n: Shape(f"SELECT r0.v FROM {n.sql} AS r0", _resolves(n, visible))
    )


def _key(name: Name) -> str:
    assert name.key is not None
    return name.key


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    from tabloader import catalog

    with catalog.open_catalog(tmp_path_factory.mktemp("scope") / "cat", create=True) as c:
        c.import_arrow("ds", pa.table({"v": ["dataset", "dataset"]}))
        yield c


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(shape=query(frozenset(), 3))
def test_select_reads_datasets_and_ctes_in_scope_only(cat, shape):
    if not shape.safe:
        with pytest.raises(ForbiddenExpressionError, match=r"dataset|schema|CTE or a table"):
            cat.sql(shape.sql)
        return
    values = set(cat.sql(shape.sql).column("v").to_pylist())
    assert values <= {"dataset", "cte"}


@pytest.mark.parametrize(
    ("statement", "message"),
    [
        (  # the bypass: a CTE in another scope unlocked the name
            "SELECT name, setting FROM pg_settings, (WITH pg_settings AS (SELECT 1) SELECT 1)",
            r"Unknown dataset 'pg_settings': no dataset, and no CTE in scope here",
        ),
        (  # a non-recursive CTE does not see itself: DuckDB reads the system view
            "WITH pg_settings AS (SELECT * FROM pg_settings) SELECT * FROM pg_settings",
            r"Unknown dataset 'pg_settings'",
        ),
        (  # nor a later one
            "WITH a AS (SELECT * FROM pg_class), pg_class AS (SELECT 1) SELECT * FROM a",
            r"Unknown dataset 'pg_class'",
        ),
        (  # a recursive CTE's anchor reads the table, not the CTE (sqlglot's scope says CTE)
            "WITH RECURSIVE pg_settings AS (SELECT name FROM pg_settings UNION ALL "
            "SELECT name FROM pg_settings WHERE false) SELECT * FROM pg_settings",
            r"Cannot tell whether 'pg_settings' means a CTE or a table here\. Give the CTE",
        ),
        (  # INTERSECT makes no recursive CTE
            "WITH RECURSIVE pg_settings AS (SELECT 'a' AS name INTERSECT "
            "SELECT name FROM pg_settings) SELECT * FROM pg_settings",
            r"Cannot tell whether 'pg_settings' means a CTE",
        ),
        (
            "SELECT * FROM ds, (SELECT 1) AS pg_class WHERE EXISTS (SELECT 1 FROM pg_class)",
            r"Unknown dataset 'pg_class'",
        ),
        ("SELECT * FROM main.ds", r"Table 'main.ds' names a schema.*Write the dataset name alone"),
        ("SELECT * FROM pg_catalog.pg_settings", r"names a schema; schemas are off limits"),
        ("SELECT * FROM range(3)", r"Table functions are not allowed"),
    ],
)
def test_out_of_scope_references_are_refused(cat, statement, message):
    with pytest.raises(ForbiddenExpressionError, match=message):
        cat.sql(statement)


def test_in_scope_ctes_named_after_system_views_read_the_cte(cat):
    out = cat.sql(
        "WITH \"PG_SETTINGS\" AS (SELECT 'cte' AS v) SELECT p.v FROM pg_settings AS p, "
        "(SELECT v FROM ds WHERE EXISTS (SELECT 1 FROM pg_settings)) AS d"
    )
    assert out.column("v").to_pylist() == ["cte", "cte"]
    out = cat.sql(
        "WITH RECURSIVE pg_class AS (SELECT 1 AS n UNION ALL SELECT n + 1 FROM pg_class "
        "WHERE n < 3) SELECT n FROM pg_class"
    )
    assert out.column("n").to_pylist() == [1, 2, 3]
