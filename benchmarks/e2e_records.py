"""What ``bench e2e``'s runner and its child processes exchange, and what it reports.

A child's :class:`Spec` goes out as JSON (``--child``); a job process writes a
:class:`JobResult`, the in-process mode prints a :class:`Run`; the runner sums a competitor's
processes into a :class:`Run`, keeps the median of each competitor per scenario in a
:class:`ScenarioRuns`, and checks them as :class:`Target` rows. All are plain dicts at run time
(the JSON output is theirs as they are).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict

from benchmarks.e2e_scenarios import ScenarioJob
from benchmarks.stalls import Stalls

if TYPE_CHECKING:
    from tests.support.cachesim import Belady

__all__ = ["JobResult", "Overhead", "Run", "ScenarioRuns", "Spec", "Target"]


class Spec(TypedDict, total=False):
    """A child process's spec: its ``role`` (``threads``, ``job`` or ``overhead``) and what
    that role reads; ``sync`` and ``index`` are added by :func:`benchmarks._procs.run_jobs`."""

    role: str
    catalog: str
    jobs: list[ScenarioJob]
    batch_size: int
    image_size: int
    workers: int
    cache_bytes: int
    service_cache_bytes: int
    competitor: str  # threads: the sampler
    access_log: str
    kind: str  # job: "service" or "dataloader"
    job: ScenarioJob
    ids_file: str
    rows_total: int
    rows: int  # overhead: the job's rows, the image side, batches timed, sleep before each
    size: int
    samples: int
    settle: float
    sync: str
    index: int


class JobRun(Stalls):
    """A job's rows, seconds and stalls in a run."""

    rows: int
    seconds: float


class JobResult(JobRun):
    """What a job process writes: its run, clock, CPU and memory; a service client's copies,
    a DataLoader's transforms."""

    name: str
    start: float
    end: float
    cpu_s: float
    peak_rss_mib: float
    copies: NotRequired[dict[str, int]]
    transforms: NotRequired[str]


class Run(TypedDict):
    """A competitor's run: wall, CPU, peak RSS, decodes and reads, its jobs, the loader's
    thread seconds (none for DataLoaders) and its cache; the runner adds the rest."""

    wall_s: float
    cpu_s: float
    peak_rss_mib: float
    decodes: int
    reads: int
    jobs: dict[str, JobRun]
    dataset_s: dict[str, float] | None
    cache: dict[str, int] | None
    service_pids: NotRequired[list[int]]
    transforms: NotRequired[str]
    copies: NotRequired[dict[str, int]]
    access_log: NotRequired[Path]
    wall_s_runs: NotRequired[list[float]]
    belady: NotRequired[Belady]


class ScenarioRuns(TypedDict):
    """A scenario's union and sets of rows, each competitor's median run, and the service's
    runs of the fastest job alone and of the evaluation job alone."""

    union: int
    sets: list[int]
    results: dict[str, Run]
    fastest_alone: Run | None
    fastest_alone_rows_per_s: float | None
    center_crop_alone: Run | None
    row_bytes: int
    cache_bytes: dict[str, int]


class Overhead(TypedDict):
    """Request -> tensors ready, in microseconds, and a bare copy's floor."""

    end: float
    shape: list[int]
    samples: int
    p50_us: float
    p99_us: float
    mean_us: float
    copy_floor_us: float
    service_pids: NotRequired[list[int]]


class Target(TypedDict):
    """A row of the targets table: a scenario's ``value`` against its ``limit``."""

    scenario: str
    target: str
    value: float
    limit: str
    result: str
