"""Benchmarks: each runs the competitors side by side in one run and reports ratios.

A benchmark module defines ``add_arguments(parser)`` and ``run(args) -> int``; it prints a table
to stdout and writes JSON (``--out``). ``BENCHMARKS`` lists them by name and is the only place a
new benchmark needs to be registered.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["BENCHMARKS", "format_table", "load", "write_json"]

BENCHMARKS: dict[str, str] = {
    "catalog": "tabloader.bench.catalog",
    "sampling": "tabloader.bench.sampling",
    "e2e": "tabloader.bench.e2e",
}


def load(name: str) -> ModuleType:
    """Import the module of benchmark ``name``."""
    return importlib.import_module(BENCHMARKS[name])


def format_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """Format dict rows as an aligned plain-text table."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` as JSON to ``path`` (``-`` or None: nowhere)."""
    if path is None:
        return
    if str(path) == "-":
        json.dump(payload, sys.stdout, indent=2, default=str)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=str))
