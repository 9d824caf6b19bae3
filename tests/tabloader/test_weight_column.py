"""A weighted job's batches carry ``_weight`` (float32 ``1 / (N p_row)``) after ``_id``, in
process and through the service's wire encoding; a plain job's batches have none."""

from __future__ import annotations

import threading

import numpy as np
from pyroaring import BitMap

from catalog.options import JobSpec
from tabloader.engine import collate
from tabloader.engine.dealer import Dealer
from tabloader.engine.handoff import WEIGHT_COLUMN, HandedBatch, Staging
from tabloader.engine.jobqueue import JobQueue
from tabloader.engine.jobs import JobState, OnError
from tabloader.engine.work import Plan
from tabloader.sampling import DependentSampler


class Kept:
    pins = False

    def receive(self, work):
        return None


def dealt(name: str, sampler: DependentSampler, n: int) -> tuple[JobState, Dealer, list]:
    state = JobState(
        name,
        BitMap(range(n)),
        Plan(columns=(), gathered=(), prepared=(), augment={}, receiver=Kept()),
        batch_size=4,
        prefetch=8,
        queue=JobQueue(horizon=n),
        on_error=OnError.RAISE,
        world_size=1,
        spec=JobSpec({"batch_size": 4}),
    )
    for r in range(state.world_size):
        state.open_rank(r, threading.Lock())
    q = state.queue
    q.sampler = sampler
    q.left = q.first_rows = n
    rows = sampler.sample_many([name], n)[name]
    q.append(rows, np.arange(n, dtype=np.int64))
    q.left = 0
    out: list = []
    dealer = Dealer(state, pop=q.pop, submit=out.append)
    dealer.deal()
    return state, dealer, out


def test_a_weighted_jobs_batches_carry_its_weights_in_process_and_on_the_wire():
    w = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 1.0, 0.0])
    s = DependentSampler(seed=0)
    s.add_job("w", BitMap(range(8)), weights=w)
    s.add_job("p", BitMap(range(8)))
    _, _, works = dealt("w", s, 8)
    assert len(works) == 2  # 8 draws (with replacement), row 7 never
    q = w / w.sum()
    for work in works:
        batch = collate._batch(work, None, {})
        names = [c.name for c in batch.columns]
        assert names == ["_id", WEIGHT_COLUMN]
        local = batch.copy_out(np.zeros(0, np.uint8), None)
        assert local[WEIGHT_COLUMN].dtype == np.float32
        assert np.allclose(local[WEIGHT_COLUMN], 1 / (7 * q[local["_id"]]))  # 7 rows weigh > 0
        staging = Staging()
        wire = batch.to_wire(staging)
        memory = np.zeros(staging.used + 128, np.uint8)
        staging.write(memory[64:], 64)
        wire["base"] = 64
        remote = HandedBatch.from_wire(wire, memory).copy_out(memory, None)
        assert remote[WEIGHT_COLUMN].tolist() == local[WEIGHT_COLUMN].tolist()
        kept = collate._batch(work, np.array([1, 3]), {}).copy_out(memory, None)
        assert kept[WEIGHT_COLUMN].tolist() == local[WEIGHT_COLUMN][[1, 3]].tolist()
    _, _, plain = dealt("p", s, 8)
    assert [c.name for c in collate._batch(plain[0], None, {}).columns] == ["_id"]


def test_a_weighted_job_with_replacement_saves_its_draws_left():
    s = DependentSampler(seed=0)
    s.add_job("w", BitMap(range(8)), weights=np.arange(1.0, 9.0))
    state, dealer, _ = dealt("w", s, 8)  # 8 draws, maybe repeats, in 2 batches
    assert BitMap.deserialize(dealer.state(state.ranks[0])["remaining"]) == BitMap(range(8))
    state.ranks[0].taken = 1
    saved = dealer.state(state.ranks[0])
    remaining = BitMap.deserialize(saved["remaining"])
    assert len(remaining) == 4  # draws left, whichever rows
    resumed = DependentSampler(seed=1)
    resumed.add_job("w", BitMap(range(8)), weights=np.arange(1.0, 9.0), remaining=remaining)
    resumed.sample_many(["w"], 4)
    assert resumed.epoch("w") == 0
    resumed.sample_many(["w"], 1)
    assert resumed.epoch("w") == 1
