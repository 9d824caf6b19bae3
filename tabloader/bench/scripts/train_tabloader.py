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
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402, F401  (a training script imports it first)
from torch.utils.data import DataLoader  # noqa: E402

from tabloader.torch import JobDataset  # noqa: E402

IMPORTED = time.time()


def main() -> int:
    spec = json.loads(sys.argv[1])
    cpu_imported = time.process_time()
    building = time.time()
    data = JobDataset(spec["job"], catalog=spec["catalog"])
    built = time.time()
    rows, first, first_rows, wait_s = 0, None, 0, 0.0
    it = iter(DataLoader(data, batch_size=None))
    while True:
        t0 = time.time()
        try:
            batch = next(it)
        except StopIteration:
            break
        now = time.time()
        wait_s += now - t0
        if first is None:
            first, first_rows = now, len(batch["_id"])
        rows += len(batch["_id"])
        if spec["step"]:
            time.sleep(spec["step"])
    end = time.time()
    stats = data.stats()
    data.close()
    me = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "start": START,
        "imported": IMPORTED,
        "building": building,
        "built": built,
        "first": first,
        "first_rows": first_rows,
        "end": end,
        "rows": rows,
        "wait_s": wait_s,
        "cpu_s": me.ru_utime + me.ru_stime,
        "cpu_imports_s": cpu_imported,
        "stages_s": {"copy": float(stats.get("copy_s", 0.0))},
        "service_pid": data.loader.service_pid if hasattr(data.loader, "service_pid") else None,
    }
    tmp = spec["out"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, spec["out"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
