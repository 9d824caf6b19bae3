"""Lightning on CPU, 1 process or ``devices=2, strategy="ddp"`` (Lightning's own launcher
starts rank 1 as a child of this process): ``train_dataloader()`` returns ``JobLoader(ds)``,
no other glue (``--plain-loader``: ``DataLoader(ds, batch_size=None)``, which Lightning
checkpoints without the job's position). See ``_common.py`` for the arguments and what is
recorded."""

from __future__ import annotations

import gc

# Python's collector runs through the frameworks' imports (a third of transformers' import
# time, 2.1 of 7.1 CPU-s; Lightning's 1.3 of 6.5): off until they are done (the tests'
# subject is what the script does after); a user's script needs none of this.
gc.disable()

import lightning as L
import torch
from _common import arguments, crash, features, model, record
from torch.utils.data import DataLoader

from tabloader.torch import JobDataset, JobLoader

gc.enable()
args = arguments()


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def train_dataloader(self) -> DataLoader:  # docs/frameworks.md's Lightning recipe
        self.train_job = JobDataset(args.job, catalog=args.catalog, epochs=args.epochs)
        if args.plain_loader:  # what other loaders do: its checkpoints hold no job position
            return DataLoader(self.train_job, batch_size=None)
        return JobLoader(self.train_job)

    def val_dataloader(self) -> JobLoader:
        # evaluation: every row (under DDP the last batches padded, not dropped)
        return JobLoader(JobDataset(args.val_job, catalog=args.catalog, drop_last=False))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        record(args, "train", self.global_rank, self.current_epoch, batch["_id"])
        logits = self.net(features(batch["image"]))
        return torch.nn.functional.cross_entropy(logits, batch["label"])

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        kind = "sanity" if self.trainer.sanity_checking else "val"
        record(args, kind, self.global_rank, self.current_epoch, batch["_id"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Interrupt(L.Callback):
    """A checkpoint at the end of epoch 0 (``--epoch-end-ckpt``), and one after step
    ``--stop-after`` followed by a crash."""

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if args.epoch_end_ckpt and trainer.current_epoch == 0:
            trainer.save_checkpoint(args.epoch_end_ckpt)

    def on_train_batch_end(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_step == args.stop_after:
            trainer.save_checkpoint(args.ckpt)
            crash()


trainer = L.Trainer(
    accelerator="cpu",
    devices=args.devices,
    strategy="ddp" if args.devices > 1 else "auto",
    max_epochs=args.epochs,
    limit_train_batches=args.limit_train_batches,
    limit_val_batches=None if args.val_job else 0,
    num_sanity_val_steps=2,
    callbacks=[Interrupt()],
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    logger=False,
)
model_ = Model()
trainer.fit(model_, ckpt_path=args.resume)
if trainer.global_rank == 0 and args.limit_train_batches:
    print(f"abandoned_rows={model_.train_job.stats()['abandoned_rows']}", flush=True)  # noqa: T201
