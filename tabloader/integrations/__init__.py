"""Training frameworks that need a few lines of glue around a ``JobDataset``.

* :mod:`tabloader.integrations.accelerate`: ``prepare(accelerator, dataset)``, the loader of
  one process of an accelerate run (instead of ``accelerator.prepare(DataLoader(...))``, which
  would read every batch on process 0 or split each rank's share again).
* :mod:`tabloader.integrations.transformers`: ``JobTrainer``, the Hugging Face ``Trainer``
  with a ``JobDataset`` as ``train_dataset`` or ``eval_dataset``, resumed exactly once.

Plain PyTorch, torchrun, Lightning and Ray Train need none: return
``tabloader.torch.JobLoader(ds)`` from Lightning's ``train_dataloader()``; docs/frameworks.md
has a recipe for each.
"""

from __future__ import annotations

__all__: list[str] = []  # each framework is its own module: importing one imports that framework
