"""Faults around the loader service: a rank of a data-parallel job that dies, or ends."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from tabloader.catalog._errors import LoaderError, ServiceError
from tabloader.engine._arena.shm import process_alive, shm_available
from tabloader.service._client import RemoteLoader
from tabloader.service._protocol import LOG_FILE, Client, runtime_dir, socket_path
from tests.support.attacks import (
    ATTACKS,
    RSS_LIMIT_MIB,
    STALL_S,
    Observer,
    RssWatch,
    Target,
    make_catalog,
    run_attack,
)
from tests.support.polling import wait_for
from tests.support.service import TIMEOUT, descendants, rows_of, start_service

pytestmark = pytest.mark.skipif(not shm_available(), reason="no /dev/shm on this system")

RANK1 = textwrap.dedent(
    """
    import json, os, sys
    from tabloader.service._client import RemoteLoader
    s = RemoteLoader(sys.argv[1], start=False).open(
        "a", batch_size=2, prefetch=1, rank=1, world_size=2
    )
    if sys.argv[2] == "one":  # one batch, then it waits (to be killed)
        s.take()
        print("took", flush=True)
        sys.stdin.readline()
    else:  # its whole share of epoch 0, then the process ends without close()
        print(json.dumps([i for b in s.iter_epoch() for i in b["_id"].tolist()]), flush=True)
        os._exit(0)
    """
)


def _rank1(tmp_path, cat_dir, mode):
    script = tmp_path / "rank1.py"
    script.write_text(RANK1)
    return subprocess.Popen(
        [sys.executable, str(script), str(cat_dir), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


def _gone(remote: RemoteLoader, pid: int) -> bool:
    return all(c["pid"] != pid for c in remote.stats()["clients"])


def test_a_rank_killed_mid_epoch_fails_its_peer_with_the_reason(service, cat_dir, tmp_path):
    remote = RemoteLoader(cat_dir, start=False)
    victim = None
    try:
        rank0 = remote.open("a", batch_size=2, prefetch=1, rank=0, world_size=2)
        victim = _rank1(tmp_path, cat_dir, "one")
        assert victim.stdout.readline().strip() == b"took"
        victim.kill()
        victim.communicate(timeout=TIMEOUT)
        pid = victim.pid
        with pytest.raises(
            LoaderError,
            match=rf"Job 'a' \(rank 0 of 2\) lost a rank: rank 1 \(pid {pid}\) died mid-epoch 0\. "
            "Every rank .* start every rank again",
        ):
            list(rank0)  # lockstep: it cannot finish the epoch without rank 1
        rank0.close()
        wait_for(lambda: remote.stats()["cache"]["pinned"] == 0, "the pins to be released")
        with remote.open("a", batch_size=4, epochs=1) as again:  # the job starts again
            assert sorted(i for b in again for i in b["_id"].tolist()) == rows_of(
                remote, "label < 3"
            )
    finally:
        if victim is not None and victim.poll() is None:
            victim.kill()
            victim.communicate(timeout=TIMEOUT)
        remote.close()


def test_a_rank_that_ends_after_its_share_of_an_epoch_is_no_death(service, cat_dir, tmp_path):
    remote = RemoteLoader(cat_dir, start=False)
    victim = None
    try:
        rank0 = remote.open("a", batch_size=2, prefetch=1, rank=0, world_size=2)
        victim = _rank1(tmp_path, cat_dir, "share")
        mine = [i for b in rank0.iter_epoch() for i in b["_id"].tolist()]  # no error
        out, _ = victim.communicate(timeout=TIMEOUT)
        assert victim.returncode == 0
        theirs = json.loads(out)
        every = rows_of(remote, "label < 3")
        assert len(mine) == len(theirs) == len(every) // 4 * 2  # full turns of 2 batches of 2
        assert not set(mine) & set(theirs)
        assert set(mine) | set(theirs) <= set(every)
        wait_for(lambda: _gone(remote, victim.pid), "the ended rank's connection to drop")
        later: list[int] = []  # epoch 1: at most the batch rank 0 read ahead, then the reason

        def epoch1():
            for b in rank0:
                later.extend(b["_id"].tolist())

        with pytest.raises(
            LoaderError,
            match=rf"lost a rank: rank 1 \(pid {victim.pid}\) ended after epoch 0\.",
        ):
            epoch1()
        assert len(later) <= 2
        rank0.close()
    finally:
        if victim is not None and victim.poll() is None:
            victim.kill()
            victim.communicate(timeout=TIMEOUT)
        remote.close()


def test_a_peer_gone_before_the_last_batch_ends_the_epoch_then_raises(service, cat_dir, tmp_path):
    """Rank 1 ends after its share while rank 0 still has its last batch of epoch 0 to take:
    the batch rank 0 reads ahead (epoch 1's first) fails in the service, and that error waits
    for epoch 1: rank 0's epoch 0 ends normally."""
    remote = RemoteLoader(cat_dir, start=False)
    victim = None
    try:
        rank0 = remote.open("a", batch_size=2, prefetch=1, rank=0, world_size=2)
        victim = _rank1(tmp_path, cat_dir, "share")
        share = len(rows_of(remote, "label < 3")) // 4  # batches of 2 per rank
        mine = [rank0.take(0) for _ in range(share - 1)]
        victim.communicate(timeout=TIMEOUT)
        wait_for(lambda: _gone(remote, victim.pid), "the ended rank's connection to drop")
        mine.append(rank0.take(0))  # the last of epoch 0; the next one is asked for now
        assert all(b is not None for b in mine)
        assert rank0.take(0) is None  # epoch 0 ended, not failed
        assert rank0.epoch == 1
        with pytest.raises(LoaderError, match=r"lost a rank: .* ended after epoch 0\."):
            rank0.take(None)
        rank0.close()
    finally:
        if victim is not None and victim.poll() is None:
            victim.kill()
            victim.communicate(timeout=TIMEOUT)
        remote.close()


REBIND = textwrap.dedent(
    """
    import gc, sys
    from tabloader.torch import JobDataset
    collect, cycle = sys.argv[2] == "collect", sys.argv[3] == "cycle"
    # The import's objects (torch's ~200k) move out of the collector's reach: a full
    # collection (the script's own, and the one an open runs to free a stream in a cycle)
    # then scans only what the loop made, 0.1 s less each on 2 cores; what it frees is alike.
    gc.freeze()
    for i in range(50):  # a notebook cell run again and again, never closing
        ds = JobDataset("a", catalog=sys.argv[1], batch_size=4)
        it = iter(ds)
        batch = next(it)  # mid-epoch: its stream is open, a batch read ahead
        assert batch["image"].shape[1:] == (16, 16, 3)
        if cycle:  # held in a reference cycle: only the collector frees it
            ds.me = ds
        del it
        if collect:
            gc.collect()
    print("ok", flush=True)
    """
)


@pytest.mark.parametrize(
    ("collect", "cycle"), [("collect", "cycle"), ("no", "no"), ("no", "cycle")]
)
def test_a_job_reopened_after_its_stream_was_dropped_opens_every_time(
    served, tmp_path, collect, cycle
):
    cat_dir = served.root
    script = tmp_path / "rebind.py"
    script.write_text(REBIND)
    run = subprocess.run(
        [sys.executable, str(script), str(cat_dir), collect, cycle],
        capture_output=True,
        timeout=TIMEOUT * 4,
    )
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert run.stdout.strip() == b"ok"
    remote = RemoteLoader(cat_dir, start=False)
    try:  # nothing of the dropped streams holds the service
        wait_for(lambda: "a" not in remote.stats()["jobs"], "the last stream to leave")
        wait_for(lambda: remote.stats()["cache"]["pinned"] == 0, "the pins to be released")
    finally:
        remote.close()


# -- what a client sends, the service's log and its temporary files -------------------------
@pytest.mark.parametrize("tickets", ["x", {}, [1.5], ["7"], [True], [-1], list(range(257)), 0])
def test_release_tickets_of_another_type_are_one_clean_error(served, tickets):
    """Each is a one-line error to that client; the service logs no traceback (it logged
    one per request) and goes on (one service takes all of them, one after another)."""
    cat_dir = served.root
    log = runtime_dir(cat_dir) / LOG_FILE
    before = log.stat().st_size
    raw = Client(cat_dir)
    try:
        for op in ("release", "next"):
            with pytest.raises(ServiceError, match=r"'release' lists the tickets of batches"):
                raw.call(op, release=tickets)
    finally:
        raw.close()
    with RemoteLoader(cat_dir, start=False) as remote, remote.open("c0", epochs=1) as stream:
        assert sorted(i for b in stream for i in b["_id"].tolist()) == rows_of(remote, "label < 2")
    with open(log, "rb") as written:
        written.seek(before)
        assert b"Traceback" not in written.read()


def test_a_service_started_in_the_background_logs_each_line_once(cat_dir, monkeypatch):
    """Its stderr goes to its log file too: a WARNING was written there twice."""
    monkeypatch.setenv("TABLOADER_IDLE_EXIT", "1")
    remote = RemoteLoader(cat_dir)  # starts it
    pid = remote.service_pid
    try:
        with socket.socket(socket.AF_UNIX) as raw:  # a client that never authenticates
            raw.connect(str(socket_path(cat_dir)))
        log = runtime_dir(cat_dir) / LOG_FILE
        wait_for(lambda: b"failed to authenticate" in log.read_bytes(), "the warning")
        assert remote.alive()
    finally:
        remote.close()
    wait_for(lambda: not process_alive(pid), "the idle service to stop")
    lines = log.read_text().splitlines()
    assert len([line for line in lines if "failed to authenticate" in line]) == 1


def test_a_service_killed_with_its_processes_leaves_no_temporary_folder(cat_dir, short_tmp):
    """Killed with its process group (its decode processes, which remove multiprocessing's
    folder when only the service dies, die too): nothing is left in $TMPDIR, and the next
    service removes what the killed one left in its own runtime directory."""
    tmp = short_tmp / "tmp"
    tmp.mkdir()
    proc = start_service(cat_dir, new_session=True, env={"TMPDIR": str(tmp)})
    helpers = descendants(proc.pid)
    assert helpers  # the forkserver and the decode processes: ready
    private = runtime_dir(cat_dir) / "mp"
    sockets = {p.name for p in private.iterdir()}
    assert sockets  # the forkserver's socket is there
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(TIMEOUT)
    wait_for(lambda: not any(map(process_alive, helpers)), "the service's processes to die")
    assert not list(tmp.iterdir())
    again = start_service(cat_dir, env={"TMPDIR": str(tmp)})
    try:
        assert not sockets & {p.name for p in private.iterdir()}  # the killed one's is gone
    finally:
        again.send_signal(signal.SIGTERM)
        assert again.wait(TIMEOUT) == 0
    assert not private.exists()
    assert not list(tmp.iterdir())


# -- one job can never hurt another: an observer beside each attack ---------------------------
@pytest.fixture(scope="module")
def beside(tmp_path_factory):
    """A service of a small table, and an observer job reading it for the module's attacks."""
    root = tmp_path_factory.mktemp("isolation") / "cat"
    make_catalog(root)
    proc = start_service(root)
    try:
        with Observer(root) as observer, RssWatch(proc.pid) as watch:
            yield Target(root), observer, watch
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)


@pytest.mark.parametrize("name", list(ATTACKS))
def test_an_attack_fails_the_attacker_alone_and_the_observer_reads_on(beside, name):
    """Each attack on the dataset, as another program would send it: the attacker gets one
    clean error (no traceback logged), the observer's epochs stay exactly once and it never
    waits more than a second for a batch (a stall bound, checked as a property), the service
    stays under 1 GiB, and the attacker's job opens again."""
    target, observer, watch = beside
    out = run_attack(target, observer, watch, name)
    assert out["error"] is not None, f"{name}: not refused"
    assert out["refused"], f"{name}: {out['error']}"
    assert not out["traceback_logged"]
    assert not out["observer_errors"]
    assert out["epochs"] >= 2
    assert out["exact"]
    assert out["stall_s"] <= STALL_S
    assert out["peak_rss_mib"] < RSS_LIMIT_MIB
    assert out["reopened"]
