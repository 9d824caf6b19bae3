"""Differential runs of one registered job, DS-Analyzer's way: where does its time go?

The runs read the job through a loader service of the analyzer's own (``tabloader serve``,
started for the analysis and stopped after; ``--workers`` and ``--cache-bytes`` as asked), each
opening the job at a state (``state_dict()``'s form) whose epoch holds only the rows the run
is to read, and each differs from another in one thing:

=================  ===================================  ======================================
run                decoded values                       storage
=================  ===================================  ======================================
``cold_storage``   none cached: random rows of the      the part files dropped from the page
                   job, at least ``batches`` batches    cache first
                   and ``seconds`` long
``cached``         all cached: the rows it read, again  (not read)
``cached_step``    all cached, the loop sleeping        (not read)
                   ``step`` seconds a batch
``cold``           none cached: other rows, as many     in the page cache (this process read
                   and as long as ``cold_storage``      them first)
``cold_one``       none cached: ``cold``'s rows, one    in the page cache
                   decode process (a fresh service)
=================  ===================================  ======================================

So ``cached`` is the loader's delivery alone (what a row costs once decoded), ``cold`` adds
reading from the page cache and decoding, ``cold_storage`` adds the storage, ``cached_step``
is the training loop's own pace with nothing to wait for (its ingestion rate), and
``cold_one`` against ``cold`` says how the cores the loader gets grow with its decode
processes (on a machine others use, less than in proportion). A job too small for two samples
reads its rows again in a fresh service for ``cold``.

What a run measures (:class:`Run`): wall time, the loop's wait, the engine's counters (reads,
decodes, bytes, its workers' seconds reading, decoding and augmenting), and CPU seconds by
process: the service's own, its decode processes' and the client's (this process), and what
the rest of the machine used meanwhile. Counters and CPU are read once the service is idle
again after the run (it finishes the batches it prefetched), so a run's per-row costs divide
all the work it caused by all the rows that work was for.

The page cache: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each local part file asks the kernel
to drop its clean pages (pages another process maps stay: the engine reads with ``pread``, so
the analyzer's own service maps none). Parts in object storage, or a platform without
``posix_fadvise``, are read as they are: :attr:`Profile.page_cache` says which.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tabloader.analyze._cpu import cores, machine_busy_s, process_cpu_s, tree_cpu_s
from tabloader.analyze._defaults import DEFAULT_BATCHES, DEFAULT_SECONDS
from tabloader.analyze._model import Rates
from tabloader.catalog._errors import LoaderError

logger = logging.getLogger(__name__)

MAX_RUN_S = 20.0  # the first run reads no longer than this, past its batches
MIN_CPU_S = 0.05  # less CPU than this (5 ticks) is not counted: the decode workers' own clocks
MAX_SAMPLE_ROWS = 100_000  # the rows the first run may read, drawn from the job's
IDLE_POLL_S = 0.05
IDLE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Run:
    """What one differential run measured (counters and CPU: until the service was idle)."""

    name: str
    batches: int
    rows: int  # delivered to the loop
    first_s: float  # from the open to the first batch
    wall_s: float  # from the first batch to the last
    wait_s: float  # the loop blocked for batches after the first
    step_s: float  # the loop's sleeping, as asked (step a batch)
    slept_s: float  # ... as it happened (a busy machine wakes a sleeper late)
    lookups: int  # prepared values the job's batches asked for (hits + misses)
    hits: int
    decodes: int
    reads: int
    bytes_read: int
    read_s: float  # seconds of the decode workers reading (counters: wall, summed)
    decode_s: float  # ... decoding and resizing
    augment_s: float  # seconds of the job's own augmentation (in the service's threads)
    cpu_service_s: float  # the service's own process
    cpu_decode_s: float  # its decode processes
    cpu_client_s: float  # the loop's process (this one)
    cpu_others_s: float  # every other process of the machine meanwhile
    span_s: float  # wall time of the whole run, to the service idle again


@dataclass(frozen=True)
class Overlap:
    """Another registered job of the same dataset and the rows it shares with the analyzed
    one (``shared / rows of the analyzed job``: ``fraction``)."""

    job: str
    rows: int
    shared: int
    fraction: float
    same_decode: bool  # the same image_size and decode_size: its decodes can serve ours
    union: int  # rows of the union of the analyzed job's and this and the jobs listed before


@dataclass(frozen=True)
class Profile:
    """The job, the service the runs used, and the runs."""

    job: str
    dataset: str
    rows: int  # the job's rows (an epoch, every rank)
    batch_size: int
    stored_bytes: int  # the dataset's part files
    dataset_rows: int
    workers: int
    cache_bytes: int
    cores: int
    page_cache: str  # what the cold_storage run did with the page cache
    runs: Mapping[str, Run]
    overlaps: tuple[Overlap, ...]
    value_bytes: float  # bytes of the arena one prepared value takes (its size class)
    values_per_row: float  # prepared values a row (its image columns)
    step: float  # the cached_step run's seconds a batch (0: none)
    options: Mapping[str, Any] = field(default_factory=dict)


def profile_job(
    root: str | os.PathLike[str],
    job: str,
    *,
    batches: int = DEFAULT_BATCHES,
    seconds: float = DEFAULT_SECONDS,
    step: float = 0.0,
    workers: int | None = None,
    cache_bytes: int | None = None,
) -> Profile:
    """Run the differential runs of ``job`` (see the module) and return what they measured.

    Args:
        root: the catalog directory.
        job: a registered job.
        batches: the fewest batches the first run reads (fewer if the job has fewer).
        seconds: the shortest the first run reads (more batches until then, up to
            ``MAX_RUN_S``); the later runs read the same rows.
        step: seconds the ``cached_step`` run's loop sleeps per batch (0: no such run).
        workers: the analysis service's decode processes (default: the setting, the cores).
        cache_bytes: its cache (default: the setting, ``$TABLOADER_CACHE_BYTES`` or 1 GiB).

    Raises:
        ServiceError: a loader service runs for the catalog (the runs need one of their own).
        JobNotFoundError: no such job.
        LoaderError: the job's first batches could not be read.
    """
    from tabloader.catalog._settings import SETTINGS
    from tabloader.service._protocol import service_pid

    if batches < 1 or not step >= 0 or not seconds >= 0:
        raise LoaderError(
            f"batches={batches}, step={step}, seconds={seconds}: analyze reads at least 1 "
            "batch a run, for 0 seconds or more, and its loop sleeps 0 seconds or more a batch."
        )
    root = Path(root).absolute()
    running = service_pid(root)
    if running is not None:
        from tabloader.catalog._errors import ServiceError

        raise ServiceError(
            f"A loader service runs for catalog {root} (pid {running}); tabloader analyze "
            "measures with a service of its own: stop that one (it stops by itself once its "
            "jobs end and it is idle) and run analyze again."
        )
    info = _job_info(root, job)
    workers = SETTINGS["workers"].resolve(workers) or cores()
    cache_bytes = int(SETTINGS["cache_bytes"].resolve(cache_bytes))
    runs, cache = _runs(
        root,
        job,
        info,
        batches=batches,
        seconds=seconds,
        step=step,
        workers=workers,
        cache_bytes=cache_bytes,
    )
    return Profile(
        job=job,
        dataset=info["dataset"],
        rows=info["rows"],
        batch_size=info["batch_size"],
        stored_bytes=info["stored_bytes"],
        dataset_rows=info["dataset_rows"],
        workers=workers,
        cache_bytes=cache_bytes,
        cores=cores(),
        page_cache=info["page_cache"],
        runs=runs,
        overlaps=info["overlaps"],
        value_bytes=cache["size_bytes"] / cache["entries"] if cache["entries"] else 0.0,
        values_per_row=runs["cached"].lookups / max(1, runs["cached"].rows),
        step=step,
        options=info["options"],
    )


def _runs(
    root: Path,
    job: str,
    info: dict[str, Any],
    *,
    batches: int,
    seconds: float,
    step: float,
    workers: int,
    cache_bytes: int,
) -> tuple[dict[str, Run], dict[str, Any]]:
    """The differential runs (see the module), and the cache's stats after the first."""
    runs: dict[str, Run] = {}
    every = _rows_of(info["ids"])
    first = _sample(every, max(1, min(MAX_SAMPLE_ROWS, every.size // 2)), seed=0)
    rest = np.setdiff1d(every, first)
    with tempfile.TemporaryDirectory(prefix="tabloader-analyze-") as tmp:
        log = Path(tmp) / "service.log"
        info["page_cache"] = _drop_page_cache(info["files"])
        with _Service(root, cache_bytes, workers, log) as svc:
            runs["cold_storage"], read = svc.run(
                job, _state(job, first), "cold_storage", batches=batches, seconds=seconds
            )
            again = _state(job, read)  # the rows it read: all cached now
            cache = svc.stats()["cache"]
            runs["cached"] = svc.run(job, again, "cached", again_s=seconds / 2)[0]
            if step > 0:
                few = max(2, math.ceil(0.75 * seconds / step))
                runs["cached_step"] = svc.run(
                    job, again, "cached_step", step=step, batches=few, again_s=0.75 * seconds
                )[0]
            cold = again
            if rest.size >= read.size:  # other rows, in the page cache, not decoded
                others = _sample(rest, 2 * read.size, seed=1)
                _warm(root, info["dataset"], info["columns"], others)
                runs["cold"], cold_read = svc.run(
                    job, _state(job, others), "cold", batches=batches, seconds=seconds
                )
                cold = _state(job, cold_read)
        if "cold" not in runs:  # a job too small for two samples: its rows, a fresh cache
            with _Service(root, cache_bytes, workers, log) as svc:
                runs["cold"] = svc.run(job, cold, "cold")[0]
        if workers > 1:  # how the cores the loader gets grow with its decode processes
            with _Service(root, cache_bytes, 1, log) as svc:
                runs["cold_one"] = svc.run(job, cold, "cold_one")[0]
    return runs, cache


def _job_info(root: Path, name: str) -> dict[str, Any]:
    """The job's rows, options, dataset files and its overlap with the other jobs."""
    from pyroaring import BitMap

    from tabloader.service._connection import connect

    with connect(root) as cat:
        job = cat.job(name)
        ds = cat.dataset(job.dataset)
        others = [cat.job(n) for n in cat.job_names() if n != name]
    files = [Path(f) for f in ds.files]
    others = sorted(
        (o for o in others if o.dataset == job.dataset),
        key=lambda o: (-len(job.ids & o.ids), o.name),
    )
    overlaps = []
    union = BitMap(job.ids)
    for other in others:
        shared = len(job.ids & other.ids)
        union |= other.ids
        overlaps.append(
            Overlap(
                job=other.name,
                rows=len(other.ids),
                shared=shared,
                fraction=shared / len(job.ids) if len(job.ids) else 0.0,
                same_decode=all(
                    job.options.get(k) == other.options.get(k)
                    for k in ("image_size", "decode_size")
                ),
                union=len(union),
            )
        )
    if len(job.ids) == 0:
        raise LoaderError(f"Job {name!r} has no rows: there is nothing to analyze.")
    return {
        "dataset": job.dataset,
        "rows": len(job.ids),
        "ids": job.ids,
        "columns": [c for c in job.columns if c != "_id"],
        "batch_size": int(job.options.get("batch_size") or 32),
        "options": dict(job.options),
        "files": files,
        "stored_bytes": sum(f.stat().st_size for f in files if f.is_file()),
        "dataset_rows": ds.num_rows,
        "overlaps": tuple(overlaps),
    }


def _drop_page_cache(files: list[Path]) -> str:
    """Ask the kernel to drop the part files' pages; what was done, in words."""
    if not hasattr(os, "posix_fadvise"):
        return "kept: this platform has no posix_fadvise; storage was read as it was"
    local = [f for f in files if f.is_file()]
    if len(local) < len(files):
        return "kept: parts in object storage are read from it as they are"
    for f in local:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "dropped: posix_fadvise(DONTNEED) on each part file before the cold_storage run"


class _Service:
    """The analysis' own ``tabloader serve`` and a client of it."""

    def __init__(self, root: Path, cache_bytes: int, workers: int, log: Path) -> None:
        from tabloader.service import ServiceProcess
        from tabloader.service._client import RemoteLoader

        self.process = ServiceProcess(root, cache_bytes=cache_bytes, workers=workers, log=log)
        try:
            self.remote = RemoteLoader(root, start=False)
        except BaseException:
            self.process.stop()
            raise

    def __enter__(self) -> _Service:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.remote.close()
        finally:
            self.process.stop()

    def stats(self) -> dict[str, Any]:
        return self.remote.stats()

    def _snapshot(self) -> dict[str, float]:
        stats = self.stats()
        own, below = tree_cpu_s(self.process.proc.pid)
        datasets = stats["datasets"].values()
        return {
            "hits": stats["cache"]["hits"],
            "misses": stats["cache"]["misses"],
            **{
                k: sum(float(d[k]) for d in datasets)
                for k in ("decodes", "reads", "bytes_read", "read_s", "decode_s", "augment_s")
            },
            "cpu_service_s": own,
            "cpu_decode_s": below,
            "cpu_client_s": process_cpu_s(os.getpid()),
            "busy_s": machine_busy_s(),
            "time": time.perf_counter(),
        }

    def _idle(self) -> dict[str, float]:
        """The snapshot once the service's work has stopped (its counters and pins still)."""
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        last = self._snapshot()
        while time.monotonic() < deadline:
            time.sleep(IDLE_POLL_S)
            now = self._snapshot()
            still = all(now[k] == last[k] for k in ("decodes", "reads", "hits", "misses"))
            if still and self.stats()["cache"]["pinned"] == 0:
                return now
            last = now
        logger.warning("the analysis service did not go idle in %.0f s", IDLE_TIMEOUT_S)
        return last

    def run(
        self,
        job: str,
        state: Mapping[str, Any],
        name: str,
        *,
        step: float = 0.0,
        batches: int | None = None,
        seconds: float = 0.0,
        again_s: float = 0.0,
    ) -> tuple[Run, npt.NDArray[np.int64]]:
        """Read ``job``'s rows of ``state`` (an epoch of only those rows), sleeping ``step``
        seconds a batch: at most ``batches`` batches, unless it has read for less than
        ``seconds`` (then on, up to ``MAX_RUN_S``), and again from ``state`` until it has read
        for ``again_s``. What the run measured, and the ids of the rows it read (the first
        time)."""
        before = self._idle()
        c0 = time.process_time()
        loop = _Loop()
        read: list[npt.NDArray[np.int64]] = []
        while True:
            first_time = not loop.batches
            stream = self.remote.open(job, state=state, epochs=1)
            try:
                loop.read(stream, step, batches, seconds, read if first_time else None)
            finally:
                stream.close()
            if loop.wall_s >= again_s or loop.batches == 0:
                break
        client = time.process_time() - c0
        after = self._idle()
        d = {k: after[k] - before[k] for k in after}
        ours = d["cpu_service_s"] + d["cpu_decode_s"] + d["cpu_client_s"]
        run = Run(
            name=name,
            batches=loop.batches,
            rows=loop.rows,
            first_s=loop.first_s,
            wall_s=loop.wall_s,
            wait_s=loop.wait_s,
            step_s=step * loop.batches,
            slept_s=loop.slept_s,
            lookups=int(d["hits"] + d["misses"]),
            hits=int(d["hits"]),
            decodes=int(d["decodes"]),
            reads=int(d["reads"]),
            bytes_read=int(d["bytes_read"]),
            read_s=d["read_s"],
            decode_s=d["decode_s"],
            augment_s=d["augment_s"],
            cpu_service_s=d["cpu_service_s"],
            cpu_decode_s=d["cpu_decode_s"],
            cpu_client_s=client,
            cpu_others_s=max(0.0, d["busy_s"] - ours),
            span_s=d["time"],
        )
        ids = np.concatenate(read) if read else np.empty(0, np.int64)
        return run, ids


class _Loop:
    """A training loop's clock over one or more opens: batches, rows, the first batch's
    latency (of the first open), the wall from the first batch on, and the waits after it."""

    def __init__(self) -> None:
        self.batches = self.rows = 0
        self.first_s = self.wall_s = self.wait_s = self.slept_s = 0.0

    def read(
        self,
        stream: Any,
        step: float,
        batches: int | None,
        seconds: float,
        ids: list[npt.NDArray[np.int64]] | None,
    ) -> None:
        t0 = time.perf_counter()
        got = 0
        while batches is None or got < batches or self.wall_s < seconds:
            if self.wall_s >= MAX_RUN_S and (batches is None or got >= batches):
                break
            t = time.perf_counter()
            batch = stream.take(None)
            now = time.perf_counter()
            if batch is None:
                break
            if self.batches == 0:
                self.first_s = now - t0
            else:
                self.wait_s += now - t
                self.wall_s += now - t
            if ids is not None:
                ids.append(np.asarray(batch["_id"], np.int64).copy())
            got += 1
            self.batches += 1
            self.rows += len(batch["_id"])
            if step > 0:
                time.sleep(step)
                slept = time.perf_counter() - now
                self.slept_s += slept
                self.wall_s += slept


def _rows_of(ids: Any) -> npt.NDArray[np.int64]:
    from tabloader.catalog._bitmaps import bitmap_to_array

    return bitmap_to_array(ids).astype(np.int64)


def _sample(rows: npt.NDArray[np.int64], size: int, *, seed: int) -> npt.NDArray[np.int64]:
    """``size`` of ``rows`` drawn with ``seed``, or all of them."""
    if size >= rows.size:
        return rows
    return np.sort(np.random.default_rng(seed).choice(rows, size=size, replace=False))


def _warm(root: Path, dataset: str, columns: list[str], rows: npt.NDArray[np.int64]) -> None:
    """Read ``rows`` of ``dataset`` in this process: their parts' pages in the page cache."""
    from tabloader.service._connection import connect

    with connect(root) as cat:
        ds = cat.dataset(dataset)
        for start in range(0, rows.size, 1024):
            ds.take(rows[start : start + 1024], columns)


def _state(job: str, rows: npt.NDArray[np.int64]) -> dict[str, Any]:
    """A job state (``state_dict()``'s form) whose epoch 0 has ``rows`` left: every run that
    opens the job at it reads those rows (in an order of its own)."""
    from pyroaring import BitMap

    return {"job": job, "epoch": 0, "remaining": BitMap(rows.tolist()).serialize()}


def rates_of(profile: Profile) -> Rates:
    """The model's rates from what the runs measured (``docs/analyze.md`` says how each is
    derived): CPU a row by process from ``cold`` and ``cached``, storage from ``cold_storage``
    against ``cold``, the loop's wait from ``cached_step``."""
    runs = profile.runs
    cold, cached, storage = runs["cold"], runs["cached"], runs["cold_storage"]
    decodes = max(1, cold.decodes)
    delivered = max(1, cached.rows)
    service_row = cached.cpu_service_s / delivered
    step_run = runs.get("cached_step")
    first_batch = cached.batches > 1
    return Rates(
        rows=profile.rows,
        batch_size=profile.batch_size,
        step_s=profile.step,
        cores=profile.cores,
        got_cores=_cores_got(cold),
        got_one=_cores_got(runs.get("cold_one", cold)),
        threads_cores=_busy_threads(cold, profile.workers),
        threads_one=_busy_threads(
            runs.get("cold_one", cold), 1 if "cold_one" in runs else profile.workers
        ),
        workers=profile.workers,
        cache_bytes=profile.cache_bytes,
        value_bytes=profile.value_bytes,
        values_per_row=profile.values_per_row,
        decode_cpu_s=(
            cold.cpu_decode_s / decodes
            if cold.cpu_decode_s >= MIN_CPU_S
            else (cold.read_s + cold.decode_s) / decodes  # under a few ticks: their clocks
        ),
        read_share=cold.read_s / (cold.read_s + cold.decode_s) if cold.decode_s > 0 else 0.0,
        storage_s=max(0.0, storage.read_s - cold.read_s) / max(1, storage.reads),
        stored_bytes=storage.bytes_read / max(1, storage.reads),
        service_decode_cpu_s=max(0.0, cold.cpu_service_s - service_row * cold.rows) / decodes,
        service_cpu_s=service_row,
        augment_s=cached.augment_s / delivered,
        client_cpu_s=cached.cpu_client_s / delivered,
        batch_s=cached.wall_s / (cached.batches - 1) if first_batch else cached.first_s,
        step_wait_s=(
            step_run.wait_s / (step_run.batches - 1)
            if step_run is not None and step_run.batches > 1
            else cached.cpu_client_s / max(1, cached.batches)
        ),
        late_s=(
            max(0.0, step_run.slept_s - step_run.step_s) / step_run.batches
            if step_run is not None and step_run.batches
            else 0.0
        ),
        first_s=cold.first_s,
        overlaps=tuple((o.rows, o.union) for o in profile.overlaps),
    )


def _cores_got(cold: Run) -> float:
    """The cores the loader got in the ``cold`` run, which wants every core it can have (its
    CPU over its wall): all of them on a machine of its own if it keeps them busy, fewer on a
    machine others use too."""
    active = cold.first_s + cold.wall_s
    ours = cold.cpu_service_s + cold.cpu_decode_s + cold.cpu_client_s
    return ours / active if active > 0 else 0.0


def _busy_threads(cold: Run, workers: int) -> float:
    """The busy threads the loader's work in a cold run made: its decode processes, and its
    other CPU (the service's, the client's) in their units."""
    ours = cold.cpu_service_s + cold.cpu_decode_s + cold.cpu_client_s
    return workers * ours / cold.cpu_decode_s if cold.cpu_decode_s >= MIN_CPU_S else workers
