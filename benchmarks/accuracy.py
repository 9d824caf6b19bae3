"""Accuracy benchmark: models trained through tabloader are as accurate as with a DataLoader.

JOADER's claim is "shared preparation without affecting the accuracy". This checks it on data
nobody here made: scikit-learn's digits (``sklearn.datasets.load_digits``: 1,797 labeled 8x8
images shipped inside the wheel, no download), written as JPEGs at ``--size`` pixels (upscaled
bicubic, grayscale to RGB, quality 95, so that random crops matter) into an image folder
``<digit>/<train|test>/<n>.jpg``, split 80/20 per class by a fixed seed, and imported with
``FORMAT imagefolder``. The jobs read the train split (``WHERE path LIKE '%/train/%'``).

The recipe (the same for both arms, one implementation:
:class:`tabloader.engine._prepare.augment.Augmenter`)::

    RandomResizedCrop(size, scale=(0.6, 1.0), ratio=(0.8, 1.25)), Normalize(0.5, 0.5)

No flip: a mirrored 2, 3, 5 or 7 is not that digit (flips are for natural images). The crop
keeps at least 60% of the area and a near-square shape, so the digit stays whole and
recognizable while its scale and position move, which is what digits vary in.

A small CNN (three 3x3 convolutions with batch norm, two max-pools, global average pooling, a
linear layer; torch on the CPU, no torchvision) is trained for ``--epochs`` with Adam on a
one-cycle schedule (reaches ~97-98% in 15 epochs, a few seconds a model), its weights seeded
by the model's seed, in two arms:

* ``dataloader``: each model alone, a plain ``DataLoader(shuffle=True)`` (its own generator)
  over a map-style dataset of the train JPEGs, decoded with Pillow (``decode_image``) and
  augmented per sample with draws of its own (seed, epoch, index), disjoint from the
  tabloader jobs' seeds;
* ``tabloader``: ``--jobs`` models training at once, each in its own process, each a job with
  its own ``seed`` reading ``JobDataset(job, catalog=DIR)`` through one loader service
  (dependent sampling, each image decoded once for all jobs and kept in the cache, each job's
  crops drawn from (its seed, epoch, row ``_id``)).

Each arm trains ``--seeds`` runs of ``--jobs`` models (the DataLoader arm also ``--jobs``
processes at a time, so both share the machine alike), seeds 1, 2, ... in both arms. Every
model is evaluated on the held-out test split without augmentation (the JPEG decoded and
normalized), by the same loop for both arms. Reported: per arm the mean test accuracy, its
standard deviation (over models), min and max; the difference in percentage points; and
whether it is under 1 point and within the seeds' noise, which here means ``|diff| < 2 SE``
with ``SE = sqrt(s1^2/n1 + s2^2/n2)`` (Welch's standard error; Welch's t is printed, and its
two-sided p-value where SciPy is installed).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import format_table, main, positive_int, write_json

__all__ = [
    "AUGMENT",
    "EVALUATE",
    "add_arguments",
    "compare",
    "load_digits",
    "run",
    "summarize",
    "write_digits",
]

AUGMENT = "RandomResizedCrop({size}, scale=(0.6, 1.0), ratio=(0.8, 1.25)), Normalize(0.5, 0.5)"
"""The training recipe (``{size}``: ``--size``); see the module's docstring for why."""
EVALUATE = "CenterCrop({size}), Normalize(0.5, 0.5)"
"""The test images' transform: the whole image (no random draw), normalized as in training."""

TEST_FRACTION = 0.2
SPLIT_SEED = 0
DATALOADER_SEEDS = 1 << 32  # the DataLoader arm's augmentation seeds: seed + this
QUICK_IMAGES = 300


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks accuracy``."""
    parser.add_argument("--quick", action="store_true", help="a smoke run: 300 images, 1 epoch")
    parser.add_argument("--epochs", type=positive_int, default=15, help="epochs per model")
    parser.add_argument(
        "--seeds", type=positive_int, default=3, help="runs per arm (each of --jobs models)"
    )
    parser.add_argument("--jobs", type=positive_int, default=3, help="models training at once")
    parser.add_argument("--size", type=positive_int, default=32, help="image pixels (8 to 256)")
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument(
        "--lr", type=float, default=0.01, help="Adam's peak learning rate (one-cycle schedule)"
    )
    parser.add_argument("--out", default="bench-results/accuracy.json", help="JSON output")
    parser.add_argument("--child", help=argparse.SUPPRESS)


# -- the data ------------------------------------------------------------------------------------
def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: (uint8 images N x 8 x 8, 0 to 255; int labels N)."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError:
        raise SystemExit(
            "bench accuracy needs scikit-learn (its digits data set): "
            "pip install 'tabloader[bench]' or pip install scikit-learn."
        ) from None
    digits = sk_load_digits()
    images = np.rint(np.asarray(digits.images) * (255 / 16)).astype(np.uint8)
    return images, np.asarray(digits.target, np.int64)


def write_digits(images: np.ndarray, labels: np.ndarray, folder: Path, size: int) -> dict[str, int]:
    """Write each image as a ``size`` x ``size`` RGB JPEG into ``folder/<label>/<split>/``,
    the split stratified (``TEST_FRACTION`` of each class, by ``SPLIT_SEED``); the counts."""
    from PIL import Image

    rng = np.random.default_rng(SPLIT_SEED)
    counts = {"train": 0, "test": 0}
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        n_test = round(TEST_FRACTION * len(members))
        for rank, index in enumerate(members):
            split = "test" if rank < n_test else "train"
            out = folder / str(int(label)) / split / f"{int(index):04d}.jpg"
            out.parent.mkdir(parents=True, exist_ok=True)
            gray = Image.fromarray(images[index]).resize((size, size), Image.Resampling.BICUBIC)
            gray.convert("RGB").save(out, quality=95)
            counts[split] += 1
    return counts


def _split_files(folder: str, split: str) -> tuple[list[str], list[int]]:
    """The JPEGs of one split and their labels, in a fixed order."""
    paths = sorted(Path(folder).glob(f"*/{split}/*.jpg"))
    return [str(p) for p in paths], [int(p.parent.parent.name) for p in paths]


def _decode(path: str) -> np.ndarray:
    from tabloader.engine.decode import decode_image

    return decode_image(Path(path).read_bytes())


# -- a model's process ---------------------------------------------------------------------------
def _model(seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[Any] = []
    for c_in, c_out, pool in ((3, 16, True), (16, 32, True), (32, 32, False)):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out)]
        layers += [nn.ReLU(), nn.MaxPool2d(2)] if pool else [nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


class _TrainSet:
    """The DataLoader arm's map-style dataset: decode with Pillow, augment with draws of
    (seed, epoch, index) from this arm's own seeds."""

    def __init__(self, paths: list[str], labels: list[int], augment: str, seed: int) -> None:
        from tabloader.engine import Augmenter

        self.paths, self.labels = paths, labels
        self.augmenter = Augmenter(augment, DATALOADER_SEEDS + seed)
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        out = np.empty(self.augmenter.output_shape, self.augmenter.dtype)
        self.augmenter.apply(_decode(self.paths[i]), self.epoch, i, out)
        return torch.from_numpy(out), self.labels[i]


def _evaluate(model: Any, folder: str, size: int) -> tuple[float, int]:
    """Test accuracy without augmentation (``EVALUATE``: the whole image, normalized as in
    training, by the same code); (accuracy, test images)."""
    import torch

    from tabloader.engine import Augmenter

    paths, labels = _split_files(folder, "test")
    evaluate = Augmenter(EVALUATE.format(size=size), seed=0)
    x = np.empty((len(paths), *evaluate.output_shape), evaluate.dtype)
    for i, path in enumerate(paths):
        evaluate.apply(_decode(path), 0, i, x[i])
    model.eval()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x)).argmax(1).numpy()
    return float(np.mean(predicted == np.asarray(labels))), len(paths)


def _child(spec: dict[str, Any]) -> None:
    import torch
    from torch import nn

    from benchmarks._procs import wait_for_start, write_result

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec["jobs"]))
    model = _model(spec["seed"])
    opt = torch.optim.Adam(model.parameters(), lr=spec["lr"])
    steps = spec["epochs"] * -(-spec["train_rows"] // spec["batch_size"])
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=spec["lr"], total_steps=steps)
    loss_fn = nn.CrossEntropyLoss()
    data: Any
    if spec["arm"] == "tabloader":
        from tabloader.torch import JobDataset

        data = JobDataset(spec["job"], catalog=spec["catalog"], epochs=spec["epochs"])

        def batches(epoch: int) -> Any:
            for batch in data:
                yield batch["image"], batch["label"]

    else:
        from torch.utils.data import DataLoader

        train = _TrainSet(*_split_files(spec["folder"], "train"), spec["augment"], spec["seed"])
        loader: DataLoader[Any] = DataLoader(
            train,  # type: ignore[arg-type]
            batch_size=spec["batch_size"],
            shuffle=True,
            generator=torch.Generator().manual_seed(spec["seed"]),
        )

        def batches(epoch: int) -> Any:
            train.epoch = epoch
            yield from loader

    wait_for_start(spec)
    started, rows, loss = time.perf_counter(), 0, math.nan
    for epoch in range(spec["epochs"]):
        model.train()
        for image, label in batches(epoch):
            out = loss_fn(model(image), label.long())
            opt.zero_grad()
            out.backward()
            opt.step()
            if schedule.last_epoch < steps - 1:  # OneCycleLR refuses a step past its end
                schedule.step()
            rows += len(label)
            loss = float(out)
    train_s = time.perf_counter() - started
    if spec["arm"] == "tabloader":
        data.close()
    accuracy, n_test = _evaluate(model, spec["folder"], spec["size"])
    write_result(
        spec,
        {
            "end": time.time(),
            "accuracy": accuracy,
            "test_images": n_test,
            "rows": rows,
            "loss": loss,
            "train_s": train_s,
        },
    )


# -- statistics ----------------------------------------------------------------------------------
def summarize(accuracies: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one model), min and max; n."""
    a = np.asarray(accuracies, np.float64)
    return {
        "n": len(a),
        "mean": float(a.mean()),
        "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
        "min": float(a.min()),
        "max": float(a.max()),
    }


def compare(tabloader: list[float], dataloader: list[float]) -> dict[str, Any]:
    """tabloader's mean minus the DataLoader's, in percentage points, against the seeds' noise:
    Welch's standard error and t; the p-value where SciPy is installed (else None)."""
    a, b = summarize(tabloader), summarize(dataloader)
    diff = 100 * (a["mean"] - b["mean"])
    se = 100 * math.sqrt(a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"])
    t = diff / se if se > 0 else (0.0 if diff == 0 else math.copysign(math.inf, diff))
    p = None
    if a["n"] > 1 and b["n"] > 1 and se > 0:
        try:
            from scipy.stats import t as student_t
        except ImportError:
            pass
        else:  # Welch's test from the summaries (ttest_ind warns when an arm's models agree)
            va, vb = (10000 * s["std"] ** 2 / s["n"] for s in (a, b))
            df = (va + vb) ** 2 / (va**2 / (a["n"] - 1) + vb**2 / (b["n"] - 1))
            p = float(2 * student_t.sf(abs(t), df))
    return {
        "diff_pp": diff,
        "se_pp": se,
        "welch_t": t,
        "welch_p": p,
        "under_1pp": abs(diff) < 1,
        "within_noise": abs(diff) < 2 * se or diff == 0,
        "noise_test": "|diff| < 2 * Welch SE, SE = sqrt(s1^2/n1 + s2^2/n2)",
    }


# -- parent --------------------------------------------------------------------------------------
def _prepare(
    work: Path, args: argparse.Namespace, seeds: list[int]
) -> tuple[Path, Path, dict[str, int]]:
    """The JPEGs, the catalog with dataset ``digits`` and a job per tabloader model."""
    from tabloader import catalog

    images, labels = load_digits()
    if args.quick:
        keep = np.random.default_rng(SPLIT_SEED).permutation(len(labels))[:QUICK_IMAGES]
        images, labels = images[np.sort(keep)], labels[np.sort(keep)]
    folder = work / "digits"
    counts = write_digits(images, labels, folder, args.size)
    root = work / "catalog"
    augment = AUGMENT.format(size=args.size)
    with catalog.open_catalog(root, create=True) as cat:
        cat.sql(f"CREATE DATASET digits FROM '{folder}' FORMAT imagefolder")
        for seed in seeds:
            cat.sql(
                f"REGISTER JOB acc{seed} SELECT image, label FROM digits "
                f"WHERE path LIKE '%/train/%' WITH (batch_size = {args.batch_size}, "
                f"seed = {seed}, augment = '{augment}')"
            )
    return folder, root, counts


def _arm(
    arm: str, args: argparse.Namespace, seeds: list[int], folder: Path, root: Path, rows: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train every model of one arm, ``--jobs`` at a time: (one entry per model, per run)."""
    from benchmarks._procs import ServiceProcess, run_jobs
    from benchmarks.e2e import bench_cache_bytes

    models: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for run_index in range(args.seeds):
        group = seeds[run_index * args.jobs : (run_index + 1) * args.jobs]
        specs = [
            {
                "arm": arm,
                "job": f"acc{seed}",
                "seed": seed,
                "jobs": len(group),
                "epochs": args.epochs,
                "batch_size": args.batch_size,
                "lr": args.lr,
                "augment": AUGMENT.format(size=args.size),
                "catalog": str(root),
                "folder": str(folder),
                "train_rows": rows,
                "size": args.size,
            }
            for seed in group
        ]
        if arm == "tabloader":
            cache = bench_cache_bytes(
                rows, len(group), 1, args.batch_size, args.size**2 * 3, service=True
            )
            log = root / "bench.log"
            with ServiceProcess(root, cache_bytes=cache, workers=1, log=log) as service:
                out = run_jobs("benchmarks.accuracy", specs)
                decodes, pid = int(service.stats()["decodes"]), service.proc.pid
        else:  # every DataLoader decodes every row it delivers
            out = run_jobs("benchmarks.accuracy", specs)
            decodes, pid = len(group) * rows * args.epochs, None
        runs.append(
            {"arm": arm, "run": run_index, "wall_s": out["wall_s"], "decodes": decodes}
            | ({} if pid is None else {"service_pid": pid})
        )
        done = [
            {"arm": arm, "run": run_index, "seed": spec["seed"], **result}
            for spec, result in zip(specs, out["results"], strict=True)
        ]
        models += done
        print(
            f"  {arm} run {run_index + 1}/{args.seeds}: "
            + ", ".join(f"seed {m['seed']} {100 * m['accuracy']:.1f}%" for m in done)
            + f" ({out['wall_s']:.0f} s)",
            file=sys.stderr,
        )
    return models, runs


def run(args: argparse.Namespace) -> int:
    """Train both arms, print the table, write JSON."""
    if args.child:
        import json

        _child(json.loads(args.child))
        return 0
    if not 8 <= args.size <= 256:
        raise SystemExit(f"--size {args.size}: give 8 to 256 pixels (the digits are 8x8).")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise SystemExit(f"--lr {args.lr}: give a positive learning rate, as 0.01.")
    from tabloader.catalog import disable_progress_bars

    disable_progress_bars()
    if args.quick:
        args.epochs = 1
    seeds = list(range(1, args.seeds * args.jobs + 1))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tabloader-accuracy-") as tmp:
        folder, root, counts = _prepare(Path(tmp), args, seeds)
        done = {
            arm: _arm(arm, args, seeds, folder, root, counts["train"])
            for arm in ("tabloader", "dataloader")
        }
    arms = {arm: models for arm, (models, _) in done.items()}
    runs = [r for _, arm_runs in done.values() for r in arm_runs]
    accuracies = {arm: [m["accuracy"] for m in models] for arm, models in arms.items()}
    summary = {arm: summarize(a) for arm, a in accuracies.items()}
    comparison = compare(accuracies["tabloader"], accuracies["dataloader"])
    table = [
        {
            "arm": arm,
            "models": s["n"],
            "mean": f"{100 * s['mean']:.2f}%",
            "std": f"{100 * s['std']:.2f} pp",
            "min": f"{100 * s['min']:.2f}%",
            "max": f"{100 * s['max']:.2f}%",
            "decodes per run": round(
                sum(r["decodes"] for r in runs if r["arm"] == arm) / args.seeds
            ),
        }
        for arm, s in summary.items()
    ]
    p = comparison["welch_p"]
    print(
        f"scikit-learn digits: {counts['train']} train / {counts['test']} test JPEGs at "
        f"{args.size}px; {args.epochs} epoch(s), batch {args.batch_size}, {args.jobs} models "
        f"at once, {args.seeds} run(s) per arm; augment = {AUGMENT.format(size=args.size)}"
    )
    print(format_table(table))
    print(
        f"tabloader - dataloader: {comparison['diff_pp']:+.2f} pp (Welch SE "
        f"{comparison['se_pp']:.2f} pp, t = {comparison['welch_t']:.2f}"
        + ("" if p is None else f", p = {p:.3f}")
        + f"); under 1 pp: {'yes' if comparison['under_1pp'] else 'NO'}; within the seeds' "
        f"noise ({comparison['noise_test']}): {'yes' if comparison['within_noise'] else 'NO'}"
    )
    write_json(
        args.out,
        {
            "benchmark": "accuracy",
            "args": {k: v for k, v in vars(args).items() if k != "child"},
            "augment": AUGMENT.format(size=args.size),
            "images": counts,
            "wall_s": time.perf_counter() - started,
            "arms": summary,
            "comparison": comparison,
            "models": [m for models in arms.values() for m in models],
            "runs": runs,
            "rows": table,
        },
    )
    return 0


if __name__ == "__main__":
    main(add_arguments, run, prog="python -m benchmarks.accuracy", catalog=None)
