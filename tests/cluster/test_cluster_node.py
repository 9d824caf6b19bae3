"""A node's engine fed by a leader, without Ray: fed jobs, their errors, catalog snapshots."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from pyroaring import BitMap

from tabloader import catalog
from tabloader.catalog._errors import CatalogLockedError, LoaderError, ServiceError
from tabloader.catalog._options import JobSpec
from tabloader.cluster import _node as node
from tabloader.cluster._leader import Leader
from tabloader.engine import Loader
from tabloader.engine._queue.sources import Fed
from tests.support.jobs import catalog_job


def spec(batch_size):
    """The wire form of a job spec of ``batch_size`` rows per batch (what a node sends)."""
    return JobSpec({"batch_size": batch_size}).to_wire()


@pytest.fixture
def loader(cat):
    cat.import_arrow("t", pa.table({"x": np.arange(50) * 10}))
    cat.register_job("j", "t", where="x < 300")  # 30 rows
    with Loader(cat, workers=2, decode="threads") as eng:
        yield eng


def fed(loader, *, rank=0, world_size=1, epochs=None, batch_size=4):
    stream = loader.serve(
        "j",
        source=Fed,
        receiver=loader.collate,
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        epochs=epochs,
    )
    return stream, stream.rank_state.job


def test_a_fed_rank_reads_what_the_leader_sends_epoch_by_epoch(loader):
    """The leader's lists for one rank: each epoch exactly its rows, in the leader's order,
    in batches (the last short with one rank), and nothing past ``epochs``."""
    stream, job = fed(loader, epochs=2)
    leader = Leader(seed=1, lookahead=1000, round_rows=7)
    j = loader.catalog.job("j")
    leader.join(j, rank=0, world_size=1, node="n", spec=spec(4), epochs=3)
    lists, _ = leader.poll("n")
    sent: dict[int, list[int]] = {}
    for w in lists:
        for a in w.items:
            stream.feed(a.epoch, a.rows, a.rounds)
            sent.setdefault(a.epoch, []).extend(a.rows.tolist())
    assert sorted(sent) == [0, 1, 2]  # the leader sent three epochs; the job reads two
    for epoch in (0, 1):
        batches = [b["_id"].tolist() for b in stream.iter_epoch()]
        assert [i for b in batches for i in b] == sent[epoch]
        assert [len(b) for b in batches] == [4] * 7 + [2]
    assert stream.take() is None  # its epochs are read: rows of epoch 2 were never queued
    assert job.queue.q_rows.size == 0


def test_data_parallel_ranks_read_whole_batches_of_their_quota(loader):
    stream, job = fed(loader, rank=1, world_size=2)
    assert stream.name == "j[rank 1]"
    assert job.source.rank_rows == 30 // (4 * 2) * 4  # 12: the remainder of the epoch is dropped
    stream.feed(0, np.arange(12, dtype=np.int64), np.arange(12, dtype=np.int64))
    assert [len(b["_id"]) for b in stream.iter_epoch()] == [4, 4, 4]


def test_feed_refuses_what_the_leader_and_node_disagree_on(loader):
    stream, _ = fed(loader)
    rows = np.arange(20, dtype=np.int64)
    stream.feed(0, rows, rows)
    with pytest.raises(LoaderError, match="got rows of epoch 1 .* while epoch 0 misses 10 rows"):
        stream.feed(1, rows, rows)
    with pytest.raises(LoaderError, match="got 20 rows of epoch 0 .* 10 more than its 30"):
        stream.feed(0, rows, rows)


def test_a_gone_job_raises_once_its_rank_would_wait(loader):
    stream, _ = fed(loader)
    rows = np.arange(8, dtype=np.int64)
    stream.feed(0, rows, rows)
    stream.fail("rank 1 (pid 7, node abc) died mid-run")
    assert len(stream.take()["_id"]) == 4  # the batches it has are still delivered
    assert len(stream.take()["_id"]) == 4
    with pytest.raises(LoaderError, match=r"left the cluster: rank 1 \(pid 7.*start every rank"):
        stream.take()


def test_fed_jobs_have_no_local_state(loader):
    with pytest.raises(LoaderError, match="leader keeps each job's progress"):
        loader.serve("j", source=Fed, state={"job": "j", "epoch": 0, "remaining": b""})
    stream, _ = fed(loader)
    with pytest.raises(LoaderError, match="whose leader keeps the job's progress"):
        stream.state_dict()


def test_snapshot_catalog_reads_again_only_after_a_change(tmp_path):
    root = tmp_path / "cat"
    with catalog.open_catalog(root, create=True) as cat:
        cat.import_arrow("t", pa.table({"x": list(range(10))}))
        cat.register_job("j", "t", where="x < 5")
    snap = node.SnapshotCatalog(root)
    assert snap.exists
    assert len(snap.job("j").ids) == 5
    assert snap.job("j") is snap.job("j")  # cached while the catalog is unchanged
    with catalog.open_catalog(root) as cat:
        cat.register_job("j", "t", where="x < 8", replace=True)
    assert len(snap.job("j").ids) == 8
    assert snap.dataset("t").num_rows == 10


def test_snapshot_catalog_runs_statements_and_uncached_reads_on_the_catalog(tmp_path):
    root = tmp_path / "cat"
    with catalog.open_catalog(root, create=True) as cat:
        cat.import_arrow("t", pa.table({"x": list(range(10))}))
    snap = node.SnapshotCatalog(root)
    assert snap.dataset_names() == ["t"]
    snap.sql("REGISTER JOB j SELECT x FROM t WHERE x > 6")  # a write: the catalog's
    assert [i.num_rows for i in snap.job_infos()] == [3]
    assert snap.column("t", "x", rows=3).to_pylist() == [0, 1, 2]
    assert snap.query("SELECT count(*) AS n FROM t").to_pydict() == {"n": [10]}
    snap.drop_dataset("t", cascade=True)
    assert snap.dataset_names() == []  # read again: the catalog changed


def test_snapshot_catalog_waits_for_the_catalog_then_says_who_holds_it(tmp_path, monkeypatch):
    monkeypatch.setattr(node, "LOCK_WAIT_S", 0.2)
    with catalog.open_catalog(tmp_path / "cat", create=True), pytest.raises(CatalogLockedError):
        node.SnapshotCatalog(tmp_path / "cat")


def test_a_rank_on_a_node_without_loader_is_told_how_to_start_one(tmp_path, monkeypatch):
    from tabloader.service import _client as client
    from tabloader.service import _plugins as plugins

    class InAWorker(node.RayNodes):  # a Ray worker of a cluster that serves the catalog
        def node(self, root):
            return "0123456789abcdef0123"

    monkeypatch.setattr(client, "START_TIMEOUT_S", 0.2)
    previous = plugins.locator()
    assert previous is not None  # importing tabloader registers the Ray one
    plugins.set_locator(InAWorker())
    try:
        with pytest.raises(
            ServiceError, match=r"No tabloader loader runs on this Ray node .*serve --ray"
        ):
            client.RemoteLoader(tmp_path)
    finally:
        plugins.set_locator(previous)


def test_no_ray_no_cluster(tmp_path):
    """A process that never imported Ray is never a cluster rank (and Ray is not imported): the
    locator that ``import tabloader`` registers for the service's clients says so."""
    import subprocess
    import sys

    code = (
        "import sys, pathlib, tabloader; from tabloader.service._plugins import locator; "
        f"print(type(locator()).__name__, locator().node(pathlib.Path({str(tmp_path)!r})), "
        "'ray' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["_RayLocator", "None", "False"]
    # nor is the cluster layer (35 ms of every job process's start)
    assert (
        "tabloader.cluster"
        not in subprocess.run(
            [sys.executable, "-c", "import sys, tabloader; print(list(sys.modules))"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    )


def test_leader_lookahead_is_bounded_for_every_node():
    leader = Leader(seed=0, lookahead=20, round_rows=5)
    ids = BitMap(range(100))
    leader.join(catalog_job("j", ids), rank=0, world_size=1, node="n", spec=spec(5))
    lists, _ = leader.poll("n")
    assert sum(w.num_rows for w in lists) == 20  # no more until the node acknowledges
    leader.ack("n", lists[-1].seq)
    assert sum(w.num_rows for w in leader.poll("n")[0]) == 20


def test_a_poll_answered_before_a_rank_joined_does_not_fail_it(loader, monkeypatch):
    """A job gone from an earlier run is started again: the feed's poll that the leader
    answered before the new rank's join lists it as gone; that stale answer must not fail the
    new rank (the next poll, after the join, is the one that counts)."""
    import threading

    import ray

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)  # calls run in place
    gone = {"j": "the loader of node n died and restarted"}
    first, second, joined = threading.Event(), threading.Event(), threading.Event()

    def poll(node, stats=None):
        answer = dict(gone)
        if first.is_set():
            second.set()  # the feed thread handled the first answer before asking again
        else:
            first.set()
            assert joined.wait(10)  # the join is answered while this poll's answer travels
        return [], answer

    def join(job, **kwargs):
        gone.pop(job.name, None)
        return True

    leader = SimpleNamespace(
        poll=SimpleNamespace(remote=poll),
        join=SimpleNamespace(remote=join),
        leave=SimpleNamespace(remote=lambda *a, **k: None),
    )
    stream, job = fed(loader)
    feed = node.NodeFeed(leader, "n", stats=dict)
    try:
        assert first.wait(10)
        feed.join(stream, loader.catalog.job("j"), rank=0, world_size=1)
        joined.set()
        assert second.wait(10)
        assert job.source.gone is None, job.source.gone
    finally:
        feed.close()
        stream.close()


def test_a_report_goes_to_the_leader_and_its_error_comes_back(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)  # calls run in place
    got = []

    def report(job, ids, losses):
        if job == "plain":
            raise TimeoutError("no answer")
        got.append((job, ids.tolist(), losses.tolist()))

    leader = SimpleNamespace(
        poll=SimpleNamespace(remote=lambda node, stats=None: ([], {})),
        report=SimpleNamespace(remote=report),
    )
    feed = node.NodeFeed(leader, "n", stats=dict)
    try:
        feed.report("j", np.array([3, 1]), np.array([0.5, 0.25]))
        assert got == [("j", [3, 1], [0.5, 0.25])]
        with pytest.raises(LoaderError, match="the cluster leader did not take the losses"):
            feed.report("plain", np.array([3]), np.array([0.5]))
    finally:
        feed.close()


def weighted_fed(cat, loader, **options):
    """A job of the loader's table weighted by ``x + 10``, opened fed, and its catalog job."""
    cat.register_job("w", "t", where="x < 300", options={"weight": "x + 10", **options})
    info = cat.job("w")
    return loader.serve("w", source=Fed, receiver=loader.collate, batch_size=4, epochs=2), info


def test_a_fed_weighted_jobs_batches_carry_the_weights_the_leader_drew_by(cat, loader):
    """No refusal on a cluster any more: the leader gets the job's stored weights with the
    join, draws by them, and the node's batches carry each row's ``_weight`` as a local job's
    do: ``1 / (N q_row)`` for the weights' distribution ``q``."""
    stream, info = weighted_fed(cat, loader)
    leader = Leader(seed=5, lookahead=1000, round_rows=7)
    wire = stream.spec.to_wire()
    leader.join(info, rank=0, world_size=1, node="n", spec=wire)
    lists, _ = leader.poll("n")
    sent: dict[int, list] = {}
    for w in lists:
        for a in w.items:
            stream.feed(a.epoch, a.rows, a.rounds, a.weights)
            sent.setdefault(a.epoch, []).append(a.rows)
    q = info.weights / info.weights.sum()
    want = 1.0 / (30 * q)  # indexed by row id: the job's ids are 0..29
    for epoch in (0, 1):
        batches = list(stream.iter_epoch())
        ids = np.concatenate([np.asarray(b["_id"]) for b in batches])
        weights = np.concatenate([np.asarray(b["_weight"]) for b in batches])
        np.testing.assert_array_equal(ids, np.concatenate(sent[epoch]))
        assert weights.dtype == np.float32
        np.testing.assert_allclose(weights, want[ids], rtol=1e-6)
    assert np.unique(ids).size < ids.size  # drawn with replacement: rows repeat
    stream.close()


def test_feed_refuses_weights_the_leader_and_node_disagree_on(cat, loader):
    stream, _ = weighted_fed(cat, loader)
    rows = np.arange(4, dtype=np.int64)
    with pytest.raises(LoaderError, match="got rows without weights .* but it is a weighted job"):
        stream.feed(0, rows, rows)
    with pytest.raises(LoaderError, match="got 3 weights for 4 rows .* or weights not finite"):
        stream.feed(0, rows, rows, np.ones(3, np.float32))
    with pytest.raises(LoaderError, match="got 4 weights for 4 rows .* or weights not finite"):
        stream.feed(0, rows, rows, np.array([1, np.nan, 1, 1], np.float32))
    with pytest.raises(LoaderError, match="got 4 weights for 4 rows .* or weights not finite"):
        stream.feed(0, rows, rows, np.array([1, 0, 1, 1], np.float32))
    plain, _ = fed(loader)
    with pytest.raises(LoaderError, match="got rows with weights .* but it is not a weighted"):
        plain.feed(0, rows, rows, np.ones(4, np.float32))
    stream.close()
    plain.close()
