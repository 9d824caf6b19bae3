"""The decode processes' forkserver as the service's own fork (tabloader.engine._prepare.zygote).

Each case runs in a fresh interpreter: the zygote is forked by a process with no thread of its own,
which a pytest-xdist worker is not."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tabloader.engine._arena.shm import process_alive
from tabloader.engine._prepare import zygote
from tests.support.polling import wait_for
from tests.support.service import TIMEOUT

pytestmark = pytest.mark.skipif(not zygote.known(), reason="not CPython's Linux forkserver")

SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing, os, signal, sys, time
    from concurrent.futures import ProcessPoolExecutor
    from tabloader.engine._prepare import zygote

    case = sys.argv[1]
    out = {"forked": zygote.fork(), "again": zygote.fork()}
    out["zygote"] = zygote.waiting()
    if case == "killed":  # the zygote is gone before the first pool: an interpreter instead
        os.kill(out["zygote"], signal.SIGKILL)
        time.sleep(0.2)
    if case == "unused":  # the process ends without a decode process: the zygote goes too
        print(json.dumps(out), flush=True)
        sys.exit(0)
    out["adopted"] = zygote.adopt(["json"])
    out["after"] = zygote.waiting()
    ctx = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(2, mp_context=ctx) as pool:
        out["parents"] = sorted({f.result() for f in [pool.submit(os.getppid) for _ in range(4)]})
    print(json.dumps(out), flush=True)
    """
)


def _run(case: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, case], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_pools_processes_are_forked_by_the_zygote_which_goes_with_them():
    out = _run("adopted")
    assert out["forked"] is True
    assert out["again"] is False  # once a process
    assert out["adopted"] is True
    assert out["after"] is None  # adopted: no longer waiting
    assert out["parents"] == [out["zygote"]]  # no forkserver interpreter: the zygote forks them
    wait_for(lambda: not process_alive(out["zygote"]), "the zygote to exit with its process")


def test_a_zygote_killed_before_the_first_pool_leaves_multiprocessing_its_own_forkserver():
    out = _run("killed")
    assert out["forked"] is True
    assert out["adopted"] is False
    assert len(out["parents"]) == 1
    assert out["parents"] != [out["zygote"]]  # an interpreter of multiprocessing's own


def test_a_zygote_never_used_exits_with_its_process():
    out = _run("unused")
    assert out["forked"] is True
    wait_for(lambda: not process_alive(out["zygote"]), "the unused zygote to exit with its process")


def test_no_zygote_is_forked_beside_a_running_thread_or_when_fork_fails():
    script = textwrap.dedent(
        """
        import os, threading
        from tabloader.engine._prepare import zygote
        fork = os.fork
        def refused():
            raise BlockingIOError(11, "Resource temporarily unavailable")
        os.fork = refused  # (no process to spare): the service starts all the same
        print(zygote.fork(), zygote.waiting())
        os.fork = fork
        stop = threading.Event()
        t = threading.Thread(target=stop.wait)
        t.start()
        print(zygote.fork(), zygote.waiting())
        stop.set()
        t.join()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert done.stdout.split() == ["False", "None"] * 2, done.stderr


def test_no_zygote_means_adopt_does_nothing():
    assert zygote.waiting() is None  # a test process never forks one
    assert zygote.adopt(["json"]) is False
