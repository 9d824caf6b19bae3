"""Many processes, one catalog, no service: DuckDB lets one process at a time open the file,
so the others wait for it (``catalog.lock_wait``) instead of failing with
``CatalogLockedError``; a service that starts while a script holds the catalog waits too,
and clients that come meanwhile go through it. A holder that never lets go ends the wait
with an error naming it and the ways out.

The processes are forked at once from one interpreter that imported first (their imports, a
second or more each on 2 cores, would otherwise spread them out, and 16 of them cost the
suite ~40 s of CPU): each then opens its own catalog connection, lock and sockets, as a
process of its own, and exits as an interpreter does. Every wait is bounded."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tabloader
from tabloader import catalog, cli
from tabloader.catalog._errors import CatalogLockedError, ServiceError
from tabloader.service._client import RemoteLoader
from tabloader.service._protocol import runtime_dir, service_pid
from tests.support.polling import wait_for
from tests.support.service import TIMEOUT, start_service

PROCESSES = 16  # issue 45's case: 16 processes opening the catalog at once all succeed
# seconds for the one interpreter to import, then for all the processes to run what they run
STARTS, RUNS = 120, 240

# One interpreter imports, says ``ready``, waits for the test's line, then forks PROCESSES
# processes at once; process ``i`` writes its stdout and stderr to ``<out>/<i>.out`` and
# ``.err``, runs ``body(i)`` and exits as an interpreter does (threads joined, exit handlers
# run; an exception: its traceback and code 1). The interpreter prints each exit code.
GATED = """
import os, sys
root, out = sys.argv[1], sys.argv[2]
{imports}


def body(i):
{body}


print("ready", flush=True)
sys.stdin.readline()
children = []
for i in range({processes}):
    pid = os.fork()
    if pid == 0:
        for fd, suffix in ((1, "out"), (2, "err")):
            path = os.path.join(out, f"{{i}}.{{suffix}}")
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        body(i)
        sys.exit(0)
    children.append(pid)
for pid in children:
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""

# What opening the catalog imports (DuckDB, the catalog, the turns), imported before the fork
# as the parser is: sixteen copies of those imports in the children were CPU, not the race.
OPENING = "import tabloader.catalog._catalog\nimport tabloader.service._connection\n"

CONNECT = {
    "imports": OPENING + "import tabloader\nimport tabloader.catalog._sql.execute",
    "body": textwrap.dedent(
        """
        with tabloader.connect(root) as cat:
            cat.sql(f"REGISTER JOB j{i} SELECT label FROM imgs WHERE label = {i % 4}")
            print(len(cat.sql("SHOW JOBS")), flush=True)
        """
    ),
}

CLI = {
    "imports": OPENING + "import tabloader.catalog._sql.execute\nfrom tabloader import cli",
    "body": 'sys.exit(cli.main(["--catalog", root, "sql", '
    'f"REGISTER JOB k{i} SELECT label FROM imgs WHERE label = {i % 4}"]))',
}

JOBS = {
    "imports": OPENING + "import tabloader\nfrom tabloader.torch import JobDataset",
    "body": textwrap.dedent(
        """
        with tabloader.connect(root) as cat:  # a statement first, as a training script may
            rows = len(cat.job(f"c{i}").ids)
        ds = JobDataset(f"c{i}", catalog=root, batch_size=4, epochs=1)  # a job each
        batch = next(iter(ds))
        ds.close()
        print(rows, len(batch["_id"]), flush=True)
        """
    ),
}


def run_at_once(script: dict[str, str], root: Path) -> list:
    """``PROCESSES`` processes running ``script`` (its ``imports`` once, then its ``body`` at
    the same instant in all): their (return code, stdout, stderr)."""
    out = root.parent / "at-once"
    out.mkdir()
    code = GATED.format(
        imports=script["imports"],
        body=textwrap.indent(script["body"], "    "),
        processes=PROCESSES,
    )
    gate = subprocess.Popen(
        [sys.executable, "-c", code, str(root), str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TABLOADER_IDLE_EXIT": "3"},
        start_new_session=True,  # its processes in its group: killed with it on a hang
    )
    try:
        ready, _, _ = select.select([gate.stdout], [], [], STARTS)
        assert ready, "the processes' interpreter did not import in time"
        line = gate.stdout.readline()
        assert line == "ready\n", gate.communicate(timeout=TIMEOUT)
        stdout, stderr = gate.communicate("go\n", timeout=RUNS)
        assert gate.returncode == 0, stderr
        codes = [int(c) for c in stdout.split()]
        assert len(codes) == PROCESSES, stdout
        return [
            (c, (out / f"{i}.out").read_text(), (out / f"{i}.err").read_text())
            for i, c in enumerate(codes)
        ]
    finally:
        if gate.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(gate.pid, signal.SIGKILL)
            gate.communicate(timeout=TIMEOUT)


def failures(results: list) -> list[str]:
    """The last line of each failed process's stderr (its error)."""
    return [err.strip().splitlines()[-1] for code, _, err in results if code and err.strip()]


def stop_service(root: Path) -> None:
    """The service the clients started, stopped now (not once idle), and gone: it closes the
    catalog before it lets go of its lock (a test that opens the catalog next found it still
    held)."""
    pid = service_pid(root)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        wait_for(lambda: service_pid(root) is None, "the service to let the catalog go")


@pytest.fixture
def root(image_cat_dir):
    """A catalog of 60 images and a job per process, ``c0``..``c15``: 30 rows (labels only)."""
    with catalog.open_catalog(image_cat_dir) as cat:
        for i in range(PROCESSES):
            cat.sql(f"REGISTER JOB c{i} SELECT label FROM imgs WHERE label < 2")
    return image_cat_dir


def test_processes_that_connect_at_once_with_no_service_take_turns(root):
    results = run_at_once(CONNECT, root)
    assert [code for code, _, _ in results] == [0] * PROCESSES, failures(results)
    with catalog.open_catalog(root) as cat:
        assert {f"j{i}" for i in range(PROCESSES)} <= set(cat.job_names())
    assert service_pid(root) is None  # they opened the catalog in turn, none started a service


def test_cli_statements_at_once_with_no_service_all_run(root):
    results = run_at_once(CLI, root)
    assert [code for code, _, _ in results] == [0] * PROCESSES, failures(results)
    with catalog.open_catalog(root) as cat:
        assert {f"k{i}" for i in range(PROCESSES)} <= set(cat.job_names())


@pytest.mark.slow
@pytest.mark.timeout(STARTS + RUNS + 60)
def test_after_a_killed_service_clients_that_start_at_once_all_open_their_jobs(root):
    """The soak's case: the service is killed, and every client starts again at once: each
    runs a statement (which opens the catalog while no service runs), then opens its job
    (which starts a service: it waits for the catalog the statements hold, and the
    statements that come meanwhile go through it)."""
    service = start_service(root)
    service.kill()
    service.wait(TIMEOUT)
    try:
        results = run_at_once(JOBS, root)
    finally:
        stop_service(root)
    assert [code for code, _, _ in results] == [0] * PROCESSES, failures(results)
    with catalog.open_catalog(root) as cat:
        rows = len(cat.job("c0").ids)
    assert {out for _, out, _ in results} == {f"{rows} 4\n"}


HOLD = """
import sys, time
import tabloader
cat = tabloader.connect(sys.argv[1])
print("holding", flush=True)
time.sleep(float(sys.argv[2]))
cat.close()
"""


def test_a_service_started_while_a_script_holds_the_catalog_waits_for_it(root):
    """A job's service starts while a script's ``connect()`` holds the catalog: the service
    waits for it, and the job opens once the script lets go (the quick form of the test
    above)."""
    argv = [sys.executable, "-c", HOLD, str(root), "2"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE) as holder:
        try:
            assert holder.stdout.readline() == b"holding\n"
            with RemoteLoader(root) as remote, remote.open("c0", batch_size=4, epochs=1) as s:
                ids = [i for b in s for i in b["_id"].tolist()]
        finally:
            stop_service(root)
            holder.kill()
            holder.wait(TIMEOUT)
    with catalog.open_catalog(root) as cat:
        assert sorted(ids) == sorted(cat.job("c0").ids)


FOREVER = """
import sys, time
import duckdb
con = duckdb.connect(sys.argv[1])
print("holding", flush=True)
time.sleep(600)
"""


@pytest.fixture
def held(root):
    """A process that is not tabloader's holds the catalog's DuckDB file and never lets go."""
    argv = [sys.executable, "-c", FOREVER, str(root / "catalog.duckdb")]
    with subprocess.Popen(argv, stdout=subprocess.PIPE) as holder:
        try:
            assert holder.stdout.readline() == b"holding\n"
            yield holder
        finally:
            holder.kill()
            holder.wait(TIMEOUT)


def test_a_catalog_held_for_ever_ends_the_wait_with_the_holder_and_the_fix(
    root, held, monkeypatch, capsys
):
    monkeypatch.setenv("TABLOADER_LOCK_WAIT", "1")
    message = (
        rf"Catalog '{root}' is held by pid {held.pid} \(`\S*python\S* -c import sys, time "
        r"import duckdb .*`\), which did not let it go within 1 s \(\$TABLOADER_LOCK_WAIT\)\. "
        r"DuckDB lets one process at a time open a catalog.*close it there.*"
        rf"`tabloader --catalog {root} serve`.*wait longer with \$TABLOADER_LOCK_WAIT\."
    )
    started = time.monotonic()
    with pytest.raises(CatalogLockedError, match=message) as info:
        tabloader.connect(root)
    assert info.value.pid == held.pid
    assert time.monotonic() - started >= 1.0  # it waited
    assert cli.main(["--catalog", str(root), "sql", "SHOW JOBS"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"CatalogLockedError: Catalog '{root}' is held by pid {held.pid}")
    assert len(err.strip().splitlines()) == 1
    # a job's service waits as long, then its client says why it did not start
    with pytest.raises(ServiceError, match=rf"did not start: .*is held by pid {held.pid}"):
        RemoteLoader(root)
    assert service_pid(root) is None


@pytest.mark.parametrize("opener", [catalog.open_catalog, tabloader.connect])
def test_a_catalog_this_process_holds_is_not_waited_for(root, opener, monkeypatch):
    monkeypatch.setenv("TABLOADER_LOCK_WAIT", "1")  # a wait would end in "is held by pid"
    with opener(root), pytest.raises(CatalogLockedError, match="open already in this process"):
        tabloader.connect(root)


def test_looking_for_a_service_creates_nothing(root):
    """``status`` and a client that only looks for a service make no service folder."""
    assert cli.main(["--catalog", str(root), "status"]) == 0
    with pytest.raises(ServiceError, match="no tabloader service runs for catalog"):
        RemoteLoader(root, start=False)
    assert service_pid(root) is None
    assert not (root / ".service").exists()
    assert not runtime_dir(root, create=False).exists()  # nor its /tmp fallback
    plain = root.parent / "plain"  # a folder that holds no catalog (a mistyped path)
    plain.mkdir()
    with tabloader.connect(plain) as cat:
        assert not cat.exists
    assert not list(plain.iterdir())
    assert not runtime_dir(plain, create=False).exists()


FORKS = """
import os, sys, time
import tabloader
cat = tabloader.connect(sys.argv[1])
child = os.fork()
if child == 0:  # a worker forked while the catalog was open here (a DataLoader's, a Pool's)
    time.sleep(120)
    os._exit(0)
cat.close()
print(child, flush=True)
time.sleep(120)
"""


def test_a_child_forked_while_the_catalog_was_open_does_not_keep_the_turn(root, monkeypatch):
    monkeypatch.setenv("TABLOADER_LOCK_WAIT", "2")
    argv = [sys.executable, "-c", FORKS, str(root)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as parent:
        child = int(parent.stdout.readline())
        try:
            with tabloader.connect(root) as cat:  # the parent closed it; the child is alive
                assert cat.service_pid is None
        finally:
            os.kill(child, signal.SIGKILL)
            parent.kill()
            parent.wait(TIMEOUT)
