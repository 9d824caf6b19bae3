"""Bounds on user statements: memory, time, and the size of what a function may build.

User SQL (SELECT pass-through and job predicates) runs under

* a memory cap: DuckDB's ``memory_limit`` (what its operators may hold), and a check before
  running that no generator with constant arguments (``range``, ``repeat``, ``lpad``...)
  builds one value larger than a quarter of that cap (the statement copies it): DuckDB
  allocates such values outside its buffer manager, so ``memory_limit`` alone does not stop
  ``SELECT length(repeat('a', 4000000000))`` (it took 8-17 GB; the check is
  :func:`tabloader.catalog._sql.sizes.check_sizes`);
* a time limit: the connection is interrupted when a statement runs longer.

Both come from ``connect(path, memory_limit=..., statement_timeout=...)``, else the
environment (``$TABLOADER_MEMORY_LIMIT``, ``$TABLOADER_STATEMENT_TIMEOUT``), else defaults a
laptop survives (the smaller of 4 GiB and half the memory; 60 s). Statement text and nesting
have fixed bounds (``tabloader.catalog._sql.dialect``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tabloader.catalog._settings import format_bytes, physical_memory, setting

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
        by ``tabloader.catalog._settings``)."""
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
