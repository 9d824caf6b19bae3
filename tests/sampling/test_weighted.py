"""Weighted jobs (issue 39): each draws exactly from its own distribution, plain jobs beside it
keep their exact uniform permutations, and a weighted job agrees with its plain leader as often
as the maximal coupling allows. Statistical tests with fixed seeds; each has a negative control
that a uniform (or uncoupled) sampler fails."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
from _sampling_helpers import check_exactly_once, chi2_pvalue, chi2_sf
from pyroaring import BitMap

from tabloader.catalog._errors import SamplingError
from tabloader.sampling import DependentSampler, IndependentSampler

WITHOUT = SimpleNamespace(replacement=False, importance=None)  # a spec: without replacement


def skewed(n: int) -> np.ndarray:
    return (np.arange(n) + 1.0) ** 1.5


@pytest.mark.parametrize(
    ("cls", "beside"),
    [(DependentSampler, True), (DependentSampler, False), (IndependentSampler, False)],
    ids=["with-a-leader", "alone", "independent"],
)
def test_a_weighted_jobs_draws_follow_its_weights(cls, beside):
    n, rounds = 20, 6000
    w = skewed(n)
    s = cls(seed=3)
    if beside:
        s.add_job("plain", BitMap(range(n)))
    s.add_job("w", BitMap(range(n)), weights=w)
    names = ["plain", "w"] if beside else ["w"]
    out = s.sample_many(names, rounds)
    expected = w / w.sum() * rounds
    assert chi2_pvalue(np.bincount(out["w"], minlength=n), expected) > 1e-3
    # negative control: uniform draws against the same weights are rejected
    uniform = np.random.default_rng(0).integers(0, n, rounds)
    assert chi2_pvalue(np.bincount(uniform, minlength=n), expected) < 1e-6
    if beside:
        assert chi2_pvalue(np.bincount(out["plain"], minlength=n), expected) < 1e-6


@pytest.mark.parametrize("cls", [DependentSampler, IndependentSampler])
def test_without_replacement_every_row_once_and_the_first_draw_by_weight(cls):
    n, epochs = 8, 1500
    w = skewed(n)
    s = cls(seed=5)
    if cls is DependentSampler:
        s.add_job("plain", BitMap(range(n)))
    s.add_job("w", BitMap(range(n)), WITHOUT, weights=w)
    names = s.jobs()
    out = s.sample_many(names, n * epochs)["w"].reshape(epochs, n)
    assert (np.sort(out, axis=1) == np.arange(n)).all()  # each epoch every row exactly once
    first = np.bincount(out[:, 0], minlength=n)
    assert chi2_pvalue(first, w / w.sum() * epochs) > 1e-3
    assert chi2_pvalue(first, np.full(n, epochs / n)) < 1e-6  # not a uniform order
    # second draw: successive sampling, P(i second) = sum_j q_j q_i / (1 - q_j)
    q = w / w.sum()
    second = q * sum(q[j] / (1 - q[j]) for j in range(n)) - q * q / (1 - q)
    assert chi2_pvalue(np.bincount(out[:, 1], minlength=n), second * epochs) > 1e-3


def test_rows_of_weight_zero_come_last_without_replacement():
    s = DependentSampler(seed=1)
    w = np.array([0.0, 1.0, 0.0, 2.0, 3.0])
    s.add_job("w", BitMap(range(5)), WITHOUT, weights=w)
    for _ in range(20):
        epoch = s.sample_many(["w"], 5)["w"]
        assert sorted(epoch[:3].tolist()) == [1, 3, 4]
        assert sorted(epoch[3:].tolist()) == [0, 2]
    s.add_job("r", BitMap(range(5)), weights=w)  # with replacement: never drawn
    assert set(s.sample_many(["r"], 200)["r"].tolist()) == {1, 3, 4}


@pytest.mark.parametrize("spec", [None, WITHOUT], ids=["with", "without"])
def test_a_plain_job_beside_a_weighted_one_draws_exactly_what_it_would_alone(spec):
    n, epochs = 12, 600
    alone, both = DependentSampler(seed=9), DependentSampler(seed=9)
    for s in (alone, both):
        s.add_job("a", BitMap(range(n)))
        s.add_job("b", BitMap(range(4, 16)))
    both.add_job("w", BitMap(range(2, 14)), spec, weights=skewed(12))
    got = both.sample_many(["a", "w", "b"], n * epochs)
    assert (got["a"] == alone.sample_many(["a", "b"], n * epochs)["a"]).all()
    check_exactly_once(got["a"].tolist(), BitMap(range(n)))
    # uniform positions: row x position counts over the epochs
    table = np.zeros((n, n))
    np.add.at(table, (got["a"], np.tile(np.arange(n), epochs)), 1)
    stat = float(((table - epochs / n) ** 2 / (epochs / n)).sum())
    assert chi2_sf(stat, (n - 1) ** 2) > 1e-3
    # negative control: the weighted job's own positions are far from uniform
    if spec is WITHOUT:
        wt = np.zeros((n, n))
        np.add.at(wt, (got["w"] - 2, np.tile(np.arange(n), epochs)), 1)
        assert chi2_sf(float(((wt - epochs / n) ** 2 / (epochs / n)).sum()), (n - 1) ** 2) < 1e-6


def bounds(plain: np.ndarray, n_ids: int, ids: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Per round, ``sum_i min(p_i, q_i)`` with ``p`` uniform over the plain job's round-start
    remaining set (a fresh epoch every ``n_ids`` rounds)."""
    out = np.empty(plain.size)
    left = np.ones(ids.size, dtype=bool)
    pos = {int(r): i for i, r in enumerate(ids)}
    for t, x in enumerate(plain.tolist()):
        if t % n_ids == 0:
            left[:] = True
        out[t] = np.minimum(np.where(left, 1.0 / left.sum(), 0.0), q).sum()
        left[pos[x]] = False
    return out


@pytest.mark.parametrize("sets", ["same", "overlapping"])
def test_agreement_with_the_leader_meets_the_maximal_coupling(sets):
    n, epochs = 30, 120
    s = DependentSampler(seed=11)
    plain_ids = np.arange(n)
    w_ids = plain_ids if sets == "same" else np.arange(10, 10 + n)
    w = skewed(n)
    s.add_job("a", BitMap(plain_ids))
    s.add_job("w", BitMap(w_ids), weights=w)
    s.add_job("twin", BitMap(w_ids), weights=w)  # same distribution: common random numbers
    out = s.sample_many(["a", "w", "twin"], n * epochs)
    q = np.zeros(10 + n)
    q[w_ids] = w / w.sum()
    b = bounds(out["a"], n, plain_ids, q[plain_ids])
    agree = (out["a"] == out["w"]).astype(float)
    se = np.sqrt((b * (1 - b)).sum()) / b.size
    assert abs(agree.mean() - b.mean()) < 4 * se
    assert (out["w"] == out["twin"]).all()
    # negative control: independent draws agree at sum_i p_i q_i, far below the bound
    rng = np.random.default_rng(0)
    indep = w_ids[np.searchsorted(np.cumsum(w / w.sum()), rng.random(b.size))]
    assert (indep == out["a"]).mean() < b.mean() - 10 * se


def test_without_replacement_agreement_meets_the_bound_every_round():
    n, epochs = 10, 800
    s = DependentSampler(seed=2)
    w = skewed(n)
    s.add_job("a", BitMap(range(n)))
    s.add_job("v", BitMap(range(n)), WITHOUT, weights=w)
    out = s.sample_many(["a", "v"], n * epochs)
    b = np.empty(n * epochs)  # p uniform over a's remaining rows, q: w over v's, renormalised
    for t, (x, y) in enumerate(zip(out["a"].tolist(), out["v"].tolist(), strict=True)):
        if t % n == 0:
            left_a, left_v = np.ones(n, bool), np.ones(n, bool)
        q = np.where(left_v, w, 0.0)
        b[t] = np.minimum(left_a / left_a.sum(), q / q.sum()).sum()
        left_a[x] = left_v[y] = False
    agree = out["a"] == out["v"]
    se = np.sqrt((b * (1 - b)).sum()) / b.size
    assert abs(agree.mean() - b.mean()) < 4 * se
    first = agree[::n]  # round 0 of each epoch: p uniform, q the weights
    assert abs(first.mean() - b[0]) < 4 * np.sqrt(b[0] * (1 - b[0]) / epochs)


def test_sample_many_is_n_calls_of_sample():
    def make():
        s = DependentSampler(seed=4)
        s.add_job("a", BitMap(range(40)))
        s.add_job("b", BitMap(range(20, 60)))
        s.add_job("w", BitMap(range(10, 50)), weights=skewed(40))
        s.add_job("v", BitMap(range(0, 40)), WITHOUT, weights=skewed(40)[::-1].copy())
        return s

    names = ["a", "b", "w", "v"]
    many = make().sample_many(names, 300)
    one = make()
    single = [one.sample(names) for _ in range(300)]
    for name in names:
        assert many[name].tolist() == [r[name] for r in single]


@pytest.mark.parametrize("cls", [DependentSampler, IndependentSampler])
def test_resume_gives_the_same_draws(cls):
    def make():
        s = cls(seed=8)
        s.add_job("a", BitMap(range(30)))
        s.add_job("w", BitMap(range(10, 40)), weights=skewed(30))
        s.add_job("v", BitMap(range(5, 35)), WITHOUT, weights=skewed(30))
        return s

    names = ["a", "w", "v"]
    first = make()
    first.sample_many(names, 47)  # mid-epoch
    first.sample_many(["w", "v"], 5)  # a round without the plain job
    state = first.state_dict()
    rest = [first.sample_many(names, 71) for _ in range(3)]
    resumed = cls(seed=123)
    resumed.load_state_dict(state)
    again = [resumed.sample_many(names, 71) for _ in range(3)]
    for a, b in zip(rest, again, strict=True):
        for name in names:
            assert a[name].tolist() == b[name].tolist()
    assert resumed.remaining("v") == first.remaining("v")
    assert resumed.epoch("w") == first.epoch("w")


def test_expected_draws_and_row_weights():
    s = DependentSampler(seed=0)
    w = np.array([1.0, 3.0, 0.0, 4.0])
    s.add_job("p", BitMap([0, 1, 2, 3, 9]))
    s.add_job("w", BitMap([0, 1, 2, 3]), weights=w)
    s.add_job("v", BitMap([1, 2, 3, 4]), WITHOUT, weights=w)
    q = w / w.sum()
    ids = np.array([0, 1, 2, 3, 4, 9])
    # v's rows 1..4 weigh 1, 3, 0, 4
    assert np.allclose(s.expected_draws(ids), [4 * q[0], 4 * q[1] + 1, 1, 4 * q[3] + 1, 1, 0])
    s.sample_many(["w", "v"], 3)  # w: one draw left; v: one row left, its row of weight 0
    assert np.allclose(s.expected_draws(ids), [q[0], q[1], 0, q[3] + 1, 0, 0])
    assert s.refcounts(np.array([0, 9])).tolist() == [1, 1]  # plain jobs only
    rows = np.array([0, 1, 3])
    assert np.allclose(s.row_weights("w", 0, rows), 1 / (3 * q[[0, 1, 3]]))  # 3 rows weigh > 0
    assert np.allclose((q[[0, 1, 3]] * s.row_weights("w", 0, rows)).sum(), 1.0)  # mean 1 under q
    assert s.row_weights("v", 0, np.array([1, 4])).tolist() == [1.0, 1.0]
    assert s.row_weights("p", 0, rows) is None
    assert s.weighted("w")
    assert not s.weighted("p")


@pytest.mark.parametrize("cls", [DependentSampler, IndependentSampler])
@pytest.mark.parametrize(
    ("weights", "match"),
    [
        (np.array([1.0, -1.0, 2.0]), "finite and >= 0; positions \\[1\\]"),
        (np.array([1.0, np.nan, 2.0]), "finite and >= 0"),
        (np.array([1.0, np.inf, 2.0]), "finite and >= 0"),
        (np.zeros(3), "all zero"),
        (np.ones(4), "shape \\(4,\\), not \\(3,\\)"),
    ],
)
def test_bad_weights_are_refused(cls, weights, match):
    s = cls(seed=0)
    with pytest.raises(SamplingError, match=match):
        s.add_job("w", BitMap(range(3)), weights=weights)
    assert s.jobs() == []


@pytest.mark.parametrize("cls", [DependentSampler, IndependentSampler])
def test_a_report_on_a_job_without_importance_is_refused(cls):
    s = cls(seed=0)
    s.add_job("p", BitMap(range(3)))
    s.add_job("w", BitMap(range(3)), weights=np.ones(3))
    for name in ("p", "w"):
        with pytest.raises(SamplingError, match="takes no loss reports.*importance = 'loss'"):
            s.report(name, np.array([0]), np.array([1.0]))
    with pytest.raises(SamplingError, match="Unknown job 'x'"):
        s.report("x", np.array([0]), np.array([1.0]))
    with pytest.raises(SamplingError, match="both weights and importance"):
        s.add_job("i", BitMap(range(3)), SimpleNamespace(importance="loss"), weights=np.ones(3))


def test_give_back_returns_draws_of_a_weighted_job():
    s = DependentSampler(seed=0)
    s.add_job("v", BitMap(range(6)), WITHOUT, weights=skewed(6))
    s.add_job("w", BitMap(range(6)), weights=skewed(6))
    got = s.sample_many(["v", "w"], 4)
    s.give_back("v", got["v"][2:])
    s.give_back("w", got["w"][2:])
    assert len(s.remaining("v")) == 4
    rest = s.sample_many(["v", "w"], 4)
    assert sorted([*got["v"][:2].tolist(), *rest["v"].tolist()]) == list(range(6))
    assert s.epoch("w") == 0
    s.sample_many(["v", "w"], 1)  # both start their next epoch
    assert s.epoch("w") == 1
    assert len(s.remaining("v")) == 5
    with pytest.raises(SamplingError, match="not in its remaining set"):
        s.give_back("v", np.array([s.remaining("v").min()]))
    with pytest.raises(SamplingError, match="rows must be ids of the job"):
        s.give_back("w", np.array([99]))


IMPORTANCE = SimpleNamespace(importance="loss", replacement=True)


@pytest.mark.parametrize("cls", [DependentSampler, IndependentSampler])
def test_an_importance_job_draws_its_next_epoch_from_the_reported_losses(cls):
    n = 10
    s = cls(seed=6)
    s.add_job("i", BitMap(range(100, 100 + n)), IMPORTANCE)
    first = s.sample_many(["i"], n)["i"]  # epoch 0: the prior (uniform)
    assert np.allclose(s.row_weights("i", 0, first), 1.0)
    ids = np.arange(100, 100 + n)
    s.report("i", ids, np.arange(n, dtype=np.float64))  # row 100 + k: k rows below it
    s.report("i", ids[:3], np.array([0.0, 1.0, 2.0]))  # a later report replaces the scores
    scores = s.importance_scores("i")
    q = scores.probabilities()
    epochs = 600
    got = s.sample_many(["i"], n * epochs)["i"]
    assert s.epoch("i") == epochs
    assert chi2_pvalue(np.bincount(got - 100, minlength=n), q * n * epochs) > 1e-3
    assert chi2_pvalue(np.bincount(got - 100, minlength=n), np.full(n, epochs)) < 1e-6
    w = s.row_weights("i", epochs, ids)
    assert np.allclose(w, 1 / (n * q))
    assert np.isclose((q * w).sum(), 1.0)
    with pytest.raises(SamplingError, match=r"epoch's distribution is gone .* in order"):
        s.row_weights("i", 0, ids)  # the dealer asked for a later epoch already
    with pytest.raises(SamplingError, match="rows not of the job"):
        s.row_weights("i", epochs, np.array([5]))


def test_an_importance_job_resumes_with_its_scores_and_draws():
    def make():
        s = DependentSampler(seed=1)
        s.add_job("a", BitMap(range(40)))
        s.add_job("i", BitMap(range(40)), IMPORTANCE)
        return s

    first = make()
    first.sample_many(["a", "i"], 25)
    first.report("i", np.arange(0, 40, 3), np.linspace(0, 1, 14))
    first.sample_many(["a", "i"], 30)  # the next epoch drew from the reports
    state = first.state_dict()
    rest = first.sample_many(["a", "i"], 90)
    resumed = DependentSampler(seed=0)
    resumed.load_state_dict(state)
    again = resumed.sample_many(["a", "i"], 90)
    assert rest["i"].tolist() == again["i"].tolist()
    assert rest["a"].tolist() == again["a"].tolist()
    np.testing.assert_array_equal(
        resumed.importance_scores("i").probabilities(), first.importance_scores("i").probabilities()
    )


def test_weighted_jobs_without_a_leader_share_by_common_random_numbers():
    s = DependentSampler(seed=7)
    s.add_job("far", BitMap(range(100, 110)))  # a plain job sharing no row: no leader
    w = skewed(10)
    s.add_job("w", BitMap(range(10)), weights=w)
    s.add_job("v", BitMap(range(10)), weights=w * (1 + 0.01 * np.arange(10)))  # close to w
    out = s.sample_many(["far", "w", "v"], 3000)
    # inverse CDF on the same uniform: agreement near 1 - TV distance, far above independence
    q = w / w.sum()
    assert (out["w"] == out["v"]).mean() > 0.9 > (q * q).sum() * 3
    assert chi2_pvalue(np.bincount(out["w"], minlength=10), q * 3000) > 1e-3


def test_a_weighted_job_without_replacement_holds_a_few_bytes_a_row():
    """Its sum tree is one float64 array: the job holds at most 12 bytes a row more than the
    same job with replacement (the tree's 16 and the live flags' 1 in place of the cumulative
    sums' 8), where a tree of Python floats held 57 more (1.4 GiB for 10M rows)."""
    n = 1 << 17
    w = np.random.default_rng(0).random(n) + 0.5
    held = {}
    for name, spec in (("with", None), ("without", WITHOUT)):
        s = DependentSampler(seed=0)
        tracemalloc.start()
        try:
            s.add_job("w", BitMap(range(n)), spec, weights=w)
            s.sample_many(["w"], 100)
            held[name] = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
    assert held["with"] < 32 * n  # the reference: ids, q and its cumulative sums
    assert held["without"] - held["with"] <= 12 * n, held


@pytest.mark.parametrize("cls", [DependentSampler, IndependentSampler])
@pytest.mark.parametrize("spec", [None, WITHOUT], ids=["with", "without"])
def test_weights_whose_sum_overflows_draw_by_their_ratios(cls, spec):
    """600 rows of 1e306 and 1e308 sum past float64's range: scaled by their maximum first,
    they draw as 1 and 100 would (they drew nothing with replacement: an IndexError; without,
    a uniform order)."""
    n = 600
    w = np.where(np.arange(n) < 100, 1e308, 1e306)
    s = cls(seed=2)
    s.add_job("w", BitMap(range(n)), spec, weights=w)
    out = s.sample_many(["w"], n)["w"]
    heavy = 100 * 100 / (100 * 100 + 500)  # the chance that a draw is a row under 100
    if spec is None:
        assert abs((out < 100).mean() - heavy) < 0.04
    else:
        assert sorted(out.tolist()) == list(range(n))
        assert (out[:100] < 100).mean() > 0.8  # uniform order: 1/6
