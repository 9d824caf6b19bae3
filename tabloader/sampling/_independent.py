"""Independent sampling: each job shuffles on its own (the PyTorch ``DataLoader`` baseline).

Each job draws a fresh permutation of its set at every epoch from its own generator
(spawned from the sampler's seed and the job's registration number), so a job's stream
does not depend on when the other jobs start epochs, and :meth:`sample_many` is exactly
``n`` calls of :meth:`sample`.

A weighted job (weights, or ``importance = 'loss'``) draws from its own distribution
(:mod:`tabloader.sampling._weighted`) with no leader and streams of its own: i.i.d. draws, or
an order drawn by weight.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from pyroaring import BitMap

from tabloader.catalog._bitmaps import bitmap_from_array, bitmap_to_array
from tabloader.catalog._errors import SamplingError
from tabloader.sampling._base import check_round
from tabloader.sampling._shared import SamplerBase
from tabloader.sampling._states import IndependentState, SamplerState
from tabloader.sampling._weighted import WeightedJobs


@dataclass
class _Job:
    seq: int
    ids: BitMap
    rng: np.random.Generator
    perm: np.ndarray
    ptr: int = 0
    epoch: int = 0


class IndependentSampler(SamplerBase[_Job]):
    """Every job reads its own uniformly random permutation per epoch; nothing is shared.

    Args:
        seed: Seed of the jobs' generators; same seed and same calls give the same output.
    """

    KIND = "independent"

    def __init__(self, seed: int | None = None) -> None:
        self._root = np.random.SeedSequence(seed)
        self._jobs: dict[str, _Job] = {}
        self._next_seq = 0
        self._refs = np.zeros(0, dtype=np.int32)
        self._weighted: dict[str, WeightedJobs] = {}  # each weighted job with streams of its own

    def _grow(self, size: int) -> None:
        if size > len(self._refs):
            refs = np.zeros(max(size, 2 * len(self._refs)), dtype=np.int32)
            refs[: len(self._refs)] = self._refs
            self._refs = refs

    def _rng(self, seq: int) -> np.random.Generator:
        ss = np.random.SeedSequence(self._root.entropy, spawn_key=(seq,))
        return np.random.default_rng(ss)

    def _own(self, name: str) -> WeightedJobs | None:
        return self._weighted.get(name)

    def _homes(self) -> Iterable[WeightedJobs]:
        return self._weighted.values()

    def _home_for(self, name: str) -> WeightedJobs:
        return WeightedJobs(int(self._root.entropy), key=self._next_seq)  # type: ignore[arg-type]

    def _keep(self, name: str, home: WeightedJobs) -> None:
        self._weighted[name] = home

    def _add_plain(self, name: str, ids: BitMap, start: BitMap, epoch: int) -> None:
        job = _Job(self._next_seq, ids, self._rng(self._next_seq), np.empty(0, np.uint32))
        self._next_seq += 1
        self._jobs[name] = job
        self._start_epoch(job, start)
        job.epoch = epoch

    def _start_epoch(self, job: _Job, rows_of: BitMap | None = None) -> None:
        rows = bitmap_to_array(job.ids if rows_of is None else rows_of)
        job.perm = job.rng.permutation(rows)
        job.ptr = 0
        job.epoch += 1
        self._grow(int(rows[-1]) + 1)
        self._refs[rows] += 1

    def remove_job(self, name: str) -> None:
        """Unregister ``name``.

        Raises:
            SamplingError: ``name`` is not registered.
        """
        if self._weighted.pop(name, None) is not None:
            return
        job = self._job(name)
        self._refs[job.perm[job.ptr :]] -= 1
        del self._jobs[name]

    def _plain_remaining(self, job: _Job) -> BitMap:
        return bitmap_from_array(np.sort(job.perm[job.ptr :]))

    def give_back(self, name: str, rows: np.ndarray) -> None:
        """Refused: each job reads its own permutation, nobody shares its rounds.

        Raises:
            SamplingError: always.
        """
        raise SamplingError(
            f"give_back({name!r}): the independent sampler's jobs share no rounds, so nothing "
            "is given back; use DependentSampler."
        )

    def refcounts(self, ids: np.ndarray) -> np.ndarray:
        """:meth:`refcount` of every row of ``ids`` (int64 array)."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.zeros(len(ids), dtype=np.int64)
        ok = (ids >= 0) & (ids < len(self._refs))
        out[ok] = self._refs[ids[ok]]
        return out

    def sample(self, jobs: Sequence[str]) -> dict[str, int]:
        """One round: the next row of each listed job.

        Raises:
            SamplingError: a job is unknown or listed twice.
        """
        return {name: int(col[0]) for name, col in self.sample_many(jobs, 1).items()}

    def sample_many(self, jobs: Sequence[str], n: int) -> dict[str, np.ndarray]:
        """``n`` rounds for the same ``jobs``; identical to ``n`` calls of :meth:`sample`."""
        check_round({**self._jobs, **self._weighted}, jobs)
        if n < 0:
            raise SamplingError(f"n must be >= 0, got {n}.")
        out: dict[str, np.ndarray] = {}
        for name in jobs:
            own = self._weighted.get(name)
            if own is not None:
                out[name] = (
                    own.draw([name], n, lambda _: None)[name] if n else np.empty(0, np.int64)
                )
                continue
            job = self._jobs[name]
            parts = []
            need = n
            while need:
                if job.ptr == len(job.perm):
                    self._start_epoch(job)
                take = min(need, len(job.perm) - job.ptr)
                part = job.perm[job.ptr : job.ptr + take]
                job.ptr += take
                self._refs[part] -= 1  # rows of one epoch slice are distinct
                parts.append(part)
                need -= take
            out[name] = np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)
        return out

    def state_dict(self) -> IndependentState:
        """Everything needed to resume exactly, as a plain dict."""
        return {
            "kind": "independent",
            "version": self.VERSION,
            "entropy": self._root.entropy,
            "next_seq": self._next_seq,
            "jobs": [
                {
                    "name": name,
                    "seq": job.seq,
                    "epoch": job.epoch,
                    "ptr": job.ptr,
                    "perm": job.perm.astype(np.uint32).tobytes(),
                    "ids": job.ids.serialize(),
                    "rng": job.rng.bit_generator.state,
                }
                for name, job in self._jobs.items()
            ],
            "weighted": {name: own.state_dict() for name, own in self._weighted.items()},
        }

    def load_state_dict(self, state: SamplerState) -> None:
        """Restore what :meth:`state_dict` returned (replaces every job).

        Raises:
            SamplingError: ``state`` is not an independent sampler state.
        """
        self._check_state(state)
        assert state["kind"] == "independent"  # checked: the other kind's keys are not read
        self._root = np.random.SeedSequence(state["entropy"])
        self._next_seq = int(state["next_seq"])
        self._jobs = {}
        self._refs = np.zeros(0, dtype=np.int32)
        self._weighted = {}
        for name, own_state in state.get("weighted", {}).items():
            own = WeightedJobs(0)
            own.load_state_dict(own_state)
            self._weighted[name] = own
        for j in state["jobs"]:
            rng = np.random.default_rng()
            rng.bit_generator.state = j["rng"]
            job = _Job(
                seq=int(j["seq"]),
                ids=BitMap.deserialize(j["ids"]),
                rng=rng,
                perm=np.frombuffer(j["perm"], dtype=np.uint32).copy(),
                ptr=int(j["ptr"]),
                epoch=int(j["epoch"]),
            )
            self._jobs[j["name"]] = job
            rest = job.perm[job.ptr :]
            if len(rest):
                self._grow(int(rest.max()) + 1)
                self._refs[rest] += 1
