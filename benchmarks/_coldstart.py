"""``bench throughput``'s cold start: seconds from making the dataset to its first batch.

Three competitors, each in a fresh process that has imported torch and tabloader already (a
training script has), side by side in each round on the same images (224 x 224, batch 64):

* **cold**: ``JobDataset(job, catalog=DIR)`` on a fresh copy of the catalog, no service running:
  it starts the service in the background (``tabloader serve``, its decode processes) and
  waits for it;
* **warm**: the same beside the service the cold one left running (connect, open, decode);
* **dataloader**: ``DataLoader(num_workers=N, shuffle=True)`` over the same files with the same
  decode (its worker processes start).

The target is the cold start's seconds (the machine is shared: the ratios to the warm start
and the DataLoader of the same round say how much of a slow run was the machine).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from benchmarks import format_table
from benchmarks._procs import run_jobs, wait_for_start, write_result
from benchmarks._verdict import Verdict, verdict

__all__ = ["TARGET_COLD_S", "ColdStart", "cold_start", "report"]

TARGET_COLD_S = 1.5
JOB = "first"
READER = "reader.pickle"
STOP_TIMEOUT_S = 60.0


class _Spec(TypedDict):
    """A competitor's process: the catalog, its DataLoader's workers and its ``role``
    (``dataloader`` or ``job``); ``run_jobs`` adds ``sync`` and ``index``."""

    catalog: str
    workers: int
    role: NotRequired[str]


class _Result(TypedDict):
    """A competitor's seconds to its first batch (a job's: the service it started)."""

    first_s: float
    end: float
    service_pid: NotRequired[int | None]


class ColdStart(TypedDict):
    """Each competitor's seconds to its first batch, per round and the best round."""

    workers: int
    runs: dict[str, list[float]]
    best: dict[str, float]
    services: list[int]


def cold_start(folder: Path, tmp: Path, workers: int, rounds: int) -> ColdStart:
    """Each competitor's time to first batch per round (``folder``: an image folder)."""
    from tabloader import catalog

    base = tmp / "cold-base"
    with catalog.open_catalog(base, create=True) as cat:
        cat.import_imagefolder("imgs", folder)
        cat.sql(
            f"REGISTER JOB {JOB} SELECT image, label FROM imgs "
            "WITH (image_size = 224, batch_size = 64)"
        )
        _, parts, schema, verify = cat.dataset("imgs").reader.spec()
    # the DataLoader's reader: the files, no DuckDB (under each round's copy of the catalog)
    (base / READER).write_bytes(pickle.dumps((parts, schema, verify)))
    runs: dict[str, list[float]] = {"cold": [], "warm": [], "dataloader": []}
    services: list[int] = []  # the started services' pids (each stopped after its round)
    for r in range(rounds):
        root = tmp / f"cold-{r}"  # a fresh catalog: no service has run for it
        shutil.copytree(base, root)
        child: _Spec = {"catalog": str(root), "workers": workers}
        runs["dataloader"].append(_first(child, "dataloader")["first_s"])
        cold = _first(child, "job")
        pid = cold.get("service_pid")
        assert pid is not None, "the cold job started no service"
        services.append(pid)
        try:
            runs["cold"].append(cold["first_s"])
            runs["warm"].append(_first(child, "job")["first_s"])
        finally:
            _stop(pid)
        shutil.rmtree(root, ignore_errors=True)
    best = {k: min(v) for k, v in runs.items()}
    return {"workers": workers, "runs": runs, "best": best, "services": services}


def report(result: ColdStart) -> Verdict:
    """Print the rounds' table; the target's verdict row."""
    best = result["best"]
    print(f"\ntime to first batch (s; best of {len(result['runs']['cold'])} rounds)")
    print(
        format_table(
            [
                {
                    "competitor": name,
                    "rounds": " ".join(f"{s:.3f}" for s in result["runs"][name]),
                    "best": f"{best[name]:.3f}",
                    "cold / this": f"{best['cold'] / best[name]:.2f}" if best[name] else "",
                }
                for name in ("cold", "warm", "dataloader")
            ]
        )
    )
    return verdict("cold start (s)", best["cold"], TARGET_COLD_S, at_most=True)


def _first(child: _Spec, role: str) -> _Result:
    result: _Result = run_jobs(__name__, [{**child, "role": role}], timeout=600)["results"][0]
    return result


def _stop(pid: int) -> None:
    """Stop the service the cold child started (not our child: polled, not waited for)."""
    from benchmarks._procs import process_alive

    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while process_alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.05)


# -- in the child processes ----------------------------------------------------------------------
class _Images:
    """The DataLoader's map-style dataset: the job's files (read in each worker process, no
    DuckDB) and its decode (``image_size`` 224)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.parts, self.schema, self.verify = pickle.loads((root / READER).read_bytes())
        self._reader: Any = None

    def __len__(self) -> int:
        return sum(int(p.num_rows) for p in self.parts)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import numpy as np

        from tabloader.catalog.storage import DatasetReader
        from tabloader.engine.decode import decode_image

        if self._reader is None:
            spec = (str(self.root), self.parts, self.schema, self.verify)
            self._reader = DatasetReader.from_spec(spec, memory_map=True)
        value = self._reader.take([i], ["image"]).column("image")[0].as_buffer()
        return np.array(decode_image(value, size=224)), i


def _child(spec: _Spec) -> None:
    """Time one competitor's first batch from the common start (imports done before it)."""
    from torch.utils.data import DataLoader

    from tabloader.torch import JobDataset

    if spec["role"] == "dataloader":
        import torch

        data = _Images(Path(spec["catalog"]))
        wait_for_start(spec)
        t = time.perf_counter()
        loader: Any = DataLoader(
            data,  # type: ignore[arg-type]
            batch_size=64,
            shuffle=True,
            num_workers=spec["workers"],
            generator=torch.Generator().manual_seed(0),
        )
        batch = next(iter(loader))
        first_s = time.perf_counter() - t
        assert len(batch[0]) == 64
        write_result(spec, {"first_s": first_s, "end": time.time()})
        return
    wait_for_start(spec)
    t = time.perf_counter()
    ds = JobDataset(JOB, catalog=spec["catalog"])
    batch = next(iter(ds))
    first_s = time.perf_counter() - t
    assert len(batch["_id"]) == 64
    pid = getattr(ds.loader, "service_pid", None)
    ds.close()
    write_result(spec, {"first_s": first_s, "service_pid": pid, "end": time.time()})


if __name__ == "__main__":
    if sys.argv[1:2] != ["--child"]:
        raise SystemExit("usage: python -m benchmarks._coldstart --child JSON")
    _child(json.loads(sys.argv[2]))
