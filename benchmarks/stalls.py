"""Stall accounting of the benchmarks (DS-Analyzer's question: is a job waiting for data?).

A tabloader job's stream counts its own (``stats()``: ``wait_s`` blocked waiting for a batch,
``compute_s`` between batches); a DataLoader job counts the same around its ``next()`` with
:class:`StallClock`; the engine (in-process or the service) counts its threads' seconds
reading, decoding and collating per dataset. :func:`stall_row` is one printed line.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

if TYPE_CHECKING:
    from typing_extensions import ReadOnly

__all__ = ["StallClock", "Stalled", "Stalls", "dataset_seconds", "stall_row", "stalls_of"]

T = TypeVar("T")


class Stalls(TypedDict):
    """A job's seconds blocked waiting for a batch and computing between batches."""

    wait_s: float
    compute_s: float


class Stalled(TypedDict):
    """A competitor's run as :func:`stall_row` reads it: its jobs' stalls and the loader's
    thread seconds (None: a DataLoader, which counts none)."""

    jobs: ReadOnly[Mapping[str, Stalls]]
    dataset_s: ReadOnly[Mapping[str, float] | None]


class StallClock:
    """A job's stalls where no engine counts them (a DataLoader): seconds blocked in ``next()``
    (``wait_s``) and between batches (``compute_s``: the job's own work), as a tabloader
    stream counts them (``JobStream.stats()``).

    Example:
        >>> clock = StallClock()
        >>> [b for b in clock.timed(range(3))]
        [0, 1, 2]
        >>> sorted(clock.stats())
        ['compute_s', 'wait_s']
    """

    def __init__(self) -> None:
        self.wait_s = self.compute_s = 0.0

    def timed(self, batches: Iterable[T]) -> Iterator[T]:
        """``batches``, timed."""
        it = iter(batches)
        returned = None
        while True:
            start = time.perf_counter()
            if returned is not None:
                self.compute_s += start - returned
            try:
                batch = next(it)
            except StopIteration:
                self.wait_s += time.perf_counter() - start
                return
            returned = time.perf_counter()
            self.wait_s += returned - start
            yield batch

    def stats(self) -> Stalls:
        """``wait_s`` and ``compute_s`` so far."""
        return {"wait_s": self.wait_s, "compute_s": self.compute_s}


def stalls_of(stats: Mapping[str, Any]) -> Stalls:
    """``wait_s`` and ``compute_s`` of a stream's ``stats()`` (a job's, or a clock's)."""
    return {"wait_s": float(stats["wait_s"]), "compute_s": float(stats["compute_s"])}


def dataset_seconds(stats: dict[str, Any]) -> dict[str, float]:
    """Seconds of an engine's threads (and decode processes) spent reading, decoding and
    collating, over its datasets (``Loader.stats()["datasets"]``, also the service's)."""
    datasets = stats.get("datasets") or {}
    return {
        k: round(sum(float(d.get(k, 0.0)) for d in datasets.values()), 4)
        for k in ("read_s", "decode_s", "collate_s")
    }


def stall_row(result: Stalled) -> dict[str, object]:
    """One line of stall accounting for a competitor's run: its jobs' ``wait_s`` and
    ``compute_s`` summed, the share of waiting, each job's ``wait/compute`` and the loader's
    ``read_s``, ``decode_s``, ``collate_s`` (``dataset_s``; blank for DataLoaders, which count
    none).

    Example:
        >>> j0, j1 = {"wait_s": 1.0, "compute_s": 3.0}, {"wait_s": 0.5, "compute_s": 0.5}
        >>> row = stall_row({"jobs": {"j0": j0, "j1": j1}, "dataset_s": None})
        >>> row["wait_s"], row["waiting"], row["per job wait/compute"], row["decode_s"]
        (1.5, '30%', '1.00/3.00 0.50/0.50', '')
    """
    jobs = list(result["jobs"].values())
    wait = sum(j["wait_s"] for j in jobs)
    compute = sum(j["compute_s"] for j in jobs)
    dataset = result.get("dataset_s") or {}
    return {
        "wait_s": round(wait, 3),
        "compute_s": round(compute, 3),
        "waiting": f"{wait / (wait + compute):.0%}" if wait + compute > 0 else "",
        "per job wait/compute": " ".join(f"{j['wait_s']:.2f}/{j['compute_s']:.2f}" for j in jobs),
        **{k: dataset.get(k, "") for k in ("read_s", "decode_s", "collate_s")},
    }
