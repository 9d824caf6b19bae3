"""The child processes of ``bench e2e`` (and the DataLoaders' dataset of ``bench train`` and
``bench cluster``): what runs in each process that :mod:`benchmarks.e2e` starts.

The runner starts them as ``python -m benchmarks.e2e --child JSON`` (through
:func:`benchmarks._procs.run_jobs`, or for the in-process mode one at a time), and
:func:`run_child` picks the role from the JSON:

* ``threads``: the in-process mode, one ``Loader`` and the jobs on threads; prints its result;
* ``job``: one job through the service or with its own ``DataLoader`` over :class:`MapDataset`;
* ``overhead``: times request -> tensors ready for batches the service has prepared.

Stall accounting: a tabloader job reports the seconds its stream counted (``stats()``:
``wait_s`` blocked waiting for a batch, ``compute_s`` between batches); a DataLoader job
counts the same around its ``next()`` (:mod:`benchmarks.stalls`).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

import numpy as np

from benchmarks._procs import (
    halfway_reached,
    mark_halfway,
    rusage,
    tree_cpu_s,
    wait_for_start,
    write_result,
)
from benchmarks.stalls import StallClock, Stalls, dataset_seconds, stalls_of

if TYPE_CHECKING:
    from collections.abc import Callable

    from benchmarks.e2e_records import JobResult, JobRun, Run, Spec
    from benchmarks.e2e_scenarios import JobOptions, ScenarioJob

__all__ = [
    "MapDataset",
    "RecipeDataset",
    "open_reader",
    "open_size",
    "run_child",
    "torchvision_recipe",
    "wait_open",
]

T = TypeVar("T")

WAIT_OPEN_S = 120.0  # the longest a job waits for the jobs it opens after


class MapDataset:
    """The DataLoaders' map-style dataset: same IPC files, same decode and resize as tabloader."""

    def __init__(self, root: str, dataset: str, ids: list[int], size: int) -> None:
        self.root, self.dataset, self.ids, self.size = root, dataset, ids, size
        self._reader: Any = None

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[Any, int, int]:
        if self._reader is None:  # opened in each worker process: files only, no DuckDB
            self._reader = open_reader(self.root, self.dataset)
        row = self.ids[i]
        table = self._reader.take([row], ["image", "label"])
        image = self.prepare(table.column("image")[0].as_buffer(), row)
        return image, table.column("label")[0].as_py(), row

    def prepare(self, data: Any, row: int) -> Any:
        """The image of ``row`` from its encoded bytes ``data``: as tabloader prepares it."""
        from tabloader.engine.decode import decode_image

        return np.array(decode_image(data, size=self.size))


class RecipeDataset(MapDataset):
    """The ``recipe`` scenarios' DataLoaders, for a job registered with ``options``: each
    sample decoded with Pillow as a tuned user does (``draft`` to the DCT scale that still covers
    the size), then the job's training recipe (``augment``, drawn with its ``seed``) with
    torchvision's ``transforms.v2`` where it is installed, else with Pillow: the crop drawn by
    torchvision's algorithm (:meth:`tabloader.engine._prepare.augment.Augmenter.draw`, on the
    decoded size), ``resize`` of its box, ``transpose`` to flip. An evaluation job (``image_size``)
    is ``bench throughput``'s Pillow decode (draft, resize, center crop). ``transforms`` says which
    was used.
    """

    def __init__(self, root: str, dataset: str, ids: list[int], options: JobOptions) -> None:
        from tabloader.engine import Augmenter

        self.augment = None
        if "augment" in options:
            self.augment = Augmenter(options["augment"], options.get("seed", 0))
        size = options["image_size"] if self.augment is None else self.augment.spec.need
        super().__init__(root, dataset, ids, size)
        self._tv = None if self.augment is None else torchvision_recipe(size)
        self.transforms = (
            "pillow draft, resize, center crop"
            if self.augment is None
            else "pillow draft decode, torchvision.transforms.v2"
            if self._tv is not None
            else "pillow draft decode, Augmenter.draw crop, pillow resize(box) + transpose "
            "(torchvision not installed)"
        )

    def prepare(self, data: Any, row: int) -> Any:
        import io

        import torch
        from PIL import Image

        from benchmarks.throughput import decode

        if self.augment is None:
            return decode(data, self.size, "pillow")
        img: Any
        with Image.open(io.BytesIO(data)) as img:
            img.draft("RGB", (self.size, self.size))
            img = img.convert("RGB")
        if self._tv is not None:
            img = self._tv(img)
        else:
            (top, left, h, w), flip = self.augment.draw((img.height, img.width), 0, row)
            box = (left, top, left + w, top + h)
            img = img.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)
            if flip:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(img).copy())


def torchvision_recipe(size: int) -> Any:
    """``RandomResizedCrop(size)`` + ``RandomHorizontalFlip()`` of torchvision's
    ``transforms.v2``, or None where torchvision is not installed (or does not import)."""
    try:
        from torchvision.transforms import v2
    except Exception:  # missing, or built for another torch
        return None
    return v2.Compose([v2.RandomResizedCrop(size), v2.RandomHorizontalFlip()])


class _OpenSize(TypedDict, total=False):
    image_size: int


def open_size(spec: Spec, job: ScenarioJob) -> _OpenSize:
    """The ``image_size`` a job is opened with: the run's, unless the job was registered
    with ``options`` (a recipe's ``augment``, or its own ``image_size``): then the catalog's."""
    return {} if job.get("options") else {"image_size": spec["image_size"]}


def wait_open(job: ScenarioJob, open_jobs: Callable[[], set[str]]) -> None:
    """Wait until the jobs ``job`` opens ``after`` are open (``open_jobs()`` names those
    open; see :mod:`benchmarks.e2e_scenarios`)."""
    deadline = time.monotonic() + WAIT_OPEN_S
    while not set(job.get("after", ())) <= open_jobs():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{job['name']}: {job['after']} did not open in {WAIT_OPEN_S} s")
        time.sleep(0.005)


def open_reader(root: str, dataset: str) -> Any:
    """The dataset's storage reader from ``reader.json`` (files only, no DuckDB connection)."""
    spec = json.loads(Path(root, "reader.json").read_text())
    import pyarrow as pa

    from tabloader.catalog.storage import DatasetReader, PartInfo

    schema = pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(spec["schema"])))
    return DatasetReader(Path(root), [PartInfo(**p) for p in spec["parts"]], schema)


def _threads_child(spec: Spec) -> Run:
    """The in-process mode: one ``Loader``, the jobs on threads of this process."""
    from tabloader import catalog
    from tabloader.engine import Loader

    cat = catalog.open_catalog(spec["catalog"], create=True)
    jobs = spec["jobs"]
    sizes = {j["name"]: len(cat.job(j["name"]).ids) for j in jobs}
    progress = {j["name"]: 0 for j in jobs}
    halfway = threading.Event()
    first = jobs[0]["name"]
    results: dict[str, JobRun] = {}
    errors: list[BaseException] = []
    eng = Loader(
        cat,
        cache_bytes=spec["cache_bytes"],
        workers=spec["workers"],
        sampler="independent" if spec["competitor"] == "independent" else "dependent",
        access_log=spec.get("access_log"),
    )
    eng.wait_ready()  # ready first, as the service is before its clients start
    # the decode processes are the forkserver's children, not ours: /proc sees them
    cpu0 = tree_cpu_s(os.getpid())
    t0 = time.perf_counter()

    def run_job(job: ScenarioJob) -> None:
        try:
            if job["late"]:
                halfway.wait()
            wait_open(job, lambda: set(eng.stats()["jobs"]))
            started = time.perf_counter()
            stream = eng.open(
                job["name"], batch_size=spec["batch_size"], epochs=1, **open_size(spec, job)
            )
            for batch in stream:
                time.sleep(job["step"])
                progress[job["name"]] += len(batch["_id"])
                if job["name"] == first and progress[first] >= sizes[first] // 2:
                    halfway.set()
            results[job["name"]] = {
                "rows": progress[job["name"]],
                "seconds": time.perf_counter() - started,
                **stalls_of(stream.stats()),
            }
            stream.close()
        except BaseException as exc:
            errors.append(exc)
            halfway.set()

    threads = [threading.Thread(target=run_job, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    stats = eng.stats()
    cache = {"entries": stats["cache"].entries, "size_bytes": stats["cache"].size_bytes}
    cpu = tree_cpu_s(os.getpid())  # while the decode processes live
    eng.close()
    cat.close()
    rss = rusage()[1]
    return {
        "wall_s": wall,
        "cpu_s": cpu - cpu0,
        "peak_rss_mib": rss,
        "decodes": stats["decodes"],
        "reads": stats["reads"],
        "jobs": results,
        "dataset_s": dataset_seconds(stats),
        "cache": cache,
    }


def _job_child(spec: Spec) -> None:
    """One job in its own process: through the service, or with its own DataLoader."""
    job = spec["job"]
    transforms: str | None = None  # a DataLoader's recipe
    if spec["kind"] == "service":
        from tabloader.service import RemoteLoader
        from tabloader.torch import to_tensors

        remote = RemoteLoader(spec["catalog"], start=False)
        stalls: Stalls = {"wait_s": 0.0, "compute_s": 0.0}

        def batches() -> Any:
            wait_open(job, lambda: {j["job"] for j in remote.stats()["jobs"].values()})
            stream = remote.open(
                job["name"], batch_size=spec["batch_size"], epochs=1, **open_size(spec, job)
            )
            with stream:
                for batch in stream:
                    yield to_tensors(batch)
                stalls.update(stalls_of(stream.stats()))  # as the service counted them

        rows_of: Any = lambda b: len(b["_id"])  # noqa: E731
        stalls_now: Any = lambda: stalls  # noqa: E731
    else:
        import torch
        from torch.utils.data import DataLoader

        ids = np.load(spec["ids_file"]).tolist()
        data = (
            RecipeDataset(spec["catalog"], "imgs", ids, job["options"])
            if job.get("options")
            else MapDataset(spec["catalog"], "imgs", ids, spec["image_size"])
        )
        if isinstance(data, RecipeDataset):
            transforms = data.transforms
        loader: DataLoader[Any] = DataLoader(
            data,  # type: ignore[arg-type]
            batch_size=spec["batch_size"],
            shuffle=True,
            num_workers=spec["workers"],
            generator=torch.Generator().manual_seed(spec["index"]),
        )
        clock = StallClock()
        batches = lambda: clock.timed(loader)  # noqa: E731
        rows_of = lambda b: len(b[2])  # noqa: E731
        stalls_now = clock.stats
    cpu0 = rusage()[0]  # after the imports (torch: a second or more), as the service's
    wait_for_start(spec)
    if job["late"]:
        while not halfway_reached(spec):
            time.sleep(0.005)
    started = time.time()
    rows = 0
    for batch in batches():
        time.sleep(job["step"])
        rows += rows_of(batch)
        if spec["index"] == 0 and rows >= spec["rows_total"] // 2:
            mark_halfway(spec)
    end = time.time()
    cpu, rss = rusage()
    stalls_then = stalls_of(stalls_now())
    result: JobResult = {
        "name": job["name"],
        "start": started,
        "end": end,
        "rows": rows,
        "seconds": end - started,
        "cpu_s": cpu - cpu0,
        "peak_rss_mib": rss,
        "wait_s": stalls_then["wait_s"],
        "compute_s": stalls_then["compute_s"],
    }
    if spec["kind"] == "service":
        result["copies"] = vars(remote.copies)
        remote.close()
    elif transforms is not None:
        result["transforms"] = transforms
    write_result(spec, result)


def _overhead_child(spec: Spec) -> None:
    """Time request -> tensors ready for batches the service has prepared (see
    :mod:`benchmarks.e2e`)."""
    from tabloader.service import RemoteLoader
    from tabloader.torch import to_tensors

    remote = RemoteLoader(spec["catalog"], start=False)
    size, batch_size = spec["size"], spec["batch_size"]
    stream = remote.open("overhead", batch_size=batch_size, image_size=size)
    wait_for_start(spec)
    for _ in range(-(-spec["rows"] // batch_size) + 1):  # an epoch: every row decoded once
        stream.take()
    samples: list[float] = []
    for _ in range(spec["samples"]):
        time.sleep(spec["settle"])  # the job's compute: the batch read ahead gets ready
        t0 = time.perf_counter()
        tensors = to_tensors(stream.take())  # type: ignore[arg-type]
        samples.append(time.perf_counter() - t0)
    shape = tuple(tensors["image"].shape)
    nbytes = math.prod(shape)
    out = np.empty(shape, np.uint8)
    source = remote.arena[:nbytes].reshape(shape)
    floor = []
    for _ in range(20):
        t0 = time.perf_counter()
        np.copyto(out, source)
        floor.append(time.perf_counter() - t0)
    stream.close()
    remote.close()
    us = np.array(samples or [math.nan]) * 1e6
    write_result(
        spec,
        {
            "end": time.time(),
            "shape": list(shape),
            "samples": len(samples),
            "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean()),
            "copy_floor_us": float(np.median(floor) * 1e6),
        },
    )


def run_child(spec: Spec) -> int:
    """Run the child process that ``spec["role"]`` names (``--child JSON``); its exit status."""
    if spec["role"] == "threads":
        print(json.dumps(_threads_child(spec)))
    elif spec["role"] == "job":
        _job_child(spec)
    else:
        _overhead_child(spec)
    return 0
