"""FutureUses on its own: counts, next queued round, growth (the scheduler's tests check it
against a recomputation from the queues at every step)."""

from __future__ import annotations

import numpy as np

from tabloader.engine._queue.uses import FutureUses


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


def test_a_queue_spanning_two_epochs_holds_a_row_twice():
    """A row queued in epoch e and again in e+1: cut the first, the second is its next use;
    a job whose queue empties holds nothing any more."""
    fu = FutureUses(4)
    a = Queue([0], [1, 2, 1], [3, 4, 9])  # row 1 in two epochs
    fu.count(a, np.array([1, 2]), +1)  # epoch e's rows, then e+1's
    fu.count(a, np.array([1]), +1)
    fu.queued(a, np.array([1, 2]), np.array([3, 4]))
    fu.queued(a, np.array([1]), np.array([9]))
    assert fu.next_round[0].tolist() == [np.inf, 3, 4, np.inf]
    a.q_rows, a.q_rounds = a.q_rows[1:], a.q_rounds[1:]  # row 1 of epoch e cut
    fu.unqueued(a, np.array([1]), [a])
    assert fu.next_round[0].tolist() == [np.inf, 9, 4, np.inf]
    assert fu.uses[0].tolist() == [0, 1, 1, 0]
    a.q_rows, a.q_rounds = a.q_rows[:0], a.q_rounds[:0]  # the job closes: all of it goes
    fu.unqueued(a, np.array([2, 1]), [])
    assert np.isinf(fu.next_round[0]).all()
    assert fu.uses[0].tolist() == [0, 0, 0, 0]
    assert not fu.first
    assert not fu.entries


def test_a_job_that_prepares_nothing_keeps_no_arrays_and_changes_no_ranks():
    """A gather-only job (no arena space) ranks no value: its queue moves leave the next
    rounds of a preparing job's rows as they were and allocate nothing (two arrays over the
    dataset's rows each time its queue ran dry made four small-row jobs 0.86x one job)."""
    fu = FutureUses(6)
    prep, gathers = Queue([0], [1, 2], [7, 8]), Queue([], [1, 2, 3], [1, 2, 3])
    fu.count(prep, np.arange(6), +1)
    fu.queued(prep, prep.q_rows, prep.q_rounds)
    fu.queued(gathers, gathers.q_rows, gathers.q_rounds)
    assert fu.next_round[0].tolist() == [np.inf, 7, 8, np.inf, np.inf, np.inf]
    assert list(fu.first) == [prep]  # nothing made for the gathering job
    gathers.q_rows, gathers.q_rounds = gathers.q_rows[:0], gathers.q_rounds[:0]
    fu.unqueued(gathers, np.array([1, 2, 3]), [prep, gathers])
    assert fu.next_round[0].tolist() == [np.inf, 7, 8, np.inf, np.inf, np.inf]
    assert list(fu.first) == [prep]
    assert list(fu.entries) == [prep]


def test_next_rounds_are_the_least_of_every_queue_at_every_step():
    """Random queues, cuts and give-backs of several jobs on two spaces: ``next_round``
    always equals the least queued round of each row, recomputed from the queues."""
    rng = np.random.default_rng(0)
    n = 40
    fu = FutureUses(n)
    jobs = [Queue([0]), Queue([0, 1]), Queue([1])]
    round_ = 0
    for step in range(300):
        job = jobs[rng.integers(len(jobs))]
        if rng.random() < 0.5 or job.q_rows.size == 0:  # queue a round of new rows
            rows = rng.choice(n, rng.integers(1, 6), replace=False)
            rounds = np.arange(round_, round_ + rows.size)
            round_ += rows.size
            fu.count(job, rows, +1)
            job.q_rows = np.concatenate((job.q_rows, rows))
            job.q_rounds = np.concatenate((job.q_rounds, rounds))
            fu.queued(job, rows, rounds)
        else:
            k = int(rng.integers(1, job.q_rows.size + 1))
            head = step % 2 == 0  # cut from the head, or give back from the tail
            cut = job.q_rows[:k] if head else job.q_rows[-k:]
            keep = slice(k, None) if head else slice(None, -k)
            job.q_rows, job.q_rounds = job.q_rows[keep], job.q_rounds[keep]
            fu.unqueued(job, cut, jobs, used=head)
        for space in (0, 1):
            want = np.full(n, np.inf)
            for j in jobs:
                if space in j.spaces():
                    np.minimum.at(want, j.q_rows, j.q_rounds.astype(float))
            got = fu.next_round.get(space, np.full(n, np.inf))
            assert got.tolist() == want.tolist(), step
