"""The catalog's structure: one DuckDB error boundary, statements without an import circle."""

from __future__ import annotations

import ast
from pathlib import Path

import duckdb
import pytest

import tabloader.catalog._sql
from tabloader.catalog import AlreadyExistsError, CatalogError, CatalogLockedError, StatementError
from tabloader.catalog._database import duckdb_errors, translate
from tabloader.catalog._sql.dialect import TabloaderParser


def test_statements_do_not_import_the_catalog():
    """tabloader.catalog._catalog imports tabloader.catalog._sql; nothing there imports it back,
    not even lazily."""
    sql = Path(tabloader.catalog._sql.__file__).parent
    for path in sql.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "tabloader.catalog._catalog", path
                assert not (
                    node.module == "catalog"
                    and any(a.name in ("Catalog", "catalog") for a in node.names)
                ), path


@pytest.mark.parametrize(
    ("exc", "kwargs", "cls", "message"),
    [
        (
            duckdb.IOException('Could not set lock on file "x": Conflicting lock (PID 42)'),
            {},
            CatalogLockedError,
            r"in use by another process \(PID 42\)",
        ),
        (
            duckdb.ConstraintException("Duplicate key"),
            {"exists": "Job 'j' exists already"},
            AlreadyExistsError,
            "Job 'j' exists already",
        ),
        (
            duckdb.ConstraintException("Duplicate key"),
            {},
            CatalogError,
            "X failed in DuckDB: Duplicate key.",
        ),
        (
            duckdb.BinderException("Binder Error: no column"),
            {"error": StatementError, "fix": "Fix it."},
            StatementError,
            "X failed in DuckDB: Binder Error: no column. Fix it.",
        ),
        (
            duckdb.IOException("No space left on device"),
            {},
            CatalogError,
            "The disk holding /cat is full",
        ),
    ],
)
def test_duckdb_errors_are_translated_at_one_boundary(exc, kwargs, cls, message):
    assert isinstance(translate(exc, "X", root=Path("/cat"), **kwargs), cls)
    with pytest.raises(cls, match=message) as info, duckdb_errors("X", root=Path("/cat"), **kwargs):
        raise exc
    assert info.value.__cause__ is exc


def test_catalog_statements_dispatch_from_a_table():
    words = {" ".join(k) for k in TabloaderParser.CATALOG_STATEMENTS}
    assert {"CREATE DATASET", "REGISTER", "SHOW JOBS", "DROP DATASET"} <= words
