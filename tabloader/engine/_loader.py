"""The engine's facade: :class:`Loader` opens jobs and wires the pipeline's steps together
(see :mod:`tabloader.engine`) - every job of this process on one arena and one thread pool.

It does not know how jobs are attached: ``JobStream`` here, and ``tabloader.torch.JobDataset``
on top of it, use the same ``Loader``. Two doors open a job: :meth:`Loader.open` for a consumer
in this process, :meth:`Loader.serve` for a server's client (the loader service, a node of a
Ray cluster). Each open is planned (``_plan``: the request checked into a :class:`JobPlan`,
nothing made) and then admitted (``_admit``: its scheduler, arena spaces and state). Its kind is
two objects chosen there once: its *row source* (:mod:`tabloader.engine._queue.sources`: drawn
by this loader's sampler, or fed by a leader) and its *receiver*
(:mod:`tabloader.engine._deliver.collate`: copied out here, or handed over pinned to a client).

Data-parallel ranks: the ranks of one job in one loader are one job (one entry in the sampler,
so it still shares reads and decodes with every other job). The first open creates it; each
other rank opens it with its own ``rank`` and the same ``world_size``, options and ``state``.
Batches of ``batch_size`` rows are cut from the job's random order as for a plain job and dealt
round-robin: batch k of an epoch goes to rank ``k % world_size``. Every rank gets
``n // (batch_size * world_size)`` batches of an epoch of ``n`` rows; the last
``n % (batch_size * world_size)`` rows of the epoch's uniformly random order (so a random
subset, another each epoch) are dropped, as with ``DistributedSampler(drop_last=True)``. With
the job option ``drop_last = false`` (evaluation jobs) no row is dropped: every rank gets
``ceil(n / world_size)`` rows (the last batch of each rank maybe short), the shares padded by
repeating the first rows of the epoch's order (fewer than ``world_size``), as with
``DistributedSampler(drop_last=False)``. With ``world_size == 1`` nothing is dropped or padded
(the last batch of an epoch may be short).

The ranks go in lockstep: each has ``prefetch`` batches prepared ahead, and a rank ahead of the
others waits for the slowest (as DDP does anyway); no rank gets a batch before every rank has
opened, and a rank that has waited ``rank_timeout`` seconds (a job option, default 45) for one
that never opened raises ``LoaderError``. Each rank's stream has its own ``epoch`` and
``stats``; ``state_dict()`` from any rank is the job's state at that rank's step, so every rank
should save at the same step (as DDP checkpoints do) and all reopen with that state. Closing a
rank while the others go on drops its batches (a rank that leaves mid-epoch loses its share of
that epoch; it cannot rejoin until every rank has closed); the job leaves the sampler with its
last open rank.

Errors: a row that fails to read or decode raises ``RowReadError`` (with its ``_id``) in
every job that reaches it, in the consumer's thread with the worker's traceback; the batch is
dropped and the stream stays usable. With ``on_error="skip"`` the row is left out of the batch
and counted in ``stats()``. Other jobs never see another job's failures.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tabloader.catalog import Catalog, open_catalog
from tabloader.catalog._api import CatalogAPI
from tabloader.catalog._bitmaps import bitmap_to_array
from tabloader.catalog._directory import not_a_catalog, resolve_root
from tabloader.catalog._errors import CacheError, LoaderError
from tabloader.catalog._settings import SETTINGS, physical_memory, setting
from tabloader.catalog.storage import DatasetReader
from tabloader.engine._arena.accounting import AccessLog
from tabloader.engine._arena.arena import Arena
from tabloader.engine._arena.shm import Segment, shm_available
from tabloader.engine._deliver.batchmem import BatchMemory
from tabloader.engine._deliver.collate import Collate, HandOver, OwnSlots, Pins
from tabloader.engine._deliver.stream import JobStream, ServedStream
from tabloader.engine._opening import OpenRequest, Resume
from tabloader.engine._prepare.augment import Augmenter
from tabloader.engine._prepare.decoding import DecodePool
from tabloader.engine._prepare.fetch import Fetcher
from tabloader.engine._prepare.planning import OpenDecode, column_plan, job_augmenter
from tabloader.engine._prepare.pool import PriorityPool
from tabloader.engine._prepare.prep import DecodeKind, decoder_for, holds_bytes
from tabloader.engine._prepare.storage import CACHE_DIR, Share, StorageReads
from tabloader.engine._prepare.work import Plan, Receiver
from tabloader.engine._queue import jobs
from tabloader.engine._queue.jobqueue import JobQueue
from tabloader.engine._queue.jobs import JobState, OnError, RankState, RowSource, Seat
from tabloader.engine._queue.queues import JobQueues
from tabloader.engine._queue.ranks import rank_share, resolve_rank
from tabloader.engine._queue.scheduler import DatasetScheduler
from tabloader.engine._queue.sources import Sampled
from tabloader.engine.decode._backend import Fit
from tabloader.engine.decode._images import pixel_limit
from tabloader.sampling import SAMPLERS, IndependentSampler

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from tabloader.catalog import Dataset, Job, JobSpec
    from tabloader.engine._opening import OpenArgs

logger = logging.getLogger(__name__)

LOOKAHEAD_BATCHES = 4  # default horizon, in batches
UNPLACED = -1  # a prepared column's arena space before the job is admitted (``_place``)


@dataclass(frozen=True)
class JobPlan:
    """What opening a job needs, checked (``Loader._plan``): nothing is made or registered
    until it is admitted (``Loader._admit``).

    Attributes:
        job, spec: the catalog's job and the options it opens with.
        dataset: the dataset version it reads.
        rank, world_size: the rank asked for (for the log).
        seat: its name, rank and world size here, and its row source.
        columns: how its columns are prepared (arena spaces ``UNPLACED``) and its receiver.
        notes: what the log says of the decodes it shares, or does not.
        prefetch, floor, lookahead, epochs: batches ahead per rank, the least horizon (rows,
            all ranks), the lookahead asked for, the epochs it reads.
        resume: where it resumes (None: a fresh start).
    """

    job: Job
    spec: JobSpec
    dataset: Dataset
    rank: int
    world_size: int
    seat: Seat
    columns: Plan
    notes: list[str]
    prefetch: int
    floor: int
    lookahead: int | None
    epochs: int | None
    resume: Resume | None


def _holds_bytes(cat: CatalogAPI) -> bool:
    """Whether a dataset of ``cat`` has a column of bytes, which a job may decode as images.

    Only then does ``wait_ready`` start the decode processes: a catalog of numbers and
    strings never needs them, and starting them costs a forkserver and its imports.
    """
    return any(
        holds_bytes(f.type) for name in cat.dataset_names() for f in cat.dataset(name).schema
    )


class Loader:
    """One engine for every job of this process: a sampler per dataset, one arena, one pool.

    Args:
        catalog: a ``Catalog`` (or another ``tabloader.catalog._api.CatalogAPI``) or its directory
            (default: ``$TABLOADER_CATALOG`` or ``./catalog``).
        cache_bytes: the arena's capacity in bytes (decoded images shared between jobs).
        workers: reader/decoder threads (default: the number of CPUs, at least 2).
        sampler: ``"dependent"`` (shared order) or ``"independent"`` (the baseline).
        seed: seed of the samplers (same seed, same calls: same order).
        decode: where fixed-size images (``image_size`` set) are decoded: ``"processes"``
            (default: ``workers`` decode processes writing into the arena, which then lives in
            shared memory; see :mod:`tabloader.engine._prepare.decoding`) or ``"threads"`` (the
            pool's threads; also what is used where shared memory is not available).
        staging_bytes: shared memory after the arena's (the loader service stages the small
            columns of the batches it hands over there, never short of room because images
            are pinned).
        access_log: keep an :class:`~tabloader.engine._arena.accounting.AccessLog`
        (``self.access_log``)
            of every look-up and release of prepared values, and write it to this ``.npz`` file
            (arrays ``kind``, ``space``, ``row``) on ``close()``: what benchmarks replay
            through Belady's MIN for the best any cache of the same size could have done.
        max_image_megapixels: an image whose header declares more megapixels is refused
            before decoding, as a bad row (``RowReadError``; ``on_error='skip'`` skips it); the
            decode processes' memory cap is sized from it. Default: the setting
            (``$TABLOADER_MAX_IMAGE_MEGAPIXELS``, else 64; ``tabloader.catalog._settings``).
        storage_cache_bytes: the local storage tier of datasets in object storage: record
            batches kept on disk (``storage_cache_dir``, default the catalog's
            ``cache/storage/``), evicted by next use, kept across restarts; 0 (the default,
            unless ``$TABLOADER_STORAGE_CACHE_BYTES``) turns it off. See
            :mod:`tabloader.catalog.storage._tier`.
        readahead_bytes: per dataset in object storage, the record batches fetched ahead of
            their decode (default 64 MiB, or ``$TABLOADER_READAHEAD_BYTES``; see
            :mod:`tabloader.engine._prepare.readahead`).
        storage_share: on a Ray node, the partitioned cache around the node's tier
            (``tabloader.cluster``).

    Example:
        >>> loader = Loader(cat, cache_bytes=1 << 30)              # doctest: +SKIP
        >>> for batch in loader.open("resnet18", batch_size=64):   # doctest: +SKIP
        ...     train_step(batch["image"], batch["label"])
    """

    def __init__(
        self,
        catalog: CatalogAPI | str | os.PathLike[str] | None = None,
        *,
        cache_bytes: int = 1 << 30,
        workers: int | None = None,
        sampler: str = "dependent",
        seed: int | None = 0,
        decode: str = "processes",
        staging_bytes: int = 0,
        access_log: str | os.PathLike[str] | None = None,
        max_image_megapixels: int | None = None,
        storage_cache_bytes: int | str | None = None,
        readahead_bytes: int | str | None = None,
        storage_cache_dir: str | os.PathLike[str] | None = None,
        storage_share: Share | None = None,
    ) -> None:
        self.max_pixels = pixel_limit(max_image_megapixels)
        tier_bytes = SETTINGS["storage_cache_bytes"].resolve(storage_cache_bytes)
        ahead_bytes = SETTINGS["readahead_bytes"].resolve(readahead_bytes)
        if decode not in ("processes", "threads"):
            raise LoaderError(f"decode={decode!r}: use 'processes' or 'threads'.")
        if sampler not in SAMPLERS:
            raise LoaderError(
                f"Unknown sampler {sampler!r}; use one of {', '.join(sorted(SAMPLERS))}."
            )
        if isinstance(cache_bytes, int) and cache_bytes > physical_memory():  # a clear error,
            SETTINGS["cache_bytes"].check(cache_bytes, "cache_bytes", LoaderError)  # not numpy's
        self._sampler_cls = SAMPLERS[sampler]
        self._access_log_path = None if access_log is None else Path(access_log)
        if self._access_log_path is not None and not self._access_log_path.parent.is_dir():
            raise LoaderError(
                f"access_log={str(access_log)!r}: its directory does not exist; create it or "
                "pass a path in an existing directory."
            )
        self.access_log = AccessLog() if self._access_log_path is not None else None
        self._seed = seed
        self._owns_catalog = catalog is None or isinstance(catalog, (str, os.PathLike))
        self.catalog = (
            open_catalog(Path(catalog) if catalog is not None else None)
            if catalog is None or isinstance(catalog, (str, os.PathLike))
            else catalog
        )
        if not self.catalog.exists:  # a loader only reads: a mistyped path is an error
            if self._owns_catalog:
                self.catalog.close()
            raise not_a_catalog(self.catalog.root)
        self.workers = workers or max(2, os.cpu_count() or 2)
        self._pid = os.getpid()
        self._segment: Segment | None = None
        self._procs: DecodePool | None = None
        self._memory = BatchMemory()  # the jobs' image batches, recycled
        try:
            self._arena = self._make_arena(cache_bytes, staging_bytes, decode)
        except BaseException:
            self._release_memory()
            if self._owns_catalog:
                self.catalog.close()
            raise
        # who receives the jobs' batches, chosen at each open: copied out for a job of this
        # process (``open``), or handed over pinned to a server's client (``serve``)
        self._pins = Pins(self._arena, self.access_log)
        self.collate: Receiver = Collate(self._arena, self._memory, self._pins)
        self.hand_over: Receiver = HandOver(self._arena, OwnSlots(self._arena), self._pins)
        self._pool = PriorityPool(self.workers, "tabloader-io")
        self._storage = StorageReads(
            Path(storage_cache_dir) if storage_cache_dir else self.catalog.root / CACHE_DIR,
            tier_bytes,
            ahead_bytes,
            share=storage_share,
        )
        self._schedulers: dict[str, DatasetScheduler] = {}
        self._read: dict[str, Dataset] = {}  # the version each scheduler reads
        # bumped when a dataset is dropped and imported again: its arena spaces are new ones
        self._generation: dict[str, int] = {}
        self._space_owner: dict[int, DatasetScheduler] = {}
        self._lock = threading.Lock()
        self._closed = False
        _LIVE_LOADERS.add(self)

    def _make_arena(self, cache_bytes: int, staging_bytes: int, decode: str) -> Arena:
        """The arena: in shared memory with decode processes writing into it (``decode``
        "processes", where shared memory is available), else in private memory."""
        if decode == "processes" and shm_available() and isinstance(cache_bytes, int):
            try:
                self._segment = Segment.new("arena", max(cache_bytes, 1) + staging_bytes)
            except CacheError as exc:  # /dev/shm too small: private memory, threads
                logger.warning("%s Decoding in threads instead.", exc)
            else:
                # started once the threads have decoded the first fixed-size load (they decode
                # until the processes run: ``Fetcher._run_load``): a loader of numbers or of
                # augmented jobs never needs them, and their start (a forkserver, its imports)
                # took a core from the first batch
                self._procs = DecodePool(self._segment, self.workers, self.max_pixels)
        buffer = None if self._segment is None else self._segment.buf
        return Arena(cache_bytes, score=self._score, buffer=buffer)

    @property
    def arena(self) -> Arena:
        """The arena of prepared values (in ``segment`` when that is not None)."""
        return self._arena

    @property
    def segment(self) -> Segment | None:
        """The shared memory the arena lives in, with ``staging_bytes`` after it (None: the
        arena is private memory, and images are decoded in threads)."""
        return self._segment

    @property
    def decode_pool(self) -> DecodePool | None:
        """The decode processes (None: images are decoded in the pool's threads)."""
        return self._procs

    def scheduler(self, dataset: str) -> DatasetScheduler:
        """The scheduler of ``dataset`` (its jobs, queues and fetcher), once a job of it was
        opened: for introspection and tests."""
        found = self._schedulers.get(dataset)
        if found is None:
            raise LoaderError(
                f"No job of dataset {dataset!r} was opened in this loader; open one first."
            )
        return found

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def _score(self, space: int, rows: np.ndarray) -> tuple[Any, Any]:
        """The arena's eviction inputs, from the scheduler of the space's dataset (lock-free)."""
        owner = self._space_owner.get(space)
        if owner is None:  # a dataset no job reads any more: nothing to come
            return np.full(rows.size, np.inf), np.zeros(rows.size)
        return owner.score(space, rows)

    def _current(self, dataset: Dataset) -> DatasetScheduler | None:
        """The scheduler that reads ``dataset`` (or an earlier version of it), None if none
        does: not yet, or one reads a dataset of that name dropped since (``_scheduler``
        replaces it).

        Raises:
            LoaderError: the dataset was dropped and imported again while jobs of this
                loader still read the one they opened.
        """
        found = self._schedulers.get(dataset.name)
        read = self._read.get(dataset.name)
        if found is None or read is None or _continues(read, dataset):
            return found
        with found.cond:
            readers = sorted(found.jobs)
        if readers:
            raise LoaderError(
                f"Dataset {dataset.name!r} was dropped and imported again while job(s) "
                f"{', '.join(readers)} of this loader still read the one dropped; close "
                "them (or let them finish), then open the job again."
            )
        return None

    def _scheduler(self, dataset: Dataset) -> DatasetScheduler:
        """The dataset's scheduler, created (or moved to a newer version) as needed.

        Raises:
            LoaderError: as ``_current``.
        """
        found = self._current(dataset)
        stale = self._schedulers.get(dataset.name)
        if found is None and stale is not None:  # of a dataset dropped since: its cached
            stale.close()  # values are of the old rows, new spaces from here on
            self._storage.detach(dataset.name)
            del self._schedulers[dataset.name]
            self._space_owner = {k: v for k, v in self._space_owner.items() if v is not stale}
            self._generation[dataset.name] = self._generation.get(dataset.name, 0) + 1
        reader = DatasetReader.from_spec(dataset.reader.spec(), memory_map=False)
        # Cheap columns are read through the memory map when rows are small (zero-copy); beside
        # payloads, with ``pread``: a map faults in the pages around each value it touches (the
        # payload's too), 6.2 ms a batch of 32 labels of images on first touch against 1.25,
        # and 285 ms against 30 to read those labels whole.
        table = reader if any(holds_bytes(f.type) for f in dataset.schema) else dataset.reader
        if found is None:
            found = self._schedulers[dataset.name] = self._new_scheduler(dataset, reader, table)
        elif self._read[dataset.name].version < dataset.version:
            found.fetcher.set_readers(reader, table)
            found.grow(dataset.num_rows)
        self._storage.attach(found, reader, self._arena)  # object storage: tier, read-ahead
        self._read[dataset.name] = dataset
        return found

    def _new_scheduler(
        self, dataset: Dataset, reader: DatasetReader, table: DatasetReader
    ) -> DatasetScheduler:
        """A scheduler of ``dataset``, its fetcher reading ``reader`` and ``table``."""
        catalog, name = self.catalog, dataset.name
        fetcher = Fetcher(
            reader,
            table,
            self._arena,
            self._pool,
            on_done=lambda w: None,
            workers=self.workers,
            procs=self._procs,
            memory=self._memory,
            read_column=lambda column, rows: catalog.column(name, column, rows=rows, of=dataset),
            pins=self._pins,
            access_log=self.access_log,
        )
        queues = JobQueues(
            dataset.num_rows,
            self._sampler_cls(seed=self._seed),
            gather_sampler=IndependentSampler(seed=self._seed),
        )
        sched = DatasetScheduler(
            dataset.name, dataset.num_rows, queues, fetcher, close_job=lambda job: sched.remove(job)
        )
        fetcher.on_done = sched.landed
        return sched

    def open(self, job: str | Job | OpenRequest, **args: Unpack[OpenArgs]) -> JobStream:
        """Start consuming a registered job (or one rank of it, for data-parallel training) in
        this process: its rows drawn by this loader's sampler, its batches copied out for it.

        Args:
            job: the job name (or ``Job``), or the whole :class:`OpenRequest` (then alone).
            **args: the open's arguments (:class:`OpenArgs`, made into one
                :class:`OpenRequest`):
            spec: the job's options (default: the ones it was registered with).
            **options: job options (``tabloader.catalog.JobOptions``: ``batch_size``,
                ``image_size``, here also ``(height, width)``, ``augment``...) laid over
                ``spec`` (``JobSpec.from_options``; None: not given). ``augment``'s draws come
                from (``seed``, epoch, row ``_id``) on a shared aspect-kept decode.
            prefetch: batches prepared ahead of consumption, per rank (default: enough to keep
                every worker busy, at least 2, more for batches of small images:
                ``default_prefetch``).
            lookahead: rows sampled ahead, per rank; more lets jobs at different moments
                share rounds, at the cost of a longer queue of ids. Default: as far as the
                cache holds (``queues.LOOKAHEAD_CACHES`` arena capacities of rounds, each job's
                share by its measured pace, at most an epoch and ``queues.LOOKAHEAD_ROWS``),
                so that the arena knows the next use of what it holds and evicts as Belady's
                MIN; at least 4 batches.
            epochs: stop iterating after this many epochs (None: never).
            state: a ``JobStream.state_dict()`` to resume from, mid-epoch.
            rank, world_size: this stream is rank ``rank`` of ``world_size`` data-parallel
                ranks of the job (DDP; see the module docstring). When both are None they are
                found from what launched this process (an initialised torch.distributed
                process group, ``RANK`` and ``WORLD_SIZE``, Lightning's launcher, SLURM's
                ``srun``...: :mod:`tabloader.engine._queue.ranks`), else 0 and 1.

        Raises:
            JobNotFoundError: no such job. LoaderError: bad options (``rank`` and
                ``world_size`` included), the job (or that rank of it) is open already, or
                open with another ``world_size``, other options or another ``state``.
        """
        return JobStream(*self._open(job, args, Sampled, self.collate))

    def serve(
        self,
        job: str | Job | OpenRequest,
        *,
        source: type[RowSource] = Sampled,
        receiver: Receiver | None = None,
        **args: Unpack[OpenArgs],
    ) -> ServedStream:
        """Open a job (as :meth:`open`) for a server to serve to its client process.

        Args:
            job, args: as :meth:`open`'s.
            source: where its rows come from (:mod:`tabloader.engine._queue.sources`):
                ``Sampled`` by this loader's sampler, or ``Fed`` by a leader through
                ``ServedStream.feed`` (a node of a Ray cluster: each rank is a job of its own
                here).
            receiver: who receives its batches (default :attr:`hand_over`: handed over with
                their values pinned in the arena, which its client copies them out of and
                then releases; see ``tabloader.service._server``).
        """
        return ServedStream(*self._open(job, args, source, receiver or self.hand_over))

    def _open(
        self,
        job: str | Job | OpenRequest,
        args: OpenArgs,
        source: type[RowSource],
        receiver: Receiver,
    ) -> tuple[DatasetScheduler, RankState]:
        """Plan the open (:meth:`_plan`: checked, nothing made), admit the job (:meth:`_admit`:
        its scheduler, arena spaces and state) and add it to its scheduler."""
        if self._closed:
            raise LoaderError("The loader is closed; create a new Loader.")
        if isinstance(job, OpenRequest) and args:
            raise LoaderError(
                f"open(OpenRequest, {', '.join(args)}=...): the request carries every argument "
                "of the open; make it with them (OpenRequest.make)."
            )
        known: Job | None = None  # a Job given: no look-up
        if isinstance(job, OpenRequest):
            request = job
        elif isinstance(job, str):
            request = OpenRequest.make(job, **args)
        else:
            request, known = OpenRequest.make(job.name, **args), job
        with self._lock:
            plan = self._plan(request, known, source, receiver)
            sched, state = self._admit(plan)
        if any(dec.dtype is None for dec in state.plan.gathered):  # strings, lists: pyarrow's
            _warm_pyarrow()
        resume = plan.resume
        remaining, epoch = (None, 0) if resume is None else (resume.remaining, resume.epoch)
        joined = sched.add(state, remaining=remaining, epoch=epoch, rank=plan.seat.rank)
        logger.info(
            "job %s opened on %s (%d rows)%s",
            plan.job.name,
            plan.job.dataset,
            len(plan.job.ids),
            f" as rank {plan.rank} of {plan.world_size}" if plan.world_size > 1 else "",
        )
        return sched, joined

    def _plan(
        self, request: OpenRequest, known: Job | None, source: type[RowSource], receiver: Receiver
    ) -> JobPlan:
        """What opening ``request`` needs, checked: the job and its options, its place here
        (its source's ``seat``), its columns' decodes, its prefetch and horizon, where it
        resumes. Nothing is made or registered (the loader's lock is held).

        Raises:
            LoaderError: what the job cannot be opened with (see :meth:`open`).
        """
        rank, world_size = resolve_rank(request.rank, request.world_size)
        info = self.catalog.job(request.job) if known is None else known
        spec = request.resolve_spec(info.options)  # the one check of the merged options
        batch_size = spec.batch_size
        augmenter, cap = job_augmenter(info.name, dict(spec.values))
        share = _share(info, spec, world_size)
        seat = source.seat(
            info.name,
            spec,
            rank=rank,
            world_size=world_size,
            share=share,
            resumes=request.state is not None,
        )
        dataset = self.catalog.dataset(info.dataset)
        if dataset.version < info.dataset_version:  # pragma: no cover - catalog invariant
            raise LoaderError(f"job {info.name!r} is newer than its dataset; reopen it.")
        current = self._current(dataset)
        columns, notes = self._columns(current, dataset, info, spec, receiver, augmenter, cap)
        prefetch = request.prefetch
        if prefetch is None:
            prefetch = jobs.default_prefetch(self.workers, batch_size, columns)
        if receiver.pins:  # the service's cache holds its clients' prepared batches
            rows = min(batch_size, len(info.ids)) * seat.world_size  # what the job produces
            capacity = self._arena.buffer.size
            prefetch = jobs.fit_prefetch(capacity, columns, rows, prefetch, request.prefetch)
        ahead = request.lookahead or LOOKAHEAD_BATCHES * batch_size
        if not request.lookahead:  # object storage: sample at least as far as it reads ahead
            ahead = max(ahead, self._storage.ahead_rows(dataset.reader))
        return JobPlan(
            job=info,
            spec=spec,
            dataset=dataset,
            rank=rank,
            world_size=world_size,
            seat=seat,
            columns=columns,
            notes=notes,
            prefetch=prefetch,
            floor=seat.world_size * max(ahead, batch_size * prefetch),
            lookahead=request.lookahead,
            epochs=request.epochs,
            resume=request.resume(info, spec),
        )

    def _admit(self, plan: JobPlan) -> tuple[DatasetScheduler, JobState]:
        """Make what the planned job needs: its dataset's scheduler, the arena spaces of its
        prepared columns, its state (the loader's lock is held; the scheduler adds it)."""
        info, spec = plan.job, plan.spec
        sched = self._scheduler(plan.dataset)
        columns = self._place(sched, plan.dataset, plan.columns)
        for note in plan.notes:  # the service's log: what sharing costs whom
            logger.info("%s", note)
        resume = plan.resume
        return sched, JobState(
            plan.seat.name,
            info.ids,
            columns,
            spec.batch_size,
            prefetch=plan.prefetch,
            queue=JobQueue(
                horizon=plan.floor,
                floor=plan.floor,
                lookahead=plan.lookahead,
                cache_rows=jobs.cache_rows(self._arena.buffer.size, columns),
                arena_spaces=[space for _, space in columns.prepared],
            ),
            on_error=OnError(spec.on_error),
            source=plan.seat.source,
            epochs=plan.epochs,
            world_size=plan.seat.world_size,
            id_array=bitmap_to_array(info.ids).astype(np.int64),
            spec=spec,
            weights=info.weights,
            scores=None if resume is None else resume.scores,
            drawn=None if resume is None else resume.drawn,
        )

    def _columns(
        self,
        sched: DatasetScheduler | None,
        dataset: Dataset,
        job: Job,
        spec: JobSpec,
        receiver: Receiver,
        augmenter: Augmenter | None,
        cap: int | None,
    ) -> tuple[Plan, list[str]]:
        """How the job's columns are prepared (gathered, or decoded: image columns' sizes and
        augmentation as :mod:`tabloader.engine._prepare.planning` decides, beside the decodes
        of the jobs open on ``sched``, the dataset's scheduler if any), and what the log says
        of sharing. The prepared columns' arena spaces are given at admission (``_place``)."""
        schema = dataset.schema
        gathered, prepared = [], []
        augment: dict[str, Augmenter] = {}
        larger, apart = [], []
        for c in job.columns:
            dec = decoder_for(schema.field(c))
            if dec.kind is not DecodeKind.IMAGE:
                gathered.append(dec)
                continue
            decodes = [] if sched is None else _open_decodes(sched, c)
            col = column_plan(job.name, job.ids, c, spec.image_size, augmenter, cap, decodes)
            if col.augmenter is not None:
                augment[c] = col.augmenter
            larger += [col.larger] if col.larger else []
            apart += [col.apart] if col.apart else []
            dec = decoder_for(schema.field(c), image_size=col.size, max_pixels=self.max_pixels)
            prepared.append((dec, UNPLACED))
        columns = tuple(job.columns)
        plan = Plan(columns, tuple(gathered), tuple(prepared), augment, receiver, tuple(larger))
        return plan, larger + apart

    def _place(self, sched: DatasetScheduler, dataset: Dataset, plan: Plan) -> Plan:
        """``plan`` with the arena space of each prepared column (made if new)."""
        gen = self._generation.get(dataset.name, 0)
        prepared = []
        for dec, _ in plan.prepared:
            name = f"{dataset.name}{f'~{gen}' if gen else ''}/{dec.key}"
            fixed = dec.image_size is not None and not isinstance(dec.image_size, Fit)
            space = self._arena.space(name, num_rows=dataset.num_rows, fixed=fixed)
            self._space_owner[space] = sched
            prepared.append((dec, space))
        return dataclasses.replace(plan, prepared=tuple(prepared))

    def storage_batch(self, uri: str, name: str, size: int, batch: int) -> bytes:
        """Record batch ``batch`` (-1: the tail) of part ``name`` (``size`` bytes) of the object
        storage at ``uri``, from this loader's own tier or fetched (and kept there): what a
        Ray node answers a peer asking for its share of the partitioned cache."""
        return self._storage.read_batch(uri, name, size, batch)

    def job_options(self, job: str) -> dict[str, Any]:
        """The ``WITH`` options a job was registered with."""
        with self._lock:
            return dict(self.catalog.job(job).options)

    def job_rows(self, job: str) -> int:
        """The number of rows of a registered job (an epoch's, all ranks together)."""
        with self._lock:
            return len(self.catalog.job(job).ids)

    def stats(self) -> dict[str, Any]:
        """Counters, overall, per dataset and per open job.

        ``cache``: the arena's (entries, hits, misses, evictions, pinned...); ``reads``:
        payload (binary) values read; ``decodes``: images decoded; ``bytes_read``;
        ``datasets``: per dataset, seconds of the pool's threads spent reading, decoding and
        collating (``read_s``, ``decode_s``, ``collate_s``); ``jobs``: per open job, its
        dataset and ``JobStream.stats()`` (``wait_s`` waiting for data vs ``compute_s``).
        """
        schedulers = list(self._schedulers.values())
        datasets = {s.name: s.fetcher.counters.snapshot() for s in schedulers}
        jobs = {}
        for s in schedulers:
            with s.cond:
                jobs.update({n: {"dataset": s.name, **j.stats()} for n, j in s.jobs.items()})
        storage = self._storage.stats()
        local = sum(int(d["storage_bytes"]) for d in datasets.values()) + sum(
            r.bytes_read
            for s in schedulers
            for r in {id(x): x for x in (s.fetcher.reader, s.fetcher.gatherer.table)}.values()
            if not r.ranged
        )
        return {
            "cache": self._arena.stats(),
            "reads": sum(int(d["reads"]) for d in datasets.values()),
            "decodes": sum(int(d["decodes"]) for d in datasets.values()),
            "bytes_read": sum(int(d["bytes_read"]) for d in datasets.values()),
            "datasets": datasets,
            "jobs": jobs,
            "storage": {**storage, "local_bytes": local},
        }

    def close(self) -> None:
        """Stop every scheduler and worker thread; open streams become unusable."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:  # a forked child: the threads, processes and memory
            return  # are the parent's
        for sched in self._schedulers.values():
            for job in list(sched.jobs.values()):
                sched.remove(job)
            sched.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._storage.close()
        self._release_memory()
        self._memory.close()
        _join_warm_up()
        if self._owns_catalog:
            self.catalog.close()
        if self.access_log is not None and self._access_log_path is not None:
            self.access_log.save(self._access_log_path)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until what the loader starts in the background (its decode processes,
        pyarrow's first conversion) is done: a benchmark that times steady state calls it;
        jobs need not (their first batch waits only for what it uses)."""
        if self._procs is not None and _holds_bytes(self.catalog):
            self._procs.start()
            self._procs.wait_started(timeout)
        _join_warm_up()

    def _release_memory(self) -> None:
        if self._procs is not None:
            self._procs.close()
        if self._segment is not None:
            self._segment.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_WARM_LOCK = threading.Lock()
_warm_thread: threading.Thread | None = None


def _warm_pyarrow() -> None:
    """Import, in a background thread, what pyarrow imports on its first numpy conversion,
    for a job whose columns take pyarrow's own conversions (strings, lists).

    pyarrow asks its pandas shim about every array it converts from or to numpy (``pa.array``,
    ``to_numpy``), and the first time that imports pandas: 0.2-0.4 s of one thread, which such a
    job's first batch would wait for. Numbers and images never convert through pyarrow
    (:mod:`tabloader.catalog._arrays`), so a service that serves only them never pays it (it did at
    each start, beside its first batch on the same cores). Once per process; ``Loader.close`` waits
    for it (no tabloader thread outlives the loaders).
    """
    global _warm_thread
    with _WARM_LOCK:
        if _warm_thread is not None:
            return

        # pandas imports it, and one imported after the main thread ended (a process that
        # exits at once) cannot register its exit hook: imported here, before
        import concurrent.futures.thread  # noqa: F401

        def run() -> None:
            import pyarrow as pa
            import pyarrow.compute  # ``take``'s kernels

            pa.array(np.zeros(1, np.int64)).to_numpy()

        # not a daemon: an import cut off at exit can crash the interpreter's finalization
        _warm_thread = threading.Thread(target=run, name="tabloader-warm-pyarrow")
        _warm_thread.start()


def _join_warm_up() -> None:
    if _warm_thread is not None:
        _warm_thread.join()


def _open_decodes(sched: DatasetScheduler, column: str) -> list[OpenDecode]:
    """The decodes of ``column`` that the jobs open on ``sched``'s dataset read: shared
    aspect-kept ones (what a job opening there may share: ``planning``) and fixed-size ones."""
    with sched.cond:
        jobs = list(sched.jobs.values())
    return [
        OpenDecode(job.name, job.ids, dec.image_size)
        for job in jobs
        for dec, _ in job.plan.prepared
        if dec.column == column and isinstance(dec.image_size, Fit | int)
    ]


_DEFAULT_LOADERS: dict[Path, Loader] = {}
_DEFAULT_LOCK = threading.Lock()
_LIVE_LOADERS: weakref.WeakSet[Loader] = weakref.WeakSet()  # closed at exit


def _close_live_loaders() -> None:
    """At exit: stop every open loader's threads and close the catalogs they opened."""
    for loader in list(_LIVE_LOADERS):
        loader.close()


# ``concurrent.futures`` stops accepting tasks in ``threading``'s exit hooks, which run before
# ``atexit``'s: a scheduler still loading rows for an open stream then failed with "cannot
# schedule new futures after interpreter shutdown". Those hooks run last-registered first, and
# this module imported the thread pool above, so the loaders close before the pools refuse work.
getattr(threading, "_register_atexit", atexit.register)(_close_live_loaders)


def default_loader(catalog: Catalog | str | os.PathLike[str] | None = None) -> Loader:
    """The process-wide ``Loader`` of a catalog, created on first use.

    Every ``JobDataset`` of a process that names the same catalog shares it, so their jobs
    share one sampler and one cache. Its cache size is ``$TABLOADER_CACHE_BYTES`` (default
    1 GiB); build a ``Loader`` yourself for other settings.
    """
    root = catalog.root if isinstance(catalog, Catalog) else resolve_root(catalog)
    with _DEFAULT_LOCK:
        loader = _DEFAULT_LOADERS.get(root)
        if loader is None or loader.closed:
            cache = setting("cache_bytes")
            loader = Loader(catalog if isinstance(catalog, Catalog) else root, cache_bytes=cache)
            _DEFAULT_LOADERS[root] = loader
        return loader


def _share(job: Job, spec: JobSpec, world_size: int) -> int:
    """The rows of an epoch each of ``world_size`` ranks of ``job`` reads (``rank_share``).

    Raises:
        LoaderError: more ranks than rows, or ranks that would get no batch.
    """
    if world_size > len(job.ids):
        raise LoaderError(
            f"world_size={world_size}: job {job.name!r} has {len(job.ids)} rows, "
            "fewer than its ranks; a job has at most one rank per row."
        )
    share = rank_share(len(job.ids), spec.batch_size, world_size, spec.drop_last)
    if share == 0 and world_size > 1:
        raise LoaderError(
            f"Job {job.name!r} has {len(job.ids)} rows, fewer than batch_size ({spec.batch_size})"
            f" x world_size ({world_size}): no rank would get a batch; use a smaller batch_size."
        )
    return share


def _continues(read: Dataset, dataset: Dataset) -> bool:
    """Whether ``dataset`` is ``read`` or a later version of it (rows appended), not a
    dataset of the same name imported after a drop (its files are all new)."""
    return dataset.files[: len(read.files)] == read.files
