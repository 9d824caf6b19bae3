"""The size check of a user statement: no call may build one value over the memory cap.

DuckDB allocates the values that generators with constant arguments build (``range``,
``repeat``, ``lpad``...) outside its buffer manager, so its ``memory_limit``
(:class:`tabloader.catalog._limits.Limits`) alone does not stop ``SELECT length(repeat('a',
4000000000))`` (it took 8-17 GB): :func:`check_sizes` estimates each such call's value
from its constant arguments (folded by sqlglot) and refuses one over a quarter of the cap
(the statement copies it).
"""

from __future__ import annotations

from collections.abc import Callable

from sqlglot import exp
from sqlglot.optimizer.simplify import simplify

from tabloader.catalog._errors import StatementError
from tabloader.catalog._limits import Limits
from tabloader.catalog._settings import format_bytes


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
GENERATORS: dict[str, Callable[[exp.Func], float | None]] = {
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
