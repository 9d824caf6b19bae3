from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tabloader.catalog._errors import (
    JobNotFoundError,
    LoaderError,
    RowReadError,
    ServiceError,
    StatementError,
    StorageError,
    TabloaderError,
)
from tabloader.service import _listener as listener
from tabloader.service._listener import Listener, Session
from tabloader.service._protocol import (
    MAX_MESSAGE,
    PROTOCOL_VERSION,
    Client,
    key_path,
    report_from_wire,
    report_to_wire,
    runtime_dir,
    socket_path,
)
from tests.support.polling import wait_for
from tests.support.sockets import authenticated_socket, frame, read_to_eof

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 10.0  # seconds any single wait may take before the test fails


class LocalError(TabloaderError):
    """Not in tabloader.catalog._errors: the client cannot rebuild it."""


REMOTE_ERRORS = {
    "job": JobNotFoundError("Unknown job 'x'. Did you mean 'y'?"),
    "statement": StatementError("bad token", line=2, col=7),
    "row": RowReadError("row 3 failed to decode", row_id=3, column="image"),
    "storage": StorageError("shard 0 is corrupt", path="/x/shard-0.arrow"),
}


class Echo:
    """Echoes each request; other ops raise, crash or block until close()."""

    def __init__(self, session: Session, log: list[Echo]) -> None:
        self.session = session
        self.closed = threading.Event()
        self.blocked = threading.Event()
        self.interrupted = threading.Event()
        log.append(self)

    def handle(self, msg):
        if msg["op"] == "raise":
            raise REMOTE_ERRORS[msg["name"]]
        if msg["op"] == "raise_local":
            raise LocalError("only the service knows this class")
        if msg["op"] == "crash":
            raise RuntimeError("boom")
        if msg["op"] == "slow":
            time.sleep(0.001)
            return msg
        if msg["op"] == "hold":  # waits as an open does (not interruptible)
            self.blocked.set()
            time.sleep(msg["s"])
            return {"interrupted": self.interrupted.is_set()}
        if msg["op"] == "block":
            self.blocked.set()
            woke = threading.Event()
            threading.Thread(target=lambda: (self.closed.wait(TIMEOUT), woke.set())).start()
            threading.Thread(target=lambda: (self.interrupted.wait(TIMEOUT), woke.set())).start()
            woke.wait(TIMEOUT)
            return {"interrupted": self.interrupted.is_set()}
        return msg

    def close(self) -> None:
        self.closed.set()

    def interrupt(self) -> None:
        self.interrupted.set()

    def interruptible(self, msg) -> bool:
        return msg["op"] in ("block", "slow")  # as a stream's ``next``


class Service:
    """A Listener with Echo handlers, serving in a thread."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.handlers: list[Echo] = []
        self.listener = Listener(root, lambda session: Echo(session, self.handlers))
        self.thread = threading.Thread(target=self.listener.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.listener.close()
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive()


@pytest.fixture
def service(tmp_path):
    svc = Service(tmp_path)
    yield svc
    svc.close()


def check_serves(root: Path) -> None:
    client = Client(root)
    try:
        assert client.call("echo", x=1) == {"op": "echo", "x": 1}
    finally:
        client.close()


def test_round_trip(service):
    client = Client(service.root)
    try:
        args = {"text": "héllo", "n": [1, 2.5, None], "nested": {"a": True}}
        assert client.call("echo", **args) == {"op": "echo", **args}
        assert service.listener.sessions == 1
        assert service.handlers[0].session.pid == os.getpid()
    finally:
        client.close()
    wait_for(lambda: service.listener.sessions == 0)
    assert service.handlers[0].closed.is_set()


def test_client_is_thread_safe(service):
    client = Client(service.root)
    results: dict[int, list[int]] = {}

    def work(t):
        results[t] = [client.call("echo", i=t * 1000 + i)["i"] for i in range(50)]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()
    client.close()
    assert results == {t: [t * 1000 + i for i in range(50)] for t in range(8)}


def test_permissions(service):
    directory = runtime_dir(service.root)
    assert directory == service.root.resolve() / ".service"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_ISSOCK(socket_path(service.root).stat().st_mode)
    assert stat.S_IMODE(socket_path(service.root).stat().st_mode) == 0o600
    assert stat.S_IMODE(key_path(service.root).stat().st_mode) == 0o600
    assert len(key_path(service.root).read_bytes()) == 32


def test_close_removes_files_and_is_idempotent(tmp_path):
    svc = Service(tmp_path)
    svc.close()
    svc.listener.close()
    assert not socket_path(tmp_path).exists()
    assert not key_path(tmp_path).exists()
    with pytest.raises(ServiceError, match="no tabloader service runs for catalog"):
        Client(tmp_path)


def test_each_listener_writes_a_new_key(tmp_path):
    svc = Service(tmp_path)
    first = key_path(tmp_path).read_bytes()
    svc.close()
    svc = Service(tmp_path)
    try:
        assert key_path(tmp_path).read_bytes() != first
        check_serves(tmp_path)
    finally:
        svc.close()


def test_runtime_dir_open_to_others_is_refused(short_tmp):
    (short_tmp / ".service").mkdir(mode=0o750)  # (a short root: .service, not the /tmp fallback)
    os.chmod(short_tmp / ".service", 0o750)
    with pytest.raises(ServiceError, match=r"open to others .*chmod 700"):
        runtime_dir(short_tmp)
    with pytest.raises(ServiceError, match="open to others"):
        Listener(short_tmp, lambda session: None)


def test_runtime_dir_symlink_is_refused(short_tmp):
    (short_tmp / "elsewhere").mkdir(mode=0o700)
    (short_tmp / ".service").symlink_to(short_tmp / "elsewhere")
    with pytest.raises(ServiceError, match="is not a directory; remove it"):
        runtime_dir(short_tmp)


@pytest.mark.parametrize("length", [8, 120])  # short paths, and those that fall back to /tmp
def test_runtime_dir_of_a_missing_catalog_is_refused(tmp_path, length):
    missing = tmp_path / ("x" * length)
    with pytest.raises(ServiceError, match=r"no catalog directory at .*xxxxxxxx; check the"):
        runtime_dir(missing)
    assert not missing.exists()


def test_long_catalog_path_falls_back_to_tmp(tmp_path):
    root = tmp_path / ("x" * 120)
    root.mkdir()
    digest = hashlib.sha256(os.fsencode(root.resolve())).hexdigest()[:16]
    expected = Path("/tmp") / f"tabloader-{os.getuid()}" / digest
    try:
        assert runtime_dir(root) == expected
        assert stat.S_IMODE(expected.stat().st_mode) == 0o700
        assert stat.S_IMODE(expected.parent.stat().st_mode) == 0o700
        svc = Service(root)
        try:
            assert socket_path(root) == expected / "sock"
            check_serves(root)
        finally:
            svc.close()
    finally:
        shutil.rmtree(expected, ignore_errors=True)


def test_no_service(tmp_path):
    with pytest.raises(ServiceError, match=r"no tabloader service runs for catalog .*--catalog"):
        Client(tmp_path)


def test_wrong_key_is_refused_and_others_are_served(service, caplog):
    path = key_path(service.root)
    good = path.read_bytes()
    path.write_bytes(b"k" * 32)
    with pytest.raises(ServiceError, match=re.escape(f"disagree on the key in {path}")):
        Client(service.root)
    wait_for(lambda: "failed to authenticate" in caplog.text)
    path.write_bytes(good)
    check_serves(service.root)


@pytest.mark.parametrize("kind", ["link", "fifo", "short"])
def test_a_key_file_that_is_a_link_a_fifo_or_short_is_never_read(service, kind):
    """A link to /dev/zero would be read for ever, a FIFO would block: both refused at once."""
    path = key_path(service.root)
    good = path.read_bytes()
    path.unlink()
    if kind == "link":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(good[:8])
    problem = {
        "link": "is a symbolic link (to '/dev/zero')",
        "fifo": "is a FIFO, not a regular file",
        "short": "has 8 bytes, expected 32",
    }[kind]
    started = time.monotonic()
    with pytest.raises(ServiceError, match=re.escape(f"The service's key {path} {problem}")):
        Client(service.root, timeout=5)
    assert time.monotonic() - started < 5
    path.unlink()
    path.write_bytes(good)
    check_serves(service.root)


@pytest.mark.parametrize(
    ("payload", "logged"),
    [
        pytest.param(b"GET / HTTP/1.1\r\n\r\n", "failed to authenticate", id="garbage"),
        pytest.param(struct.pack("!I", 1 << 30), "failed to authenticate", id="huge-prefix"),
        pytest.param(b"\x00\x00", "failed to authenticate", id="truncated-prefix"),
    ],
)
def test_unauthenticated_bytes_close_the_connection(service, caplog, payload, logged):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(TIMEOUT)
        sock.connect(str(socket_path(service.root)))
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        read_to_eof(sock)  # the challenge, maybe a failure, then EOF
    wait_for(lambda: logged in caplog.text)
    assert service.listener.sessions == 0
    check_serves(service.root)


@pytest.mark.parametrize(
    ("payload", "logged"),
    [
        pytest.param(b"\xde\xad\xbe\xef garbage", "over the limit", id="garbage"),
        pytest.param(b"\x00\x00", "truncated length prefix (2 of 4 bytes)", id="truncated-prefix"),
        pytest.param(frame(b"{}")[:-1], "truncated message (1 of 2 bytes)", id="truncated-body"),
        pytest.param(struct.pack("!I", MAX_MESSAGE + 1), "over the limit", id="oversized"),
        pytest.param(frame(b"\xff{not json"), "is not JSON", id="not-json"),
        pytest.param(frame(b"[1, 2]"), "a JSON list, not an object", id="not-object"),
        pytest.param(frame(b'{"op": "echo"}'), "version None", id="no-version"),
        pytest.param(frame(b'{"v": true, "op": "echo"}'), "version True", id="bool-version"),
        pytest.param(frame(b"[" * 100_000), "is not JSON", id="deep-nesting"),
    ],
)
def test_bad_messages_close_the_connection(service, caplog, payload, logged):
    with authenticated_socket(service.root) as sock:
        wait_for(lambda: service.listener.sessions == 1)
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        read_to_eof(sock)
    wait_for(lambda: logged in caplog.text)
    assert any(r.name.startswith("tabloader.service") for r in caplog.records)
    wait_for(lambda: service.handlers[0].closed.is_set())
    check_serves(service.root)


def test_wrong_version_is_answered_with_both_versions(service, caplog):
    with authenticated_socket(service.root) as sock:
        sock.sendall(frame(json.dumps({"v": 99, "op": "echo"}).encode()))
        reply = read_to_eof(sock)
    (size,) = struct.unpack("!I", reply[:4])
    error = json.loads(reply[4 : 4 + size])["error"]
    assert error["type"] == "ServiceError"
    assert re.search(rf"version 99, this end speaks {PROTOCOL_VERSION}", error["message"])
    assert "version 99" in caplog.text
    check_serves(service.root)


def test_oversized_request_is_refused_before_sending(service):
    client = Client(service.root)
    try:
        with pytest.raises(ServiceError, match=r"over MAX_MESSAGE"):
            client.call("echo", blob="x" * MAX_MESSAGE)
        assert client.call("echo", x=2) == {"op": "echo", "x": 2}
    finally:
        client.close()


def test_silent_client_blocks_nobody(service):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(str(socket_path(service.root)))
        check_serves(service.root)
        check_serves(service.root)


def test_silent_client_is_dropped_after_the_handshake_timeout(service, caplog, monkeypatch):
    monkeypatch.setattr(listener, "HANDSHAKE_TIMEOUT", 0.2)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.settimeout(TIMEOUT)
        silent.connect(str(socket_path(service.root)))
        read_to_eof(silent)  # the challenge, then EOF when the service gives up
    assert "failed to authenticate (timed out)" in caplog.text


@pytest.mark.parametrize("name", sorted(REMOTE_ERRORS))
def test_remote_errors_are_raised_by_type(service, name):
    local = REMOTE_ERRORS[name]
    client = Client(service.root)
    try:
        with pytest.raises(type(local), match=re.escape(str(local))) as info:
            client.call("raise", name=name)
        assert type(info.value) is type(local)
        assert vars(info.value) == vars(local)
        assert client.call("echo") == {"op": "echo"}  # the connection stays open
    finally:
        client.close()


def test_unknown_remote_error_and_handler_crash_are_service_errors(service, caplog):
    client = Client(service.root)
    try:
        with pytest.raises(ServiceError, match="LocalError: only the service knows this class"):
            client.call("raise_local")
        with pytest.raises(ServiceError, match="RuntimeError: boom"):
            client.call("crash")
        assert client.call("echo") == {"op": "echo"}
    finally:
        client.close()
    (record,) = [r for r in caplog.records if "handler failed" in r.getMessage()]
    assert record.exc_info is not None
    assert record.exc_info[0] is RuntimeError


def pythonpath() -> str:
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def run_and_kill_itself(code: str, root: Path) -> int:
    """Run ``code`` in a new interpreter that then kills itself with SIGKILL; return its pid."""
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    code += "print('done', flush=True)\nos.kill(os.getpid(), 9)\n"
    with subprocess.Popen(
        [sys.executable, "-c", code, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    ) as proc:
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == -9, err
    assert out == "done\n"
    return proc.pid


def test_killed_client_closes_its_handler(service):
    code = (
        "import os, sys\nfrom tabloader.service._protocol import Client\nc = Client(sys.argv[1])\n"
    )
    pid = run_and_kill_itself(code, service.root)
    wait_for(lambda: any(h.session.pid == pid for h in service.handlers))
    (handler,) = [h for h in service.handlers if h.session.pid == pid]
    assert handler.closed.wait(TIMEOUT)
    wait_for(lambda: service.listener.sessions == 0)


def blocked_call(client, service) -> tuple[threading.Thread, list[BaseException]]:
    """``client.call("block")`` on a thread, once the service's handler is blocked in it;
    the list gets what the call raises."""
    raised: list[BaseException] = []

    def call():
        try:
            client.call("block")
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    wait_for(lambda: bool(service.handlers) and service.handlers[0].blocked.is_set())
    return thread, raised


def test_listener_close_wakes_a_blocked_call(tmp_path):
    svc = Service(tmp_path)
    client = Client(tmp_path)
    thread, raised = blocked_call(client, svc)
    svc.close()
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    (exc,) = raised
    assert isinstance(exc, ServiceError)
    assert re.search(r"lost the tabloader service for catalog .* \(end of file\)", str(exc))
    assert svc.handlers[0].closed.is_set()
    with pytest.raises(ServiceError, match="is closed; make a new one"):
        client.call("echo")
    client.close()


@pytest.mark.parametrize("how", ["close", "kill"])
def test_client_gone_during_a_request_closes_its_handler(service, how):
    """The handler's close() runs at once, though its handle() still waits."""
    if how == "kill":
        code = (
            "import os, sys, threading\nfrom tabloader.service._protocol import Client\n"
            "c = Client(sys.argv[1])\nthreading.Thread(target=c.call, args=('block',)).start()\n"
            "import time\ntime.sleep(30)\n"
        )
        env = {**os.environ, "PYTHONPATH": pythonpath()}
        proc = subprocess.Popen([sys.executable, "-c", code, str(service.root)], env=env)
        try:
            wait_for(lambda: bool(service.handlers) and service.handlers[0].blocked.is_set())
        finally:
            proc.kill()
            proc.wait(TIMEOUT)
    else:
        client = Client(service.root)
        thread, raised = blocked_call(client, service)
        client.close()
        thread.join(TIMEOUT)
        assert not thread.is_alive()
        assert isinstance(raised[0], ServiceError)
    assert service.handlers[0].closed.wait(TIMEOUT)
    wait_for(lambda: service.listener.sessions == 0)
    check_serves(service.root)


def test_a_client_gone_while_another_request_waits_closes_its_handler(service):
    """Requests are watched once they have run ``WATCH_AFTER_S``: a second one that starts
    while the watcher waits on a first is watched too."""
    first = Client(service.root)
    thread, _ = blocked_call(first, service)  # handlers[0]: a second client connected
    second = Client(service.root)  # before it could be accepted first (a CI failure)
    try:
        time.sleep(3 * listener.WATCH_AFTER_S)  # the first is watched; nothing else is busy
        second.send("block")
        wait_for(lambda: len(service.handlers) == 2 and service.handlers[1].blocked.is_set())
        second.close()
        # the watcher closes it within WATCH_AFTER_S; not the block's own TIMEOUT running out
        assert service.handlers[1].closed.wait(TIMEOUT / 2)
        assert not service.handlers[0].closed.is_set()
    finally:
        first.close()
        thread.join(TIMEOUT)
    assert not thread.is_alive()


def test_a_request_sent_while_one_waits_interrupts_it(service):
    """A client that sends its next request before the reply (a RemoteStream leaving while it
    reads ahead) has the waiting ``handle()`` interrupted; both replies come, in order."""
    client = Client(service.root)
    try:
        client.send("block")
        wait_for(lambda: bool(service.handlers) and service.handlers[0].blocked.is_set())
        client.send("echo", x=2)
        assert client.receive(timeout=TIMEOUT) == {"interrupted": True}
        assert client.receive(timeout=TIMEOUT) == {"op": "echo", "x": 2}
        assert not service.handlers[0].closed.is_set()  # the connection goes on
        assert client.call("echo", x=3) == {"op": "echo", "x": 3}
    finally:
        client.close()


def test_a_request_sent_behind_one_that_is_not_interruptible_waits_its_turn(service):
    """A client may send its first ``next`` right behind its ``open``: while a request that
    is not ``interruptible`` runs (long enough for the watcher to look), the one behind it is
    not taken for the client giving the first up (four launched training scripts lost a
    stream 1 run in 5 when a cold service's open took longer than the watcher's delay)."""
    client = Client(service.root)
    try:
        client.send("hold", s=4 * listener.WATCH_AFTER_S)
        client.send("echo", x=1)
        assert client.receive(timeout=TIMEOUT) == {"interrupted": False}
        assert client.receive(timeout=TIMEOUT) == {"op": "echo", "x": 1}
        assert not service.handlers[0].interrupted.is_set()
        assert not service.handlers[0].closed.is_set()
    finally:
        client.close()


def test_a_request_sent_right_after_a_reply_is_not_an_interrupt(tmp_path, monkeypatch):
    """The watcher wakes late (its copy of the busy connections is old): the request a client
    sends as soon as a reply comes (a RemoteStream reading ahead) is not taken for one sent
    while a request waits."""
    real_poll = listener.select.poll

    class LatePoll:
        def __init__(self):
            self.poller = real_poll()

        def register(self, *args):
            self.poller.register(*args)

        def poll(self, *args):
            time.sleep(0.003)  # what a loaded machine does to the watcher thread
            return self.poller.poll(*args)

    real_recv = listener.recv_frame

    def late_recv(sock, limit):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.006)  # the connection's thread reads the next request late too
        return real_recv(sock, limit)

    monkeypatch.setattr(listener.select, "poll", LatePoll)
    monkeypatch.setattr(listener, "recv_frame", late_recv)
    monkeypatch.setattr(listener, "WATCH_AFTER_S", 0.0)  # each request watched at once
    svc = Service(tmp_path)
    client = Client(tmp_path)
    try:
        client.send("slow", i=0)
        for i in range(1, 100):
            assert client.receive(timeout=TIMEOUT) == {"op": "slow", "i": i - 1}
            client.send("slow", i=i)
        client.receive(timeout=TIMEOUT)
        assert not svc.handlers[0].interrupted.is_set()
    finally:
        client.close()
        svc.close()


class CountingPoll:
    """``select.poll`` for the watcher, counting its waits."""

    polls = 0
    real = listener.select.poll

    def __init__(self):
        self.poller = CountingPoll.real()

    def register(self, *args):
        self.poller.register(*args)

    def poll(self, *args):
        CountingPoll.polls += 1
        return self.poller.poll(*args)


def test_the_watcher_wakes_per_interval_not_per_request(tmp_path, monkeypatch):
    """While requests come, the watcher looks at the busy ones every ``WATCH_AFTER_S``: 100
    requests 5 ms apart, each answered at once, do not wake it 100 times (woken for each, it
    was: 92 here). With none for ``IDLE_S`` it waits for the next."""
    monkeypatch.setattr(listener.select, "poll", CountingPoll)
    monkeypatch.setattr(listener, "IDLE_S", 0.2)
    monkeypatch.setattr(CountingPoll, "polls", 0)
    svc = Service(tmp_path)
    client = Client(tmp_path)
    try:
        client.call("echo", x=0)
        polls, t0 = CountingPoll.polls, time.monotonic()
        for i in range(100):
            assert client.call("echo", i=i) == {"op": "echo", "i": i}
            time.sleep(0.005)  # a job's step
        woken = CountingPoll.polls - polls
        # per interval (and once per request that comes of age), not per request
        assert woken <= (time.monotonic() - t0) / listener.WATCH_AFTER_S + 10
        time.sleep(3 * listener.IDLE_S)  # idle: it waits with no timeout
        polls = CountingPoll.polls
        time.sleep(3 * listener.WATCH_AFTER_S)
        assert CountingPoll.polls == polls
    finally:
        client.close()
        svc.close()
    # and a request after the idle time is watched at once (the hang-up tests above)


def test_a_reply_not_come_in_time_closes_the_connection(service):
    client = Client(service.root)
    client.send("block")
    with pytest.raises(ServiceError, match=r"lost the tabloader service .*timed out"):
        client.receive(timeout=0.2)
    with pytest.raises(ServiceError, match="is closed; make a new one"):
        client.call("echo")
    assert service.handlers[0].closed.wait(TIMEOUT)  # the service saw it hang up


def test_second_listener_is_refused(service):
    with pytest.raises(
        ServiceError, match=rf"a service already runs for catalog .* \(pid {os.getpid()}\)"
    ):
        Listener(service.root, lambda session: None)
    check_serves(service.root)  # the refused one removed nothing


def test_stale_socket_of_a_killed_service_is_replaced(tmp_path):
    code = (
        "import os, sys\nfrom tabloader.service._listener import Listener as L\n"
        "L(sys.argv[1], id)\n"
    )
    run_and_kill_itself(code, tmp_path)
    assert stat.S_ISSOCK(socket_path(tmp_path).stat().st_mode)  # left behind
    assert key_path(tmp_path).exists()
    with pytest.raises(ServiceError, match="no tabloader service runs"):
        Client(tmp_path)
    svc = Service(tmp_path)
    try:
        check_serves(tmp_path)
    finally:
        svc.close()


# -- a report's arrays on the wire ----------------------------------------------------------
def _report(ids, losses) -> dict:
    return {
        "ids": report_to_wire(np.asarray(ids, np.int64)),
        "losses": report_to_wire(np.asarray(losses, np.float64)),
    }


def test_a_report_round_trips_exactly():
    losses = np.array([0.1, 1 / 3, 2.5e-300, 7.0])
    ids, back = report_from_wire(json.loads(json.dumps(_report([5, 0, 2**40, 3], losses))))
    assert ids.dtype == np.int64 and back.dtype == np.float64  # noqa: PT018
    assert ids.tolist() == [5, 0, 2**40, 3]
    assert back.tobytes() == losses.tobytes()  # bit for bit


@pytest.mark.parametrize(
    ("msg", "error", "match"),
    [
        ({}, ServiceError, r"'ids' must be hex of at most 65536 8-byte values, got NoneType"),
        ({**_report([1], [0.5]), "ids": 7}, ServiceError, "'ids' must be hex .* got int"),
        ({**_report([1], [0.5]), "losses": "abc"}, ServiceError, "'losses' .* got 3 hex digits"),
        ({**_report([1], [0.5]), "ids": "zz" * 8}, ServiceError, "'ids' is not hex"),
        (
            {**_report([1], [0.5]), "ids": "00" * 8 * 65537},
            ServiceError,
            "at most 65536 8-byte values",
        ),
        (_report([1, 2], [0.5]), LoaderError, "2 ids and 1 losses"),
        (_report([1, 2], [0.5, float("nan")]), LoaderError, r"non-finite losses .* rows \[2\]"),
        (_report([1], [float("-inf")]), LoaderError, r"non-finite losses .* rows \[1\]"),
    ],
)
def test_bad_reports_are_refused_in_one_line(msg, error, match):
    with pytest.raises(error, match=match) as info:
        report_from_wire(msg)
    assert "\n" not in str(info.value)
