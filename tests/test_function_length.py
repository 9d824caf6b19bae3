"""The product's code stays readable at a glance: no function or method over
``MAX_FUNCTION_LINES`` lines (its ``def`` to its last line, docstring included), measured
with ``ast`` over every module of ``tabloader/``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of each function of ``source`` over ``limit`` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append((node.name, node.lineno, lines))
    return found


def test_no_product_function_is_over_80_lines():
    over = [
        f"{path.relative_to(ROOT)}:{line} {name} ({lines} lines)"
        for path in sorted((ROOT / "tabloader").rglob("*.py"))
        for name, line, lines in long_functions(path.read_text())
    ]
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(over)


def test_the_measure_counts_a_function_from_def_to_its_last_line():
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    nested = f"class C:\n    def method(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n"
    assert long_functions(f"def f():\n{body}\n") == [("f", 1, 81)]
    assert long_functions(f"def f():\n{body}\n", limit=81) == []
    assert long_functions(nested) == [("method", 2, 81)]
