"""CPU seconds as ``/proc`` counts them: of one process, of a process and its descendants, and
of the whole machine.

The analyzer splits a run's CPU between the loader service's own process, its decode processes
(its descendants) and the client (this process), and counts what every other process of the
machine used meanwhile (``machine_busy_s`` less ours): on a shared machine that is the part of
the cores the loader did not get.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def cores() -> int:
    """The cores this process may run on (its affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` (every thread; 0 if gone)."""
    fields = _stat_fields(pid)
    return 0.0 if fields is None else (float(fields[11]) + float(fields[12])) / _TICK


def tree_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of process ``pid`` itself, and of its live descendants and the children
    they reaped (a service's forkserver and decode processes)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                parents[int(entry.name)] = int(fields[1])
    below: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        below += kids
        frontier += kids
    total = 0.0
    for p in below:
        fields = _stat_fields(p)
        if fields is not None:
            total += sum(float(x) for x in fields[11:15]) / _TICK  # with its reaped children
    return process_cpu_s(pid), total


def machine_busy_s() -> float:
    """CPU seconds every process of the machine has used since boot (``/proc/stat``: all but
    idle and I/O wait), or 0 where there is no ``/proc/stat``."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:  # pragma: no cover - not Linux
        return 0.0
    ticks = [float(x) for x in first[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICK
