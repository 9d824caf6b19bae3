"""Statistical tests (fixed seeds): uniform positions, two-job agreement, equal sets agree."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _sampling_helpers import chi2_pvalue
from pyroaring import BitMap

from tabloader.sampling import DependentSampler, IndependentSampler

P_MIN = 1e-4  # a fair sampler fails one of these with probability ~1e-4 per check


def position_table(streams: list[int], ids: BitMap, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts of (row, position bin) over every full epoch of a job's stream."""
    rows = sorted(ids)
    n = len(rows)
    where = {row: i for i, row in enumerate(rows)}
    edges = [(b * n) // bins for b in range(bins + 1)]
    bin_of = np.searchsorted(edges, np.arange(n), side="right") - 1
    width = np.diff(edges)
    obs = np.zeros((n, bins))
    epochs = len(streams) // n
    for e in range(epochs):
        for p, row in enumerate(streams[e * n : (e + 1) * n]):
            obs[where[row], bin_of[p]] += 1
    expected = np.tile(width / n * epochs, (n, 1))
    return obs, expected


def collect(sampler, schedule, rounds):
    streams: dict[str, list[int]] = {}
    for t in range(rounds):
        jobs = schedule(t)
        for name, row in sampler.sample(jobs).items():
            streams.setdefault(name, []).append(row)
    return streams


@pytest.mark.parametrize("cls", [DependentSampler, IndependentSampler])
def test_lone_job_positions_uniform(cls):
    ids = BitMap(range(37))  # not a multiple of any block size
    s = cls(seed=123)
    s.add_job("a", ids)
    stream = s.sample_many(["a"], 37 * 400)["a"].tolist()
    obs, exp = position_table(stream, ids, 4)
    assert chi2_pvalue(obs, exp) > P_MIN


OVERLAP = {
    "a": BitMap(range(0, 23)),
    "b": BitMap(range(9, 40)),
    "c": BitMap(list(range(0, 5)) + list(range(15, 35))),
}


@pytest.mark.parametrize("jobs", [["a", "b"], ["a", "b", "c"]])
def test_overlap_positions_uniform(jobs):
    """Jobs of a 2-/3-job overlap, uneven speeds, epochs restarting at different times."""
    s = DependentSampler(seed=7)
    for name in jobs:
        s.add_job(name, OVERLAP[name])

    def schedule(t: int) -> list[str]:
        return [j for i, j in enumerate(jobs) if i == 0 or t % (i + 2) != 0]

    streams = collect(s, schedule, 14000)
    for name in jobs:
        obs, exp = position_table(streams[name], OVERLAP[name], 4)
        assert chi2_pvalue(obs, exp) > P_MIN, name


def test_positions_uniform_after_joins_and_leaves():
    s = DependentSampler(seed=99)
    target = BitMap(range(3, 44))  # 41 rows
    s.add_job("t", target)
    stream: list[int] = []
    rng = np.random.default_rng(5)
    others: list[str] = []
    for step in range(900):
        if step % 9 == 0:
            if others and rng.random() < 0.5:
                s.remove_job(others.pop(int(rng.integers(len(others)))))
            else:
                name = f"o{step}"
                lo = int(rng.integers(0, 40))
                s.add_job(name, BitMap(range(lo, lo + int(rng.integers(1, 60)))))
                others.append(name)
        jobs = ["t", *[o for o in others if rng.random() < 0.7]]
        res = s.sample_many(jobs, 20)
        stream.extend(res["t"].tolist())
    obs, exp = position_table(stream, target, 4)
    assert chi2_pvalue(obs, exp) > P_MIN


@pytest.mark.parametrize(
    ("a", "b"), [((0, 100), (40, 200)), ((0, 50), (0, 50)), ((0, 30), (0, 90))]
)
def test_two_job_agreement_matches_theory(a, b):
    ra, rb = BitMap(range(*a)), BitMap(range(*b))
    p = len(ra & rb) / max(len(ra), len(rb))
    trials = 3000
    same = 0
    for seed in range(trials):
        s = DependentSampler(seed=seed)
        s.add_job("a", ra)
        s.add_job("b", rb)
        got = s.sample(["a", "b"])
        same += got["a"] == got["b"]
    sigma = math.sqrt(p * (1 - p) / trials) or 1e-9
    assert abs(same / trials - p) <= 4 * sigma + 1e-12


def test_equal_sets_always_agree():
    s = DependentSampler(seed=4)
    ids = BitMap(range(0, 200, 3))
    for i in range(5):
        s.add_job(f"j{i}", ids)
    res = s.sample_many(s.jobs(), 3 * len(ids))
    first = res["j0"]
    for name in s.jobs():
        assert res[name].tolist() == first.tolist()


def test_independent_rarely_agrees():
    s = IndependentSampler(seed=4)
    ids = BitMap(range(100))
    s.add_job("a", ids)
    s.add_job("b", ids)
    res = s.sample_many(["a", "b"], 100)
    assert (res["a"] == res["b"]).sum() < 10


CRAFTED = {  # a ⊂ b; the walk reaches a second step with |S| = 10 (the c ← |D| - |S| case)
    "a": BitMap(range(0, 10)),
    "b": BitMap(range(0, 14)),
    "c": BitMap(list(range(0, 12)) + list(range(14, 20))),
}


def _random_sets(seed: int) -> dict[str, BitMap]:
    rng = np.random.default_rng(seed)
    return {f"j{i}": BitMap(np.flatnonzero(rng.random(30) < 0.6).tolist()) for i in range(4)}


@pytest.mark.parametrize("sets", [CRAFTED, _random_sets(3)], ids=["crafted", "random4"])
def test_first_round_marginals_uniform(sets):
    """Theorem 2 directly: in one round every job's row is uniform over R_j."""
    trials = 3000
    counts = {name: dict.fromkeys(ids, 0) for name, ids in sets.items()}
    for seed in range(trials):
        s = DependentSampler(seed=seed)
        for name, ids in sets.items():
            s.add_job(name, ids)
        for name, row in s.sample(list(sets)).items():
            counts[name][row] += 1
    for name, ids in sets.items():
        obs = np.array(list(counts[name].values()))
        assert chi2_pvalue(obs, np.full(len(ids), trials / len(ids))) > P_MIN, name


def test_late_job_uniform_whatever_the_others_decide():
    """A job's next row is uniform over its R_j given the whole state, not only on average.

    Job ``a`` is half-way through [0, 10) when ``b`` joins; ``a`` then leaves exactly when
    row 0 is still ahead of it (an adaptive leave, as after a crash on that row). A sampler
    that couples ``b`` to ``a`` beyond DSA's |I| / max |R| (say, ``b`` replays ``a``'s
    remaining rows first: uniform on average over ``a``'s history) gives ``b`` row 0 first
    half as often as any other row here; DSA stays uniform.
    """
    trials, n = 4000, 10
    firsts = np.zeros(n)
    for seed in range(trials):
        s = DependentSampler(seed=seed)
        s.add_job("a", BitMap(range(n)))
        s.sample_many(["a"], n // 2)
        s.add_job("b", BitMap(range(n)))
        if 0 in s.remaining("a"):
            s.remove_job("a")
        firsts[s.sample(s.jobs())["b"]] += 1
    assert chi2_pvalue(firsts, np.full(n, trials / n)) > P_MIN


def _read_through_a_queue(give_back, seed: int = 11, steps: int = 6000) -> list[int]:
    """Job ``t`` reads through a queue sampled ahead, as the engine's scheduler does, and at
    moments fixed in advance gives back rows of the queue that ``give_back(queue, rng)``
    picks; job ``o`` joins and leaves and sometimes takes part in the rounds. Returns what
    ``t`` read, checked exactly once per epoch."""
    target = BitMap(range(29))
    s = DependentSampler(seed=seed)
    s.add_job("t", target)
    rng = np.random.default_rng(seed)
    queue: list[tuple[int, int]] = []  # (row, epoch)
    out: list[int] = []
    for step in range(steps):
        if step % 40 == 0:
            if "o" in s.jobs():
                s.remove_job("o")
            else:
                s.add_job("o", BitMap(range(10, 45)))
        if step % 5 == 0 and queue:  # rows queued of the sampler's epoch may go back
            now = s.epoch("t")
            back = give_back([row for row, e in queue if e == now], rng)
            if back:
                s.give_back("t", np.array(back))
                queue = [q for q in queue if not (q[1] == now and q[0] in back)]
        while len(queue) < 7:
            jobs = ["t"] + (["o"] if "o" in s.jobs() and rng.random() < 0.6 else [])
            queue.append((s.sample(jobs)["t"], s.epoch("t")))
        for _ in range(int(rng.integers(1, 3))):
            out.append(queue.pop(0)[0])
    n = len(target)
    full = len(out) // n * n
    for e in range(full // n):
        assert sorted(out[e * n : (e + 1) * n]) == list(target), f"epoch {e}"
    return out[:full]


def test_positions_uniform_when_queued_rows_are_given_back():
    """``give_back`` of a queue's tail cut at a position chosen without looking at the rows
    (what the scheduler does when a job opens) keeps the order uniform; giving back by row
    identity would not, and this check sees it."""

    def tail(rows: list[int], rng: np.random.Generator) -> list[int]:
        return rows[int(rng.integers(0, len(rows) + 1)) :]

    def high_rows(rows: list[int], rng: np.random.Generator) -> list[int]:
        return [r for r in rows if r >= 15]  # keeps the low rows first: biased

    ids = BitMap(range(29))
    obs, exp = position_table(_read_through_a_queue(tail), ids, 4)
    assert chi2_pvalue(obs, exp) > P_MIN
    obs, exp = position_table(_read_through_a_queue(high_rows), ids, 4)
    assert chi2_pvalue(obs, exp) < P_MIN
