"""Attacks on the shared service from one client, each beside an observer job on the same dataset.

What isolation asks (issue 45): an attack (a resume state whose epoch is no epoch, a forged
bitmap or importance state, a world size no job has, release tickets and report payloads of
the wrong type, a mangled batch layout), sent straight onto the wire as another program
would, fails the attacker alone with one clean error; the observer reads every epoch exactly
once and never waits over ``STALL_S`` for a batch; the service stays under ``RSS_LIMIT_MIB``;
the attacker's job opens again. ``tests/service/test_service_faults.py`` asserts it for every
attack; ``python -m benchmarks isolation`` prints it as a table.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tabloader.catalog import TabloaderError

__all__ = [
    "ATTACKS",
    "EPOCHS_AFTER",
    "RSS_LIMIT_MIB",
    "STALL_S",
    "STEP_S",
    "Attack",
    "Observer",
    "RssWatch",
    "Target",
    "make_catalog",
    "passed",
    "run_attack",
]


def proc_status_mib(pid: int | str, field: str) -> float | None:
    """``field`` of ``/proc/PID/status`` in MiB; None where it cannot be read (gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


STALL_S = 1.0  # the longest the observer may wait for a batch, during any attack
RSS_LIMIT_MIB = 1024.0  # the service's peak resident memory during an attack
STEP_S = 0.005  # the observer's "training" per batch
EPOCHS_AFTER = 2  # epochs the observer reads after an attack returned, within its window
WAIT_S = 60.0  # the longest anything here waits


def make_catalog(root: Path, rows: int = 64) -> None:
    """A catalog of one table ``t`` of ``rows`` labels and the jobs: ``obs`` (the observer,
    half the rows), ``att`` (the attacker's, every row) and ``imp`` (``importance = 'loss'``)."""
    import pyarrow as pa

    from tabloader import catalog

    with catalog.open_catalog(root) as cat:
        cat.import_arrow("t", pa.table({"label": np.arange(rows, dtype=np.int64) % 4}))
        cat.sql(f"REGISTER JOB obs SELECT label FROM t WHERE _id < {rows // 2}")
        cat.sql("REGISTER JOB att SELECT label FROM t")
        cat.sql("REGISTER JOB imp SELECT label FROM t WITH (importance = 'loss')")


# -- the attacks ----------------------------------------------------------------------------------
class Target:
    """What the attacks aim at: the service of catalog ``root``, and true states of its jobs
    ``att`` and ``imp`` to forge from."""

    def __init__(self, root: Path) -> None:
        from tabloader.service._client import RemoteLoader

        self.root = root
        with RemoteLoader(root, start=False) as remote:
            self.observed = remote.job_rows("obs")  # the observer's rows: 0 .. observed - 1
            with remote.open("att", batch_size=4) as stream:
                stream.take()
                self.state = stream.state_dict()
            with remote.open("imp", batch_size=4) as stream:
                stream.take()
                self.imp_state = stream.state_dict()

    @contextlib.contextmanager
    def client(self) -> Iterator[Any]:
        """A connection of the attacker's own."""
        from tabloader.service._protocol import Client

        client = Client(self.root)
        try:
            yield client
        finally:
            client.close()

    def open(self, job: str = "att", *, state: Any = None, **wire: Any) -> None:
        """Open ``job`` on a raw connection with a request whose fields ``wire`` replaces,
        with ``state`` (as it goes on the wire), then take its first batch: what the open
        costs shows there."""
        with self.client() as client:
            self.open_on(client, job, state=state, **wire)
            client.call("next")

    def open_on(self, client: Any, job: str, *, state: Any = None, **wire: Any) -> None:
        """Open ``job`` on ``client`` (as ``open``), keeping the connection."""
        from tabloader.engine._opening import OpenRequest

        request = OpenRequest.make(job, batch_size=4, rank=0, world_size=1).to_wire()
        request.update(wire, state=state)
        _, fds = client.call_fds("open", request=request)
        for fd in fds:
            os.close(fd)

    def forged(self, **fields: Any) -> dict[str, Any]:
        """``att``'s true state with ``fields`` replaced, as it goes on the wire."""
        from tabloader.engine._opening import state_to_wire

        return {**state_to_wire(self.state), **fields}

    def reopen(self) -> bool:
        """Whether the attacker's job opens and reads a batch now, as any job would."""
        from tabloader.service._client import RemoteLoader

        with RemoteLoader(self.root, start=False) as remote, remote.open("att") as stream:
            return stream.take() is not None


def _bitmap(rows: int) -> str:
    """A serialized bitmap of ``rows`` ids (run containers: a few KB), in hex."""
    from pyroaring import BitMap

    bitmap = BitMap()
    bitmap.add_range(0, rows)
    bitmap.run_optimize()
    return str(bitmap.serialize().hex())


def _importance(target: Target, rows: int) -> None:
    """Resume ``imp`` from a state whose scores name ``rows`` row ids."""
    from tabloader.engine._opening import state_to_wire

    state = state_to_wire(target.imp_state)
    ranks = zlib.compress(b"").hex()  # (their count is checked after the ids')
    state["importance"] = {**state["importance"], "ids": _bitmap(rows), "ranks": ranks}
    target.open("imp", state=state)


def _draws(target: Target, rows: int) -> None:
    """Resume ``imp`` from a state whose draws say ``rows`` rows were drawn ahead."""
    from tabloader.engine._opening import state_to_wire

    state = state_to_wire(target.imp_state)
    epoch = target.imp_state["epoch"]
    draws = {"entropy": 1, "key": 0, "round": 0, "frozen": [], "epochs": [[epoch, rows]]}
    state["draws"] = {**draws, "rows": bytes(4 * rows).hex()}
    target.open("imp", state=state)


def _report(target: Target, **payload: Any) -> None:
    """Report ``payload`` on an open ``imp`` stream of the attacker's."""
    with target.client() as client:
        target.open_on(client, "imp")
        client.call("next")
        client.call("report", **payload)


def _layouts(target: Target) -> None:
    """The client side: read mangled layouts of a true batch against the mapped memory; the
    first that is not refused is the attack's success."""
    from tabloader.catalog._errors import ServiceError
    from tabloader.engine._deliver.handoff import HandedBatch
    from tabloader.service._client import RemoteLoader

    rng = np.random.default_rng(45)
    junk: list[Any] = [-1, 2**70, 1e300, "8", [2**40, 2**40], "V0", "(2,)i4", None]
    with RemoteLoader(target.root, start=False) as remote, target.client() as client:
        memory = remote.arena
        target.open_on(client, "att")
        wire = client.call("next")["batch"]
        for _ in range(200):
            mangled = {**wire, "columns": [dict(c) for c in wire["columns"]]}
            col = mangled["columns"][rng.integers(len(mangled["columns"]))]
            col[["offset", "dtype", "shape", "rows"][rng.integers(4)]] = junk[rng.integers(8)]
            try:
                HandedBatch.from_wire(mangled, memory).copy_out(memory, remote.memory)
            except ServiceError:
                continue
            except Exception as exc:  # the attack found a raw error: report it as one
                raise RuntimeError(f"a mangled layout raised {exc!r}") from exc
    raise ServiceError("The loader service sent a malformed batch (every mangled layout)")


@dataclass(frozen=True)
class Attack:
    """One attack: what it sends, the one clean error it must get (a regex), and the call
    (on a ``Target``) that sends it."""

    what: str
    match: str
    run: Callable[[Target], None]


_EPOCH = r"The state's epoch .* is not an epoch from 0 to"
_RELEASE = r"'release' lists the tickets of batches a client is done with"
_OPTIONS = {"drop_last": False, "rank_timeout": 1}  # one rank a row at most; fail in 1 s


def _epoch(value: Any) -> Attack:
    return Attack(
        f"a state at epoch {value!r}", _EPOCH, lambda t: t.open(state=t.forged(epoch=value))
    )


def _world(size: int, match: str) -> Attack:
    return Attack(
        f"one rank of world_size {size} (drop_last false, rank_timeout 1)",
        match,
        lambda t: t.open(world_size=size, options=_OPTIONS),
    )


def _reporting(what: str, match: str, ids: Any, losses: Any) -> Attack:
    payload = {"ids": _hex(ids, "<i8"), "losses": _hex(losses, "<f8")}
    return Attack(what, match, lambda t: _report(t, **payload))


def _hex(values: Any, dtype: str) -> Any:
    return values if isinstance(values, str) else np.asarray(values, dtype).tobytes().hex()


ATTACKS: dict[str, Attack] = {
    "epoch 2**70": _epoch(2**70),
    "epoch 1e300": _epoch(1e300),
    "epoch -5": _epoch(-5),
    "epoch 10**18": _epoch(10**18),
    "epoch true": _epoch(True),
    "epoch 3.0": _epoch(3.0),
    "rows 2**32": Attack(
        "a state whose rows bitmap names 2**32 ids",
        r"not a non-empty subset of job 'att'",
        lambda t: t.open(state=t.forged(remaining=_bitmap(1 << 32))),
    ),
    "rows no bitmap": Attack(
        "a state whose rows are no bitmap",
        r"no bitmap|not a non-empty subset",
        lambda t: t.open(state=t.forged(remaining="3a30" + "ff" * 64)),
    ),
    "importance 2**27": Attack(
        "an importance state naming 2**27 rows",
        r"importance scores are bad: .*(more than 64 rows|not the job's 64)",
        lambda t: _importance(t, 1 << 27),
    ),
    "draws 2**20": Attack(
        "an importance state whose draws name 2**20 rows",
        r"the draws' epochs .* and their rows disagree",
        lambda t: _draws(t, 1 << 20),
    ),
    "world 10**6": _world(10**6, r"world_size <= 4096"),
    "world 65 > rows": _world(65, r"world_size=65: job 'att' has 64 rows, fewer than its ranks"),
    "world 48 never": _world(48, r"waited 1 s for ranks 1, 2, 3, 4, 5, 6, 7, 8 and 39 more"),
    "release 'x'": Attack("release=['x']", _RELEASE, lambda t: _call(t, "release", release=["x"])),
    "release {}": Attack("release={}", _RELEASE, lambda t: _call(t, "release", release={})),
    "report other rows": _reporting(
        "a report of rows not the job's", r"not rows of this job", [1000, 1001], [0, 0]
    ),
    "report nan": _reporting("a report of NaN losses", r"non-finite", [0, 1], [np.nan, 0]),
    "report lengths": _reporting(
        "a report of 2 ids, 1 loss", r"report got 2 ids and 1 losses", [0, 1], [0]
    ),
    "report not hex": _reporting("a report of no hex", r"'ids' is not hex", "zz" * 8, [0]),
    "layouts": Attack(
        "200 mangled batch layouts, read in the attacker's process", r"malformed batch", _layouts
    ),
}


def _call(target: Target, op: str, **args: Any) -> None:
    with target.client() as client:
        client.call(op, **args)


# -- the observer ---------------------------------------------------------------------------------
@dataclass
class Window:
    """What the observer did between two moments: its whole epochs and its longest wait."""

    epochs: list[list[int]]
    stall_s: float
    seconds: float

    def exact(self, rows: list[int]) -> bool:
        """Whether each epoch had each of ``rows`` once (and there was one)."""
        return bool(self.epochs) and all(sorted(e) == rows for e in self.epochs)

    def epochs_per_s(self) -> float:
        return len(self.epochs) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Observer:
    """Job ``job`` read epoch after epoch in a thread of this process, through the service of
    ``root``, ``STEP_S`` a batch; each batch's arrival and wait, each epoch's rows."""

    root: Path
    job: str = "obs"
    batch_size: int = 4
    arrivals: list[tuple[float, float]] = field(default_factory=list)  # (time, waited)
    epochs: list[tuple[float, float, list[int]]] = field(default_factory=list)  # (start, end)
    errors: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="observer", daemon=True)

    def __enter__(self) -> Observer:
        self._thread.start()
        self.wait_epochs(1, after=time.monotonic())
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)

    def _read(self) -> None:
        from tabloader.service._client import RemoteLoader

        try:
            with (
                RemoteLoader(self.root, start=False) as remote,
                remote.open(self.job, batch_size=self.batch_size) as stream,
            ):
                last = time.monotonic()
                while not self._stop.is_set():
                    start, ids = last, []
                    for batch in stream.iter_epoch():
                        now = time.monotonic()
                        self.arrivals.append((now, now - last))
                        ids += batch["_id"].tolist()
                        time.sleep(STEP_S)
                        last = time.monotonic()
                    self.epochs.append((start, last, ids))
        except BaseException as exc:  # the test and the bench report it
            self.errors.append(exc)

    def wait_epochs(self, n: int, *, after: float) -> None:
        """Return once ``n`` epochs began and ended after ``after`` (or the observer failed,
        or ``WAIT_S`` passed)."""
        deadline = time.monotonic() + WAIT_S
        while sum(s >= after for s, _, _ in self.epochs) < n and not self.errors:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)

    def window(self, t0: float, t1: float) -> Window:
        """Its epochs that ended between ``t0`` and ``t1``, and its longest wait for a batch
        that came then (or it waits now, if it has waited longer)."""
        waits = [w for t, w in self.arrivals if t0 <= t <= t1]
        if self.arrivals:
            waits.append(min(time.monotonic(), t1) - self.arrivals[-1][0] - STEP_S)
        return Window([ids for _, end, ids in self.epochs if t0 <= end <= t1], max(waits), t1 - t0)


class RssWatch:
    """The resident memory of process ``pid``, sampled every 10 ms in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rss", daemon=True)

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            mib = proc_status_mib(self.pid, "VmRSS")
            if mib is not None:
                self.samples.append((time.monotonic(), mib))

    def peak(self, t0: float, t1: float) -> float:
        """The most it held between ``t0`` and ``t1`` (MiB)."""
        return max([m for t, m in self.samples if t0 <= t <= t1] or [0.0])


def run_attack(target: Target, observer: Observer, watch: RssWatch, name: str) -> dict[str, Any]:
    """Run attack ``name`` beside the observer: its outcome (see the module docstring)."""
    from tabloader.service._protocol import LOG_FILE, runtime_dir

    attack = ATTACKS[name]
    log = runtime_dir(target.root) / LOG_FILE
    logged = log.stat().st_size if log.exists() else 0
    t0 = time.monotonic()
    error = None
    try:
        attack.run(target)
    except TabloaderError as exc:
        error = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # a raw error is a failed attack's outcome too
        error = f"{type(exc).__name__}: {exc}"
    attacked = time.monotonic()
    observer.wait_epochs(EPOCHS_AFTER, after=attacked)  # it reads on after the attack
    try:
        reopened = target.reopen()
    except TabloaderError:
        reopened = False
    t1 = time.monotonic()
    window = observer.window(t0, t1)
    with open(log, "rb") as written:
        written.seek(logged)
        traceback = b"Traceback" in written.read()
    return {
        "attack": name,
        "what": attack.what,
        "error": error,
        "refused": error is not None and re.search(attack.match, error) is not None,
        "attack_s": attacked - t0,
        "traceback_logged": traceback,
        "epochs": len(window.epochs),
        "exact": window.exact(list(range(target.observed))),
        "epochs_per_s": window.epochs_per_s(),
        "stall_s": window.stall_s,
        "peak_rss_mib": watch.peak(t0, t1),
        "reopened": reopened,
        "observer_errors": [repr(e) for e in observer.errors],
    }


def passed(outcome: dict[str, Any]) -> bool:
    """Whether an attack's outcome is what isolation asks (the module docstring)."""
    return bool(
        outcome["refused"]
        and not outcome["traceback_logged"]
        and outcome["exact"]
        and outcome["stall_s"] <= STALL_S
        and outcome["peak_rss_mib"] < RSS_LIMIT_MIB
        and outcome["reopened"]
        and not outcome["observer_errors"]
    )
