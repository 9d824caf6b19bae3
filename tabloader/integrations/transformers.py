"""Hugging Face ``Trainer`` with a ``JobDataset`` as ``train_dataset`` and ``eval_dataset``.

    from tabloader.integrations.transformers import JobTrainer
    from tabloader.torch import JobDataset

    trainer = JobTrainer(
        model=model,
        args=TrainingArguments("out", num_train_epochs=3, save_steps=100),
        train_dataset=JobDataset("resnet18"),
        eval_dataset=JobDataset("resnet18_eval", drop_last=False),
    )
    trainer.train()  # or trainer.train(resume_from_checkpoint=True)

What ``JobTrainer`` changes, and why the plain ``Trainer`` does not fit:

* **Loaders.** The ``Trainer`` builds a ``DataLoader`` that would batch the job's batches
  again (``per_device_train_batch_size``) and hands it to ``accelerator.prepare``, which reads
  every batch on process 0 (the other ranks never open the job: ``LoaderError`` after the
  job's ``rank_timeout``) or splits each rank's share again. ``JobTrainer`` gives each process
  its own share through :func:`tabloader.integrations.accelerate.prepare`. The job's
  ``batch_size`` is the batch per device (``per_device_train_batch_size`` is not used for it).
* **Columns.** The ``Trainer`` calls ``model(**batch)``. A batch holds the job's columns and
  ``_id``; as the ``Trainer`` does for a ``datasets.Dataset`` (``remove_unused_columns``, on
  by default), columns that the model's ``forward`` does not take are dropped, ``_id``
  included unless ``forward`` has such a parameter. To rename columns (``image`` to
  ``pixel_values``, ``label`` to ``labels``: the ``Trainer``'s collator, which renames
  ``label``, does not run on a job's batches), give the ``JobDataset`` a ``transform``.
* **Epochs.** ``len()`` is the job's batches per epoch on this process, so
  ``num_train_epochs`` works (no ``max_steps`` to compute by hand).
* **Resume.** Each checkpoint folder gets the job's position (``tabloader_job.pt``);
  ``train(resume_from_checkpoint=...)`` loads it and the resumed epoch goes on from there,
  each of its rows trained once, instead of the ``Trainer``'s skipping of the batches trained
  already (which would read them again, in another order). With ``ignore_data_skip=True`` the
  job starts a fresh epoch instead, as the ``Trainer`` does.
* **Evaluation under DDP.** Register or open evaluation jobs with ``drop_last = false``: the
  last batches are padded (as ``DistributedSampler`` pads) so every row is evaluated; the
  padded rows are in the gathered predictions too (their ``_id`` says which).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from typing import Any

import torch
import transformers
import transformers.trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from tabloader.catalog._errors import LoaderError
from tabloader.integrations.accelerate import JobDataLoader, prepare
from tabloader.torch import JobDataset

__all__ = ["STATE_FILE", "JobTrainer"]

STATE_FILE = "tabloader_job.pt"
"""The job's position in each checkpoint folder of a ``JobTrainer``."""


class JobTrainer(transformers.Trainer):  # type: ignore[misc]  # not followed: pyproject.toml
    """``transformers.Trainer`` whose ``JobDataset`` datasets load one share per process and
    resume exactly once (see the module's docstring). Other datasets load as in the
    ``Trainer``."""

    _job_loader: JobDataLoader | None = None

    def get_train_dataloader(self) -> Any:
        if not isinstance(self.train_dataset, JobDataset):
            return super().get_train_dataloader()
        self._job_loader = self._loader_of(self.train_dataset)
        return self._job_loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        chosen = eval_dataset
        if chosen is None:
            chosen = self.eval_dataset
        elif isinstance(chosen, str) and isinstance(self.eval_dataset, dict):
            chosen = self.eval_dataset[chosen]
        if not isinstance(chosen, JobDataset):
            return super().get_eval_dataloader(eval_dataset)
        return self._loader_of(chosen)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        if not isinstance(test_dataset, JobDataset):
            return super().get_test_dataloader(test_dataset)
        return self._loader_of(test_dataset)

    def _loader_of(self, dataset: JobDataset) -> JobDataLoader:
        """This process's loader of ``dataset``; not registered with the accelerator (the
        checkpoint folder gets the training job's position, see ``_save_checkpoint``)."""
        return prepare(self.accelerator, dataset, register=False, collate_fn=self._column_filter())

    def _column_filter(self) -> Any:
        """Drop the columns that ``model.forward`` does not take (nor the ``Trainer``'s
        ``label_names``), as ``remove_unused_columns`` does for a ``datasets.Dataset``
        (``None``: keep every column). Unlike the ``Trainer``, ``label`` and ``label_ids``
        are not kept for a collator to rename: a job's batches are not collated again."""
        if not self.args.remove_unused_columns:
            return None
        model: Any = self.model
        if hasattr(model, "get_base_model"):  # PEFT: the base model's forward
            model = model.get_base_model()
        keep = set(inspect.signature(model.forward).parameters) | set(self.label_names or ())

        def columns_the_model_takes(batch: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in batch.items() if k in keep}

        return columns_the_model_takes

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The ``Trainer``'s checkpoint, plus the training job's position (every process
        computes it, the same; the main process writes it)."""
        super()._save_checkpoint(model, trial)
        if self._job_loader is None:
            return
        state = self._job_loader.state_dict()
        if self.args.should_save:
            folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            path = os.path.join(self._get_output_dir(trial=trial), folder, STATE_FILE)
            torch.save(state, path)

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        """Load the job's position from the checkpoint resumed, and keep the ``Trainer`` from
        skipping the batches trained already (the job resumes past them itself)."""
        checkpoint = kwargs.get("resume_from_checkpoint")
        if checkpoint is None and len(args) > 2:
            checkpoint = args[2]
        if checkpoint is None or not isinstance(self.train_dataset, JobDataset):
            return super()._inner_training_loop(*args, **kwargs)
        if not self.args.ignore_data_skip:
            self.train_dataset.load_state_dict(_load_state(checkpoint))
        with _no_skipping(self):
            return super()._inner_training_loop(*args, **kwargs)


def _load_state(checkpoint: str) -> dict[str, Any]:
    path = os.path.join(checkpoint, STATE_FILE)
    if not os.path.exists(path):
        raise LoaderError(
            f"Checkpoint {checkpoint!r} has no {STATE_FILE} (the job's position): it was not "
            "saved by tabloader's JobTrainer, so the epoch cannot resume where it stopped. "
            "Resume from a JobTrainer checkpoint, or pass ignore_data_skip=True in the "
            "TrainingArguments to start the job's next epoch afresh."
        )
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


@contextlib.contextmanager
def _no_skipping(trainer: JobTrainer) -> Iterator[None]:
    """While the ``Trainer`` resumes: its ``skip_first_batches`` leaves the job's loader as
    it is (it would read the batches trained already and drop them)."""
    module: Any = transformers.trainer
    skip = module.skip_first_batches

    def skip_unless_job(loader: Any, num_batches: int = 0) -> Any:
        if loader is trainer._job_loader:
            return loader
        return skip(loader, num_batches)

    module.skip_first_batches = skip_unless_job
    try:
        yield
    finally:
        module.skip_first_batches = skip
