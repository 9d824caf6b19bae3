"""Plain text for the CLI, the service and the benchmarks: tables, statement results."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

# C0 and C1 control characters but the newline and the tab: a name or value holding a terminal
# escape ("\x1b[31m") must not drive the terminal it is printed on.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: Any) -> str:
    """``str(text)`` with each control character (but newline and tab) shown as ``\\xNN``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


WIDTH = 60  # a longer cell (a job's predicate) wraps onto more lines, whole


def _cell(v: Any) -> list[str]:
    if isinstance(v, float):
        return [f"{v:.4g}"]
    if isinstance(v, bytes):
        return [f"<{len(v)} bytes>"]
    text = "" if v is None else printable(v)
    return textwrap.wrap(text, WIDTH, break_on_hyphens=False) or [""]


def format_table(rows: Sequence[Mapping[str, Any]], columns: list[str] | None = None) -> str:
    """Format dict rows as an aligned plain-text table."""
    if not rows:
        return "(no rows)" if columns is None else printable("  ".join(columns)) + "\n(no rows)"
    keys = columns or list(rows[0])
    cells = [[_cell(r.get(c)) for c in keys] for r in rows]
    columns = [printable(c) for c in keys]
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


def describe_result(result: Any) -> str:
    """A statement's result as text: a table, a dataset or job summary, or OK."""
    import pyarrow as pa

    from tabloader.catalog import Dataset, Job

    if isinstance(result, pa.Table):
        return format_table(result.to_pylist(), result.column_names)
    if isinstance(result, Dataset):
        return (
            f"Dataset {result.name} version {result.version}: {result.num_rows:,} rows, "
            f"columns {', '.join(result.columns)}"
        )
    if isinstance(result, Job):
        return (
            f"Job {result.name} on {result.dataset} (version {result.dataset_version}): "
            f"{result.num_rows:,} rows, columns {', '.join(result.columns)}"
        )
    return "OK" if result is None else str(result)
