"""The tabloader SQL dialect: DuckDB's, plus catalog statements.

::

    CREATE DATASET name FROM 'path' [FORMAT imagefolder|parquet|arrow|hf]
        [WITH (follow_links = true, split = 'train', storage = 's3://bucket/prefix')]
    APPEND TO DATASET name FROM 'path' [FORMAT ...] [WITH (...)]
    REGISTER [OR REPLACE] JOB name SELECT cols FROM dataset [WHERE predicate]
        [WITH (key = value, ...)]
    UNREGISTER JOB [IF EXISTS] name
    SHOW DATASETS | SHOW JOBS | DESCRIBE name | DROP DATASET [IF EXISTS] name [CASCADE]
    SELECT ...    -- read-only, passed to DuckDB

The catalog statements are parsed by extending sqlglot's ``Parser._parse_statement``; every
other statement goes to the DuckDB parser unchanged, so SELECT, expressions and error positions
are sqlglot's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import sqlglot
from sqlglot import exp
from sqlglot.dialects.duckdb import DuckDB
from sqlglot.errors import ParseError, TokenError
from sqlglot.parsers.duckdb import DuckDBParser

from tabloader.catalog._errors import StatementError

FORMATS = ("imagefolder", "parquet", "arrow", "hf")
# Bounds on statement text, checked before parsing: sqlglot's parser is recursive (50 nested
# parentheses overflow Python's stack) and takes ~5 s per 100,000 IN-list items.
MAX_STATEMENT_CHARS = 100_000
MAX_NESTING = 32
_OPENERS = {sqlglot.TokenType.L_PAREN, sqlglot.TokenType.L_BRACKET, sqlglot.TokenType.L_BRACE}
_CLOSERS = {sqlglot.TokenType.R_PAREN, sqlglot.TokenType.R_BRACKET, sqlglot.TokenType.R_BRACE}


class CreateDataset(exp.Expression):
    """``CREATE DATASET this FROM path [FORMAT format] [WITH (options)]``."""

    arg_types = {"this": True, "path": True, "format": False, "options": False}


class AppendDataset(exp.Expression):
    """``APPEND TO DATASET this FROM path [FORMAT format] [WITH (options)]``."""

    arg_types = {"this": True, "path": True, "format": False, "options": False}


class RegisterJob(exp.Expression):
    """``REGISTER [OR REPLACE] JOB this <select> [WITH (options)]``."""

    arg_types = {"this": True, "query": True, "options": False, "replace": False}


class UnregisterJob(exp.Expression):
    """``UNREGISTER JOB [IF EXISTS] this``."""

    arg_types = {"this": True, "exists": False}


class ShowDatasets(exp.Expression):
    """``SHOW DATASETS``."""

    arg_types: ClassVar[dict[str, bool]] = {}


class ShowJobs(exp.Expression):
    """``SHOW JOBS``."""

    arg_types: ClassVar[dict[str, bool]] = {}


class DescribeDataset(exp.Expression):
    """``DESCRIBE this``."""

    arg_types = {"this": True}


class DropDataset(exp.Expression):
    """``DROP DATASET [IF EXISTS] this [CASCADE]``."""

    arg_types = {"this": True, "exists": False, "cascade": False}


class TabloaderParser(DuckDBParser):
    """DuckDB's parser with the catalog statements in front."""

    # The catalog statements by their leading words, tried in order (as sqlglot's
    # STATEMENT_PARSERS maps a statement's first token to its parser).
    CATALOG_STATEMENTS: ClassVar[dict[tuple[str, ...], Callable[[TabloaderParser], exp.Expr]]] = {
        ("CREATE", "DATASET"): lambda self: self._parse_dataset_source(CreateDataset),
        ("APPEND", "TO", "DATASET"): lambda self: self._parse_dataset_source(AppendDataset),
        ("REGISTER",): lambda self: self._parse_register(),
        ("UNREGISTER", "JOB"): lambda self: self._parse_unregister(),
        ("SHOW", "DATASETS"): lambda self: self.expression(ShowDatasets()),
        ("SHOW", "JOBS"): lambda self: self.expression(ShowJobs()),
        ("DESCRIBE",): lambda self: self.expression(
            DescribeDataset(this=self._parse_name("dataset"))
        ),
        ("DESC",): lambda self: self.expression(DescribeDataset(this=self._parse_name("dataset"))),
        ("DROP", "DATASET"): lambda self: self._parse_drop_dataset(),
    }

    def _parse_statement(self) -> exp.Expr | None:
        if self._curr is None:
            return None
        for words, parse_statement in self.CATALOG_STATEMENTS.items():
            if self._match_text_seq(*words):
                return parse_statement(self)
        return super()._parse_statement()

    def _parse_register(self) -> exp.Expr:
        replace = self._match_text_seq("OR", "REPLACE")
        self._expect_words("JOB")
        name = self._parse_name("job")
        if not self._match(sqlglot.TokenType.SELECT, advance=False):
            self.raise_error("Expected SELECT <columns> FROM <dataset> after the job name")
        query = self._parse_select()
        options = self._parse_options() if self._match(sqlglot.TokenType.WITH) else None
        return self.expression(
            RegisterJob(this=name, query=query, options=options, replace=replace or None)
        )

    def _parse_unregister(self) -> exp.Expr:
        exists = self._match_text_seq("IF", "EXISTS")
        return self.expression(UnregisterJob(this=self._parse_name("job"), exists=exists or None))

    def _parse_drop_dataset(self) -> exp.Expr:
        exists = self._match_text_seq("IF", "EXISTS")
        name = self._parse_name("dataset")
        cascade = self._match_text_seq("CASCADE")
        return self.expression(
            DropDataset(this=name, exists=exists or None, cascade=cascade or None)
        )

    def _warn_unsupported(self) -> None:
        # sqlglot logs a warning when it falls back to an opaque Command (LOAD, CALL...);
        # execute refuses every Command with its own one-line error, so that would be noise.
        return

    def _parse_table_hints(self) -> list[exp.Expr] | None:
        # T-SQL's "FROM t WITH (NOLOCK)" would swallow REGISTER JOB's "WITH (options)".
        return None

    def _expect_words(self, *words: str) -> None:
        if not self._match_text_seq(*words):
            self.raise_error(f"Expected {' '.join(words)}")

    def _parse_name(self, kind: str) -> exp.Identifier:
        name = self._parse_id_var(any_token=False)
        if not isinstance(name, exp.Identifier):
            self.raise_error(f"Expected a {kind} name")
        return name  # type: ignore[return-value]

    def _parse_dataset_source(self, cls: type[exp.Expression]) -> exp.Expression:
        name = self._parse_name("dataset")
        self._expect_words("FROM")
        path = self._parse_string()
        if path is None:
            self.raise_error("Expected a quoted path after FROM, e.g. FROM 'data/imagenet'")
        fmt = None
        if self._match_text_seq("FORMAT"):
            fmt = self._parse_var(any_token=True)
            if fmt is None or fmt.name.lower() not in FORMATS:
                self.raise_error(f"Expected a FORMAT among {', '.join(FORMATS)}")
        options = self._parse_options() if self._match(sqlglot.TokenType.WITH) else None
        return self.expression(cls(this=name, path=path, format=fmt, options=options))

    def _parse_options(self) -> exp.Tuple:
        def option() -> exp.Expression | None:
            key = self._parse_id_var(any_token=True)
            if key is None or not self._match(sqlglot.TokenType.EQ):
                self.raise_error("Expected key = value in WITH (...)")
            value = self._parse_primary() or self._parse_unary()
            if value is None:
                self.raise_error("Expected a value (number, 'string', TRUE or FALSE)")
            return exp.EQ(this=key, expression=value)

        return exp.Tuple(expressions=self._parse_wrapped_csv(option))


class Tabloader(DuckDB):
    """The sqlglot dialect of tabloader statements."""

    class Parser(TabloaderParser):
        """Parser with the catalog statements."""


def _statement_error(exc: ParseError | TokenError) -> StatementError:
    errors: list[dict[str, Any]] = getattr(exc, "errors", []) or []
    if errors:
        first = errors[0]
        return StatementError(
            f"Cannot parse statement: {first.get('description', exc)}, near "
            f"'{first.get('highlight', '')}'",
            line=first.get("line"),
            col=first.get("col"),
        )
    return StatementError(f"Cannot parse statement: {exc}")


def parse(text: str) -> exp.Expr:
    """Parse exactly one statement.

    Raises:
        StatementError: it does not parse, or there is not exactly one statement.
    """
    if not isinstance(text, str) or not text.strip():
        raise StatementError("Empty statement; write e.g. SHOW DATASETS.")
    check_size(text)
    try:
        statements = [s for s in sqlglot.parse(text, dialect=Tabloader) if s is not None]
    except (ParseError, TokenError) as exc:
        raise _statement_error(exc) from exc
    if len(statements) != 1:
        raise StatementError(
            f"Expected exactly one statement, found {len(statements)}; send them one at a time."
        )
    return statements[0]


def absolute_paths(text: str, cwd: str | os.PathLike[str] | None = None) -> str:
    """``text`` with the relative FROM path of a CREATE or APPEND TO DATASET statement made
    absolute against ``cwd`` (default: this process's working directory); any other statement
    unchanged. For a statement that another process (the loader service) runs.

    The path's literal is replaced where the parser found it, the rest of the text is kept.

    Raises:
        StatementError: ``text`` is not one statement (as ``parse``).
    """
    stmt = parse(text)
    if not isinstance(stmt, (CreateDataset, AppendDataset)):
        return text
    literal = stmt.args["path"]
    if os.path.isabs(literal.name) or "://" in literal.name:  # (a URI: s3://bucket/prefix)
        return text
    path = exp.Literal.string(str(Path(cwd or os.getcwd()).absolute() / literal.name))
    start, end = literal.meta["start"], literal.meta["end"]  # the literal's token, inclusive
    return text[:start] + path.sql(dialect=Tabloader) + text[end + 1 :]


def parse_predicate(text: str) -> exp.Expr:
    """Parse a WHERE predicate on its own (for ``Catalog.register_job(where=...)``)."""
    check_size(text)
    try:
        return sqlglot.parse_one(text, dialect=Tabloader, into=exp.Condition)
    except (ParseError, TokenError) as exc:
        raise _statement_error(exc) from exc


def check_size(text: str) -> None:
    """Refuse statement text longer than ``MAX_STATEMENT_CHARS`` or nested deeper than
    ``MAX_NESTING`` (before parsing it).

    Raises:
        StatementError: naming the limit and the fix.
    """
    if len(text) > MAX_STATEMENT_CHARS:
        raise StatementError(
            f"The statement is {len(text):,} characters long, over the limit of "
            f"{MAX_STATEMENT_CHARS:,}; for a long IN list, filter on a column instead "
            "(e.g. a range or a label), or register several jobs."
        )
    try:
        tokens = Tabloader().tokenize(text)
    except TokenError as exc:
        raise _statement_error(exc) from exc
    depth = 0
    for tok in tokens:
        if tok.token_type in _OPENERS:
            depth += 1
            if depth > MAX_NESTING:
                raise StatementError(
                    f"The statement nests parentheses more than {MAX_NESTING} deep; "
                    "remove redundant parentheses or split the expression.",
                    line=tok.line,
                    col=tok.col,
                )
        elif tok.token_type in _CLOSERS:
            depth -= 1


def first_token(text: str) -> str:
    """The first token of a parsed statement's ``text`` as written (comments skipped)."""
    return Tabloader().tokenize(text)[0].text


def split_statements(text: str) -> list[str]:
    """Split a script into statement texts at top-level semicolons (sqlglot's tokenizer)."""
    try:
        tokens = Tabloader().tokenize(text)
    except TokenError as exc:
        raise _statement_error(exc) from exc
    out, start = [], 0
    for tok in tokens:
        if tok.token_type == sqlglot.TokenType.SEMICOLON:
            out.append(text[start : tok.start])
            start = tok.end + 1
    out.append(text[start:])
    return [s.strip() for s in out if s.strip()]
