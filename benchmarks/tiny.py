"""Small rows, per-row cost: ``bench throughput``'s tiny-JPEG scenario (issue 35, item 4).

CIFAR-size hyper-parameter searches are the commonest case of several jobs on one dataset,
and with rows this small the engine's cost per row (not the decode) decides its speed. On the
tiny-JPEG dataset (:mod:`benchmarks.tinydata`: ``--tiny-rows`` JPEGs of 24x24 pixels,
read at ``image_size = 16``, batch ``--tiny-batch``), side by side in one run, competitors
alternating over ``--rounds`` rounds (each one's best round kept):

* ``dataloader(2)``: ``torch.utils.data.DataLoader(num_workers=2, shuffle=True)`` over a
  map-style dataset as its users write it, in three variants: the rows read from the catalog's
  Arrow IPC files (``DatasetReader.take`` of one row, a memory map) and decoded with Pillow
  (``draft`` + a bilinear resize) or with simplejpeg (+ Pillow's resize), and the same JPEGs
  read from the image folder and decoded with Pillow. Each reads the first
  ``--tiny-dataloader-rows`` rows of its epoch (its rate is steady long before), timed from
  its first batch (its workers' start-up counts for nobody). The best of the three is the
  reference.
* ``tabloader``, in-process (one ``Loader`` in this process, ``JobDataset``\\ s on threads)
  and through the service (``tabloader serve`` and job processes with ``RemoteLoader``, as
  separate training scripts): one job, and four jobs on the same rows, each one whole epoch,
  timed from the common start to the last job's end (after the loader or service is ready).

The cache is ``--tiny-cache`` of the decoded rows (plus what batches in flight pin), so it
evicts as a cache smaller than the data does. Targets (``TARGETS``): one job >= 3x the best
``DataLoader(2)``'s rows/s; four jobs >= 2.5x one job's rows/s delivered (all jobs' rows over
the wall time), in each mode. The table also shows decodes (the engine's counter) and CPU
milliseconds per delivered row (every process of the competitor: decode processes, service,
job processes, DataLoader workers), and the service's peak RSS.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from benchmarks import format_table, positive_int
from benchmarks._cpu import cpu_line
from benchmarks._procs import (
    ServiceProcess,
    run_jobs,
    rusage,
    tree_cpu_s,
    wait_for_start,
    write_result,
)
from benchmarks._verdict import Verdict, verdict
from benchmarks.tinydata import add_data_arguments, open_reader, prepare_tiny

__all__ = ["TARGETS", "TinyResult", "add_arguments", "cache_bytes", "print_tiny", "run_tiny"]

TARGETS = {"one_vs_dataloader": 3.0, "four_vs_one": 2.5}
SIZE = 16  # image_size the jobs read
DATALOADER_WORKERS = 2
VARIANTS = ("arrow, pillow", "arrow, simplejpeg", "folder, pillow")


class _Run(TypedDict, total=False):
    """One competitor's pass: rows delivered, seconds, CPU seconds of all its processes."""

    rows: int
    seconds: float
    cpu_s: float
    decodes: int
    evictions: int
    service_rss_mib: float
    service_pid: int


class TinyResult(TypedDict):
    """The scenario's result: its sizes, table rows, verdicts and every competitor's runs."""

    cpu: str
    rows: int
    batch_size: int
    cache_rows: int
    dataloader_rows: int
    table: list[dict[str, object]]
    targets: list[Verdict]
    runs: dict[str, list[_Run]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The tiny scenario's options (of ``bench throughput``)."""
    add_data_arguments(parser, "tiny")
    parser.add_argument(
        "--tiny-cache",
        type=float,
        default=0.10,
        help="'tiny': the cache, as a fraction of the rows' decoded bytes",
    )
    parser.add_argument(
        "--tiny-dataloader-rows",
        type=positive_int,
        default=100_000,
        help="'tiny': rows each DataLoader reads of its epoch",
    )


# -- the DataLoaders ---------------------------------------------------------------------------
class _TinyRows:
    """A DataLoader's map-style dataset of the tiny JPEGs: row ``i`` -> (16x16x3 tensor, label).

    ``source`` ``"arrow"`` reads the catalog's IPC files (each worker opens its own reader),
    ``"folder"`` the JPEG files; ``decode`` is ``"pillow"`` or ``"simplejpeg"``.
    """

    def __init__(self, root: str, folder: str, rows: int, source: str, decode: str) -> None:
        self.root, self.rows, self.source, self.decode = root, rows, source, decode
        self.files: list[str] = []
        self.labels: list[int] = []
        if source == "folder":
            classes = sorted(p.name for p in Path(folder).iterdir() if p.is_dir())
            for k, name in enumerate(classes):
                files = sorted(str(f) for f in (Path(folder) / name).iterdir())
                self.files += files
                self.labels += [k] * len(files)
        self._reader: Any = None

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        if self.source == "folder":
            with open(self.files[i], "rb") as f:
                data: Any = f.read()
            label = self.labels[i]
        else:
            if self._reader is None:
                self._reader = open_reader(self.root)
            table = self._reader.take([i], ["image", "label"])
            data = table.column("image")[0].as_buffer()
            label = table.column("label")[0].as_py()
        return torch.from_numpy(_decode(data, self.decode)), label


def _decode(data: Any, how: str) -> Any:
    """A tuned user's decode of one tiny JPEG to ``SIZE`` x ``SIZE`` x 3."""
    from PIL import Image

    if how == "simplejpeg":
        import simplejpeg

        arr = simplejpeg.decode_jpeg(memoryview(data).cast("B"), colorspace="RGB")
        img = Image.fromarray(arr)
    else:
        with Image.open(io.BytesIO(data)) as src:
            src.draft("RGB", (SIZE, SIZE))  # a DCT-domain downscale where one fits
            img = src.convert("RGB")
    img = img.resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    return np.asarray(img).copy()


def _dataloader(data: Any, variant: str, rows: int, batch_size: int) -> _Run:
    import torch
    from torch.utils.data import DataLoader

    source, decode = variant.split(", ")
    dataset = _TinyRows(str(data.root), str(data.folder), data.rows, source, decode)
    loader: Any = DataLoader(
        dataset,  # type: ignore[arg-type]
        batch_size=batch_size,
        shuffle=True,
        num_workers=DATALOADER_WORKERS,
        generator=torch.Generator().manual_seed(0),
    )
    it = iter(loader)
    next(it)  # its workers are up: timed from here
    cpu0, t0, got = tree_cpu_s(os.getpid()), time.perf_counter(), 0
    for _, labels in it:
        got += len(labels)
        if got >= rows:
            break
    seconds = time.perf_counter() - t0
    cpu = tree_cpu_s(os.getpid()) - cpu0  # while its workers live
    del it
    return {"rows": got, "seconds": seconds, "cpu_s": cpu, "decodes": got}


# -- tabloader -------------------------------------------------------------------------------
def _in_process(data: Any, jobs: list[str], cache_bytes: int, workers: int, batch: int) -> _Run:
    """``jobs`` on threads of one ``Loader`` in this process, each one epoch of JobDataset."""
    from tabloader.engine import Loader
    from tabloader.torch import JobDataset

    ends: dict[str, float] = {}
    counts: dict[str, int] = {}
    errors: list[BaseException] = []
    with Loader(data.root, cache_bytes=cache_bytes, workers=workers) as loader:
        loader.wait_ready()

        def one(job: str) -> None:
            try:
                ds = JobDataset(job, loader=loader, batch_size=batch, epochs=1, image_size=SIZE)
                counts[job] = sum(len(b["_id"]) for b in ds)
                ends[job] = time.perf_counter()
                ds.close()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(j,)) for j in jobs]
        cpu0, t0 = tree_cpu_s(os.getpid()), time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        cpu = tree_cpu_s(os.getpid()) - cpu0  # while the decode processes live
        stats = loader.stats()
    return {
        "rows": sum(counts.values()),
        "seconds": max(ends.values()) - t0,
        "cpu_s": cpu,
        "decodes": stats["decodes"],
        "evictions": stats["cache"].evictions,
    }


def _service(data: Any, jobs: list[str], cache_bytes: int, workers: int, batch: int) -> _Run:
    """``jobs`` as separate processes through one ``tabloader serve``, each one epoch."""
    specs = [
        {"role": "job", "catalog": str(data.root), "job": j, "batch_size": batch} for j in jobs
    ]
    with ServiceProcess(
        data.root, cache_bytes=cache_bytes, workers=workers, log=data.root / "bench.log"
    ) as service:
        cpu0 = service.usage()[0]
        out = run_jobs("benchmarks.tiny", specs)
        stats = service.stats()
        cpu, rss = service.usage()
    results = out["results"]
    return {
        "rows": sum(r["rows"] for r in results),
        "seconds": out["wall_s"],
        "cpu_s": cpu - cpu0 + sum(r["cpu_s"] for r in results),
        "decodes": stats["decodes"],
        "evictions": stats["cache"]["evictions"],
        "service_rss_mib": rss,
        "service_pid": service.proc.pid,
    }


def _job_child(spec: dict[str, Any]) -> None:
    """One job process: its epoch through the service, as tensors (``to_tensors``)."""
    from tabloader.service import RemoteLoader
    from tabloader.torch import to_tensors

    remote = RemoteLoader(spec["catalog"], start=False)
    cpu0 = rusage()[0]
    wait_for_start(spec)
    rows = 0
    with remote.open(spec["job"], batch_size=spec["batch_size"], epochs=1, image_size=SIZE) as s:
        for batch in s:
            rows += len(to_tensors(batch)["_id"])
    end = time.time()
    remote.close()
    write_result(spec, {"rows": rows, "end": end, "cpu_s": rusage()[0] - cpu0})


# -- the scenario ----------------------------------------------------------------------------
def cache_bytes(shared_rows: int, jobs: int, workers: int, batch: int, *, service: bool) -> int:
    """The cache of a competitor: ``shared_rows`` decoded rows plus what its ``jobs`` pin (each
    ``prefetch`` batches as the engine sizes them, and half again for rows decoded ahead; a
    service's client also holds two), as ``bench e2e`` sizes its caches; 1 MiB at least."""
    from tabloader.engine import default_prefetch

    prefetch = default_prefetch(workers, batch, batch * SIZE * SIZE * 3)
    pinned = jobs * (prefetch + 2 if service else prefetch) * batch * 3 // 2
    return max(1 << 20, (shared_rows + pinned) * SIZE * SIZE * 3)


def _register(root: Path, jobs: list[str]) -> None:
    from tabloader import catalog

    with catalog.open_catalog(root) as cat:
        for j in jobs:
            cat.sql(f"REGISTER OR REPLACE JOB {j} SELECT image, label FROM imgs")


def run_tiny(args: argparse.Namespace) -> TinyResult:
    """Run the scenario (``args``: throughput's, with :func:`add_arguments`'); its results."""
    data = prepare_tiny(args.tiny_data, args.tiny_rows)
    jobs = [f"t{i}" for i in range(4)]
    _register(data.root, jobs)
    batch = args.tiny_batch
    shared = max(1, int(args.tiny_cache * data.rows))
    cache = {
        (mode, n): cache_bytes(shared, n, args.workers, batch, service=mode == "service")
        for mode in ("in-process", "service")
        for n in (1, 4)
    }
    dl_rows = min(args.tiny_dataloader_rows, data.rows - batch)
    competitors: dict[tuple[str, str], Callable[[], _Run]] = {
        ("dataloader(2)", v): partial(_dataloader, data, v, dl_rows, batch) for v in VARIANTS
    }
    for mode, fn in (("in-process", _in_process), ("service", _service)):
        for n in (1, 4):
            competitors[(mode, f"{n} job{'s' if n > 1 else ''}")] = partial(
                fn, data, jobs[:n], cache[mode, n], args.workers, batch
            )
    names = list(competitors)
    runs: dict[tuple[str, str], list[_Run]] = {k: [] for k in names}
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:  # each first in turn: the machine's drift hits all
            runs[name].append(competitors[name]())
    best = {name: max(rs, key=lambda x: x["rows"] / x["seconds"]) for name, rs in runs.items()}
    rate = {name: b["rows"] / b["seconds"] for name, b in best.items()}
    reference = max(rate[("dataloader(2)", v)] for v in VARIANTS)
    rows = []
    for (mode, what), b in best.items():
        rows.append(
            {
                "mode": mode,
                "competitor": what,
                "rows/s": round(rate[mode, what]),
                "vs dataloader(2)": round(rate[mode, what] / reference, 2),
                "decodes": b["decodes"],
                "evictions": b.get("evictions", ""),
                "cpu ms/row": round(1e3 * b["cpu_s"] / max(1, b["rows"]), 4),
                "service rss MiB": round(b["service_rss_mib"]) if "service_rss_mib" in b else "",
            }
        )
    verdicts = []
    for mode in ("in-process", "service"):
        one, four = rate[mode, "1 job"], rate[mode, "4 jobs"]
        for check, value, limit in (
            (f"{mode}: 1 job / best dataloader(2)", one / reference, TARGETS["one_vs_dataloader"]),
            (f"{mode}: 4 jobs / 1 job (rows/s delivered)", four / one, TARGETS["four_vs_one"]),
        ):
            verdicts.append(verdict(check, value, limit))
    return {
        "cpu": cpu_line(),
        "rows": data.rows,
        "batch_size": batch,
        "cache_rows": shared,
        "dataloader_rows": dl_rows,
        "table": rows,
        "targets": verdicts,
        "runs": {f"{m} / {w}": rs for (m, w), rs in runs.items()},
    }


def print_tiny(result: TinyResult) -> None:
    """The scenario's table and targets."""
    print(
        f"\ntiny JPEGs: {result['rows']} rows of 24x24 read at {SIZE}x{SIZE}, batch "
        f"{result['batch_size']}, cache {result['cache_rows']} rows (+ what batches pin); "
        f"DataLoaders read {result['dataloader_rows']} rows of their epoch"
    )
    print(result["cpu"])
    print(format_table(result["table"]))


if __name__ == "__main__":  # a job process of the service mode (``run_jobs``)
    _job_child(json.loads(sys.argv[2]))
