"""Benchmarks: each runs the competitors side by side in one run and reports ratios.

A benchmark module defines ``add_arguments(parser)`` and ``run(args) -> int``; it prints a table
to stdout and writes JSON (``--out``). ``BENCHMARKS`` lists them by name and is the only place a
new benchmark needs to be registered (a second name may run the same module).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from tabloader.cli import format_table

__all__ = [
    "BENCHMARKS",
    "add_loader_arguments",
    "add_mode_arguments",
    "format_table",
    "load",
    "main",
    "peak_rss_mib",
    "positive_int",
    "proc_status_mib",
    "write_json",
]

BENCHMARKS: dict[str, str] = {
    "accuracy": "benchmarks.accuracy",
    "analyze": "benchmarks.predictions",  # tabloader analyze's predictions, run for real
    "catalog": "benchmarks.catalog",
    "cluster": "benchmarks.cluster",
    "sampling": "benchmarks.sampling",
    "e2e": "benchmarks.e2e",
    "hostile": "benchmarks.hostile",
    "importance": "benchmarks.importance",
    "isolation": "benchmarks.isolation",
    "kernels": "benchmarks.kernels",
    "service": "benchmarks.e2e",  # the loader service's benchmark is e2e (one run, all three)
    "storage": "benchmarks.storage",
    "throughput": "benchmarks.throughput",
    "train": "benchmarks.train",
}


def positive_int(text: str) -> int:
    """An ``argparse`` type: a count of at least 1 (a zero would leave nothing to measure)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a count of at least 1")
    return value


def proc_status_mib(pid: int | str, field: str) -> float | None:
    """``field`` of ``/proc/PID/status`` in MiB (``VmHWM``: the peak resident set,
    ``RssAnon``: the private resident memory); None where it cannot be read (gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def add_loader_arguments(parser: argparse.ArgumentParser, *, workers_help: str) -> None:
    """``--workers`` (decode workers, default: the cores) and ``--cache`` (a fraction of the
    dataset): how a benchmark sizes the loaders it compares."""
    parser.add_argument(
        "--workers", type=positive_int, default=os.cpu_count() or 2, help=workers_help
    )
    parser.add_argument("--cache", type=float, default=0.10, help="cache, fraction of dataset")


def add_mode_arguments(parser: argparse.ArgumentParser, modes: Mapping[str, str]) -> None:
    """``--mode`` (``modes``: each mode's description, ``launched`` the default and first, then
    the lab view's mode), ``--quick`` (a smoke run) and ``--images`` (3000 launched, 2000 in
    the lab view): the options of a benchmark that launches the training scripts
    (:mod:`benchmarks.launched`) or runs them in the lab view."""
    launched, lab = modes
    parser.add_argument(
        "--mode",
        choices=[launched, lab],
        default=launched,
        help=f"{launched} (default): {modes[launched]}; {lab}: {modes[lab]}",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument(
        "--images",
        type=positive_int,
        help=f"generated JPEGs (default: 3000 {launched}, 2000 {lab})",
    )


def peak_rss_mib() -> float:
    """Peak resident set of this process in MiB (``VmHWM``).

    Not ``ru_maxrss``: it survives ``exec``, so a child started by a big parent reports the
    parent's size (measured: 1.5 GB reported for an import that peaked at 0.45 GB).
    """
    peak = proc_status_mib("self", "VmHWM")
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load(name: str) -> ModuleType:
    """Import the module of benchmark ``name``."""
    return importlib.import_module(BENCHMARKS[name])


def main(
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    *,
    prog: str | None = None,
    description: str | None = None,
    **defaults: Any,
) -> NoReturn:
    """``python -m benchmarks.NAME``: parse the module's options (and ``defaults`` for
    what the ``tabloader`` command would set, e.g. ``catalog``), run it, exit with its code."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.set_defaults(**defaults)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))


def write_json(path: str | Path | None, payload: Mapping[str, object]) -> None:
    """Write ``payload`` as JSON to ``path`` (``-`` or None: nowhere)."""
    if path is None:
        return
    if str(path) == "-":
        json.dump(payload, sys.stdout, indent=2, default=str)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=str))
