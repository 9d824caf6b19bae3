"""Plain-text tables for the CLI and the benchmarks."""

from __future__ import annotations

import textwrap
from typing import Any

__all__ = ["format_table"]


WIDTH = 60  # a longer cell (a job's predicate) wraps onto more lines, whole


def _cell(v: Any) -> list[str]:
    if isinstance(v, float):
        return [f"{v:.4g}"]
    if isinstance(v, bytes):
        return [f"<{len(v)} bytes>"]
    text = "" if v is None else str(v)
    return textwrap.wrap(text, WIDTH, break_on_hyphens=False) or [""]


def format_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """Format dict rows as an aligned plain-text table."""
    if not rows:
        return "(no rows)" if columns is None else "  ".join(columns) + "\n(no rows)"
    columns = columns or list(rows[0])
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [
        max(len(c), *(len(line) for row in cells for line in row[i])) for i, c in enumerate(columns)
    ]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        for k in range(max(len(cell) for cell in row)):
            parts = (cell[k] if k < len(cell) else "" for cell in row)
            lines.append("  ".join(p.ljust(w) for p, w in zip(parts, widths, strict=True)).rstrip())
    return "\n".join(lines)
