"""The crop-resize-flip kernel (``_resample.c``): torch's uint8 antialiased bilinear, exactly."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

CPU_AVX2: int
"""1 where the CPU has AVX2 (the fast path can run), else 0."""

def resize(
    src: npt.NDArray[np.uint8],
    out: npt.NDArray[np.uint8],
    top: int,
    left: int,
    height: int,
    width: int,
    flip: bool,
    /,
) -> None:
    """Resize the box (top, left, height, width) of ``src`` (H x W x 3) into ``out`` (h x w x 3),
    mirrored left-right when ``flip``; the GIL is released."""

def resize_batch(
    arena: npt.NDArray[np.uint8],
    offsets: npt.NDArray[np.int64],
    shapes: npt.NDArray[np.int64],
    boxes: npt.NDArray[np.int64],
    flips: npt.NDArray[np.bool_] | npt.NDArray[np.uint8],
    out: npt.NDArray[np.uint8],
    /,
) -> None:
    """For each k: the image of ``shapes[k]`` at byte ``offsets[k]`` of ``arena``, its box
    ``boxes[k]`` resized into ``out[k]``, mirrored where ``flips[k]``; one call, the GIL released
    once."""

def isa() -> str:
    """The code path resizes use now: ``"avx2"`` or ``"scalar"``."""

def set_isa(name: str, /) -> str:
    """Use ``"scalar"``, ``"avx2"`` or ``"auto"`` from now on, in every thread; returns the last."""
