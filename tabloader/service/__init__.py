"""The loader service: one process per catalog, serving jobs of other processes."""

from __future__ import annotations

__all__: list[str] = []
