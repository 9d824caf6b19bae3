"""A job's queue on its own: its three arrays stay aligned through appends, cuts at the head
and tails given back; a cut logs its rounds; a fed job's source has no sampler rows."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from pyroaring import BitMap

from tabloader.engine._queue.jobqueue import JobQueue
from tabloader.engine._queue.sources import Fed, Sampled
from tabloader.sampling import DependentSampler


def rows(*ids: int) -> np.ndarray:
    return np.array(ids, np.int64)


def test_the_arrays_stay_aligned_and_cuts_log_their_rounds():
    q = JobQueue(horizon=8)
    q.append(rows(5, 6, 7), rows(0, 1, 2))
    q.epoch = 1
    q.append(rows(5, 1), rows(3, 4))
    assert q.pop(2).tolist() == [5, 6]
    assert q.cut_rounds.rounds().tolist() == [0, 1]
    assert q.keep(2).tolist() == [1]  # the tail leaves (given back)
    assert (q.q_rows.tolist(), q.q_rounds.tolist(), q.q_epochs.tolist()) == (
        [7, 5],
        [2, 3],
        [0, 1],
    )
    assert q.clear().tolist() == [7, 5]
    assert q.q_rows.size == q.q_rounds.size == q.q_epochs.size == 0


def test_remaining_is_the_samplers_or_none_for_a_fed_job():
    job = SimpleNamespace(name="j", queue=JobQueue(horizon=4))
    assert Fed(rank_rows=6).remaining(job) == BitMap()
    sampler = DependentSampler(seed=0)
    sampler.add_job("j", BitMap(range(6)))
    source = Sampled()
    source.sampler = sampler
    sampler.sample_many(["j"], 2)
    assert len(source.remaining(job)) == 4


def test_a_horizon_follows_the_cache_only_without_a_lookahead():
    assert JobQueue(horizon=4, cache_rows=100).dynamic()
    assert not JobQueue(horizon=4, cache_rows=100, lookahead=16).dynamic()
    assert not JobQueue(horizon=4).dynamic()  # nothing prepared in the arena
