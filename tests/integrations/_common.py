"""What every framework script here shares: its arguments, the tiny model, the record of the
rows trained.

Each script trains a ``Linear`` on the job's flattened 8x8 images and appends one JSON line
per batch to ``<out>/<kind>-rank<r>.jsonl`` (``kind``: train, val, sanity): the run's name,
the epoch and the batch's ``_id`` values. A run given ``--stop-after K`` saves a checkpoint
right after its K-th optimizer step and exits at once, as if it crashed there; the test then
resumes from that checkpoint in a fresh process and checks each epoch's rows over both runs.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

FEATURES = 8 * 8 * 3
CLASSES = 4


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--catalog", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--val-job")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tag", default="first", help="the run's name in the record")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--stop-after", type=int, help="checkpoint after this step and exit")
    parser.add_argument("--ckpt", help="the checkpoint to write (with --stop-after)")
    parser.add_argument("--epoch-end-ckpt", help="also a checkpoint at the end of epoch 0")
    parser.add_argument("--resume", help="the checkpoint to resume from")
    parser.add_argument("--limit-train-batches", type=int)
    parser.add_argument("--plain-prepare", action="store_true")
    parser.add_argument(
        "--plain-loader", action="store_true", help="DataLoader(ds, batch_size=None), no JobLoader"
    )
    return parser.parse_args()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, CLASSES)


def features(images: torch.Tensor) -> torch.Tensor:
    """uint8 N x 8 x 8 x 3 -> float N x 192."""
    return images.flatten(1).float() / 255


def record(
    args: argparse.Namespace, kind: str, rank: int, epoch: int, ids: Any, **extra: Any
) -> None:
    """One batch trained (or evaluated): appended and flushed, so that an exit right after a
    checkpoint leaves every batch before it on disk."""
    line = {"run": args.tag, "epoch": int(epoch), "ids": [int(i) for i in ids], **extra}
    with open(Path(args.out) / f"{kind}-rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def crash() -> None:
    """Exit now, as a process killed right after its checkpoint (no teardown)."""
    os._exit(0)
