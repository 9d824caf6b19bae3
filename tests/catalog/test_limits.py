"""Bounded statements: memory and time limits, text and nesting bounds, SELECT reaches datasets
only, and the predicate function allow-list matches the parser."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
from sqlglot import exp

from tabloader import catalog
from tabloader.catalog import CatalogError, ForbiddenExpressionError, StatementError
from tabloader.catalog._database import translate
from tabloader.catalog._limits import Limits
from tabloader.catalog._settings import parse_bytes
from tabloader.catalog._sql.dialect import MAX_NESTING, MAX_STATEMENT_CHARS
from tabloader.catalog._sql.validate import PREDICATE_FUNCTION_CALLS

STATEMENTS = Path(__file__).parents[2] / "docs" / "statements.md"


@pytest.fixture(scope="module")
def table_t(tmp_path_factory):
    """A closed catalog holding dataset ``t``, imported once: each test opens a copy."""
    root = tmp_path_factory.mktemp("limits") / "cat"
    with catalog.open_catalog(root, create=True) as c:
        c.import_arrow(
            "t",
            pa.table(
                {
                    "x": [float(i) for i in range(1000)],
                    "s": [f"s{i}" for i in range(1000)],
                    "d": pa.array(list(range(1000)), pa.date32()),
                    "l": [[i, i] for i in range(1000)],
                }
            ),
        )
    return root


@pytest.fixture
def cat(tmp_path, table_t):
    shutil.copytree(table_t, tmp_path / "cat", copy_function=shutil.copy)
    with catalog.open_catalog(tmp_path / "cat", memory_limit="64MiB", statement_timeout=2) as c:
        yield c


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT list_sum(range(3000000000))",
        "SELECT length(repeat('a', 4000000000))",
        "SELECT length(repeat('a', 40000 * 100000))",
        "SELECT lpad('a', 4000000000, 'b')",
        "SELECT list_resize([1], 1000000000)",
    ],
)
def test_values_over_the_memory_limit_are_refused(cat, statement):
    with pytest.raises(StatementError, match="memory limit") as info:
        cat.sql(statement)
    message = str(info.value)
    assert "the statement memory limit is 64.0 MiB; raise it with connect(path, memory_limit=" in (
        message
    )
    assert "\n" not in message


def test_a_predicate_over_the_memory_limit_is_refused(cat):
    with pytest.raises(StatementError, match="not allowed in a job predicate"):
        cat.sql("REGISTER JOB j SELECT x FROM t WHERE length(repeat(s, 4000000000)) > 0")
    assert cat.job_names() == []


def test_predicate_generators_are_checked_when_allowed(cat, monkeypatch):
    """Were a generator on the allow-list, its size would be checked against the limit."""
    import tabloader.catalog._sql.validate as validate

    monkeypatch.setattr(
        validate, "PREDICATE_FUNCTION_NODES", (*validate.PREDICATE_FUNCTION_NODES, exp.Repeat)
    )
    with pytest.raises(StatementError, match="over the limit of 16.0 MiB for one value"):
        cat.sql("REGISTER JOB j SELECT x FROM t WHERE length(repeat(s, 4000000000)) > 0")


def test_a_slow_predicate_is_stopped_at_the_time_limit(tmp_path):
    with catalog.open_catalog(tmp_path / "slow", statement_timeout=0.001) as slow:
        slow.import_arrow("big", pa.table({"x": pa.array(range(1_000_000), pa.int64())}))
        with pytest.raises(StatementError, match="The predicate of job 'j' was stopped: it ran"):
            slow.sql(
                "REGISTER JOB j SELECT x FROM big WHERE regexp_matches(CAST(x AS VARCHAR) || "
                "CAST(x * 3 AS VARCHAR), '(1|2|3)*(4|5)*9$') AND hash(x) % 3 = 1"
            )
        assert slow.job_names() == []


def test_duckdb_runs_under_the_memory_limit(cat):
    (value,) = cat.connection.execute("SELECT current_setting('memory_limit')").fetchone()
    assert value.replace(" ", "") in ("64.0MiB", "67.1MB")


def test_out_of_memory_names_the_limit():
    exc = duckdb.OutOfMemoryException("Out of Memory Error: failed to pin block\n\nPossible...")
    error = translate(
        exc, "SELECT", root=Path("/c"), error=StatementError, limits=Limits(1 << 30, 9)
    )
    assert str(error) == (
        "SELECT ran out of memory (Out of Memory Error: failed to pin block); the statement "
        "memory limit is 1.0 GiB; raise it with connect(path, memory_limit='8GB') or "
        "$TABLOADER_MEMORY_LIMIT."
    )


def test_a_long_statement_is_stopped_at_the_time_limit(cat):
    with pytest.raises(StatementError) as info:
        cat.sql("SELECT count(*) FROM t a, t b, t c, t d WHERE hash(a.x + b.x + c.x + d.x) = 7")
    assert str(info.value) == (
        "SELECT was stopped: it ran too long; the statement time limit is 2 s; raise it with "
        "connect(path, statement_timeout=SECONDS) or $TABLOADER_STATEMENT_TIMEOUT."
    )
    assert cat.sql("SELECT count(*) AS n FROM t").column("n").to_pylist() == [1000]  # usable


def test_limits_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TABLOADER_MEMORY_LIMIT", "128MiB")
    monkeypatch.setenv("TABLOADER_STATEMENT_TIMEOUT", "7")
    with catalog.open_catalog(tmp_path) as c:
        assert c.limits == Limits(128 << 20, 7.0)
    with catalog.open_catalog(tmp_path, memory_limit=1 << 30, statement_timeout=2) as c:
        assert c.limits == Limits(1 << 30, 2.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_limit": "lots"}, r"memory_limit 'lots' is not a size; .* e\.g\. '2GB'"),
        ({"memory_limit": 0}, r"memory_limit 0 is below the range: .* from 1\.0 MiB to "),
        ({"memory_limit": 1 << 60}, r"memory_limit 1152921504606846976 is above the range"),
        ({"statement_timeout": 0}, r"statement_timeout 0 is below the range: .* e\.g\. 60\."),
        ({"statement_timeout": "soon"}, "statement_timeout 'soon' is not a number"),
    ],
)
def test_bad_limits_are_refused(tmp_path, kwargs, message):
    with pytest.raises(CatalogError, match=message):
        catalog.open_catalog(tmp_path, **kwargs)


def test_parse_bytes():
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("1.5 GiB") == 3 << 29
    assert parse_bytes(1024) == 1024


def test_deep_nesting_is_a_one_line_error(cat):
    deep = "(" * 50 + "x" + ")" * 50
    with pytest.raises(StatementError, match=f"nests parentheses more than {MAX_NESTING} deep"):
        cat.sql(f"REGISTER JOB j SELECT x FROM t WHERE {deep} > 1")
    with pytest.raises(StatementError, match="nests parentheses"):
        cat.register_job("j", "t", where=f"{deep} > 1")
    with pytest.raises(StatementError, match="nests parentheses"):
        cat.sql(f"SELECT {deep}")
    ok = "(" * MAX_NESTING + "x" + ")" * MAX_NESTING
    assert cat.sql(f"REGISTER JOB j SELECT x FROM t WHERE {ok} > 1").num_rows == 998


def test_long_operator_chains_are_a_one_line_error(cat):
    with pytest.raises(StatementError, match="nested too deeply"):
        cat.sql("REGISTER JOB j SELECT x FROM t WHERE " + "NOT " * 3000 + "x > 1")


def test_a_huge_in_list_is_refused_before_parsing(cat):
    items = ", ".join(str(i) for i in range(1_000_000))
    with pytest.raises(StatementError, match=f"over the limit of {MAX_STATEMENT_CHARS:,}"):
        cat.sql(f"REGISTER JOB j SELECT x FROM t WHERE x IN ({items})")
    with pytest.raises(StatementError, match="characters long"):
        cat.register_job("j", "t", where=f"x IN ({items})")
    small = ", ".join(str(i) for i in range(5000))
    assert cat.sql(f"REGISTER JOB j SELECT x FROM t WHERE x IN ({small})").num_rows == 1000


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT current_setting('home_directory')",
        "SELECT getvariable('x')",
        "SELECT * FROM pragma_database_list",
        "SELECT * FROM pragma_database_list()",
        "SELECT * FROM duckdb_settings()",
        "SELECT * FROM duckdb_tables",
        "SELECT duckdb_api()",
        "SELECT * FROM information_schema.tables",
        "SELECT * FROM _tabloader.jobs",
        "SELECT * FROM main.t",
        "SELECT * FROM settings",
        "SELECT version()",
        "SELECT current_database()",
        "SELECT x FROM t WHERE s IN (SELECT name FROM duckdb_settings())",
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM glob('/*')",
    ],
)
def test_select_reaches_dataset_tables_only(cat, statement):
    with pytest.raises(ForbiddenExpressionError) as info:
        cat.sql(statement)
    assert "\n" not in str(info.value)


def test_select_on_datasets_and_ctes_runs(cat):
    out = cat.sql(
        "WITH small AS (SELECT x FROM t WHERE x < 10) "
        "SELECT count(*) AS n FROM small JOIN T USING (x)"
    )
    assert out.column("n").to_pylist() == [10]


def test_every_offered_function_registers(cat):
    try:
        cat.sql("REGISTER JOB j SELECT x FROM t WHERE nope(x) > 0")
    except ForbiddenExpressionError as exc:
        offered = set(re.findall(r"\b([a-z_]+)\b", str(exc).split("functions", 1)[1]))
    offered -= {"on", "the", "dataset", "s", "columns", "line", "col"}
    text = STATEMENTS.read_text()
    section = text[text.index("predicates use an allow-list") :]
    offered |= set(re.findall(r"`([a-z_]+)`", section[: section.index("no subqueries")]))
    assert {"contains", "ends_with", "array_length", "hash", "lower", "abs"} <= offered
    assert offered <= set(PREDICATE_FUNCTION_CALLS)
    columns = {"x": "x", "s": "s", "d": "d", "l": "l"}
    for name in sorted(offered):
        call = PREDICATE_FUNCTION_CALLS[name]
        call = re.sub(r"\b([xsdl])\b", lambda m: columns[m.group(1)], call)
        cat.sql(f"REGISTER OR REPLACE JOB j SELECT x FROM t WHERE ({call}) IS NOT NULL")
