"""Separate processes for the benchmarks: a loader service, and job processes started together.

A job process runs ``python -m <module> --child JSON`` (the benchmark's own module), forked
from a ``multiprocessing`` forkserver that imported torch and the module once: an interpreter
and torch start-up (1.2 s of CPU each, four jobs at once on 2 cores) paid once per benchmark run
instead of once per job process. It gets
ready (imports, connects, builds its loader), says so with a file in a private sync folder,
and waits for the common start (``go``, a file holding the start's ``time.time()``), so that
wall times are measured from one instant for every process and interpreter start-up counts for
nobody. It writes its result as JSON to ``result-<index>.json``; its output goes to
``log-<index>.txt``, quoted when it fails. Every process a benchmark starts is stopped when it
returns or fails: jobs are killed, the service gets SIGTERM (it removes its socket and shared
memory) and SIGKILL only if it does not stop.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypedDict

from benchmarks import proc_status_mib
from tabloader import service

__all__ = [
    "START_TIMEOUT_S",
    "JobsRun",
    "ServiceProcess",
    "descendants",
    "halfway_reached",
    "mark_halfway",
    "peak_rss_of",
    "run_jobs",
    "run_one",
    "rusage",
    "tree_cpu_s",
    "wait_for_start",
    "write_result",
]

START_TIMEOUT_S = 120.0  # interpreter + torch start-up on a loaded 2-core machine
POLL_S = 0.005


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` and all its live descendants (and their reaped children).

    The service's decode processes are children of its forkserver, not of the service, so
    ``getrusage`` would miss them; ``/proc`` sees the whole tree.
    """
    procs = _processes()
    tree = {pid, *_below(pid, procs)}
    ticks = sum(procs[p][1] for p in tree if p in procs)
    return ticks / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid`` (a service's forkserver and decode processes)."""
    return _below(pid, _processes())


def _processes() -> dict[int, tuple[int, float]]:
    """Every process ``/proc`` shows: pid -> (parent pid, CPU ticks with reaped children)."""
    procs: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2 :].split()
        procs[int(entry.name)] = (int(rest[1]), sum(float(x) for x in rest[11:15]))
    return procs


def _below(pid: int, procs: dict[int, tuple[int, float]]) -> list[int]:
    found: list[int] = []
    seen, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, (pp, _) in procs.items() if pp == parent and p not in seen]
        seen.update(kids)
        found += kids
        frontier += kids
    return found


def rusage() -> tuple[float, float]:
    """(CPU seconds of this process and its reaped children, peak RSS in MiB)."""
    import resource

    from benchmarks import peak_rss_mib

    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    cpu = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    # a child's ru_maxrss can include our size when it forked (it survives exec): an upper bound
    return cpu, max(peak_rss_mib(), kids.ru_maxrss / 1024)


def peak_rss_of(pid: int) -> float:
    """The peak resident set of process ``pid`` in MiB (0 if gone)."""
    return proc_status_mib(pid, "VmHWM") or 0.0


class ServiceProcess(service.ServiceProcess):
    """``tabloader serve`` in a child process for one benchmark run (the product's
    :class:`tabloader.service.ServiceProcess`), with what it cost."""

    def usage(self) -> tuple[float, float]:
        """(CPU seconds so far of the service and its decode processes, its peak RSS in MiB)."""
        return tree_cpu_s(self.proc.pid), peak_rss_of(self.proc.pid)


@contextmanager
def _killing(procs: list[multiprocessing.process.BaseProcess]) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()


TORCH = ("torch", "torch.utils.data", "tabloader.torch")
"""What the zygote imports besides the benchmark's module, unless told (the jobs' torch)."""


def _zygote(module: str, preload: Sequence[str] = TORCH) -> multiprocessing.context.BaseContext:
    """The forkserver context the job processes of ``module`` are forked from (started once
    per benchmark process, with ``preload`` and the module imported)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*preload, module])
    return ctx


def _job_main(module: str, child: str, log: str) -> None:
    """In a forked job process: its output to ``log``, then the module's ``--child`` entry,
    as ``python -m module --child JSON`` would run it (multiprocessing's default start
    method too: a forkserver's children inherit "forkserver", so a DataLoader's workers would
    not fork as a user's do)."""
    multiprocessing.set_start_method(None, force=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [module, "--child", child]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


class JobsRun(TypedDict):
    """:func:`run_jobs`' result: the common start, the wall to the last job's ``end``, and
    each job's result as it wrote it (its module's JSON)."""

    go: float
    wall_s: float
    results: list[Any]


def run_jobs(
    module: str,
    specs: Sequence[Mapping[str, object]],
    *,
    timeout: float = 3600,
    preload: Sequence[str] = TORCH,
) -> JobsRun:
    """Start one process per spec, start them together, wait for all; their results
    (``preload``: what the processes' zygote imports besides ``module``).

    Returns:
        ``{"go": start time, "wall_s": start to the last job's "end", "results": [...]}``.
    """
    ctx = _zygote(module, preload)
    with tempfile.TemporaryDirectory(prefix="tabloader-bench-") as tmp:
        sync = Path(tmp)
        procs: list[multiprocessing.process.BaseProcess] = []
        with _killing(procs):
            for i, spec in enumerate(specs):
                child = json.dumps({**spec, "sync": tmp, "index": i})
                proc = ctx.Process(  # type: ignore[attr-defined]
                    target=_job_main, args=(module, child, str(sync / f"log-{i}.txt"))
                )
                proc.start()
                procs.append(proc)
            deadline = time.monotonic() + START_TIMEOUT_S
            while not all((sync / f"ready-{i}").exists() for i in range(len(specs))):
                _check(procs, sync)
                if time.monotonic() > deadline:
                    raise RuntimeError("benchmark job processes did not get ready in time")
                time.sleep(POLL_S)
            go = time.time()
            (sync / "go.tmp").write_text(repr(go))
            (sync / "go.tmp").rename(sync / "go")
            deadline = time.monotonic() + timeout
            while any(p.is_alive() for p in procs):
                _check(procs, sync)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"benchmark job processes ran past {timeout:.0f} s")
                time.sleep(0.05)
            for p in procs:
                p.join()
            _check(procs, sync)
        results = [json.loads((sync / f"result-{i}.json").read_text()) for i in range(len(specs))]
    return {"go": go, "wall_s": max(r["end"] for r in results) - go, "results": results}


def run_one(module: str, spec: Mapping[str, object]) -> str:
    """Run ``python -m module --child JSON`` once (forked from the zygote, like ``run_jobs``);
    its output.

    Raises:
        RuntimeError: it failed, quoting its output.
    """
    with tempfile.TemporaryDirectory(prefix="tabloader-bench-") as tmp:
        log = Path(tmp) / "log.txt"
        proc = _zygote(module).Process(  # type: ignore[attr-defined]
            target=_job_main, args=(module, json.dumps(spec), str(log))
        )
        with _killing([proc]):
            proc.start()
            proc.join()
        out = log.read_text(errors="replace") if log.exists() else ""
        if proc.exitcode != 0:
            raise RuntimeError(f"benchmark child failed:\n{out[-3000:]}")
        return out


def _check(procs: list[multiprocessing.process.BaseProcess], sync: Path) -> None:
    for i, p in enumerate(procs):
        if p.exitcode not in (None, 0):
            log = (sync / f"log-{i}.txt").read_text(errors="replace")
            raise RuntimeError(f"benchmark job process {i} failed:\n{log[-3000:]}")


# -- inside a job process ------------------------------------------------------------------------
def wait_for_start(spec: Mapping[str, object]) -> float:
    """Say this process is ready, wait for the common start; its ``time.time()``."""
    sync = Path(str(spec["sync"]))
    (sync / f"ready-{spec['index']}").touch()
    go = sync / "go"
    while not go.exists():
        time.sleep(POLL_S)
    return float(go.read_text())


def mark_halfway(spec: Mapping[str, object]) -> None:
    """The first job is half-way: a late job may start."""
    (Path(str(spec["sync"])) / "halfway").touch()


def halfway_reached(spec: Mapping[str, object]) -> bool:
    return (Path(str(spec["sync"])) / "halfway").exists()


def write_result(spec: Mapping[str, object], result: Mapping[str, object]) -> None:
    """This process's result, for ``run_jobs``."""
    path = Path(str(spec["sync"])) / f"result-{spec['index']}.json"
    path.with_suffix(".tmp").write_text(json.dumps(result))
    path.with_suffix(".tmp").rename(path)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: a zombie (exited, not yet reaped by its parent, as a
    service killed under the client that started it) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): kill() said it exists
    return state not in (b"Z", b"X")
