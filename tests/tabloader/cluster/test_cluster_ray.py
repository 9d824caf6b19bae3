from __future__ import annotations

import os

import pytest
from pyroaring import BitMap

# Ray reads this when it is imported: its servers then bind the loopback address only.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'tabloader[ray]')")
cluster_utils = pytest.importorskip("ray.cluster_utils")

TIMEOUT = 120  # seconds for any answer of the cluster: a hang fails the test

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


@pytest.fixture
def two_nodes(monkeypatch, tmp_path):
    """A simulated 2-node Ray cluster on loopback, one CPU and one custom resource per node."""
    from ray._private import ray_constants

    assert not ray_constants.ENABLE_RAY_CLUSTER, "ray was imported before this module"
    cluster = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"node0": 1},
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    cluster.add_node(num_cpus=1, resources={"node1": 1}, node_ip_address="127.0.0.1")
    assert cluster.address.startswith("127.0.0.1:"), cluster.address
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_leader_actor_answers_each_node_its_work(two_nodes, tmp_path):
    from tabloader.cluster.actor import get_leader, leader_name, start_leader

    catalog = tmp_path / "cat"

    @ray.remote(num_cpus=0)
    def node_id():
        return ray.get_runtime_context().get_node_id()

    @ray.remote(num_cpus=0)
    def pull(catalog):
        """A node's loader: asks the leader (found by name) for its node's work."""
        node = ray.get_runtime_context().get_node_id()
        leader = get_leader(catalog)
        lists = ray.get(leader.work.remote(node), timeout=TIMEOUT)
        ray.get(leader.ack.remote(node, lists[-1].seq), timeout=TIMEOUT)
        return node, [(a.job, a.rank, a.epoch, a.rows.tolist()) for w in lists for a in w.items]

    ids = [
        ray.get(node_id.options(resources={f"node{i}": 0.01}).remote(), timeout=TIMEOUT)
        for i in range(2)
    ]
    assert ids[0] != ids[1]
    leader = start_leader(catalog, resources={"node0": 0.01}, lookahead=64, round_rows=32)
    again = start_leader(catalog)  # the same named actor
    assert ray.get(again.jobs.remote(), timeout=TIMEOUT) == []
    rows = {"a": BitMap(range(64)), "b": BitMap(range(32, 96))}
    for name, bm in rows.items():
        ray.get(
            leader.add_job.remote(
                name, nodes=ids, batch_size=8, ids=bm.serialize(), dataset="imgs@1"
            ),
            timeout=TIMEOUT,
        )
    got = dict(
        ray.get(
            [pull.options(resources={f"node{i}": 0.01}).remote(catalog) for i in range(2)],
            timeout=TIMEOUT,
        )
    )
    assert set(got) == set(ids)
    per_job: dict[str, list[int]] = {"a": [], "b": []}
    for i, node in enumerate(ids):
        for job, rank, epoch, r in got[node]:
            assert rank == i  # rank i runs on node i: it gets only its node's rows
            if epoch == 0:  # (a node that acknowledged first may get rows of epoch 1 too)
                per_job[job] += r
    for name, bm in rows.items():
        assert sorted(per_job[name]) == list(bm)  # one epoch, exactly once
    shared = list(range(32, 64))
    where = {x: {n for n in ids for _, _, e, r in got[n] if e == 0 and x in r} for x in shared}
    assert sum(len(w) == 1 for w in where.values()) >= 0.9 * len(shared)
    state = ray.get(leader.state_dict.remote(), timeout=TIMEOUT)
    assert {j["name"] for j in state["jobs"]} == {"a", "b"}
    assert leader_name(catalog).startswith("tabloader-leader-")
