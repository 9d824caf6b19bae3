"""An image's declared size, read from its header before any decoder allocates.

A decoder allocates what the header declares: a 4 KB JPEG whose frame header says
65500x65500 made libjpeg-turbo allocate 12 GB, and a 493 KB PNG of 13000x13000 decodes to
1.67 GB. So every decode path (:func:`tabloader.engine.decode.decode_image` and
:func:`~tabloader.engine.decode.decode_images`, in threads, in decode processes, into an
arena slot) first reads the declared width and height here and refuses the image when
width x height is over the pixel limit (:func:`check_pixels`); then the decoder runs.

The formats read here take microseconds and allocate nothing (no Pillow object):

====== ===================================================================================
JPEG   the first frame header (any SOFn, progressive SOF2 included), walking the segments
       before it by their lengths and skipping fill and garbage bytes as libjpeg does
PNG    ``IHDR``, the first chunk
WebP   ``VP8 `` (lossy), ``VP8L`` (lossless) or ``VP8X`` (extended: the canvas)
GIF    the logical screen, widened by the first frame's extent (as Pillow widens it)
====== ===================================================================================

Other formats return None here; the decoder then checks Pillow's ``Image.open(...).size``,
which reads the header only (Pillow decodes on ``load()``). A header that is cut short or
malformed is refused with a clear error (the image could not be decoded anyway). Every scan
moves forward through the bytes it was given, so it ends, whatever they hold.
"""

from __future__ import annotations

import re
import struct
from typing import Any

from tabloader.catalog._errors import LoaderError

PIXEL_LIMIT_FIX = (
    "tabloader serve --max-image-megapixels N, $TABLOADER_MAX_IMAGE_MEGAPIXELS or "
    "Loader(max_image_megapixels=N)"
)
"""Where the pixel limit is raised (the setting ``max_image_megapixels``)."""

_JPEG = b"\xff\xd8"
_PNG = b"\x89PNG\r\n\x1a\n"
_GIFS = (b"GIF87a", b"GIF89a")
# a marker: 0xFF, any fill bytes 0xFF, then its code (0x00 after 0xFF is not a marker)
_MARKER = re.compile(rb"\xff+([\x01-\xfe])")
# frame headers: every SOFn, but DHT (C4), JPG (C8) and DAC (CC), which share the range
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})  # TEM, RSTn, SOI: no length follows


def declared_size(data: Any) -> tuple[int, int] | None:
    """The (width, height) that the header of encoded image ``data`` declares, for JPEG, PNG,
    WebP and GIF; None for other formats (see the module docstring).

    Raises:
        LoaderError: the header of one of those formats is cut short or malformed.

    Example:
        >>> declared_size(b"GIF89a" + bytes([0x20, 0, 0x10, 0]) + bytes(3))
        (32, 16)
    """
    view = memoryview(data)
    if view.format != "B":  # pyarrow buffers export signed chars
        view = view.cast("B")
    head = bytes(view[:16])
    if head.startswith(_JPEG):
        return _jpeg(view)
    if head.startswith(_PNG):
        return _png(view)
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return _webp(view)
    if head.startswith(_GIFS):
        return _gif(view)
    return None


def check_pixels(size: tuple[int, int], max_pixels: int) -> None:
    """Refuse an image whose declared ``size`` (width, height) is over ``max_pixels``.

    Raises:
        LoaderError: ``width * height > max_pixels``, naming the size, the limit and where to
            raise it.
    """
    w, h = size
    if w * h > max_pixels:
        raise LoaderError(
            f"the image declares {w}x{h} pixels ({w * h / 1e6:.1f} megapixels), over the limit "
            f"of {max_pixels / 1e6:g} megapixels, so it was refused before decoding (a "
            f"decompression bomb, or a very large image). If such images are real, raise the "
            f"limit ({PIXEL_LIMIT_FIX}); else leave the row out of the job."
        )


def _damaged(fmt: str, what: str) -> LoaderError:
    return LoaderError(
        f"the {fmt} header is damaged ({what}); the stored bytes are not a valid image. "
        "Re-import the row or exclude it."
    )


def _need(view: memoryview, end: int, fmt: str, what: str) -> None:
    if len(view) < end:
        raise _damaged(fmt, f"{len(view)} bytes end before its {what}")


def _jpeg(view: memoryview) -> tuple[int, int]:
    pos = 2
    while True:
        found = _MARKER.search(view, pos)  # skips garbage before a marker, as libjpeg does
        if found is None:
            raise _damaged("JPEG", "no frame header (SOF) before the end of the data")
        code, at = found.group(1)[0], found.end()
        if code in _STANDALONE:
            pos = at
            continue
        if code in (0xD9, 0xDA):  # EOI, SOS
            raise _damaged("JPEG", f"marker 0x{code:02X} before any frame header (SOF)")
        _need(view, at + 2, "JPEG", f"segment 0x{code:02X}'s length")
        (length,) = struct.unpack_from(">H", view, at)
        if length < 2:
            raise _damaged("JPEG", f"segment 0x{code:02X} has length {length}")
        if code in _SOF:
            _need(view, at + 7, "JPEG", "frame header")
            h, w = struct.unpack_from(">HH", view, at + 3)
            if h == 0 or w == 0:
                raise _damaged("JPEG", f"the frame header declares {w}x{h} (DNL is unsupported)")
            return w, h
        pos = at + length


def _png(view: memoryview) -> tuple[int, int]:
    _need(view, 24, "PNG", "IHDR chunk")
    if bytes(view[12:16]) != b"IHDR":
        raise _damaged("PNG", f"the first chunk is {bytes(view[12:16])!r}, not IHDR")
    w, h = struct.unpack_from(">II", view, 16)
    if w == 0 or h == 0 or w > 0x7FFFFFFF or h > 0x7FFFFFFF:
        raise _damaged("PNG", f"IHDR declares {w}x{h}")
    return w, h


def _webp(view: memoryview) -> tuple[int, int]:
    _need(view, 20, "WebP", "first chunk")
    chunk = bytes(view[12:16])
    if chunk == b"VP8 ":  # lossy: a frame tag (3 bytes), a start code, 14-bit sizes
        _need(view, 30, "WebP", "VP8 frame header")
        if bytes(view[23:26]) != b"\x9d\x01\x2a":
            raise _damaged("WebP", "no VP8 start code")
        w, h = struct.unpack_from("<HH", view, 26)
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L":  # lossless: a signature byte, then 14 bits each of width-1, height-1
        _need(view, 25, "WebP", "VP8L header")
        if view[20] != 0x2F:
            raise _damaged("WebP", "no VP8L signature")
        (bits,) = struct.unpack_from("<I", view, 21)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":  # extended: flags (4 bytes), then 24 bits each of canvas w-1, h-1
        _need(view, 30, "WebP", "VP8X canvas size")
        w = int.from_bytes(view[24:27], "little") + 1
        h = int.from_bytes(view[27:30], "little") + 1
        return w, h
    raise _damaged("WebP", f"the first chunk is {chunk!r}, not VP8, VP8L or VP8X")


def _gif(view: memoryview) -> tuple[int, int]:
    _need(view, 13, "GIF", "logical screen descriptor")
    w, h, flags = struct.unpack_from("<HHB", view, 6)
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # the global color table
    n = len(view)
    while pos < n:  # extensions, up to the first frame (cut short: the decoder fails)
        kind = view[pos]
        if kind == 0x2C:  # image descriptor: left, top, width, height
            if pos + 9 > n:
                break
            x0, y0, fw, fh = struct.unpack_from("<HHHH", view, pos + 1)
            return max(w, x0 + fw), max(h, y0 + fh)  # Pillow widens the canvas to the frame
        if kind != 0x21:  # the trailer, or not a block: no frame
            break
        pos += 2  # introducer and label, then sub-blocks until one of size 0
        while pos < n and view[pos]:
            pos += view[pos] + 1
        pos += 1
    return w, h
