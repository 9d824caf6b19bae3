from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
from pyroaring import BitMap

from tabloader.catalog._errors import OptionError, SamplingError
from tabloader.catalog._options import JobSpec
from tabloader.cluster._actor import _decode, state_json
from tabloader.cluster._leader import Leader
from tests.support.jobs import catalog_job

# name -> (ids, node of each rank, batch size, dataset)
JOBS = {
    "a": (range(0, 900), ["n0", "n1"], 16, "imgs@1"),
    "b": (range(300, 1100), ["n1", "n0"], 16, "imgs@1"),
    "c": (range(0, 500), ["n0", "n0", "n1"], 8, "imgs@1"),
    "t": (range(0, 400), ["n1"], 10, "text@1"),
}


def spec(batch_size):
    """The wire form of a job spec of ``batch_size`` rows per batch (what a node sends)."""
    return JobSpec({"batch_size": batch_size}).to_wire()


def make_leader(**kw):
    leader = Leader(seed=3, **kw)
    for name, (ids, nodes, bs, ds) in JOBS.items():
        leader.add_job(catalog_job(name, ids, dataset=ds, batch_size=bs), nodes=nodes)
    return leader


def job_status(leader, name):
    """``name``'s entry of the leader's ``status()``."""
    (found,) = [j for j in leader.status()["jobs"] if j["job"] == name]
    return found


class Nodes:
    """Each node's loader: fetches its lists and acknowledges them ``lag`` lists late.

    ``delivered[job][epoch][rank]``: rows of acknowledged lists, the rows the ranks read."""

    def __init__(self, rng, lag=3):
        self.rng = rng
        self.lag = lag
        self.held = {}
        self.delivered = {}

    def poll(self, leader, node):
        held = self.held.setdefault(node, [])
        held.extend(leader.work(node))
        n = len(held) - int(self.rng.integers(0, self.lag + 1))
        if n > 0:
            done, self.held[node] = held[:n], held[n:]
            leader.ack(node, done[-1].seq)
            for w in done:
                for a in w.items:
                    per = self.delivered.setdefault(a.job, {}).setdefault(a.epoch, {})
                    per.setdefault(a.rank, []).append(a.rows)
                    assert job_status(leader, a.job)["ranks"][a.rank] == node


def complete_epochs(delivered, name, ids, nodes, bs):
    """The epochs of ``name`` with all their rows delivered; asserts exactly once and equal
    rows per rank for each."""
    w = len(nodes)
    quota = len(ids) if w == 1 else len(ids) // (bs * w) * bs
    done = []
    for epoch, per_rank in delivered.get(name, {}).items():
        parts = [np.concatenate(per_rank.get(r, [np.zeros(0, np.int64)])) for r in range(w)]
        rows = np.concatenate(parts)
        assert np.unique(rows).size == rows.size, (name, epoch)  # never twice
        assert set(rows.tolist()) <= set(ids)
        if rows.size == quota * w:
            assert [p.size for p in parts] == [quota] * w, (name, epoch)
            done.append(epoch)
    return sorted(done)


def test_work_lists_cover_each_epoch_exactly_once():
    leader = make_leader(lookahead=200, round_rows=64)
    nodes = Nodes(np.random.default_rng(0))
    for _ in range(60):
        for node in ("n0", "n1"):
            nodes.poll(leader, node)
    for name, (ids, ranks, bs, _) in JOBS.items():
        assert complete_epochs(nodes.delivered, name, ids, ranks, bs)[:2] == [0, 1], name


def test_lookahead_bounds_rows_not_acknowledged():
    leader = make_leader(lookahead=100, round_rows=30)
    leader.work("n0")
    leader.work("n1")
    for name in JOBS:
        assert 100 <= job_status(leader, name)["outstanding"] < 130
    assert not leader.step()  # nobody below its lookahead until nodes acknowledge


def test_rows_carry_increasing_rounds_for_eviction():
    leader = make_leader(lookahead=100, round_rows=30)
    lists = leader.work("n0")
    rounds = np.concatenate([a.rounds for w in lists for a in w.items if a.job == "a"])
    assert (np.diff(rounds) > 0).all()
    assert [w.seq for w in lists] == sorted({w.seq for w in lists})


@pytest.mark.parametrize("stop_after", [7, 23, 41])
def test_restored_leader_resumes_every_job_exactly_once(stop_after):
    rng = np.random.default_rng(stop_after)
    leader = make_leader(lookahead=150, round_rows=50)
    nodes = Nodes(rng, lag=4)
    for _ in range(stop_after):
        for node in ("n0", "n1"):
            nodes.poll(leader, node)
    state = pickle.loads(pickle.dumps(leader.state_dict()))
    # the leader dies: the loaders drop what they had not acknowledged
    restored = Leader.from_state_dict(state)
    assert restored.generation == leader.generation + 1
    nodes.held.clear()
    for _ in range(60):
        for node in ("n0", "n1"):
            nodes.poll(restored, node)
    for name, (ids, ranks, bs, _) in JOBS.items():
        done = complete_epochs(nodes.delivered, name, ids, ranks, bs)
        assert done[: len(done)] == list(range(len(done))), (name, done)
        assert len(done) >= 2, (name, done)


def test_state_lists_the_epochs_owed():
    leader = Leader(seed=0, lookahead=40, round_rows=20)
    leader.add_job(catalog_job("a", range(30), batch_size=5), nodes=["n0", "n1"])
    lists = leader.work("n0") + leader.work("n1")  # 30 rows of epoch 0, 10 of epoch 1
    state = leader.state_dict()["jobs"][0]
    owed = [(p["epoch"], len(BitMap.deserialize(p["remaining"]))) for p in state["epochs"]]
    assert owed == [(0, 30), (1, 30)]  # nothing acknowledged: everything still owed
    for w in lists:
        leader.ack(w.node, w.seq)
    state = leader.state_dict()["jobs"][0]
    epochs = {p["epoch"]: p for p in state["epochs"]}
    assert list(epochs) == [1]
    assert len(BitMap.deserialize(epochs[1]["remaining"])) == 20
    assert sum(epochs[1]["counts"]) == 10


def test_remove_job_keeps_the_others():
    leader = make_leader(lookahead=100, round_rows=30)
    leader.work("n0")
    leader.remove_job("b")
    assert leader.jobs() == ["a", "c", "t"]
    assert all(a.job != "b" for w in leader.work("n1") for a in w.items)
    assert "b" not in {j["name"] for j in leader.state_dict()["jobs"]}


def test_a_catalog_job_carries_its_rows_dataset_and_spec(cat):
    import pyarrow as pa

    cat.import_arrow("tbl", pa.table({"x": list(range(20))}))
    cat.register_job("j", "tbl", where="x < 12")
    leader = Leader(lookahead=50)
    job = cat.job("j")
    leader.add_job(job, nodes=["n0", "n1"], spec=JobSpec.from_options(job.options, batch_size=3))
    lists = leader.work("n0") + leader.work("n1")
    rows = np.concatenate([a.rows for w in lists for a in w.items if a.epoch == 0])
    assert sorted(rows.tolist()) == list(range(12))


def test_errors():
    leader = Leader()
    leader.add_job(catalog_job("a", range(5), batch_size=1), nodes=["n0"])
    with pytest.raises(SamplingError, match="already on the leader"):
        leader.add_job(catalog_job("a", range(5), batch_size=1), nodes=["n0"])
    with pytest.raises(SamplingError, match="no ranks"):
        leader.add_job(catalog_job("b", range(5), batch_size=1), nodes=[])
    padded = JobSpec({"batch_size": 2, "drop_last": False})
    with pytest.raises(SamplingError, match=r"drop_last = false \(padded epochs\) is not supp"):
        leader.add_job(catalog_job("p", range(5)), nodes=["n0", "n1"], spec=padded)
    assert "p" not in leader.jobs()
    leader.add_job(catalog_job("p", range(5), batch_size=2), nodes=["n0", "n1"])  # not half-added
    with pytest.raises(SamplingError, match="No job has a rank on node 'n9'"):
        leader.work("n9")
    with pytest.raises(SamplingError, match="Unknown job 'zz'"):
        leader.epoch("zz")
    with pytest.raises(SamplingError, match="Not a Leader state"):
        Leader.from_state_dict({"kind": "dependent"})
    with pytest.raises(SamplingError, match="lookahead"):
        Leader(lookahead=0)


def test_job_starts_when_every_rank_joined():
    leader = Leader(seed=0, lookahead=40, round_rows=20)
    ids = BitMap(range(40))
    assert not leader.join(catalog_job("a", ids), rank=1, world_size=2, node="n1", spec=spec(5))
    assert leader.jobs() == []
    assert leader.status()["pending"] == {"a": 1}
    assert leader.poll("n1") == ([], {})  # no rows before every rank joined
    assert leader.join(catalog_job("a", ids), rank=0, world_size=2, node="n0", spec=spec(5))
    assert job_status(leader, "a")["ranks"] == ["n0", "n1"]
    lists, gone = leader.poll("n1", stats={"decodes": 3})
    assert gone == {}
    assert {a.rank for w in lists for a in w.items} == {1}
    assert leader.status()["nodes"] == {"n1": {"decodes": 3}}
    with pytest.raises(SamplingError, match="runs on the cluster already"):
        leader.join(catalog_job("a", ids), rank=0, world_size=2, node="n0", spec=spec(5))
    leader.join(catalog_job("b", ids), rank=0, world_size=2, node="n0", spec=spec(5))
    with pytest.raises(SamplingError, match="the same way"):
        leader.join(catalog_job("b", ids), rank=1, world_size=3, node="n0", spec=spec(5))
    with pytest.raises(SamplingError, match="joined already or is out of range"):
        leader.join(catalog_job("b", ids), rank=0, world_size=2, node="n0", spec=spec(5))
    other = JobSpec({"batch_size": 5, "on_error": "skip"}).to_wire()
    with pytest.raises(
        SamplingError, match=r"Rank 1 of job 'b' joined with on_error='skip' \(others: 'raise'\)"
    ):
        leader.join(catalog_job("b", ids), rank=1, world_size=2, node="n1", spec=other)
    with pytest.raises(OptionError, match="A job spec of version 0; this tabloader reads"):
        leader.join(
            catalog_job("b", ids), rank=1, world_size=2, node="n1", spec={**spec(5), "v": 0}
        )
    assert leader.join(catalog_job("b", ids), rank=1, world_size=2, node="n1", spec=spec(5))


def test_failed_rank_takes_its_job_off_and_is_listed_gone():
    leader = make_leader(lookahead=100, round_rows=30)
    leader.leave("a", rank=1, failed=True, reason="rank 1 died")
    assert "a" not in leader.jobs()
    lists, gone = leader.poll("n0")
    assert gone == {"a": "rank 1 died"}
    assert all(a.job != "a" for w in lists for a in w.items)
    # a job that joins again under that name is no longer gone
    leader.join(catalog_job("a", BitMap(range(8))), rank=0, world_size=1, node="n0", spec=spec(4))
    assert leader.poll("n0")[1] == {}


def test_ranks_leaving_normally_end_the_job_with_the_last():
    leader = make_leader(lookahead=100, round_rows=30)
    leader.leave("c", rank=0)
    leader.leave("c", rank=2)
    assert "c" in leader.jobs()
    leader.leave("c", rank=1)
    assert "c" not in leader.jobs()
    assert leader.poll("n0")[1] == {}
    leader.leave("nope", rank=0)  # a job that ended already: nothing to do


def test_node_leaving_takes_only_its_jobs():
    leader = make_leader(lookahead=100, round_rows=30)
    leader.add_job(catalog_job("solo", range(50), batch_size=5), nodes=["n2"])
    assert sorted(leader.remove_node("n2")) == ["solo"]
    assert leader.jobs() == ["a", "b", "c", "t"]
    lists, gone = leader.poll("n0")
    assert gone == {"solo": "node n2 left the cluster"}
    assert sum(w.num_rows for w in lists) > 0  # the others go on


def test_acked_counts_per_rank_survive_a_restore():
    leader = make_leader(lookahead=100, round_rows=30)
    lists = leader.work("n0")
    leader.ack("n0", lists[-1].seq)
    counts = leader.acked("n0")
    expect: dict = {}
    for w in lists:
        for a in w.items:
            key = (a.job, a.rank, a.epoch)
            expect[key] = expect.get(key, 0) + a.rows.size
    assert {k: v for k, v in counts.items() if v} == expect
    leader.leave("c", rank=0)
    restored = Leader.from_state_dict(pickle.loads(pickle.dumps(leader.state_dict())))
    assert {k: v for k, v in restored.acked("n0").items() if v} == expect
    assert [j["left"] for j in restored.status()["jobs"] if j["job"] == "c"] == [[0]]


def test_no_rows_sampled_past_a_jobs_last_epoch():
    leader = Leader(seed=0, lookahead=1000, round_rows=16)
    ids = BitMap(range(40))
    leader.join(catalog_job("a", ids), rank=0, world_size=1, node="n0", spec=spec(4), epochs=2)
    lists, _ = leader.poll("n0")
    epochs = [a.epoch for w in lists for a in w.items]
    assert sorted(set(epochs)) == [0, 1]
    assert sum(w.num_rows for w in lists) == 80
    restored = Leader.from_state_dict(leader.state_dict())
    assert job_status(restored, "a")["last_epoch"] == 1


def test_an_importance_job_takes_reports_on_the_leader_and_keeps_its_spec_on_restore():
    """A rank's report reaches the leader's sampler of the job; the job's options survive a
    restore (so the restored leader still takes reports); a plain job's are refused."""
    leader = make_leader()
    imp = JobSpec({"batch_size": 4, "importance": "loss"}).to_wire()
    rows = BitMap(range(2000, 2040))
    assert leader.join(
        catalog_job("imp", rows, dataset="x"), rank=0, world_size=1, node="n0", spec=imp
    )
    leader.report("imp", np.array([2001, 2005, 2003]), np.array([0.5, 0.1, 0.9]))
    scores = leader._samplers["x@0"].importance_scores("imp")
    got = dict(zip(scores.ids.tolist(), scores.ranks.tolist(), strict=True))
    assert (got[2005], got[2001], got[2003]) == (1, 2, 3)  # lowest loss: rank 0, stored + 1
    assert sum(v > 0 for v in got.values()) == 3
    with pytest.raises(SamplingError, match=r"register it WITH \(importance = 'loss'\)"):
        leader.report("a", np.array([1]), np.array([0.5]))
    with pytest.raises(SamplingError, match="not rows of this job"):
        leader.report("imp", np.array([1]), np.array([0.5]))
    restored = Leader.from_state_dict(_decode(json.loads(state_json(leader))))
    again = restored._samplers["x@0"].importance_scores("imp")
    np.testing.assert_array_equal(again.ranks, scores.ranks)  # the checkpoint keeps them
    restored.report("imp", np.array([2002]), np.array([1.0]))  # and it takes reports
    assert again.ranks[2] == 1


# -- weighted jobs (issue 39) ------------------------------------------------------------------
WIDS = np.arange(60)
WEIGHTS = 1.0 + WIDS % 4  # rows weigh 1 to 4: a leader drawing uniformly is far off


def weighted_leader(seed):
    """A weighted job with replacement on two nodes, one without on ``n0``, and a plain job
    sharing their rows."""
    leader = Leader(seed=seed, lookahead=60, round_rows=20)
    with_r = JobSpec({"batch_size": 5, "weight": "w"})
    leader.add_job(catalog_job("w", WIDS, weights=WEIGHTS), nodes=["n0", "n1"], spec=with_r)
    without = JobSpec({"batch_size": 5, "weight": "w", "replacement": False})
    leader.add_job(catalog_job("o", WIDS, weights=WEIGHTS), nodes=["n0"], spec=without)
    leader.add_job(catalog_job("p", WIDS, batch_size=5), nodes=["n1"])
    return leader


def run(leader, nodes, polls):
    """``polls`` rounds of both nodes polling ``leader``; the lists they fetched, in order."""
    fetched = []
    for _ in range(polls):
        for node in ("n0", "n1"):
            held = len(nodes.held.get(node, []))
            nodes.poll(leader, node)
            fetched += nodes.held.get(node, [])[held:]
    return fetched


def draws_of(delivered, name):
    """Per epoch, the rows each rank of ``name`` got (concatenated over its lists)."""
    return {
        e: {r: np.concatenate(parts) for r, parts in per.items()}
        for e, per in delivered.get(name, {}).items()
    }


def check_weighted_items(lists_or_items):
    """Every assignment carries ``_weight``s: ``1 / (N q_row)`` with replacement (computed
    here from the weights, not asked of the sampler), 1 without, none for the plain job."""
    q = WEIGHTS / WEIGHTS.sum()
    for a in lists_or_items:
        if a.job == "w":
            np.testing.assert_allclose(a.weights, 1.0 / (60 * q[a.rows]), rtol=1e-6)
        elif a.job == "o":
            np.testing.assert_array_equal(a.weights, np.ones(a.rows.size, np.float32))
        else:
            assert a.weights is None


def chi_square_p(rows):
    """Pearson's chi-square p-value of the draws against the weights (Wilson-Hilferty's
    normal approximation: SciPy is no test dependency)."""
    counts = np.bincount(rows, minlength=60)
    expected = counts.sum() * WEIGHTS / WEIGHTS.sum()
    stat, dof = float(((counts - expected) ** 2 / expected).sum()), counts.size - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_a_weighted_job_draws_by_its_weights_and_its_rows_carry_their_weight():
    leader = weighted_leader(seed=4)
    nodes = Nodes(np.random.default_rng(1), lag=2)
    fetched = run(leader, nodes, 40)
    check_weighted_items([a for w in fetched for a in w.items])
    draws = draws_of(nodes.delivered, "w")
    full = [e for e, per in draws.items() if sum(r.size for r in per.values()) == 60]
    assert len(full) >= 15
    for e in full:  # an epoch is 60 draws, 30 per rank
        assert sorted(r.size for r in draws[e].values()) == [30, 30]
    rows = np.concatenate([r for e in full for r in draws[e].values()])
    assert np.unique(rows).size < rows.size  # with replacement: rows repeat
    assert chi_square_p(rows) > 1e-3  # uniform draws: p ~ 1e-40 here
    assert len(complete_epochs(nodes.delivered, "o", WIDS, ["n0"], 5)) >= 15  # rows once
    assert len(complete_epochs(nodes.delivered, "p", WIDS, ["n1"], 5)) >= 15


@pytest.mark.parametrize("stop_after", [3, 8])
def test_a_restored_leader_owes_a_weighted_jobs_draws_and_keeps_drawing_by_its_weights(
    stop_after,
):
    """Checkpointed mid-epoch (through the actor's JSON), a leader owes the job with
    replacement exactly the draws not acknowledged (60 an epoch, 30 a rank), still draws them
    by the weights with their ``_weight``s; the job without still reads each row once."""
    leader = weighted_leader(seed=stop_after)
    nodes = Nodes(np.random.default_rng(stop_after), lag=3)
    run(leader, nodes, stop_after)
    before = {
        e: sum(r.size for r in per.values()) for e, per in draws_of(nodes.delivered, "w").items()
    }
    assert any(0 < n < 60 for n in before.values())  # stopped mid-epoch
    restored = Leader.from_state_dict(_decode(json.loads(state_json(leader))))
    nodes.held.clear()  # the loaders drop what they had not acknowledged
    fetched = run(restored, nodes, 40)
    check_weighted_items([a for w in fetched for a in w.items])
    draws = draws_of(nodes.delivered, "w")
    last = max(draws)  # that epoch and the one before may miss lists held by a node
    assert all(r.size <= 30 for per in draws.values() for r in per.values())
    for e in range(last - 1):  # the others: exactly their draws, never more
        assert sorted(r.size for r in draws[e].values()) == [30, 30], e
    after = [a.rows for w in fetched for a in w.items if a.job == "w"]
    assert chi_square_p(np.concatenate(after)) > 1e-3
    done = complete_epochs(nodes.delivered, "o", WIDS, ["n0"], 5)
    assert done == list(range(len(done)))
    assert len(done) >= 10


def test_rows_of_an_importance_job_carry_the_weights_of_the_distribution_they_came_from():
    """An epoch starts from the scores the ranks reported before it: its rows' ``_weight`` is
    ``1 / (N p_row)`` for ``p`` the scores' probabilities then (1 for the prior's epoch)."""
    leader = Leader(seed=0, lookahead=40, round_rows=40)
    imp = JobSpec({"batch_size": 4, "importance": "loss"}).to_wire()
    ids = np.arange(100, 140)
    leader.join(catalog_job("imp", BitMap(ids)), rank=0, world_size=1, node="n0", spec=imp)
    (first,) = leader.work("n0")
    np.testing.assert_array_equal(first.items[0].weights, np.ones(40, np.float32))
    leader.ack("n0", first.seq)
    leader.report("imp", ids[:8], np.arange(8.0))
    leader.report("imp", ids[8:16], np.arange(8.0)[::-1])
    p = leader._samplers["imgs@1"].importance_scores("imp").probabilities().copy()
    (second,) = leader.work("n0")
    (a,) = second.items
    assert a.epoch == 1
    want = 1.0 / (40 * p[a.rows - 100])
    assert np.ptp(want) > 0.1  # the reports changed the distribution
    np.testing.assert_allclose(a.weights, want, rtol=1e-6)


def test_ranks_joining_with_other_weights_are_refused():
    leader = Leader(seed=0)
    ws = JobSpec({"batch_size": 5, "weight": "w"}).to_wire()
    ids = BitMap(range(10))
    leader.join(
        catalog_job("w", ids, weights=np.ones(10)), rank=0, world_size=2, node="n0", spec=ws
    )
    with pytest.raises(SamplingError, match="Rank 1 of job 'w' joined with other row weights"):
        leader.join(
            catalog_job("w", ids, weights=np.ones(10) * 2), rank=1, world_size=2, node="n1", spec=ws
        )
    with pytest.raises(SamplingError, match="Rank 1 of job 'w' joined with other row weights"):
        leader.join(catalog_job("w", ids), rank=1, world_size=2, node="n1", spec=ws)
    assert leader.join(
        catalog_job("w", ids, weights=np.ones(10)), rank=1, world_size=2, node="n1", spec=ws
    )
    with pytest.raises(SamplingError, match=r"weights of job 'v' .* all zero"):
        leader.join(
            catalog_job("v", ids, weights=np.zeros(10)), rank=0, world_size=1, node="n0", spec=ws
        )
