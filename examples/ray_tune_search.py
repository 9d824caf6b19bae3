"""A Ray Tune search whose trials share each node's reads and decodes.

Each trial trains a small CPU model with its own learning rate and its own registered job on
the same images. The training function is plain tabloader code: ``JobDataset(job,
catalog=DIR)``. Inside a Ray trial it finds its node's loader (started here as
``tabloader serve --ray`` would), so an image is decoded once per node for every trial that
reads it at about the same time, and each trial still sees each of its rows once per epoch in
its own random order.

    python examples/ray_tune_search.py --catalog /tmp/tl-tune --images 600 --trials 4

It starts a local Ray instance on the loopback address (``--address`` joins a running
cluster instead, whose nodes must all see the catalog at the same path).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # servers on loopback
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray
import torch
from ray import tune
from torch import nn

import tabloader
from tabloader.cluster import Cluster
from tabloader.datagen import make_imagefolder


def train(config: dict[str, Any]) -> None:
    """One trial: a tiny CNN on the trial's own job, reporting its loss per epoch."""
    from tabloader.torch import JobDataset

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=learning_rate(config["trial"]))
    ds = JobDataset(f"trial_{config['trial']}", catalog=config["catalog"], epochs=config["epochs"])
    for epoch in range(config["epochs"]):
        total, n = 0.0, 0
        for batch in ds:
            x = batch["image"].permute(0, 3, 1, 2).float() / 255
            loss = nn.functional.cross_entropy(model(x), batch["label"].long())
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, n = total + loss.item() * len(x), n + len(x)
        tune.report({"epoch": epoch, "loss": total / n, "rows": n})
    ds.close()


def learning_rate(trial: int) -> float:
    """The search space: one learning rate per trial."""
    return 0.1 / 2**trial


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--catalog", default="tune-catalog")
    parser.add_argument("--data", default="tune-data")
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=48)
    parser.add_argument("--address", default=None, help="a running Ray cluster (default: local)")
    args = parser.parse_args()

    root = str(Path(args.catalog).resolve())
    folder = make_imagefolder(args.data, num_images=args.images, num_classes=10, size=(160, 120))
    with tabloader.connect(root, create=True) as cat:
        if "imgs" not in {d.name for d in cat.datasets()}:
            cat.import_imagefolder("imgs", folder)
        for trial in range(args.trials):  # one job per trial, on the same images
            cat.register_job(
                f"trial_{trial}",
                "imgs",
                columns=["image", "label"],
                options={"image_size": args.image_size, "batch_size": 32},
                replace=True,
            )

    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        ray.init(
            num_cpus=os.cpu_count() or 2,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
        )
    cluster = Cluster(root, workers=max(1, (os.cpu_count() or 2) // 2), cache_bytes=256 << 20)
    try:
        cluster.wait_ready()
        with tempfile.TemporaryDirectory() as results:
            tuner = tune.Tuner(
                tune.with_resources(train, {"cpu": 0.25}),  # trials wait for data, not CPU
                param_space={
                    "trial": tune.grid_search(list(range(args.trials))),
                    "catalog": root,
                    "epochs": args.epochs,
                },
                run_config=tune.RunConfig(storage_path=results, verbose=0),
            )
            grid = tuner.fit()
        status = cluster.status()
    finally:
        cluster.close()
        ray.shutdown()
    served = 0
    for result in sorted(grid, key=lambda r: r.config["trial"]):
        if result.error:
            raise SystemExit(f"trial {result.config['trial']} failed: {result.error}")
        trial, metrics = result.config["trial"], result.metrics
        served += metrics["rows"] * args.epochs
        print(f"trial_{trial}: lr {learning_rate(trial):.4f}, final loss {metrics['loss']:.3f}")
    print(f"images served to trials: {served}; decoded: {status['decodes']}")


if __name__ == "__main__":
    main()
