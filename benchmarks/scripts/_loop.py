"""What both training scripts do around their loader: iterate it to its end as a training loop
does, timing it, and write the result JSON that ``benchmarks.launched`` reads.

Imported as a sibling (``from _loop import ...``: a script's folder is ``sys.path[0]`` when
``python SCRIPT`` runs it), and it imports nothing of tabloader: ``train_dataloader.py`` is the
competitor and must not load it.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Callable, Iterable
from typing import Any, TypedDict, TypeVar

B = TypeVar("B")


class Loop(TypedDict):
    """When the first batch came (``time.time()``) and its rows, when the last ended, the rows
    and the seconds spent waiting on the loader."""

    first: float | None
    first_rows: int
    end: float
    rows: int
    wait_s: float


def drain(loader: Iterable[B], count: Callable[[B], int], step: float) -> Loop:
    """Takes every batch of ``loader``, sleeping ``step`` seconds after each (a simulated
    training step; 0 for none); ``count(batch)`` says its rows (and may note what else it
    carries). The loader's iterator is let go on return (a DataLoader's workers stop)."""
    rows, first, first_rows, wait_s = 0, None, 0, 0.0
    it = iter(loader)
    while True:
        t0 = time.time()
        try:
            batch = next(it)
        except StopIteration:
            break
        now = time.time()
        wait_s += now - t0
        n = count(batch)
        if first is None:
            first, first_rows = now, n
        rows += n
        if step:
            time.sleep(step)
    end = time.time()
    return {"first": first, "first_rows": first_rows, "end": end, "rows": rows, "wait_s": wait_s}


def report(
    out: str,
    clock: tuple[float, float, float, float, float],
    loop: Loop,
    **more: Any,
) -> None:
    """Writes the result to ``out`` (whole or not at all): ``clock`` (start, imported, building,
    built: ``time.time()``; the process's CPU seconds when imported), ``loop``, this process's
    CPU seconds now, and ``more``."""
    start, imported, building, built, cpu_imports_s = clock
    me = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "start": start,
        "imported": imported,
        "building": building,
        "built": built,
        **loop,
        "cpu_s": me.ru_utime + me.ru_stime,
        "cpu_imports_s": cpu_imports_s,
        **more,
    }
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out)
