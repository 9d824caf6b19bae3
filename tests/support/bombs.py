"""Decompression bombs as tiny files: small real images whose headers declare a huge size.

Each is a few KB; decoded as declared, the JPEG would take ~12 GB. The tests check that they
are refused before any decoder runs; ``python -m benchmarks hostile`` times a job beside them.
"""

from __future__ import annotations

import io
import struct
import zlib
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["KINDS", "bomb", "image_bytes", "with_size"]

KINDS = ("progressive", "jpeg", "png", "webp", "gif")


def image_bytes(fmt: str, size: tuple[int, int] = (40, 30), **kw: Any) -> bytes:
    """A small real image of ``size`` (width, height) in ``fmt`` (Pillow's name)."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt, **kw)
    return out.getvalue()


def with_size(data: bytes, w: int, h: int) -> bytes:
    """``data`` (JPEG, PNG, WebP or GIF) with its header declaring ``w`` x ``h``."""
    b = bytearray(data)
    if b.startswith(b"\xff\xd8"):  # the first SOFn (Pillow writes no other FFCx before it)
        at = next(i for i in range(2, len(b) - 1) if b[i] == 0xFF and b[i + 1] in (0xC0, 0xC2))
        struct.pack_into(">HH", b, at + 5, h, w)
    elif b.startswith(b"\x89PNG"):
        struct.pack_into(">II", b, 16, w, h)
        struct.pack_into(">I", b, 29, zlib.crc32(bytes(b[12:29])))  # IHDR's CRC
    elif b[12:16] == b"VP8 ":
        struct.pack_into("<HH", b, 26, w, h)
    elif b[12:16] == b"VP8L":
        (bits,) = struct.unpack_from("<I", b, 21)
        struct.pack_into("<I", b, 21, (bits & ~0xFFFFFFF) | (w - 1) | (h - 1) << 14)
    elif b[12:16] == b"VP8X":
        b[24:27] = (w - 1).to_bytes(3, "little")
        b[27:30] = (h - 1).to_bytes(3, "little")
    elif b.startswith(b"GIF"):
        struct.pack_into("<HH", b, 6, w, h)
    else:
        raise ValueError("not a format with_size knows")
    return bytes(b)


def bomb(kind: str) -> bytes:
    """A bomb: ``progressive`` (the issue's 65500x65500 progressive JPEG), ``jpeg``
    (baseline, 30000x30000), ``png`` (13000x13000), ``webp`` (lossless, 16384x16384) or
    ``gif`` (65535x65535)."""
    if kind == "progressive":
        return with_size(image_bytes("JPEG", progressive=True), 65500, 65500)
    if kind == "jpeg":
        return with_size(image_bytes("JPEG"), 30000, 30000)
    if kind == "png":
        return with_size(image_bytes("PNG"), 13000, 13000)
    if kind == "webp":
        return with_size(image_bytes("WEBP", lossless=True), 16384, 16384)
    if kind == "gif":
        return with_size(image_bytes("GIF"), 65535, 65535)
    raise ValueError(f"no bomb of kind {kind!r}")
