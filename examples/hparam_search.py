"""Train several small CPU models at once on overlapping subsets; decode each image once.

Three jobs are registered with statements: two learning rates on the same subset, and a third
model on an overlapping one. They train concurrently (one thread each) from one tabloader
``Loader``; every image is read and decoded once per epoch and served to every job that needs
it, while each job keeps its own random order and its own augmentation.

    python examples/hparam_search.py --catalog /tmp/tl-example --images 1500 --epochs 2
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import tabloader
from tabloader.datagen import make_imagefolder
from tabloader.engine import Loader
from tabloader.torch import JobDataset

JOBS = {
    "cnn_lr_01": ("label < 8", 0.01),
    "cnn_lr_003": ("label < 8", 0.003),
    "cnn_upper": ("label >= 4", 0.01),
}


def random_flip(batch: dict, generator: torch.Generator) -> dict:
    """Per-job augmentation: flip the whole batch horizontally half of the time."""
    if torch.rand(1, generator=generator).item() < 0.5:
        batch["image"] = batch["image"].flip(2)
    return batch


def make_model(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, classes),
    )


def train(name: str, lr: float, loader: Loader, epochs: int, served: dict) -> None:
    torch.manual_seed(0)
    model = make_model(10)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    data = JobDataset(name, loader=loader, transform=random_flip)
    try:
        for epoch in range(epochs):
            train_epoch(name, epoch, model, opt, data)
        served[name] = data.stats()
    finally:
        data.close()  # leave the loader even if training fails: the other jobs go on


def train_epoch(
    name: str, epoch: int, model: nn.Module, opt: torch.optim.Optimizer, data: JobDataset
) -> None:
    seen, correct, total_loss = 0, 0, 0.0
    for batch in DataLoader(data, batch_size=None):  # one iteration = one epoch of the job
        x = batch["image"].permute(0, 3, 1, 2).float() / 255
        y = batch["label"]
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen += len(y)
        correct += int((out.argmax(1) == y).sum())
        total_loss += loss.item() * len(y)
    print(
        f"{name:11} epoch {epoch}: {seen} rows, loss {total_loss / seen:.3f}, "
        f"train acc {correct / seen:.2f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--catalog", help="catalog directory (default: the default catalog)")
    parser.add_argument("--data", default="demo-data", help="where to generate images")
    parser.add_argument("--images", type=int, default=1500)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=64)
    args = parser.parse_args()

    folder = make_imagefolder(
        Path(args.data) / f"imagenet-{args.images}", num_images=args.images, num_classes=10
    )
    cat = tabloader.connect(args.catalog, create=True)
    if "hparam_images" not in cat.dataset_names():
        cat.sql(f"CREATE DATASET hparam_images FROM '{folder}' FORMAT imagefolder")
    for name, (where, _) in JOBS.items():
        stmt = (
            f"REGISTER OR REPLACE JOB {name} SELECT image, label FROM hparam_images "
            f"WHERE {where} WITH (batch_size = 32, image_size = {args.image_size})"
        )
        job = cat.sql(stmt)
        print(f"{stmt}\n  -> {job.num_rows} rows")

    decoded = args.image_size * args.image_size * 3
    # room for every image (and its label), so later epochs are served from the cache
    loader = Loader(cat.catalog, cache_bytes=args.images * (decoded + 256), workers=2)
    served: dict[str, dict] = {}
    start = time.perf_counter()
    threads = [
        threading.Thread(target=train, args=(n, lr, loader, args.epochs, served))
        for n, (_, lr) in JOBS.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = loader.stats()
    jobs = [cat.job(n) for n in JOBS]
    union = len(jobs[0].ids.union(*(j.ids for j in jobs[1:])))
    total = sum(s["rows"] for s in served.values())
    print(f"\n{len(JOBS)} jobs, {args.epochs} epochs, {time.perf_counter() - start:.1f} s")
    for name, s in served.items():  # decoded: the images this job's batches decoded
        print(
            f"  {name:11} {s['rows']} images: {s['decoded']} decoded by this job, "
            f"{s['rows'] - s['decoded']} served from the cache or another job's decode"
        )
    print(
        f"images served to jobs: {total}; decoded: {stats['decodes']} (the union of the "
        f"jobs' sets has {union} rows); each decode served {total / max(stats['decodes'], 1):.2f}"
        " images (sharing between jobs, and the cache across epochs)"
    )
    loader.close()
    cat.close()


if __name__ == "__main__":
    main()
