"""tabloader's augmentation against real torchvision, in a scratch venv (not the suite).

The suite runs on a CPU torch beside which PyPI's torchvision does not import, so it checks
torchvision's algorithms re-implemented; this script checks the real thing:

    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install torch torchvision && \
        /tmp/tv/bin/pip install -e . && /tmp/tv/bin/python scripts/torchvision_parity.py

It converts a ``v2.Compose`` with ``from_torchvision``, refuses an unsupported op, compares
``RandomResizedCrop``'s crop parameters with torchvision's own ``get_params`` (two-sample KS,
4,000 draws each) and the pixels of 600 crops (+ flips) with ``v2.functional.resized_crop``
on each of the kernel's code paths (torchvision's uint8 resize is torch's
``interpolate(antialias=True)``, whose bytes the kernel computes).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torchvision
from torchvision.transforms import RandomResizedCrop, v2

from tabloader.catalog import OptionError, from_torchvision
from tabloader.engine import Augmenter

N, H, W = 4000, 375, 500


def ks(x: np.ndarray, y: np.ndarray) -> float:
    x, y = np.sort(x), np.sort(y)
    g = np.concatenate([x, y])
    a = np.searchsorted(x, g, "right") / x.size
    return float(np.abs(a - np.searchsorted(y, g, "right") / y.size).max())


def features(p: np.ndarray) -> dict[str, np.ndarray]:
    i, j, ch, cw = p.T
    return {"area": ch * cw / (H * W), "log ratio": np.log(cw / ch), "top": i / H, "left": j / W}


def main() -> None:
    print("torch", torch.__version__, "torchvision", torchvision.__version__)
    compose = v2.Compose(
        [
            v2.ToImage(),
            v2.RandomResizedCrop(224, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.RandomCrop(200, padding=4),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    text = from_torchvision(compose)
    print("converted:", text, "->", Augmenter(text, 0).output_shape)
    try:
        from_torchvision(v2.Compose([v2.ColorJitter(0.4)]))
    except OptionError as exc:
        print("refused:", exc)
    torch.manual_seed(1)
    img = torch.zeros(3, H, W)
    theirs = np.array(
        [RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(N)], float
    )
    aug = Augmenter("RandomResizedCrop(224)", seed=3)
    ours = np.array([aug.draw((H, W), 0, r)[0] for r in range(N)], float)
    crit = 1.95 * math.sqrt(2 / N)
    for k, v in features(ours).items():
        print(f"KS {k}: {ks(v, features(theirs)[k]):.4f} (critical {crit:.4f}, alpha 0.001)")
    pixels()


def pixels(rows: int = 300) -> None:
    """Augmenter.apply of RandomResizedCrop(224) + flip against torchvision's own
    resized_crop (+ horizontal_flip) of the drawn box, on every code path of the kernel."""
    from tabloader import engine

    aug = Augmenter("RandomResizedCrop(224), RandomHorizontalFlip()", seed=3)
    rng = np.random.default_rng(0)
    smooth = np.repeat(np.repeat(rng.integers(0, 256, (H // 5 + 1, W // 5 + 1, 3)), 5, 0), 5, 1)
    images = [rng.integers(0, 256, (H, W, 3), dtype=np.uint8), smooth[:H, :W].astype(np.uint8)]
    for isa in engine.resize_kernels() or ["(no kernel)"]:
        if isa != "(no kernel)":
            engine.use_resize_kernel(isa)
        worst, n = 0, 0
        for src in images:
            chw = torch.from_numpy(src).permute(2, 0, 1)
            out = np.empty((224, 224, 3), np.uint8)
            for row in range(rows):
                (i, j, ch, cw), flip = aug.draw((H, W), 0, row)
                aug.apply(src, 0, row, out)
                ref = v2.functional.resized_crop(chw, i, j, ch, cw, [224, 224], antialias=True)
                if flip:
                    ref = v2.functional.horizontal_flip(ref)
                diff = np.abs(out.astype(int) - ref.permute(1, 2, 0).numpy().astype(int))
                worst, n = max(worst, int(diff.max())), n + 1
        print(
            f"pixels vs v2.functional.resized_crop (+ horizontal_flip), kernel path {isa}: "
            f"max diff {worst} over {n} crops"
        )


if __name__ == "__main__":
    main()
