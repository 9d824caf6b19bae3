"""Plain-text tables for the CLI and the benchmarks."""

from __future__ import annotations

from typing import Any

__all__ = ["format_table"]


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, bytes):
        return f"<{len(v)} bytes>"
    text = "" if v is None else str(v)
    return text if len(text) <= 60 else text[:57] + "..."


def format_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """Format dict rows as an aligned plain-text table."""
    if not rows:
        return "(no rows)" if columns is None else "  ".join(columns) + "\n(no rows)"
    columns = columns or list(rows[0])
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=False)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=False)).rstrip() for row in cells
    ]
    return "\n".join(lines)
