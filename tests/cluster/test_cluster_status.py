"""``tabloader status`` tells who serves a catalog: its local service, a Ray cluster recorded
under it (found without ``--ray``), both, or nothing; the cluster is simulated here (the real
one: ``test_serve_ray_follows_nodes_joining_and_leaving``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tabloader import catalog, cli
from tabloader.catalog._errors import ServiceError
from tabloader.cluster import _actor as actor
from tabloader.cluster._record import (
    check_address,
    process_started,
    record_leader,
    record_path,
    recorded_leader,
)

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
    catalog.open_catalog(path, create=True).close()
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


SERVE = """
import sys, time
from tabloader.cluster._record import record_leader
if sys.argv[-1] != "-":
    record_leader(sys.argv[2], sys.argv[-1])  # relative: to its working directory
print("ready", flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def serving(root, address, catalog_arg=None, cwd=None):
    """A stand-in for ``tabloader --catalog ROOT serve --ray ADDRESS`` (its command line) that
    records itself as serving ``root`` at ``address`` (``-``: writes no record)."""
    argv = [sys.executable, "-c", SERVE, "--catalog", str(catalog_arg or root)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # found from any cwd
    with subprocess.Popen(
        [*argv, "serve", "--ray", address], stdout=subprocess.PIPE, cwd=cwd, env=env
    ) as proc:
        try:
            assert proc.stdout.readline() == b"ready\n"  # EOF (b"") if it failed
            yield proc
        finally:
            proc.kill()
            proc.wait(30)


def status(capsys, root, *flags):
    assert cli.main(["--catalog", str(root), "status", *flags]) == 0
    return capsys.readouterr().out


def test_a_recorded_cluster_is_found_without_ray(capsys, root, asked):
    with serving(root, ADDRESS) as serve:
        report = json.loads(status(capsys, root, "--json"))
        text = status(capsys, root)
    assert report["service_pid"] is None
    assert report["clients"] == []
    assert report["ray"] == {"address": ADDRESS, "pid": serve.pid, **CLUSTER}
    assert text.startswith(
        f"Ray cluster at {ADDRESS} (served by pid {serve.pid}) serves catalog {root}: 1 "
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
    path = record_path(root)
    path.write_text(json.dumps({"address": ADDRESS, "pid": 1, "started": process_started(1)}))
    report = json.loads(status(capsys, root, "--ray", "other:1", "--json"))
    assert (report["ray"]["address"], report["ray"]["pid"]) == ("other:1", None)
    assert asked == ["other:1"]


def test_a_record_whose_cluster_does_not_answer_says_so(capsys, root, asked):
    with serving(root, "gone:1") as serve:
        report = json.loads(status(capsys, root, "--json"))
        text = status(capsys, root)
    assert report["ray"] == {
        "address": "gone:1",
        "pid": serve.pid,
        "error": "Could not find any running Ray instance at gone:1",
    }
    assert text.startswith(
        f"A Ray cluster at gone:1 (served by pid {serve.pid}) is recorded as serving catalog "
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
    # a live pid that is another process by now (its start time differs): stale too
    path.write_text(json.dumps({"address": ADDRESS, "pid": 1, "started": process_started(1) + 1}))
    assert recorded_leader(root) is None
    assert not path.exists()


def test_a_local_service_and_a_recorded_cluster_show_in_one_output(capsys, root, asked):
    from tests.support.service import TIMEOUT, start_service

    proc = start_service(root)
    try:
        with serving(root, ADDRESS) as serve:
            report = json.loads(status(capsys, root, "--json"))
            text = status(capsys, root)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)
    assert report["service_pid"] == proc.pid
    assert report["ray"]["decodes"] == 7
    assert text.startswith(f"Loader service pid {proc.pid} for catalog {root}")
    assert f"Ray cluster at {ADDRESS} (served by pid {serve.pid}) serves catalog" in text


def write_record(root, pid, address=ADDRESS, **extra):
    record = {"address": address, "pid": pid, "started": process_started(pid), **extra}
    record_path(root).write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("record", "why"),
    [
        ({"address": "local"}, "its address 'local' is not host:port or ray://host:port"),
        ({"address": "auto"}, "its address 'auto' is not host:port or ray://host:port"),
        ({"address": "http://h:1/x"}, "its address 'http://h:1/x' is not host:port"),
        ({"address": 6379}, "its address 6379 is not a string"),
        ({"started": None}, r"records no start time of process \d+ \(written by an older"),
    ],
)
def test_an_untrusted_record_is_ignored_with_one_warning(root, asked, caplog, record, why):
    """A record of a live ``serve --ray`` of this catalog, but with an address Ray would
    start or search a cluster for, or no start time: ignored (kept), never dialled."""
    with serving(root, "-") as serve:
        write_record(root, serve.pid, **record)
        with caplog.at_level(logging.WARNING):
            assert recorded_leader(root) is None
    path = record_path(root)
    assert path.exists()
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"ignoring the Ray leader record {path}: ")
    assert __import__("re").search(why, line), line
    assert asked == []


def test_a_record_of_a_process_that_is_not_serve_ray_of_this_catalog_is_ignored(
    root, tmp_path, asked, caplog
):
    caplog.set_level(logging.WARNING)
    write_record(root, os.getpid())  # pytest: alive, started then, but no `serve --ray`
    assert recorded_leader(root) is None
    assert f"process {os.getpid()} is not a `tabloader serve --ray`" in caplog.text
    other = tmp_path / "other"
    with serving(root, "-", catalog_arg=other) as serve:
        write_record(root, serve.pid)
        assert recorded_leader(root) is None
    assert f"is a `tabloader serve --ray` of {other}, not of {root}" in caplog.text
    assert record_path(root).exists()
    assert asked == []


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_record_that_is_a_link_or_a_fifo_is_never_read(root, asked, caplog, kind):
    path = record_path(root)
    if kind == "link":
        path.symlink_to("/dev/zero")
    else:
        os.mkfifo(path)
    caplog.set_level(logging.WARNING)
    started = time.monotonic()
    assert recorded_leader(root) is None
    assert time.monotonic() - started < 5
    expected = "is a symbolic link (to '/dev/zero')" if kind == "link" else "is a FIFO"
    assert f"ignoring the Ray leader record {path}: Leader record {path} {expected}" in caplog.text
    assert json.loads(status_json(root))["ray"] is None
    assert asked == []


def status_json(root):
    out = subprocess.run(
        [sys.executable, "-m", "tabloader", "--catalog", str(root), "status", "--json"],
        capture_output=True,
        timeout=60,
        check=True,
    )
    return out.stdout


@pytest.mark.parametrize("address", ["local", "auto", "", "host", "h:0", "h:99999", "a b:1"])
def test_addresses_other_than_host_port_are_refused(address):
    with pytest.raises(ServiceError, match=r"is not host:port or ray://host:port; give the"):
        check_address(address)
    if address != "auto":
        with pytest.raises(ServiceError, match="is not host:port"):
            actor.cluster_status("/nowhere", address)


def test_addresses_of_the_host_port_forms_are_accepted():
    assert check_address("10.1.2.3:6379") == ("10.1.2.3", 6379)
    assert check_address("ray://head.example:10001") == ("head.example", 10001)
    assert check_address("[::1]:6379") == ("::1", 6379)


def test_status_never_starts_ray_and_dials_with_a_short_timeout(root, monkeypatch, capsys):
    """``status --ray`` at an address where nothing listens fails within the dial timeout,
    before Ray is imported; ``auto`` with ``$RAY_ADDRESS=local`` (start a new instance) is
    refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    started = time.monotonic()
    with pytest.raises(ServiceError, match=f"Nothing answers at Ray address 127.0.0.1:{port}"):
        actor.cluster_status(root, f"127.0.0.1:{port}", timeout=2)
    assert time.monotonic() - started < 10
    assert cli.main(["--catalog", str(root), "status", "--ray", f"127.0.0.1:{port}"]) == 1
    assert capsys.readouterr().err.startswith(
        f"ServiceError: Nothing answers at Ray address 127.0.0.1:{port} within 3 s"
    )
    monkeypatch.setenv("RAY_ADDRESS", "local")
    with pytest.raises(ServiceError, match=r"RAY_ADDRESS says to start a local Ray instance"):
        actor.cluster_status(root, "auto")
    with pytest.raises(ServiceError, match="is not host:port"):
        record_leader(root, "local")


def test_a_serve_given_a_relative_catalog_path_is_recognised(root, asked):
    """``--catalog cat`` in the serving process's command line is resolved against its
    working directory (``/proc/<pid>/cwd``)."""
    with serving(root, ADDRESS, catalog_arg="cat", cwd=root.parent) as serve:
        assert recorded_leader(root) == {"address": ADDRESS, "pid": serve.pid}


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_leader_checkpoint_that_is_a_link_or_a_fifo_is_never_read(root, kind):
    """The leader's body (no Ray needed) restarting from its checkpoint file."""
    from tabloader.catalog import StorageError

    path = actor.checkpoint_path(root)
    if kind == "link":
        path.symlink_to("/dev/zero")
    else:
        os.mkfifo(path)
    expected = "is a symbolic link" if kind == "link" else "is a FIFO"
    with pytest.raises(StorageError, match=f"The leader's checkpoint {path} {expected}"):
        actor.LeaderActor(str(root), {})


def test_status_ray_shows_bytes_from_the_bucket_the_tiers_and_the_peers(capsys, root, monkeypatch):
    storage = {
        "bucket_bytes": 1000,
        "bucket_requests": 4,
        "tier": {"hit_bytes": 300, "used_bytes": 900, "capacity_bytes": 2000},
        "peers": {"peer_bytes": 700, "peer_requests": 3, "peer_failures": 0},
        "local_bytes": 0,
    }
    node = {**CLUSTER["nodes"][NODE], "storage": storage}
    status_of = actor.with_totals(
        {**CLUSTER, "nodes": {NODE: node, "cd" * 20: CLUSTER["nodes"][NODE]}}
    )
    monkeypatch.setattr(actor, "cluster_status", lambda root, address="auto": status_of)
    text = status(capsys, root, "--ray", ADDRESS)
    assert "storage: bucket 1,000 bytes, tiers 300 bytes, peers 700 bytes" in text
    header = next(line for line in text.splitlines() if line.startswith("node"))
    assert header.split()[4:7] == ["bucket_bytes", "tier_bytes", "peer_bytes"]
    row = next(line for line in text.splitlines() if line.startswith(NODE[:16]))
    assert row.split()[4:7] == ["1000", "300", "700"]
    other = next(line for line in text.splitlines() if line.startswith("cd" * 8))
    assert other.split()[4:7] == ["-", "-", "-"]  # a node of an older tabloader reports none
