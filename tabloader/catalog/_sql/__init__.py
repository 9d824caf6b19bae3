"""Statements: the sqlglot dialect, the allow-list checks and their execution."""
