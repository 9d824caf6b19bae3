"""Statements: the sqlglot dialect, the allow-list checks and their execution."""

from __future__ import annotations

from tabloader.catalog._sql.dialect import Tabloader, parse, parse_predicate
from tabloader.catalog._sql.execute import execute
from tabloader.catalog._sql.validate import check_predicate, check_query

__all__ = ["Tabloader", "check_predicate", "check_query", "execute", "parse", "parse_predicate"]
