"""Decoding image rows: in the calling thread, or in decode processes writing into shared memory.

Threads decode and resize with the GIL released, but the Python between those calls (slicing the
stored bytes, bookkeeping, the arena) holds it: on 16 cores the threads of one process top out near
8 busy workers (measured: 1,648 rows/s with 8, 1,052 with 16). Decode processes have a GIL each. The
loader's arena lives in a shared-memory segment (:mod:`tabloader.engine._arena.shm`); a fixed-shape
space's slots are reserved in the loader process, and a worker reads the rows' bytes from the
dataset's files itself (no payload is pickled), decodes and resizes them with the same
:class:`~tabloader.engine._prepare.prep.Decoder` (the same pixels as a thread would produce) and
writes each value straight into its slot. Only row ids, offsets, errors and counters cross the pipe.

**Memory cap.** Each decode checks the image's declared size against the pixel limit before it
allocates (:mod:`tabloader.engine._prepare.imagesize`); where the platform has ``RLIMIT_DATA``
(Linux), a decode process also runs under a cap on its private memory: what it uses once started,
plus ``CAP_BYTES_PER_PIXEL`` bytes a pixel of the limit (one decode at its widest: CMYK or RGBA,
then its RGB copy), plus ``CAP_HEADROOM`` for the rows' stored bytes, a batch of small decodes and
the libraries' own buffers (64 MP: 1.5 GiB over the start). The shared arena is a shared mapping,
outside the cap. A decode that reaches it (a format whose header lies, a decoder's own tables) gets
a ``MemoryError``, which ends its process: as with any death, its task runs again, and a row whose
decode alone ends a process twice is bad data (``KILLS_PER_ROW``). In the loader's threads a
``MemoryError`` fails its row for this batch only (it is not bad data).
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import functools
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.reduction
import multiprocessing.spawn
import multiprocessing.util
import os
import pickle
import queue
import resource
import select
import shutil
import signal
import sys
import termios
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from tabloader.catalog._errors import LoaderError, RowReadError, StorageError
from tabloader.catalog.storage import DatasetReader, register_store
from tabloader.catalog.storage._stores import store_factory
from tabloader.engine._arena.shm import Segment, process_alive
from tabloader.engine._prepare import zygote
from tabloader.engine._prepare.prep import Decoder
from tabloader.engine.decode import pixel_limit

Errors = dict[int, BaseException]
Result = tuple[Errors, dict[str, float]]

#: A row whose decode alone killed this many decode processes is bad data (``RowReadError``).
KILLS_PER_ROW = 2
#: The decode processes' memory cap (module docstring): bytes a pixel of the pixel limit...
CAP_BYTES_PER_PIXEL = 8
#: ... and bytes over that and what the process used once started.
CAP_HEADROOM = 1 << 30
_OUT_OF_MEMORY = 75  # a decode process's exit status when a decode ran out of its cap
#: What the decode processes' forkserver imports before it forks any. Not torch: the resizes : are
# tabloader's own kernel (:mod:`tabloader.engine._prepare.resample`); only an install without it :
# imports torch, in each decode process at its first resize.
FORKSERVER_PRELOAD = (__name__,)

logger = logging.getLogger(__name__)


def decode_rows(
    reader: DatasetReader,
    dec: Decoder,
    rows: npt.NDArray[np.int64],
    into: Callable[[int, tuple[int, int, int]], npt.NDArray[np.uint8] | None] | None = None,
) -> tuple[list[npt.NDArray[np.uint8] | None], Errors, dict[str, float]]:
    """Read and decode ``rows`` (sorted: a record batch is read once) of ``dec``'s column.

    Returns ``(values, errors, counters)``: a value or None per row, the failures by position
    (``RowReadError``; ``StorageError`` for every row of a damaged record batch, which the
    reader checks against its checksums on first read in this process; any other failed read
    fails every row), and ``read_s``, ``decode_s``, ``reads``, ``bytes_read``, ``decodes``.

    The values are read first, all together (``DatasetReader.binary_values``: small rows one
    value at a time, not a record batch each), then decoded together (``Decoder.many``: the
    resizes of one shape in one call).
    """
    t0 = time.perf_counter()
    try:
        raw, errors = reader.binary_values(rows, dec.column)
    except Exception as exc:  # a failed read: every row fails with it
        values: list[npt.NDArray[np.uint8] | None] = [None] * rows.size
        return values, dict.fromkeys(range(rows.size), exc), _counters(0, 0, 0, 0)
    return decode_values(dec, rows, raw, dict(errors), into, read_s=time.perf_counter() - t0)


def decode_values(
    dec: Decoder,
    rows: npt.NDArray[np.int64],
    raw: list[Any],
    failed: Errors,
    into: Callable[[int, tuple[int, int, int]], npt.NDArray[np.uint8] | None] | None = None,
    *,
    read_s: float = 0.0,
) -> tuple[list[npt.NDArray[np.uint8] | None], Errors, dict[str, float]]:
    """Decode the values ``raw`` of ``rows`` read already (``decode_rows``), but those that
    failed to read (``failed``, by position)."""
    values: list[npt.NDArray[np.uint8] | None] = [None] * rows.size
    t1 = time.perf_counter()
    todo = [i for i in range(rows.size) if i not in failed] if failed else range(rows.size)
    reads = nbytes = 0
    for i in todo:
        if raw[i] is not None:
            reads += 1
            nbytes += len(raw[i])
    where = None if into is None else (lambda k, shape: into(todo[k], shape))
    prepared = dec.many([raw[i] for i in todo], rows[todo].tolist(), where)
    shape = dec.fixed_shape  # a decode process writes it into a slot of that shape
    for i, value in zip(todo, prepared, strict=True):
        if isinstance(value, MemoryError):  # not the row's fault: not bad data
            failed[i] = LoaderError(
                f"row {int(rows[i])}, column {dec.column!r}: out of memory while decoding it "
                f"({value!r}); it is decoded again when asked for next time."
            )
            failed[i].__cause__ = value
        elif isinstance(value, BaseException):
            failed[i] = value
        elif shape is not None and (value.shape != shape or value.dtype != np.uint8):
            failed[i] = LoaderError(
                f"row {int(rows[i])}, column {dec.column!r}: its decode gave {value.dtype} "
                f"{value.shape}, not uint8 {shape} (image_size {dec.image_size!r}); fix the "
                f"decode backend {getattr(dec.backend, 'name', None)!r}."
            )
        else:
            values[i] = value
    counters = _counters(read_s, time.perf_counter() - t1, reads, nbytes)
    counters["decodes"] = sum(v is not None for v in values)
    return values, failed, counters


def _counters(read_s: float, decode_s: float, reads: int, nbytes: int) -> dict[str, float]:
    return {
        "read_s": read_s,
        "decode_s": decode_s,
        "reads": reads,
        "bytes_read": nbytes,
        "decodes": 0,
    }


class DecodePool:
    """Processes that decode rows into a shared-memory arena; see the module docstring.

    Args:
        segment: the arena's segment (its descriptor is handed to each process as it starts).
        processes: how many.
        max_pixels: the pixel limit the processes' memory cap is sized from (module
            docstring; None: :func:`~tabloader.engine.decode.pixel_limit`'s).

    The processes start from a ``forkserver`` (never ``fork``: the loader has threads and a
    DuckDB connection) that has imported this module once: on first use, or ahead of it with
    :meth:`start`. In a loader of its own that is an interpreter and its imports (0.25-0.4 s
    of a core; later loaders of the process reuse it); a service's is the fork it made as it
    started, before its threads (:mod:`~tabloader.engine._prepare.zygote`), which has
    everything imported already.

    A process that dies (killed, crashed) is a fault, not bad data: it breaks the executor and
    every task in flight with it; the executor is replaced and each of those tasks runs again
    (its slots stay reserved, so every batch waiting for its rows still gets them). A task
    caught in a second death has its rows decoded one at a time in a process of their own (the
    quarantine), where a death names its row: a row whose decode alone killed
    ``KILLS_PER_ROW`` processes fails as bad data (``RowReadError``), so it cannot loop forever.
    """

    def __init__(self, segment: Segment, processes: int, max_pixels: int | None = None) -> None:
        self._segment, self.processes = segment, processes
        self.max_pixels = pixel_limit() if max_pixels is None else max_pixels
        self._pool: ProcessPoolExecutor | None = None
        self._quarantine: ProcessPoolExecutor | None = None  # one process, one row at a time
        self._lock = threading.Lock()  # creating the pools (``start``'s thread and submits)
        self._closed = False
        self._starting: threading.Thread | None = None
        self._specs: dict[int, tuple[DatasetReader, int, bytes]] = {}  # id(reader) -> ...
        self._retries: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._retrier: threading.Thread | None = None
        self._kills: dict[tuple[int, str, int], int] = {}  # (reader, column, row) -> deaths

    @property
    def status(self) -> str:
        """``"idle"`` (no process started yet), ``"starting"`` (:meth:`start`'s background
        start runs), ``"running"``, ``"broken"`` (a process died: the next ``submit`` starts
        new ones) or ``"closed"``."""
        with self._lock:
            pool = self._pool
        if self._closed:
            return "closed"
        if pool is not None and pool._broken:
            return "broken"
        if self._starting is not None and self._starting.is_alive():
            return "starting"
        return "idle" if pool is None else "running"

    @property
    def ready(self) -> bool:
        """Whether tasks go to the processes now: they run (or one died: the next
        ``submit`` replaces them), not idle or still starting."""
        return self.status in ("running", "broken")

    def start(self) -> None:
        """Start every process now, in a background thread (``submit`` need not wait); once
        (a second call does nothing)."""
        with self._lock:
            if self._starting is not None:
                return
            self._starting = threading.Thread(
                target=self._start_all, name="tabloader-decode-start", daemon=True
            )
        self._starting.start()

    def wait_started(self, timeout: float | None = None) -> None:
        """Return once ``start``'s background start is done (or ``timeout`` seconds)."""
        if self._starting is not None:
            self._starting.join(timeout)

    def pids(self) -> list[int]:
        """The process ids of the decode processes now (none before their first use)."""
        with self._lock:
            pools = [p for p in (self._pool, self._quarantine) if p is not None and not p._broken]
            return sorted(pid for pool in pools for pid in list(pool._processes or ()))

    def _start_all(self) -> None:
        try:
            pool = self.executor()
            # With a forkserver the executor starts a process per task while none is idle: a
            # no-op task each starts them all (one more when a no-op was done before the next
            # came: that process was idle).
            started = []
            for _ in range(2 * self.processes):
                if len(pool._processes or ()) >= self.processes:
                    break
                started.append(pool.submit(_started))
            # Started is not ready: a process still boots (bootstrap, initializer) when the
            # executor counts it. ``wait_started`` returns once the no-ops have run; each
            # holds its process 20 ms, so the next goes to another process.
            concurrent.futures.wait(started, timeout=60)
        except Exception as exc:  # closed meanwhile, or a start that failed: the loader's
            # threads decode instead (it sends tasks here only once they run)
            if self._closed:
                logger.debug("decode processes not started: %r", exc)
            else:
                logger.warning("%s Images are decoded in the loader's threads instead.", exc)

    def executor(self, quarantine: bool = False) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise LoaderError(_STOPPED)
            pool = self._quarantine if quarantine else self._pool
            if pool is None or pool._broken:  # a process died (killed, crashed)
                ctx = _DecodeContext()
                ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # (unless running)
                zygote.adopt(list(FORKSERVER_PRELOAD))  # the service's fork, if it made one
                # (the pool's temporary folder holds the forkserver's socket)
                tempdir = _socket_room(multiprocessing.util.get_temp_dir())
                args: tuple[Any, ...] = (_Inherited(self._segment.fd), self._segment.size)
                pool = ProcessPoolExecutor(
                    1 if quarantine else self.processes,
                    mp_context=ctx,
                    initializer=_attach,
                    initargs=(*args, os.getpid(), tempdir, self.max_pixels, dict(os.environ)),
                )
                if quarantine:
                    self._quarantine = pool
                else:
                    self._pool = pool
            return pool

    def submit(
        self,
        reader: DatasetReader,
        dec: Decoder,
        rows: npt.NDArray[np.int64],
        offsets: npt.NDArray[np.int64],
    ) -> Future[Result]:
        """Decode ``rows`` into the slots at ``offsets``; the future's result is
        ``(errors by position, counters)``.
        """
        known = self._specs.get(id(reader))
        if known is None:  # pickled once per reader (kept: its id stays unique); workers
            spec = _pickled_spec(reader)  # cache it by key
            known = self._specs[id(reader)] = (reader, len(self._specs), spec)
        _, key, spec = known
        task = _Task(Future(), key, spec, dec, rows, offsets)
        if reader.ranged:
            # Object storage: the values are read here, from the batches the loader fetched
            # ahead (its read-ahead, its storage tier; one fetch of a batch for every process),
            # and go with the task; a decode process never requests anything itself.
            t0 = time.perf_counter()
            try:
                raw, errors = reader.binary_values(rows, dec.column)
            except Exception as exc:  # a failed read: every row fails with it
                raw, errors = [None] * rows.size, dict.fromkeys(range(rows.size), exc)
            task.raw = [_NOT_READ if i in errors else _plain(v) for i, v in enumerate(raw)]
            task.read_errors, task.read_s = dict(errors), time.perf_counter() - t0
        self._run(task)
        return task.out

    def _run(self, task: _Task) -> None:
        future = self.executor().submit(*task.args())
        future.add_done_callback(functools.partial(self._ran, task))

    def _ran(self, task: _Task, future: Future[Result]) -> None:
        """In the executor's thread: a task is done, failed, or its process died."""
        if future.cancelled():  # closing
            task.out.set_exception(LoaderError(_STOPPED))
            return
        exc = future.exception()
        if exc is None:
            task.out.set_result(task.merged(future.result()))
        elif isinstance(exc, BrokenProcessPool) and not self._closed:
            task.deaths += 1  # run again from another thread: this one ends the old executor
            with self._lock:
                if self._retrier is None:
                    self._retrier = threading.Thread(
                        target=self._retry, name="tabloader-decode-retry", daemon=True
                    )
                    self._retrier.start()
            self._retries.put(task)
        else:
            task.out.set_exception(exc)

    def _retry(self) -> None:
        while (task := self._retries.get()) is not None:
            try:
                if task.deaths < KILLS_PER_ROW:
                    self._run(task)
                else:
                    task.out.set_result(task.merged(self._isolate(task)))
            except BaseException as exc:  # closed meanwhile: its batches fail, none hangs
                if not task.out.done():
                    task.out.set_exception(exc)

    def _isolate(self, task: _Task) -> Result:
        """Decode ``task``'s rows one at a time in the quarantine process: a death is its row's."""
        errors: Errors = {}
        totals: dict[str, float] = {}
        column = task.dec.column
        for i, row in enumerate(task.rows.tolist()):
            mark = (task.key, column, row)
            while self._kills.get(mark, 0) < KILLS_PER_ROW:
                one = task.args(slice(i, i + 1))
                try:
                    failed, counters = self.executor(quarantine=True).submit(*one).result()
                except BrokenProcessPool:
                    self._kills[mark] = self._kills.get(mark, 0) + 1
                    continue
                if 0 in failed:
                    errors[i] = failed[0]
                for name, value in counters.items():
                    totals[name] = totals.get(name, 0) + value
                break
            else:
                errors[i] = RowReadError(
                    f"row {row}, column {column!r}: decoding it killed a decode process "
                    f"{KILLS_PER_ROW} times (a crash, or its memory cap), so it counts as bad "
                    "data; check or replace that value (e.g. open it with PIL).",
                    row_id=row,
                    column=column,
                )
        return errors, totals

    def close(self) -> None:
        """Stop the processes (queued decodes are cancelled)."""
        with self._lock:
            self._closed = True
            pools = [p for p in (self._pool, self._quarantine) if p is not None]
            self._pool = self._quarantine = None
            retrier = self._retrier
        if self._starting is not None:  # it submits a few no-ops at most, then ends
            self._starting.join()
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)
        if retrier is not None:
            self._retries.put(None)
            retrier.join()


_STOPPED = "The decode processes are stopped; create a new Loader."
_SUN_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path, less its NUL)


def _socket_room(tempdir: str) -> str:
    """``tempdir`` (multiprocessing's ``pymp-*`` folder), if the forkserver's socket fits in it
    (``listener-XXXXXXXX``): else a clear error now, not an ``OSError`` from a decode thread.

    Raises:
        LoaderError: the temporary folder's path is too long, with the fix.
    """
    need = len(os.fsencode(tempdir)) + len("/listener-XXXXXXXX")
    if need > _SUN_PATH_MAX:
        raise LoaderError(
            f"The temporary folder {os.path.dirname(tempdir)} is too deep for the decode "
            f"processes' socket ({need} bytes with its name, at most {_SUN_PATH_MAX}); set "
            "TMPDIR to a shorter folder (e.g. TMPDIR=/tmp) or use decode='threads'."
        )
    return tempdir


def _pickled_spec(reader: DatasetReader) -> bytes:
    """``reader``'s spec, and the factory of its store where that is not local files: pickled
    by name, it brings its module (and the stores that registers) into the decode process.
    A factory that cannot be pickled (a lambda) stays behind: the decode process then has
    only the stores its own imports registered."""
    spec = reader.spec()
    factory = store_factory(spec[0])
    try:
        return pickle.dumps((spec, factory))
    except (pickle.PicklingError, AttributeError, TypeError):
        return pickle.dumps((spec, None))


@dataclass
class _Task:
    """One ``submit``: its rows, where they go, and how many process deaths it has seen."""

    out: Future[Result]
    key: int
    spec: bytes
    dec: Decoder
    rows: npt.NDArray[np.int64]
    offsets: npt.NDArray[np.int64]
    deaths: int = 0
    # the rows' values read by the loader (object storage), ``_NOT_READ`` where the read failed
    # (``read_errors``, by position); None: the decode process reads them
    raw: list[Any] | None = None
    read_errors: Errors | None = None
    read_s: float = 0.0

    def args(self, part: slice = slice(None)) -> tuple[Any, ...]:
        raw = None if self.raw is None else self.raw[part]
        rows, offsets = self.rows[part], self.offsets[part]
        return (_decode_into, self.key, self.spec, self.dec, rows, offsets, raw)

    def merged(self, result: Result) -> Result:
        """The process's result with the loader's failed reads and read time."""
        errors, counters = result
        if self.read_errors:
            errors = {**errors, **self.read_errors}
        if self.raw is not None:
            counters = {**counters, "read_s": counters.get("read_s", 0.0) + self.read_s}
        return errors, counters


class _NotRead:
    """A value the loader could not read (its error stays with the task)."""

    def __reduce__(self) -> str:
        return "_NOT_READ"


_NOT_READ = _NotRead()


def _plain(value: Any) -> bytes | None:
    """A value read (a ``pa.Buffer``, bytes-like) as bytes, to go through the pipe."""
    return None if value is None else bytes(value)


class _Inherited:
    """A descriptor that a process receives as it starts: pickled (only) while multiprocessing
    starts one, it travels with the process (``SCM_RIGHTS`` to the forkserver), never by name."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        multiprocessing.context.assert_spawning(self)  # else DupFd would start a fd server
        return _inherited, (multiprocessing.reduction.DupFd(self.fd),)


def _inherited(dup: Any) -> int:
    return int(dup.detach())


class TabloaderDecodeProcess(multiprocessing.context.ForkServerProcess):
    """A decode process: by this class's name, it does not run the main script (below)."""


class _DecodeContext(multiprocessing.context.ForkServerContext):
    """The forkserver, with locks of no name for the pool's queues (see ``PipeSemaphore``)."""

    Process = TabloaderDecodeProcess

    def Lock(self) -> Any:
        return PipeSemaphore(1)

    def BoundedSemaphore(self, value: int = 1) -> Any:
        return PipeSemaphore(value)


class PipeSemaphore:
    """A semaphore shared by processes, with no name: its count is the bytes in a pipe.

    multiprocessing's locks are POSIX semaphores that a process started from a forkserver opens
    by name (``/dev/shm/sem.mp-*``): a killed owner leaves them to its resource tracker, which
    a process-group kill (Ray's, a terminal's) takes too. A pipe is passed by descriptor as the
    process starts, and goes with the last process that holds it. Both ends are non-blocking
    (``acquire`` waits in ``select``): a byte is taken or not, by one process or thread.
    """

    def __init__(self, value: int, fds: tuple[int, int] | None = None) -> None:
        if fds is None:
            fds = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            os.write(fds[1], b"\0" * value)
        self._r, self._w = fds
        self._semlock = self  # what multiprocessing.Queue asks for full() and qsize()
        multiprocessing.util.Finalize(self, _close_all, (fds,))

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return bool(os.read(self._r, 1))
            except BlockingIOError:
                left = None if deadline is None else deadline - time.monotonic()
                if not block or (left is not None and left <= 0):
                    return False
                select.select([self._r], [], [], left)

    def release(self) -> None:
        os.write(self._w, b"\0")

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _get_value(self) -> int:
        return int.from_bytes(fcntl.ioctl(self._r, termios.FIONREAD, b"\0" * 4), sys.byteorder)

    def _is_zero(self) -> bool:
        return self._get_value() == 0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _pipe_semaphore, (_Inherited(self._r), _Inherited(self._w))


def _pipe_semaphore(r: int, w: int) -> PipeSemaphore:
    return PipeSemaphore(0, (r, w))


def _close_all(fds: tuple[int, ...]) -> None:
    for fd in fds:
        os.close(fd)


def _without_main(get: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    """``multiprocessing.spawn.get_preparation_data``, but a decode process does not import the
    parent's ``__main__``: a process started from a forkserver runs the main script again
    (as ``__mp_main__``) unless it has an ``if __name__ == "__main__"`` guard, and a training
    script without one would run again in every decode process. They need only this module.
    """

    @functools.wraps(get)
    def get_preparation_data(name: str) -> dict[str, Any]:
        data = get(name)
        if name.startswith(TabloaderDecodeProcess.__name__):
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data

    get_preparation_data.tabloader = True  # type: ignore[attr-defined]
    return get_preparation_data


if not getattr(multiprocessing.spawn.get_preparation_data, "tabloader", False):
    multiprocessing.spawn.get_preparation_data = _without_main(  # type: ignore[assignment]
        multiprocessing.spawn.get_preparation_data
    )


# -- in the decode processes ---------------------------------------------------------------------
_ARENA: Any = None
_READERS: OrderedDict[int, DatasetReader] = OrderedDict()


def _attach(
    fd: int, size: int, owner: int, tempdir: str, max_pixels: int, environ: dict[str, str]
) -> None:
    from tabloader.engine._prepare.resample import torch_resizing

    global _ARENA
    # The forkserver's environment is the loader's when the forkserver started (once a
    # process): a decode process takes the loader's of now, as a child it started would (an
    # object store's credentials set since, say; else it fails with "No S3 credentials").
    os.environ.clear()
    os.environ.update(environ)
    # Ctrl-C in a terminal signals the whole process group: the loader (or service) stops
    # and closes these processes; a KeyboardInterrupt traceback from each would only be noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _ARENA = np.frombuffer(Segment.attach(fd, size).buf, np.uint8)
    # One process per core decodes already: torch's own threads in each resize would only add
    # hand-offs (measured: 0.83 CPU-ms for a 0.42 ms resize with 2 threads, 0.36 with one).
    torch = torch_resizing()
    if torch is not None:  # only without the kernel (else nothing here imports torch)
        torch.set_num_threads(1)
    # A process of the forkserver is not the loader's child: if the loader is killed, nothing
    # tells it, and it would keep the shared memory mapped. It watches the loader instead.
    threading.Thread(target=_exit_with, args=(owner, tempdir), daemon=True).start()
    # pyarrow's allocator reserves its arena at its first allocation (mimalloc: 1 GiB of
    # private memory, mapped, not touched): reserved now, it counts in what the start took
    pa.allocate_buffer(1)
    cap_memory(max_pixels)  # last: what the start took is counted in


def cap_memory(max_pixels: int) -> int | None:
    """Cap this process's private memory (``RLIMIT_DATA``) for decodes of at most
    ``max_pixels`` pixels (see the module docstring); the cap in bytes, or None where the
    platform has none (not Linux), or a lower cap is set already (kept)."""
    used = data_bytes()
    if used is None:
        return None
    cap = used + CAP_HEADROOM + CAP_BYTES_PER_PIXEL * max_pixels
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        return None
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    return cap


def data_bytes() -> int | None:
    """This process's private writable memory (``VmData``: what ``RLIMIT_DATA`` counts),
    or None where there is no such count (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _started() -> int:
    """A no-op task that holds its process a moment, so the next one goes to another."""
    time.sleep(0.02)
    return os.getpid()


def _exit_with(owner: int, tempdir: str) -> None:
    while process_alive(owner):  # a zombie owner (killed, not reaped yet) is gone too
        time.sleep(1.0)
    # A killed loader leaves multiprocessing's temporary folder (``pymp-*``, the forkserver's
    # socket); nobody else would remove it. (A loader that exits removes it itself.)
    shutil.rmtree(tempdir, ignore_errors=True)
    os._exit(0)


def reader_of(pickled: bytes) -> DatasetReader:
    """The reader of a spec ``_pickled_spec`` pickled (its store registered here first)."""
    spec, factory = pickle.loads(pickled)
    if factory is not None and store_factory(spec[0]) is None:
        register_store(spec[0].partition("://")[0], factory)
    try:
        return DatasetReader.from_spec(spec, memory_map=False)
    except StorageError as exc:  # a store whose factory could not come along
        raise StorageError(
            f"{exc} (In a decode process: register it with a factory defined at the top level "
            "of a module, which comes along by name, or use decode='threads'.)",
            path=exc.path,
        ) from None


def _decode_into(
    key: int,
    spec: bytes,
    dec: Decoder,
    rows: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    raw: list[Any] | None = None,
) -> tuple[Errors, dict[str, float]]:
    if raw is not None:  # read by the loader (object storage): decoded, not read, here
        failed: Errors = {i: LoaderError("not read") for i, v in enumerate(raw) if v is _NOT_READ}
        values, errors, counters = decode_values(dec, rows, raw, failed)
        errors = {i: e for i, e in errors.items() if i not in failed}  # (the loader has those)
        return _placed(values, errors, counters, offsets)
    reader = _READERS.get(key)
    if reader is None:
        # A reader of its own: it checks each record batch's checksums on its first read in
        # this process, as the loader's reader does in the loader's.
        reader = _READERS[key] = reader_of(spec)
        while len(_READERS) > 8:  # older versions of datasets
            _READERS.popitem(last=False)
    before = reader.bytes_read
    values, errors, counters = decode_rows(reader, dec, rows)
    counters["storage_bytes"] = reader.bytes_read - before  # (one task at a time here)
    return _placed(values, errors, counters, offsets)


def _placed(
    values: list[npt.NDArray[np.uint8] | None],
    errors: Errors,
    counters: dict[str, float],
    offsets: npt.NDArray[np.int64],
) -> tuple[Errors, dict[str, float]]:
    """Write the decoded ``values`` into their slots (``offsets``) of the arena."""
    if any(
        isinstance(e, MemoryError) or isinstance(e.__cause__, MemoryError) for e in errors.values()
    ):
        # a decode reached the memory cap: end as a crash does (the task runs again, its
        # rows alone in quarantine if it happens again), not with a row error of bad data
        os._exit(_OUT_OF_MEMORY)
    for i, value in enumerate(values):
        if value is not None:
            start = int(offsets[i])
            _ARENA[start : start + value.nbytes] = value.reshape(-1)
    return errors, counters
