"""``tabloader serve``: one process per catalog owns the catalog and the engine; jobs are clients.

Control plane: :mod:`tabloader.service._protocol` (an authenticated Unix socket, JSON). Data
plane: the arena is shared memory of no name (:mod:`tabloader.engine._arena.shm`), which clients map
read-only from a descriptor sent on the socket. A job's batch reaches its client as a *ticket*:

* the engine hands it over as a :class:`~tabloader.engine._deliver.handoff.HandedBatch` (its job
opened
  ``remote``): its images stay where the shared decode put them, pinned in the arena; a job
  that augments gets its own images instead, made by the engine's threads into slots of the
  batch's own (one shape and dtype);
* its other columns (``_id``, labels, ...), each prepared column's index (each value's start
  and shape) and any image the arena had no room for are written once into a *staging* slot
  of the arena; the reply's ``batch`` says where (``HandedBatch.to_wire``: fixed-width columns
  as raw arrays, others as an Arrow IPC stream);
* the client checks that layout (``HandedBatch.from_wire``), copies every value into its own
  arrays with the same ``copy_out`` as a job of the engine's process (the one copy: its batch
  is its own) and names the ticket in its next request, which releases the pins and the
  staging slot.

No payload byte crosses the socket and nothing is pickled. A client whose connection closes
(exit, crash, SIGKILL) leaves: its job's stream closes and its tickets are released.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import multiprocessing
import multiprocessing.util
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypedDict, cast

import numpy as np

from tabloader.catalog._api import StatementTarget
from tabloader.catalog._directory import not_a_catalog
from tabloader.catalog._errors import LoaderError, ServiceError
from tabloader.engine import Loader
from tabloader.engine._deliver.handoff import HandedBatch, Staging
from tabloader.engine._deliver.stream import ServedStream
from tabloader.engine._deliver.streams import no_importance
from tabloader.engine._opening import OpenRequest, state_to_wire
from tabloader.engine._prepare.storage import Share, node_cache_dir
from tabloader.engine._queue.sources import Fed
from tabloader.service._catalog_ops import CatalogOps
from tabloader.service._listener import STARTER_ENV, Listener, ServiceRunningError, Session
from tabloader.service._metrics import MetricsServer, render_metrics
from tabloader.service._plugins import Feed
from tabloader.service._protocol import (
    FDS,
    LOG_FILE,
    BatchReply,
    Empty,
    EndReply,
    EpochReply,
    HelloReply,
    Message,
    OpenReply,
    OptionsReply,
    RowsReply,
    SegmentReply,
    StateReply,
    StatsReply,
    report_from_wire,
    runtime_dir,
)
from tabloader.service._turns import open_catalog

logger = logging.getLogger(__name__)

STAGING_TICKETS = 1 << 16  # staging slots are rows of one arena space, reused round-robin
STAGING_BLOCK = 64 << 10  # a batch's small columns (ids, labels) fit one block after the arena
STAGING_BLOCKS = 64
# a batch staged in a run of slabs (an augmented batch: 9.6 MB at 64x3x224x224) waits this
# long for pins to drop: the batches in flight pin values scattered over the slabs, and 1 bench
# e2e run in 12 found no free run at once and failed the job
STAGING_WAIT_S = 10.0
READY_TIMEOUT_S = 120.0  # the longest a client's wait_ready() waits for the decode processes


class Service:
    """The loader service of one catalog (see the module docstring).

    Args:
        root: the catalog directory.
        cache_bytes: the arena's size (shared memory).
        workers: decode processes and reader threads.
        idle_exit: stop this many seconds after the last client left (None: never); what a
            service started in the background by a client uses.
        node: the Ray node this service is the loader of (names its runtime directory).
        opened: the catalog to read instead of opening it here (a node's loader reads one
            opened only for the moment of a lookup).
        feed: makes, given the service, the :class:`~tabloader.service._plugins.Feed` of every
            job opened here (a node's loader: the cluster's leader); None: jobs sample here.
        access_log: record the engine's look-ups and releases to this ``.npz`` file when the
            service stops (``Loader``'s ``access_log``; for benchmarks' cache bounds).
        max_image_megapixels: the pixel limit of a decode (``Loader``'s; None: the setting).
        storage_cache_bytes: the local storage tier of datasets in object storage
            (``Loader``'s; None: the setting, ``--storage-cache-bytes``); a node's is its own,
            ``node_cache_dir(node)`` under the catalog.
        storage_share: a Ray node's partitioned cache around its tier (``Loader``'s).
        metrics_port: serve the figures of ``stats()`` for Prometheus at
            ``http://127.0.0.1:PORT/metrics`` until closed (:mod:`tabloader.service._metrics`;
            0: a free port, then ``metrics.port`` says which); None: not.

    A service started by a client (``STARTER_ENV`` set) that finds another one serving exits 0
    with one line in the log instead (see ``_lost_start``).

    Raises:
        ServiceRunningError: a service already runs for the catalog.
        CatalogError: the directory is not a usable catalog.
    """

    def __init__(
        self,
        root: Path,
        *,
        cache_bytes: int = 1 << 30,
        workers: int | None = None,
        idle_exit: float | None = None,
        node: str | None = None,
        opened: StatementTarget | None = None,
        feed: Callable[[Service], Feed] | None = None,
        access_log: str | os.PathLike[str] | None = None,
        max_image_megapixels: int | None = None,
        storage_cache_bytes: int | None = None,
        storage_share: Share | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.root = Path(root).absolute()
        self.metrics: MetricsServer | None = None
        self.node = node
        self.idle_exit = idle_exit
        self._stop = threading.Event()
        self.lock = threading.RLock()  # the catalog: one statement or open at a time
        self._tickets = itertools.count()
        starter = os.environ.pop(STARTER_ENV, None)  # this process's, not its children's
        try:
            self.listener = Listener(
                self.root, lambda session: _Handler(self, session), node=node, listen=False
            )
        except ServiceRunningError as exc:
            if starter is None:  # a user's `tabloader serve`: theirs to see
                raise
            _lost_start(self.root, exc, starter)
        self.feed: Feed | None = None
        try:
            self.catalog: StatementTarget = open_catalog(self.root) if opened is None else opened
            try:
                if not self.catalog.exists:  # a service reads a catalog; it creates none
                    raise not_a_catalog(self.root)
                self.loader = Loader(
                    self.catalog,
                    cache_bytes=cache_bytes,
                    workers=workers,
                    staging_bytes=STAGING_BLOCK * STAGING_BLOCKS,
                    access_log=access_log,
                    max_image_megapixels=max_image_megapixels,
                    storage_cache_bytes=storage_cache_bytes,
                    # a node of a Ray cluster keeps its own tier (its share, on its disk)
                    storage_cache_dir=None if node is None else self.root / node_cache_dir(node),
                    storage_share=storage_share,
                )
            except BaseException:
                self.catalog.close()
                raise
        except BaseException:
            self.listener.close()
            raise
        self._stage()
        try:
            if feed is not None:
                self.feed = feed(self)
            if metrics_port is not None:
                self.metrics = MetricsServer(metrics_port, self.prometheus)
            self.listener.listen()  # clients find the socket once the service can answer
        except BaseException:
            self.close()
            raise

    def _stage(self) -> None:
        """The staging of the loader's shared segment: its arena's ``_staging`` space and the
        blocks after the arena (the loader has no segment: closed, ``ServiceError``)."""
        segment = self.loader.segment
        if segment is None:
            self.close()
            raise ServiceError(
                "The loader service needs shared memory (/dev/shm with room for the cache); "
                "lower --cache-bytes, or use a Loader in-process."
            )
        arena = self.loader.arena
        self.arena = arena
        self.staging = arena.space("_staging", num_rows=STAGING_TICKETS)
        # Blocks of the segment after the arena: pinned images can never take them, so a
        # batch always finds room for its ids and labels (a bigger staging uses the arena).
        self.blocks = list(range(STAGING_BLOCKS - 1, -1, -1))
        self.blocks_at = arena.buffer.size
        self.blocks_view = np.frombuffer(
            segment.buf, np.uint8, STAGING_BLOCK * STAGING_BLOCKS, self.blocks_at
        )
        self.blocks_lock = threading.Lock()
        self.segment = segment

    def serve(self) -> None:
        """Serve until SIGTERM/SIGINT, ``stop()``, or ``idle_exit`` seconds without clients."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self._stop.set())
        # The objects of the imports and of the start live as long as the service: a full
        # collection need not walk them again every time the requests' garbage triggers one.
        gc.freeze()
        accept = threading.Thread(target=self.listener.serve_forever, daemon=True)
        accept.start()
        logger.info("serving catalog %s", self.root)  # the listener logs its socket
        idle_since = time.monotonic()
        warmed = False
        try:
            while not self._stop.wait(0.2):
                if not warmed and not self.listener.sessions:
                    warmed = True  # once: with no client, nobody's first batch waits for it
                    threading.Thread(target=_warm_statements, daemon=True).start()
                if self.listener.sessions:
                    idle_since = time.monotonic()
                elif self.idle_exit is not None and time.monotonic() - idle_since > self.idle_exit:
                    logger.info("no client for %.0f s: stopping", self.idle_exit)
                    break
        finally:
            self.close()

    def stop(self) -> None:
        """Ask ``serve()`` to return (it closes everything)."""
        self._stop.set()

    def close(self) -> None:
        """Close every connection, the catalog, then the engine (its processes and shared
        memory).

        The catalog goes before the engine: the engine's close waits for the decodes in
        flight (one in a thread cannot be stopped), and a new service, which a client starts as
        soon as this one's socket is gone, must find the catalog free, not locked until they
        end; so the listener stops taking connections first and frees its socket and lock
        (which let a new service start) once the catalog is closed. The work in flight is
        abandoned: its batches have no client left.
        """
        self._stop.set()
        if self.metrics is not None:
            self.metrics.close()
        self.listener.stop()
        self.catalog.close()  # before the lock that lets a new service start
        self.listener.close()
        if self.feed is not None:
            self.feed.close()
        self.loader.close()

    def stats(self, *, but: Any = None) -> dict[str, Any]:
        """The engine's counters (``Loader.stats()``) and the ``clients`` but ``but``."""
        return {**self.loader.stats(), "clients": self.clients(but=but)}

    def prometheus(self) -> str:
        """``stats()`` in Prometheus' text format (``--metrics-port``)."""
        return render_metrics(_jsonable(self.stats()))

    def clients(self, *, but: Any = None) -> list[ClientInfo]:
        """The client processes connected now, but the connection ``but`` (the one asking):
        ``pid``, ``connections`` (a process has one for statements and one per job stream)
        and the ``jobs`` it reads (job, rank, world_size)."""
        out: dict[int, ClientInfo] = {}
        for handler in cast("list[_Handler]", self.listener.handlers()):
            who = None if handler is but else handler.client()
            if who is not None:
                pid, job = who
                client = out.setdefault(pid, {"pid": pid, "connections": 0, "jobs": []})
                client["connections"] += 1
                client["jobs"] += [job] if job else []
        return sorted(out.values(), key=lambda c: c["pid"])

    def ticket(self) -> int:
        return next(self._tickets) % STAGING_TICKETS


class JobSeat(TypedDict):
    """A job stream a client reads: its job and rank among the job's ranks."""

    job: str
    rank: int
    world_size: int


class ClientInfo(TypedDict):
    """A client process of the service (``Service.clients``)."""

    pid: int
    connections: int  # one for statements, one per job stream
    jobs: list[JobSeat]


class _Handler(CatalogOps):
    """One client connection: statements (and ``CatalogOps``), or one job's stream."""

    def __init__(self, service: Service, session: Session) -> None:
        self.service = service
        self.session = session
        self.stream: ServedStream | None = None
        # ticket -> staging offset, staging block (-1: staged in the arena, or nothing), and
        # the batch's Work (what it holds in the arena)
        self.out: dict[int, tuple[int, int, Any]] = {}
        self.lock = threading.Lock()
        self.closed = False
        self.joined: tuple[str, int] | None = None  # a fed job: (job, rank) on the leader
        self.left = False  # the client asked to leave (else its connection dropped)
        self.unread: int | None = None  # rows of the batch sent last, until the client asks on

    def handle(self, msg: Message) -> Mapping[str, object]:
        op = msg.get("op")
        fn = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        if fn is None:
            raise ServiceError(f"Unknown request {op!r}; is the client a newer tabloader?")
        return fn(msg)  # type: ignore[no-any-return]

    # -- statements --------------------------------------------------------------------------
    def op_hello(self, msg: Message) -> HelloReply:
        return {
            "pid": os.getpid(),
            "catalog": str(self.service.root),
            "segment": self.service.segment.name,
        }

    def op_segment(self, msg: Message) -> SegmentReply:
        """The arena's shared memory: its name and size, and a read-only descriptor of it."""
        segment = self.service.segment
        return {
            "segment": segment.name,
            "size": segment.size,
            "pid": os.getpid(),
            FDS: [segment.readonly_fd()],
        }

    def op_options(self, msg: Message) -> OptionsReply:
        with self.service.lock:
            return {"options": self.service.loader.job_options(msg.string("job"))}

    def op_rows(self, msg: Message) -> RowsReply:
        with self.service.lock:
            return {"rows": self.service.loader.job_rows(msg.string("job"))}

    def op_stats(self, msg: Message) -> StatsReply:
        if self.stream is not None:
            self._record_stalls(msg)
            return {"stats": _jsonable(self.stream.stats())}
        return {"stats": _jsonable(self.service.stats(but=self))}

    def client(self) -> tuple[int, JobSeat | None] | None:
        """This connection's process and the job stream it reads, if any (None: closed)."""
        if self.closed:
            return None
        stream = self.stream
        if stream is None:
            return self.session.pid, None
        return self.session.pid, {
            "job": stream.name,
            "rank": stream.rank,
            "world_size": stream.world_size,
        }

    def op_ready(self, msg: Message) -> Empty:
        self.service.loader.wait_ready(READY_TIMEOUT_S)
        return {}

    # -- a job ---------------------------------------------------------------------------------
    def op_open(self, msg: Message) -> OpenReply:
        """Open a job on this connection: ``request`` is an ``OpenRequest.to_wire()``;
        ``segment`` the shared memory the client maps already (a stale client's open is
        refused before the job opens), or None: the reply carries a read-only descriptor of
        it, so that a client's first open is its only request before its first batch (it sends
        its first ``next`` behind it without waiting)."""
        if self.stream is not None:
            raise LoaderError("This connection has a job open already; open another connection.")
        unknown = sorted(set(msg) - {"op", "v", "request", "segment"})
        if unknown:
            raise ServiceError(
                f"Unknown open argument(s) {', '.join(unknown)}: an open's arguments travel as "
                "request=OpenRequest.to_wire(); is the client another tabloader version?"
            )
        segment = self.service.segment
        mapped = msg.get("segment")
        if mapped is not None and mapped != segment.name:
            stale = ServiceError(
                f"The client maps shared memory segment {str(mapped)[:80]!r}, not the memory of "
                "this service: it was connected to a service that is gone."
            )
            stale.stale_segment = True  # type: ignore[attr-defined]  # travels with the error
            raise stale
        request = OpenRequest.from_wire(msg.get("request"))
        feed = self.service.feed
        with self.service.lock:  # a fed service's jobs get their rows from the feed's leader
            if feed is None:
                stream = self.service.loader.serve(request)
            else:
                info = self.service.catalog.job(request.job)
                stream = self.service.loader.serve(request, source=Fed)
        if feed is not None:
            rank, world_size = int(request.rank or 0), int(request.world_size or 1)
            try:
                feed.join(stream, info, rank=rank, world_size=world_size)
            except BaseException:
                stream.close()
                raise
            self.joined = (info.name, rank)
        with self.lock:
            if self.closed:  # the client left while we opened
                stream.close()
                raise ServiceError("the client left")
            self.stream = stream
        logger.info("client pid %d opened job %s", self.session.pid, stream.name)
        reply: OpenReply = {
            "job": stream.name,
            "epoch": stream.epoch,
            "spec": stream.spec.to_wire(),
            "segment": segment.name,
            "size": segment.size,
            "pid": os.getpid(),
        }
        if mapped is None:
            reply[FDS] = [segment.readonly_fd()]
        return reply

    def op_next(self, msg: Message) -> BatchReply | EndReply:
        """The next batch. The request also says the client's job has the batch sent last
        (a client asks once it has copied it out: it reads one ahead)."""
        self._release(msg.tickets())
        stream = self._stream()
        self._record_stalls(msg)
        if self.unread is not None:
            stream.record_delivery(self.unread)
            self.unread = None
        try:  # the client keeps one of a later epoch for its take(epoch)
            batch = stream.take(None)
        except LoaderError as exc:  # the epoch it failed at: a take(epoch) before ends first
            exc.epoch = stream.epoch  # type: ignore[attr-defined]
            raise
        if batch is None:
            return {"end": True, "epoch": stream.epoch}
        handed = _handed(batch)
        reply = self._deliver(handed)
        self.unread = len(handed)
        return reply

    def _record_stalls(self, msg: Message) -> None:
        """The client's own stall times since its last request (it reads ahead, so the time
        this service waits for its next batch is mostly the client computing)."""
        stalls = msg.stalls()
        if any(stalls):
            self._stream().record_stalls(*stalls)

    def op_release(self, msg: Message) -> Empty:
        self._release(msg.tickets())
        return {}

    def op_epoch(self, msg: Message) -> EpochReply:
        return {"epoch": self._stream().epoch}

    def op_state(self, msg: Message) -> StateReply:
        ahead = msg.get("ahead", 0)
        if not isinstance(ahead, int) or isinstance(ahead, bool) or not 0 <= ahead <= 2:
            raise ServiceError(
                f"'ahead' is the batches a client holds but its job has not trained on, 0 to "
                f"2: {ahead!r}."
            )
        return {"state": state_to_wire(self._stream().state_dict(undelivered=ahead))}

    def op_abandon(self, msg: Message) -> RowsReply:
        """The client's job starts a new iteration mid-epoch: give up the rest of ``epoch``.
        ``release`` lists the batch it read ahead and dropped, if it was of that epoch."""
        epoch = msg.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ServiceError(f"'epoch' to abandon must be an epoch number: {epoch!r}.")
        dropped = msg.tickets()
        self._release(dropped)
        stream = self._stream()
        self._record_stalls(msg)
        ahead_rows = 0
        if dropped and self.unread is not None:  # the batch sent last: never delivered
            ahead_rows, self.unread = self.unread, None
        return {"rows": stream.abandon(epoch, ahead_rows=ahead_rows)}

    def op_report(self, msg: Message) -> Empty:
        """The client's job scored rows of a batch by their losses (``Stream.report``): to
        the job's sampler here, or on a Ray node to the cluster leader's (the feed)."""
        ids, losses = report_from_wire(msg)
        stream = self._stream()
        feed = self.service.feed
        if feed is None:
            stream.report(ids, losses)
            return {}
        if stream.spec.importance != "loss":  # the leader would say so too, one hop later
            raise no_importance(stream.name)
        job = stream.name if self.joined is None else self.joined[0]
        feed.report(job, ids, losses)
        return {}

    def op_leave(self, msg: Message) -> Empty:
        self.left = True
        self.close()
        return {}

    def _stream(self) -> ServedStream:
        if self.stream is None:
            raise LoaderError("No job is open on this connection; send 'open' first.")
        return self.stream

    # -- the data plane ------------------------------------------------------------------------
    def _deliver(self, batch: HandedBatch) -> BatchReply:
        """Lay a handed-over batch out in shared memory; the reply says where
        (``HandedBatch.to_wire``, read by the client's ``HandedBatch.from_wire``)."""
        arena, service = self.service.arena, self.service
        staged = Staging()
        wire = batch.to_wire(staged)
        used = staged.used
        ticket = service.ticket()
        staging, block = -1, -1
        if 0 < used <= STAGING_BLOCK:
            with service.blocks_lock:
                block = service.blocks.pop() if service.blocks else -1
            if block >= 0:
                staging = service.blocks_at + block * STAGING_BLOCK
        if used > arena.slab_bytes and block < 0:  # whole slabs, their values evicted
            staging = arena.reserve_run(used, wait=STAGING_WAIT_S)
        elif used and block < 0:
            staging = int(arena.reserve(service.staging, np.array([ticket]), (used,))[0][0])
        if used and staging < 0:
            batch.work.plan.receiver.release(batch.work)
            raise LoaderError(
                f"A batch needs {used} bytes of staging in the cache, more than its unpinned "
                + (
                    f"part held in one run of slabs for {STAGING_WAIT_S:.0f} s"
                    if used > arena.slab_bytes
                    else "part"
                )
                + "; raise the service's cache size or lower batch_size."
            )
        if used:
            target = (
                service.blocks_view[block * STAGING_BLOCK :]
                if block >= 0
                else arena.buffer[staging:]
            )
            staged.write(target, staging)
        wire["base"] = staging
        with self.lock:
            self.out[ticket] = (staging, block, batch.work)
            closed = self.closed
        if closed:
            self._release([ticket])
            raise ServiceError("the client left")
        return {"ticket": ticket, "epoch": batch.work.epoch, "batch": wire}

    def _release(self, tickets: list[int]) -> None:
        arena = self.service.arena
        for t in tickets:
            with self.lock:
                held = self.out.pop(t, None)
            if held is None:
                continue
            staging, block, work = held
            work.plan.receiver.release(work)  # its pins (and the access log hears of it)
            if block >= 0:
                with self.service.blocks_lock:
                    self.service.blocks.append(block)
            elif staging >= 0:
                arena.discard(np.array([staging], np.int64))

    def interruptible(self, msg: Message) -> bool:
        """Only a ``next`` is given up by a request sent while it waits (a client's ``leave``
        while it reads ahead); an ``open`` has the first ``next`` sent right behind it."""
        return msg.get("op") == "next"

    def interrupt(self) -> None:
        """The client sent a request while its ``next`` waits: it leaves (the only request a
        client sends then), so the job's stream closes and the waiting ``take`` returns."""
        with self.lock:
            stream = self.stream
        if stream is not None:
            stream.close()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            stream = self.stream
            tickets = list(self.out)
        if stream is not None:
            # a client that hangs up after its share of an epoch (its batch read ahead
            # unread) ended normally, as one that said it leaves; other ends are deaths
            undelivered = int(self.unread is not None)
            ended = self.left or stream.share_done(undelivered=undelivered)
            rank = stream.rank if self.joined is None else self.joined[1]  # fed: the job's
            who = f"rank {rank} (pid {self.session.pid}"
            feed = self.service.feed
            if feed is None and not self.left:
                stream.lost(f"{who})", undelivered=undelivered)  # closes it
            else:
                stream.close()  # a take() waiting in handle() returns (raises: closed)
            logger.info("client pid %d left job %s", self.session.pid, stream.name)
            if feed is not None and self.joined is not None:
                node = (self.service.node or "")[:16]
                feed.leave(
                    self.joined[0],
                    rank,
                    failed=not ended,
                    reason="" if ended else f"{who}, node {node}) died mid-run",
                )
        self._release(tickets)


def _lost_start(root: Path, exc: ServiceRunningError, starter: str) -> NoReturn:
    """End a service that a client started in the background and that found another serving
    the catalog (two clients, or a client and ``tabloader serve``, started one at once; or the
    client found the one before answering too slowly): one line in the log says so, and it
    exits 0. The client connects to the other one; a traceback or a ``ServiceError`` line
    there read as a failure, which it is not."""
    logger.warning(
        "another tabloader service (pid %s) already serves catalog %s; this one (pid %d, "
        "started by pid %s) exits",
        "?" if exc.pid is None else exc.pid,
        root,
        os.getpid(),
        starter,
    )
    raise SystemExit(0)


TEMP_DIR = "mp"  # multiprocessing's temporary folder, in the service's runtime directory


def keep_temp_private(root: Path) -> Path | None:
    """Give multiprocessing (the decode processes' forkserver, whose socket is there) a
    temporary folder in the service's runtime directory instead of a ``pymp-*`` folder in
    ``$TMPDIR``, and remove the one a service killed before left there.

    A service's decode processes remove its folder when it is killed, but not when they die
    with it (a kill of its process group, an out-of-memory kill): a ``pymp-*`` folder was left
    in the temporary folder for good. This one is the service's own and goes at the next
    start. Process-wide: for a process that is the service alone (``tabloader serve``), with
    the service's lock held (no live service's folder is removed) and before any decode
    process starts. Returns the folder; None where multiprocessing has one already (kept).
    """
    config = getattr(multiprocessing.current_process(), "_config", None)
    if not isinstance(config, dict) or config.get("tempdir") is not None:
        return None
    folder = runtime_dir(root) / TEMP_DIR  # short: its socket fits (``runtime_dir``)
    shutil.rmtree(folder, ignore_errors=True)  # a killed service's: the lock is ours now
    folder.mkdir(mode=0o700)
    config["tempdir"] = str(folder)
    multiprocessing.util.Finalize(
        None, shutil.rmtree, args=(str(folder),), kwargs={"ignore_errors": True}, exitpriority=-100
    )
    return folder


def log_to_file(root: Path) -> Path:
    """Log every logger's INFO and above to the service's log file (appended, with times
    and the pid) as well; handlers there already keep the level they had. Returns the path.

    A service that a client started writes its stderr into that file too: there the handlers
    that write to stderr are dropped, else each of their records (WARNING and above) would
    be in the file twice.
    """
    path = runtime_dir(root) / LOG_FILE
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(
        logging.Formatter("%(asctime)s pid %(process)d %(levelname)s %(name)s: %(message)s")
    )
    top = logging.getLogger()
    if _same_file(sys.stderr, path):
        for other in list(top.handlers):
            if isinstance(other, logging.StreamHandler) and other.stream is sys.stderr:
                top.removeHandler(other)
    if top.getEffectiveLevel() > logging.INFO:
        for other in top.handlers:
            if other.level == logging.NOTSET:
                other.setLevel(top.getEffectiveLevel())  # the console shows what it did
        top.setLevel(logging.INFO)
    top.addHandler(handler)
    return path


def _same_file(stream: Any, path: Path) -> bool:
    """Whether ``stream`` writes to the file at ``path``."""
    try:
        mine, theirs = os.fstat(stream.fileno()), os.stat(path)
    except (OSError, AttributeError, ValueError):  # no descriptor (a test's capture), no file
        return False
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def yield_to_jobs() -> bool:
    """Put this process's threads (and the threads and processes they start from now on)
    under Linux's ``SCHED_BATCH``: same share of the CPU, but a wake-up never preempts a
    running task.

    A job's request wakes a service thread with a *sync* wake-up (Unix sockets), which puts it
    on the job's own core and preempts the job there: a job's ``send`` of its next request
    took 0.7 ms while the service prepared the reply on its core (1.3 involuntary context
    switches per batch), against 25 us under ``SCHED_BATCH`` (0.2); the job's per-batch
    overhead went from 2.6-2.7 to 2.1-2.3 ms. The service's threads then run when a core is
    free, which the job's compute does not wait for (it reads ahead). False where the policy
    does not exist (not Linux) or is refused.
    """
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        return False
    try:  # each thread has its own policy: those that imports started too (pyarrow's...)
        for tid in [int(t) for t in os.listdir("/proc/self/task")] or [0]:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setscheduler(tid, policy, os.sched_param(0))
    except OSError as exc:  # pragma: no cover - unprivileged users may always choose it
        logger.info("SCHED_BATCH refused (%s): the service keeps the default policy", exc)
        return False
    return True


def _handed(batch: object) -> HandedBatch:
    """A batch of a stream opened ``remote`` (the engine's ``HandOver`` made it)."""
    if not isinstance(batch, HandedBatch):  # pragma: no cover - every job here opens remote
        raise LoaderError(f"A service's job got a {type(batch).__name__} batch, not handed over.")
    return batch


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _warm_statements() -> None:
    """Import and exercise the statement parser (sqlglot and the dialect: 0.15-0.35 s here)
    and the statements' code, so the first statement a client sends (a REGISTER JOB) does not
    pay for it. The service imports only what serving needs when it starts (a job's first
    batch must not wait for the parser); ``serve`` runs this once, while no client is
    connected. A failure here costs nothing: the first statement imports it again and
    reports what is wrong."""
    try:
        from tabloader.catalog._sql import dialect, execute, validate  # noqa: F401

        dialect.parse("REGISTER OR REPLACE JOB w SELECT a FROM d WHERE a % 3 <> 0 AND b < 5")
        dialect.parse_predicate("a < 50")
    except Exception:
        logger.debug("warming the statement parser failed", exc_info=True)
