"""PyTorch: a registered job as an ``IterableDataset`` of batches.

Example:
    >>> from torch.utils.data import DataLoader                      # doctest: +SKIP
    >>> ds = JobDataset("resnet18", batch_size=64)  # the default catalog  # doctest: +SKIP
    >>> for epoch in range(3):                                         # doctest: +SKIP
    ...     for batch in DataLoader(ds, batch_size=None):
    ...         loss = model(batch["image"], batch["label"])

Each ``iter()`` over the dataset starts the job's next epoch, as a ``DataLoader`` does: an
epoch left part-read (a ``break``, a framework's sanity check, ``limit_train_batches``) is
given up and counted (``stats()["abandoned_rows"]``), except right after ``load_state_dict()``,
where the first ``iter()`` resumes the saved epoch mid-way. ``len(ds)`` is this rank's batches
per epoch. Use ``JobLoader(ds)`` (or ``DataLoader(ds, batch_size=None)`` with the default
``num_workers=0``): tabloader reads and decodes with its own threads, shared by every job of
the process; ``JobLoader`` also carries the job's position into framework checkpoints
(Lightning saves ``state_dict()`` of loaders that have one). A ``JobDataset`` that Lightning
trains through a plain ``DataLoader`` warns once, with that fix, when a checkpoint is saved
or resumed without its position (:mod:`tabloader.integrations._lightning`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from tabloader.catalog._augment import default_seed, from_torchvision
from tabloader.catalog._errors import CatalogLockedError, LoaderError
from tabloader.catalog._options import JobSpec
from tabloader.engine._opening import OpenArgs, OpenRequest
from tabloader.engine._queue.ranks import rank_share, resolve_rank
from tabloader.integrations import _lightning
from tabloader.service._client import RemoteLoader, service_loader

if TYPE_CHECKING:  # a job process through the service never imports DuckDB or the engine
    from typing_extensions import Unpack

    from tabloader.catalog import Catalog
    from tabloader.engine import Loader
    from tabloader.engine._deliver.streams import Stream

__all__ = ["JobDataset", "JobLoader", "Transform", "to_tensors"]

Transform = Callable[[dict[str, Any], torch.Generator], dict[str, Any]]
"""``transform(batch, generator) -> batch``; draw randomness only from ``generator``."""


def to_tensors(batch: dict[str, Any]) -> dict[str, Any]:
    """Numpy arrays become tensors (zero-copy); lists of strings stay lists."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, np.ndarray) and value.dtype != object:
            out[key] = torch.from_numpy(value)
        elif isinstance(value, list) and value and isinstance(value[0], np.ndarray):
            out[key] = [torch.from_numpy(v) for v in value]
        else:
            out[key] = value
    return out


def _to_numpy(value: Any) -> Any:
    """A tensor (any device, with or without grad) as a CPU numpy array; others as they are."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    return value


class JobDataset(IterableDataset):  # type: ignore[type-arg]
    """The batches of a registered job, as dicts of tensors with the ``_id`` column.

    Args:
        job: the registered job's name.
        catalog: the catalog's directory: the job loads through the catalog's loader service
            (started in the background if none runs), so training scripts in separate
            processes share reads and decodes. Or a ``Catalog`` object: the job loads in this
            process (the default ``Loader`` of that catalog, shared by its jobs: notebooks,
            tests, jobs on threads).
        loader: a ``Loader`` (or ``RemoteLoader``) to use instead.
        transform: per-job augmentation ``transform(batch, generator)``, run in this job.

        The other arguments are those of every open (:class:`~tabloader.engine.OpenArgs`,
        made into one ``OpenRequest`` and checked here; see ``tabloader.engine._opening``):

        prefetch: batches loaded ahead (default: enough to keep the loader's workers busy).
        epochs: the epochs this job will read (None: no end); nothing is loaded ahead past
            the last one.
        rank, world_size: this dataset is rank ``rank`` of ``world_size`` data-parallel ranks
            of the job. Default: found when it opens (its first ``iter()``) from what launched
            this process: an initialised torch.distributed process group (Lightning, the HF
            Trainer and accelerate under a launcher), else ``RANK`` and ``WORLD_SIZE``
            (torchrun, ``accelerate launch``, Ray Train), Lightning's launcher's
            ``LOCAL_RANK``/``NODE_RANK``/``WORLD_SIZE``, SLURM's ``srun`` tasks, else a plain
            job; launchers that disagree fail with an error naming what they set (the order:
            :mod:`tabloader.engine._queue.ranks`). Pass both to override them. Each rank gets a
            disjoint, equal share of every epoch; the last ``n % (batch_size * world_size)``
            rows of an epoch are dropped (``DistributedSampler(drop_last=True)``), or with
            ``drop_last=False`` (for evaluation) none: each rank gets ``ceil(n / world_size)``
            rows, padded with repeats of the epoch's first rows
            (``DistributedSampler(drop_last=False)``). A rank waits ``rank_timeout`` seconds
            (default 45) for a rank that never opens the job, then raises. Ranks in separate
            processes (torchrun) meet in the catalog's service; each must save its
            ``state_dict()`` at the same step (see ``Loader.open``).
        **options: the job's options (``tabloader.catalog._options.JOB_OPTIONS``; default: the ones
        it
            was registered with), each checked here (with the registered ones when it opens):

            * ``batch_size``: rows per batch (default 32).
            * ``seed``: seed of this job's generator and its augmentations (default: a hash
              of the job name, so two jobs never draw the same sequence).
            * ``image_size``: shared deterministic resize (an int or a ``(height, width)``).
            * ``augment``: the job's own random transforms, run by the loader per image on a
              shared decode: a text such as ``"RandomResizedCrop(224),
              RandomHorizontalFlip()"`` (see :mod:`tabloader.catalog._augment`) or a
              ``torchvision.transforms.v2.Compose`` of the same ops. Draws come from
              (``seed``, epoch, row ``_id``): reproducible, across resumes too.
            * ``decode_size``: cap of the shared decode's shorter side.
            * ``on_error``: ``"raise"`` or ``"skip"`` rows that fail to read or decode.

    Raises:
        OptionError: an unknown option (with the closest known one) or a bad value.
    """

    def __init__(
        self,
        job: str,
        *,
        catalog: Catalog | str | os.PathLike[str] | None = None,
        loader: Loader | RemoteLoader | None = None,
        transform: Transform | None = None,
        **args: Unpack[OpenArgs],
    ) -> None:
        super().__init__()
        self.job = job
        self._pid = os.getpid()  # its loader's connection and threads are this process's
        if args.get("augment") is not None and not isinstance(args["augment"], str):
            args["augment"] = from_torchvision(args["augment"])
        # every open of it asks for this: its arguments checked here, once (the options each
        # on its own; with the registered ones where they are, when it opens)
        self._request = OpenRequest.make(job, **args)
        if loader is None:
            loader = _loader_for(catalog)
        self.loader: Loader | RemoteLoader = loader
        self.transform = transform
        # the job's seed, else one of its own: jobs never share draws (the registered seed is
        # known when it opens: it seeds the generator then)
        self._generator = torch.Generator()
        self._seeded = False  # by the job's seed: given here, else registered (see generator)
        if self._request.options.get("seed") is not None:
            self._seed(self._request.options["seed"])
        self._stream: Stream | None = None
        self._closes = 0  # close() calls: an open that a close overtook gives its stream up
        self._closing = threading.Lock()  # a close and an open's end, one at a time
        self._state: dict[str, Any] | None = None
        self._rows: int | None = None  # the job's, for len()
        self._resuming = False  # the next iter() resumes the state loaded (not a new epoch)
        self._partial: int | None = None  # the epoch an iteration stopped in mid-way
        # whether frameworks' checkpoints carry its position (tabloader.integrations._lightning)
        self.position_requests = 0  # state_dict() calls
        self.position_loaded = False  # load_state_dict() was called
        self.position_warned = False  # it said that a checkpoint does not carry it

    def _here(self) -> None:
        """Refuse use in a process forked from the one that made it (it would share the
        parent's connection and threads and garble both)."""
        if os.getpid() != self._pid:
            raise LoaderError(
                f"JobDataset {self.job!r} was created in process {self._pid} and is used in "
                f"process {os.getpid()} (forked from it); create the JobDataset in the child."
            )

    def __reduce__(self) -> Any:
        raise TypeError(
            f"A JobDataset (job {self.job!r}) cannot be pickled: it holds its process's "
            "connection to the loader. Pass the job name (and options) to the other process "
            "and create the JobDataset there."
        )

    def _open(self, *, read_ahead: bool = False) -> Stream:
        """The job's stream, opened with the request made at ``__init__`` (and the state
        loaded); ``read_ahead``: for an iteration (a service's first batch is asked for with
        the open)."""
        self._here()
        stream = self._stream
        if stream is not None:
            return stream
        request = self._request
        if self._state is not None:
            request = dataclasses.replace(request, state=self._state)
        closes = self._closes
        if read_ahead and isinstance(self.loader, RemoteLoader):
            stream = self.loader.open(request, read_ahead=True)
        else:
            stream = self.loader.open(request)
        with self._closing:
            overtaken = closes != self._closes  # close() came (another thread) meanwhile
            if not overtaken:
                self._stream = stream
        if overtaken:
            stream.close()
            raise LoaderError(f"Job stream {self.job!r} is closed; open the job again.")
        self._state = None
        if not self._seeded:  # the registered seed, known now
            self._seed(stream.spec.seed)
        return stream

    @property
    def generator(self) -> torch.Generator:
        """The generator of this job's ``transform``: seeded by the job's ``seed`` (given
        here, else registered), else by one of its own (jobs never share draws). The
        registered seed comes with the first open; read before it, it is asked for."""
        if not self._seeded:
            self._seed(self._request.resolve_spec(self.loader.job_options(self.job)).seed)
        return self._generator

    def _seed(self, seed: int | None) -> None:
        self._generator.manual_seed(int(default_seed(self.job) if seed is None else seed))
        self._seeded = True

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if get_worker_info() is not None:
            raise LoaderError(
                "JobDataset runs in the main process: use DataLoader(ds, batch_size=None) with "
                "num_workers=0; tabloader decodes with its own threads."
            )
        if not self.position_warned and any(p in sys.modules for p in _lightning.PACKAGES):
            _lightning.watch(self)  # a Lightning trainer that trains: is the position saved?
        stream = self._open(read_ahead=True)
        if self._resuming:
            self._resuming = False
        elif self._partial is not None:  # the last iteration stopped mid-epoch: a new one
            stream.abandon(self._partial)
        self._partial = None
        epoch = stream.epoch
        while (batch := stream.take(epoch)) is not None:
            self._partial = epoch  # until the epoch's end is reached
            tensors = to_tensors(batch)
            yield self.transform(tensors, self.generator) if self.transform else tensors
        self._partial = None

    def __len__(self) -> int:
        """Batches of an epoch for this rank (a whole epoch's, also while one resumed from
        a ``state_dict`` delivers only its remaining rows). With ranks (found as ``open``
        finds them, when this is called), the share of ``rank_share``; with one rank the
        last batch may be short."""
        if self._rows is None:
            self._rows = self.loader.job_rows(self.job)
        world_size = self.world_size
        spec = (
            self._stream.spec
            if self._stream is not None
            else self._request.resolve_spec(self.loader.job_options(self.job))
        )
        batch_size = int(spec.batch_size)
        share = rank_share(self._rows, batch_size, world_size, bool(spec.drop_last))
        return -(-share // batch_size)

    @property
    def rank(self) -> int:
        """This dataset's rank among the job's data-parallel ranks: the open stream's, else
        the one it would open as now (``rank=``, else found from the launcher:
        :mod:`tabloader.engine._queue.ranks`), without opening."""
        if self._stream is not None:
            return self._stream.rank
        return resolve_rank(self._request.rank, self._request.world_size)[0]

    @property
    def world_size(self) -> int:
        """The number of the job's data-parallel ranks (as ``rank``)."""
        if self._stream is not None:
            return self._stream.world_size
        return resolve_rank(self._request.rank, self._request.world_size)[1]

    @property
    def spec(self) -> JobSpec:
        """The job's options: the ones it was registered with, those given here laid over."""
        return self._open().spec

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._open().epoch

    def stats(self) -> dict[str, Any]:
        """The job's counters (batches, rows, epoch, rows per second...)."""
        return self._open().stats()

    def report(self, ids: torch.Tensor | np.ndarray, losses: torch.Tensor | np.ndarray) -> None:
        """Report the per-row losses of a batch of a job with ``importance = 'loss'``: rows
        that score high (SHADE's rank of the loss within its batch,
        :mod:`tabloader.sampling._importance`) are drawn more often from the next epoch on.

        ``ids``: the batch's ``batch["_id"]``; ``losses``: one loss per row (e.g.
        ``F.cross_entropy(out, y, reduction="none")``), a tensor on any device (it is
        detached and copied to the CPU) or an array. Every rank of a data-parallel job reports
        its own batches; they score the job's one set of rows. ``state_dict()`` keeps the
        scores (a resume draws as the run would have).

        Example:
            >>> for batch in JobLoader(ds):                              # doctest: +SKIP
            ...     per_row = F.cross_entropy(model(batch["image"]), batch["label"],
            ...                               reduction="none")
            ...     ds.report(batch["_id"], per_row)
            ...     (per_row * batch["_weight"]).mean().backward()

        Raises:
            LoaderError: the job is not open (iterate it first), has no ``importance =
                'loss'``, or the arrays are bad (shapes, dtypes, non-finite losses, rows not
                of the job).
        """
        self._here()
        if self._stream is None:
            raise LoaderError(
                f"Job {self.job!r}: report() scores rows of the batches this dataset yielded; "
                "iterate it first."
            )
        self._stream.report(_to_numpy(ids), _to_numpy(losses))

    def state_dict(self, unused: int = 0) -> dict[str, Any]:
        """Where the job is (epoch, rows not yet delivered) and its generator's state.

        ``unused``: batches this dataset has yielded that training has not used yet (0 to
        2; a loop that fetches a batch before it trains on the last one passes 1): their
        rows count as still to come, so a resume trains them.

        With ranks, the job's state at this rank's step: save it on every rank at the same
        step (as DDP checkpoints do), and load it on every rank to resume. The state does not
        depend on the number of ranks: one saved with N ranks resumes with M, each remaining
        row of the epoch delivered once (less what M ranks drop, see ``rank_share``).
        """
        self.position_requests += 1
        if self._state is not None:  # loaded, not opened yet: still where it says
            return {"stream": self._state, "generator": self.generator.get_state()}
        stream = self._open()
        return {
            "stream": stream.state_dict(undelivered=unused),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next ``iter()`` continues that epoch exactly."""
        self.close()  # the stream open now (or being opened) goes
        self._state = state["stream"]
        self.position_loaded = True
        self._generator.set_state(state["generator"])
        self._seeded = True  # the generator goes on from there
        self._resuming, self._partial = True, None

    def close(self) -> None:
        """Leave the loader (release this job's pins); iterating again reopens the job."""
        self._here()
        with self._closing:
            self._closes += 1  # an open under way in another thread gives its stream up
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()


class JobLoader(DataLoader):  # type: ignore[type-arg]
    """``DataLoader(dataset, batch_size=None)`` for a :class:`JobDataset`, with its
    ``state_dict()`` and ``load_state_dict()``: frameworks that checkpoint the state of their
    loaders (Lightning does for every loader that has both) then resume the job mid-epoch,
    each row of the epoch trained once. Its ``len()`` is the dataset's.

    Example:
        >>> def train_dataloader(self):                                # doctest: +SKIP
        ...     return JobLoader(JobDataset("resnet18", batch_size=64))

    Args:
        dataset: the job's dataset.
        **kwargs: ``DataLoader`` arguments (``pin_memory``, ``pin_memory_device``); the
            batching and worker ones are tabloader's (``batch_size``, ``num_workers``...).
    """

    def __init__(self, dataset: JobDataset, **kwargs: Any) -> None:
        if not isinstance(dataset, JobDataset):
            raise TypeError(f"JobLoader takes a JobDataset, not {type(dataset).__name__}.")
        ours = sorted(
            k
            for k in ("batch_size", "shuffle", "sampler", "batch_sampler", "num_workers")
            if kwargs.get(k) not in (None, 0, False)
        )
        if ours:
            raise LoaderError(
                f"JobLoader({', '.join(ours)}=...): the job's batches come from tabloader "
                "(batch_size is a job option: JobDataset(job, batch_size=...)), in its own "
                "random order, decoded by its own threads; leave these out."
            )
        kwargs = {k: v for k, v in kwargs.items() if k not in ("batch_size", "num_workers")}
        super().__init__(dataset, batch_size=None, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The dataset's ``state_dict()``."""
        return self.dataset.state_dict()  # type: ignore[no-any-return, attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The dataset's ``load_state_dict()``: the next epoch iterated resumes it."""
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]


def _is_catalog(value: object) -> bool:
    """Whether ``value`` is an open ``Catalog`` (without importing DuckDB and sqlglot, 0.3 s
    of a job process's start, where the catalog module was never imported: then it is not)."""
    module = sys.modules.get("tabloader.catalog._catalog")
    return module is not None and isinstance(value, module.Catalog)


def _loader_for(catalog: Catalog | str | os.PathLike[str] | None) -> Loader | RemoteLoader:
    """The default ``Loader`` of an open ``Catalog`` (its jobs load in this process), else the
    service of the catalog directory."""
    if _is_catalog(catalog):
        from tabloader.engine import default_loader

        return default_loader(catalog)
    if catalog is not None and not isinstance(catalog, (str, os.PathLike)):
        raise TypeError(
            f"catalog= takes a catalog directory or an open Catalog, not {type(catalog).__name__}."
        )
    return _service(catalog)


def _service(catalog: str | os.PathLike[str] | None) -> RemoteLoader:
    """The catalog's loader service (started if none runs), unless this process has the
    catalog open itself: then the service could not open it (the error says to share it).
    """
    from tabloader.catalog._directory import DB_FILE, is_open, not_a_catalog, resolve_root

    root = resolve_root(catalog)
    if not (root / DB_FILE).exists():  # no service to start for it: say so, create nothing
        raise not_a_catalog(root)
    if is_open(root):
        raise CatalogLockedError(
            f"Catalog '{root}' is open already in this process. Pass that Catalog object as "
            "catalog= to JobDataset (jobs then load in this process), or close() it so that "
            "the jobs go through the catalog's loader service."
        )
    return service_loader(root)
