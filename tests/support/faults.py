"""Decoders that misbehave inside a decode process (imported there by name, so a module)."""

from __future__ import annotations

import os
import resource
import signal
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tabloader.engine._prepare.prep import Decoder

__all__ = ["Hungry", "KillsOnce", "Poisoned", "Slow"]


@dataclass(frozen=True)
class Slow(Decoder):
    """Decodes as its base does, ``delay`` seconds a row: decodes stay in flight a while."""

    delay: float = 0.02

    def __call__(self, value: Any, *, row_id: int | None = None) -> tuple[Any, int]:
        time.sleep(self.delay)
        return super().__call__(value, row_id=row_id)


@dataclass(frozen=True)
class Poisoned(Decoder):
    """Kills its own process (SIGKILL, as a crash in a C decoder would) on row ``poison``."""

    poison: int = -1

    def __call__(self, value: Any, *, row_id: int | None = None) -> tuple[Any, int]:
        if row_id == self.poison:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__call__(value, row_id=row_id)


@dataclass(frozen=True)
class KillsOnce(Decoder):
    """Kills its own process on the first decode of row ``row`` anywhere (``marker``, a file
    path, says it did): a fault while that row is surely in flight, then a healthy row."""

    row: int = -1
    marker: str = ""

    def __call__(self, value: Any, *, row_id: int | None = None) -> tuple[Any, int]:
        if row_id == self.row:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().__call__(value, row_id=row_id)


@dataclass(frozen=True)
class Hungry(Decoder):
    """On row ``row``, allocates as much as the process's memory cap (1 GiB where it has
    none: then the allocation succeeds, and the row decodes)."""

    row: int = -1

    def __call__(self, value: Any, *, row_id: int | None = None) -> tuple[Any, int]:
        if row_id == self.row:
            cap, _ = resource.getrlimit(resource.RLIMIT_DATA)
            hog = np.empty(1 << 30 if cap == resource.RLIM_INFINITY else cap, np.uint8)
            del hog
        return super().__call__(value, row_id=row_id)
