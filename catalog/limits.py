"""Bounds on user statements: memory, time, and the size of what a function may build.

User SQL (SELECT pass-through and job predicates) runs under

* a memory cap: DuckDB's ``memory_limit`` (what its operators may hold), and a check before
  running that no generator with constant arguments (``range``, ``repeat``, ``lpad``...)
  builds one value larger than a quarter of that cap (the statement copies it): DuckDB
  allocates such values outside its buffer manager, so ``memory_limit`` alone does not stop
  ``SELECT length(repeat('a', 4000000000))`` (it took 8-17 GB);
* a time limit: the connection is interrupted when a statement runs longer.

Both come from ``connect(path, memory_limit=..., statement_timeout=...)``, else the
environment (``$TABLOADER_MEMORY_LIMIT``, ``$TABLOADER_STATEMENT_TIMEOUT``), else defaults a
laptop survives (the smaller of 4 GiB and half the memory; 60 s). Statement text and nesting
have fixed bounds (``catalog.sql.dialect``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlglot import exp
from sqlglot.optimizer.simplify import simplify

from catalog.errors import StatementError
from catalog.settings import format_bytes, physical_memory, setting

__all__ = [
    "MEMORY_ENV",
    "TIMEOUT_ENV",
    "Limits",
    "check_sizes",
]

MEMORY_ENV = "TABLOADER_MEMORY_LIMIT"
TIMEOUT_ENV = "TABLOADER_STATEMENT_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0


def _default_memory() -> int:
    return min(4 << 30, physical_memory() // 2)


@dataclass(frozen=True)
class Limits:
    """The bounds of user statements.

    Attributes:
        memory_limit: bytes DuckDB may use, and the largest value a generator may build.
        statement_timeout: seconds a statement may run before it is interrupted.
    """

    memory_limit: int
    statement_timeout: float

    @classmethod
    def resolve(
        cls, memory_limit: int | str | None = None, statement_timeout: float | None = None
    ) -> Limits:
        """The limits from the arguments, else the environment, else the defaults (checked
        by ``catalog.settings``)."""
        memory = setting("memory_limit", memory_limit)
        seconds = setting("statement_timeout", statement_timeout)
        return cls(_default_memory() if memory is None else memory, seconds)

    @property
    def memory_fix(self) -> str:
        return (
            f"the statement memory limit is {format_bytes(self.memory_limit)}; raise it with "
            f"connect(path, memory_limit='8GB') or ${MEMORY_ENV}"
        )

    @property
    def value_limit(self) -> int:
        """The most bytes one generated value may take: a quarter of ``memory_limit``."""
        return self.memory_limit // 4

    @property
    def time_fix(self) -> str:
        return (
            f"the statement time limit is {self.statement_timeout:g} s; raise it with "
            f"connect(path, statement_timeout=SECONDS) or ${TIMEOUT_ENV}"
        )

    @contextmanager
    def timer(self, interrupt: Any) -> Iterator[None]:
        """Call ``interrupt()`` (a DuckDB connection's) if the block outlasts the time limit.

        After the limit it is called every 10 ms until the block ends: an interrupt that
        arrives before DuckDB starts the query is forgotten when it starts.
        """
        done = threading.Event()

        def watch() -> None:
            delay = self.statement_timeout
            while not done.wait(delay):
                interrupt()
                delay = 0.01

        watcher = threading.Thread(target=watch, name="tabloader-statement-timer", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()


def _number(node: exp.Expr | None) -> float | None:
    """The value of a constant numeric expression (folded by sqlglot), else None."""
    if node is None:
        return None
    folded = simplify(node.copy())
    if isinstance(folded, exp.Neg) and isinstance(folded.this, exp.Literal):
        folded = exp.Literal.number(f"-{folded.this.this}")
    if isinstance(folded, exp.Literal) and not folded.is_string:
        try:
            return float(folded.this)
        except ValueError:
            return None
    return None


def _string_length(node: exp.Expr | None) -> int:
    if isinstance(node, exp.Literal) and node.is_string:
        return max(len(node.this.encode()), 1)
    return 1


def _series_bytes(args: list[exp.Expr], inclusive: bool) -> float | None:
    nums = [_number(a) for a in args]
    if not nums or any(n is None for n in nums):
        return None
    start, stop, step = (0.0, nums[0], 1.0) if len(nums) == 1 else (nums[0], nums[1], 1.0)
    if len(nums) >= 3:
        step = nums[2] or 1.0
    count = (stop - start) / step + (1 if inclusive else 0)  # type: ignore[operator]
    return 8 * max(count, 0)


def _times(count: exp.Expr | None, unit: float) -> float | None:
    n = _number(count)
    return None if n is None else max(n, 0) * unit


def _args(node: exp.Expr) -> list[exp.Expr]:
    """A call's arguments in order (sqlglot keeps named args for known functions)."""
    if isinstance(node, exp.Anonymous):
        return list(node.expressions)
    return [v for k, v in node.args.items() if isinstance(v, exp.Expr) and k != "expressions"]


def _name(node: exp.Func) -> str:
    return node.name.upper() if isinstance(node, exp.Anonymous) else node.sql_name().upper()


# Functions whose value grows with an argument, and the bytes a call builds (None: unknown).
GENERATORS: dict[str, Any] = {
    "RANGE": lambda n: _series_bytes(_args(n), inclusive=False),
    "GENERATE_SERIES": lambda n: _series_bytes(_args(n), inclusive=True),
    "REPEAT": lambda n: _times(_args(n)[1], _string_length(_args(n)[0])),
    "LPAD": lambda n: _times(_args(n)[1], 1),
    "RPAD": lambda n: _times(_args(n)[1], 1),
    "PAD": lambda n: _times(n.args.get("expression"), 1),
    "LIST_RESIZE": lambda n: _times(_args(n)[1], 8),
    "ARRAY_RESIZE": lambda n: _times(_args(n)[1], 8),
}


def check_sizes(expr: exp.Expr, limits: Limits) -> None:
    """Refuse a call that would build a value larger than ``limits.value_limit``.

    Raises:
        StatementError: naming the function, the size, the limit and how to raise it.
    """
    for node in expr.walk():
        if not isinstance(node, exp.Func):
            continue
        estimate = GENERATORS.get(_name(node))
        if estimate is None:
            continue
        try:
            size = estimate(node)
        except (IndexError, TypeError, ZeroDivisionError):
            size = None
        if size is not None and size > limits.value_limit:
            call = node.sql(dialect="duckdb")
            call = call if len(call) <= 60 else call[:57] + "..."
            raise StatementError(
                f"{call} would build a value of {format_bytes(size)}, over the limit of "
                f"{format_bytes(limits.value_limit)} for one value (a quarter of the memory "
                f"limit): {limits.memory_fix}."
            )
