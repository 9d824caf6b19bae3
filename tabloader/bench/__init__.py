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

from tabloader._format import format_table

__all__ = ["BENCHMARKS", "format_table", "load", "write_json"]

BENCHMARKS: dict[str, str] = {
    "catalog": "tabloader.bench.catalog",
    "sampling": "tabloader.bench.sampling",
    "e2e": "tabloader.bench.e2e",
}


def load(name: str) -> ModuleType:
    """Import the module of benchmark ``name``."""
    return importlib.import_module(BENCHMARKS[name])


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` as JSON to ``path`` (``-`` or None: nowhere)."""
    if path is None:
        return
    if str(path) == "-":
        json.dump(payload, sys.stdout, indent=2, default=str)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=str))
