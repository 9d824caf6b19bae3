"""The Hugging Face ``Trainer`` (tabloader's ``JobTrainer``), under torchrun or alone: a
``JobDataset`` as ``train_dataset`` and ``eval_dataset``, ``num_train_epochs`` (the job's
``len()``), checkpoints every ``--stop-after`` steps and ``train(resume_from_checkpoint=...)``.
See ``_common.py`` for the arguments and what is recorded."""

from __future__ import annotations

import gc

# Python's collector runs through the frameworks' imports (a third of transformers' import
# time, 2.1 of 7.1 CPU-s; Lightning's 1.3 of 6.5): off until they are done (the tests'
# subject is what the script does after); a user's script needs none of this.
gc.disable()

import os

import torch
from _common import arguments, crash, features, model, record
from transformers import TrainerCallback, TrainingArguments

from tabloader.integrations.transformers import JobTrainer
from tabloader.torch import JobDataset

gc.enable()
args = arguments()
RANK = int(os.environ.get("RANK", "0"))


class Classifier(torch.nn.Module):
    """``model(**batch)`` with the names of docs/frameworks.md's transform; ``_id`` is kept because
    ``forward`` takes it, ``image`` and ``label`` are dropped because it does not."""

    def __init__(self) -> None:
        super().__init__()
        self.net = model()
        self.epoch = 0

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor, _id: torch.Tensor) -> dict:
        kind = "train" if self.training else "val"
        record(args, kind, RANK, self.epoch, _id)
        logits = self.net(pixel_values.flatten(1))
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def names(batch: dict, generator: torch.Generator) -> dict:
    """The job's columns as the model's arguments (docs/frameworks.md's recipe), the rest kept."""
    return {**batch, "pixel_values": features(batch["image"]), "labels": batch["label"]}


class Epochs(TrainerCallback):
    """Tells the model the epoch it trains (for the record) and crashes after the checkpoint
    of step ``--stop-after``."""

    def on_epoch_begin(self, _args, state, control, **kwargs) -> None:  # type: ignore[no-untyped-def]
        classifier.epoch = int(state.epoch or 0)  # a resumed epoch starts part-way

    def on_save(self, _args, state, control, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if state.global_step == args.stop_after:
            if torch.distributed.is_initialized():
                torch.distributed.barrier()  # every rank has recorded its batches
            crash()


classifier = Classifier()
trainer = JobTrainer(  # docs/frameworks.md's Hugging Face recipe
    model=classifier,
    args=TrainingArguments(
        output_dir=args.out + "/hf",
        num_train_epochs=args.epochs,
        learning_rate=0.1,
        save_strategy="steps" if args.stop_after else "no",
        save_steps=args.stop_after or 500,
        eval_strategy="epoch" if args.val_job else "no",
        report_to=[],
        use_cpu=True,
        ddp_find_unused_parameters=False,  # every parameter is used (and no unused-search pass)
        disable_tqdm=True,
    ),
    train_dataset=JobDataset(args.job, catalog=args.catalog, epochs=args.epochs, transform=names),
    eval_dataset=JobDataset(args.val_job, catalog=args.catalog, drop_last=False, transform=names)
    if args.val_job
    else None,
    callbacks=[Epochs()],
)
trainer.train(resume_from_checkpoint=args.resume)
if torch.distributed.is_initialized():  # as a training script ends: a group left to the
    torch.distributed.destroy_process_group()  # interpreter's exit may abort in gloo's threads
