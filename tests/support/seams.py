"""A store and a decode backend that travel to decode processes (imported there by name)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tabloader.catalog.storage import LocalStore
from tabloader.engine.decode import SimpleJpegBackend

__all__ = ["Inverted", "LoggedStore", "logged_store"]


class LoggedStore(LocalStore):
    """Local files under a ``logged://<dir>`` URI; each open of a part appends the opening
    process's id to ``<dir>/opens.log`` (which process read through the store)."""

    def open_part(self, name: str, *, size: int, what: str, memory_map: bool) -> pa.NativeFile:
        with open(self.root / "opens.log", "a") as log:
            log.write(f"{os.getpid()}\n")
        return super().open_part(name, size=size, what=what, memory_map=memory_map)


def logged_store(uri: str) -> LoggedStore:
    return LoggedStore(Path(uri.removeprefix("logged://")), uri)


class Inverted(SimpleJpegBackend):
    """The default decode, then ``255 - pixels``: values no other backend gives."""

    name = "inverted"

    def decode(self, values: Any, **kw: Any) -> list[Any]:
        out = []
        for value in super().decode(values, **kw):
            if isinstance(value, np.ndarray):
                value = 255 - value
                value.flags.writeable = False
            out.append(value)
        return out
