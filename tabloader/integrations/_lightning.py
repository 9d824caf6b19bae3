"""Lightning: a ``JobDataset`` whose position Lightning's checkpoints do not carry says so.

Lightning saves the state of each training loader that has ``state_dict()`` and
``load_state_dict()``: a ``JobLoader`` (the README's recipe) hands it the job's. A plain
``DataLoader(ds, batch_size=None)`` has neither, so its checkpoints hold no position of the
job, and a resume from one taken mid-epoch starts the job's epoch anew: some of that epoch's
rows are trained twice and others never (277 and 93 of a measured run), and nothing said so.

So each time a ``JobDataset`` starts an iteration under a Lightning ``Trainer`` that trains
(found on the stack: the loops that iterate it; validation and test loaders need no position),
:func:`watch` checks, once per dataset:

* the run resumed mid-epoch from a checkpoint (``fit(ckpt_path=...)``; Lightning counts the
  epoch's batches trained already) and the job's position was not loaded: it warns at once
  (a resume at an epoch's end starts a new epoch of the job, as it should);
* else it joins the trainer's callbacks; Lightning asks its loaders for their states before
  the callbacks' ``on_save_checkpoint``, so a checkpoint saved without asking the dataset for
  its ``state_dict()`` is one without the job's position: it warns then.

The warning names the fix: return ``JobLoader(ds)`` from ``train_dataloader()``. Lightning is
never imported here: only a Lightning already imported can run a trainer (the packages
``lightning.pytorch`` and ``pytorch_lightning`` alike).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Protocol

PACKAGES = ("lightning.pytorch", "pytorch_lightning")
_CALLBACKS: dict[str, type] = {}  # per package: the callback class, made on first use


class Positioned(Protocol):
    """What this module reads of a ``JobDataset``."""

    job: str
    position_requests: int  # state_dict() calls so far
    position_loaded: bool  # load_state_dict() was called
    position_warned: bool  # this module warned about it


def watch(dataset: Positioned) -> None:
    """Called as ``dataset`` starts an iteration: under a Lightning trainer that trains, warn
    if its position is not in the checkpoints (see the module)."""
    if dataset.position_warned:
        return
    found = _trainer()
    if found is None:
        return
    package, trainer = found
    if not getattr(trainer, "training", False):  # validation, sanity check, test, predict
        return
    resumed, done = getattr(trainer, "ckpt_path", None), _batches_done(trainer)
    if resumed is not None and done and not dataset.position_loaded:
        _warn(
            dataset,
            f"Lightning resumed from {resumed} after batch {done} of epoch "
            f"{trainer.current_epoch}, but the checkpoint holds no position of job "
            f"{dataset.job!r}: the job starts a new epoch there, so rows of that epoch are "
            "trained twice and others never.",
        )
        return
    callbacks: list[Any] = trainer.callbacks
    if not any(getattr(c, "dataset", None) is dataset for c in callbacks):
        callbacks.append(_callback_class(package)(dataset))


def _batches_done(trainer: Any) -> int:
    """The batches of the current epoch trained before this iteration started: more than 0
    only when a run resumed mid-epoch (a new epoch starts at 0)."""
    try:
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
    except (AttributeError, TypeError, ValueError):  # another Lightning: assume mid-epoch
        return int(bool(getattr(trainer.fit_loop, "restarting", True)))


def _warn(dataset: Positioned, what: str) -> None:
    dataset.position_warned = True
    warnings.warn(
        f"{what} Its train loader is a plain DataLoader, which has no state_dict(): "
        "return JobLoader(ds) from train_dataloader() (from tabloader.torch import "
        "JobLoader; a DataLoader(ds, batch_size=None) whose state_dict() Lightning saves), "
        "and a resume continues the epoch, each row once.",
        UserWarning,
        stacklevel=3,
    )


def _trainer() -> tuple[str, Any] | None:
    """The Lightning package and ``Trainer`` whose loops are on the stack, or None."""
    trainers = {p: sys.modules[p].Trainer for p in PACKAGES if p in sys.modules}
    if not trainers:
        return None
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and type(owner).__module__.startswith(PACKAGES):
            for package, cls in trainers.items():
                for candidate in (owner, getattr(owner, "trainer", None)):
                    if isinstance(candidate, cls):
                        return package, candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _callback_class(package: str) -> type:
    """The callback that warns at a checkpoint saved without the job's position, as a
    ``Callback`` of ``package``."""
    made = _CALLBACKS.get(package)
    if made is not None:
        return made
    base: type = sys.modules[package].Callback

    class UnsavedJobPosition(base):  # type: ignore[misc]
        """Warns once when a checkpoint is saved without the dataset's ``state_dict()``."""

        def __init__(self, dataset: Positioned) -> None:
            self.dataset = dataset
            self.requests = dataset.position_requests

        @property
        def state_key(self) -> str:
            return f"tabloader.UnsavedJobPosition[{self.dataset.job}:{id(self.dataset)}]"

        def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: Any) -> None:
            dataset = self.dataset
            if dataset.position_requests == self.requests and not dataset.position_warned:
                _warn(
                    dataset,
                    f"Lightning saved a checkpoint without the position of job "
                    f"{dataset.job!r}: a resume from it starts the job's epoch anew, and if "
                    "it was taken mid-epoch, rows of that epoch are trained twice and others "
                    "never.",
                )
            self.requests = dataset.position_requests

    _CALLBACKS[package] = UnsavedJobPosition
    return UnsavedJobPosition
