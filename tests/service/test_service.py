"""The loader service: separate processes share one engine through shared memory."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from pyroaring import BitMap

import tabloader
from tabloader import catalog
from tabloader.catalog._errors import (
    CatalogLockedError,
    ImportFailedError,
    JobNotFoundError,
    LoaderError,
    OptionError,
    ServiceError,
)
from tabloader.catalog._options import SPEC_VERSION
from tabloader.engine._arena.shm import shm_available
from tabloader.engine._opening import OpenRequest
from tabloader.engine.decode import decode_image
from tabloader.service._client import RemoteLoader, service_loader
from tabloader.service._listener import STARTER_ENV
from tabloader.service._protocol import (
    MAX_MESSAGE,
    PROTOCOL_VERSION,
    Client,
    runtime_dir,
    socket_path,
)
from tests.support.polling import wait_for
from tests.support.service import TIMEOUT, descendants, rows_of, sql, start_service
from tests.support.shm import named_shm_of
from tests.support.sockets import authenticated_socket, frame, read_to_eof

pytestmark = pytest.mark.skipif(
    not shm_available(), reason="no /dev/shm (O_TMPFILE) on this system"
)


TRAIN = textwrap.dedent(
    """
    import json, sys
    from tabloader.torch import JobDataset
    ds = JobDataset(sys.argv[2], catalog=sys.argv[1])
    epochs = []
    for epoch in range(2):
        ids = []
        for batch in ds:
            assert batch["image"].shape[1:] == (16, 16, 3)
            batch["image"].zero_()  # in place: nobody else sees it
            ids += batch["_id"].tolist()
        epochs.append(ids)
    print(json.dumps({"epochs": epochs, "pid": ds.loader.service_pid}))
    """
)


def test_two_training_scripts_share_one_service_exactly_once_each(cat_dir, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = {**os.environ, "TABLOADER_IDLE_EXIT": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(cat_dir), job], stdout=subprocess.PIPE, env=env
        )
        for job in ("a", "b")
    ]  # no service runs: the first starts one in the background, both use it
    outs = [json.loads(p.communicate(timeout=TIMEOUT * 2)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0]["pid"] == outs[1]["pid"]
    service_pid = outs[0]["pid"]
    wait_for(lambda: not _alive(service_pid), "the idle service to stop")
    assert not socket_path(cat_dir).exists()
    with catalog.open_catalog(cat_dir) as cat:
        for job, out in zip("ab", outs, strict=True):
            rows = sorted(cat.job(job).ids)
            for ids in out["epochs"]:
                assert sorted(ids) == rows  # every row once per epoch
            assert out["epochs"][0] != out["epochs"][1]  # a new order each epoch


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_batches_equal_the_source_and_jobs_share_decodes(service, cat_dir, image_folder):
    remote = RemoteLoader(cat_dir, start=False)
    try:
        a = remote.open("a", batch_size=8, epochs=1)
        b = remote.open("b", batch_size=8, epochs=1)
        seen: dict[int, np.ndarray] = {}
        for batch_a, batch_b in zip(a, b, strict=False):
            for batch in (batch_a, batch_b):
                for i, img in zip(batch["_id"].tolist(), batch["image"].copy(), strict=True):
                    seen[i] = img
                batch["image"][...] = 0  # the client's own copy: nobody else sees it
        for stream in (a, b):
            for batch in stream:
                for i, img in zip(batch["_id"].tolist(), batch["image"], strict=True):
                    seen[i] = img.copy()
            stream.close()
        paths = sql(remote, "SELECT _id, path FROM imgs").to_pylist()
        assert sorted(seen) == rows_of(remote, "true")  # a and b together: every row
        wait_for(lambda: remote.stats()["cache"]["pinned"] == 0, "the pins to be released")
        stats = remote.stats()
    finally:
        remote.close()
    assert stats["decodes"] <= len(seen) * 1.05  # shared between the two jobs
    for row in paths:
        expected = decode_image((image_folder / row["path"]).read_bytes(), size=16)
        assert np.array_equal(seen[row["_id"]], expected)


def test_statements_go_through_the_running_service(service, cat_dir):
    run = [sys.executable, "-m", "tabloader", "--catalog", str(cat_dir), "sql"]
    out = subprocess.run([*run, "SHOW JOBS"], capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert "label < 3" in out.stdout
    out = subprocess.run(
        [*run, "REGISTER JOB c SELECT label FROM imgs WHERE label = 2"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert out.returncode == 0, out.stderr
    assert "Job c on imgs" in out.stdout
    out = subprocess.run([*run, "SHOW JOBS nope"], capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 1
    assert out.stderr.startswith("StatementError") or "Error" in out.stderr
    remote = RemoteLoader(cat_dir, start=False)
    try:
        with pytest.raises(JobNotFoundError, match="nope"):
            remote.open("nope")
        with remote.open("c", batch_size=4, epochs=1) as c:  # registered while others train
            labels = np.concatenate([b["label"] for b in c])
        assert (labels == 2).all()
        assert sql(remote, "SELECT count(*) AS n FROM imgs").column("n").to_pylist()[0] > 0
    finally:
        remote.close()
    with tabloader.connect(cat_dir) as cat:  # the Python API: through the service too
        assert cat.service_pid is not None
        cat.sql("REGISTER JOB d SELECT label FROM imgs WHERE label = 1")
        assert "d" in cat.sql("SHOW JOBS").column("name").to_pylist()


def test_the_catalog_package_opened_beside_a_service_names_the_way_through_it(served):
    """``catalog.open_catalog`` opens the catalog in this process only; its error says what does
    reach the service's catalog."""
    service, cat_dir = served.proc, served.root
    with pytest.raises(
        CatalogLockedError,
        match=rf"in use by another process \(PID {service.pid}\)\. If that is its tabloader "
        r"service .*`tabloader.connect\(.*\)` returns it in Python .*`tabloader sql` uses it",
    ):
        catalog.open_catalog(cat_dir)


def test_connect_without_a_service_reports_the_process_that_holds_the_catalog(cat_dir, monkeypatch):
    monkeypatch.setenv("TABLOADER_LOCK_WAIT", "0.5")  # waited for that long, then refused
    holder = subprocess.Popen(
        [
            *(sys.executable, "-c"),
            "import sys, time; from tabloader import catalog;"
            " c = catalog.open_catalog(sys.argv[1]); print(1, flush=True); time.sleep(60)",
            str(cat_dir),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline().strip() == b"1"
        with pytest.raises(
            CatalogLockedError, match=rf"is held by pid {holder.pid} .*within 0.5 s"
        ):
            tabloader.connect(cat_dir)
    finally:
        holder.kill()
        holder.wait(TIMEOUT)
        holder.stdout.close()


DDP_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from tabloader.torch import JobDataset
    dist.init_process_group("gloo")
    ds = JobDataset("a", catalog=sys.argv[1], batch_size=4)  # rank: torchrun's environment
    model = DistributedDataParallel(torch.nn.Linear(16 * 16 * 3, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = []
    for batch in ds:  # a rank with a batch more than another would hang in backward()
        x = batch["image"].flatten(1).float() / 255
        loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        ids += batch["_id"].tolist()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (ds.stats()["rank"], ids))  # the rank the job gave it
    if dist.get_rank() == 0:
        print(json.dumps({"ids": every, "pid": ds.loader.service_pid}), flush=True)
    ds.close()
    dist.destroy_process_group()
    # torch 2.13's gloo aborts about one exit in ten ("terminate called without an active
    # exception"), with no tabloader in the process too (measured: 1 in 12 of a bare DDP
    # script); skip the interpreter's teardown, all is done.
    os._exit(0)
    """
)


def test_torchrun_trains_two_cpu_ranks_over_gloo_on_one_job(service, cat_dir, tmp_path):
    """The real launcher: ``torchrun --standalone --nproc_per_node 2`` and DDP over gloo. Its
    two rank processes join one job of the one service (equal, disjoint shares; the remainder
    dropped), while another job open in this process reads every row of its own once and
    shares their decodes."""
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    remote = RemoteLoader(cat_dir, start=False)
    try:
        b = remote.open("b", batch_size=8, epochs=1)  # another job, open while the ranks run
        torchrun = subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
                *("--nproc_per_node", "2", str(script), str(cat_dir)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            stdout, stderr = torchrun.communicate(timeout=TIMEOUT * 3)
        finally:
            if torchrun.poll() is None:  # a hang: its ranks (each in a session of its own) too
                for pid in [*descendants(torchrun.pid), torchrun.pid]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                torchrun.communicate()
        assert torchrun.returncode == 0, stderr[-3000:]
        seen_b = [i for batch in b for i in batch["_id"].tolist()]
        b.close()
        wait_for(lambda: remote.stats()["cache"]["pinned"] == 0, "the pins to be released")
        decodes = remote.stats()["decodes"]
        rows_a, rows_b = rows_of(remote, "label < 3"), rows_of(remote, "label > 0")
    finally:
        remote.close()
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["pid"] == service.pid  # one service, one job
    assert [rank for rank, _ in out["ids"]] == [0, 1]
    r0, r1 = (ids for _, ids in out["ids"])
    assert len(r0) == len(r1) == len(rows_a) // 8 * 4  # equal shares; the remainder dropped
    assert not set(r0) & set(r1)
    assert set(r0) | set(r1) <= set(rows_a)
    assert len(set(rows_a) - set(r0) - set(r1)) == len(rows_a) % 8
    assert sorted(seen_b) == rows_b  # the other job: every row once
    assert decodes <= len(set(rows_a) | set(rows_b)) * 1.05  # the ranks share decodes with b


def test_a_small_cache_evicts_for_a_batch_larger_than_a_slab(cat_dir):
    """1 MiB of cache: 64 KiB slabs, and a 160x160 image (75 KiB) is never cached, so each
    batch carries its images in staging (300 KiB for 4): whole slabs, their values evicted."""
    with catalog.open_catalog(cat_dir) as cat:
        cat.sql("REGISTER JOB big SELECT image, label FROM imgs WITH (image_size = 160)")
        rows = sorted(cat.job("big").ids)
    proc = start_service(cat_dir, "--cache-bytes", str(1 << 20))
    try:
        with RemoteLoader(cat_dir, start=False) as remote:
            with remote.open("big", batch_size=4, epochs=2) as stream:
                epochs: list[list[int]] = [[], []]
                for e in (0, 1):
                    for b in stream.iter_epoch():
                        assert b["image"].shape[1:] == (160, 160, 3)
                        epochs[e] += b["_id"].tolist()
            assert sorted(epochs[0]) == sorted(epochs[1]) == rows
            wait_for(lambda: remote.stats()["cache"]["pinned"] == 0, "the staging to go")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)


def test_a_client_that_stops_reading_holds_only_its_prefetch(service, cat_dir):
    remote = RemoteLoader(cat_dir, start=False)
    try:
        stalled = remote.open("a", batch_size=4, prefetch=2)
        stalled.take()  # ... and never asks again, with its connection open
        other = remote.open("b", batch_size=4, epochs=2)
        epochs: list[list[int]] = [[], []]
        runner = threading.Thread(
            target=lambda: [
                epochs[e].extend(b["_id"].tolist()) for e in (0, 1) for b in other.iter_epoch()
            ],
            daemon=True,
        )
        runner.start()
        runner.join(TIMEOUT)
        assert not runner.is_alive(), "a stalled client held up another job"
        other.close()
        assert sorted(epochs[0]) == sorted(epochs[1]) == rows_of(remote, "label > 0")
        # a holds its taken batch and its 2 prefetched ones (4 rows each), plus the staging
        # slot of its ticket (the label column): nothing of b's stays pinned
        wait_for(lambda: remote.stats()["cache"]["pinned"] <= 3 * 4 + 1, "b's pins to go")
        assert stalled.stats()["batches"] == 1
        stalled.close()
        wait_for(lambda: remote.stats()["cache"]["pinned"] == 0, "a's pins to go")
    finally:
        remote.close()


KILLED = textwrap.dedent(
    """
    import os, sys
    from tabloader.service._client import RemoteLoader, service_loader
    s = RemoteLoader(sys.argv[1], start=False).open("a", batch_size=4, prefetch=4)
    s.take()
    print("took", flush=True)
    sys.stdin.readline()
    """
)


def test_a_killed_client_leaves_and_others_go_on(service, cat_dir, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    victim = subprocess.Popen(
        [sys.executable, str(script), str(cat_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert victim.stdout.readline().strip() == b"took"
    remote = RemoteLoader(cat_dir, start=False)
    try:
        assert "a" in remote.stats()["jobs"]
        victim.kill()
        victim.communicate(timeout=TIMEOUT)  # closes its pipes
        wait_for(lambda: "a" not in remote.stats()["jobs"], "the killed client's job to leave")
        wait_for(lambda: remote.stats()["cache"]["pinned"] == 0, "its pins to be released")
        with remote.open("a", batch_size=4, epochs=1) as again:  # the same job, started again
            assert sorted(i for b in again for i in b["_id"].tolist()) == rows_of(
                remote, "label < 3"
            )
    finally:
        remote.close()


def test_resume_from_a_saved_state_exactly_once(served):
    cat_dir = served.root
    remote = RemoteLoader(cat_dir, start=False)
    try:
        s = remote.open("a", batch_size=4)
        first = s.take()["_id"].tolist() + s.take()["_id"].tolist()
        state = s.state_dict()
        s.close()
        with remote.open("a", batch_size=4, state=state, epochs=1) as resumed:
            rest = [i for b in resumed for i in b["_id"].tolist()]
        assert sorted(first + rest) == rows_of(remote, "label < 3")  # none twice, none lost
    finally:
        remote.close()


def test_resume_from_a_state_saved_at_an_epochs_end_with_a_batch_read_ahead(served):
    """The client has read the next epoch's first batch ahead when the job saves at the end of
    an epoch: the state is that epoch, whole, and nothing is lost."""
    cat_dir = served.root
    remote = RemoteLoader(cat_dir, start=False)
    try:
        rows = rows_of(remote, "label < 3")
        s = remote.open("a", batch_size=4)
        first = [i for b in s.iter_epoch() for i in b["_id"].tolist()]
        state = s.state_dict()
        assert s.epoch == 1
        assert s.stats()["rows"] == len(rows)  # the batch read ahead is not delivered
        s.close()
        assert state["epoch"] == 1
        assert sorted(BitMap.deserialize(state["remaining"])) == rows
        with remote.open("a", batch_size=4, state=state, epochs=2) as resumed:
            second = [i for b in resumed for i in b["_id"].tolist()]
        assert sorted(first) == sorted(second) == rows
    finally:
        remote.close()


def test_stall_times_count_the_jobs_compute(served):
    """The client times its job's stalls (it reads ahead: the service's own wait for the next
    batch overlaps the job's compute) and reports them with its requests."""
    cat_dir = served.root
    with RemoteLoader(cat_dir, start=False) as remote, remote.open("a", batch_size=4) as s:
        s.take()
        for _ in range(4):
            time.sleep(0.1)  # the job's compute
            s.take()
        stats = s.stats()
    assert stats["compute_s"] >= 0.4
    assert stats["batches"] == 5


def test_a_jobs_waits_and_compute_fit_in_its_time(served):
    """A job that never computes waits for every batch: its waits add up to about its time,
    never more (a wait for a batch read ahead is counted once)."""
    cat_dir = served.root
    with RemoteLoader(cat_dir, start=False) as remote, remote.open("c0", batch_size=2) as s:
        t0 = time.perf_counter()
        for _ in s.iter_epoch():
            pass
        elapsed = time.perf_counter() - t0
        stats = s.stats()
    assert stats["batches"] >= 10
    assert stats["wait_s"] > 0
    assert stats["wait_s"] + stats["compute_s"] <= elapsed * 1.05 + 0.01


def test_a_stream_closing_while_it_reads_ahead_leaves_and_does_not_hang_up(cat_dir):
    """Rank 0 reads ahead a batch that waits for rank 1 (lockstep); closing it leaves the job
    at once (the service stops waiting), not as a client that died mid-request."""
    proc = start_service(cat_dir, "-v")
    try:
        with RemoteLoader(cat_dir, start=False) as remote:
            ranks = [
                remote.open("a", batch_size=2, prefetch=1, rank=r, world_size=2) for r in (0, 1)
            ]
            ranks[1].take()
            for _ in range(4):  # rank 0 gets ahead of rank 1 and its read-ahead waits
                ranks[0].take()
            ranks[0].close()
            ranks[1].close()
            wait_for(lambda: remote.stats()["jobs"] == {}, "the job to leave")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)
    log = (cat_dir.parent / "serve.log").read_text()
    assert log.count(" left job a") == 2
    assert "hung up during a request" not in log


def in_a_thread(work) -> tuple[threading.Thread, list[BaseException]]:
    """``work()`` run in a thread that records what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, raised


def test_closing_a_job_dataset_from_another_thread_is_a_close_not_a_lost_service(service, cat_dir):
    """A thread iterates rank 0 of a 2-rank job, waiting in the service for rank 1; another
    closes the dataset: the iteration ends with the stream's "closed", not "lost the
    service", and the service serves on."""
    from tabloader.torch import JobDataset

    data = JobDataset("c0", catalog=cat_dir, batch_size=4, rank=0, world_size=2)
    thread, raised = in_a_thread(lambda: list(data))
    wait_for(lambda: "c0" in service_loader(cat_dir).stats()["jobs"], "the job to open")
    data.close()  # waits CLOSE_WAIT_S for the take that waits, then hangs up
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    assert [type(e) for e in raised] == [LoaderError], raised
    assert str(raised[0]) == "Job stream 'c0' is closed; open the job again."
    with RemoteLoader(cat_dir, start=False) as remote:
        assert remote.service_pid == service.pid


def test_closing_a_connection_from_another_thread_is_a_close_not_a_lost_service(service, cat_dir):
    """A statement waits for the service (stopped for the while); another thread closes the
    connection: the statement fails as closed here, not as a lost service."""
    cat = tabloader.connect(cat_dir)
    assert cat.service_pid == service.pid
    service.send_signal(signal.SIGSTOP)
    try:
        thread, raised = in_a_thread(lambda: cat.sql("SHOW JOBS"))
        time.sleep(0.2)  # it sent the statement and waits for the reply
        cat.close()
        thread.join(TIMEOUT)
    finally:
        service.send_signal(signal.SIGCONT)
    assert not thread.is_alive()
    assert [type(e) for e in raised] == [ServiceError], raised
    # (if the thread had not sent the statement yet: "this Client ... is closed")
    assert re.search(r"was closed \(close\(\) from another thread\)|is closed", str(raised[0]))
    assert "lost" not in str(raised[0])


def test_wait_ready_returns_once_the_decode_processes_run(service, cat_dir):
    with RemoteLoader(cat_dir, start=False) as remote:
        remote.wait_ready()  # no job opened: the service started them for its image dataset
        helpers = descendants(service.pid)
    assert len(helpers) >= 3, helpers  # a forkserver and its two decode processes


def test_a_killed_service_leaves_nothing_behind_and_fails_its_clients(cat_dir, short_tmp):
    """SIGKILL (the OOM killer's signal) mid-epoch: no clean-up code runs in the service, yet
    nothing of it stays in /dev/shm or the temporary folder, with no other service to clean."""
    tmp = short_tmp  # the service's $TMPDIR: what it makes there is its alone
    service = start_service(cat_dir, env={"TMPDIR": str(tmp)})
    try:
        remote = RemoteLoader(cat_dir, start=False)
        cached = service_loader(cat_dir)  # this process's connection, as JobDataset's
        stream = remote.open("a", batch_size=4)
        stream.take()
        helpers = descendants(service.pid)
        assert len(helpers) >= 3  # a forkserver and its two decode processes
        named = named_shm_of(service.pid, *helpers, os.getpid())
        assert not named  # neither the arena nor the pool's locks have a name
        private = runtime_dir(cat_dir) / "mp"  # multiprocessing's folder (the forkserver's
        assert list(private.iterdir())  # socket): the service's own, not in $TMPDIR
        assert not list(tmp.iterdir())
        service.kill()
        service.wait(TIMEOUT)
    finally:
        if service.poll() is None:
            service.kill()
            service.wait(TIMEOUT)
    with pytest.raises(ServiceError, match="lost the tabloader service .* state_dict"):
        list(stream)  # the batches prefetched before the kill, then the error
    stream.close()
    wait_for(lambda: not any(_alive(p) for p in helpers), "the decode processes to exit")
    assert not list(tmp.iterdir())
    assert not private.exists()  # the decode processes removed it as they exited
    fresh = start_service(cat_dir)
    try:
        # The old connection maps the dead service's memory: it must not read the new one's
        # batches from it (it would deliver the wrong images, silently).
        with pytest.raises(ServiceError, match="is gone, and another one runs now"):
            remote.open("a", batch_size=4)
        remote.close()
        again = service_loader(cat_dir)
        assert again is not cached
        assert again.service_pid == fresh.pid
        assert again.stats()["jobs"] == {}  # the refused open left nothing open there
        with again.open("a", batch_size=4, epochs=1) as s:
            assert sorted(i for b in s for i in b["_id"].tolist()) == rows_of(again, "label < 3")
        again.close()
    finally:
        fresh.send_signal(signal.SIGTERM)
        assert fresh.wait(TIMEOUT) == 0


def test_sigterm_stops_the_service_cleanly(cat_dir):
    proc = start_service(cat_dir)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(TIMEOUT) == 0
    assert not socket_path(cat_dir).exists()
    with pytest.raises(ServiceError, match="no tabloader service runs"):
        RemoteLoader(cat_dir, start=False)


def test_ctrl_c_stops_a_foreground_service_quietly(cat_dir):
    """Ctrl-C signals the terminal's whole process group: the service, its forkserver and its
    decode processes. The service stops cleanly; the others exit without a traceback each."""
    (cat_dir.parent / "serve.log").unlink(missing_ok=True)
    proc = start_service(cat_dir, new_session=True)
    try:
        remote = RemoteLoader(cat_dir, start=False)
        stream = remote.open("a", batch_size=4)
        assert stream.take() is not None  # the decode processes run
        helpers = descendants(proc.pid)
        assert len(helpers) >= 3
        assert not named_shm_of(proc.pid, *helpers)  # nothing to leave behind
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(TIMEOUT)
    with pytest.raises(ServiceError, match="lost the tabloader service"):
        list(stream)
    stream.close()
    remote.close()
    wait_for(lambda: not any(_alive(p) for p in helpers), "the decode processes to exit")
    assert not socket_path(cat_dir).exists()
    err = (cat_dir.parent / "serve.log").read_text()
    assert "serving catalog" in err
    assert "Traceback" not in err, err
    assert "KeyboardInterrupt" not in err, err


def test_garbage_on_the_services_socket_is_logged_and_serving_goes_on(service, cat_dir):
    """Bytes no client would send, each on its own connection, to a running ``serve``: each
    connection is closed with a line in the service's log file, and jobs are served on."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # no key: an HTTP probe
        sock.settimeout(TIMEOUT)
        sock.connect(str(socket_path(cat_dir)))
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        sock.shutdown(socket.SHUT_WR)
        read_to_eof(sock)
    for payload in (
        b"\xde\xad\xbe\xef garbage",  # read as a length prefix: over the limit
        struct.pack("!I", MAX_MESSAGE + 1),
        frame(b"\xff{not json"),
        frame(b"{}")[:-1],  # truncated
        frame(json.dumps({"op": "next", "v": PROTOCOL_VERSION}).encode()),  # no job open
    ):
        with authenticated_socket(cat_dir) as sock:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            read_to_eof(sock)
    assert service.poll() is None
    remote = RemoteLoader(cat_dir, start=False)
    with remote.open("a", batch_size=4, epochs=1) as stream:
        assert sorted(i for b in stream for i in b["_id"].tolist()) == rows_of(remote, "label < 3")
    remote.close()
    log = runtime_dir(cat_dir) / "service.log"
    wait_for(lambda: "opened job a" in log.read_text(), "the service to log the job")
    text = log.read_text()
    for line in ("failed to authenticate", "over the limit", "is not JSON", "truncated message"):
        assert line in text, text
    assert re.search(r"^\d{4}-\d\d-\d\d .* pid \d+ INFO ", text, re.M), text


def test_bad_options_from_a_client_fail_its_open_and_nobody_elses(served):
    """Option values no JobDataset would send (a list for epochs...): the engine shares one
    scheduler per dataset, so one that got through would stop every job of the dataset."""
    cat_dir = served.root
    logged = (runtime_dir(cat_dir) / "service.log").stat().st_size  # the module's service's

    def spec(**options):
        return {"spec": {"v": SPEC_VERSION, "options": options}}

    def given(**options):
        return {"options": options}

    malformed = r"malformed open request \(%s.*run the same tabloader on both ends"
    for bad, error, message in (
        ({"epochs": [1]}, ServiceError, malformed % r"epochs is \[1\], not an integer"),
        (spec(batch_size="x"), ServiceError, "batch_size = 'x' is not an integer"),
        (given(batch_size="x"), ServiceError, "batch_size = 'x' is not an integer"),
        ({"prefetch": 0}, ServiceError, malformed % "prefetch 0 is below the range"),
        (given(image_size=100000), ServiceError, r"image_size = 100000 is out of range"),
        (given(batch_size=65536, image_size=512), OptionError, "over the 4 GiB limit"),
        (given(batchsize=4), ServiceError, r"Unknown job option 'batchsize'\. Did you mean"),
        ({"spec": {"v": 0, "options": {}}}, ServiceError, "A job spec of version 0"),
        ({"spec": [4]}, ServiceError, "Not a job spec"),
        ({"batch_size": 4}, ServiceError, malformed % r"not an open request: \['batch_size'"),
        # within REGISTER's bounds, but more than this service's cache (16 MiB) holds
        (given(batch_size=32, image_size=256), LoaderError, r"6\.0 MiB of decoded images"),
        (given(image_size=128) | {"prefetch": 9}, LoaderError, r"11 of them .* cache of 16"),
    ):
        conn = Client(cat_dir)
        try:
            with pytest.raises(error, match=message):
                conn.call(
                    "open", request=OpenRequest.make("a", rank=0, world_size=1).to_wire() | bad
                )
        finally:
            conn.close()
    remote = RemoteLoader(cat_dir, start=False)
    with pytest.raises(OptionError, match=r"open\(batchsize=4\): .*Did you mean 'batch_size'"):
        remote.open("a", batchsize=4)  # refused by the client
    with remote.open("a", batch_size=4, epochs=1) as stream:
        assert sorted(i for b in stream for i in b["_id"].tolist()) == rows_of(remote, "label < 3")
        assert stream.spec.values == {"image_size": 16, "batch_size": 4}  # REGISTER's + open's
    with remote.open("a", batch_size=2, image_size=(8, 6), epochs=1) as stream:
        assert next(iter(stream))["image"].shape == (2, 8, 6, 3)  # a pair over the wire
    # 65536 rows of 147x147 would be 4.0 GiB, but the job has 45 rows: 2.8 MiB a batch
    with remote.open("a", batch_size=65536, image_size=147, epochs=1) as stream:
        [batch] = list(stream)
        assert batch["image"].shape == (len(rows_of(remote, "label < 3")), 147, 147, 3)
    remote.close()
    with open(runtime_dir(cat_dir) / "service.log", "rb") as log:  # this test's lines
        log.seek(logged)
        assert b"failed" not in log.read()


def test_a_second_service_for_the_catalog_is_refused(served):
    cat_dir = served.root
    out = subprocess.run(
        [sys.executable, "-m", "tabloader", "--catalog", str(cat_dir), "serve"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert out.returncode == 1
    assert "a service already runs" in out.stderr


def test_a_batch_is_staged_even_when_pinned_images_fill_the_arena(cat_dir, image_folder):
    """The ids and labels of a handed-over batch are staged in blocks after the arena, which
    pinned images never take: before, a full arena failed the batch. Images with no room in
    the arena are decoded uncached and staged there too: the right pixels, and two copies
    of each (the service's into staging, the client's out of it), counted."""
    from tabloader.service._server import Service

    service = Service(cat_dir, cache_bytes=1 << 20, workers=2)
    runner = threading.Thread(target=service.serve, daemon=True)
    runner.start()
    try:
        arena = service.arena
        space = arena.space("test-filler", num_rows=1 << 16)
        filled = 0
        with warnings.catch_warnings():  # "every slot was pinned": what this test wants
            warnings.simplefilter("ignore")
            while True:  # pin every slot of every slab, as stalled clients' batches would
                offsets, _ = arena.reserve(space, np.arange(filled, filled + 64), (4096,))
                if (offsets < 0).any():
                    break
                filled += 64
        assert filled > 0
        with (
            RemoteLoader(cat_dir, start=False) as remote,
            remote.open("c0", batch_size=4, epochs=1) as stream,
        ):
            labels = [b["label"] for b in stream]
            expected = rows_of(remote, "label < 2")
        assert np.concatenate(labels).size == len(expected)
        with (
            RemoteLoader(cat_dir, start=False) as remote,
            remote.open("a", batch_size=2, epochs=1) as stream,
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            seen = {i: img for b in stream for i, img in zip(b["_id"], b["image"], strict=True)}
            paths = sql(remote, "SELECT _id, path FROM imgs WHERE label < 3").to_pylist()
            copies = remote.copies
        assert sorted(seen) == sorted(row["_id"] for row in paths)
        for row in paths:
            expected = decode_image((image_folder / row["path"]).read_bytes(), size=16)
            assert np.array_equal(seen[row["_id"]], expected)
        assert copies.prepared_bytes == len(paths) * 16 * 16 * 3
        assert copies.copied_bytes == 2 * copies.prepared_bytes
    finally:
        service.stop()
        runner.join(TIMEOUT)
    assert not runner.is_alive()


def scheduling_policies(pid: int) -> dict[str, int]:
    """``{thread name: scheduling policy}`` of process ``pid`` and its live descendants
    (``/proc``: the decode processes are the forkserver's children)."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            kids.setdefault(int(stat[stat.rfind(")") + 2 :].split()[1]), []).append(int(entry.name))
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        todo += kids.get(p, [])
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.find("(") + 1 : stat.rfind(")")]
            out[f"{p}/{task.name} {name}"] = int(stat[stat.rfind(")") + 2 :].split()[38])
    return out


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_the_service_yields_to_jobs_on_wake_ups(service, cat_dir):
    """Every thread and decode process of ``tabloader serve`` runs under SCHED_BATCH (a job's
    request does not preempt the job on its own core); the job keeps the default policy."""
    with RemoteLoader(cat_dir, start=False) as remote:
        remote.wait_ready()  # the decode processes started
        with remote.open("a", batch_size=4, epochs=1) as stream:
            stream.take()
            policies = scheduling_policies(service.pid)
    assert len(policies) > 5  # threads, the forkserver, its decode processes
    assert set(policies.values()) == {os.SCHED_BATCH}, policies
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


STARTS = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from tabloader.service._client import RemoteLoader
    with RemoteLoader(sys.argv[1]) as remote:  # none runs: this starts one
        if sys.argv[3] == "ready":
            remote.wait_ready()
        with remote.open(sys.argv[2], batch_size=4, epochs=1) as stream:
            stream.take()
            pid = remote.service_pid
            fields = lambda p: (p / "stat").read_text().rsplit(")", 1)[1].split()
            threads = [  # when the service's threads started (clock ticks since boot)
                int(fields(t)[19]) for t in Path(f"/proc/{pid}/task").iterdir()
                if t.name != str(pid)
            ]
            parents = {}  # every process's parent
            for p in Path("/proc").iterdir():
                try:
                    if p.name.isdigit():
                        parents[int(p.name)] = int(fields(p)[1])
                except OSError:
                    continue
            cmdline = lambda p: Path(f"/proc/{p}/cmdline").read_text()
            # the resource tracker and the forkserver, and the processes each forked
            children = {
                cmdline(c): [k for k, q in parents.items() if q == c]
                for c, p in parents.items() if p == pid
            }
            service = cmdline(pid)
    print(json.dumps({"pid": pid, "children": children, "threads": threads, "cmd": service}))
    """
)


def _started(tmp_path, cat_dir, job: str, ready: str) -> dict:
    script = tmp_path / "starts.py"
    script.write_text(STARTS)
    env = {**os.environ, "TABLOADER_IDLE_EXIT": "5"}
    out = subprocess.run(
        [sys.executable, str(script), str(cat_dir), job, ready],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT * 2,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _stop(pid: int) -> None:
    """Stopped now rather than idle 5 s (its idle exit stops it if this process dies)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not _alive(pid), "the service to stop")


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_a_started_service_starts_decode_processes_when_asked_under_sched_batch(cat_dir, tmp_path):
    """A service a client starts yields to jobs (SCHED_BATCH, its threads and processes);
    ``wait_ready`` starts its decode processes (a catalog of images)."""
    started = _started(tmp_path, cat_dir, "a", "ready")
    try:
        # the forkserver is the service's own fork (the zygote), no interpreter of its own
        assert not [cmd for cmd in started["children"] if "forkserver" in cmd], started
        decoders = started["children"][started["cmd"]]  # the Loader's default: a core each
        assert len(decoders) == max(2, os.cpu_count() or 2), started
        policies = scheduling_policies(started["pid"])  # idle: until it exits, 5 s later
        assert len(policies) > 5  # threads, the forkserver, its decode processes
        assert set(policies.values()) == {os.SCHED_BATCH}, policies
    finally:
        _stop(started["pid"])


def test_a_started_service_serving_augmented_jobs_starts_no_decode_process(cat_dir, tmp_path):
    """An augmented job's shared decode is made in the service's threads: its decode
    processes (a forkserver and its imports, a core taken from the first batch) never start."""
    with catalog.open_catalog(cat_dir) as cat:
        cat.sql("REGISTER JOB aug SELECT image FROM imgs WITH (augment = 'RandomResizedCrop(8)')")
    started = _started(tmp_path, cat_dir, "aug", "no")
    try:
        assert not [cmd for cmd in started["children"] if "forkserver" in cmd], started
        assert started["children"][started["cmd"]] == [], started  # the zygote forked none
    finally:
        _stop(started["pid"])


LEAVES = textwrap.dedent(
    """
    import sys
    from tabloader.torch import JobDataset
    data = JobDataset(sys.argv[2], catalog=sys.argv[1], batch_size=4)  # starts the service
    batch = next(iter(data))
    data.close()
    print(data.loader.service_pid)
    """
)


def test_a_script_that_started_the_service_exits_without_resource_warnings(cat_dir, tmp_path):
    """A training script's JobDataset connects through the process's shared connection and
    starts the service; at exit that connection closes and the service stays up, detached,
    with nothing left for ``-X dev`` to warn about (an unclosed socket, a running child)."""
    script = tmp_path / "leaves.py"
    script.write_text(LEAVES)
    dev = ["-X", "dev", "-W", "error::ResourceWarning"]
    out = subprocess.run(
        [sys.executable, *dev, str(script), str(cat_dir), "a"],
        env={**os.environ, "TABLOADER_IDLE_EXIT": "5"},
        capture_output=True,
        text=True,
        timeout=TIMEOUT * 2,
    )
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    try:
        assert "Warning" not in out.stderr, out.stderr
        assert _alive(pid)  # it outlives the script that started it
    finally:
        _stop(pid)


DIALS = textwrap.dedent(
    """
    import sys, time
    from tabloader.service._client import RemoteLoader
    go = float(sys.argv[2])
    while time.time() < go:  # the four processes dial at one instant
        time.sleep(0.001)
    with RemoteLoader(sys.argv[1]) as remote:
        print(remote.service_pid)
    """
)


def test_clients_that_find_no_service_start_one_between_them(cat_dir, tmp_path):
    """Four processes that find no service at once: one starts it, the others wait for the
    start lock and connect to it; no second service starts only to find the catalog taken."""
    script = tmp_path / "dials.py"
    script.write_text(DIALS)
    go = str(time.time() + 2.0)
    env = {**os.environ, "TABLOADER_IDLE_EXIT": "5"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(cat_dir), go],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=TIMEOUT * 2) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    pids = {int(out.strip()) for out, _ in outs}
    assert len(pids) == 1
    try:
        log = (runtime_dir(cat_dir) / "service.log").read_text()
        assert log.count("service._server: serving catalog") == 1, log
        assert "already runs" not in log, log
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids.pop(), signal.SIGTERM)


def _background_serve(root: Path, log) -> subprocess.Popen:
    """``tabloader serve`` as a client starts it (``client.SERVE``, marked as started by
    this process), its output into ``log``."""
    from tabloader.service import _client as client

    return subprocess.Popen(
        [
            *(sys.executable, "-c", client.SERVE, "--catalog", str(root), "serve"),
            *("--idle-exit", "60", "--workers", "2", "--cache-bytes", str(16 << 20)),
        ],
        stdout=log,
        stderr=log,
        env={**os.environ, STARTER_ENV: str(os.getpid())},
    )


def test_a_service_that_loses_the_race_to_start_says_so_in_one_line_and_exits_0(cat_dir):
    """Two services started at once for one catalog, as two clients would start them: one
    serves; the other writes one line naming it and exits 0, no traceback, no error."""
    log_path = runtime_dir(cat_dir) / "service.log"
    with open(log_path, "ab") as log:
        procs = [_background_serve(cat_dir, log) for _ in range(2)]
    try:
        wait_for(lambda: any(p.poll() is not None for p in procs), "one service to end")
        loser = next(p for p in procs if p.poll() is not None)  # it lost the race
        winner = procs[1 - procs.index(loser)]
        assert loser.returncode == 0
        with RemoteLoader(cat_dir, start=False) as remote:
            assert remote.service_pid == winner.pid
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(TIMEOUT)
    log = log_path.read_text()
    lost = [line for line in log.splitlines() if "already serves" in line]
    assert lost == [
        f"WARNING tabloader.service._server: another tabloader service (pid {winner.pid}) "
        f"already serves catalog {cat_dir}; this one (pid {loser.pid}, started by pid "
        f"{os.getpid()}) exits"
    ], log
    assert "Traceback" not in log, log
    assert "Error" not in log, log


def test_a_client_waits_for_a_lock_holder_then_starts_the_service_it_left_undone(cat_dir, tmp_path):
    """A service that holds the catalog's lock without answering (starting, or stopping after
    its idle time) is waited for, not joined by a second that finds the lock taken; when it
    goes away without answering, the client starts one."""
    script = tmp_path / "dial.py"
    script.write_text(DIALS)
    lock = os.open(runtime_dir(cat_dir) / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a service holds it
        os.write(lock, f"{os.getpid()}\n".encode())
        proc = subprocess.Popen(
            [sys.executable, str(script), str(cat_dir), "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "TABLOADER_IDLE_EXIT": "5"},
        )
        starting = os.open(runtime_dir(cat_dir) / "starting", os.O_RDWR | os.O_CREAT, 0o600)
        try:  # the client holds the start lock: it found no service, and waits in _start
            wait_for(lambda: not _try_flock(starting), "the client to take the start lock")
        finally:
            os.close(starting)
        time.sleep(3)  # what a second service took to start and find the lock taken, before
    finally:
        os.close(lock)  # the holder goes away without ever answering
    out, err = proc.communicate(timeout=TIMEOUT * 2)
    assert proc.returncode == 0, err
    try:
        log = (runtime_dir(cat_dir) / "service.log").read_text()
        assert log.count("service._server: serving catalog") == 1, log
        assert "already" not in log, log
    finally:
        _stop(int(out))


def _try_flock(fd: int) -> bool:
    """Whether ``fd``'s lock was free (taken and dropped again)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def test_status_shows_the_running_service_its_jobs_and_decodes(service, cat_dir):
    remote = RemoteLoader(cat_dir, start=False)
    try:
        with remote.open("a", batch_size=8, epochs=1) as stream:
            stream.take()
            run = [sys.executable, "-m", "tabloader", "--catalog", str(cat_dir), "status"]
            text = subprocess.run(run, capture_output=True, text=True, timeout=TIMEOUT)
            raw = subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=60)
    finally:
        remote.close()
    assert text.returncode == raw.returncode == 0, text.stderr + raw.stderr
    assert text.stdout.startswith(f"Loader service pid {service.pid} for catalog {cat_dir}")
    lines = text.stdout.splitlines()
    assert lines[1] == f"clients: 1 (pid {os.getpid()}: a)"
    assert any(line.split()[:3] == ["a", "imgs", "1"] for line in lines)
    assert re.search(r"\(\d+\.\d% full\).*; hit rate \d+\.\d% \(\d+ hits", text.stdout)
    stats = json.loads(raw.stdout)
    assert stats["service_pid"] == service.pid
    assert stats["decodes"] >= 8  # the first batch was decoded
    # this process: one connection, its loader's, which its job's stream took (the open was
    # its only request before the first batch); not the status
    job = {"job": "a", "rank": 0, "world_size": 1}
    assert stats["clients"] == [{"pid": os.getpid(), "connections": 1, "jobs": [job]}]
    [a] = stats["jobs"]
    assert (a["job"], a["dataset"], a["batches"], a["epoch"]) == ("a", "imgs", 1, 0)
    assert a["rows_per_s"] > 0
    assert a["wait_s"] > 0
    cache = stats["cache"]
    assert cache["hit_rate"] == cache["hits"] / (cache["hits"] + cache["misses"])
    # every row of the first batch was looked up, the cold cache's first looks missed (rows
    # decoded ahead of their batch are decodes without a miss: misses may be fewer than them)
    assert cache["hits"] + cache["misses"] >= 8
    assert cache["misses"] > 0
    assert 0 < cache["fill"] < 1


SHADOWED = textwrap.dedent(
    """
    import json, os, sys, tabloader
    from tabloader.service._client import RemoteLoader, service_loader
    with RemoteLoader(sys.argv[1]) as remote:  # no service runs: this starts one
        table = tabloader.connect(sys.argv[1]).sql("SELECT count(*) AS n FROM imgs")
        proc = f"/proc/{remote.service_pid}"
        env = dict(v.split("=", 1) for v in open(f"{proc}/environ").read().split("\\0") if v)
        n = table.column("n")[0].as_py()
        out = {"pid": remote.service_pid, "n": n, "cwd": os.readlink(f"{proc}/cwd")}
        print(json.dumps({**out, "pythonpath": env.get("PYTHONPATH")}))
    """
)


def test_a_catalog_folder_in_the_clients_directory_cannot_shadow_the_started_service(
    cat_dir, tmp_path
):
    """The service a client starts runs in / with the client's packages: ``python -m`` in the
    client's directory imported a ./catalog or ./tabloader folder there instead."""
    work = tmp_path / "work"
    for name in ("catalog", "tabloader"):
        (work / name).mkdir(parents=True)
        (work / name / "__init__.py").write_text(f"raise ImportError('./{name} was imported')\n")
    script = tmp_path / "client.py"  # sys.path[0] is the script's folder, not the cwd
    script.write_text(SHADOWED)
    # a relative PYTHONPATH entry means the client's directory, for the service too
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths.append(str(tmp_path / "lib"))
    pythonpath = os.pathsep.join(os.path.relpath(p, work) for p in paths)
    env = {**os.environ, "TABLOADER_IDLE_EXIT": "1", "PYTHONPATH": pythonpath}
    out = subprocess.run(
        [sys.executable, str(script), str(cat_dir)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT * 2,
    )
    assert out.returncode == 0, out.stderr
    started = json.loads(out.stdout)
    assert started["n"] == 60
    assert started["cwd"] == "/"
    assert started["pythonpath"] == os.pathsep.join(os.path.abspath(p) for p in paths)
    wait_for(lambda: not _alive(started["pid"]), "the idle service to stop")


@pytest.fixture
def elsewhere(tmp_path, image_folder, monkeypatch):
    """A working directory other than the service's, holding a copy of the image folder
    as ``more`` (relative paths in statements mean paths in it)."""
    work = tmp_path / "elsewhere"
    work.mkdir()
    shutil.copytree(image_folder, work / "more")
    monkeypatch.chdir(work)
    return work


def test_relative_paths_of_a_client_mean_its_own_directory(service, cat_dir, elsewhere):
    with tabloader.connect(cat_dir) as cat:
        assert cat.service_pid == service.pid
        created = cat.sql("CREATE DATASET more FROM 'more' FORMAT imagefolder")
        assert (created.name, created.version, created.num_rows) == ("more", 1, 60)
        appended = cat.sql("APPEND TO DATASET more FROM './more'")
        assert (appended.version, appended.num_rows) == (2, 120)
        again = cat.import_imagefolder("again", "more")
        assert (again.name, again.version, again.num_rows) == ("again", 1, 60)
        with pytest.raises(ImportFailedError, match=re.escape(f"'{elsewhere / 'missing'}'")):
            cat.sql("CREATE DATASET gone FROM 'missing'")
        with pytest.raises(ImportFailedError, match=re.escape(f"'{elsewhere / 'missing'}'")):
            cat.import_imagefolder("gone", "missing")
    run = [sys.executable, "-m", "tabloader", "--catalog", str(cat_dir)]
    out = subprocess.run(
        [*run, "sql", "CREATE DATASET cli FROM 'more'"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert (out.returncode, out.stdout.split(":")[0]) == (0, "Dataset cli version 1"), out.stderr
    out = subprocess.run(
        [*run, "import", "cli2", "more"], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert (out.returncode, out.stdout.split(":")[0]) == (0, "Dataset cli2 version 1"), out.stderr
    out = subprocess.run(
        [*run, "sql", "CREATE DATASET gone FROM 'missing'"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert out.returncode == 1
    assert f"No such file or directory: '{elsewhere / 'missing'}'" in out.stderr


def test_an_import_through_the_service_refuses_a_link_out_unless_follow_links(
    service, cat_dir, elsewhere, tmp_path
):
    """``follow_links`` reaches the service's import (``import_imagefolder``, ``tabloader import
    --follow-links`` and ``WITH (follow_links = true)``); a refusal leaves nothing behind."""
    secret = tmp_path / "secret"
    first_class = min(p for p in (elsewhere / "more").iterdir() if p.is_dir())
    shutil.copytree(first_class, secret)  # a class folder outside, linked in as one more class
    (elsewhere / "more" / "linked").symlink_to(secret)
    link_out = re.escape(f"'{elsewhere / 'more' / 'linked'}' is a symbolic link to '{secret}'")
    data = cat_dir / "data"
    before = sorted(data.rglob("*"))
    run = [sys.executable, "-m", "tabloader", "--catalog", str(cat_dir)]
    with tabloader.connect(cat_dir) as cat:
        assert cat.service_pid == service.pid
        with pytest.raises(ImportFailedError, match=f"^{link_out}, outside the imported folder"):
            cat.import_imagefolder("more", "more")
        with pytest.raises(ImportFailedError, match=f"^{link_out}, outside the imported folder"):
            cat.sql("CREATE DATASET more FROM 'more'")
        out = subprocess.run(
            [*run, "import", "more", "more"], capture_output=True, text=True, timeout=TIMEOUT
        )
        assert out.returncode == 1
        assert re.search(f"{link_out}, outside the imported folder", out.stderr), out.stderr
        assert "more" not in cat.dataset_names()
        assert sorted(data.rglob("*")) == before
        linked = len(os.listdir(secret))
        assert cat.import_imagefolder("more", "more", follow_links=True).num_rows == 60 + linked
        more2 = cat.sql("CREATE DATASET more2 FROM 'more' WITH (follow_links = true)")
        assert (more2.name, more2.version, more2.num_rows) == ("more2", 1, 60 + linked)
    out = subprocess.run(
        [*run, "import", "more3", "more", "--follow-links"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert (out.returncode, out.stdout.split(":")[0]) == (0, "Dataset more3 version 1"), out.stderr
    assert service.poll() is None  # the import went through the service, which still runs


def test_serve_access_log_records_the_clients_look_ups_and_releases(cat_dir, tmp_path):
    """``serve --access-log``: written when the service stops, each look-up released once
    (by the client's release of its batch, as the pins were)."""
    path = tmp_path / "access.npz"
    proc = start_service(cat_dir, "--access-log", str(path))
    try:
        with (
            RemoteLoader(cat_dir, start=False) as remote,
            remote.open("a", batch_size=4, epochs=1) as stream,
        ):
            seen = [i for b in stream for i in b["_id"].tolist()]
            expected = rows_of(remote, "label < 3")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)
    assert sorted(seen) == expected
    with np.load(path) as log:
        kind, row = log["kind"], log["row"]
    assert sorted(row[kind == 1].tolist()) == expected
    assert sorted(row[kind == 0].tolist()) == expected


def test_a_stopped_service_is_reported_as_not_answering(cat_dir, capsys, monkeypatch):
    """SIGSTOP: the service holds the catalog but answers nobody. ``status`` and ``sql`` say
    so with its pid, instead of "no service" or "locked, see status"."""
    from tabloader.cli import main
    from tabloader.service import _protocol as protocol

    monkeypatch.setattr(protocol, "CONNECT_TIMEOUT_S", 1.0)  # three commands wait for it

    proc = start_service(cat_dir)
    try:
        proc.send_signal(signal.SIGSTOP)
        for argv in (["status"], ["sql", "SHOW JOBS"], ["verify"]):
            assert main(["--catalog", str(cat_dir), *argv]) == 1
            err = capsys.readouterr().err
            assert err.count("\n") == 1, err
            assert re.search(
                rf"^ServiceStuckError: .*: pid {proc.pid} does not answer \(stopped or hung\); "
                rf"resume it with `kill -CONT {proc.pid}`, or end it with `kill {proc.pid}`",
                err,
            ), err
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)


def test_verify_beside_a_service_says_to_stop_it(served, capsys):
    service, cat_dir = served.proc, served.root
    from tabloader.cli import main

    assert main(["--catalog", str(cat_dir), "verify"]) == 1
    err = capsys.readouterr().err
    assert re.search(
        rf"^CatalogLockedError: verify reads catalog .* itself, and its loader service "
        rf"\(pid {service.pid}\) holds it: stop the service \(`kill {service.pid}`",
        err,
    ), err


def test_a_job_held_by_another_client_says_so(service, cat_dir):
    first, second = Client(cat_dir), Client(cat_dir)
    try:
        first.call("open", request=OpenRequest.make("a", rank=0, world_size=1).to_wire())
        with pytest.raises(
            LoaderError,
            match=r"Job 'a' is open already in the loader service, by another process or another "
            r"stream of this one \(`tabloader status` lists the clients and their jobs\): close",
        ):
            second.call("open", request=OpenRequest.make("a", rank=0, world_size=1).to_wire())
    finally:
        first.close()
        second.close()


def test_a_failed_start_quotes_only_its_own_log_lines(cat_dir, monkeypatch):
    log = runtime_dir(cat_dir) / "service.log"
    log.write_text("2020-01-01 pid 1 ERROR an old service: OLD LINE\n")
    monkeypatch.setenv("TABLOADER_CACHE_BYTES", "abc")
    with pytest.raises(
        ServiceError, match=r"did not start: CatalogError: \$TABLOADER_CACHE_BYTES"
    ) as info:
        RemoteLoader(cat_dir)
    assert "OLD LINE" not in str(info.value)


def test_a_job_asks_the_service_once_before_its_first_batch(served, monkeypatch):
    """One connection and one request before the first batch: the open (its reply maps the
    service's memory) with the first ``next`` behind it, both sent before either reply is
    read; the batch after is asked for as the job computes (it reads one ahead)."""
    service, cat_dir = served.proc, served.root
    from tabloader.torch import JobDataset

    log: list[str] = []

    def counted(name, what):
        real = getattr(Client, name)

        def wrapper(self, *args, **kwargs):
            log.append(what(args))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Client, name, wrapper)

    counted("__init__", lambda args: "connect")
    counted("send", lambda args: args[0])
    counted("receive", lambda args: "reply")
    counted("call", lambda args: f"call {args[0]}")
    counted("call_fds", lambda args: f"call {args[0]}")
    remote = RemoteLoader(cat_dir, start=False)
    ds = JobDataset("a", loader=remote, batch_size=4, epochs=1)
    try:
        batch = next(iter(ds))
        assert log == ["connect", "open", "next", "reply", "reply", "next"]
        assert batch["image"].shape == (4, 16, 16, 3)
        assert ds.spec.values == {"image_size": 16, "batch_size": 4}  # REGISTER's + ours
        assert remote.service_pid == service.pid  # the open's reply said
        assert log[6:] == []  # without asking
    finally:
        ds.close()
        remote.close()


def test_ranks_report_losses_through_the_service_and_a_resume_keeps_the_scores(cat_dir):
    """Two ranks of an importance job report through the service into one set of scores;
    its state carries them to a resume; a plain job's report and garbage get one-line errors
    and the service goes on."""
    from tabloader.sampling._importance import PRIOR, ImportanceScores

    with catalog.open_catalog(cat_dir) as cat:
        cat.sql(
            "REGISTER JOB imp SELECT image, label FROM imgs WHERE label < 3 "
            "WITH (image_size = 16, importance = 'loss')"
        )
    proc = start_service(cat_dir)
    try:
        with RemoteLoader(cat_dir, start=False) as remote:
            ranks = [remote.open("imp", batch_size=4, rank=r, world_size=2) for r in (0, 1)]
            reported: dict[int, int] = {}  # row -> rank + 1 of the report that scored it
            for stream in ranks:
                ids = stream.take()["_id"]
                losses = np.arange(ids.size, dtype=np.float32)[::-1]  # the first row: highest
                stream.report(ids, losses)
                mine: dict[int, int] = {}  # a row twice in a batch keeps its higher rank
                for k, i in enumerate(ids.tolist()):
                    mine[i] = max(mine.get(i, 0), ids.size - k)
                reported.update(mine)  # a later report replaces an earlier one
            state = ranks[0].state_dict()
            scores = ImportanceScores.from_state(state["importance"])
            got = dict(zip(scores.ids.tolist(), scores.ranks.tolist(), strict=True))
            assert {r: got[r] for r in reported} == reported  # both ranks' rows, as reported
            assert sum(v > 0 for v in got.values()) == len(reported)
            assert scores.scores.max() > PRIOR
            for stream in ranks:
                stream.close()
            with remote.open("imp", batch_size=4, state=state, rank=0, world_size=1) as again:
                again.take()
                after = ImportanceScores.from_state(again.state_dict()["importance"])
            np.testing.assert_array_equal(after.ranks, scores.ranks)
            with remote.open("a", batch_size=4, epochs=1) as plain:
                ids = plain.take()["_id"]
                with pytest.raises(LoaderError, match=r"register it WITH \(importance = 'loss'\)"):
                    plain.report(ids, np.zeros(ids.size))
                assert plain.take() is not None  # the stream goes on
            raw = Client(cat_dir)
            with pytest.raises(ServiceError, match="'ids' must be hex"):
                raw.call("report", ids=[1, 2], losses="00" * 8)
            with pytest.raises(ServiceError, match="'losses' is not hex"):
                raw.call("report", ids="00" * 8, losses="zz" * 8)
            with pytest.raises(LoaderError, match="No job is open on this connection"):
                raw.call("report", ids="00" * 8, losses="00" * 8)
            raw.close()
            assert remote.alive()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)
