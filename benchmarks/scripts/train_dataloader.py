"""A training script as a PyTorch user writes it: a ``DataLoader`` with its own workers.

``bench e2e`` and ``bench throughput`` run it as a shell does, ``python train_dataloader.py
SPEC`` (a fresh interpreter; it imports nothing of tabloader, nor does its sibling ``_loop.py``
that both scripts time their loader with), beside ``train_tabloader.py``.
``SPEC`` is JSON: ``folder`` (an image folder ``root/<class>/<file>``), ``recipe``
(``train``: ``RandomResizedCrop(size)`` + flip; ``eval``: ``Resize(size)`` +
``CenterCrop(size)``), ``size``, ``batch_size``, ``workers``, ``seed``, ``step`` (seconds slept
per batch: a simulated training step; 0 for none), ``out`` (where the result JSON goes).

Each sample is decoded as a tuned user does: Pillow's ``draft`` (a DCT-domain downscale where
the image is at least twice the size), then torchvision's ``transforms.v2`` where torchvision
imports, else the same ops with Pillow (the crop drawn by torchvision's algorithm with
``random``). The worker times its stages (read, decode, augment: thread CPU seconds) and sends
them with the sample; the result says which transforms ran.
"""

from __future__ import annotations

import time

START = time.time()  # before the imports: they are part of what a user waits for

import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

try:
    from torchvision.transforms import v2
except Exception:  # not installed, or a build that does not import beside this torch
    v2 = None

if TYPE_CHECKING:  # mypy names this file benchmarks.scripts.<name>
    from benchmarks.scripts._loop import drain, report
else:  # run as a file, its folder is sys.path[0]: the sibling, loading nothing of tabloader
    from _loop import drain, report

IMPORTED = time.time()
EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")


def _rrc_box(w: int, h: int) -> tuple[int, int, int, int]:
    """``RandomResizedCrop.get_params`` (scale (0.08, 1), ratio (3/4, 4/3)): top, left, h, w."""
    area = w * h
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * random.uniform(0.08, 1.0)
        aspect = math.exp(random.uniform(*log_ratio))
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            return random.randint(0, h - ch), random.randint(0, w - cw), ch, cw
    side = min(w, h)
    return (h - side) // 2, (w - side) // 2, side, side


class Folder(Dataset):  # type: ignore[type-arg]
    """``root/<class>/<file>`` as ``torchvision.datasets.ImageFolder`` lists it."""

    def __init__(self, root: str, recipe: str, size: int) -> None:
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.samples = [
            (os.path.join(root, c, f), label)
            for label, c in enumerate(classes)
            for f in sorted(os.listdir(os.path.join(root, c)))
            if f.lower().endswith(EXTENSIONS)
        ]
        self.recipe, self.size = recipe, size
        self.tv: Any = None
        if v2 is not None:
            ops = (
                [v2.RandomResizedCrop(size), v2.RandomHorizontalFlip()]
                if recipe == "train"
                else [v2.Resize(size), v2.CenterCrop(size)]
            )
            self.tv = v2.Compose([*ops, v2.PILToTensor()])

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, int, Any]:
        t0 = time.thread_time()
        path, label = self.samples[i]
        with open(path, "rb") as f:
            data = f.read()
        t1 = time.thread_time()
        img: Any
        with Image.open(io.BytesIO(data)) as img:
            img.draft("RGB", (self.size, self.size))
            img = img.convert("RGB")
        t2 = time.thread_time()
        if self.tv is not None:
            out = self.tv(img)
        else:
            out = torch.from_numpy(np.asarray(self._pillow(img)).copy())
        t3 = time.thread_time()
        return out, label, torch.tensor([t1 - t0, t2 - t1, t3 - t2], dtype=torch.float64)

    def _pillow(self, img: Image.Image) -> Image.Image:
        size = self.size
        if self.recipe == "train":
            top, left, h, w = _rrc_box(img.width, img.height)
            box = (left, top, left + w, top + h)
            img = img.resize((size, size), Image.Resampling.BILINEAR, box=box)
            if random.random() < 0.5:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            return img
        scale = size / min(img.size)
        img = img.resize(
            (max(size, round(img.width * scale)), max(size, round(img.height * scale))),
            Image.Resampling.BILINEAR,
        )
        left, top = (img.width - size) // 2, (img.height - size) // 2
        return img.crop((left, top, left + size, top + size))


def main() -> int:
    spec = json.loads(sys.argv[1])
    cpu_imported = time.process_time()
    building = time.time()
    data = Folder(spec["folder"], spec["recipe"], spec["size"])
    loader = DataLoader(
        data,
        batch_size=spec["batch_size"],
        shuffle=True,
        num_workers=spec["workers"],
        generator=torch.Generator().manual_seed(spec["seed"]),
    )
    built = time.time()
    stages = torch.zeros(3, dtype=torch.float64)

    def count(batch: tuple[Any, Any, Any]) -> int:
        _images, labels, times = batch
        stages.add_(times.sum(0))
        return len(labels)

    loop = drain(loader, count, spec["step"])
    # the loader's iterator ran out and is gone: its workers stopped and were reaped, their CPU
    # is in RUSAGE_CHILDREN now
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    read_s, decode_s, augment_s = stages.tolist()
    report(
        spec["out"],
        (START, IMPORTED, building, built, cpu_imported),
        loop,
        workers_cpu_s=kids.ru_utime + kids.ru_stime,
        stages_s={"read": read_s, "decode": decode_s, "augment": augment_s},
        transforms="torchvision.transforms.v2" if data.tv is not None else "pillow",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
