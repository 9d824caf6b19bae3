"""The CPU a benchmark ran on: its model and SIMD level, printed beside the tables.

A kernel's cost depends on the CPU (a crop-resize that took 0.135 ms on one took 0.61 ms on
another), so a table of timings says where it was measured.

Example:
    >>> simd_level({"avx2", "sse4_2"})
    'AVX2'
    >>> simd_level({"avx512f", "avx512bw", "avx2"})
    'AVX-512 (avx512f, avx512bw)'
"""

from __future__ import annotations

import os
import platform
from collections.abc import Set
from pathlib import Path
from typing import Any

__all__ = ["AVX2_ENV", "cpu_line", "cpu_model", "force_avx2", "simd_level"]

AVX2_ENV = ("TABLOADER_RESAMPLE", "NPY_DISABLE_CPU_FEATURES", "ATEN_CPU_CAPABILITY")
"""What ``force_avx2`` sets: tabloader's resize kernel, numpy's and torch's dispatch."""


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = "", set[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model or platform.machine(), flags


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the machine type where there is none."""
    return _cpuinfo()[0]


def simd_level(flags: Set[str] | None = None) -> str:
    """The widest x86 SIMD the CPU has (``AVX-512 (...)``, ``AVX2``, ``AVX``, ``SSE4.2``), or
    ``NEON``/``none known`` (from ``/proc/cpuinfo``'s flags unless ``flags`` is given)."""
    if flags is None:
        flags = _cpuinfo()[1]
    wide = sorted(f for f in flags if f.startswith("avx512"))
    if "avx512f" in flags:
        shown = ["avx512f", *[f for f in ("avx512bw", "avx512vl", "avx512_vnni") if f in wide]]
        return f"AVX-512 ({', '.join(shown)})"
    for flag, name in (("avx2", "AVX2"), ("avx", "AVX"), ("sse4_2", "SSE4.2"), ("asimd", "NEON")):
        if flag in flags:
            return name
    return "none known"


def cpu_line() -> str:
    """``CPU: <model>, SIMD: <level>, <n> cores``: the line printed with a benchmark's table
    (with ``forced to AVX2`` and the variables after ``force_avx2``)."""
    line = f"CPU: {cpu_model()}, SIMD: {simd_level()}, {os.cpu_count()} cores"
    if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
        shown = ", ".join(f"{k}={os.environ.get(k, '')!r}" for k in AVX2_ENV)
        line += f"; forced to AVX2 ({shown})"
    return line


def force_avx2() -> None:
    """Run the processes started from now on (jobs, the services they start, DataLoader
    workers) at AVX2 where the CPU has AVX-512, as on the CPUs that lack it: tabloader's resize
    kernel at its AVX2 path, numpy without its AVX-512 dispatch targets (those this numpy
    has), torch at ``avx2``. Their environment is inherited; this process's own imports done
    already keep theirs. The CPU's speed is not emulated: an AVX2-only CPU may be slower."""
    import numpy as np

    umath: Any = (getattr(np, "_core", None) or np.core)._multiarray_umath
    # numpy 2's dispatch targets (X86_V4 AVX512_ICL AVX512_SPR), else numpy 1's features
    targets = list(getattr(umath, "__cpu_dispatch__", None) or umath.__cpu_features__)
    wide = [t for t in targets if "AVX512" in t or t == "X86_V4"]
    os.environ.update(
        TABLOADER_RESAMPLE="avx2",
        NPY_DISABLE_CPU_FEATURES=" ".join(wide),
        ATEN_CPU_CAPABILITY="avx2",
    )
