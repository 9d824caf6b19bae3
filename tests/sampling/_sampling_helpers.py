"""Shared helpers of the sampling tests: scripted runs, exactly-once checks, chi-square."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from pyroaring import BitMap

from tabloader.sampling import Sampler

__all__ = ["Op", "check_exactly_once", "chi2_pvalue", "run_ops", "run_save_load_state"]

# ("add", name, ids) | ("remove", name) | ("sample", [names]) | ("many", [names], n)
Op = tuple[Any, ...]


def run_ops(sampler: Sampler, ops: Sequence[Op]) -> list[Any]:
    """Apply ``ops``; return what each sampling op returned (as plain lists)."""
    out: list[Any] = []
    for op in ops:
        if op[0] == "add":
            sampler.add_job(op[1], op[2])
        elif op[0] == "remove":
            sampler.remove_job(op[1])
        elif op[0] == "sample":
            out.append(sorted(sampler.sample(op[1]).items()))
        elif op[0] == "many":
            res = sampler.sample_many(op[1], op[2])
            out.append(sorted((k, v.tolist()) for k, v in res.items()))
        else:  # pragma: no cover
            raise AssertionError(op)
    return out


def run_save_load_state(
    make: Callable[[], Sampler], ops: Sequence[Op], midpoints: Sequence[int]
) -> None:
    """Save at every midpoint, restore into a fresh sampler and check the rest is identical."""
    full = run_ops(make(), ops)
    for k in midpoints:
        first = make()
        head = run_ops(first, ops[:k])
        state = first.state_dict()
        rest_orig = run_ops(first, ops[k:])
        resumed = make()
        resumed.load_state_dict(state)
        rest = run_ops(resumed, ops[k:])
        assert head + rest == full, f"resume at op {k} diverged"
        assert rest == rest_orig
        assert resumed.jobs() == first.jobs()
        for name in resumed.jobs():
            assert resumed.remaining(name) == first.remaining(name)
            assert resumed.epoch(name) == first.epoch(name)


def check_exactly_once(stream: Sequence[int], ids: BitMap) -> None:
    """``stream`` (a job's rows since it joined), cut every ``len(ids)``, is permutations."""
    n = len(ids)
    full = sorted(ids)
    for start in range(0, len(stream), n):
        chunk = list(stream[start : start + n])
        if len(chunk) == n:
            assert sorted(chunk) == full, f"epoch at {start} is not a permutation"
        else:
            assert len(set(chunk)) == len(chunk), "a row repeated within an epoch"
            assert set(chunk) <= set(full)


def chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square p-value (dof = cells - 1 - ``ddof`` is the caller's business)."""
    observed = np.asarray(observed, dtype=float).ravel()
    expected = np.asarray(expected, dtype=float).ravel()
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = observed.size - 1
    return chi2_sf(stat, dof)


def chi2_sf(stat: float, dof: int) -> float:
    """Survival function of chi-square (scipy if installed, else Wilson-Hilferty)."""
    try:
        from scipy.stats import chi2
    except ImportError:  # pragma: no cover
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))
    return float(chi2.sf(stat, dof))
