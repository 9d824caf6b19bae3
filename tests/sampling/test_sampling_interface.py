from __future__ import annotations

import numpy as np
import pytest
from _sampling_helpers import check_exactly_once, run_ops, run_save_load_state
from pyroaring import BitMap

from tabloader.catalog._errors import SamplingError
from tabloader.sampling import SAMPLERS, DependentSampler, IndependentSampler, Sampler


def r(lo: int, hi: int) -> BitMap:
    return BitMap(range(lo, hi))


def test_registry_and_protocol(sampler_cls):
    assert set(SAMPLERS.values()) == {DependentSampler, IndependentSampler}
    assert isinstance(sampler_cls(seed=0), Sampler)


def test_errors(sampler_cls):
    s = sampler_cls(seed=0)
    s.add_job("a", r(0, 10))
    with pytest.raises(SamplingError, match="'a' is already registered"):
        s.add_job("a", r(0, 5))
    with pytest.raises(SamplingError, match="'e' has an empty id set"):
        s.add_job("e", BitMap())
    with pytest.raises(SamplingError, match=r"Unknown job 'b'.*'a'"):
        s.sample(["a", "b"])
    with pytest.raises(SamplingError, match="Unknown job 'b'"):
        s.sample_many(["b"], 3)
    with pytest.raises(SamplingError, match="'a' is listed twice"):
        s.sample(["a", "a"])
    for call in (s.remove_job, s.remaining, s.epoch):
        with pytest.raises(SamplingError, match="Unknown job 'zz'"):
            call("zz")
    with pytest.raises(SamplingError, match="n must be >= 0"):
        s.sample_many(["a"], -1)
    with pytest.raises(SamplingError, match="Not a"):
        s.load_state_dict({"kind": "other"})
    assert s.jobs() == ["a"]  # failed calls changed nothing
    assert len(s.remaining("a")) == 10


def test_basic_bookkeeping(sampler_cls):
    s = sampler_cls(seed=1)
    s.add_job("a", r(0, 10))
    s.add_job("b", r(5, 20))
    s.add_job("c", BitMap([3, 7, 100]))
    assert s.jobs() == ["a", "b", "c"]
    assert s.refcount(7) == 3
    assert s.refcount(12) == 1
    assert s.refcount(50) == 0
    assert s.refcount(10**6) == 0
    got = s.sample(["a", "c"])
    assert set(got) == {"a", "c"}
    assert got["a"] not in s.remaining("a")
    assert len(s.remaining("a")) == 9
    assert len(s.remaining("b")) == 15
    ids = np.arange(0, 120)
    expect = [sum(i in s.remaining(j) for j in s.jobs()) for i in ids]
    assert s.refcounts(ids).tolist() == expect
    s.remove_job("b")
    assert s.jobs() == ["a", "c"]
    assert s.refcount(12) == 0
    assert s.sample([]) == {}


def test_epochs_restart(sampler_cls):
    s = sampler_cls(seed=2)
    s.add_job("a", r(0, 5))
    s.add_job("b", r(0, 13))
    stream = {"a": [], "b": []}
    for _ in range(40):
        for k, v in s.sample(["a", "b"]).items():
            stream[k].append(v)
    assert s.epoch("a") == 7
    assert s.epoch("b") == 3
    check_exactly_once(stream["a"], r(0, 5))
    check_exactly_once(stream["b"], r(0, 13))


def test_same_seed_same_output_and_sample_many_equals_sample(sampler_cls):
    ops = [("add", "a", r(0, 30)), ("add", "b", r(10, 50)), ("add", "c", BitMap(range(0, 60, 3)))]
    one = sampler_cls(seed=5)
    run_ops(one, ops)
    many = sampler_cls(seed=5)
    run_ops(many, ops)
    singles = [one.sample(["a", "b", "c"]) for _ in range(95)]
    batch = many.sample_many(["a", "b", "c"], 95)
    for name in "abc":
        assert [x[name] for x in singles] == batch[name].tolist()
    assert one.state_dict()["jobs"] == many.state_dict()["jobs"]


def test_save_load_state_midpoints(sampler_cls):
    ops = [
        ("add", "a", r(0, 20)),
        ("add", "b", r(10, 40)),
        ("many", ["a", "b"], 7),
        ("sample", ["b"]),
        ("add", "c", BitMap(range(0, 50, 2))),
        ("many", ["a", "b", "c"], 13),
        ("sample", ["c", "a"]),
        ("remove", "b"),
        ("many", ["a", "c"], 30),
        ("add", "b", r(30, 33)),
        ("many", ["c", "b"], 9),
    ]
    run_save_load_state(lambda: sampler_cls(seed=11), ops, range(1, len(ops)))


def test_seedless_is_resumable(sampler_cls):
    s = sampler_cls()
    s.add_job("a", r(0, 100))
    s.sample_many(["a"], 10)
    state = s.state_dict()
    t = sampler_cls()
    t.load_state_dict(state)
    assert s.sample_many(["a"], 150)["a"].tolist() == t.sample_many(["a"], 150)["a"].tolist()


def test_large_sparse_ids(sampler_cls):
    s = sampler_cls(seed=3)
    ids = BitMap([5, 1 << 20, (1 << 20) + 7, 3_000_000])
    s.add_job("a", ids)
    got = s.sample_many(["a"], 8)["a"].tolist()
    check_exactly_once(got, ids)


def test_give_back_returns_rows_to_the_job_only():
    s = DependentSampler(seed=3)
    s.add_job("a", r(0, 10))
    s.add_job("b", r(0, 10))
    got = s.sample_many(["a", "b"], 4)
    assert got["a"].tolist() == got["b"].tolist()
    s.give_back("a", got["a"][2:])
    assert s.remaining("a") == r(0, 10) - BitMap(got["a"][:2].tolist())
    assert len(s.remaining("b")) == 6
    assert [s.refcount(int(row)) for row in got["a"][2:]] == [1, 1]
    rest = s.sample_many(["a"], 8)["a"].tolist()
    assert sorted(got["a"][:2].tolist() + rest) == list(range(10))  # once each, this epoch
    assert s.epoch("a") == 0


def test_give_back_errors():
    s = DependentSampler(seed=3)
    s.add_job("a", r(0, 10))
    row = s.sample(["a"])["a"]
    with pytest.raises(SamplingError, match="Unknown job 'zz'"):
        s.give_back("zz", np.array([row]))
    with pytest.raises(SamplingError, match=r"give_back\('a'\): rows must be ids of the job"):
        s.give_back("a", np.array([row, (row + 1) % 10]))  # the second was never handed out
    with pytest.raises(SamplingError, match=r"give_back\('a'\): rows must be ids of the job"):
        s.give_back("a", np.array([10]))  # not one of its ids
    assert len(s.remaining("a")) == 9  # failed calls changed nothing
    s.give_back("a", np.array([], np.int64))
    assert len(s.remaining("a")) == 9
