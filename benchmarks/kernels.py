"""Benchmark ``kernels``: one job's crop-resize-flip per image, single-threaded.

The per-job rest of loading an image is its draws and one crop-resize-flip of the shared
decode (DESIGN 7); with several jobs on a row it is paid once per job. This times
``Augmenter.apply`` of ``RandomResizedCrop(224), RandomHorizontalFlip()`` on a 375x500 image
(the decode of an ImageNet-sized JPEG) per image, every arm on one thread, side by side:

=========================  ==================================================================
arm                        what runs per image
=========================  ==================================================================
``kernel avx2``            ``Augmenter.apply``: draws + one call of tabloader's kernel (AVX2)
``kernel scalar``          the same on the kernel's portable C path (other CPUs, aarch64)
``kernel avx2, cold``      the AVX2 arm on 64 different images in turn (36 MB: they come from
                           memory, as an arena's decodes do), not one image kept in cache
``torch``                  the draws, then what tabloader ran before the kernel: torch's
                           private ``_upsample_bilinear2d_aa(out=)`` channels-last into an
                           HWC array, a mirrored copy of 3-byte pixels (one thread)
``torch, cold``            the torch arm on the 64 images in turn
``pillow resize(box)``     the draws, Pillow's ``resize(box=...)`` of an ``Image`` made once,
                           ``transpose`` when flipped, copied into the slot
``draw``                   ``Augmenter.draw`` alone (a Philox stream per (epoch, row))
=========================  ==================================================================

The arms take turns (one repeat of each, then again), so that a shared machine's slow
moments fall on all of them; each repeat times ``--images`` images (rows 0, 1, ...: every
arm draws the same boxes), and the table gives the median of ``--repeats`` repeats, in ms per
image, with the CPU model and its SIMD level: a kernel that costs 0.135 ms on one CPU has
cost 0.61 ms on another.

Usage: ``python -m benchmarks kernels [--quick] [--images N] [--repeats N] [--out PATH]`` (or
``python -m benchmarks.kernels``).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt

from benchmarks import format_table, main, positive_int, write_json
from benchmarks._cpu import cpu_model, simd_level
from tabloader import engine
from tabloader.engine import Augmenter

__all__ = [
    "CPU",
    "RECIPE",
    "KernelResult",
    "add_arguments",
    "cpu_description",
    "measure",
    "run",
    "table",
]

RECIPE = "RandomResizedCrop(224), RandomHorizontalFlip()"
SHAPE = (375, 500)
COLD_IMAGES = 64


class CPU(TypedDict):
    """The CPU model, its SIMD level and the resize kernel's path on it."""

    cpu: str
    simd: str
    kernel: str


class KernelResult(CPU):
    """:func:`measure`'s result: median ms per image of each arm and its (min, max)."""

    ms_per_image: dict[str, float]
    spread: dict[str, tuple[float, float]]
    images: int
    repeats: int


def cpu_description() -> CPU:
    """``{"cpu": model name, "simd": "AVX-512 (...)" | "AVX2" | "NEON" | ...}`` from
    /proc/cpuinfo (:mod:`benchmarks._cpu`), and the kernel's own choice of path
    (``"kernel"``)."""
    return {
        "cpu": cpu_model(),
        "simd": simd_level(),
        "kernel": engine.resize_kernel() or "not built",
    }


def _images(rng: np.random.Generator) -> npt.NDArray[np.uint8]:
    """COLD_IMAGES different 375x500 images, smooth like photos (not noise), read-only."""
    h, w = SHAPE
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // w, y * 255 // h, (x + y) % 256], axis=-1).astype(np.int16)
    noise = rng.integers(-12, 13, (COLD_IMAGES, h, w, 3), dtype=np.int16)
    images: npt.NDArray[np.uint8] = np.clip(base + noise, 0, 255).astype(np.uint8)
    images.flags.writeable = False
    return images


def _torch_arm(aug: Augmenter) -> Callable[[npt.NDArray[np.uint8], int, Any], None]:
    """Augmenter.apply as tabloader ran it on torch: the draws, a channels-last resize into an
    HWC array (copied first when read-only, as torch wants writable memory), and the flip as
    a copy of 3-byte items."""
    import torch

    torch.set_num_threads(1)
    pixel = np.dtype((np.void, 3))

    def apply(src: npt.NDArray[np.uint8], row: int, out: Any) -> None:
        (top, left, h, w), flip = aug.draw(src.shape[:2], 0, row)
        box = np.ascontiguousarray(src[top : top + h, left : left + w])
        if not box.flags.writeable:
            box = box.copy()
        res = np.empty((224, 224, 3), np.uint8)
        torch._C._nn._upsample_bilinear2d_aa(  # type: ignore[call-arg]
            torch.from_numpy(box).permute(2, 0, 1).unsqueeze(0),
            (224, 224),
            False,
            None,
            None,
            out=torch.from_numpy(res).permute(2, 0, 1).unsqueeze(0),
        )
        if flip:
            out.view(pixel)[..., 0][...] = res.view(pixel)[..., 0][:, ::-1]
        else:
            out[...] = res

    return apply


def _pillow_arm(aug: Augmenter) -> Callable[[Any, int, Any], None]:
    from PIL import Image

    def apply(img: Any, row: int, out: Any) -> None:
        (top, left, h, w), flip = aug.draw((img.height, img.width), 0, row)
        box = (left, top, left + w, top + h)
        res = img.resize((224, 224), Image.Resampling.BILINEAR, box=box)
        if flip:
            res = res.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        out[...] = np.asarray(res)

    return apply


def measure(images: int = 200, repeats: int = 15, *, seed: int = 0) -> KernelResult:
    """Median ms per image of each arm (see the module docstring), with the CPU.

    Args:
        images: images per repeat (rows 0..images-1: the same draws in every arm).
        repeats: repeats per arm, taken in turns.
        seed: the images' noise.

    Returns:
        ``{"cpu", "simd", "kernel", "ms_per_image": {arm: median}, "spread": {arm: (min,
        max)}, "images", "repeats"}``.
    """
    aug = Augmenter(RECIPE, seed=1)
    pics = _images(np.random.default_rng(seed))
    hot = pics[0]
    out = np.empty((224, 224, 3), np.uint8)
    arms: dict[str, Callable[[], None]] = {}
    isas = engine.resize_kernels()

    def on(isa: str, f: Callable[[], None]) -> Callable[[], None]:
        def timed() -> None:
            old = engine.use_resize_kernel(isa)
            try:
                f()
            finally:
                engine.use_resize_kernel(old)

        return timed

    def rows(apply: Callable[[Any, int], None], cold: bool = False) -> Callable[[], None]:
        """An arm: ``apply(image, row)`` for rows 0..images-1, on the one hot image or on the
        cold ones in turn."""
        source = [pics[r % COLD_IMAGES] if cold else hot for r in range(images)]

        def arm() -> None:
            for r, image in enumerate(source):
                apply(image, r)

        return arm

    if isas:
        kernel_hot = rows(lambda image, r: aug.apply(image, 0, r, out))
        kernel_cold = rows(lambda image, r: aug.apply(image, 0, r, out), cold=True)
        if "avx2" in isas:
            arms["kernel avx2"] = on("avx2", kernel_hot)
            arms["kernel avx2, cold"] = on("avx2", kernel_cold)
        arms["kernel scalar"] = on("scalar", kernel_hot)
    if importlib.util.find_spec("torch") is not None:
        torch_apply = _torch_arm(aug)
        arms["torch"] = rows(lambda image, r: torch_apply(image, r, out))
        arms["torch, cold"] = rows(lambda image, r: torch_apply(image, r, out), cold=True)
    from PIL import Image

    pil = Image.fromarray(hot)
    pillow_apply = _pillow_arm(aug)

    def draw() -> None:
        for r in range(images):
            aug.draw(SHAPE, 0, r)

    arms["pillow resize(box)"] = rows(lambda _, r: pillow_apply(pil, r, out))
    arms["draw"] = draw
    for f in arms.values():  # warm up: imports, scratch memory, caches
        f()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, f in arms.items():
            start = time.perf_counter()
            f()
            times[name].append((time.perf_counter() - start) * 1e3 / images)
    return {
        **cpu_description(),
        "ms_per_image": {name: statistics.median(t) for name, t in times.items()},
        "spread": {name: (min(t), max(t)) for name, t in times.items()},
        "images": images,
        "repeats": repeats,
    }


def table(result: KernelResult) -> str:
    """The result as a table: median ms per image, the spread, and the ratio to torch's."""
    base = result["ms_per_image"].get("torch")
    rows = []
    for name, ms in result["ms_per_image"].items():
        lo, hi = result["spread"][name]
        rows.append(
            {
                "arm": name,
                "ms/image (median)": round(ms, 4),
                "min..max": f"{lo:.4f}..{hi:.4f}",
                "x torch": "" if base is None or name == "draw" else f"{base / ms:.2f}",
            }
        )
    head = (
        f"{RECIPE} of a {SHAPE[0]}x{SHAPE[1]} image, one thread, median of "
        f"{result['repeats']} x {result['images']} images\n"
        f"CPU: {result['cpu']}; SIMD: {result['simd']}; kernel path: {result['kernel']}\n"
    )
    return head + format_table(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the ``kernels`` benchmark."""
    parser.add_argument("--quick", action="store_true", help="few images (a smoke run)")
    parser.add_argument("--images", type=positive_int, default=200, help="images per repeat")
    parser.add_argument("--repeats", type=positive_int, default=15, help="repeats per arm")
    parser.add_argument("--out", default="bench-results/kernels.json", help="JSON output")


def run(args: argparse.Namespace) -> int:
    """Measure, print the table and write JSON."""
    images, repeats = (10, 3) if args.quick else (args.images, args.repeats)
    result = measure(images, repeats)
    print(table(result))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    main(add_arguments, run, description=__doc__.splitlines()[0])
