"""accelerate: a ``JobDataset`` as the loader of one process of an ``Accelerator`` run.

    from accelerate import Accelerator
    from tabloader.integrations.accelerate import prepare
    from tabloader.torch import JobDataset

    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = prepare(accelerator, JobDataset("resnet18"))  # not accelerator.prepare(...)
    for epoch in range(3):
        for batch in loader:  # this process's share, on accelerator.device
            ...
    accelerator.save_state("ckpt")  # the job's position too: load_state("ckpt") resumes it

tabloader already gives each process its own share of every epoch (rank
``accelerator.process_index`` of ``accelerator.num_processes``), which
``accelerator.prepare(DataLoader(ds, batch_size=None))`` does not know:

* by default accelerate dispatches an ``IterableDataset``: process 0 reads every batch and
  sends the others their slices, so the other ranks never open the job and process 0 waits
  for them until ``rank_timeout`` (a job option) runs out and raises ``LoaderError``;
* with ``dispatch_batches=False`` it wraps the dataset in ``IterableDatasetShard``, which
  splits each rank's share again: with a ``batch_size`` (the HF ``Trainer``'s loader) half
  the rows of each epoch are never trained with 2 processes, silently; with
  ``batch_size=None`` it fails at the first batch (``None * num_processes``).

``prepare`` builds accelerate's own per-process loader (``DataLoaderShard``) around the
dataset as it is: batches move to ``accelerator.device``, ``accelerator.accumulate`` still
sees the end of each epoch (gradients sync on the last batch), and the job's position goes
into ``accelerator.save_state()`` (it is registered for checkpointing) and comes back with
``load_state()``: a resume continues the epoch where the checkpoint was taken, each row once,
with the same or another number of processes.

On a machine without GPUs accelerate joins torchrun's processes only with
``Accelerator(cpu=True)``; otherwise each process runs alone, and ``prepare`` refuses the
dataset whose rank says otherwise. An evaluation job with ``drop_last=False`` pads the
ranks' last batches with repeated rows; ``accelerator.gather_for_metrics`` keeps them (it
knows no remainder for a loader of batches): drop repeats by ``_id``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accelerate.data_loader import DataLoaderShard

from tabloader.catalog._errors import LoaderError
from tabloader.torch import JobDataset

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["JobDataLoader", "prepare"]


class JobDataLoader(DataLoaderShard):  # type: ignore[misc]
    """accelerate's loader of one process around a ``JobDataset``, batches as they come.

    ``DataLoaderShard`` reads one batch ahead (to know the last batch of an epoch), so while
    the training loop holds a batch the next one is already taken from the job: ``state_dict``
    counts it as still to come.
    """

    def __init__(
        self,
        dataset: JobDataset,
        device: Any = None,
        non_blocking: bool = False,
        collate_fn: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        extra = {} if collate_fn is None else {"collate_fn": collate_fn}
        super().__init__(
            dataset,
            device=device,
            batch_size=None,
            _drop_last=True,
            _non_blocking=non_blocking,
            **extra,
        )
        self._ahead = False  # a batch taken from the job and not yielded yet

    def _update_state_dict(self) -> None:
        """``DataLoaderShard`` calls this just before it reads the batch ahead, and again once
        the epoch ended (``end_of_dataloader``): whether a batch is held ahead. (Its own
        snapshot of the base loader's state per batch would ask the service every batch.)"""
        self._ahead = not self.end_of_dataloader

    def state_dict(self) -> dict[str, Any]:
        """The job's position for ``accelerator.save_state()``: the batch read ahead and not
        trained yet is still to come. The same on every process saved at the same step."""
        dataset: JobDataset = self.dataset
        return dataset.state_dict(unused=int(self._ahead))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the job from ``state_dict()`` (``accelerator.load_state()``): the next
        iteration continues that epoch."""
        dataset: JobDataset = self.dataset
        dataset.load_state_dict(state)
        self._ahead = False


def prepare(
    accelerator: Accelerator,
    dataset: JobDataset,
    *,
    device_placement: bool | None = None,
    register: bool = True,
    collate_fn: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> JobDataLoader:
    """The loader of this process's share of the job, for a loop under ``accelerator``.

    Use it instead of ``accelerator.prepare(DataLoader(dataset, batch_size=None))``; prepare
    the model and optimizer with ``accelerator.prepare`` as usual.

    Args:
        accelerator: the run's ``Accelerator``; its ``process_index`` and ``num_processes``
            must be the dataset's rank and world size (what the dataset finds by default under
            ``accelerate launch`` and torchrun).
        dataset: the job, one stream per process.
        device_placement: move batches to ``accelerator.device`` (default: the
            accelerator's own ``device_placement``).
        register: register the loader with ``accelerator.register_for_checkpointing``, so
            that ``save_state()`` and ``load_state()`` carry the job's position. Register
            every ``prepare``d training job in the same order in the run that resumes.
        collate_fn: applied to each batch (a dict of tensors) before it moves to the device:
            renames or drops columns.

    Raises:
        LoaderError: the dataset's rank or world size is not the accelerator's.
    """
    if not isinstance(dataset, JobDataset):
        raise TypeError(
            f"prepare() takes a tabloader JobDataset, not {type(dataset).__name__}; "
            "prepare other loaders with accelerator.prepare()."
        )
    _check_ranks(accelerator, dataset)
    if device_placement is None:
        device_placement = accelerator.device_placement
    loader = JobDataLoader(
        dataset,
        device=accelerator.device if device_placement else None,
        non_blocking=accelerator.non_blocking,
        collate_fn=collate_fn,
    )
    if register:
        accelerator.register_for_checkpointing(loader)
    return loader


def _check_ranks(accelerator: Accelerator, dataset: JobDataset) -> None:
    """The dataset's ranks are accelerate's processes: one stream per process."""
    rank, world_size = dataset.rank, dataset.world_size
    expected = (accelerator.process_index, accelerator.num_processes)
    if (rank, world_size) == expected:
        return
    cpu = ""
    if expected[1] == 1 and world_size > 1:
        cpu = (
            " accelerate runs one process: on a machine without GPUs it joins the launcher's "
            "processes only with Accelerator(cpu=True) (TrainingArguments(use_cpu=True))."
        )
    raise LoaderError(
        f"JobDataset {dataset.job!r} is rank {rank} of {world_size}, but this accelerate "
        f"process is {expected[0]} of {expected[1]}.{cpu} Give the dataset accelerate's "
        "processes: JobDataset(job, rank=accelerator.process_index, "
        "world_size=accelerator.num_processes)."
    )
