"""Benchmark ``hostile``: a job keeps its speed beside a job whose dataset holds bombs.

Issue 36: a 3,981-byte progressive JPEG whose header says 65500x65500 took the service to
14.6 GB and 63 s for that one row, every epoch, and a job on another dataset of the same
service had a 33 s epoch instead of 2 s. Now the service refuses such a row from its header
and remembers it. This runs one ``tabloader serve`` over three image-folder datasets of small
JPEGs (96x72, read at ``image_size = 32``):

=============  ===========================================================================
``clean``      ``--images`` images: the neighbour job ``n`` times its epochs on it
``twin``       ``--other`` images: job ``t``, the reference second job
``bombs``      the same images plus ``--bombs`` bombs of every kind (``bench/bombs.py``):
               job ``b``, ``on_error = 'skip'``
=============  ===========================================================================

The neighbour's epoch is timed (median of ``--epochs``) alone, then while a second process
runs job ``t``, then while it runs job ``b``, each second job paced as training is
(``--step`` seconds per batch). Target: beside the bombs, the neighbour's epoch is within
1.5x of its time alone (``TARGET``); the twin's row shows what any second job costs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import format_table, main, positive_int, write_json
from benchmarks._cpu import cpu_line
from benchmarks._procs import ServiceProcess
from tests.support.bombs import KINDS, bomb, image_bytes

__all__ = ["TARGET", "add_arguments", "run"]

TARGET = 1.5  # the neighbour's epoch beside the bombs / alone
SUFFIX = {"progressive": "jpg", "jpeg": "jpg", "png": "png", "webp": "webp", "gif": "gif"}

# The second job, in its own process: epochs of ``job`` until ``seconds`` pass, ``step``
# seconds per batch; prints its rows and the rows it skipped.
_SECOND = """
import sys, time
from tabloader.service._client import RemoteLoader
root, job, seconds, step = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
rows = skipped = 0
with RemoteLoader(root, start=False) as remote:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with remote.open(job, batch_size=64, epochs=1) as stream:
            for batch in stream:
                rows += len(batch["_id"])
                time.sleep(step)
            skipped += stream.stats()["skipped"]
print(rows, skipped)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--images", type=positive_int, default=3000, help="the neighbour's rows")
    parser.add_argument("--other", type=positive_int, default=600, help="the second job's rows")
    parser.add_argument("--bombs", type=positive_int, default=20, help="bombs among them")
    parser.add_argument("--epochs", type=positive_int, default=5, help="neighbour epochs timed")
    parser.add_argument("--step", type=float, default=0.005, help="second job: s per batch")
    parser.add_argument("--out", default="bench-results/hostile.json", help="JSON output")


def _folder(path: Path, images: int, bombs: int) -> Path:
    (path / "a").mkdir(parents=True)
    picture = image_bytes("JPEG", (96, 72))
    for i in range(images):
        (path / "a" / f"{i:06d}.jpg").write_bytes(picture)
    for i in range(bombs):
        kind = KINDS[i % len(KINDS)]
        (path / "a" / f"bomb{i:04d}.{SUFFIX[kind]}").write_bytes(bomb(kind))
    return path


def _catalog(root: Path, args: argparse.Namespace) -> None:
    from tabloader import catalog

    with catalog.open_catalog(root / "catalog") as cat:
        cat.import_imagefolder("clean", _folder(root / "clean", args.images, 0))
        cat.import_imagefolder("twin", _folder(root / "twin", args.other, 0))
        cat.import_imagefolder("bombs", _folder(root / "bombs", args.other, args.bombs))
        cat.sql("REGISTER JOB n SELECT image FROM clean WITH (image_size = 32)")
        for job, ds in (("t", "twin"), ("b", "bombs")):
            cat.sql(
                f"REGISTER JOB {job} SELECT image FROM {ds} WITH (image_size = 32, "
                "on_error = 'skip')"
            )


def _epochs(root: Path, n: int) -> list[float]:
    from tabloader.service import RemoteLoader

    times = []
    with RemoteLoader(root, start=False) as remote:
        for _ in range(n):
            start = time.perf_counter()
            with remote.open("n", batch_size=64, epochs=1) as stream:
                for _batch in stream:
                    pass
            times.append(time.perf_counter() - start)
    return times


def _beside(root: Path, job: str, args: argparse.Namespace, warm: float) -> dict[str, Any]:
    """The neighbour's epochs while a second process runs ``job``."""
    seconds = warm * (args.epochs + 2) + 3.0  # the neighbour's epochs fall inside its run
    second = subprocess.Popen(
        [sys.executable, "-c", _SECOND, str(root), job, f"{seconds:.2f}", str(args.step)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(1.0)  # its imports and first epoch
        times = _epochs(root, args.epochs)
        out, err = second.communicate(timeout=seconds + 120)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    if second.returncode != 0:
        raise RuntimeError(f"the second job ({job}) failed: {err.strip()[-500:]}")
    rows, skipped = (int(v) for v in out.split())
    return {"epochs_s": times, "second_rows": rows, "second_skipped": skipped}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build the datasets, start the service, time the neighbour alone and beside each."""
    if args.quick:
        args.images, args.other, args.bombs, args.epochs = 300, 100, 5, 3
    work = Path(tempfile.mkdtemp(prefix="tabloader-hostile-"))
    try:
        _catalog(work, args)
        root = work / "catalog"
        with ServiceProcess(root, cache_bytes=256 << 20, workers=2, log=work / "serve.log"):
            _epochs(root, 1)  # the first epoch decodes; the rest read the cache
            alone = _epochs(root, args.epochs)
            warm = statistics.median(alone)
            twin = _beside(root, "t", args, warm)
            bombs = _beside(root, "b", args, warm)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "cpu": cpu_line(),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "alone_s": alone,
        "twin": twin,
        "bombs": bombs,
    }


def table(result: dict[str, Any]) -> str:
    """The neighbour's epochs, the second jobs' rows, and the target line."""
    args = result["args"]
    alone = statistics.median(result["alone_s"])
    rows = [{"neighbour n": "alone", "epoch ms (median)": round(alone * 1000, 1)}]
    for name, key in (("beside a clean job", "twin"), ("beside the bombs' job", "bombs")):
        got = result[key]
        median = statistics.median(got["epochs_s"])
        rows.append(
            {
                "neighbour n": name,
                "epoch ms (median)": round(median * 1000, 1),
                "x alone": round(median / alone, 2),
                "second job rows": got["second_rows"],
                "skipped": got["second_skipped"],
            }
        )
    ratio = statistics.median(result["bombs"]["epochs_s"]) / alone
    verdict = "PASS" if ratio <= TARGET else "FAIL"
    return (
        f"{result['cpu']}\n"
        f"one service; neighbour: {args['images']} rows of 96x72 JPEGs at image_size 32, "
        f"cached after its first epoch; second job: {args['other']} rows (+ {args['bombs']} "
        f"bombs: {', '.join(KINDS)}), {args['step']} s per batch\n"
        + format_table(rows, list(rows[1]))
        + f"\n\ntarget: neighbour beside the bombs / alone {ratio:.2f} <= {TARGET}  {verdict}"
    )


def run(args: argparse.Namespace) -> int:
    """Measure, print the table and write JSON."""
    result = measure(args)
    print(table(result))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    main(add_arguments, run, description=__doc__.splitlines()[0])
