"""Throughput benchmark: one job against a tuned DataLoader, on images and on small rows.

Side by side in one run (competitors alternate, each one's best round is kept; throughput is
measured from each run's first batch on, so worker start-up counts for nobody):

* **images** (generated JPEGs, about 500x375), ``image_size`` 224 and 112, and the training
  recipe (:mod:`.recipe`: a job with ``augment`` vs DataLoaders doing it per sample), batch 64: a
  ``JobDataset`` epoch vs ``DataLoader(num_workers=N, shuffle=True)`` over the same Arrow
  files with a tuned Pillow decode (``draft`` + the same resize, as a user writes it; the
  target), the same DataLoader with tabloader's own decode (for reference), and SPDL's thread
  pipeline with tabloader's decode, N = the machine's cores.
* **decode**: milliseconds per image of the Pillow-draft and the libjpeg-turbo (simplejpeg)
  decode + resize, on the same bytes; the JPEG libraries alone (simplejpeg, PyTurboJPEG where
  the system has libturbojpeg, Pillow draft) at the same DCT scale; and the engine's
  throughput with 1..N workers.
* **small rows**: 200,000 rows of ``int64`` + ``float64``, batch 256, vs
  ``DataLoader(TensorDataset, batch_size=256, shuffle=True)``; and four such jobs at once on
  threads, total rows/s vs one job alone.
* **latency**: seconds from asking for a batch to getting it, p50 and p99, for a job that
  never computes (it asks again at once) and for one that computes a little per batch.
* **tiny JPEGs**: small rows at ImageNet row counts, one job vs ``DataLoader(2)`` and four jobs
  vs one, in-process and through the service (:mod:`.tiny`).
* **cold start**: seconds to the first batch of a ``JobDataset`` that starts the service, of one
  beside a running service, and of a DataLoader (:mod:`._coldstart`); target <= 1.5 s.

Each tabloader run also prints its stall accounting: the job's seconds waiting for data vs
computing, and the dataset's seconds reading, decoding and collating. ``--only images`` runs
images, decode, scaling and cold start; ``--only small`` small rows, four jobs and latency;
``--only cold`` the cold start, ``--only tiny`` the tiny JPEGs (each checks only its
targets).
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from benchmarks import add_mode_arguments, format_table, positive_int, write_json
from benchmarks._coldstart import ColdStart, cold_start
from benchmarks._coldstart import report as cold_report
from benchmarks._verdict import verdict
from benchmarks.recipe import RECIPE, recipe_competitors
from benchmarks.tiny import TinyResult, print_tiny, run_tiny
from benchmarks.tiny import add_arguments as tiny_arguments

__all__ = ["add_arguments", "run"]

TARGETS = {"images": 1.2, "recipe": 1.2, "small_rows": 1.0, "four_jobs": 0.9}


class Run(TypedDict, total=False):
    """One competitor's pass: rows/s from its first batch on and next()'s latency, or the
    ``error`` that kept it from running; a tabloader run adds its arena and stall counts."""

    rows_per_s: float
    p50_ms: float
    p99_ms: float
    error: str
    bytes_per_cached_image: float
    stalls: dict[str, float | None]


class ScenarioRow(Run):
    """A row of the throughput table: a competitor's best run and its ratio to the target's."""

    scenario: str
    competitor: str
    ratio: float | None


class ScalingRow(Run):
    """One image-224 job's run with ``workers`` decode processes."""

    workers: int


class DecodeRow(TypedDict):
    """Milliseconds per image of one decode + resize at one size."""

    size: int
    decode: str
    ms_per_image: float


class LibraryRow(TypedDict):
    """Milliseconds per image of one JPEG library at one size (or why it was not measured)."""

    size: int
    library: str
    ms_per_image: str


class FourJobs(TypedDict):
    """Rows/s of one small-row job alone and of four at once."""

    one_job_rows_per_s: float
    four_jobs_rows_per_s: float
    ratio: float


MODES = {  # --mode: how the jobs run, each mode's description (its help)
    "launched": (
        "one job as a fresh `python train.py`, start-up and a cold service inside its time"
    ),
    "inprocess": "the lab view, every competitor in this process from its first batch on",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks throughput``."""
    add_mode_arguments(parser, MODES)
    parser.add_argument(
        "--rows", type=positive_int, default=200_000, help="rows of the small-row table"
    )
    parser.add_argument("--workers", type=positive_int, default=os.cpu_count() or 2, help="N")
    parser.add_argument(
        "--rounds", type=positive_int, default=2, help="alternations of competitors"
    )
    parser.add_argument("--data", default="bench-results/throughput-data", help="image cache")
    parser.add_argument("--out", default="bench-results/throughput.json", help="JSON output")
    parser.add_argument(
        "--only",
        choices=["images", "small", "cold", "tiny"],
        help="run only the image scenarios (images, decode, scaling, cold start), only the "
        "small-row ones (small rows, four jobs, latency), only the cold start, or only the "
        "tiny JPEGs",
    )
    tiny_arguments(parser)


# -- competitors -------------------------------------------------------------------------------
def _timed(batches: Iterator[Any], rows_of: Callable[[Any], int]) -> Run:
    """Consume ``batches``; rows/s from the first batch on, and each next()'s latency."""
    waits: list[float] = []
    rows = 0
    t = time.perf_counter()
    first = None
    for batch in batches:
        now = time.perf_counter()
        waits.append(now - t)
        if first is None:
            first = now
        else:
            rows += rows_of(batch)
        t = time.perf_counter()
    elapsed = time.perf_counter() - (first or t)
    lat = np.array(waits[1:] or [0.0])
    return {
        "rows_per_s": rows / elapsed if elapsed > 0 else 0.0,
        "p50_ms": float(np.percentile(lat, 50) * 1e3),
        "p99_ms": float(np.percentile(lat, 99) * 1e3),
    }


class _ImageRows:
    """A map-style dataset over the catalog's IPC files (a DataLoader worker opens them)."""

    def __init__(self, root: str, parts: list[Any], schema: Any, size: int, how: str):
        self.root, self.parts, self.schema, self.size, self.how = root, parts, schema, size, how
        self.n: int = sum(p.num_rows for p in parts)
        self._reader: Any = None

    def __len__(self) -> int:
        return self.n

    def raw(self, i: int) -> Any:
        """Row ``i``'s image bytes."""
        if self._reader is None:  # opened in the worker process: files only, no DuckDB
            from tabloader.catalog.storage import DatasetReader

            self._reader = DatasetReader(Path(self.root), self.parts, self.schema)
        return self._reader.take([i], ["image"]).column("image")[0].as_buffer()

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return decode(self.raw(i), self.size, self.how), i


def decode(data: Any, size: int, how: str) -> Any:
    """``how="pillow"``: the tuned user's decode (draft + resize); ``"tabloader"``: ours."""
    import torch

    if how == "tabloader":
        from tabloader.engine.decode import decode_image

        return torch.from_numpy(np.array(decode_image(data, size=size)))
    from PIL import Image

    img: Any
    with Image.open(io.BytesIO(data)) as img:
        img.draft("RGB", (size, size))  # DCT-domain downscale to at least size x size
        img = img.convert("RGB")
        w, h = img.size
        m = min(w, h)
        box = ((w - m) / 2, (h - m) / 2, (w + m) / 2, (h + m) / 2)
        img = img.resize((size, size), Image.Resampling.BILINEAR, box=box)
        return torch.from_numpy(np.asarray(img).copy())


def _image_dataset(cat: Any, size: int, how: str) -> _ImageRows:
    ds = cat.dataset("imgs")
    return _ImageRows(str(cat.root), ds.reader.parts, ds.reader.schema, size, how)


def _dataloader_images(cat: Any, size: int, how: str, workers: int) -> Run:
    """``how``: a decode (``decode``), or ``recipe-<variant>`` (:mod:`.recipe`)."""
    import torch
    from torch.utils.data import DataLoader

    from benchmarks.recipe import RecipeRows

    dataset: Any = _image_dataset(cat, size, how)
    if how.startswith("recipe-"):
        dataset = RecipeRows(dataset, how.removeprefix("recipe-"))
    loader: Any = DataLoader(
        dataset,
        batch_size=64,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(0),
    )
    return _timed(iter(loader), lambda b: len(b[1]))


def _spdl_images(cat: Any, size: int, workers: int) -> Run:
    try:
        from spdl.pipeline import PipelineBuilder
    except ImportError as exc:
        return {"error": f"spdl is not installed ({exc}); pip install spdl-core spdl-io"}
    import torch

    data = _image_dataset(cat, size, "tabloader")
    order = np.random.default_rng(0).permutation(len(data)).tolist()
    builder: Any = PipelineBuilder()
    pipeline: Any = (
        builder.add_source(order)
        .pipe(data.__getitem__, concurrency=workers)
        .aggregate(64)
        .pipe(lambda items: (torch.stack([i for i, _ in items]), [r for _, r in items]))
        .add_sink(3)
        .build(num_threads=workers)
    )
    with pipeline.auto_stop():
        return _timed(pipeline.get_iterator(timeout=600), lambda b: len(b[1]))


def _tabloader_job(
    cat: Any, job: str, workers: int, batch_size: int, *, steady: bool = False, **open_kw: Any
) -> Run:
    """One epoch of ``job`` (``steady``: after the loader's background start, as the
    in-memory ``TensorDataset`` it is compared with has none)."""
    from tabloader.engine import Loader
    from tabloader.torch import JobDataset

    with Loader(cat, cache_bytes=1 << 30, workers=workers) as loader:
        if steady:
            loader.wait_ready()
        ds = JobDataset(job, loader=loader, batch_size=batch_size, **open_kw)
        out = _timed(iter(ds), lambda b: len(b["_id"]))
        stats = loader.stats()
        ds.close()
    job_stats: dict[str, float] = next(iter(stats["jobs"].values()), {}) if stats["jobs"] else {}
    cache = stats["cache"]
    out["bytes_per_cached_image"] = cache.size_bytes / cache.entries if cache.entries else 0
    out["stalls"] = {
        "wait_s": job_stats.get("wait_s"),
        "compute_s": job_stats.get("compute_s"),
        **{k: round(v, 3) for k, v in next(iter(stats["datasets"].values())).items()},
    }
    return out


def _best(runs: list[Run]) -> Run:
    ok = [r for r in runs if "rows_per_s" in r]
    return max(ok, key=lambda r: r["rows_per_s"]) if ok else runs[0]


# -- data ------------------------------------------------------------------------------------
def _catalogs(args: argparse.Namespace, tmp: Path) -> tuple[Any, Any]:
    """The image catalog and the small-row one (each None where ``--only`` leaves it out)."""
    import pyarrow as pa

    from tabloader import catalog
    from tabloader.datagen import make_imagefolder

    images = small = None
    if args.only in (None, "images", "cold"):
        folder = Path(args.data) / f"images-{args.images}"
        if not (folder / ".done").exists():
            make_imagefolder(folder, num_images=args.images, num_classes=10)
            (folder / ".done").touch()
    if args.only in (None, "images"):
        images = catalog.open_catalog(tmp / "images", create=True)
        images.import_imagefolder("imgs", folder)
        for size in (224, 112):
            images.sql(f"REGISTER JOB img{size} SELECT image FROM imgs WITH (image_size = {size})")
        # the recipe on a dataset of its own: beside it, the image_size jobs would share its
        # aspect-kept decode (engine ``_plan``) instead of their center crops
        images.import_imagefolder("recipe_imgs", folder)
        images.sql(f"REGISTER JOB recipe SELECT image FROM recipe_imgs WITH (augment = '{RECIPE}')")
    if args.only in (None, "small"):
        rng = np.random.default_rng(0)
        small = catalog.open_catalog(tmp / "small", create=True)
        x, y = rng.integers(0, 1 << 40, args.rows), rng.random(args.rows)
        small.import_arrow("t", pa.table({"x": x, "y": y}))
        for i in range(5):
            small.sql(f"REGISTER JOB s{i} SELECT x, y FROM t")
    return images, small


# -- scenarios -------------------------------------------------------------------------------
def _images(args: argparse.Namespace, cat: Any) -> list[ScenarioRow]:
    """Image 224 and 112 (shared resize + center crop), and the training recipe."""
    rows: list[ScenarioRow] = []
    for size in (224, 112, 0):  # 0: the recipe
        runs: dict[str, list[Run]] = {}
        for _ in range(args.rounds):
            job = f"img{size}" if size else "recipe"
            runs.setdefault("tabloader", []).append(_tabloader_job(cat, job, args.workers, 64))
            if not size:
                for how in recipe_competitors():
                    runs.setdefault(f"dataloader (pillow draft, {how})", []).append(
                        _dataloader_images(cat, 224, f"recipe-{how}", args.workers)
                    )
                continue
            runs.setdefault("dataloader (pillow draft)", []).append(
                _dataloader_images(cat, size, "pillow", args.workers)
            )
            runs.setdefault("dataloader (tabloader decode)", []).append(
                _dataloader_images(cat, size, "tabloader", args.workers)
            )
            runs.setdefault("spdl (tabloader decode)", []).append(
                _spdl_images(cat, size, args.workers)
            )
        best = {name: _best(r) for name, r in runs.items()}
        base = next(r for n, r in best.items() if n.startswith("dataloader (pillow"))["rows_per_s"]
        for name, r in best.items():
            rows.append(
                {
                    "scenario": f"image {size}" if size else f"recipe ({RECIPE})",
                    "competitor": name,
                    **r,
                    "ratio": r.get("rows_per_s", 0.0) / base if base else None,
                }
            )
    return rows


def _jpegs(cat: Any, n: int) -> list[bytes]:
    """The encoded bytes of the first ``n`` images."""
    return [
        bytes(v.as_buffer()) for v in cat.dataset("imgs").take(list(range(n)), ["image"])["image"]
    ]


def _ms_per_image(fn: Callable[[bytes, int], Any], data: list[bytes], size: int) -> float:
    """Milliseconds per image of ``fn(image, size)`` over ``data``, the best of 3 passes."""
    best = np.inf
    for _ in range(3):
        t = time.perf_counter()
        for d in data:
            fn(d, size)
        best = min(best, (time.perf_counter() - t) / len(data))
    return float(best * 1e3)


def _decode_costs(cat: Any, n: int) -> list[DecodeRow]:
    data = _jpegs(cat, n)
    out: list[DecodeRow] = []
    for size in (224, 112):
        for how in ("pillow", "tabloader"):
            ms = _ms_per_image(lambda d, s: decode(d, s, how), data, size)  # noqa: B023 (run here)
            out.append({"size": size, "decode": how, "ms_per_image": ms})
    return out


def _jpeg_libraries(cat: Any, n: int) -> list[LibraryRow]:
    """Decode only (no resize), at the DCT scale the shared decode uses for each size
    (``prep.dct_least_size``): simplejpeg (what tabloader uses), PyTurboJPEG and Pillow
    ``draft``, all libjpeg-turbo. PyTurboJPEG needs the system's libturbojpeg, or
    ``$TURBOJPEG_LIB`` (its 2.x the library's 3.x, its 1.x the 2.x): where it is missing the
    row says so."""
    import simplejpeg
    from PIL import Image

    from tabloader.engine.decode import dct_least_size

    data = _jpegs(cat, n)
    turbo: Any = None
    why = ""
    try:
        from turbojpeg import TJPF_RGB, TurboJPEG

        turbo = TurboJPEG(os.environ.get("TURBOJPEG_LIB"))  # None: where the system keeps it
    except ImportError:
        why = "not measured: pip install PyTurboJPEG (it needs the system's libturbojpeg)"
    except Exception as exc:  # no libturbojpeg it can load
        why = f"not measured: {str(exc).split('.')[0]} (set TURBOJPEG_LIB to its path)"

    def least(d: bytes, size: int) -> tuple[int, int] | None:
        h, w = simplejpeg.decode_jpeg_header(d)[:2]
        return dct_least_size((h, w), size)

    def with_simplejpeg(d: bytes, size: int) -> Any:
        at = least(d, size)
        kw = {} if at is None else {"min_height": at[0], "min_width": at[1]}
        return simplejpeg.decode_jpeg(d, colorspace="RGB", **kw)

    def with_turbojpeg(d: bytes, size: int) -> Any:
        h, w = simplejpeg.decode_jpeg_header(d)[:2]
        at = dct_least_size((h, w), size)
        fits = [
            f
            for f in turbo.scaling_factors
            if at and h * f[0] / f[1] >= at[0] and w * f[0] / f[1] >= at[1]
        ]
        factor = min(fits, key=lambda f: f[0] / f[1]) if fits else None
        return turbo.decode(d, pixel_format=TJPF_RGB, scaling_factor=factor)

    def with_pillow(d: bytes, size: int) -> Any:
        with Image.open(io.BytesIO(d)) as img:
            img.draft("RGB", (size, size))
            return np.asarray(img.convert("RGB"))

    out: list[LibraryRow] = []
    for size in (224, 112):
        for name, fn in (
            ("simplejpeg", with_simplejpeg),
            ("pyturbojpeg", with_turbojpeg if turbo is not None else None),
            ("pillow draft", with_pillow),
        ):
            ms = why if fn is None else f"{_ms_per_image(fn, data, size):.3f}"
            out.append({"size": size, "library": name, "ms_per_image": ms})
    return out


def _scaling(args: argparse.Namespace, cat: Any) -> list[ScalingRow]:
    counts = sorted({1, 2, args.workers} | ({4, 8} if args.workers >= 8 else set()))
    return [
        {"workers": w, **_tabloader_job(cat, "img224", w, 64)} for w in counts if w <= args.workers
    ]


def _small(args: argparse.Namespace, cat: Any) -> list[ScenarioRow]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    table = cat.dataset("t").take(list(range(cat.dataset("t").num_rows)), ["x", "y"])
    x = torch.tensor(table["x"].to_numpy())  # a copy: Arrow's buffers are read-only
    y = torch.tensor(table["y"].to_numpy())
    runs: dict[str, list[Run]] = {}
    for _ in range(args.rounds):
        run = _tabloader_job(cat, "s0", args.workers, 256, steady=True)
        runs.setdefault("tabloader", []).append(run)
        dl = DataLoader(TensorDataset(x, y), batch_size=256, shuffle=True)
        runs.setdefault("dataloader (TensorDataset)", []).append(
            _timed(iter(dl), lambda b: len(b[0]))
        )
    best = {name: _best(r) for name, r in runs.items()}
    base = best["dataloader (TensorDataset)"]["rows_per_s"]
    return [
        {"scenario": "small rows", "competitor": n, **r, "ratio": r["rows_per_s"] / base}
        for n, r in best.items()
    ]


def _four_jobs(args: argparse.Namespace, cat: Any) -> FourJobs:
    from tabloader.engine import Loader

    def one(loader: Loader, job: str, out: dict[str, int]) -> None:
        # three epochs: one job's single epoch lasts ~60 ms, too short to time reliably
        with loader.open(job, batch_size=256, epochs=3) as stream:
            out[job] = sum(len(b["_id"]) for b in stream)

    results = []
    for _ in range(args.rounds):
        for jobs in (["s0"], ["s1", "s2", "s3", "s4"]):
            counts: dict[str, int] = {}
            with Loader(cat, cache_bytes=1 << 24, workers=args.workers) as loader:
                loader.wait_ready()  # steady state: its processes start in the background
                threads = [threading.Thread(target=one, args=(loader, j, counts)) for j in jobs]
                t = time.perf_counter()
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                results.append((len(jobs), sum(counts.values()) / (time.perf_counter() - t)))
    alone = max(r for n, r in results if n == 1)
    four = max(r for n, r in results if n == 4)
    return {"one_job_rows_per_s": alone, "four_jobs_rows_per_s": four, "ratio": four / alone}


def _paced_latency(cat: Any, workers: int) -> Run:
    """A job that computes ~1 ms per batch: latency when prefetch can keep up."""
    from tabloader.engine import Loader

    with (
        Loader(cat, cache_bytes=1 << 24, workers=workers) as loader,
        loader.open("s0", batch_size=256, epochs=1) as stream,
    ):
        loader.wait_ready()

        def paced() -> Iterator[Any]:
            for batch in stream:
                yield batch
                time.sleep(0.001)

        return _timed(paced(), lambda b: len(b["_id"]))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 if every target is met."""
    if args.mode == "launched" and args.only is None:  # --only picks in-process scenarios
        from benchmarks.throughput_launched import run_launched

        return run_launched(args)
    args.images = args.images or 2000
    if args.quick:
        args.images, args.rows, args.rounds = min(args.images, 300), min(args.rows, 50_000), 1
        args.tiny_rows, args.tiny_dataloader_rows = min(args.tiny_rows, 2000), 1000
    image_rows: list[ScenarioRow] = []
    decode_rows: list[DecodeRow] = []
    libraries: list[LibraryRow] = []
    scaling: list[ScalingRow] = []
    small_rows: list[ScenarioRow] = []
    four: FourJobs | None = None
    paced: Run = {}
    cold: ColdStart | None = None
    tiny: TinyResult | None = None
    with tempfile.TemporaryDirectory() as tmp:
        images, small = _catalogs(args, Path(tmp))
        try:
            if images is not None:
                image_rows = _images(args, images)
                decode_rows = _decode_costs(images, min(200, args.images))
                libraries = _jpeg_libraries(images, min(200, args.images))
                scaling = _scaling(args, images)
            if small is not None:
                small_rows = _small(args, small)
                four = _four_jobs(args, small)
                paced = _paced_latency(small, args.workers)
            if args.only in (None, "tiny"):
                tiny = run_tiny(args)
            if args.only in (None, "images", "cold"):
                folder = Path(args.data) / f"images-{args.images}"
                cold = cold_start(folder, Path(tmp), args.workers, args.rounds)
        finally:
            for cat in (images, small):
                if cat is not None:
                    cat.close()
    table = image_rows + small_rows
    print(f"throughput, N = {args.workers} workers, {args.images} images, {args.rows} rows")
    print(
        format_table(
            [
                {
                    "scenario": r["scenario"],
                    "competitor": r["competitor"],
                    "rows/s": f"{r['rows_per_s']:.0f}" if "rows_per_s" in r else r.get("error"),
                    "ratio": f"{r['ratio']:.2f}" if r.get("ratio") is not None else "",
                    "p50 ms": f"{r['p50_ms']:.2f}" if "p50_ms" in r else "",
                    "p99 ms": f"{r['p99_ms']:.2f}" if "p99_ms" in r else "",
                }
                for r in table
            ]
        )
    )
    print(
        "\nstalls of the tabloader runs (job: waiting vs computing; dataset: pool thread-seconds)"
    )
    print(
        format_table(
            [
                {"scenario": r["scenario"], **{k: _fmt(v) for k, v in r["stalls"].items()}}
                for r in table
                if "stalls" in r
            ]
        )
    )
    checks: dict[str, float] = {}
    if images is not None:
        print("\ndecode + resize, one thread")
        print(
            format_table([{**d, "ms_per_image": f"{d['ms_per_image']:.3f}"} for d in decode_rows])
        )
        print("\nJPEG decode only, at the shared decode's DCT scale, one thread")
        print(format_table(libraries))
        print("\nscaling: one image-224 job, rows/s by workers")
        print(
            format_table(
                [{"workers": s["workers"], "rows/s": f"{s['rows_per_s']:.0f}"} for s in scaling]
            )
        )
        checks["images 224"] = _ratio(image_rows, "image 224")
        checks["images 112"] = _ratio(image_rows, "image 112")
        checks["recipe"] = _ratio(image_rows, f"recipe ({RECIPE})")
        kept = {
            r["scenario"]: r["bytes_per_cached_image"]
            for r in image_rows
            if r["competitor"] == "tabloader"
        }
        print(
            f"\narena bytes per cached image: {kept[f'recipe ({RECIPE})']:.0f} for the recipe's "
            f"shared aspect-kept decode, {kept['image 224']:.0f} for the 224 center crop"
        )
    if four is not None:
        print(
            f"\nfour small-row jobs at once: {four['four_jobs_rows_per_s']:.0f} rows/s in total, "
            f"{four['ratio']:.2f}x one job alone ({four['one_job_rows_per_s']:.0f} rows/s)"
        )
        print(
            f"latency of a job computing 1 ms per batch: p50 {paced['p50_ms']:.3f} ms, "
            f"p99 {paced['p99_ms']:.3f} ms"
        )
        checks["small rows"] = _ratio(small_rows, "small rows")
        checks["four jobs"] = four["ratio"]
    targets = {
        "images 224": TARGETS["images"],
        "images 112": TARGETS["images"],
        "recipe": TARGETS["recipe"],
        "small rows": TARGETS["small_rows"],
        "four jobs": TARGETS["four_jobs"],
    }
    verdicts = [verdict(k, v, targets[k]) for k, v in checks.items()]
    if cold:
        verdicts.append(cold_report(cold))  # prints its table
    if tiny:
        print_tiny(tiny)
        verdicts += tiny["targets"]
    print("\ntargets")
    print(format_table(verdicts))
    write_json(
        args.out,
        {
            "args": vars(args),
            "throughput": table,
            "decode": decode_rows,
            "jpeg_libraries": libraries,
            "scaling": scaling,
            "four_jobs": four or {},
            "paced_latency": paced,
            "cold_start": cold or {},
            "tiny": tiny or {},
            "targets": verdicts,
        },
    )
    return 0 if all(v["result"] == "PASS" for v in verdicts) else 1


def _ratio(rows: list[ScenarioRow], scenario: str) -> float:
    ratio = next(
        r["ratio"] for r in rows if r["scenario"] == scenario and r["competitor"] == "tabloader"
    )
    assert ratio is not None, f"{scenario}: no reference rate"
    return ratio


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)
