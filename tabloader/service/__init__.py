"""The loader service: one process per catalog owns the catalog and engine; jobs are clients."""

from __future__ import annotations

__all__: list[str] = []
