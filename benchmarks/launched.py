"""Benchmarks as users run them: each job a fresh ``python train.py``, launched as a shell does.

A user compares the wall clock of ``python train.py`` (four of them, for a search) with and
without tabloader. So here every job is a fresh interpreter started by ``subprocess`` from a
script file (:mod:`benchmarks.scripts`), all of a run's jobs at once, and the wall time
runs from the launch to the last process's exit: imports, the auto-started service (cold: no
service runs before a tabloader run, so the first ``JobDataset`` starts it and its cache is
empty) and DataLoader worker start-up are inside it. Competitors:

* ``tabloader``: ``train_tabloader.py``, the README's script (``JobDataset(job,
  catalog=DIR)`` in ``DataLoader(ds, batch_size=None)``);
* ``dataloader(W)``: ``train_dataloader.py``, a ``DataLoader(num_workers=W, shuffle=True)``
  per process over the image folder with a tuned Pillow decode and torchvision's transforms
  where torchvision imports (Pillow's own ops otherwise); ``W`` = 2 and the machine's cores.

Per competitor: wall, images/s delivered (all jobs), time to first batch (from the moment
the script starts building its loader, a ``JobDataset`` that may start the service or a
``DataLoader`` whose workers start; the slowest job's), the *span* from the last loader built to the
last batch (the loading itself, once every interpreter is up), and CPU-seconds per delivered
image, by process (the job processes, the service, its decode processes, the DataLoaders'
workers) and by stage (imports; read, decode and own augmentation: thread seconds of the
service's pool or CPU seconds of the DataLoader workers; copy out of shared memory in the
job; waiting: the jobs' seconds blocked on their next batch, not CPU). The service's CPU and
counters are read before it is stopped (SIGTERM) after the run, so the next run is cold too.

Every table is printed with the machine's CPU model and SIMD level (:func:`machine`): a
kernel's cost differs several-fold between CPUs of one family.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

__all__ = [
    "SCRIPTS",
    "Job",
    "Machine",
    "ScenarioRun",
    "TargetRow",
    "machine",
    "measure",
    "report",
    "run_dataloaders",
    "run_tabloader",
    "stop_service",
]

SCRIPTS = Path(__file__).parent / "scripts"
RUN_TIMEOUT_S = 1800.0
STOP_TIMEOUT_S = 60.0


class Machine(TypedDict):
    """What a table's header says of the machine (:func:`machine`)."""

    cpu: str
    simd: str
    kernel: str
    cores: int | None
    torch: str
    torchvision: str | None


class ScriptSpec(TypedDict, total=False):
    """A script's argument (JSON): its job (``train_tabloader.py``) or its DataLoader's
    recipe (``train_dataloader.py``), the step, and where its result goes."""

    catalog: str
    job: str
    folder: str
    recipe: str
    size: int
    batch_size: int
    workers: int
    seed: int
    step: float
    out: str


class ScriptResult(TypedDict, total=False):
    """A script's result (JSON): its clock (``time.time()``) at each point, rows, CPU and the
    seconds of its stages; the DataLoader's also its workers' CPU and transforms."""

    start: float
    imported: float
    building: float
    built: float
    first: float
    first_rows: int
    end: float
    rows: int
    wait_s: float
    cpu_s: float
    cpu_imports_s: float
    workers_cpu_s: float
    stages_s: dict[str, float]
    transforms: str
    service_pid: int | None


class Launch(TypedDict):
    """One launch of a run's scripts: when, the wall to the last exit, each one's result."""

    launch: float
    wall_s: float
    results: list[ScriptResult]


class ServiceUsage(TypedDict):
    """The auto-started service's counters, CPU and peak RSS after a tabloader run."""

    pid: int
    cpu_s: float
    decode_procs_cpu_s: float
    peak_rss_mib: float
    decodes: int
    reads: int
    threads_s: dict[str, float]
    augment_s: float
    cache: dict[str, int]


class Summary(TypedDict):
    """A run's numbers (:func:`summarize`)."""

    competitor: str
    jobs: int
    wall_s: float
    images: int
    images_per_s: float
    first_batch_s: float
    imports_s: float
    span_s: float
    after_first_images_per_s: float
    launch_to_first_s: float
    cpu_s: float
    cpu_ms_per_image: float
    cpu_ms_per_image_by_process: dict[str, float]
    stage_s: dict[str, float]
    service: ServiceUsage | None
    transforms: list[str]
    processes: list[ScriptResult]


class ScenarioRun(Summary):
    """A competitor's median run of a scenario at a step, with every run's wall."""

    scenario: str
    step: float
    wall_s_runs: list[float]


class TargetRow(TypedDict):
    """A row of the targets table: ``value`` against ``limit`` and the verdict."""

    target: str
    value: float
    limit: str
    result: str


@dataclass(frozen=True)
class Job:
    """One training job of a run: its name in the catalog (registered with its recipe) and,
    for the DataLoader competitors, the recipe it stands for (``train`` or ``eval``)."""

    name: str
    recipe: str
    seed: int = 0


def machine() -> Machine:
    """The CPU model, its SIMD level and core count, which resize kernel path tabloader runs
    (:func:`benchmarks.kernels.cpu_description`), torch's version and whether
    torchvision imports (tried in a fresh interpreter: a mismatched build may crash one)."""
    import torch

    from benchmarks.kernels import cpu_description

    info: Machine = {
        **cpu_description(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torchvision": None,
    }
    probe = "import torchvision; print(torchvision.__version__)"
    try:
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
        )
        info["torchvision"] = out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def machine_line(info: Machine) -> str:
    """``info`` (:func:`machine`) as one line for a table's header."""
    tv = info.get("torchvision") or "not installed"
    return (
        f"CPU: {info['cpu']} ({info['simd']}, {info['cores']} cores); torch "
        f"{info.get('torch', '?')}, torchvision {tv}; tabloader resize kernel: "
        f"{info.get('kernel', '?')}"
    )


def stop_service(root: Path) -> None:
    """Stop the catalog's service if one runs (SIGTERM; SIGKILL after a minute) and wait
    until it is gone, so that the next run starts a cold one."""
    from tabloader.service import service_pid

    pid = service_pid(root)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while service_pid(root) == pid:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.02)


def _launch(specs: list[tuple[str, ScriptSpec]], tmp: Path) -> Launch:
    """Run ``python SCRIPT SPEC`` for each ``(script, spec)`` at once; their results."""
    procs = []
    launch = time.time()
    for i, (script, spec) in enumerate(specs):
        spec = {**spec, "out": str(tmp / f"result-{i}.json")}
        log = open(tmp / f"log-{i}.txt", "wb")  # noqa: SIM115 - closed below
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(SCRIPTS / script), json.dumps(spec)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        for proc, _ in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
        exit_last = time.time()
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    results: list[ScriptResult] = []
    for i, (proc, _) in enumerate(procs):
        if proc.returncode != 0 or not (tmp / f"result-{i}.json").exists():
            text = (tmp / f"log-{i}.txt").read_text(errors="replace")
            raise RuntimeError(f"benchmark job {i} ({specs[i][0]}) failed:\n{text[-3000:]}")
        results.append(json.loads((tmp / f"result-{i}.json").read_text()))
    return {"launch": launch, "wall_s": exit_last - launch, "results": results}


def _proc_cpu(pid: int) -> tuple[float, float]:
    """(CPU seconds of process ``pid`` itself, of its reaped children) from ``/proc``."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    rest = stat[stat.rfind(")") + 2 :].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (float(rest[11]) + float(rest[12])) / tick, (float(rest[13]) + float(rest[14])) / tick


def _service_usage(root: Path) -> ServiceUsage:
    """The running service's counters, CPU (itself and its decode processes) and peak RSS."""
    from benchmarks._procs import peak_rss_of, tree_cpu_s
    from tabloader.service import RemoteLoader, service_pid

    pid = service_pid(root)
    if pid is None:
        raise RuntimeError(f"no service runs for {root} after a tabloader run")
    remote = RemoteLoader(root, start=False)
    try:
        stats = remote.stats()
    finally:
        remote.close()
    own, reaped = _proc_cpu(pid)
    tree = tree_cpu_s(pid)
    return {
        "pid": pid,
        "cpu_s": own,
        "decode_procs_cpu_s": max(0.0, tree - own) + reaped,
        "peak_rss_mib": peak_rss_of(pid),
        "decodes": int(stats["decodes"]),
        "reads": int(stats["reads"]),
        "threads_s": {
            k: sum(float(d.get(k, 0.0)) for d in stats.get("datasets", {}).values())
            for k in ("read_s", "decode_s", "collate_s")
        },
        "augment_s": sum(
            float(d.get("augment_s", 0.0)) for d in stats.get("datasets", {}).values()
        ),
        "cache": {k: stats["cache"][k] for k in ("entries", "size_bytes")},
    }


def run_tabloader(root: Path, jobs: list[Job], *, step: float) -> Summary:
    """``len(jobs)`` processes of ``train_tabloader.py`` at once, the first of which starts the
    catalog's service (none runs before); the run's summary (:func:`summarize`)."""
    stop_service(root)
    specs: list[tuple[str, ScriptSpec]] = [
        ("train_tabloader.py", {"catalog": str(root), "job": j.name, "step": step}) for j in jobs
    ]
    with tempfile.TemporaryDirectory(prefix="tabloader-launched-") as tmp:
        try:
            out = _launch(specs, Path(tmp))
            service = _service_usage(root)
        finally:
            stop_service(root)
    return summarize("tabloader", out, service)


def run_dataloaders(
    folder: Path, jobs: list[Job], *, size: int, batch_size: int, workers: int, step: float
) -> Summary:
    """``len(jobs)`` processes of ``train_dataloader.py`` at once; the run's summary."""
    specs: list[tuple[str, ScriptSpec]] = [
        (
            "train_dataloader.py",
            {
                "folder": str(folder),
                "recipe": j.recipe,
                "size": size,
                "batch_size": batch_size,
                "workers": workers,
                "seed": j.seed,
                "step": step,
            },
        )
        for j in jobs
    ]
    with tempfile.TemporaryDirectory(prefix="tabloader-launched-") as tmp:
        out = _launch(specs, Path(tmp))
    return summarize(f"dataloader({workers})", out, None)


def summarize(name: str, out: Launch, service: ServiceUsage | None) -> Summary:
    """A run's numbers: wall, images, images/s, first batch, span, CPU by process and stage."""
    res = out["results"]
    launch = out["launch"]
    images = sum(r["rows"] for r in res)
    last_built = max(r["built"] for r in res)
    last_batch = max(r["end"] for r in res)
    clients = sum(r["cpu_s"] for r in res)
    by_process = {"jobs": clients}
    stages: dict[str, float] = {"imports": sum(r["cpu_imports_s"] for r in res)}
    for r in res:
        for k, v in r.get("stages_s", {}).items():
            stages[k] = stages.get(k, 0.0) + v
    if service is not None:
        by_process["service"] = service["cpu_s"]
        by_process["decode processes"] = service["decode_procs_cpu_s"]
        t = service["threads_s"]
        stages["read"] = stages.get("read", 0.0) + t["read_s"]
        stages["decode"] = stages.get("decode", 0.0) + t["decode_s"]
        stages["augment"] = stages.get("augment", 0.0) + service["augment_s"]
    else:
        by_process["dataloader workers"] = sum(r.get("workers_cpu_s", 0.0) for r in res)
    stages["waiting (not CPU)"] = sum(r["wait_s"] for r in res)
    cpu = sum(by_process.values())
    per_image = {k: v / images for k, v in by_process.items()} if images else {}
    return {
        "competitor": name,
        "jobs": len(res),
        "wall_s": out["wall_s"],
        "images": images,
        "images_per_s": images / out["wall_s"],
        "first_batch_s": max(r["first"] - r["building"] for r in res),
        "imports_s": max(r["imported"] - r["start"] for r in res),
        "span_s": last_batch - last_built,
        "after_first_images_per_s": _after_first(res),
        "launch_to_first_s": max(r["first"] - launch for r in res),
        "cpu_s": cpu,
        "cpu_ms_per_image": 1e3 * cpu / images if images else float("nan"),
        "cpu_ms_per_image_by_process": {k: 1e3 * v for k, v in per_image.items()},
        "stage_s": stages,
        "service": service,
        "transforms": sorted({r["transforms"] for r in res if "transforms" in r}),
        "processes": res,
    }


def _after_first(res: list[ScriptResult]) -> float:
    """Images per second after each job's first batch (the jobs' rows after it, over the
    time from the first job's first batch to the last batch)."""
    first = min(r["first"] for r in res)
    last = max(r["end"] for r in res)
    rows = sum(r["rows"] - r["first_rows"] for r in res)
    return float(rows / max(last - first, 1e-9))


# -- scenarios -----------------------------------------------------------------------------------
TRAIN = "RandomResizedCrop({size}), RandomHorizontalFlip()"


@dataclass(frozen=True)
class Scenario:
    """``jobs`` jobs at once on every row, each with the ``recipe`` (``train``: the training
    recipe with its own seed; ``eval``: ``image_size``)."""

    name: str
    jobs: int
    recipe: str

    def job_list(self) -> list[Job]:
        return [Job(f"{self.name}{i}", self.recipe, seed=i) for i in range(self.jobs)]


def register(root: Path, scenario: Scenario, *, size: int, batch_size: int) -> None:
    """Register the scenario's jobs (and no other: the jobs registered decide how a column is
    shared) in catalog ``root`` (no service runs for it)."""
    from tabloader import catalog

    stop_service(root)
    with catalog.open_catalog(root) as cat:
        for name in cat.job_names():
            cat.sql(f"UNREGISTER JOB {name}")
        for j in scenario.job_list():
            recipe = (
                f"augment = '{TRAIN.format(size=size)}', seed = {j.seed}"
                if j.recipe == "train"
                else f"image_size = {size}"
            )
            cat.sql(
                f"REGISTER JOB {j.name} SELECT image, label FROM imgs "
                f"WITH (batch_size = {batch_size}, {recipe})"
            )


def run_scenarios(
    root: Path,
    folder: Path,
    scenarios: list[Scenario],
    *,
    steps: list[float],
    workers: list[int],
    size: int,
    batch_size: int,
    repeat: int,
    log: Any = print,
) -> list[ScenarioRun]:
    """Each scenario x step: tabloader and the DataLoaders with each of ``workers``, ``repeat``
    times interleaved (each competitor first in turn: a shared machine drifts); the run of
    median wall time of each competitor, with every run's wall (``wall_s_runs``)."""
    out: list[ScenarioRun] = []
    names = ["tabloader", *(f"dataloader({w})" for w in dict.fromkeys(workers))]
    for scenario in scenarios:
        register(root, scenario, size=size, batch_size=batch_size)
        jobs = scenario.job_list()
        for step in steps:
            runs: dict[str, list[Summary]] = {n: [] for n in names}
            for k in range(repeat):
                for name in names[k % len(names) :] + names[: k % len(names)]:
                    if name == "tabloader":
                        r = run_tabloader(root, jobs, step=step)
                    else:
                        w = int(name[len("dataloader(") : -1])
                        r = run_dataloaders(
                            folder, jobs, size=size, batch_size=batch_size, workers=w, step=step
                        )
                    log(
                        f"  {scenario.name} x{scenario.jobs} step {step:g}: {name} "
                        f"{r['wall_s']:.2f} s"
                    )
                    runs[name].append(r)
            for rs in runs.values():
                median = sorted(rs, key=lambda r: r["wall_s"])[(len(rs) - 1) // 2]
                out.append(
                    {
                        "scenario": scenario.name,
                        "jobs": scenario.jobs,
                        "step": step,
                        **median,
                        "wall_s_runs": [r["wall_s"] for r in rs],
                    }
                )
    return out


def measure(
    args: argparse.Namespace,
    scenarios: list[Scenario],
    *,
    steps: list[float],
    size: int,
    batch_size: int,
    repeat: int,
) -> tuple[Machine, int, list[ScenarioRun]]:
    """The machine, the image count and the runs of ``scenarios`` on ``args.images``
    generated images (:func:`run_scenarios`; DataLoaders of 2 workers and of the cores)."""
    from benchmarks.imagedata import prepare
    from tabloader.catalog import disable_progress_bars

    disable_progress_bars()
    root, n, _ = prepare(args)
    folder = Path(args.data) / f"images-{args.images}"
    info = machine()
    runs = run_scenarios(
        root,
        folder,
        scenarios,
        steps=steps,
        workers=[2, os.cpu_count() or 2],
        size=size,
        batch_size=batch_size,
        repeat=repeat,
    )
    return info, n, runs


def report(
    info: Machine, header: str, runs: list[ScenarioRun], checked: list[TargetRow], *notes: str
) -> None:
    """Print the machine, ``header``, the runs' table, any ``notes`` and the targets."""
    from benchmarks import format_table

    print(machine_line(info))
    print(header)
    print(format_table(table_rows(runs)))
    for note in notes:
        print()
        print(note)
    print()
    print(format_table(checked))


def table_rows(runs: list[ScenarioRun]) -> list[dict[str, object]]:
    """One line per run for ``format_table``."""
    rows = []
    for r in runs:
        by = r["cpu_ms_per_image_by_process"]
        st = r["stage_s"]
        rows.append(
            {
                "scenario": f"{r['scenario']} x{r['jobs']}",
                "step s": r["step"],
                "competitor": r["competitor"],
                "wall s": round(r["wall_s"], 2),
                "runs": "-".join(
                    f"{w:.1f}" for w in (min(r["wall_s_runs"]), max(r["wall_s_runs"]))
                ),
                "img/s": round(r["images_per_s"]),
                "first batch s": round(r["first_batch_s"], 3),
                "imports s": round(r["imports_s"], 2),
                "span s": round(r["span_s"], 2),
                "CPU ms/img": round(r["cpu_ms_per_image"], 3),
                "by process": " ".join(f"{k} {v:.3f}" for k, v in by.items()),
                "by stage s": " ".join(f"{k} {v:.1f}" for k, v in st.items()),
            }
        )
    return rows


def check(
    rows: list[TargetRow], what: str, value: float, limit: float, *, at_least: bool = False
) -> None:
    """Append a target row: ``value`` against ``limit`` (at most, or ``at_least``)."""
    ok = value >= limit if at_least else value <= limit
    rows.append(
        {
            "target": what,
            "value": round(value, 3),
            "limit": f"{'>=' if at_least else '<='} {limit:g}",
            "result": "PASS" if ok else "FAIL",
        }
    )


def pick(
    runs: list[ScenarioRun], scenario: str, competitor: str, step: float = 0.0
) -> ScenarioRun | None:
    """The run of ``competitor`` in ``scenario`` at ``step``, if it ran."""
    for r in runs:
        if r["scenario"] == scenario and r["competitor"] == competitor and r["step"] == step:
            return r
    return None
