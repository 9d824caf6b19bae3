"""The training recipe in the benchmarks: ``RandomResizedCrop(224)`` + a random flip per image.

What the DataLoader competitors run per sample, the way a tuned user writes it: Pillow's ``draft``
decode (a DCT-domain downscale where the image is at least twice 224; a full decode for the ~500x375
JPEGs here), then either torchvision's ``v2`` transforms where torchvision is installed, or the same
ops by hand with Pillow (``resize`` with the crop's ``box``: crop and resize in one call, as
torchvision does on PIL images) with crop parameters drawn by torchvision's algorithm
(:meth:`tabloader.engine._prepare.augment.Augmenter.draw`). tabloader's competitor is a job
registered with ``augment = RECIPE``: one shared decode per image, then the job's own crop-resize in
the loader's threads.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from tabloader.engine import Augmenter

__all__ = ["RECIPE", "RecipeRows", "recipe_competitors"]

RECIPE = "RandomResizedCrop(224), RandomHorizontalFlip()"


def _torchvision() -> Any:
    try:
        from torchvision.transforms import v2
    except Exception:  # not installed, or a build that does not import beside this torch
        return None
    return v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()])


def recipe_competitors() -> list[str]:
    """The DataLoader variants this machine can run: ``pillow``, and ``torchvision`` where
    it imports."""
    return ["pillow"] + (["torchvision"] if _torchvision() is not None else [])


class RecipeRows:
    """A map-style dataset: ``rows.raw(i)`` (a row's JPEG bytes) through the recipe."""

    def __init__(self, rows: Any, how: str) -> None:
        self.rows, self.how = rows, how
        self._aug = Augmenter(RECIPE, seed=0)
        self._tv: Any = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch
        from PIL import Image

        img: Any
        with Image.open(io.BytesIO(self.rows.raw(i))) as img:
            img.draft("RGB", (224, 224))
            img = img.convert("RGB")
        if self.how == "torchvision":
            if self._tv is None:
                self._tv = _torchvision()
            img = self._tv(img)
        else:
            (top, left, h, w), flip = self._aug.draw((img.height, img.width), 0, i)
            box = (left, top, left + w, top + h)
            img = img.resize((224, 224), Image.Resampling.BILINEAR, box=box)
            if flip:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(img).copy()), i
