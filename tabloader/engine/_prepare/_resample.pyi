"""Crop, antialiased bilinear resize and mirror of uint8 (H, W, 3) images, in C.

The bytes are those of torch's uint8 ``interpolate(mode="bilinear", antialias=True)``. Each
instruction set is one table of kernels (``ISAS``: those this CPU runs, best first). Resizes
use the best one, unless ``TABLOADER_RESAMPLE=scalar|avx2|auto`` at import or ``set_isa()``
picks another; every path gives the same bytes.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

ISAS: tuple[str, ...]
"""The code paths this CPU runs, best first: ``("avx2", "scalar")`` or ``("scalar",)``."""

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
    """Resize the box (top, left, height, width) of src into out, mirrored when flip.

    The GIL is released while the pixels are computed.

    Args:
        src: uint8 (H, W, 3): pixels as 3 contiguous bytes, rows of any positive stride.
        out: uint8 (h, w, 3), writable, laid out as src may be.
        top: The box's first row.
        left: The box's first column.
        height: The box's rows.
        width: The box's columns.
        flip: Write the output's columns in reverse order (a left-right mirror).

    Raises:
        ValueError: A wrong dtype, shape or layout, a read-only out, a box that is empty or
            not inside src, or an image over 2**24 pixels wide or tall.
    """

def resize_batch(
    arena: Buffer,
    offsets: npt.NDArray[np.int64],
    shapes: npt.NDArray[np.int64],
    boxes: npt.NDArray[np.int64],
    flips: npt.NDArray[np.bool_] | npt.NDArray[np.uint8],
    out: npt.NDArray[np.uint8],
    /,
) -> None:
    """Resize images held in one buffer, each into its slot of out.

    Image k, C-contiguous uint8 (h, w, 3) with (h, w) = shapes[k], starts at byte offsets[k]
    of arena; its box boxes[k] = (top, left, height, width) is resized into out[k], mirrored
    where flips[k]. One call: the GIL is released once for the batch.

    Args:
        arena: A contiguous byte buffer (a shared arena, a uint8 array).
        offsets: int64 (n,), C-contiguous.
        shapes: int64 (n, 2), C-contiguous.
        boxes: int64 (n, 4), C-contiguous.
        flips: bool or uint8 (n,), C-contiguous.
        out: uint8 (n, h, w, 3), writable: pixels as 3 contiguous bytes.

    Raises:
        ValueError: A table of the wrong dtype or shape, an image outside arena or a box
            outside its image (naming the image), or a wrong out.
    """

def isa() -> str:
    """The code path resizes use now: 'avx2' or 'scalar'."""

def set_isa(name: str, /) -> str:
    """Use a code path for every resize from now on, in every thread.

    For tests and benchmarks; both paths give the same bytes.

    Args:
        name: 'scalar' (portable C), 'avx2' (where the CPU has it, else the best it has) or
            'auto' (the best the CPU has).

    Returns:
        The path used until now.

    Raises:
        ValueError: An unknown name.
    """
