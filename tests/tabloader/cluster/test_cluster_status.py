"""``tabloader status`` tells who serves a catalog: its local service, a Ray cluster recorded
under it (found without ``--ray``), both, or nothing; the cluster is simulated here (the real
one: ``test_serve_ray_follows_nodes_joining_and_leaving``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import catalog
from tabloader import cli
from tabloader.cluster import actor
from tabloader.cluster.actor import record_leader, recorded_leader

ADDRESS = "10.1.2.3:6379"
NODE = "ab" * 20
CLUSTER = {
    "nodes": {NODE: {"reads": 5, "decodes": 7, "cache": {"hits": 3}, "clients": 1, "jobs": ["a"]}},
    "generation": 2,
    "jobs": [{"job": "a", "epoch": 1, "ranks": [0, 1], "left": []}],
    "gone": {"b": "node 1234 left the cluster"},
    "reads": 5,
    "decodes": 7,
}


@pytest.fixture
def root(tmp_path):
    path = tmp_path / "cat"
    catalog.connect(path, create=True).close()
    return path


@pytest.fixture
def asked(monkeypatch):
    """The addresses the simulated cluster was asked at (``cluster_status`` is the one place
    ``tabloader status`` reaches Ray)."""
    calls: list[str] = []

    def fake_status(catalog_root, address="auto"):
        calls.append(address)
        if address == "gone:1":
            raise ConnectionError("Could not find any running Ray instance at gone:1\nmore")
        return CLUSTER

    monkeypatch.setattr(actor, "cluster_status", fake_status)
    return calls


def status(capsys, root, *flags):
    assert cli.main(["--catalog", str(root), "status", *flags]) == 0
    return capsys.readouterr().out


def test_a_recorded_cluster_is_found_without_ray(capsys, root, asked):
    record_leader(root, ADDRESS)
    report = json.loads(status(capsys, root, "--json"))
    assert report["service_pid"] is None
    assert report["clients"] == []
    assert report["ray"] == {"address": ADDRESS, "pid": os.getpid(), **CLUSTER}
    text = status(capsys, root)
    assert text.startswith(
        f"Ray cluster at {ADDRESS} (served by pid {os.getpid()}) serves catalog {root}: 1 "
        "node(s), leader generation 2; reads 5, decodes 7"
    )
    assert NODE[:16] in text
    assert NODE[:17] not in text
    assert "job b left the cluster: node 1234 left the cluster" in text
    assert "No loader service" not in text
    assert asked == [ADDRESS, ADDRESS]
    record_leader(root, None)  # the cluster stopped
    assert json.loads(status(capsys, root, "--json"))["ray"] is None
    assert status(capsys, root).startswith(
        f"No loader service runs for catalog {root}, and no Ray cluster serves it"
    )
    assert asked == [ADDRESS, ADDRESS]  # nothing recorded: Ray is not asked


def test_an_explicit_address_wins_over_the_record(capsys, root, asked):
    record_leader(root, ADDRESS)
    report = json.loads(status(capsys, root, "--ray", "other:1", "--json"))
    assert (report["ray"]["address"], report["ray"]["pid"]) == ("other:1", None)
    assert asked == ["other:1"]


def test_a_record_whose_cluster_does_not_answer_says_so(capsys, root, asked):
    record_leader(root, "gone:1")
    report = json.loads(status(capsys, root, "--json"))
    assert report["ray"] == {
        "address": "gone:1",
        "pid": os.getpid(),
        "error": "Could not find any running Ray instance at gone:1",
    }
    assert status(capsys, root).startswith(
        f"A Ray cluster at gone:1 (served by pid {os.getpid()}) is recorded as serving catalog "
        f"{root}, but does not answer: Could not find any running Ray instance at gone:1"
    )


def test_a_stale_or_damaged_record_is_removed(capsys, root, asked):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(60)
    path = actor.checkpoint_path(root).with_name("ray-leader.json")
    path.write_text(json.dumps({"address": ADDRESS, "pid": dead.pid}))
    assert recorded_leader(root) is None
    assert not path.exists()
    path.write_text("{not json")
    assert json.loads(status(capsys, root, "--json"))["ray"] is None
    assert not path.exists()
    assert asked == []


def test_a_local_service_and_a_recorded_cluster_show_in_one_output(capsys, root, asked):
    from test_service import TIMEOUT, start_service

    record_leader(root, ADDRESS)
    proc = start_service(root)
    try:
        report = json.loads(status(capsys, root, "--json"))
        text = status(capsys, root)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)
    assert report["service_pid"] == proc.pid
    assert report["ray"]["decodes"] == 7
    assert text.startswith(f"Loader service pid {proc.pid} for catalog {root}")
    assert f"Ray cluster at {ADDRESS} (served by pid {os.getpid()}) serves catalog" in text
