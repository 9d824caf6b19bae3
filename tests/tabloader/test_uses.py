"""FutureUses on its own: counts, next queued round, growth (the scheduler's tests check it
against a recomputation from the queues at every step)."""

from __future__ import annotations

import numpy as np

from tabloader.engine.uses import FutureUses


class Queue:
    """What FutureUses reads of a job: its arena spaces and its queue."""

    def __init__(self, spaces, rows=(), rounds=()):
        self.arena_spaces = spaces
        self.q_rows = np.array(rows, np.int64)
        self.q_rounds = np.array(rounds, np.int64)

    def spaces(self):
        return self.arena_spaces


def test_counts_and_next_rounds_follow_the_queues():
    fu = FutureUses(6)
    a, b = Queue([0], [1, 2, 3], [10, 11, 12]), Queue([0], [2, 4], [5, 13])
    for job in (a, b):
        fu.count(job, np.arange(6), +1)
        fu.queued(job, job.q_rows, job.q_rounds)
    assert fu.uses[0].tolist() == [2] * 6
    assert fu.next_round[0].tolist() == [np.inf, 10, 5, 12, 13, np.inf]
    b.q_rows, b.q_rounds = b.q_rows[1:], b.q_rounds[1:]  # b cuts row 2 into a batch
    fu.unqueued(b, np.array([2]), [a, b])
    assert fu.uses[0].tolist() == [2, 2, 1, 2, 2, 2]
    assert fu.next_round[0][2] == 11  # a's queued use is next now
    a.q_rows, a.q_rounds = a.q_rows[:1], a.q_rounds[:1]  # a gives 2 and 3 back to the sampler
    fu.unqueued(a, np.array([2, 3]), [a, b], used=False)
    assert fu.uses[0].tolist() == [2, 2, 1, 2, 2, 2]  # still future uses
    assert fu.next_round[0].tolist() == [np.inf, 10, np.inf, np.inf, 13, np.inf]


def test_other_spaces_and_new_rows_have_no_uses():
    fu = FutureUses(3)
    job = Queue([1], [0], [4])
    fu.count(job, np.array([0, 2]), +1)
    fu.queued(job, job.q_rows, job.q_rounds)
    fu.grow(5)
    assert fu.uses[1].tolist() == [1, 0, 1, 0, 0]
    n, u = fu.of(1, np.array([0, 4, 9]))  # 9: past the arrays
    assert n.tolist() == [4, np.inf, np.inf]
    assert u.tolist() == [1, 0, 0]
    n, u = fu.of(7, np.array([0]))  # a space no job uses
    assert (n.tolist(), u.tolist()) == ([np.inf], [0])
