from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyroaring import BitMap

from tabloader.catalog._errors import OptionError, SamplingError
from tabloader.catalog._options import JobSpec
from tabloader.cluster._placement import DROPPED, Placer, preferred_nodes
from tabloader.sampling import DependentSampler


def batches_of(batch_size):
    """The options of a job of ``batch_size`` rows per batch (what placement reads)."""
    return JobSpec({"batch_size": batch_size})


# name -> (ids, node of each rank, batch size)
JOBS = {
    "a": (range(0, 4000), ["n0", "n1"], 32),
    "b": (range(1000, 5000), ["n0", "n1"], 32),
    "c": (range(0, 3000), ["n1", "n0"], 16),
    "d": (range(0, 5000), ["n0", "n0", "n1"], 32),
}


def run_epochs(jobs, *, epochs=2, round_rows=256, seed=0, control=False, slack=None):
    """Sample and place rounds (cut at epoch ends, like the leader) until every job has done
    ``epochs`` epochs. Returns the per job, per epoch, per rank rows; the same-node rate of
    rows several jobs sampled in one round; and the per-round rank counts."""
    sampler, placer = DependentSampler(seed=seed), Placer(slack=slack)
    rng = np.random.default_rng(seed + 1)
    left, epoch = {}, dict.fromkeys(jobs, 0)
    got = {name: {} for name in jobs}
    for name, (ids, nodes, bs) in jobs.items():
        sampler.add_job(name, BitMap(ids))
        placer.add_job(name, size=len(ids), nodes=nodes, spec=batches_of(bs))
        left[name] = len(ids)
    shared = same = 0
    snapshots = []
    while True:
        for name in jobs:
            if left[name] == 0:
                left[name] = len(jobs[name][0])
                epoch[name] += 1
        if min(epoch.values()) >= epochs:
            break
        names = [n for n in jobs if epoch[n] < epochs]
        k = min(round_rows, *(left[n] for n in names))
        rows = sampler.sample_many(names, k)
        ranks = placer.place(rows)
        if control:  # random ranks with the same counts: placement without hashing
            for name in names:
                r = ranks[name]
                keep = r != DROPPED
                r[keep] = rng.permutation(r[keep])
        where: dict[int, set[str]] = {}
        count: dict[int, int] = {}
        for name in names:
            left[name] -= k
            r = ranks[name]
            per_rank = got[name].setdefault(epoch[name], {})
            for rank in range(len(jobs[name][1])):
                per_rank.setdefault(rank, []).append(rows[name][r == rank])
            per_rank.setdefault(DROPPED, []).append(rows[name][r == DROPPED])
            nodes = placer.node_of(name, r)
            for x, node in zip(rows[name].tolist(), nodes.tolist(), strict=True):
                if node:
                    where.setdefault(x, set()).add(node)
                    count[x] = count.get(x, 0) + 1
            job = placer.jobs[name]
            snapshots.append((name, job.placed, job.counts.copy(), job.slack, job.quota))
        for x, c in count.items():
            if c > 1:
                shared += 1
                same += len(where[x]) == 1
    return got, same / max(shared, 1), snapshots


def test_exactly_once_and_equal_rows_per_rank():
    got, _, _ = run_epochs(JOBS)
    for name, (ids, nodes, bs) in JOBS.items():
        w = len(nodes)
        quota = len(ids) // (bs * w) * bs
        for epoch, per_rank in got[name].items():
            parts = [np.concatenate(per_rank[r]) for r in range(w)]
            dropped = np.concatenate(per_rank[DROPPED])
            everything = np.concatenate([*parts, dropped])
            assert np.sort(everything).tolist() == list(ids), (name, epoch)  # exactly once
            assert [p.size for p in parts] == [quota] * w, (name, epoch)
            assert dropped.size == len(ids) % (bs * w)


def test_dropped_rows_are_the_last_of_the_epoch():
    # the remainder is cut like DistributedSampler(drop_last=True): the last rows sampled
    got, _, _ = run_epochs({"a": (range(1000), ["n0", "n1"], 64)}, epochs=1, round_rows=100)
    rounds = got["a"][0][DROPPED]
    sizes = [r.size for r in rounds]
    assert sum(sizes) == 1000 % 128
    first = next(i for i, s in enumerate(sizes) if s)
    assert all(s == 100 for s in sizes[first + 1 :]), sizes  # once dropping, all dropped


def test_ranks_stay_within_slack_during_the_epoch():
    _, _, snapshots = run_epochs(JOBS, round_rows=300)
    for name, placed, counts, slack, quota in snapshots:
        w = counts.size
        mean = placed / w
        assert counts.sum() == placed
        assert counts.max() <= quota
        assert np.abs(counts - mean).max() < slack + w - 1 + 1e-9, (name, counts)


def test_shared_rows_go_to_one_node_far_more_than_random():
    _, rate, _ = run_epochs(JOBS)
    _, control, _ = run_epochs(JOBS, control=True)
    assert rate > 0.95
    assert control < 0.5
    assert rate > control + 0.4


def test_tight_slack_still_places_most_shared_rows_together():
    _, rate, snapshots = run_epochs(JOBS, slack=4)
    assert rate > 0.8
    for _, placed, counts, _, _ in snapshots:
        assert np.abs(counts - placed / counts.size).max() < 4 + counts.size


def test_common_node_wins_for_every_job():
    # a and b share only n1: every row both sampled goes to n1 for both
    rows = np.arange(500)
    _, prefs = preferred_nodes({"a": rows, "b": rows}, {"a": ["n0", "n1"], "b": ["n1", "n2"]})
    # columns are the job's sorted nodes: a -> [n0, n1], b -> [n1, n2]
    assert (prefs["a"].argmax(axis=1) == 1).all()
    assert (prefs["b"].argmax(axis=1) == 0).all()


def test_unshared_rows_spread_evenly_over_nodes():
    rows = np.arange(20000)
    _, prefs = preferred_nodes({"a": rows}, {"a": ["n0", "n1", "n2", "n3"]})
    share = np.bincount(prefs["a"].argmax(axis=1), minlength=4) / rows.size
    assert np.abs(share - 0.25).max() < 0.02


def test_placement_is_stable_across_placers():
    rows = {"a": np.arange(300), "b": np.arange(100, 400)}
    out = []
    for _ in range(2):
        p = Placer()
        p.add_job("a", size=300, nodes=["x", "y"], spec=batches_of(10))
        p.add_job("b", size=300, nodes=["y", "x", "x"], spec=batches_of(10))
        out.append(p.place(rows))
    assert all((out[0][n] == out[1][n]).all() for n in rows)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    worlds=st.lists(
        st.lists(st.sampled_from(["n0", "n1", "n2"]), min_size=1, max_size=4),
        min_size=4,
        max_size=4,
    ),
    batch=st.integers(1, 40),
    round_rows=st.integers(1, 120),
    seed=st.integers(0, 2**16),
)
def test_property_exactly_once_equal_ranks(sizes, worlds, batch, round_rows, seed):
    jobs = {
        f"j{i}": (range(i * 50, i * 50 + size), worlds[i], batch) for i, size in enumerate(sizes)
    }
    got, _, _ = run_epochs(jobs, epochs=2, round_rows=round_rows, seed=seed)
    for name, (ids, nodes, bs) in jobs.items():
        w = len(nodes)
        quota = len(ids) if w == 1 else len(ids) // (bs * w) * bs
        for per_rank in got[name].values():
            parts = [np.concatenate(per_rank[r]) for r in range(w)]
            everything = np.concatenate([*parts, *per_rank[DROPPED]])
            assert np.sort(everything).tolist() == list(ids)
            assert [p.size for p in parts] == [quota] * w


def test_errors():
    p = Placer()
    with pytest.raises(SamplingError, match="no ranks"):
        p.add_job("a", size=3, nodes=[], spec=batches_of(1))
    with pytest.raises(OptionError, match="batch_size"):  # the spec refuses it, before
        p.add_job("a", size=3, nodes=["n"], spec=batches_of(0))
    with pytest.raises(SamplingError, match=r"size \(0\) must be >= 1"):
        p.add_job("a", size=0, nodes=["n"], spec=batches_of(1))
    with pytest.raises(SamplingError, match="drop_last = false"):
        p.add_job("a", size=3, nodes=["n"], spec=JobSpec({"batch_size": 1, "drop_last": False}))
    with pytest.raises(SamplingError, match="2 rank counts for 1 ranks"):
        p.add_job("a", size=3, nodes=["n"], spec=batches_of(1), counts=[0, 0])
    p.add_job("a", size=3, nodes=["n"], spec=batches_of(1))
    with pytest.raises(SamplingError, match="Unknown job 'b'"):
        p.place({"b": np.arange(2)})
    with pytest.raises(SamplingError, match="3 rows left in its epoch"):
        p.place({"a": np.arange(4)})
