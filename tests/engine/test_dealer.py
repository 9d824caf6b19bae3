"""The dealer on its own: a job's queue filled by hand, batches cut, dealt in turn and padded,
the state from its log; no scheduler, no fetcher (``submit`` collects the batches)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from pyroaring import BitMap

from tabloader.catalog._errors import LoaderError
from tabloader.catalog._options import JobSpec
from tabloader.engine._prepare.work import Plan
from tabloader.engine._queue.dealer import Dealer
from tabloader.engine._queue.jobqueue import JobQueue
from tabloader.engine._queue.jobs import JobState, OnError
from tabloader.engine._queue.sources import Sampled
from tabloader.sampling import DependentSampler


class Kept:
    """A receiver that keeps nothing pinned (batches here are never prepared)."""

    pins = False

    def receive(self, work):
        return None


def job(n: int, *, world_size: int, drop_last: bool = True, prefetch: int = 8) -> JobState:
    source = Sampled()  # its rows are appended by hand (``sampled``); a plain job there
    source.sampler = DependentSampler(seed=0)
    source.sampler.add_job("j", BitMap(range(n)))
    state = JobState(
        "j",
        BitMap(range(n)),
        Plan(columns=(), gathered=(), prepared=(), augment={}, receiver=Kept()),
        batch_size=4,
        prefetch=prefetch,
        queue=JobQueue(horizon=n),
        on_error=OnError.RAISE,
        source=source,
        world_size=world_size,
        spec=JobSpec({"batch_size": 4, "drop_last": drop_last}),
    )
    state.queue.left = state.queue.first_rows = n
    for r in range(state.world_size):
        state.open_rank(r, threading.Lock())
    return state


def sampled(state: JobState, rows: list[int]) -> None:
    """The sampler hands out ``rows`` of the current epoch (the queue's own append)."""
    q = state.queue
    q.append(np.array(rows, np.int64), np.arange(len(rows), dtype=np.int64))
    q.left -= len(rows)


def dealt(n: int, **kw) -> tuple[JobState, Dealer, list]:
    state = job(n, **kw)
    out: list = []
    dealer = Dealer(state, pop=state.queue.pop, submit=out.append)
    sampled(state, list(range(n)))
    dealer.deal()
    return state, dealer, out


def test_batches_go_to_the_ranks_in_turn_and_the_rest_is_dropped():
    state, dealer, out = dealt(18, world_size=2)  # 2 turns of 2 x 4 rows; 2 rows dropped
    assert [(w.job.rank, w.rows.tolist()) for w in out] == [
        (0, [0, 1, 2, 3]),
        (1, [4, 5, 6, 7]),
        (0, [8, 9, 10, 11]),
        (1, [12, 13, 14, 15]),
    ]
    epoch, index, rows = dealer.log[-1]  # the epoch's dropped rows: logged past its batches
    assert (epoch, index, rows.tolist()) == (0, 4, [16, 17])
    assert state.queue.q_rows.size == 0


def test_drop_last_false_pads_the_last_turn_with_the_epochs_first_rows():
    _, dealer, out = dealt(10, world_size=4, drop_last=False)  # 3 rows a rank: 10 + 2 repeats
    assert [w.rows.tolist() for w in out] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]]
    assert dealer.padded == 2


def test_a_rank_without_room_stops_the_dealing_and_a_rank_that_left_loses_its_turn():
    state, dealer, out = dealt(16, world_size=2, prefetch=1)
    assert [w.job.rank for w in out] == [0, 1]  # each rank has its one batch ahead
    state.ranks[0].batches.clear()
    state.ranks[1].closed = True
    dealer.deal()
    assert [w.job.rank for w in out] == [0, 1, 0]  # rank 1's turn was cut and dropped
    assert dealer.cut == 4


def test_the_state_counts_the_rows_no_rank_has_taken():
    state, dealer, _ = dealt(16, world_size=2)
    state.ranks[0].taken = state.ranks[1].taken = 1  # every rank has its first batch
    sampler = state.source.sampler  # the one that keeps the job's progress
    remaining = BitMap.deserialize(dealer.state(state.ranks[0], sampler)["remaining"])
    assert remaining == BitMap(range(8, 16))


def test_ranks_joining_with_another_state_are_refused():
    state = job(8, world_size=2)
    dealer = Dealer(state, pop=state.queue.pop, submit=print, resumed=(0, BitMap([1, 2])))
    dealer.check_state(1, BitMap([1, 2]), 0)  # the same: joins
    with pytest.raises(LoaderError, match="Rank 1 of job 'j' was opened with another state"):
        dealer.check_state(1, None, 0)
