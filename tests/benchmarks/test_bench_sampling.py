from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from pyroaring import BitMap

from benchmarks import sampling as bench
from tabloader.sampling import DependentSampler, IndependentSampler
from tests.support.cachesim import (
    POLICIES,
    JobSpec,
    Policy,
    Scenario,
    Stream,
    belady_pinned,
    generate_stream,
    simulate,
)


def stream_of(rows: list[int], per_round: int = 1) -> Stream:
    arr = np.asarray(rows, dtype=np.int64)
    return Stream(
        rows=arr,
        counts=np.ones(len(arr), dtype=np.int64),
        rounds=np.arange(0, len(arr) + 1, per_round, dtype=np.int64),
        ref_events=[(0, np.unique(arr), 1)],
        universe=int(arr.max()) + 1,
    )


def test_policies_on_a_hand_stream():
    s = stream_of([1, 2, 3, 1, 2, 4, 1, 2, 3, 4])
    assert simulate(s, Policy.LRU, 3) == 6
    assert simulate(s, Policy.FIFO, 3) == 8
    assert simulate(s, Policy.MINIO, 3) == 5
    assert simulate(s, Policy.BELADY, 3) == 5
    assert simulate(s, Policy.BELADY, 4) == 4
    for policy in POLICIES:
        assert simulate(s, policy, 10) == 4
    with pytest.raises(ValueError, match="capacity"):
        simulate(s, Policy.LRU, 0)


@pytest.mark.parametrize("cls", [DependentSampler, IndependentSampler])
def test_generate_stream_reads_every_row(cls):
    sc = Scenario(
        "t",
        (
            JobSpec("a", BitMap(range(50))),
            JobSpec("b", BitMap(range(20, 80)), speed=0.5),
            JobSpec("c", BitMap(range(0, 80, 2)), start=10, leave_after=15),
        ),
    )
    st = generate_stream(sc, cls(seed=0))
    assert int(st.counts.sum()) == sc.total == 50 + 60 + 15
    for policy in POLICIES:
        reads = simulate(st, policy, 1000)
        assert reads == len(np.unique(st.rows)) == sc.union


def test_quick_bench_end_to_end(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "sampling.json"
    args = parser.parse_args(["--quick", "--no-speed", "--out", str(out)])
    assert bench.run(args) == 0
    text = capsys.readouterr().out
    assert "PASS" in text
    data = json.loads(out.read_text())
    assert {"pair-shift-0", "nested-n-2n", "identical-x4", "leave-mid-epoch"} <= set(
        data["scenarios"]
    )
    assert len(data["plots"]) == len(data["scenarios"])
    assert all((tmp_path / p.split("/")[-1]).exists() for p in data["plots"])
    sizes = ["1 row", "1%", "10%", "30%"]
    for row in data["results"]:
        belady = next(
            r
            for r in data["results"]
            if r["scenario"] == row["scenario"]
            and r["sampler"] == row["sampler"]
            and r["policy"] == "Belady"
        )
        for size in sizes:
            assert row[size] >= row["union"]
            assert belady[size] <= row[size]
        assert row["1 row"] <= row["sum"]


@pytest.mark.parametrize("cls", [DependentSampler, IndependentSampler])
def test_lookahead_spans_refcnt_to_belady(cls):
    """Window 0 knows no next use (RefCnt); a window past the end knows them all (Belady)."""
    from tabloader.engine._arena.eviction import ARENA_POLICY
    from tests.support.cachesim import replay

    sc = Scenario(
        "t",
        (
            JobSpec("a", BitMap(range(300))),
            JobSpec("b", BitMap(range(100, 400)), speed=0.5),
            JobSpec("c", BitMap(range(0, 400, 2)), start=60),
        ),
    )
    st = generate_stream(sc, cls(seed=3))
    for cap in (20, 60):
        refcnt, belady = simulate(st, Policy.REFCNT, cap), simulate(st, Policy.BELADY, cap)
        assert replay(st, ARENA_POLICY, cap, 0) == refcnt
        assert replay(st, ARENA_POLICY, cap, len(st.rows)) == belady < refcnt
        assert belady <= simulate(st, Policy.LOOKAHEAD, cap) <= refcnt


def access_log(*events: tuple[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """("+", row): a batch looks the row up; ("-", row): it releases it (space 0)."""
    kind = np.array([1 if e == "+" else 0 for e, _ in events], np.int64)
    row = np.array([r for _, r in events], np.int64)
    return kind, np.zeros_like(row), row


def test_belady_pinned_keeps_what_batches_hold():
    # b is looked up while a is held: a cache of one value cannot take b, so b is read twice
    kind, space, row = access_log(("+", 0), ("+", 1), ("-", 0), ("-", 1), ("+", 1), ("-", 1))
    assert belady_pinned(kind, space, row, 1) == 3
    assert belady_pinned(kind, space, row, 1, pins=False) == 2  # MIN: evict a for b
    assert belady_pinned(kind, space, row, 2) == 2
    # a value needed later than every cached one is not cached (MIN's bypass)
    kind, space, row = access_log(*[(e, r) for r in (0, 1, 0) for e in "+-"])
    assert belady_pinned(kind, space, row, 1) == 2  # 1 is not cached: 0 stays for its reuse
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        belady_pinned(kind, space, row, 0)


def test_belady_pinned_without_holds_is_min_on_the_look_ups():
    rows = [1, 2, 3, 1, 2, 4, 1, 2, 3, 4]
    kind, space, row = access_log(*[(e, r) for r in rows for e in "+-"])
    for capacity in (1, 2, 3, 4, 10):
        expected = simulate(stream_of(rows), Policy.BELADY, capacity)
        assert belady_pinned(kind, space, row, capacity) == expected
        assert belady_pinned(kind, space, row, capacity, pins=False) == expected
    # the same row in two spaces is two values
    two = belady_pinned(np.array([1, 0, 1, 0]), np.array([0, 0, 1, 1]), np.array([5, 5, 5, 5]), 1)
    assert two == 2
    assert belady_pinned(*access_log(), 3) == 0
