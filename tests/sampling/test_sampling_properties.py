"""Hypothesis property tests: exactly once per epoch under any interleaving; exact resume."""

from __future__ import annotations

import array

import numpy as np
import pytest
from _sampling_helpers import check_exactly_once, run_ops, run_save_load_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyroaring import BitMap

from tabloader.sampling import DependentSampler, IndependentSampler
from tabloader.sampling import _dependent as dependent

walk = dependent._walk  # the C walk: the one private name these tests call

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def scripts(draw: st.DrawFn) -> list[tuple]:
    """Random joins (any size, incl. largest/smallest), leaves, rounds over job subsets."""
    universe = draw(st.integers(3, 40))
    ops: list[tuple] = []
    live: list[str] = []
    next_id = 0
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["add", "remove", "sample", "many", "many"]))
        if kind == "add" or not live:
            ids = draw(st.sets(st.integers(0, universe - 1), min_size=1, max_size=universe))
            name = f"j{next_id}"
            next_id += 1
            ops.append(("add", name, BitMap(ids)))
            live.append(name)
        elif kind == "remove":
            name = draw(st.sampled_from(live))
            live.remove(name)
            ops.append(("remove", name))
        else:
            jobs = draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
            if kind == "sample":
                ops.append(("sample", jobs))
            else:
                ops.append(("many", jobs, draw(st.integers(0, 3 * universe))))
    return ops


def replay_streams(ops: list[tuple], results: list) -> dict[str, list[int]]:
    streams: dict[str, list[int]] = {}
    it = iter(results)
    for op in ops:
        if op[0] == "add":
            streams[op[1]] = []
        elif op[0] in ("sample", "many"):
            for name, rows in next(it):
                streams[name].extend(rows if isinstance(rows, list) else [rows])
    return streams


@pytest.mark.parametrize("cls", [DependentSampler, IndependentSampler])
@SETTINGS
@given(ops=scripts(), seed=st.integers(0, 2**32 - 1))
def test_exactly_once_per_epoch(cls, ops, seed):
    s = cls(seed=seed)
    results = run_ops(s, ops)
    streams = replay_streams(ops, results)
    sets = {op[1]: op[2] for op in ops if op[0] == "add"}
    for name, stream in streams.items():
        check_exactly_once(stream, sets[name])
    # remaining / epoch / refcount agree with the streams
    for name in s.jobs():
        n = len(sets[name])
        stream = streams[name]
        done = len(stream) % n
        epoch = max(0, (len(stream) - 1) // n) if stream else 0
        assert s.epoch(name) == epoch
        if done:
            assert s.remaining(name) == sets[name] - BitMap(stream[len(stream) - done :])
        elif stream:
            assert len(s.remaining(name)) == 0
        else:
            assert s.remaining(name) == sets[name]
    universe = range(0, 41)
    expect = [sum(i in s.remaining(j) for j in s.jobs()) for i in universe]
    assert s.refcounts(list(universe)).tolist() == expect


@pytest.mark.parametrize("cls", [DependentSampler, IndependentSampler])
@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(ops=scripts(), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_resume_equals_uninterrupted(cls, ops, seed, data):
    mids = data.draw(st.lists(st.integers(0, len(ops)), min_size=1, max_size=3, unique=True))
    run_save_load_state(lambda: cls(seed=seed), ops, mids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorized_one_region_rounds_equal_the_round_by_round_walk(seed):
    """Many rows at once (one region) give exactly what the general loop gives, call by call,
    through joins, leaves, restarts and small regions where picks collide."""
    runs = []
    for vectorize in (True, False):
        s = DependentSampler(seed=seed)
        s.vectorize = vectorize
        out = []
        s.add_job("a", BitMap(range(5000)))
        out += s.sample_many(["a"], 700)["a"].tolist()  # one region: vectorized
        s.add_job("b", BitMap(range(5000)))  # b's region differs from a's remaining rows
        out += [v for col in s.sample_many(["a", "b"], 300).values() for v in col.tolist()]
        s.remove_job("b")
        small = BitMap(range(40))
        s.add_job("c", small)
        for _ in range(5):  # a 40-row region: 30 picks at once collide with the tail
            out += s.sample_many(["c"], 30)["c"].tolist()
        out += s.sample_many(["a"], 6000)["a"].tolist()  # through an epoch restart
        for name in ("d", "e", "f"):  # staggered joins: nested sets, mostly one root region
            s.add_job(name, BitMap(range(5000)))
            out += s.sample_many([name], 37)[name].tolist()
        for _ in range(20):
            res = s.sample_many(["a", "d", "e", "f"], 250)
            out += [v for col in res.values() for v in col.tolist()]
        runs.append(out)
    assert runs[0] == runs[1]


@SETTINGS
@given(ops=scripts(), seed=st.integers(0, 2**32 - 1))
def test_the_c_walk_gives_the_rows_and_state_of_the_python_walk(ops, seed):
    """Rounds over several regions are walked in C (``_rounds.c``) unless ``vectorize`` is
    off: under any joins, leaves and rounds both give the same rows, and the same state
    after (what a later resume continues from)."""
    runs, states = [], []
    for vectorize in (True, False):
        s = DependentSampler(seed=seed)
        s.vectorize = vectorize
        s.CHUNK = 7  # the C walk's rounds in several calls, as a long round is
        runs.append(run_ops(s, ops))
        states.append(replay_state(s))
    assert runs[0] == runs[1]
    assert states[0] == states[1]


def replay_state(s: DependentSampler) -> tuple:
    """What the sampler will do next: its jobs' remaining rows and epochs, and 50 more
    rounds of all its jobs (the uniforms' stream must be where the Python walk left it)."""
    jobs = sorted(s.jobs())
    now = [(j, sorted(s.remaining(j)), s.epoch(j)) for j in jobs]
    more = sorted((k, v.tolist()) for k, v in s.sample_many(jobs, 50).items()) if jobs else []
    return now, more


def test_the_c_walk_is_built():
    """The install builds the C walk (a C compiler is part of the test setup); without it the
    service samples four staggered jobs ~30x slower per round."""
    assert walk is not None


def one_region(row):
    """Regions holding ``row`` alone, in region 0 of job slot 0; pos/reg cover rows 0..1."""
    regions = dependent.Regions()
    regions.keys, regions.index = [1], {1: 0}
    regions.rows = [array.array("I", [row])]
    regions.pos, regions.reg = array.array("I", [0, 0]), array.array("i", [0, 0])
    return regions


def test_the_c_walk_refuses_a_row_past_its_position_index():
    """Regions that name a row the position index does not cover (a bug elsewhere) raise in
    the C walk instead of writing past the index's memory."""
    out = np.empty((1, 1), dtype=np.int64)
    with pytest.raises(RuntimeError, match="row 5 is past the position index"):
        walk.rounds(one_region(5), (0,), [1], [[0]], [[]], [0.5, 0.5], 0, out)


def test_the_c_walk_takes_the_regions_object_and_walks_as_python():
    """One round over one region: the C walk reads the region through the object, picks the
    row the uniforms name and drops it (no job needs it after)."""
    regions, out = one_region(1), np.empty((1, 1), dtype=np.int64)
    assert walk.rounds(regions, (0,), [1], [[0]], [[]], [0.25, 0.5], 0, out) == 2
    assert out.tolist() == [[1]]
    assert (len(regions.rows[0]), regions.reg[1]) == (0, -1)


@pytest.mark.parametrize(
    ("attr", "value", "error", "match"),
    [
        ("rows", (), TypeError, r"regions\.rows must be a list; got tuple"),
        ("index", [], TypeError, r"regions\.index must be a dict; got list"),
        ("pos", [0, 0], TypeError, r"regions\.pos must be a writable array\('I'\); got list"),
        ("reg", array.array("I", [0, 0]), TypeError, r"regions\.reg must be .*array\('i'\)"),
        ("reg", array.array("i", [0]), ValueError, "regions.pos and regions.reg differ"),
    ],
)
def test_the_c_walk_names_a_wrong_attribute_of_its_regions(attr, value, error, match):
    regions, out = one_region(1), np.empty((1, 1), dtype=np.int64)
    setattr(regions, attr, value)
    with pytest.raises(error, match=match):
        walk.rounds(regions, (0,), [1], [[0]], [[]], [0.25, 0.5], 0, out)


@pytest.mark.parametrize("out", [np.empty((2, 1), np.int64), np.empty(1, np.int64)])
def test_the_c_walk_wants_an_out_of_one_row_per_job(out):
    with pytest.raises(ValueError, match=r"out must be an int64 array \(m jobs, n rounds\)"):
        walk.rounds(one_region(1), (0,), [1], [[0]], [[]], [0.25, 0.5], 0, out)
