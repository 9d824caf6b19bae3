"""End-to-end benchmark: four training jobs at once, tabloader vs four PyTorch DataLoaders.

On a generated JPEG folder (``--images``, about 500x375 each), four jobs consume at once,
each sleeping ``step`` seconds per batch (a simulated training step). Side by side, each run in
its own process (so CPU seconds and peak RSS are its own):

* ``baseline``: four ``torch.utils.data.DataLoader(shuffle=True)`` over a map-style dataset
  that reads the same Arrow IPC storage and decodes with Pillow to the same size; the worker
  budget (``--workers``) is split between them;
* ``tabloader``: one ``Loader`` with the dependent sampler and the RefCnt cache;
* ``independent``: the same ``Loader`` with the independent sampler (ablation).

Scenarios (each job runs one epoch of its subset):

* ``same``: four jobs, same subset, same speed;
* ``overlap``: two pairs on subsets that overlap by 50%;
* ``speeds``: step times 1x, 2x, 4x, 4x, on the first ``--speeds-rows`` rows, with a step
  long enough that the fastest job is bound by its step, not by decoding;
* ``late``: same subset and speed, the fourth job arrives when the first is half-way.

Reported per scenario and competitor: decodes and reads (absolute and / union of the jobs'
sets), wall time to finish all jobs, CPU seconds, peak RSS, and each job's throughput vs the
same job running alone (tabloader, measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tabloader.bench import format_table, peak_rss_mib, write_json

__all__ = ["add_arguments", "run"]

COMPETITORS = ("baseline", "tabloader", "independent")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tabloader bench e2e``."""
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--images", type=int, default=10_000, help="generated JPEGs")
    parser.add_argument("--image-size", type=int, default=96, help="shared resize (pixels)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--step", type=float, default=0.02, help="seconds per batch at 1x")
    parser.add_argument(
        "--speeds-rows",
        type=int,
        default=2500,
        help="rows of the 'speeds' jobs (the 4x jobs take long)",
    )
    parser.add_argument(
        "--speeds-step",
        type=float,
        default=0.12,
        help="seconds per batch of the fastest 'speeds' job (step-bound, so "
        "its throughput alone is not limited by decoding)",
    )
    parser.add_argument("--workers", type=int, default=4, help="total reader/decoder workers")
    parser.add_argument("--cache", type=float, default=0.10, help="cache, fraction of dataset")
    parser.add_argument("--scenarios", default="same,overlap,speeds,late")
    parser.add_argument("--data", default="bench-results/e2e-data", help="image folder cache")
    parser.add_argument("--out", default="bench-results/e2e.json", help="JSON output")
    parser.add_argument("--child", help=argparse.SUPPRESS)


def _scenarios(
    n: int, step: float, speeds_rows: int, speeds_step: float
) -> dict[str, list[dict[str, Any]]]:
    every = "_id >= 0"
    first, second = f"_id < {2 * n // 3}", f"_id >= {n // 3}"
    subset = f"_id < {min(n, speeds_rows)}"
    return {
        "same": [{"name": f"j{i}", "where": every, "step": step, "late": False} for i in range(4)],
        "overlap": [
            {"name": f"j{i}", "where": w, "step": step, "late": False}
            for i, w in enumerate([first, first, second, second])
        ],
        "speeds": [
            {"name": f"j{i}", "where": subset, "step": speeds_step * m, "late": False}
            for i, m in enumerate([1, 2, 4, 4])
        ],
        "late": [{"name": f"j{i}", "where": every, "step": step, "late": i == 3} for i in range(4)],
    }


# -- child processes -------------------------------------------------------------------------
def _rusage() -> tuple[float, float]:
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    cpu = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    # a child's ru_maxrss can include our size when it forked (it survives exec): an upper bound
    return cpu, max(peak_rss_mib(), kids.ru_maxrss / 1024)


class _MapDataset:
    """The baseline's map-style dataset: same IPC files, Pillow decode, same resize."""

    def __init__(self, root: str, dataset: str, ids: list[int], size: int) -> None:
        self.root, self.dataset, self.ids, self.size = root, dataset, ids, size
        self._reader: Any = None

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        from tabloader.prep import decode_image

        if self._reader is None:  # opened in each worker process: files only, no DuckDB
            self._reader = _open_reader(self.root, self.dataset)
        row = self.ids[i]
        table = self._reader.take([row], ["image", "label"])
        image = decode_image(table.column("image")[0].as_buffer(), size=self.size)
        return image, row


def _open_reader(root: str, dataset: str) -> Any:
    spec = json.loads(Path(root, "reader.json").read_text())
    import pyarrow as pa

    from catalog.storage import DatasetReader, PartInfo

    schema = pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(spec["schema"])))
    return DatasetReader(Path(root), [PartInfo(**p) for p in spec["parts"]], schema)


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    import catalog

    cat = catalog.connect(spec["catalog"], create=True)
    jobs = spec["jobs"]
    ids = {j["name"]: cat.job(j["name"]).ids for j in jobs}
    progress = {j["name"]: 0 for j in jobs}
    halfway = threading.Event()
    first = jobs[0]["name"]
    results: dict[str, dict[str, float]] = {}
    errors: list[BaseException] = []
    cpu0 = _rusage()[0]
    t0 = time.perf_counter()

    def account(name: str, rows: int, started: float) -> None:
        progress[name] += rows
        if name == first and progress[name] >= len(ids[name]) // 2:
            halfway.set()
        results[name] = {"rows": progress[name], "seconds": time.perf_counter() - started}

    if spec["competitor"] == "baseline":
        import torch
        from torch.utils.data import DataLoader

        per_job = max(1, spec["workers"] // len(jobs))
        root, size = spec["catalog"], spec["image_size"]

        def run_job(job: dict[str, Any]) -> None:
            try:
                if job["late"]:
                    halfway.wait()
                started = time.perf_counter()
                data = _MapDataset(root, "imgs", sorted(ids[job["name"]]), size)
                # spawn: forking a process that runs threads (DuckDB's, the other jobs') can
                # deadlock in the child
                loader: DataLoader[Any] = DataLoader(
                    data,  # type: ignore[arg-type]
                    batch_size=spec["batch_size"],
                    shuffle=True,
                    num_workers=per_job,
                    multiprocessing_context="spawn",
                    generator=torch.Generator().manual_seed(0),
                )
                for _images, rows in loader:
                    time.sleep(job["step"])
                    account(job["name"], len(rows), started)
            except BaseException as exc:
                errors.append(exc)

        reads = None
    else:
        from tabloader.engine import Loader

        eng = Loader(
            cat,
            cache_bytes=spec["cache_bytes"],
            workers=spec["workers"],
            sampler="dependent" if spec["competitor"] == "tabloader" else "independent",
        )

        def run_job(job: dict[str, Any]) -> None:
            try:
                if job["late"]:
                    halfway.wait()
                started = time.perf_counter()
                stream = eng.open(
                    job["name"],
                    batch_size=spec["batch_size"],
                    epochs=1,
                    image_size=spec["image_size"],
                )
                for batch in stream:
                    time.sleep(job["step"])
                    account(job["name"], len(batch["_id"]), started)
                stream.close()
            except BaseException as exc:
                errors.append(exc)

    threads = [threading.Thread(target=run_job, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    if spec["competitor"] == "baseline":
        decodes = reads = sum(r["rows"] for r in results.values())
    else:
        stats = eng.stats()
        decodes, reads = stats["decodes"], stats["reads"]
        eng.close()
    cat.close()
    cpu, rss = _rusage()
    return {
        "wall_s": wall,
        "cpu_s": cpu - cpu0,
        "peak_rss_mib": rss,
        "decodes": decodes,
        "reads": reads,
        "jobs": results,
    }


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "tabloader.bench.e2e", "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# -- parent ----------------------------------------------------------------------------------
def _prepare(args: argparse.Namespace) -> tuple[Path, int, int]:
    import catalog
    from tabloader.datagen import make_imagefolder

    folder = make_imagefolder(
        Path(args.data) / f"images-{args.images}", num_images=args.images, num_classes=10
    )
    root = Path(args.data) / f"catalog-{args.images}"
    with catalog.connect(root, create=True) as cat:
        if "imgs" not in cat.dataset_names():
            cat.import_imagefolder("imgs", folder)
        ds = cat.dataset("imgs")
        spec = {"schema": pa_schema_hex(ds), "parts": [p.__dict__ for p in ds.reader.parts]}
        (root / "reader.json").write_text(json.dumps(spec))
        size = sum(f.stat().st_size for f in ds.files)
        return root, ds.num_rows, size


def pa_schema_hex(ds: Any) -> str:
    import pyarrow as pa

    return str(pa.schema(list(ds.schema)[1:]).serialize().to_pybytes().hex())


def run(args: argparse.Namespace) -> int:
    """Run the scenarios, print the table and write JSON."""
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    import catalog
    from catalog import _progress

    _progress.disable_progress_bars()
    if args.quick:
        args.images, args.speeds_rows, args.speeds_step = min(args.images, 600), 300, 0.05
    root, n, _ = _prepare(args)
    decoded_row = args.image_size * args.image_size * 3
    cache_bytes = max(1, int(args.cache * n)) * decoded_row
    rows: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    for scenario in args.scenarios.split(","):
        jobs = _scenarios(n, args.step, args.speeds_rows, args.speeds_step)[scenario]
        with catalog.connect(root, create=True) as cat:
            for j in jobs:
                cat.sql(
                    f"REGISTER OR REPLACE JOB {j['name']} SELECT image, label FROM imgs "
                    f"WHERE {j['where']}"
                )
            sets = [cat.job(j["name"]).ids for j in jobs]
        union = len(sets[0].union(*sets[1:]))
        base = {
            "catalog": str(root),
            "jobs": jobs,
            "batch_size": args.batch_size,
            "image_size": args.image_size,
            "workers": args.workers,
            "cache_bytes": cache_bytes,
        }
        results = {c: _run_child({**base, "competitor": c}) for c in COMPETITORS}
        alone: dict[float, float] = {}
        for step in sorted({j["step"] for j in jobs}):
            job = next(j for j in jobs if j["step"] == step)
            solo = _run_child({**base, "competitor": "tabloader", "jobs": [{**job, "late": False}]})
            alone[step] = solo["jobs"][job["name"]]["rows"] / solo["jobs"][job["name"]]["seconds"]
        runs[scenario] = {
            "union": union,
            "sets": [len(s) for s in sets],
            "results": results,
            "alone_rows_per_s": alone,
        }
        for c, r in results.items():
            ratios = [
                (r["jobs"][j["name"]]["rows"] / r["jobs"][j["name"]]["seconds"]) / alone[j["step"]]
                for j in jobs
            ]
            rows.append(
                {
                    "scenario": scenario,
                    "competitor": c,
                    "decodes": r["decodes"],
                    "decodes/union": r["decodes"] / union,
                    "reads/union": r["reads"] / union,
                    "wall_s": r["wall_s"],
                    "cpu_s": r["cpu_s"],
                    "rss_mib": r["peak_rss_mib"],
                    "vs_alone": " ".join(f"{x:.2f}" for x in ratios),
                }
            )
    print(
        f"{n} images, batch {args.batch_size}, image_size {args.image_size}, step {args.step}s,"
        f" {args.workers} workers, cache {cache_bytes / 2**20:.1f} MiB ({args.cache:.0%})"
    )
    print(format_table(rows))
    print()
    for line in _targets(runs, cache_bytes):
        print(line)
    write_json(
        args.out,
        {
            "benchmark": "e2e",
            "args": {k: v for k, v in vars(args).items() if k != "child"},
            "rows": rows,
            "runs": runs,
        },
    )
    return 0


def _targets(runs: dict[str, Any], cache_bytes: int) -> list[str]:
    out = []

    def check(ok: bool, text: str) -> None:
        out.append(f"{'PASS' if ok else 'FAIL'}  {text}")

    if "same" in runs:
        r = runs["same"]
        res = r["results"]
        ratio = res["tabloader"]["decodes"] / r["union"]
        check(ratio <= 1.05, f"same subset and speed: decodes / union = {ratio:.3f} (<= 1.05)")
        w = res["tabloader"]["wall_s"] / res["baseline"]["wall_s"]
        check(w <= 0.4, f"same subset and speed: wall time vs baseline = {w:.2f} (<= 0.4)")
    if "speeds" in runs:
        r = runs["speeds"]
        res = r["results"]
        d = res["tabloader"]["decodes"] / res["baseline"]["decodes"]
        check(d <= 0.6, f"different speeds: decodes vs baseline = {d:.2f} (<= 0.6)")
        fastest = min(r["alone_rows_per_s"])
        j0 = res["tabloader"]["jobs"]["j0"]
        t = (j0["rows"] / j0["seconds"]) / r["alone_rows_per_s"][fastest]
        check(t >= 0.9, f"different speeds: fastest job's throughput vs alone = {t:.2f} (>= 0.9)")
    for name, r in runs.items():
        rss = r["results"]["tabloader"]["peak_rss_mib"]
        limit = cache_bytes / 2**20 + 600
        check(
            rss <= limit,
            f"{name}: tabloader peak RSS {rss:.0f} MiB (<= cache + 600 = {limit:.0f} MiB)",
        )
    return out


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m tabloader.bench.e2e")
    add_arguments(_parser)
    _ns = _parser.parse_args()
    _ns.catalog = None
    raise SystemExit(run(_ns))
