"""Benchmark ``analyze``: ``tabloader analyze``'s predictions against the same runs, for real.

On a generated JPEG folder (``--images`` small images, decoded at ``--image-size``), three
jobs are registered with the same rows and options (``v0``, ``v1``, ``v2``). ``tabloader
analyze`` profiles ``v0`` (its differential runs, :func:`tabloader.analyze.profile_job`, with
the loop's ``--step``), and the model predicts each configuration of the grid:

* ``--workers`` decode processes (default 1 and 2);
* a cache that holds the dataset (``2``: twice its decoded bytes) and one that holds 1/20 of
  it (``0.05``; ``--caches``, fractions of the decoded dataset);
* ``--jobs`` jobs reading at once (default 1 and 3: ``v0``, then ``v1`` and ``v2``).

Then each configuration runs for real: a fresh ``tabloader serve --workers N --cache-bytes B``
and one fresh process per job (started together), each reading ``--epochs`` epochs of its job
and sleeping ``--step`` seconds a batch, as the model assumes. Measured per job: each epoch's
wall time and the time its loop waited for batches; reported: ``v0``'s seconds per epoch (the
mean over the epochs) and its stall fraction beside the prediction, and the error
``predicted / measured - 1``. Targets: the median absolute error <= 10%, the worst <= 25%.

``--repeat`` rounds (default 3), each an analysis and then every configuration once, so that
a shared machine's drift hits them all: the rates predicted from are the median of the
analyses', a configuration's measure the median of its runs. The ``others`` column is the
cores every other process of the machine used during a run (``/proc/stat``): a run whose
machine was busier or quieter than the analyses' is predicted for a machine it did not have.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import format_table, main, positive_int, write_json
from benchmarks._cpu import cpu_line
from benchmarks._verdict import verdict

__all__ = ["MEDIAN_TARGET", "WORST_TARGET", "add_arguments", "run"]

MEDIAN_TARGET = 0.10  # median |predicted / measured - 1| of the seconds per epoch
WORST_TARGET = 0.25  # the worst
JOBS = ("v0", "v1", "v2")
MODULE = "benchmarks.predictions"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--images", type=positive_int, help="generated JPEGs (default 10000)")
    parser.add_argument(
        "--image-size", type=positive_int, default=64, help="decoded size (default 64)"
    )
    parser.add_argument("--batch-size", type=positive_int, default=16, help="rows a batch")
    parser.add_argument(
        "--step", type=float, default=0.004, help="the loop's seconds a batch (default 0.004)"
    )
    parser.add_argument("--epochs", type=positive_int, default=2, help="epochs each job reads")
    parser.add_argument("--workers", default="1,2", help="decode processes to run (list)")
    parser.add_argument("--jobs", default="1,3", help="jobs at once to run (list, at most 3)")
    parser.add_argument(
        "--caches", default="2,0.05", help="caches as fractions of the decoded dataset (list)"
    )
    parser.add_argument(
        "--batches", type=positive_int, default=20, help="the analysis' fewest batches (20)"
    )
    parser.add_argument(
        "--seconds", type=float, help="the analysis' shortest first run (2; quick: 0.3)"
    )
    parser.add_argument(
        "--repeat",
        type=positive_int,
        default=3,
        help="runs of each configuration, in rounds; the median is compared (1 with --quick)",
    )
    parser.add_argument("--data", default="bench-results/analyze-data", help="data folder")
    parser.add_argument("--out", default="bench-results/analyze.json", help="JSON output")
    parser.add_argument("--child", help=argparse.SUPPRESS)


def _numbers(text: str, kind: type) -> list[Any]:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"not a list of {kind.__name__}: {text!r}") from None


def _prepare(args: argparse.Namespace) -> tuple[Path, int]:
    """The catalog (dataset ``imgs``, jobs ``v0``-``v2``) and the dataset's rows."""
    from tabloader import catalog
    from tabloader.datagen import make_imagefolder

    folder = make_imagefolder(
        Path(args.data) / f"images-{args.images}", num_images=args.images, size=(200, 150)
    )
    root = (Path(args.data) / f"catalog-{args.images}").absolute()
    with catalog.open_catalog(root, create=True) as cat:
        if "imgs" not in cat.dataset_names():
            cat.import_imagefolder("imgs", folder)
        options = f"image_size = {args.image_size}, batch_size = {args.batch_size}"
        for job in JOBS:
            cat.sql(f"REGISTER OR REPLACE JOB {job} SELECT image, label FROM imgs WITH ({options})")
        return root, cat.dataset("imgs").num_rows


def _grid(args: argparse.Namespace, decoded_bytes: float) -> list[dict[str, Any]]:
    grid = []
    for jobs in _numbers(args.jobs, int):
        if not 1 <= jobs <= len(JOBS):
            raise SystemExit(f"--jobs: 1 to {len(JOBS)} jobs at once, not {jobs}")
        for fraction in _numbers(args.caches, float):
            for workers in _numbers(args.workers, int):
                grid.append(
                    {
                        "workers": workers,
                        "cache_bytes": max(1 << 20, int(decoded_bytes * fraction)),
                        "cache": fraction,
                        "jobs": jobs,
                    }
                )
    return grid


def _measure(root: Path, config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One configuration for real: a fresh service and one fresh process per job."""
    from benchmarks._procs import ServiceProcess, run_jobs
    from tabloader.analyze._cpu import machine_busy_s

    with ServiceProcess(
        root,
        cache_bytes=config["cache_bytes"],
        workers=config["workers"],
        log=Path(args.data) / "service.log",
    ) as service:
        specs = [
            {"root": str(root), "job": j, "epochs": args.epochs, "step": args.step}
            for j in JOBS[: config["jobs"]]
        ]
        busy, ours = machine_busy_s(), service.usage()[0]
        t0 = time.perf_counter()
        out = run_jobs(MODULE, specs, timeout=1800, preload=("tabloader.service._client",))
        span = time.perf_counter() - t0
        ours = service.usage()[0] - ours + sum(r["cpu_s"] for r in out["results"])
        others = max(0.0, machine_busy_s() - busy - ours) / span
        stats = service.stats()
    first = out["results"][0]
    waited = sum(first["wait_s"])
    seconds = sum(first["epochs_s"])
    rows = sum(r["rows"] for r in out["results"])
    return {
        "epoch_s": seconds / args.epochs,
        "epochs_s": first["epochs_s"],
        "stall_fraction": waited / seconds if seconds > 0 else 0.0,
        "decodes_per_row": stats["decodes"] / rows if rows else 0.0,
        "others_cores": others,
        "cores_got": ours / span,
        "jobs_epoch_s": [sum(r["epochs_s"]) / args.epochs for r in out["results"]],
    }


def run(args: argparse.Namespace) -> int:
    """Profile ``v0``, predict the grid, run it; print predicted beside measured."""
    from tabloader.analyze import profile_job, rates_of
    from tabloader.analyze._model import WhatIf, predict

    if args.child:
        return _child(json.loads(args.child))
    if args.images is None:
        args.images = 800 if args.quick else 10000
    if args.quick:
        args.epochs, args.workers, args.jobs, args.caches, args.repeat = 1, "1", "2", "2", 1
    print(cpu_line())
    root, rows = _prepare(args)
    seconds = args.seconds if args.seconds is not None else (0.3 if args.quick else 2.0)
    grid: list[dict[str, Any]] = []
    analyses: list[tuple[Any, Any, float]] = []
    runs: list[list[dict[str, Any]]] = []
    for _ in range(args.repeat):  # rounds: an analysis, then each configuration once
        t0 = time.perf_counter()
        profile = profile_job(root, JOBS[0], batches=args.batches, seconds=seconds, step=args.step)
        rates = rates_of(profile)
        analyses.append((profile, rates, time.perf_counter() - t0))
        print(
            f"analysis of {JOBS[0]}: {analyses[-1][2]:.1f} s; the loader got "
            f"{rates.got_one:.2f} cores with 1 decode process, {rates.got_cores:.2f} with "
            f"{rates.workers} (of {rates.cores:g})",
            flush=True,
        )
        if not grid:
            grid = _grid(args, rows * rates.value_bytes * rates.values_per_row)
            runs = [[] for _ in grid]
        for i, config in enumerate(grid):
            runs[i].append(_measure(root, config, args))
            print(f"  {_label(config)}: {runs[i][-1]['epoch_s']:.2f} s/epoch", flush=True)
    rates = median_rates([r for _, r, _ in analyses])
    profile, analyze_s = analyses[0][0], statistics.median(a for _, _, a in analyses)
    results = []
    for config, measured_runs in zip(grid, runs, strict=True):
        what_if = WhatIf(
            workers=config["workers"],
            cache_bytes=config["cache_bytes"],
            jobs=config["jobs"],
            step=args.step,
        )
        predicted = predict(rates, what_if, epochs=args.epochs)
        measured = sorted(measured_runs, key=lambda m: m["epoch_s"])[(len(measured_runs) - 1) // 2]
        results.append(
            {
                **config,
                "predicted": predicted.to_json(),
                "measured": measured,
                "measured_epoch_s_runs": [m["epoch_s"] for m in measured_runs],
                "error": predicted.epoch_s / measured["epoch_s"] - 1,
            }
        )
    _report(args, rows, results, rates, profile, analyze_s, [r for _, r, _ in analyses])
    return 0


def median_rates(rates: list[Any]) -> Any:
    """The median of each measured rate over ``rates`` (of the same job and configuration)."""
    from dataclasses import fields, replace

    numbers = {
        f.name: statistics.median(getattr(r, f.name) for r in rates)
        for f in fields(rates[0])
        if isinstance(getattr(rates[0], f.name), float)
    }
    return replace(rates[0], **numbers)


def _label(config: dict[str, Any]) -> str:
    return f"workers={config['workers']} cache={config['cache']:g}x jobs={config['jobs']}"


def _report(
    args: argparse.Namespace,
    rows: int,
    results: list[dict[str, Any]],
    rates: Any,
    profile: Any,
    analyze_s: float,
    rates_of_rounds: list[Any],
) -> None:
    """Print the table and the targets; write the JSON."""
    table = [
        {
            "workers": r["workers"],
            "cache": f"{r['cache']:g}x",
            "jobs": r["jobs"],
            "bound": "/".join(r["predicted"]["bound"]),
            "pred s/epoch": f"{r['predicted']['epoch_s']:.2f}",
            "meas s/epoch": f"{r['measured']['epoch_s']:.2f}",
            "error": f"{r['error']:+.1%}",
            "meas runs": " ".join(f"{x:.2f}" for x in r["measured_epoch_s_runs"]),
            "pred stall": f"{r['predicted']['stall_fraction']:.0%}",
            "meas stall": f"{r['measured']['stall_fraction']:.0%}",
            "pred dec/row": f"{r['predicted']['decodes_per_row']:.2f}",
            "meas dec/row": f"{r['measured']['decodes_per_row']:.2f}",
            "got": f"{r['measured']['cores_got']:.2f}",
            "others": f"{r['measured']['others_cores']:.2f}",
        }
        for r in results
    ]
    errors = [abs(r["error"]) for r in results]
    median, worst = statistics.median(errors), max(errors)
    verdicts = [
        verdict("median |error|", median, MEDIAN_TARGET, at_most=True),
        verdict("worst |error|", worst, WORST_TARGET, at_most=True),
    ]
    print()
    print(cpu_line())
    print(
        f"{rows} images decoded at {args.image_size}, batches of {args.batch_size}, step "
        f"{args.step} s, {args.epochs} epoch(s) a run, median of {args.repeat} run(s) and of "
        f"the rates of {args.repeat} analyses (one a round, {analyze_s:.1f} s each); error: "
        "predicted / measured - 1 of v0's s/epoch; got: cores the loader and its jobs used during "
        "the run, others: the machine's other processes"
    )
    print(format_table(table, list(table[0])))
    print(format_table(verdicts, list(verdicts[0])))
    write_json(
        args.out,
        {
            "cpu": cpu_line(),
            "rows": rows,
            "analysis_s": analyze_s,
            "rates": rates.__dict__,
            "rates_of_each_round": [r.__dict__ for r in rates_of_rounds],
            "runs": {name: r.__dict__ for name, r in profile.runs.items()},
            "configs": results,
            "median_error": median,
            "worst_error": worst,
            "verdicts": verdicts,
        },
    )


def _child(spec: dict[str, Any]) -> int:
    """One job's process: ``epochs`` epochs of its job, ``step`` seconds a batch."""
    from benchmarks._procs import rusage, wait_for_start, write_result
    from tabloader.service._client import RemoteLoader

    root, job, step = spec["root"], spec["job"], float(spec["step"])
    with RemoteLoader(root, start=False) as remote:
        wait_for_start(spec)
        epochs_s, waits = [], []
        rows = 0
        with remote.open(job, epochs=int(spec["epochs"])) as stream:
            for _ in range(int(spec["epochs"])):
                t0 = time.perf_counter()
                waited = 0.0
                it = iter(stream.iter_epoch())
                while True:
                    t = time.perf_counter()
                    batch = next(it, None)
                    waited += time.perf_counter() - t
                    if batch is None:
                        break
                    rows += len(batch["_id"])
                    time.sleep(step)
                epochs_s.append(time.perf_counter() - t0)
                waits.append(waited)
    write_result(
        spec,
        {
            "epochs_s": epochs_s,
            "wait_s": waits,
            "rows": rows,
            "cpu_s": rusage()[0],
            "end": time.time(),
        },
    )
    return 0


if __name__ == "__main__":
    if "--child" in sys.argv:
        raise SystemExit(_child(json.loads(sys.argv[sys.argv.index("--child") + 1])))
    main(add_arguments, run, prog=f"python -m {MODULE}", catalog=None)
