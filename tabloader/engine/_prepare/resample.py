"""Crop, resize and mirror ``uint8`` HWC images in one pass: the kernel every resize goes through.

A job's ``RandomResizedCrop(224), RandomHorizontalFlip()`` is a crop box, an antialiased
bilinear resize and maybe a mirror. :func:`resize_into` does all three into a caller's
array (a slot of the job's batch) in one call with the GIL released; :func:`resize_batch`
does a whole batch of images held in one buffer (the arena) in one call.

**The kernel** is a small C extension (``tabloader/engine/_prepare/_resample.c``, built by
``setup.py``): exactly the arithmetic of torch's ``uint8``
``interpolate(mode="bilinear", antialias=True)``, which is what torchvision's
``resized_crop`` calls on ``uint8`` tensors (a port of Pillow-SIMD: int16 weights, horizontal
pass first into a ``uint8`` intermediate, then vertical), so its bytes equal torch's. The mirror
is folded into the horizontal pass (the output columns are written reversed), so it costs no
copy. It runs AVX2 code where the CPU has it and portable C elsewhere (the same bytes;
``TABLOADER_RESAMPLE=scalar`` forces the portable code). Measured on a 375x500 image,
``RandomResizedCrop(224)`` + flip, one core of an AMD EPYC (Zen 4, ``python -m benchmarks
kernels``): the resize 0.06 ms per image against 0.15 ms for torch, which also costs a 1.5 s
``import torch`` in every process that resizes; ``Augmenter.apply`` with its draws 0.072 ms
(0.098 with the sources coming from memory), 0.22 ms (0.24) on torch.

**Fallbacks.** An install without a C compiler has no kernel (the extension is optional):
then torch computes the resize (the same bytes, when torch is installed), else Pillow
(``BILINEAR``: the same filter, give or take 1 in a few values). Which one runs is logged once.

Example:
    >>> import numpy as np
    >>> src = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    >>> out = np.empty((2, 2, 3), np.uint8)
    >>> resize_into(src, out, box=(0, 2, 4, 4), flip=True)
    >>> out[0, 1].tolist() == resize_hw(src[:, 2:], 2, 2)[0, 0].tolist()
    True
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

try:
    from tabloader.engine._prepare import _resample as kernel
except ImportError:  # pragma: no cover - built without a C compiler
    kernel = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

Box = tuple[int, int, int, int]
"""(top, left, height, width) of a crop, in source pixels."""


class Resampler(enum.Enum):
    """What computes the resizes in this process."""

    KERNEL = "kernel"
    TORCH = "torch"
    PILLOW = "pillow"


@functools.cache
def resampler() -> Resampler:
    """The resampler this process uses (decided at the first resize without the kernel, and
    logged once then)."""
    if kernel is not None:
        return Resampler.KERNEL
    if optional_torch() is not None:
        logger.warning(
            "tabloader's resize kernel (tabloader.engine._prepare._resample) is not built (no C "
            "compiler at install?): images are resized by torch (the same pixels, slower, and "
            "each process imports torch). "
            "Reinstall tabloader with a C compiler to build it."
        )
        return Resampler.TORCH
    logger.warning(
        "tabloader.engine._prepare._resample is not built and torch is not installed: images are "
        "resized by Pillow (the same filter, give or take 1 in a few values, slower)."
    )
    return Resampler.PILLOW


def resize_kernel() -> str | None:
    """The kernel's code path, ``"avx2"`` or ``"scalar"``; None without the kernel."""
    return None if kernel is None else str(kernel.isa())


def resize_kernels() -> list[str]:
    """The kernel's code paths this CPU can run (``"avx2"`` where it has AVX2, ``"scalar"``);
    empty without the kernel."""
    return [] if kernel is None else list(kernel.ISAS)


def use_resize_kernel(name: str) -> str:
    """Use the kernel's ``"scalar"`` or ``"avx2"`` (``"auto"``: the best) path from now on, in
    every thread; returns the previous one. Both give the same bytes: the choice is speed
    (and a way to measure a CPU without AVX2 on one that has it). The environment variable
    ``TABLOADER_RESAMPLE=scalar|avx2`` does it for a whole process and the processes it starts
    (a loader service started by a job inherits it).

    Raises:
        ValueError: an unknown name, or no kernel.
    """
    if kernel is None:
        raise ValueError("the kernel (tabloader.engine._prepare._resample) is not built")
    return str(kernel.set_isa(name))


def torch_resizing() -> Any:
    """torch where it computes this process's resizes (no kernel), else None: a process that
    resizes with the kernel never imports torch."""
    return optional_torch() if resampler() is Resampler.TORCH else None


@functools.cache
def optional_torch() -> Any:
    """torch, imported the first time it is needed (only without the kernel), or None where it
    is not installed or does not import (a broken install is logged once, not raised per row).
    """
    try:
        import torch
    except ImportError:
        return None
    except Exception as exc:  # e.g. an OSError loading its native libraries
        logger.warning("torch does not import (%r); images are resized with Pillow", exc)
        return None
    return torch


def resize_into(
    src: npt.NDArray[np.uint8],
    out: npt.NDArray[np.uint8],
    *,
    box: Box | None = None,
    flip: bool = False,
) -> None:
    """Resize ``box`` of ``src`` into ``out``, mirrored left-right when ``flip``.

    Args:
        src: uint8 (H, W, 3); rows may have any positive stride, pixels are 3 contiguous bytes
            (other layouts are copied first). Left untouched.
        out: uint8 (h, w, 3), writable, the same layout rules (a slot of a batch).
        box: (top, left, height, width) inside ``src``; the whole image by default.
        flip: write the output columns in reverse order (a horizontal flip of the result).

    Raises:
        ValueError: a wrong dtype, shape or layout, or a box outside ``src``.
    """
    if box is None:
        box = (0, 0, src.shape[0], src.shape[1]) if src.ndim == 3 else (0, 0, 0, 0)
    mod = kernel
    if mod is not None:
        if src.ndim == 3 and (src.strides[1] != 3 or src.strides[2] != 1 or src.strides[0] <= 0):
            src = np.ascontiguousarray(src)
        mod.resize(src, out, box[0], box[1], box[2], box[3], flip)
        return
    _check(src, out, box)
    top, left, h, w = box
    res = _resize_fallback(src[top : top + h, left : left + w], out.shape[0], out.shape[1])
    out[...] = res[:, ::-1] if flip else res


def resize_hw(arr: npt.NDArray[np.uint8], out_h: int, out_w: int) -> npt.NDArray[np.uint8]:
    """``arr`` (uint8 H x W x 3, any strides) resized to a new C-contiguous ``out_h`` x
    ``out_w`` array (the same array's copy when the size does not change)."""
    if arr.shape[:2] == (out_h, out_w):
        return np.ascontiguousarray(arr)
    out = np.empty((out_h, out_w, 3), np.uint8)
    resize_into(arr, out)
    return out


def resize_many_hw(arrs: npt.NDArray[np.uint8], out_h: int, out_w: int) -> npt.NDArray[np.uint8]:
    """``arrs`` (uint8 N x H x W x 3) each resized as :func:`resize_hw` resizes it (the same
    pixels): a new N x ``out_h`` x ``out_w`` x 3, in one kernel call (its fixed cost, 15 us a
    call for 24x24 -> 16x16 through torch, is paid once for the batch)."""
    n, h, w = arrs.shape[:3]
    out = np.empty((n, out_h, out_w, 3), np.uint8)
    if kernel is None or (h, w) == (out_h, out_w):
        for k in range(n):
            out[k] = resize_hw(arrs[k], out_h, out_w)
        return out
    src = np.ascontiguousarray(arrs)
    offsets = np.arange(n, dtype=np.int64) * (h * w * 3)
    shapes = np.tile(np.array([[h, w]], np.int64), (n, 1))
    boxes = np.tile(np.array([[0, 0, h, w]], np.int64), (n, 1))
    resize_batch(src.reshape(-1), offsets, shapes, boxes, np.zeros(n, np.bool_), out)
    return out


def resize_batch(
    buffer: Any,
    offsets: npt.NDArray[np.int64],
    shapes: npt.NDArray[np.int64],
    boxes: npt.NDArray[np.int64],
    flips: npt.NDArray[np.bool_],
    out: npt.NDArray[np.uint8],
) -> None:
    """For each ``k``: the image ``shapes[k]`` = (h, w) stored C-contiguous (h, w, 3) at byte
    ``offsets[k]`` of ``buffer``, its box ``boxes[k]`` resized into ``out[k]``, mirrored where
    ``flips[k]``; one call (the kernel releases the GIL once for the whole batch).

    Args:
        buffer: one contiguous byte buffer (the arena), e.g. a uint8 array.
        offsets: (n,) ints; shapes: (n, 2) ints; boxes: (n, 4) ints (top, left, height,
            width); flips: (n,) bools. Converted to contiguous int64 / bool arrays.
        out: uint8 (n, h, w, 3), writable.

    Raises:
        ValueError: a table of the wrong dtype or shape, an image outside ``buffer`` or a box
            outside its image (naming the image).
    """
    offsets = np.ascontiguousarray(offsets, np.int64)
    shapes = np.ascontiguousarray(shapes, np.int64)
    boxes = np.ascontiguousarray(boxes, np.int64)
    flips = np.ascontiguousarray(flips, np.bool_)
    mod = kernel
    if mod is not None:
        mod.resize_batch(buffer, offsets, shapes, boxes, flips, out)
        return
    if out.ndim != 4 or out.shape[3] != 3 or out.dtype != np.uint8:
        raise ValueError(
            f"out must have shape (n, height, width, 3) and dtype uint8; got {out.shape} "
            f"{out.dtype}"
        )
    n = out.shape[0]
    if (offsets.shape, shapes.shape, boxes.shape, flips.shape) != ((n,), (n, 2), (n, 4), (n,)):
        raise ValueError(
            f"offsets, shapes, boxes and flips must have shapes (n,), (n, 2), (n, 4) and (n,) "
            f"for the n = {n} images of out; got {offsets.shape}, {shapes.shape}, "
            f"{boxes.shape}, {flips.shape}"
        )
    arena = np.frombuffer(buffer, np.uint8)
    for k in range(out.shape[0]):
        h, w = (int(v) for v in shapes[k])
        start = int(offsets[k])
        if start < 0 or h < 1 or w < 1 or start + h * w * 3 > arena.size:
            raise ValueError(
                f"image {k}: shape ({h}, {w}) at offset {start} does not fit in the "
                f"{arena.size}-byte arena"
            )
        src = arena[start : start + h * w * 3].reshape(h, w, 3)
        try:
            resize_into(src, out[k], box=_box(boxes[k]), flip=bool(flips[k]))
        except ValueError as exc:
            raise ValueError(f"image {k}: {exc}") from exc


def _box(row: Sequence[Any]) -> Box:
    return int(row[0]), int(row[1]), int(row[2]), int(row[3])


def _check(src: npt.NDArray[Any], out: npt.NDArray[Any], box: Box) -> None:
    """The kernel's input checks, for the fallbacks (the same messages)."""
    for name, arr in (("src", src), ("out", out)):
        if arr.dtype != np.uint8:
            raise ValueError(f"{name} must be a uint8 array (height, width, 3); got {arr.dtype}")
        if arr.ndim != 3 or arr.shape[2] != 3:
            raise ValueError(f"{name} must have shape (height, width, 3); got {arr.shape}")
        if 0 in arr.shape:
            raise ValueError(f"{name} is empty: shape {arr.shape}")
    if not out.flags.writeable:
        raise ValueError("out must be a writable uint8 array; got a read-only ndarray")
    top, left, h, w = box
    if h < 1 or w < 1 or top < 0 or left < 0 or top + h > src.shape[0] or left + w > src.shape[1]:
        raise ValueError(
            f"box (top, left, height, width) = {box} is not a non-empty box inside the "
            f"{src.shape[0]} x {src.shape[1]} source"
        )


def _resize_fallback(arr: npt.NDArray[np.uint8], out_h: int, out_w: int) -> npt.NDArray[np.uint8]:
    """Without the kernel: torch's ``interpolate`` (the same bytes), else Pillow's BILINEAR."""
    if arr.shape[:2] == (out_h, out_w):
        return np.ascontiguousarray(arr)
    if resampler() is Resampler.PILLOW:
        from PIL import Image

        image = Image.fromarray(np.ascontiguousarray(arr))
        return np.asarray(image.resize((out_w, out_h), Image.Resampling.BILINEAR))
    torch = optional_torch()
    arr = np.ascontiguousarray(arr)  # channels-last contiguous: torch's SIMD path
    if not arr.flags.writeable:  # Pillow's and the arena's arrays: torch wants writable memory
        arr = arr.copy()
    src = torch.from_numpy(arr).permute(2, 0, 1).unsqueeze(0)
    out = np.empty((out_h, out_w, 3), np.uint8)
    dst = torch.from_numpy(out).permute(2, 0, 1).unsqueeze(0)
    try:  # writing an HWC array seen as NCHW skips two layout conversions
        torch._C._nn._upsample_bilinear2d_aa(src, (out_h, out_w), False, None, None, out=dst)
    except (AttributeError, TypeError, RuntimeError):  # pragma: no cover - other torch builds
        res = torch.nn.functional.interpolate(
            src, size=(out_h, out_w), mode="bilinear", antialias=True
        )
        dst.copy_(res)
    return out
