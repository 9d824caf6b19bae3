"""Benchmark ``isolation``: a job beside each attack on the shared service (issue 45).

One ``tabloader serve`` over a small table of labels; an *observer* job reads epoch after epoch
through it (``STEP_S`` of "training" a batch) while one client attacks the same dataset, one
attack at a time (``ATTACKS``): resume states whose epoch is no epoch, forged bitmaps and
importance scores, world sizes no job has, release tickets and report payloads of the wrong
type, mangled batch layouts. Each attack goes straight onto the wire (a raw connection, as
another program would), past the checks a tabloader client makes before it sends.

For each attack: the error the attacker got, the observer's epochs per second and its longest
wait for a batch before and during it, and the service's peak resident memory during it
(``VmRSS`` from ``/proc``, sampled). Verdict: PASS when the attacker got the one clean error it
should (``Attack.match``), no traceback was logged for it, the observer read every epoch
exactly once and never waited more than ``STALL_S`` for a batch, the attacker's job opens again
afterwards, and the service stayed under ``RSS_LIMIT_MIB``.

The attacks and the observer are the tests' own (``tests/support/attacks.py``):
``tests/service/test_service_faults.py`` asserts the same for each.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import format_table, main, write_json
from benchmarks._cpu import cpu_line
from tests.support.attacks import (
    ATTACKS,
    RSS_LIMIT_MIB,
    STALL_S,
    STEP_S,
    Observer,
    RssWatch,
    Target,
    make_catalog,
    passed,
    run_attack,
)

__all__ = ["add_arguments", "run"]


# -- the benchmark --------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--quick", action="store_true", help="a few attacks (a smoke run)")
    parser.add_argument("--rows", type=int, default=64, help="rows of the table")
    parser.add_argument("--before", type=float, default=3.0, help="s of the observer alone")
    parser.add_argument("--out", default="bench-results/isolation.json", help="JSON output")


QUICK = ("epoch 2**70", "world 10**6", "importance 2**27", "release 'x'")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build the catalog, start the service and the observer, then each attack beside it."""
    from benchmarks._procs import ServiceProcess

    work = Path(tempfile.mkdtemp(prefix="tl-iso-", dir="/tmp"))
    names = QUICK if args.quick else tuple(ATTACKS)
    try:
        make_catalog(work / "catalog", args.rows)
        with ServiceProcess(
            work / "catalog", cache_bytes=64 << 20, workers=2, log=work / "serve.log"
        ) as service:
            target = Target(work / "catalog")
            with Observer(target.root) as observer, RssWatch(service.proc.pid) as watch:
                t0 = time.monotonic()
                time.sleep(1.0 if args.quick else args.before)
                before = observer.window(t0, time.monotonic())
                outcomes = [run_attack(target, observer, watch, name) for name in names]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "cpu": cpu_line(),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "before": {"epochs_per_s": before.epochs_per_s(), "stall_s": before.stall_s},
        "attacks": outcomes,
    }


def table(result: dict[str, Any]) -> str:
    """The observer before and during each attack, the service's memory, the verdicts."""
    before = result["before"]
    rows = [
        {
            "attack": "(none: the observer alone)",
            "attacker got": "",
            "attack s": "",
            "epochs/s": round(before["epochs_per_s"], 1),
            "longest stall ms": round(before["stall_s"] * 1000, 1),
            "peak RSS MiB": "",
            "verdict": "",
        }
    ]
    for out in result["attacks"]:
        rows.append(
            {
                "attack": out["attack"],
                "attacker got": (out["error"] or "no error")[:60],
                "attack s": round(out["attack_s"], 2),
                "epochs/s": round(out["epochs_per_s"], 1),
                "longest stall ms": round(out["stall_s"] * 1000, 1),
                "peak RSS MiB": round(out["peak_rss_mib"]),
                "verdict": "PASS" if passed(out) else "FAIL",
            }
        )
    failed = [out["attack"] for out in result["attacks"] if not passed(out)]
    return (
        f"{result['cpu']}\n"
        f"one service; observer: job obs ({result['args']['rows'] // 2} rows of labels, "
        f"batches of 4, {STEP_S * 1000:.0f} ms a batch) beside each attack on its dataset\n"
        + format_table(rows, list(rows[0]))
        + f"\n\nPASS: the attacker's one clean error, observer exact, stall <= {STALL_S} s, "
        f"service RSS < {RSS_LIMIT_MIB:.0f} MiB, the job opens again: "
        + ("all PASS" if not failed else f"FAIL: {', '.join(failed)}")
    )


def run(args: argparse.Namespace) -> int:
    """Measure, print the table and write JSON."""
    result = measure(args)
    print(table(result))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    main(add_arguments, run, description=__doc__.splitlines()[0])
