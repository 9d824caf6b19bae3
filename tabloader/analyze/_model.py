"""The what-if model: seconds per epoch and stall fraction of a job from its measured rates.

DS-Analyzer's model (Mohan et al., VLDB'21) takes an epoch to last as long as its slowest
stage: the training loop's own steps, preparation (read and decode on the CPU), and fetching
(from the cache, or from storage). Here it is written per epoch of one fresh training process,
extended for what the loader service shares (``docs/analyze.md`` says it in words):

* **Decodes per epoch** come from the jobs' rows and the cache. ``J`` jobs read at the same
  pace (the same batch size and step; the service paces them by epoch size when it is the
  bottleneck); the dependent sampler makes them ask for a shared row at about the same time,
  so each row of the union ``U`` of their rows is decoded once in the first epoch, and in each
  later one every row the cache could not keep: ``U - H``, where ``H`` is the rows the cache
  holds besides the batches pinned in flight (its eviction by next use keeps rows that will be
  read again). Decodes per delivered row: ``decodes / (J * N)``.
* **CPU**: decode processes spend ``decode_cpu_s`` a decoded row, the service
  ``service_decode_cpu_s`` more a decoded row and ``service_cpu_s`` a delivered one (hand-over,
  augmentation), the clients ``client_cpu_s`` a delivered row (the copy out of the cache).
* **Cores**: the loader's work makes ``T`` busy threads (the ``w`` decode processes, and the
  service's and clients' CPU in their units: ``w * work / (X_e * decode_cpu_s)``); on a
  machine of its own each gets a core, up to the ``K`` cores. On a machine others use it gets
  part of that, measured: what its ``cold_one`` and ``cold`` runs got (their CPU over their
  wall) over what they would have had alone, on the line through both for other ``w`` (the
  scheduler favours threads that wait often, so a second decode process gets less than the
  first). ``K_w`` is that part times ``min(T, K)``; ``cores=C`` predicts a machine of ``C``
  cores of its own.

Per epoch ``e`` (``N`` rows of the job, ``N / b`` batches, step ``s``), with ``X_e`` decodes
and ``D = J * N`` deliveries::

    loop     = N/b * (s + late_s + step_wait_s)  the loop's steps (and how late its sleeps end),
                                                 and its wait when all is cached (the copy out)
    deliver  = N/b * batch_s                     batches from the cache back to back (s = 0)
    cpu      = (X_e * (decode_cpu_s + service_decode_cpu_s)
                + D * (service_cpu_s + client_cpu_s)) / K_w
    decode   = X_e * (decode_cpu_s + io_s) / min(w, K_w)    each decode process in turn; io_s:
                                                 the wall a read waits on storage
    storage  = X_e * stored_bytes / bandwidth    (storage_mbps)
    epoch_e  = max(loop, deliver, cpu, decode, storage) (+ first_s, the first batch, in epoch 1)
    stall_e  = 1 - N/b * (s + late_s) / epoch_e  the share of the epoch the loop waited

Where it is wrong: the stages overlap perfectly in the max (near a crossing, queueing makes
real epochs longer); the machine's other load is taken as it was during the analysis; jobs of
other sizes or speeds share less than the union (``DESIGN.md`` section 17).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tabloader.catalog._errors import TabloaderError

EPOCH_BOUNDS = ("loop", "decode", "storage", "cpu", "deliver")
"""The stages an epoch can be bound by (``Prediction.bound``; of two equal, the first)."""


MIN_CORES = 0.05  # the least the model gives the loader however busy the machine was


class WhatIfError(TabloaderError, ValueError):
    """A ``--what-if`` that is not ``key=value,...`` of the known keys."""


@dataclass(frozen=True)
class Rates:
    """What the model predicts from: one job's measured rates (per row: seconds a row).

    ``overlaps`` are the other registered jobs' rows and the rows the union of the job's and
    theirs grows to, taking them in order (``(rows, union)``: the ``jobs`` what-if takes the
    first ``J - 1`` of them, then copies of the job).
    """

    rows: int  # the job's rows, an epoch
    batch_size: int
    step_s: float  # the loop's seconds a batch (the analysis' --step)
    cores: float  # the machine's
    got_cores: float  # the cores the loader got when it wanted them all (the cold run)
    got_one: float  # ... with one decode process (cold_one)
    threads_cores: float  # the busy threads its work in the cold run made (decoders' units)
    threads_one: float  # ... in the cold_one run
    workers: int  # decode processes
    cache_bytes: int
    value_bytes: float  # arena bytes of one prepared value (its slot)
    values_per_row: float  # prepared values a row (image columns)
    decode_cpu_s: float  # a decode process's CPU a decoded row (read from the page cache)
    read_share: float  # the part of it reading (the rest: decoding and resizing)
    storage_s: float  # the wall a read from storage adds to a row (not in the page cache)
    stored_bytes: float  # bytes read a decoded row
    service_decode_cpu_s: float  # the service's CPU a decoded row
    service_cpu_s: float  # the service's CPU a delivered row (hand-over, augmentation)
    augment_s: float  # of the service's seconds a delivered row: the job's augmentation
    client_cpu_s: float  # the client's CPU a delivered row (copy out)
    batch_s: float  # wall between batches all cached, no step
    step_wait_s: float  # a batch's wait all cached, with the step (the reply, the copy out)
    late_s: float  # how late the step's sleep ended a batch (a busy machine's wake-ups)
    first_s: float  # the first batch of a fresh open, cold
    overlaps: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class WhatIf:
    """One configuration to predict; None keeps the measured value.

    Keys: ``workers`` (decode processes), ``cache_bytes``, ``jobs`` (jobs reading at once,
    this one included), ``storage_mbps`` (reads from storage at this many MB/s, nothing in the
    page cache), ``cores`` (a machine of that many cores and no other load), ``step`` (the
    loop's seconds a batch).
    """

    workers: int | None = None
    cache_bytes: int | None = None
    jobs: int | None = None
    storage_mbps: float | None = None
    cores: float | None = None
    step: float | None = None

    def given(self) -> dict[str, Any]:
        """The keys set, as given."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def label(self) -> str:
        """The keys set, as ``--what-if`` takes them (bytes with a unit).

        Example:
            >>> WhatIf(workers=8, cache_bytes=6 << 20, storage_mbps=20.0).label()
            'workers=8,cache_bytes=6MiB,storage_mbps=20'
        """
        from tabloader.catalog._settings import format_bytes

        def show(key: str, value: Any) -> str:
            if key == "cache_bytes":
                return format_bytes(value).replace(".0 ", "").replace(" ", "")
            return f"{value:g}"

        return ",".join(f"{k}={show(k, v)}" for k, v in self.given().items())


@dataclass(frozen=True)
class Prediction:
    """The model's answer for one configuration over ``epochs`` epochs of a fresh process."""

    what_if: WhatIf
    epoch_s: float  # mean seconds an epoch
    stall_fraction: float  # of the whole run: the share of time the loop waited
    epochs_s: tuple[float, ...]  # each epoch
    stalls: tuple[float, ...]  # each epoch's stall fraction
    bound: tuple[str, ...]  # what bound each epoch (EPOCH_BOUNDS)
    decodes_per_row: float  # decodes a delivered row over the run
    stages_s: tuple[dict[str, float], ...] = field(default=(), repr=False)  # each epoch's terms

    def to_json(self) -> dict[str, Any]:
        return {
            "what_if": self.what_if.given(),
            "epoch_s": round(self.epoch_s, 4),
            "stall_fraction": round(self.stall_fraction, 4),
            "epochs_s": [round(x, 4) for x in self.epochs_s],
            "stalls": [round(x, 4) for x in self.stalls],
            "bound": list(self.bound),
            "decodes_per_row": round(self.decodes_per_row, 4),
        }


_KEYS = {
    "workers": int,
    "cache_bytes": int,
    "jobs": int,
    "storage_mbps": float,
    "cores": float,
    "step": float,
}


def parse_what_if(text: str) -> WhatIf:
    """``workers=2,cache_bytes=1GiB,jobs=3,storage_mbps=200`` (any subset; bytes take units).

    Example:
        >>> parse_what_if("workers=4,cache_bytes=64MiB").given()
        {'workers': 4, 'cache_bytes': 67108864}

    Raises:
        WhatIfError: an unknown key, a repeated one or a value out of range.
    """
    from tabloader.catalog._settings import parse_bytes

    values: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in _KEYS:
            raise WhatIfError(
                f"--what-if {text!r}: {part!r} is not KEY=VALUE with a KEY of "
                f"{', '.join(_KEYS)}; e.g. --what-if workers=4,cache_bytes=2GiB."
            )
        if key in values:
            raise WhatIfError(f"--what-if {text!r}: {key} is given twice.")
        try:
            number = parse_bytes(value) if key == "cache_bytes" else _KEYS[key](value)
        except (TabloaderError, ValueError):
            raise WhatIfError(
                f"--what-if {text!r}: {key}={value!r} is not a {_KEYS[key].__name__}."
            ) from None
        low = 0 if key == "step" else 1 if key in ("workers", "jobs", "cache_bytes") else 1e-9
        if not math.isfinite(number) or number < low:
            raise WhatIfError(f"--what-if {text!r}: {key}={value} must be at least {low}.")
        values[key] = number
    return WhatIf(**values)


EXAMPLE: dict[str, Any] = {
    "rows": 1000,
    "batch_size": 50,
    "step_s": 0.0,
    "cores": 8,
    "got_cores": 1.0,
    "got_one": 1.0,
    "threads_cores": 1.0,
    "threads_one": 1.0,
    "workers": 1,
    "cache_bytes": 1 << 30,
    "value_bytes": 12288,
    "values_per_row": 1,
    "decode_cpu_s": 0.002,
    "read_share": 0.1,
    "storage_s": 0.0,
    "stored_bytes": 8e4,
    "service_decode_cpu_s": 0.0,
    "service_cpu_s": 0.0,
    "augment_s": 0.0,
    "client_cpu_s": 0.0,
    "batch_s": 0.001,
    "step_wait_s": 0.0,
    "late_s": 0.0,
    "first_s": 0.0,
}
"""Rates of a made-up job, for the examples: decode-bound, 2 ms of CPU a row."""


def _jobs(rates: Rates, jobs: int) -> tuple[int, int]:
    """(rows of the union, rows delivered an epoch of ours) of ``jobs`` jobs: the registered
    others in order, then copies of this one (the same rows)."""
    union = rates.rows
    for _rows, grown in rates.overlaps[: jobs - 1]:
        union = grown
    return union, jobs * rates.rows


def available_cores(
    rates: Rates, workers: int, threads: float, cores: float | None = None
) -> float:
    """The cores the loader gets with ``workers`` decode processes and work enough for
    ``threads`` busy threads: each busy thread a core, up to the machine's, times the part of
    that the machine left it in the analysis (``got / min(cores, threads)`` of the ``cold_one``
    and ``cold`` runs; between and beyond them on the line through both, at most all). With
    ``cores``, a machine of that many cores of its own: all of it.

    Example:
        >>> r = Rates(**{**EXAMPLE, "cores": 2, "workers": 2, "got_one": 0.6, "got_cores": 1.0,
        ...     "threads_one": 1.2, "threads_cores": 2.4})
        >>> [round(available_cores(r, w, t), 2) for w, t in ((1, 1.2), (2, 2.4), (1, 1.8))]
        [0.6, 1.0, 0.9]
        >>> available_cores(r, 8, 9.0, cores=8)
        8
    """
    if cores is not None:
        return max(MIN_CORES, min(cores, threads))
    k = rates.cores
    one = rates.got_one / max(MIN_CORES, min(k, rates.threads_one))
    most = rates.got_cores / max(MIN_CORES, min(k, rates.threads_cores))
    measured = min(rates.workers, k)
    part = (min(workers, k) - 1) / (measured - 1) if measured > 1 else 0.0
    left = min(1.0, max(MIN_CORES, one + (most - one) * part))
    return max(MIN_CORES, left * min(k, threads))


def cache_rows(rates: Rates, cache_bytes: int, jobs: int, workers: int) -> int:
    """Rows the cache keeps across epochs: its capacity in the job's values, less the batches
    every job holds pinned (its prefetch, one at the client and one read ahead)."""
    from tabloader.engine._arena.arena import values_that_fit
    from tabloader.engine._queue.jobs import default_prefetch

    if rates.value_bytes <= 0 or rates.values_per_row <= 0:
        return 0
    b = rates.batch_size
    row_bytes = rates.value_bytes * rates.values_per_row
    one = int(b * row_bytes)
    prefetch = min(default_prefetch(workers, b, one), max(1, cache_bytes // max(1, one) - 2))
    slots = values_that_fit(cache_bytes, int(rates.value_bytes))
    return max(0, int(slots / rates.values_per_row) - jobs * (prefetch + 2) * b)


def predict(rates: Rates, what_if: WhatIf = WhatIf(), *, epochs: int = 1) -> Prediction:
    """The model's seconds per epoch and stall fraction of ``what_if`` (see the module).

    Example:
        >>> rates = Rates(**EXAMPLE)   # 1000 rows decoding in 2 ms of CPU each, on 8 cores
        >>> one = predict(rates, WhatIf(step=0.05))        # decode-bound: 2 s against 1 s
        >>> one.epoch_s, one.bound, round(one.stall_fraction, 2)
        (2.0, ('decode',), 0.5)
        >>> predict(rates, WhatIf(step=0.05, workers=2)).bound  # twice the workers: the loop
        ('loop',)
    """
    if epochs < 1:
        raise WhatIfError(f"epochs={epochs}: predict at least 1 epoch.")
    workers = what_if.workers or rates.workers
    cache = what_if.cache_bytes or rates.cache_bytes
    jobs = what_if.jobs or 1
    step = rates.step_s if what_if.step is None else what_if.step
    batches = math.ceil(rates.rows / rates.batch_size)
    union, delivered = _jobs(rates, jobs)
    keep = cache_rows(rates, cache, jobs, workers)
    io = rates.storage_s if what_if.storage_mbps is not None else 0.0
    per_decode = rates.decode_cpu_s + rates.service_decode_cpu_s
    per_row = rates.service_cpu_s + rates.client_cpu_s
    # with a step, a batch is the step, its lateness and a wait; with none, back to back
    own = step + rates.late_s if step > 0 else 0.0
    wait = rates.step_wait_s if step > 0 else 0.0
    times, stalls, bounds, stages = [], [], [], []
    decoded = 0
    for e in range(epochs):
        x = union if e == 0 else max(0, union - keep)
        decoded += x
        work = x * per_decode + delivered * per_row
        # busy threads: the decode processes, and the rest of the work in their units
        threads = workers * work / (x * rates.decode_cpu_s) if x else 1.0 + jobs
        available = available_cores(rates, workers, threads, what_if.cores)
        terms = {
            "loop": batches * (own + wait),
            "deliver": batches * rates.batch_s,
            "cpu": work / available,
            "decode": x * (rates.decode_cpu_s + io) / min(workers, available),
            "storage": (
                x * rates.stored_bytes / (what_if.storage_mbps * 1e6)
                if what_if.storage_mbps
                else 0.0
            ),
        }
        bound = max(EPOCH_BOUNDS, key=lambda k: terms[k])
        seconds = terms[bound] + (rates.first_s if e == 0 else 0.0)
        times.append(seconds)
        stalls.append(max(0.0, 1 - batches * own / seconds) if seconds > 0 else 0.0)
        bounds.append(bound)
        stages.append(terms)
    total = sum(times)
    return Prediction(
        what_if=what_if,
        epoch_s=total / epochs,
        stall_fraction=max(0.0, 1 - epochs * batches * own / total) if total > 0 else 0.0,
        epochs_s=tuple(times),
        stalls=tuple(stalls),
        bound=tuple(bounds),
        decodes_per_row=decoded / (delivered * epochs),
        stages_s=tuple(stages),
    )
