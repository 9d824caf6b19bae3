"""What processes leave in /dev/shm: the files of it they map that have a name there."""

from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["named_shm_of"]


def named_shm_of(*pids: int) -> set[Path]:
    """The files of ``/dev/shm`` that processes ``pids`` map and that have a name there (shared
    memory of no name shows as ``/dev/shm/#<inode> (deleted)``): what they could leave behind."""
    found = set()
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[5:]
                if path and path[0].startswith("/dev/shm/") and not path[0].endswith("(deleted)"):
                    found.add(Path(path[0]))
    return found
