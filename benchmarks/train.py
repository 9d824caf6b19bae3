"""Training benchmark: N models trained at once, through the loader service vs a DataLoader each.

The experiment of the JOADER paper's Table 1 (6 ResNet18 jobs on ImageNet: 37.6 minutes per
epoch with JOADER vs 67.9 with PyTorch's DataLoader), scaled to this machine. For each N of
``--jobs`` (default 1 to 6), N jobs train at once, each in its own process, each one epoch
(``--epochs``) over every generated image (the ``bench e2e`` images, ``--images``):

* ``service``: every job reads its job through one ``tabloader serve`` of the catalog
  (started for the run; ``--workers`` decode processes, ``--cache`` of the images);
* ``dataloader``: every job has its own ``DataLoader(shuffle=True)`` over the same Arrow IPC
  storage with the same decode and resize as tabloader, ``--workers`` split between the jobs.

The model: on CPU a small convolutional network (three strided 3x3 convolutions, pooling, a
linear layer) at ``--image-size`` (default 64); where ``torch.cuda.is_available()``,
torchvision's ResNet18 (10 classes) if torchvision is installed, else the small network, on
the GPU; ``--model resnet18`` or ``tiny`` chooses on any device. Each job uses ``cores / N``
intra-op threads (both competitors alike). Reported per N: each job's epoch time (from the
common start, after every process got ready), their mean and max, decodes, and the
DataLoaders' time over the service's; and a line of stall accounting per N and competitor:
the jobs' seconds waiting for data vs training (as the service counted them; a DataLoader job
times its ``next()``), and the service's seconds reading, decoding and collating.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from benchmarks import add_loader_arguments, format_table, main, positive_int, write_json
from benchmarks._procs import ServiceProcess, run_jobs, rusage, wait_for_start, write_result
from benchmarks.e2e import bench_cache_bytes
from benchmarks.e2e_children import MapDataset
from benchmarks.imagedata import prepare
from benchmarks.stalls import StallClock, Stalls, dataset_seconds, stall_row, stalls_of

__all__ = ["JOADER_TABLE_1", "add_arguments", "build_model", "run"]

JOADER_TABLE_1 = {
    "jobs": 6,
    "model": "ResNet18 (JOADER, Table 1)",
    "device": "GPU, ImageNet",
    "service_epoch": "37.6 min",
    "dataloader_epoch": "67.9 min",
    "dataloader/service": 67.9 / 37.6,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks train``."""
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument(
        "--jobs", default="1,2,3,4,5,6", help="numbers of jobs trained at once (the issue: 1 to 6)"
    )
    parser.add_argument("--images", type=positive_int, default=1000, help="generated JPEGs")
    parser.add_argument(
        "--image-size",
        type=positive_int,
        default=None,
        help="pixels (default: 64 on CPU, 224 on GPU)",
    )
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--epochs", type=positive_int, default=1)
    parser.add_argument(
        "--model",
        choices=["auto", "tiny", "resnet18"],
        default="auto",
        help="auto: ResNet18 on a GPU with torchvision, else the small CNN; resnet18 on a CPU "
        "too (slow)",
    )
    add_loader_arguments(
        parser,
        workers_help="decode workers (default: cores)",
    )
    parser.add_argument("--data", default="bench-results/e2e-data", help="image folder cache")
    parser.add_argument("--out", default="bench-results/train.json", help="JSON output")
    parser.add_argument("--child", help=argparse.SUPPRESS)


# -- a job process -------------------------------------------------------------------------------
def build_model(name: str, device: Any) -> tuple[Any, str]:
    """``(model, its name)`` for ``--model name`` on ``device``: torchvision's ResNet-18
    (``"auto"`` on a GPU), else a small CNN; exits naming a torchvision that cannot load."""
    import torch
    from torch import nn

    if name == "resnet18" or (name == "auto" and device.type == "cuda"):
        try:
            from torchvision.models import resnet18
        except (ImportError, RuntimeError) as exc:  # RuntimeError: built for another torch
            problem = (
                f"torchvision cannot be used with torch {torch.__version__} ({exc}); install "
                "the torchvision release built for this torch"
            )
            if name == "resnet18":
                raise SystemExit(f"--model resnet18: {problem}.") from exc
            print(f"bench train: {problem}; training the small CNN instead.", file=sys.stderr)
        else:
            torch.manual_seed(0)
            return resnet18(num_classes=10).to(device), "resnet18"
    torch.manual_seed(0)
    tiny = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )
    return tiny.to(device), "tiny-cnn"


class _Spec(TypedDict):
    """A job process's spec (``run_jobs`` adds ``sync`` and ``index``)."""

    kind: str
    job: str
    num_jobs: int
    catalog: str
    rows: int
    batch_size: int
    image_size: int
    epochs: int
    model: str
    workers: int
    sync: NotRequired[str]
    index: NotRequired[int]


class ModeRun(TypedDict):
    """N jobs at once in one mode: epoch times, decodes, CPU, losses and stalls."""

    epoch_s: list[float]
    mean_epoch_s: float
    max_epoch_s: float
    decodes: int
    cpu_s: float
    loss: list[float]
    model: str
    device: str
    jobs: dict[str, Stalls]
    dataset_s: dict[str, float] | None
    service_pids: list[int]


def _child(spec: _Spec) -> None:
    import torch
    from torch import nn

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec["num_jobs"]))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, model_name = build_model(spec["model"], device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    cpu0 = rusage()[0]
    if spec["kind"] == "service":
        from tabloader.service import RemoteLoader
        from tabloader.torch import to_tensors

        remote = RemoteLoader(spec["catalog"], start=False)

        def epoch_batches() -> Any:
            for batch in stream.iter_epoch():
                t = to_tensors(batch)
                yield t["image"], t["label"]

    else:
        from torch.utils.data import DataLoader

        ids = list(range(spec["rows"]))
        loader: DataLoader[Any] = DataLoader(
            MapDataset(spec["catalog"], "imgs", ids, spec["image_size"]),  # type: ignore[arg-type]
            batch_size=spec["batch_size"],
            shuffle=True,
            num_workers=spec["workers"],
            persistent_workers=spec["epochs"] > 1,
            generator=torch.Generator().manual_seed(spec["index"]),
        )

        clock = StallClock()  # no engine counts a DataLoader's stalls: the job times them

        def epoch_batches() -> Any:
            for image, label, _row in clock.timed(loader):
                yield image, label

    go = wait_for_start(spec)
    if spec["kind"] == "service":
        stream = remote.open(
            spec["job"],
            batch_size=spec["batch_size"],
            epochs=spec["epochs"],
            image_size=spec["image_size"],
        )
    epochs, rows, loss = [], 0, float("nan")
    started = go
    for _ in range(spec["epochs"]):
        for image, label in epoch_batches():
            x = image.to(device, non_blocking=True).permute(0, 3, 1, 2).float().div_(255)
            out = loss_fn(model(x), label.to(device, non_blocking=True).long())
            opt.zero_grad()
            out.backward()
            opt.step()
            rows += len(label)
            loss = float(out)
        if device.type == "cuda":
            torch.cuda.synchronize()
        now = time.time()
        epochs.append(now - started)
        started = now
    if spec["kind"] == "service":
        stalls = stalls_of(stream.stats())  # as the service counted them
        stream.close()
        remote.close()
    else:
        stalls = clock.stats()
    cpu, rss = rusage()
    write_result(
        spec,
        {
            "end": time.time(),
            "epoch_s": epochs,
            "rows": rows,
            "loss": loss,
            "cpu_s": cpu - cpu0,
            "peak_rss_mib": rss,
            "model": model_name,
            "device": str(device),
            **stalls,
        },
    )


# -- parent --------------------------------------------------------------------------------------
def _run_mode(kind: str, n: int, args: argparse.Namespace, root: Path, rows: int) -> ModeRun:
    specs: list[_Spec] = [
        {
            "kind": kind,
            "job": f"train{i}",
            "num_jobs": n,
            "catalog": str(root),
            "rows": rows,
            "batch_size": args.batch_size,
            "image_size": args.image_size,
            "epochs": args.epochs,
            "model": args.model,
            "workers": max(1, args.workers // n),
        }
        for i in range(n)
    ]
    if kind == "dataloader":
        out = run_jobs("benchmarks.train", specs)
        decodes, service_cpu, pids = rows * n * args.epochs, 0.0, []
        dataset_s = None  # a DataLoader counts no read or decode seconds
    else:
        cache = bench_cache_bytes(
            int(args.cache * rows),
            n,
            args.workers,
            args.batch_size,
            args.image_size**2 * 3,
            service=True,
        )
        with ServiceProcess(
            root, cache_bytes=cache, workers=args.workers, log=root / "bench.log"
        ) as service:
            cpu0 = service.usage()[0]  # its start-up is not the run's
            out = run_jobs("benchmarks.train", specs)
            stats = service.stats()
            decodes, dataset_s = int(stats["decodes"]), dataset_seconds(stats)
            service_cpu = service.usage()[0] - cpu0
        pids = [service.proc.pid]
    results = out["results"]
    epoch_s = [sum(r["epoch_s"]) / len(r["epoch_s"]) for r in results]
    return {
        "epoch_s": epoch_s,
        "mean_epoch_s": sum(epoch_s) / n,
        "max_epoch_s": max(epoch_s),
        "decodes": decodes,
        "cpu_s": sum(r["cpu_s"] for r in results) + service_cpu,
        "loss": [r["loss"] for r in results],
        "model": results[0]["model"],
        "device": results[0]["device"],
        "jobs": {
            s["job"]: {"wait_s": r["wait_s"], "compute_s": r["compute_s"]}
            for s, r in zip(specs, results, strict=True)
        },
        "dataset_s": dataset_s,
        "service_pids": pids,
    }


def run(args: argparse.Namespace) -> int:
    """Train N jobs at once for each N, through the service and with DataLoaders; print, JSON."""
    if args.child:
        import json

        _child(json.loads(args.child))
        return 0
    import torch

    from tabloader import catalog
    from tabloader.catalog import disable_progress_bars

    disable_progress_bars()
    try:
        counts = [int(x) for x in args.jobs.split(",") if x]
    except ValueError:
        raise SystemExit(f"--jobs {args.jobs!r}: give numbers of jobs, as 1,2,4,6.") from None
    if not counts or min(counts) < 1:
        raise SystemExit(f"--jobs {args.jobs!r}: give numbers of jobs of at least 1, as 1,2,4,6.")
    if args.quick:
        args.images, counts = min(args.images, 300), [c for c in counts if c <= 2] or [1]
    gpu = torch.cuda.is_available()
    if args.image_size is None:
        args.image_size = 224 if gpu else 64
    root, n, _ = prepare(args)
    with catalog.open_catalog(root) as cat:
        for i in range(max(counts)):
            cat.sql(f"REGISTER OR REPLACE JOB train{i} SELECT image, label FROM imgs")
    table: list[dict[str, object]] = []
    stalls: list[dict[str, object]] = []
    runs = []
    for jobs in counts:
        service = _run_mode("service", jobs, args, root, n)
        dataloader = _run_mode("dataloader", jobs, args, root, n)
        runs.append({"jobs": jobs, "service": service, "dataloader": dataloader})
        for mode, result in (("service", service), ("dataloader", dataloader)):
            stalls.append({"jobs": jobs, "competitor": mode, **stall_row(result)})
        table.append(
            {
                "jobs": jobs,
                "model": service["model"],
                "device": service["device"],
                "service_epoch": f"{service['mean_epoch_s']:.1f} s",
                "dataloader_epoch": f"{dataloader['mean_epoch_s']:.1f} s",
                "dataloader/service": dataloader["mean_epoch_s"] / service["mean_epoch_s"],
                "max_service": f"{service['max_epoch_s']:.1f} s",
                "max_dataloader": f"{dataloader['max_epoch_s']:.1f} s",
                "service_decodes": service["decodes"],
                "dataloader_decodes": dataloader["decodes"],
            }
        )
    device = torch.cuda.get_device_name() if gpu else f"CPU ({os.cpu_count()} cores)"
    print(
        f"{n} images at {args.image_size}px, batch {args.batch_size}, {args.epochs} epoch(s), "
        f"{args.workers} decode workers, on {device}; epoch time = mean over the jobs"
    )
    print(format_table([*table, JOADER_TABLE_1]))
    print()
    print(
        "stalls: jobs' seconds waiting for data vs training (summed; per job wait/compute), "
        "and the service's seconds reading, decoding, collating"
    )
    print(format_table(stalls))
    write_json(
        args.out,
        {
            "benchmark": "train",
            "args": {k: v for k, v in vars(args).items() if k != "child"},
            "device": device,
            "rows": table,
            "stalls": stalls,
            "reference": JOADER_TABLE_1,
            "runs": runs,
        },
    )
    return 0


if __name__ == "__main__":
    main(add_arguments, run, prog="python -m benchmarks.train", catalog=None)
