"""Jobs of other processes: connect to a catalog's loader service (starting one if none runs).

:class:`RemoteLoader` is the service's engine seen from a training process, with the same
``open()`` as :class:`tabloader.engine.Loader`; its streams (:class:`RemoteStream`) behave as
``JobStream``. A batch's values are copied out of the service's shared memory (mapped
read-only) into the job's own arrays, then released (see :mod:`tabloader.service._server`).

If no service runs for the catalog, :func:`dial` starts one in the background (a detached
``tabloader --catalog DIR serve --idle-exit S``; ``S`` is ``$TABLOADER_IDLE_EXIT``, default
30 s) and waits for it (also while it waits for a catalog another process holds:
:mod:`tabloader.service._turns`); two scripts that start at once end up with one service. It runs in
``/``, whoever started it, so paths go to it absolute (:mod:`tabloader.service._connection`
resolves relative ones against the client's working directory). Statements and the catalog's
other calls go through :func:`tabloader.connect`, which uses the service while one runs.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tabloader.catalog._directory import resolve_root
from tabloader.catalog._errors import LoaderError, ServiceError, ServiceStuckError, TabloaderError
from tabloader.catalog._options import JobSpec
from tabloader.catalog._settings import STORAGE_ENV, setting
from tabloader.engine._arena.shm import Segment
from tabloader.engine._deliver.batchmem import BatchMemory
from tabloader.engine._deliver.handoff import HandedBatch
from tabloader.engine._deliver.streams import StreamBase
from tabloader.engine._opening import OpenArgs, OpenRequest, state_from_wire
from tabloader.sampling._importance import report_arrays
from tabloader.service._listener import STARTER_ENV
from tabloader.service._plugins import Locator, locator
from tabloader.service._protocol import (
    LOG_FILE,
    Client,
    Message,
    report_to_wire,
    runtime_dir,
    service_pid,
)
from tabloader.service._reopen import Ahead, forget, register, settle

if TYPE_CHECKING:
    from typing_extensions import Unpack

START_TIMEOUT_S = 60.0
START_POLL_S = 0.01  # a try is a failed connect() (the socket is not there yet): cheap
# The started service's program: ``tabloader`` in an interpreter without its working directory
# on sys.path. ``python -m`` puts it first, so a ./catalog or ./tabloader folder there would
# shadow the installed packages; ``python -P`` leaves it out only from Python 3.11 (we support
# 3.10), and ``-c`` puts '' (the working directory) first, which this removes. Under
# SCHED_BATCH, as ``yield_to_jobs`` puts the service's threads later (processes inherit it).
# Its parser knows ``serve`` only: the other commands' help imports what serving never uses.
# Its decode processes start once its threads decoded the first fixed-size values (DecodePool).
SERVE = """\
import os, sys
if sys.path[:1] == ['']: del sys.path[0]
try:
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
except (AttributeError, OSError):
    pass
from tabloader.cli import main
sys.exit(main(commands=("serve",)))
"""


def _service_env() -> dict[str, str]:
    """This process's environment with its paths absolute: relative ones mean this process's
    working directory (the service runs in /): ``PYTHONPATH`` (so the service imports our
    packages) and ``$TABLOADER_STORAGE`` (so it reads the parts this process would read)."""
    env = dict(os.environ)
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(
            os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep)
        )
    if env.get(STORAGE_ENV):  # (the storage package imports pyarrow: 0.1 s, where needed)
        from tabloader.catalog.storage._stores import storage_uri

        env[STORAGE_ENV] = str(storage_uri(Path("/")))
    return env


def _start_seconds() -> float:
    """How long a client waits for the service it starts: ``START_TIMEOUT_S``, and the
    ``lock_wait`` that a service waits for a catalog another process holds."""
    return START_TIMEOUT_S + float(setting("lock_wait"))


def dial(root: str | os.PathLike[str], *, start: bool = True) -> Client:
    """A socket connection to the service of catalog ``root``, started in the background if needed.

    Clients that find no service take turns at a start lock (``runtime_dir/starting``): the
    first starts one and waits for it, the others wait for the lock and find it running. Four
    training scripts launched at once used to start four services, three of which imported
    everything and started decode processes only to find the catalog's lock taken, on the
    cores the first batch waits for.

    Raises:
        ServiceError: none runs (and ``start`` is False), or the one started failed (its log
            is named).
    """
    root = Path(root).absolute()
    try:
        return Client(root)
    except ServiceStuckError:  # another would not start beside it
        raise
    except ServiceError:
        if not start:
            raise
    start_s = _start_seconds()
    deadline = time.monotonic() + start_s
    fd = os.open(runtime_dir(root) / "starting", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        while True:  # polled, not blocking: a stopped client holding it cannot hang us
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                with contextlib.suppress(ServiceError):
                    return Client(root)  # the one another client started
                if time.monotonic() > deadline:
                    raise ServiceError(
                        f"Another process has been starting the tabloader service for catalog "
                        f"{root} for {start_s:.0f} s; see {runtime_dir(root) / LOG_FILE}."
                    ) from None
                time.sleep(START_POLL_S)
        try:  # it may have come up while we waited for the lock
            return Client(root)
        except ServiceError:
            return _start(root, deadline)
    finally:
        os.close(fd)  # the lock goes with it


def _start(root: Path, deadline: float) -> Client:
    """Start the catalog's service and connect once it answers (the start lock held).

    A service that holds the catalog's lock but did not answer (still starting, or too busy to
    answer in time; or a ``tabloader serve`` of a user, started at the same time) is waited
    for: a second one would only find the lock taken. Ours, if it loses that race all the same,
    logs one line and exits 0 (``tabloader.service._server``); it is started again only if the
    one it lost to went away without answering.
    """
    log = runtime_dir(root) / LOG_FILE  # its output before it logs there itself, too
    proc: subprocess.Popen[bytes] | None = None
    start_of_ours = 0  # earlier services' lines are not this start's story
    while True:
        try:
            return Client(root)
        except ServiceError as exc:
            ended = proc is not None and proc.poll() is not None
            if proc is not None and ended and proc.returncode != 0:
                raise _failed(root, log, start_of_ours, exc) from None
            if time.monotonic() > deadline:
                if proc is not None and not ended:
                    proc.kill()
                if isinstance(exc, ServiceStuckError):  # names the pid, and the way out
                    raise
                raise ServiceError(
                    f"The tabloader service for catalog {root} did not answer within "
                    f"{_start_seconds():.0f} s; see {log}."
                ) from exc
            if (proc is None or ended) and service_pid(root) is None:
                proc, start_of_ours = _spawn(root, log)
            time.sleep(START_POLL_S)


def _spawn(root: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """The catalog's service, started detached with its output appended to ``log``; and
    where in ``log`` its output begins."""
    with open(log, "ab") as out:
        start = out.tell()  # before it runs: it writes through the same file offset
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SERVE,
                "--catalog",
                str(root),
                "serve",
                "--idle-exit",
                str(setting("idle_exit")),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            cwd="/",  # not the directory of whichever client came first
            env={**_service_env(), STARTER_ENV: str(os.getpid())},
            start_new_session=True,  # detached: it outlives this process, not its signals
        )
    _STARTED.append(proc)  # not collected while it runs ("subprocess ... is still running")
    return proc, start


def _failed(root: Path, log: Path, start: int, exc: ServiceError) -> ServiceError:
    """The error of a service that exited failing to start: the last lines it wrote."""
    with open(log, "rb") as written:
        written.seek(start)
        ours = written.read().decode(errors="replace")
    tail = ours.strip().splitlines()[-3:]
    return ServiceError(
        f"The tabloader service for catalog {root} did not start: "
        f"{' | '.join(tail) or exc}. See {log}."
    )


def _node_client(root: Path, node: str, found: Locator) -> Client:
    """A connection to node ``node``'s loader (``found`` named it), waiting while it starts."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return Client(root, node=node)
        except ServiceError:
            if time.monotonic() > deadline:
                raise found.missing(node, root) from None
            time.sleep(0.1)


def _int_field(reply: Message, name: str) -> int:
    value = reply.get(name)
    if type(value) is not int:
        raise _malformed_reply(f"{name} {str(value)[:20]}")
    return value


def _malformed_reply(what: str) -> ServiceError:
    return ServiceError(
        f"The tabloader service sent a malformed reply to an open ({what}); is it another "
        "version of tabloader? Restart it (`tabloader serve`)."
    )


@dataclass
class Copies:
    """Image payload bytes copied to deliver batches, counted (``python -m benchmarks e2e`` reads
    it).

    ``copied_bytes`` counts this process's copy of each image out of the mapping into the job's
    batch, plus the service's copy into staging of each image the arena had no room for (the
    reply lists those); ``prepared_bytes`` is the delivered images' prepared sizes.
    """

    images: int = 0
    prepared_bytes: int = 0
    copied_bytes: int = 0


class RemoteLoader:
    """The loader service of catalog ``root``, from this process.

    In a Ray worker of a cluster whose leader serves the catalog (``tabloader serve --ray``),
    the service is the loader of the worker's node (a :mod:`~tabloader.service._plugins` locator
    names it; ``node`` is then its id), which is never started from here.

    Args:
        root: the catalog directory.
        start: start a service in the background if none runs.
    """

    def __init__(self, root: str | os.PathLike[str], *, start: bool = True) -> None:
        self.root = Path(root).absolute()
        found = locator()  # a Ray worker's node, when a cluster serves the catalog
        self.node = None if found is None else found.node(self.root)
        self._lock = threading.Lock()  # the control connection and the mapping
        self._asking = threading.Lock()  # a request of the loader's own is on ``_ctl``
        # Its own requests' connection; the first stream opened takes it (its connect is that
        # stream's) and ``_ask`` makes another when one is needed.
        self._ctl: Client | None = (
            dial(self.root, start=start)
            if found is None or self.node is None
            else _node_client(self.root, self.node, found)
        )
        self._segment: Segment | None = None  # mapped by the first open's reply (or ``arena``)
        self._arena: npt.NDArray[np.uint8] | None = None
        self._service_pid: int | None = None
        self.copies = Copies()  # of every stream of this loader
        self.memory = BatchMemory()  # the streams' image batches, recycled
        self._copies_lock = threading.Lock()
        self._closed = False

    @property
    def arena(self) -> npt.NDArray[np.uint8]:
        """The service's arena, mapped read-only from the descriptor it sends (no name to
        open): by the first open's reply, else asked for now."""
        with self._asking, self._lock:
            if self._arena is None:
                reply, fds = self._control_locked().call_fds("segment")
                self._map_locked(reply, fds)
            assert self._arena is not None
            return self._arena

    @property
    def service_pid(self) -> int:
        """The pid of the service this loader maps the memory of (or would connect to)."""
        if self._service_pid is None:
            self._service_pid = _int_field(self._ask("hello"), "pid")
        return self._service_pid

    def _map_locked(self, reply: Message, fds: list[int]) -> None:
        """Map the memory a reply sent the descriptor of (``_lock`` held): once; a later
        one, of the same memory, is closed (two first opens at once)."""
        try:
            if len(fds) != 1:
                raise ServiceError(
                    f"the tabloader service sent {len(fds)} descriptors for its shared memory, "
                    "not 1; is it another version of tabloader? Restart it (`tabloader serve`)."
                )
            name, size = reply.get("segment"), _int_field(reply, "size")
            if not isinstance(name, str):
                raise _malformed_reply(f"segment {str(name)[:40]}")
            pid = _int_field(reply, "pid")
            if self._segment is None:
                self._segment = Segment.attach(fds.pop(), size, name, readonly=True)
                self._arena = np.frombuffer(self._segment.buf, np.uint8)  # read-only
                self._service_pid = pid
            elif name != self._segment.name:  # pragma: no cover - a new service, mid-open
                raise self._stale()
        finally:
            while fds:
                os.close(fds.pop())

    def _stale(self) -> ServiceError:
        return ServiceError(
            f"The tabloader service of catalog {self.root} this loader was connected "
            f"to (pid {self._service_pid}) is gone, and another one runs now; its "
            "batches are in memory this loader does not map. Make a new JobDataset or "
            "RemoteLoader for the job (with state= a state_dict() you saved to resume)."
        )

    def _control_locked(self) -> Client:
        if self._ctl is None:
            if self._closed:
                raise ServiceError(
                    f"This RemoteLoader of catalog {self.root} is closed; make a new one."
                )
            self._ctl = Client(self.root, node=self.node)
        return self._ctl

    def _ask(self, op: str, **args: Any) -> Message:
        """A request of the loader's own, on its connection (made again once a stream took
        it, or it broke); no stream takes it meanwhile."""
        with self._asking:
            with self._lock:
                ctl = self._control_locked()
            return ctl.call(op, **args)

    def _connection(self) -> Client:
        """A connection for a stream: the loader's own if no stream took it yet (a first open
        connects once) and no request of the loader's is on it, else a new one."""
        conn = None
        if self._asking.acquire(blocking=False):
            try:
                with self._lock:
                    conn, self._ctl = self._ctl, None
            finally:
                self._asking.release()
        return conn if conn is not None else Client(self.root, node=self.node)

    def _keep_connected(self) -> None:
        """A stream leaves: the loader connects again if it holds no connection, so that the
        service stays up while the loader is open (it stops ``idle_exit`` seconds after its
        last client left), as it did while the stream was open."""
        with self._lock:
            if self._ctl is None and not self._closed:
                with contextlib.suppress(ServiceError):
                    self._ctl = Client(self.root, node=self.node)

    def open(
        self, job: str | OpenRequest, *, read_ahead: bool = False, **args: Unpack[OpenArgs]
    ) -> RemoteStream:
        """Open ``job`` in the service; ``args`` as ``Loader.open``'s (:class:`OpenArgs`,
        made into one ``OpenRequest``), or the whole ``OpenRequest``.

        ``rank`` and ``world_size`` are found here, in this process (never in the service),
        from what launched it when both are None (a process group, torchrun's ``RANK`` and
        ``WORLD_SIZE``, Lightning's launcher, ...: see :mod:`tabloader.engine._queue.ranks`): the
        ranks of a job, each in its own process, join the service as one job. The options
        given are checked here each on its own, and with the job's registered ones in the
        service (the open's error says which).

        One request: the open carries the request and, the first time, asks for the
        service's memory (its reply sends the descriptor; later opens name the memory they
        map, and a service that is not that one refuses them before the job opens). With
        ``read_ahead`` (a job about to iterate) the first batch is asked for behind the open,
        before its reply is read: a first batch is then one round trip away.
        """
        if isinstance(job, OpenRequest) and args:
            raise LoaderError(
                f"open(OpenRequest, {', '.join(args)}=...): the request carries every argument "
                "of the open; make it with them (OpenRequest.make)."
            )
        request = job if isinstance(job, OpenRequest) else OpenRequest.make(job, **args)
        request = request.resolved()  # this process's ranks
        rank, world_size = int(request.rank or 0), int(request.world_size or 1)
        settle((self.root, self.node, request.job, rank))  # a stream of it dropped here
        conn = self._connection()
        with self._lock:
            mapped = None if self._segment is None else self._segment.name
        fds: list[int] = []
        try:
            conn.send("open", request=request.to_wire(), segment=mapped)
            if read_ahead:
                conn.send("next")
            reply = conn.receive(fds=fds)
            if mapped is None:
                with self._lock:
                    self._map_locked(reply, fds)
            epoch = _int_field(reply, "epoch")
            try:
                spec = JobSpec.from_wire(reply.get("spec"))
            except TabloaderError as exc:
                raise _malformed_reply(str(exc)) from None
        except ServiceError as exc:
            conn.close()
            if getattr(exc, "stale_segment", False):  # this loader's service is gone
                raise self._stale() from None
            raise
        except BaseException:
            conn.close()
            raise
        finally:
            while fds:
                os.close(fds.pop())
        stream = RemoteStream(self, conn, request.job, rank, world_size, spec)
        stream._epoch_hint = epoch
        stream._ahead = read_ahead
        return stream

    def job_options(self, job: str) -> dict[str, Any]:
        """The ``WITH`` options a job was registered with."""
        return dict(self._ask("options", job=job)["options"])

    def job_rows(self, job: str) -> int:
        """The number of rows of a registered job."""
        return int(self._ask("rows", job=job)["rows"])

    def stats(self) -> dict[str, Any]:
        """The service's engine counters (as ``Loader.stats()``), and its ``clients``: the
        other client processes connected (``Service.clients``)."""
        return dict(self._ask("stats")["stats"])

    def wait_ready(self) -> None:
        """Wait until the service's decode processes have started (as ``Loader.wait_ready()``):
        for a benchmark that times steady state, as jobs need not."""
        self._ask("ready")

    def count_copies(self, images: int, prepared_bytes: int, copied_bytes: int) -> None:
        """Add a batch's images to ``copies`` (its streams may run on several threads)."""
        with self._copies_lock:
            self.copies.images += images
            self.copies.prepared_bytes += prepared_bytes
            self.copies.copied_bytes += copied_bytes

    def alive(self) -> bool:
        """Whether the service this loader maps the memory of still answers."""
        if self._closed:
            return False
        try:
            reply = self._ask("hello")
        except ServiceError:
            with self._lock:
                self._ctl = None  # broken: the next request connects again
            return False
        with self._lock:
            return self._segment is None or reply.get("segment") == self._segment.name

    def close(self) -> None:
        """Disconnect (open streams stay usable until closed)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ctl, self._ctl = self._ctl, None
        if ctl is not None:
            ctl.close()
        self.memory.close()  # the blocks kept for reuse go (a stream still works)

    def __enter__(self) -> RemoteLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteStream(StreamBase):
    """One job's batches from the service; the interface of ``JobStream``.

    **Reading ahead.** As soon as a batch is copied out of the shared memory (and its values
    released), the request for the next one goes out, so the service prepares the reply while
    the job computes: ``take`` then finds it waiting (the round trip, two process wake-ups and
    the service's handling, 0.5-2 ms on a busy 2-core machine, is off the job's path). The
    batch read ahead is the job's next one whatever ``take``'s ``epoch``: one of a later epoch
    stays here until asked for. ``state_dict`` tells the service it is not delivered yet.

    **Stalls** are timed here, not in the service (which waits for the batch read ahead while
    the job computes): each request carries the seconds the job waited in ``take`` and spent
    between two ``take`` calls since the previous one.
    """

    CLOSE_WAIT_S = 2.0  # close() waits this long for a batch read ahead, then just hangs up

    def __init__(
        self,
        loader: RemoteLoader,
        conn: Client,
        name: str,
        rank: int = 0,
        world_size: int = 1,
        spec: JobSpec | None = None,
    ) -> None:
        self._loader, self._conn, self.name = loader, conn, name
        self.rank, self.world_size = rank, world_size  # of the job's data-parallel ranks
        self.spec = JobSpec() if spec is None else spec  # the job's options it was opened with
        self._lock = threading.Lock()
        self._ahead_out = Ahead()  # a "next" request is out, its reply not read
        self._key = (loader.root, loader.node, name, rank)
        self._finalizer = register(self._key, self, conn, self._ahead_out)
        self._ready: Message | None = None  # a batch reply read, not delivered yet
        self._wait_s = self._compute_s = 0.0  # since the last request (for the service's stats)
        self._copy_s = 0.0  # copying batches out of the shared memory, in all
        self._returned: float | None = None  # when take() last returned
        self._epoch_hint: int | None = None  # the epoch it opened at, until a batch moves it
        # the reply read ahead was this error, for a later epoch than the one being read
        self._failed: TabloaderError | None = None
        self._closed = False  # by close(), maybe from another thread

    @property
    def epoch(self) -> int:
        """The epoch of the next batch (0-based)."""
        with self._lock:
            if self._epoch_hint is not None:  # nothing taken since the open said
                return self._epoch_hint
            ready = self._peek()
            if self._failed is not None and hasattr(self._failed, "epoch"):
                return int(self._failed.epoch)
            if ready is not None and not ready.get("end"):
                return int(ready["epoch"])
            return int(self._conn.call("epoch")["epoch"])

    def take(self, epoch: int | None = None) -> dict[str, Any] | None:
        """The next batch, or None at the end of ``epoch`` (if given) or of the last epoch.

        Raises:
            LoaderError: the job's error; or the stream is closed (also by ``close()`` from
                another thread while this waits: not a lost service).
        """
        try:
            with self._lock:
                if self._closed:
                    raise self._closed_error()
                return self._take_locked(epoch)
        except TabloaderError:
            if self._closed:  # what failed is the connection close() hung up
                raise self._closed_error() from None
            raise

    def _closed_error(self) -> LoaderError:
        return LoaderError(f"Job stream {self.name!r} is closed; open the job again.")

    def _take_locked(self, epoch: int | None) -> dict[str, Any] | None:
        """``take`` with ``_lock`` held."""
        self._epoch_hint = None
        start = time.perf_counter()
        if self._returned is not None:
            self._compute_s += start - self._returned
        reply = self._collect()  # counts its own wait for a reply read ahead
        failed = self._failed
        if failed is not None:  # the next batch failed: raise it when it is asked for
            if epoch is not None and getattr(failed, "epoch", epoch) > epoch:
                self._returned = time.perf_counter()
                return None  # ``epoch`` ended before it
            self._failed = None
            raise failed
        start = time.perf_counter()
        if reply is None:
            reply = self._conn.call("next", **self._timing())
        if reply.get("end"):
            batch = None
        elif epoch is not None and int(reply["epoch"]) != epoch:
            self._ready, batch = reply, None  # of a later epoch: kept for its take
        else:
            copy = time.perf_counter()
            batch = self._build(reply.get("batch"))
            done = time.perf_counter()
            self._copy_s += done - copy
            self._wait_s += done - start  # the copy counts as waiting
            self._conn.send("next", release=[int(reply["ticket"])], **self._timing())
            self._ahead = True
        self._returned = time.perf_counter()
        return batch

    def _collect(self) -> Message | None:
        """The reply read ahead (waiting for it if it is on its way), or None; the caller
        holds ``_lock``."""
        if self._ahead:
            self._ahead = False
            t0 = time.perf_counter()
            try:
                self._ready = self._conn.receive()
            except LoaderError as exc:  # the job's error: ``take`` raises it in its turn
                self._failed = exc
            finally:
                self._wait_s += time.perf_counter() - t0
        ready, self._ready = self._ready, None
        return ready

    def _peek(self) -> Message | None:
        """``_collect``, the reply kept for the next ``take``."""
        self._ready = self._collect()
        return self._ready

    def _timing(self) -> dict[str, float]:
        timing = {"wait_s": self._wait_s, "compute_s": self._compute_s}
        self._wait_s = self._compute_s = 0.0
        return timing

    def next_batch(self) -> dict[str, Any]:
        """The next batch (``LoaderError`` after the last epoch)."""
        batch = self.take(None)
        if batch is None:
            raise LoaderError(f"Job stream {self.name!r} has delivered its epochs.")
        return batch

    def state_dict(self, *, undelivered: int = 0) -> dict[str, Any]:
        """Where the job is (as ``JobStream.state_dict()``): the batch read ahead is not
        delivered, so its rows are still to come, as are those of the ``undelivered``
        batches taken that the job has not trained on."""
        with self._lock:
            ready = self._peek()
            ahead = int(ready is not None and not ready.get("end"))
            state = self._conn.call("state", ahead=ahead + undelivered)["state"]
        return state_from_wire(state)

    def abandon(self, epoch: int) -> int:
        """Give up the rest of ``epoch`` (as ``JobStream.abandon``); the batch read ahead is
        dropped (and released) if it is of that epoch."""
        with self._lock:
            self._epoch_hint = None
            ready = self._collect()
            release: list[int] = []
            if ready is not None and not ready.get("end") and int(ready["epoch"]) == epoch:
                release = [int(ready["ticket"])]
            else:
                self._ready = ready  # of a later epoch (or the end): still to deliver
            reply = self._conn.call("abandon", epoch=epoch, release=release, **self._timing())
        return int(reply["rows"])

    def report(self, ids: Any, losses: Any) -> None:
        """Score rows of a batch by their losses (as ``JobStream.report``), checked here
        first. It waits for the batch read ahead (the service answers in order), which the
        next ``take`` then returns at once.

        Raises:
            LoaderError: as ``JobStream.report`` (the service's own check included).
        """
        checked_ids, checked_losses = report_arrays(ids, losses)
        wire = {"ids": report_to_wire(checked_ids), "losses": report_to_wire(checked_losses)}
        with self._lock:
            self._peek()  # the reply read ahead comes before this one
            self._conn.call("report", **wire)

    def stats(self) -> dict[str, Any]:
        """The job's counters (as ``JobStream.stats()``)."""
        with self._lock:
            self._peek()  # the reply read ahead comes before this one
            stats = dict(self._conn.call("stats", **self._timing())["stats"])
        stats["copy_s"] = self._copy_s  # this process's (part of its waiting)
        return stats

    def close(self) -> None:
        """Leave the job (the service releases what this stream held). It says so first (a
        batch read ahead and not come yet is given up), unless a ``take`` blocks in another
        thread for ``CLOSE_WAIT_S``: a connection that just drops is a client that died (on a
        Ray cluster, its job's other ranks then fail)."""
        self._closed = True  # first: a take() it interrupts says closed, not lost
        self._finalizer.detach()
        forget(self._key, self)
        if self._lock.acquire(timeout=self.CLOSE_WAIT_S):
            try:
                self._conn.send("leave", **self._timing())
                if self._ahead:  # the service stops waiting for that batch: leave is next
                    self._ahead = False
                    with contextlib.suppress(TabloaderError):
                        self._conn.receive(timeout=self.CLOSE_WAIT_S)
                self._conn.receive(timeout=self.CLOSE_WAIT_S)
            except TabloaderError:
                pass
            finally:
                self._lock.release()
        self._loader._keep_connected()  # before this connection goes: the service stays up
        self._conn.close()

    @property
    def _ahead(self) -> bool:
        return self._ahead_out.value

    @_ahead.setter
    def _ahead(self, value: bool) -> None:
        self._ahead_out.value = value

    # -- copying out of shared memory -----------------------------------------------------------
    def _build(self, wire: Any) -> dict[str, Any]:
        """The job's batch, copied out of the service's shared memory as the reply's layout
        says (checked first: a malformed one is a ``ServiceError``)."""
        loader = self._loader
        handed = HandedBatch.from_wire(wire, loader.arena)
        batch = handed.copy_out(loader.arena, loader.memory)
        images, prepared, staged = handed.images()
        # ours, and the service's into staging of the values the arena had no room for
        loader.count_copies(images, prepared, prepared + staged)
        return batch


_LOADERS: dict[Path, RemoteLoader] = {}
_LOADERS_LOCK = threading.Lock()
_STARTED: list[subprocess.Popen[bytes]] = []  # the services this process started


@atexit.register
def _at_exit() -> None:
    """This process's connections to services close as it exits (no "unclosed socket"
    ``ResourceWarning`` under ``-X dev``), and the services it started stay up, detached on
    purpose (the system reaps them; no "subprocess is still running" warning)."""
    with _LOADERS_LOCK:
        loaders = list(_LOADERS.values())
        _LOADERS.clear()
    for loader in loaders:
        with contextlib.suppress(Exception):
            loader.close()
    for proc in _STARTED:
        if proc.poll() is None:
            proc.returncode = 0  # Popen's own mark of a child it need not wait for


def service_loader(root: str | os.PathLike[str] | None) -> RemoteLoader:
    """This process's connection to the service of catalog ``root`` (default: as ``connect``
    in ``catalog``), made on first use, and anew once its service is gone (the next client
    starts a new one; streams of the old connection keep raising ``ServiceError``).
    """
    path = resolve_root(root)
    with _LOADERS_LOCK:
        loader = _LOADERS.get(path)
        if loader is None or not loader.alive():
            if loader is not None:
                loader.close()
            loader = _LOADERS[path] = RemoteLoader(path)
        return loader
