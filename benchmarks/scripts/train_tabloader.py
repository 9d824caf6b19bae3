"""A training script as a tabloader user writes it: the README's ``train.py``.

``bench e2e`` and ``bench throughput`` run it as a shell does, ``python train_tabloader.py
SPEC`` (a fresh interpreter), beside ``train_dataloader.py``. ``SPEC`` is JSON: ``catalog``,
``job`` (registered with its recipe: ``augment`` or ``image_size``), ``step`` (seconds slept
per batch: a simulated training step; 0 for none), ``out`` (where the result JSON goes).

``JobDataset(job, catalog=DIR)`` connects to the catalog's loader service, or starts it in the
background (cold: its cache empty) when none runs, as a user's first script does.
"""

from __future__ import annotations

import time

START = time.time()  # before the imports: they are part of what a user waits for

import json  # noqa: E402
import sys  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import torch  # noqa: E402, F401  (a training script imports it first)
from torch.utils.data import DataLoader  # noqa: E402

from tabloader.torch import JobDataset  # noqa: E402

if TYPE_CHECKING:  # mypy names this file benchmarks.scripts.<name>
    from benchmarks.scripts._loop import drain, report
else:  # run as a file, its folder is sys.path[0]: the sibling, loading nothing of tabloader
    from _loop import drain, report

IMPORTED = time.time()


def main() -> int:
    spec = json.loads(sys.argv[1])
    cpu_imported = time.process_time()
    building = time.time()
    data = JobDataset(spec["job"], catalog=spec["catalog"])
    built = time.time()
    loop = drain(DataLoader(data, batch_size=None), lambda batch: len(batch["_id"]), spec["step"])
    stats = data.stats()
    data.close()
    report(
        spec["out"],
        (START, IMPORTED, building, built, cpu_imported),
        loop,
        stages_s={"copy": float(stats.get("copy_s", 0.0))},
        service_pid=data.loader.service_pid if hasattr(data.loader, "service_pid") else None,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
