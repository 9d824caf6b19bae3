"""Chaos: clients stopped and killed, a decode process and the service killed, mid-epoch.

Five jobs read in their own processes, each writing every batch it takes (epoch, row, a digest
of each value) with the ``state_dict()`` after it, one line per batch: a checkpoint. Faults hit
them one after another while they read; afterwards every job that carried on has read each of
its epochs exactly once (the lines of a job's file, across its processes), every value equal to
the source, and nothing is left: no process, socket, shared memory or temporary folder.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from pyroaring import BitMap

from tabloader import catalog
from tabloader.engine._arena.shm import process_alive, shm_available
from tabloader.engine.decode import decode_image
from tabloader.service._client import RemoteLoader
from tabloader.service._protocol import runtime_dir, socket_path
from tests.support.polling import wait_for
from tests.support.service import TIMEOUT, descendants, start_service
from tests.support.shm import named_shm_of

pytestmark = [
    pytest.mark.skipif(not shm_available(), reason="no /dev/shm (O_TMPFILE) on this system"),
    pytest.mark.slow,  # about 30 s: two services and a dozen client processes
]


def digest(x: np.ndarray) -> str:
    """A value's digest (its shape and bytes), here and in the client."""
    x = np.ascontiguousarray(x)
    return hashlib.sha256(repr(x.shape).encode() + x.tobytes()).hexdigest()[:16]


CLIENT = "import hashlib\nimport numpy as np\n" + inspect.getsource(digest)
CLIENT += textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from tabloader.catalog._errors import ServiceError
    from tabloader.service._client import RemoteLoader
    from tabloader.engine._opening import state_from_wire, state_to_wire

    root, job, out, more = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    lines = out.read_text().splitlines() if out.exists() else []
    options = {"batch_size": 4}
    if lines:  # resume from the last checkpoint, then read `more` epochs from there
        options["state"] = state_from_wire(json.loads(lines[-1])["state"])
    options["epochs"] = options.get("state", {}).get("epoch", 0) + more

    try:
        with RemoteLoader(root, start=False) as remote, remote.open(job, **options) as s:
            with out.open("a") as f:
                while True:
                    epoch = s.epoch
                    batch = s.take()
                    if batch is None:
                        break
                    images = batch.get("image", [None] * len(batch["_id"]))
                    rows = [
                        [epoch, int(i), None if img is None else digest(img), int(label)]
                        for i, img, label in zip(batch["_id"], images, batch["label"])
                    ]
                    state = state_to_wire(s.state_dict())  # after this batch
                    f.write(json.dumps({"rows": rows, "state": state}) + "\\n")
                    f.flush()
                    time.sleep(0.05)  # the job's compute
    except ServiceError as exc:
        print(exc, flush=True)
        sys.exit(3)
    """
)

# job -> its image_size: a, b and c0 (labels only) of ``cat_dir``, d and e made here
SIZES = {"a": 16, "b": 16, "c0": None, "d": 24, "e": 20}
# job -> the file of its batches (b's first client is killed: b2 is its fresh start)
OUTS = {"a": "a.jsonl", "b": "b2.jsonl", "c0": "c0.jsonl", "d": "d.jsonl", "e": "e.jsonl"}
FOREVER = 1000  # epochs: a client of the first service reads until it is stopped


def _expected(root: Path) -> dict[str, dict[int, tuple[str | None, int]]]:
    """Every job's rows: ``{job: {row: (digest of its decoded image, label)}}``."""
    expected = {}
    with catalog.open_catalog(root) as cat:
        for job, size in SIZES.items():
            ids = sorted(int(i) for i in cat.job(job).ids)
            table = cat.dataset("imgs").take(ids, ["image", "label"])
            values = {}
            for i, raw, label in zip(ids, table["image"], table["label"].to_pylist(), strict=True):
                image = None if size is None else decode_image(raw.as_buffer(), size=size)
                values[i] = (None if image is None else digest(image), label)
            expected[job] = values
    return expected


def _lines(out: Path) -> list[dict]:
    """The checkpoints a client wrote (a last line cut short by a SIGKILL left out)."""
    if not out.exists():
        return []
    found = []
    for line in out.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return found


def _check(job: str, out: Path, expected: dict[int, tuple[str | None, int]], *, whole: bool):
    """Every value of ``out`` equals the source and no row comes twice in an epoch; with
    ``whole``, every epoch has every row of the job."""
    epochs: dict[int, Counter[int]] = {}
    for line in _lines(out):
        for epoch, row, value, label in line["rows"]:
            assert (value, label) == expected[row], f"job {job}: row {row} of epoch {epoch}"
            epochs.setdefault(epoch, Counter())[row] += 1
    assert epochs, f"job {job} read nothing"
    for epoch, rows in epochs.items():
        assert max(rows.values()) == 1, f"job {job}: rows twice in epoch {epoch}"
        if whole:
            assert sorted(rows) == sorted(expected), f"job {job}: epoch {epoch} not whole"
    if whole:
        assert sorted(epochs) == list(range(len(epochs)))
    return len(epochs)


def _decode_pids(service: int) -> set[int]:
    """The decode processes of a service: its forkserver's children."""
    return {p for p in descendants(service) if _ppid(p) != service and process_alive(p)}


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None


def _held(path: Path) -> bool:
    """Whether a live process maps or opens ``path``."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if str(path) in (proc / "maps").read_text():
                return True
            if any(os.readlink(fd) == str(path) for fd in (proc / "fd").iterdir()):
                return True
        except OSError:
            continue
    return False


def test_chaos_every_surviving_job_reads_each_epoch_once_and_nothing_is_left(
    cat_dir,
    tmp_path,
    short_tmp,
):
    with catalog.open_catalog(cat_dir) as cat:
        cat.sql("REGISTER JOB d SELECT image, label FROM imgs WITH (image_size = 24)")
        cat.sql(
            "REGISTER JOB e SELECT image, label FROM imgs WHERE label >= 2 WITH (image_size = 20)"
        )
    expected = _expected(cat_dir)
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    tmp, client_tmp = short_tmp / "tmp", short_tmp / "client-tmp"  # private $TMPDIRs
    tmp.mkdir()
    client_tmp.mkdir()
    shm_before = set(Path("/dev/shm").iterdir())
    procs: list[subprocess.Popen] = []
    services: list[subprocess.Popen] = []
    helpers: set[int] = set()  # every process the services started
    stopped: set[int] = set()  # decode processes stopped, until they are continued
    remote = None

    def client(job: str, out: str, more: int = FOREVER) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(cat_dir), job, str(tmp_path / out), str(more)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "TMPDIR": str(client_tmp)},
        )
        procs.append(proc)
        return proc

    def count(out: str) -> int:  # the batches a client wrote
        return (tmp_path / out).read_bytes().count(b"\n") if (tmp_path / out).exists() else 0

    def read(out: str, n: int) -> None:
        wait_for(lambda: count(out) >= n, f"{out} to have {n} batches")

    def finish(proc: subprocess.Popen, code: int) -> str:
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == code, err.decode()[-3000:]
        return out.decode()

    try:
        services.append(start_service(cat_dir, env={"TMPDIR": str(tmp)}))
        first = services[0].pid
        remote = RemoteLoader(cat_dir, start=False)  # the test's own view of the service
        clients = {job: client(job, f"{job}.jsonl") for job in ("a", "b", "c0")}
        read("a.jsonl", 2)
        clients["a"].send_signal(signal.SIGSTOP)  # stopped mid-epoch, its read-ahead pinned
        read("b.jsonl", 3)
        clients["b"].kill()  # mid-epoch: its job leaves, the others go on
        finish(clients.pop("b"), -signal.SIGKILL)
        wait_for(lambda: "b" not in remote.stats()["jobs"], "the killed client to leave")
        clients["b"] = client("b", "b2.jsonl")  # b again, from nothing: a fresh start
        decoders = _decode_pids(first)
        assert decoders, descendants(first)
        stopped |= decoders
        for pid in decoders:  # d's rows (a size nobody read yet) stay in flight in them
            os.kill(pid, signal.SIGSTOP)
        clients["d"] = client("d", "d.jsonl")
        wait_for(lambda: "d" in remote.stats()["jobs"], "job d to open")
        killed = min(decoders)
        os.kill(killed, signal.SIGKILL)
        for pid in decoders - {killed}:  # (the killed one may be reaped already: no such pid)
            os.kill(pid, signal.SIGCONT)
        stopped.clear()
        clients["a"].send_signal(signal.SIGCONT)
        clients["e"] = client("e", "e.jsonl")  # another new size: decoded by new processes
        read("e.jsonl", 2)
        wait_for(  # the pool of the dead process goes; another takes its place
            lambda: _decode_pids(first) and not _decode_pids(first) & decoders,
            "the decode processes to be replaced",
        )
        assert not process_alive(killed)
        for out, n in [(out, count(out)) for out in OUTS.values()]:  # every job reads on after them
            read(out, n + 2)
        helpers |= descendants(first)
        remote.close()
        # nothing of the service, its helpers or its clients has a name in /dev/shm
        assert not named_shm_of(first, *helpers, *(p.pid for p in procs))
        assert list((runtime_dir(cat_dir) / "mp").iterdir())  # multiprocessing's folder (the
        assert not list(tmp.iterdir())  # forkserver's socket): the service's own, not $TMPDIR's
        services[0].kill()  # mid-epoch of every job
        services[0].wait(TIMEOUT)
        for job, proc in clients.items():  # each fails with the reason, in bounded time
            assert "lost the tabloader service" in finish(proc, 3), job
        left = {  # the rows of its epoch each job has still to read, at its last checkpoint
            job: len(
                BitMap.deserialize(bytes.fromhex(_lines(tmp_path / out)[-1]["state"]["remaining"]))
            )
            for job, out in OUTS.items()
        }
        assert any(0 < n < len(expected[job]) for job, n in left.items()), left  # mid-epoch
        wait_for(lambda: not any(map(process_alive, helpers)), "the decode processes to exit")
        assert not list(tmp.iterdir())  # the killed service left no temporary folder

        services.append(start_service(cat_dir, env={"TMPDIR": str(tmp)}))
        resumed = [client(job, out, 2) for job, out in OUTS.items()]  # from their checkpoints
        for proc in resumed:
            finish(proc, 0)
        helpers |= descendants(services[1].pid)
        services[1].send_signal(signal.SIGTERM)
        assert services[1].wait(TIMEOUT) == 0
    finally:
        for proc in services:
            if proc.poll() is None:
                helpers |= descendants(proc.pid)
        if remote is not None:
            remote.close()
        for pid in stopped:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for proc in procs + services:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=TIMEOUT)
        for pid in helpers:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)

    for job, out in OUTS.items():
        epochs = _check(job, tmp_path / out, expected[job], whole=True)
        assert epochs >= 2, job  # read on both services
    _check("b", tmp_path / "b.jsonl", expected["b"], whole=False)  # the killed one: no wrong value
    wait_for(lambda: not any(map(process_alive, helpers)), "the service's processes to exit")
    assert not list(tmp.iterdir())
    assert not list(client_tmp.iterdir())
    assert not socket_path(cat_dir).exists()
    assert not [p for p in runtime_dir(cat_dir).iterdir() if p.is_socket()]
    left = {p for p in set(Path("/dev/shm").iterdir()) - shm_before if p.exists()}
    assert not {p for p in left if not _held(p)}  # (another live process's files are its own)
