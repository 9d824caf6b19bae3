"""End-to-end benchmark: four training jobs at once, through the loader service vs DataLoaders.

On a generated JPEG folder (``--images``, about 500x375 each), four jobs consume one epoch each
at once, sleeping ``step`` seconds per batch (a simulated training step). Side by side in one
run, on the same data and scenario:

* ``service``: four job processes, each reading its job through one ``tabloader serve`` of the
  catalog (started for the run with the same cache and ``--workers``; a ``RemoteStream`` of a
  ``RemoteLoader``, batches made tensors with ``to_tensors`` as ``JobDataset`` does);
* ``dataloader``: four job processes, each with its own ``torch.utils.data.DataLoader
  (shuffle=True)`` over a map-style dataset that reads the same Arrow IPC storage and decodes and
  resizes as tabloader does (``tabloader.engine.decode.decode_image``); ``--workers``
  (default: every core) split between them;
* ``threads``: the in-process mode, one ``Loader`` and four jobs on threads of one process;
* ``independent`` (with ``--competitors``): ``threads`` with the independent sampler (ablation).

Every process of a run gets ready first (imports, connections, workers started where a user's
code starts them) and then starts at one instant; wall time runs from there to the last job's
end. CPU seconds include every process of the competitor (the decode processes of the service
and of the in-process mode, the DataLoaders' workers), from the start on (not the imports).

Each competitor runs ``--repeat`` times (default 3) per scenario, the competitors in turn and
each first in turn; the run of median wall time is reported (the table's other columns are
that run's; ``wall_s runs`` gives the range, the JSON every wall time). Shared machines drift:
here the same 400 decodes in one process took 0.91 to 1.22 ms each from one round to the next,
so one run of each competitor can be 20% off in either direction.

Scenarios (each job runs one epoch of its subset):

* ``same``: four jobs, same subset, same speed;
* ``overlap``: two pairs on subsets that overlap by 50%;
* ``speeds``: step times 1x, 2x, 4x, 4x, on the first ``--speeds-rows`` rows, with a step
  long enough that the fastest job is bound by its step, not by decoding; the fastest job's
  rows/s is compared with the same job alone through the service (measured in the same run);
* ``late``: same subset and speed, the fourth job arrives when the first is half-way.

Training recipes (issue 29; not in the default ``--scenarios``, which stays the run it was:
``--scenarios recipe,recipe-eval``, or add them to the others):

* ``recipe``: four jobs on every row, each registered ``WITH (augment =
  'RandomResizedCrop(224), RandomHorizontalFlip()', seed = i)`` (``--recipe-size``): the service
  shares one aspect-kept decode a row (:class:`tabloader.engine.decode.Fit`) and each client
  crops, resizes and flips its own draws in its threads. The DataLoaders decode each sample with
  Pillow as a tuned user does (``draft`` to the DCT scale that covers 224, as ``bench throughput``'s
  Pillow arm), then the same recipe: torchvision's ``transforms.v2`` where it is installed, else the
  crop drawn by torchvision's algorithm (:meth:`tabloader.engine._prepare.augment.Augmenter.draw` on
  the decoded size), Pillow's ``resize`` of its box and ``transpose`` to flip; the table says which
  (``transforms`` in the JSON);
* ``recipe-eval``: the same rows, an evaluation job (``image_size = 224``, no augment) and
  three training jobs (``seed`` 1-3): the evaluation job, opened once the training jobs are
  open, reads their shared decode (``tabloader.engine._prepare.planning``: the jobs open decide), so
  the service decodes each row once. The evaluation job also
  runs alone through a service (its own center crop cached): ``center_crop_alone``.

At ImageNet row counts with a small cache (issue 35; not in the default ``--scenarios``):

* ``scale``: four jobs on overlapping subsets of 400,000 tiny JPEGs, the cache at 2%, 5% and
  10% of the union, started together, one late, at speeds 1:2:4; decodes against Belady's MIN
  on each run's own requests, and the service's memory (:mod:`benchmarks.e2e_scale`).

Each scenario's jobs are the only ones registered while it runs; the cache is ``--cache`` of
the rows at the scenario's row size (``--image-size`` squared x 3, or for the recipes the mean
slot of the shared decode).

Targets (``PASS``/``FAIL`` with the ratio, in the table and the JSON):

* decodes <= 1.05x the union of the jobs' sets (the service's own ``decodes`` counter);
* ``late``: the union is out of reach there (rows the others read before the late job came
  must stay cached or be decoded again), so also decodes <= 1.05x *Belady's MIN*: the
  service's own requests of the run (its ``--access-log``) replayed through an offline cache
  of the same arena size that knows every future request and keeps the rows batches hold
  (``belady/union`` in the table, for the threads mode too: its own requests and arena);
* ``same``: wall time <= 0.35x the four DataLoader processes, and <= 1.1x the in-process mode;
  the in-process mode's <= 0.27x the DataLoaders (four jobs cannot beat 0.25x);
* ``recipe``: wall time <= 0.35x the four DataLoader processes (the in-process mode's
  ratio is reported); ``recipe`` and ``recipe-eval`` also take the decodes target above;
* the arena's bytes per cached image (``stats()["cache"]``: ``size_bytes / entries``, the
  ``cache B/img`` column), reported: the recipe's shared aspect-kept decode vs the center
  crop of the evaluation job alone (the line under the table; ``recipe`` in the JSON);
* ``speeds``: the fastest job's rows/s >= 0.9x its rows/s alone;
* payload bytes copied per delivered image <= 1x its prepared size: counted by the client
  (``RemoteLoader.copies``: its copy out of the shared mapping, plus the service's copy into
  staging of every image the arena had no room for, which the reply lists);
* per-batch overhead of the service for a batch of ``--overhead-batch`` x
  ``--overhead-size``\\ :sup:`2` x 3 (default 64 x 224 x 224 x 3), p50 and p99 in us: one job
  process times ``take()`` + ``to_tensors`` (what the job waits for: the reply to the
  request its stream sent ahead, the copy out of the mapping, the release of the slots and the
  request for the next batch) on a subset that the arena holds whole, after a first epoch that
  decoded it, sleeping ``--overhead-settle`` seconds (its compute) before each ``take``. Every
  sample counts. Reported with the time of a bare ``numpy`` copy of the same bytes out of the
  mapping: the floor of any one-copy design.

Stall accounting, a line per scenario and competitor (the reported run): the jobs' seconds
blocked waiting for their next batch vs computing between batches (summed, the share of
waiting, and each job's ``wait/compute``), as the loader counted them (``JobStream.stats()``,
the service's for its clients) and for the DataLoaders as each job timed its ``next()``; and
the loader's seconds reading, decoding and collating (``Loader.stats()["datasets"]``). In the
JSON: ``stalls``, and each job's ``wait_s``/``compute_s`` and the run's ``dataset_s`` under
``runs``.

This module is the runner (processes, report); the scenarios' jobs are
:mod:`benchmarks.e2e_scenarios`, the targets :mod:`benchmarks.e2e_targets`, and
what runs in the processes it starts :mod:`benchmarks.e2e_children`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import (
    add_loader_arguments,
    add_mode_arguments,
    format_table,
    main,
    positive_int,
    write_json,
)
from benchmarks._procs import ServiceProcess, run_jobs, run_one
from benchmarks.e2e_children import run_child
from benchmarks.e2e_records import Overhead, Run, ScenarioRuns, Spec
from benchmarks.e2e_scale import add_arguments as scale_arguments
from benchmarks.e2e_scale import print_scale, run_scale
from benchmarks.e2e_scenarios import (
    SCENARIOS,
    ScenarioJob,
    register,
    scenarios_of,
    shared_decode_bytes,
)
from benchmarks.e2e_targets import cache_bytes_per_image, recipe_notes
from benchmarks.e2e_targets import targets as _targets
from benchmarks.imagedata import prepare
from benchmarks.stalls import dataset_seconds, stall_row
from tabloader.engine import values_that_fit
from tests.support.cachesim import belady_of_log

__all__ = ["add_arguments", "bench_cache_bytes", "median_run", "run"]

COMPETITORS = ("service", "dataloader", "threads", "independent")


MODES = {  # --mode: how the jobs run, each mode's description (its help)
    "launched": (
        "each job a fresh `python train.py` started as a shell does, start-up and a cold service "
        "inside the wall time"
    ),
    "zygote": (
        "the lab view, job processes forked from a pre-imported zygote, timed from a common start"
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks e2e``."""
    add_mode_arguments(parser, MODES)
    parser.add_argument(
        "--image-size", type=positive_int, default=96, help="shared resize (pixels)"
    )
    parser.add_argument(
        "--batch-size", type=positive_int, help="rows per batch (default: 64 launched, 32 zygote)"
    )
    parser.add_argument("--step", type=float, default=0.02, help="seconds per batch at 1x")
    parser.add_argument(
        "--speeds-rows",
        type=positive_int,
        default=1000,
        help="rows of the 'speeds' jobs (the 4x jobs take long)",
    )
    parser.add_argument(
        "--speeds-step",
        type=float,
        default=0.12,
        help="seconds per batch of the fastest 'speeds' job (step-bound, so "
        "its throughput alone is not limited by decoding)",
    )
    add_loader_arguments(
        parser,
        workers_help="decode workers of each competitor (the DataLoaders split them); "
        "default: cores",
    )
    parser.add_argument(
        "--scenarios",
        help="comma-separated; launched mode: of recipe, eval (default both: four jobs each); "
        f"zygote mode: of {', '.join(SCENARIOS)} (default same,overlap,speeds,late)",
    )
    parser.add_argument(
        "--steps",
        default="0,0.05",
        help="launched mode: seconds each job sleeps per batch (its simulated step), "
        "comma-separated; the targets use 0",
    )
    parser.add_argument(
        "--recipe-size",
        type=positive_int,
        default=224,
        help="output side of the recipe scenarios' RandomResizedCrop and evaluation job",
    )
    parser.add_argument(
        "--competitors",
        default="service,dataloader,threads",
        help=f"comma-separated, of {', '.join(COMPETITORS)}",
    )
    parser.add_argument("--overhead-batch", type=positive_int, default=64, help="rows of a batch")
    parser.add_argument(
        "--overhead-size", type=positive_int, default=224, help="image side (pixels)"
    )
    parser.add_argument("--overhead-samples", type=positive_int, default=200, help="batches timed")
    parser.add_argument(
        "--overhead-settle", type=float, default=0.03, help="seconds slept before each request"
    )
    parser.add_argument(
        "--repeat",
        type=positive_int,
        default=3,
        help="runs of each competitor per scenario, interleaved; the run of median wall time "
        "is reported (1 with --quick)",
    )
    parser.add_argument("--data", default="bench-results/e2e-data", help="image folder cache")
    parser.add_argument("--out", default="bench-results/e2e.json", help="JSON output")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    scale_arguments(parser)


def _run_threads(spec: Spec) -> Run:
    out = run_one("benchmarks.e2e", spec)  # its warnings share the output: the JSON line
    line = next(ln for ln in reversed(out.splitlines()) if ln.startswith("{"))
    return json.loads(line)  # type: ignore[no-any-return]


def _run_processes(
    kind: str,
    base: Spec,
    jobs: list[ScenarioJob],
    ids: dict[str, Path],
    access_log: Path | None = None,
) -> Run:
    """The jobs as separate processes, through a service (``kind="service"``, recording its
    ``access_log`` if given) or DataLoaders."""
    root = Path(base["catalog"])
    specs: list[Spec] = [
        {
            **base,
            "role": "job",
            "kind": kind,
            "job": j,
            "ids_file": str(ids[j["name"]]),
            "rows_total": int(np.load(ids[j["name"]]).size),
            "workers": max(1, base["workers"] // len(jobs)),
        }
        for j in jobs
    ]
    if kind == "dataloader":
        out = run_jobs("benchmarks.e2e", specs)
        decodes = reads = sum(r["rows"] for r in out["results"])
        service_cpu, service_rss, pids = 0.0, 0.0, []
        dataset_s, cache = None, None  # a DataLoader counts no read or decode seconds
    else:
        with ServiceProcess(
            root,
            cache_bytes=base["service_cache_bytes"],
            workers=base["workers"],
            log=root / "bench.log",
            access_log=access_log,
        ) as service:
            cpu0 = service.usage()[0]  # its start-up is not the run's
            out = run_jobs("benchmarks.e2e", specs)
            stats = service.stats()
            service_cpu, service_rss = service.usage()
            service_cpu -= cpu0
        decodes, reads = stats["decodes"], stats["reads"]
        dataset_s = dataset_seconds(stats)
        cache = {k: stats["cache"][k] for k in ("entries", "size_bytes")}
        pids = [service.proc.pid]
    results = out["results"]
    result: Run = {
        "wall_s": out["wall_s"],
        "cpu_s": sum(r["cpu_s"] for r in results) + service_cpu,
        "peak_rss_mib": max([service_rss] + [r["peak_rss_mib"] for r in results]),
        "decodes": decodes,
        "reads": reads,
        "jobs": {
            r["name"]: {
                "rows": r["rows"],
                "seconds": r["seconds"],
                "wait_s": r["wait_s"],
                "compute_s": r["compute_s"],
            }
            for r in results
        },
        "dataset_s": dataset_s,
        "cache": cache,
        "service_pids": pids,
    }
    transforms = sorted({r["transforms"] for r in results if "transforms" in r})
    if transforms:  # the DataLoaders' recipe: torchvision's, or Pillow's where it is missing
        result["transforms"] = ", ".join(transforms)
    if kind == "service":
        result["copies"] = {
            k: sum(r["copies"][k] for r in results)
            for k in ("images", "prepared_bytes", "copied_bytes")
        }
    return result


def _overhead(args: argparse.Namespace, root: Path, n: int) -> Overhead:
    from tabloader import catalog

    rows = min(n, 4 * args.overhead_batch)
    with catalog.open_catalog(root) as cat:
        register(cat, [{"name": "overhead", "where": f"_id < {rows}", "step": 0.0, "late": False}])
    value = args.overhead_size**2 * 3
    cache = 2 * rows * value + (64 << 20)
    spec: Spec = {
        "role": "overhead",
        "catalog": str(root),
        "rows": rows,
        "size": args.overhead_size,
        "batch_size": args.overhead_batch,
        "samples": args.overhead_samples,
        "settle": args.overhead_settle,
    }
    with ServiceProcess(
        root, cache_bytes=cache, workers=args.workers, log=root / "bench.log"
    ) as service:
        result: Overhead = run_jobs("benchmarks.e2e", [spec])["results"][0]
    return {**result, "service_pids": [service.proc.pid]}


# -- parent ----------------------------------------------------------------------------------
def bench_cache_bytes(
    rows: int, jobs: int, workers: int, batch_size: int, row_bytes: int, *, service: bool
) -> int:
    """A competitor's cache: room for ``rows`` shared values, plus what its mechanism pins
    besides: the batches being prepared (``prefetch`` per job as the engine sizes it, and half
    again for rows decoded ahead), and for the service also the two batches each client holds
    (the one it reads, one in delivery) and its prepared batches, which stay pinned until
    handed over (threads copy theirs out of the cache at once); plus 4 MiB of slabs for the
    staging of ids and labels (the arena gives out memory in slabs of at least 64 KiB).
    """
    from tabloader.engine import default_prefetch

    prefetch = default_prefetch(workers, batch_size, None)
    per_job = prefetch + 2 if service else prefetch
    pinned = jobs * per_job * batch_size * 3 // 2
    return (rows + pinned) * row_bytes + (4 << 20)


def run(args: argparse.Namespace) -> int:
    """Run the scenarios, print the tables and write JSON."""
    if args.child:
        return run_child(json.loads(args.child))
    if args.mode == "launched":
        from benchmarks.e2e_launched import run_launched

        return run_launched(args)
    args.images = args.images or 2000
    args.scenarios = args.scenarios or "same,overlap,speeds,late"
    args.batch_size = args.batch_size or 32
    from tabloader import catalog
    from tabloader.catalog import disable_progress_bars

    disable_progress_bars()
    competitors = [c for c in args.competitors.split(",") if c]
    unknown = sorted(set(competitors) - set(COMPETITORS))
    if unknown:
        raise SystemExit(
            f"Unknown competitor(s) {', '.join(unknown)}: use {', '.join(COMPETITORS)}."
        )
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown or not scenarios:
        raise SystemExit(
            f"Unknown scenario(s) {', '.join(unknown) or '(none given)'} in --scenarios: use "
            f"{', '.join(SCENARIOS)}."
        )
    if args.quick:
        args.images, args.speeds_rows, args.speeds_step = min(args.images, 600), 300, 0.05
        args.overhead_samples = min(args.overhead_samples, 50)
        args.repeat = 1
    scale = run_scale(args) if "scale" in scenarios else None  # data of its own
    scenarios = [s for s in scenarios if s != "scale"]
    if scale is not None:
        print_scale(scale)
        if not scenarios:
            print(format_table(scale["targets"]))
            write_json(args.out, {"benchmark": "e2e", "args": vars(args), "scale": scale})
            return 0
    root, n, _ = prepare(args)
    shared_rows = int(args.cache * n)
    row_bytes = {"": args.image_size * args.image_size * 3}  # by augment text ("": none)
    rows: list[dict[str, object]] = []
    stalls: list[dict[str, object]] = []
    runs: dict[str, ScenarioRuns] = {}
    for scenario in scenarios:
        jobs = scenarios_of(n, args.step, args.speeds_rows, args.speeds_step, args.recipe_size)[
            scenario
        ]
        recipe = max(str(j.get("options", {}).get("augment", "")) for j in jobs)
        if recipe not in row_bytes:  # the shared decode, aspect kept: about 3.7x 224x224x3
            row_bytes[recipe] = shared_decode_bytes(root, recipe, min(n, 32))
        decoded_row = row_bytes[recipe]
        cache_bytes, service_cache_bytes = (
            bench_cache_bytes(shared_rows, 4, args.workers, args.batch_size, decoded_row, service=s)
            for s in (False, True)
        )
        with catalog.open_catalog(root, create=True) as cat:
            register(cat, jobs)
            sets = [cat.job(j["name"]).ids for j in jobs]
        union = len(sets[0].union(*sets[1:]))
        base: Spec = {
            "catalog": str(root),
            "jobs": jobs,
            "batch_size": args.batch_size,
            "image_size": args.image_size,
            "workers": args.workers,
            "cache_bytes": cache_bytes,
            "service_cache_bytes": service_cache_bytes,
        }
        results: dict[str, Run] = {}
        with tempfile.TemporaryDirectory(prefix="tabloader-bench-ids-") as tmp:
            ids = {}
            for j, s in zip(jobs, sets, strict=True):
                ids[j["name"]] = Path(tmp, f"{j['name']}.npy")
                np.save(ids[j["name"]], np.array(s, np.int64))
            trials: dict[str, list[Run]] = {c: [] for c in competitors}
            for k in range(args.repeat):  # interleaved, each in turn first: the machine's
                # drift (other tenants: the same decodes vary by 30% here) hits all alike
                for c in competitors[k % len(competitors) :] + competitors[: k % len(competitors)]:
                    log = Path(tmp, f"access-{c}-{k}.npz")
                    if c == "dataloader":
                        r = _run_processes(c, base, jobs, ids)
                    elif c == "service":
                        r = _run_processes(c, base, jobs, ids, log)
                    else:
                        spec: Spec = {
                            **base,
                            "role": "threads",
                            "competitor": c,
                            "access_log": str(log),
                        }
                        r = _run_threads(spec)
                    trials[c].append({**r, "access_log": log})
            for c, runs_of in trials.items():
                results[c] = median_run(runs_of)
                log = results[c].pop("access_log")
                if c != "dataloader":
                    arena = service_cache_bytes if c == "service" else cache_bytes
                    results[c]["belady"] = belady_of_log(log, values_that_fit(arena, decoded_row))[
                        0
                    ]
            alone, solo, center = None, None, None
            if scenario == "recipe-eval" and "service" in competitors:
                # the arena's form of the evaluation job alone (no augmented job beside it to
                # share a decode with): its own center crop, for the bytes per cached image
                alone_job: ScenarioJob = {**jobs[0]}
                alone_job.pop("after", None)  # no training job opens this time
                with catalog.open_catalog(root) as cat:
                    register(cat, [alone_job])
                center = _run_processes("service", base, [alone_job], ids)
            if scenario == "speeds" and "service" in competitors:
                fastest: ScenarioJob = {**jobs[0], "late": False}
                solo = median_run(  # one job: the median wall is the median rows/s
                    [_run_processes("service", base, [fastest], ids) for _ in range(args.repeat)]
                )
                j0 = solo["jobs"][fastest["name"]]
                alone = j0["rows"] / j0["seconds"]
        runs[scenario] = {
            "union": union,
            "sets": [len(s) for s in sets],
            "results": results,
            "fastest_alone": solo,
            "fastest_alone_rows_per_s": alone,
            "center_crop_alone": center,
            "row_bytes": decoded_row,
            "cache_bytes": {"threads": cache_bytes, "service": service_cache_bytes},
        }
        for c, r in results.items():
            row = {
                "scenario": scenario,
                "competitor": c,
                "decodes": r["decodes"],
                "decodes/union": r["decodes"] / union,
                "reads/union": r["reads"] / union,
                "belady/union": r["belady"]["decodes"] / union if "belady" in r else "",
                "wall_s": r["wall_s"],
                "wall_s runs": "-".join(
                    f"{w:.2f}" for w in (min(r["wall_s_runs"]), max(r["wall_s_runs"]))
                )
                if len(r["wall_s_runs"]) > 1
                else "",
                "cpu_s": r["cpu_s"],
                "rss_mib": r["peak_rss_mib"],
                "copies/img": (
                    r["copies"]["copied_bytes"] / r["copies"]["prepared_bytes"]
                    if r.get("copies", {}).get("prepared_bytes")
                    else ""
                ),
                "fastest/alone": "",
                "cache B/img": cache_bytes_per_image(r) or "",
            }
            if alone:
                j0 = r["jobs"][jobs[0]["name"]]
                row["fastest/alone"] = (j0["rows"] / j0["seconds"]) / alone
            rows.append(row)
            stalls.append({"scenario": scenario, "competitor": c, **stall_row(r)})
    overhead = _overhead(args, root, n)
    targets = _targets(runs, overhead) + (scale["targets"] if scale else [])
    print(
        f"{n} images, batch {args.batch_size}, image_size {args.image_size}, step {args.step}s,"
        f" {args.workers} workers, cache: {shared_rows} shared rows ({args.cache:.0%} of the"
        f" images) + what each pins, {os.cpu_count()} cores"
    )
    for row_size in sorted({r["row_bytes"] for r in runs.values()}):
        used = [name for name, r in runs.items() if r["row_bytes"] == row_size]
        c = runs[used[0]]["cache_bytes"]
        print(
            f"  {', '.join(used)}: {row_size:,} B a cached image, cache threads"
            f" {c['threads'] / 2**20:.1f} MiB, service {c['service'] / 2**20:.1f} MiB (+ the"
            " batches its clients hold)"
        )
    print(format_table(rows))
    notes = recipe_notes(runs, args.recipe_size)
    for line in notes["lines"]:
        print(line)
    print()
    print(
        "stalls (the reported runs): jobs' seconds waiting for data vs computing (summed; "
        "per job wait/compute), and the loader's seconds reading, decoding, collating"
    )
    print(format_table(stalls))
    print()
    print(format_table(targets))
    print()
    print(
        f"overhead: {overhead['samples']} batches of {'x'.join(map(str, overhead['shape']))}"
        f" uint8, take() -> tensors ready in a job process that computes"
        f" {args.overhead_settle * 1e3:.0f} ms per batch: p50 {overhead['p50_us']:.0f} us,"
        f" p99 {overhead['p99_us']:.0f} us; a bare copy of the"
        f" same bytes out of the mapping: {overhead['copy_floor_us']:.0f} us"
    )
    write_json(
        args.out,
        {
            "benchmark": "e2e",
            "args": {k: v for k, v in vars(args).items() if k != "child"},
            "cores": os.cpu_count(),
            "rows": rows,
            "stalls": stalls,
            "targets": targets,
            "overhead": overhead,
            "recipe": {k: v for k, v in notes.items() if k != "lines"},
            "runs": runs,
            "scale": scale,
        },
    )
    return 0


def median_run(runs: list[Run]) -> Run:
    """The run of median wall time (of an even count, the lower middle), with every run's wall
    time (``wall_s_runs``, in order) and every run's service processes (``service_pids``)."""
    median = sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2]
    return {
        **median,
        "wall_s_runs": [r["wall_s"] for r in runs],
        "service_pids": [p for r in runs for p in r.get("service_pids", [])],
    }


if __name__ == "__main__":
    main(add_arguments, run, prog="python -m benchmarks.e2e", catalog=None)
