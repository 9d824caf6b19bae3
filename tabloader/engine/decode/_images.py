"""The built-in decode backends: encoded images to ``uint8`` HWC pixels, the size read first.

:class:`SimpleJpegBackend` (the default) decodes JPEGs through libjpeg-turbo (simplejpeg:
scaled in the DCT domain, the GIL released) and every other format, or a JPEG simplejpeg
cannot turn into RGB (CMYK), with Pillow; :class:`PillowBackend` decodes everything with
Pillow. Both read an image's declared size before any decoder allocates
(:mod:`tabloader.engine._prepare.imagesize`) and refuse one over the pixel limit
(:func:`pixel_limit`). :func:`decode_image` is the one-image form; :func:`decode_images`
batches the resizes of a group to one fixed size.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import simplejpeg
from PIL import Image, UnidentifiedImageError

from tabloader.catalog._errors import LoaderError
from tabloader.catalog._settings import SETTINGS, setting
from tabloader.engine._prepare.imagesize import check_pixels, declared_size
from tabloader.engine._prepare.resample import resize_hw, resize_many_hw
from tabloader.engine.decode._backend import DEFAULT_BACKEND, Fit, ImageSize, IntoAt

Into = Callable[[tuple[int, int, int]], "npt.NDArray[np.uint8] | None"]
"""``into(shape)``: a writable uint8 array of ``shape`` to decode into (a slot of the arena),
or None (decode into a new array)."""

#: A decoded image of more bytes than this is resized at once by :func:`decode_images`, not
#: kept for a batched resize with others of its shape: a group's memory stays about one large
#: image (batching pays for small images only, whose resize is mostly its fixed cost).
BATCH_RESIZE_BYTES = 4 << 20


def pixel_limit(megapixels: int | None = None) -> int:
    """The pixel limit of a decode: ``megapixels`` (checked), else the setting
    ``max_image_megapixels`` (``$TABLOADER_MAX_IMAGE_MEGAPIXELS``, default 64), in pixels.

    Raises:
        LoaderError: ``megapixels`` (or the variable) is not a whole number in range.
    """
    if megapixels is not None:
        checked = SETTINGS["max_image_megapixels"].check(megapixels, error=LoaderError)
        return int(checked) * 10**6
    return int(setting("max_image_megapixels")) * 10**6


def decode_image(
    data: bytes | bytearray | memoryview | pa.Buffer,
    *,
    size: ImageSize | None = None,
    into: Into | None = None,
    max_pixels: int | None = None,
    turbo: bool = True,
) -> npt.NDArray[np.uint8]:
    """Decode encoded image bytes (JPEG, PNG, WebP...) to a read-only ``uint8`` (H, W, 3) array.

    Grayscale, palette, CMYK and RGBA images become RGB (alpha is dropped, not composited);
    16-bit grayscale keeps its high byte. EXIF orientation is not applied (as in
    torchvision's ``ImageFolder``).

    With ``size``, the result is resized deterministically with bilinear (antialiased)
    filtering: ``size=s`` scales the shorter side to ``s`` and center-crops ``s``x``s`` (the
    usual evaluation transform; done as one resize of the central square, which is the same
    mapping), ``size=(h, w)`` resizes to exactly hxw. For JPEG the decoder first asks libjpeg
    for a 1/2, 1/4 or 1/8 scale decode that is still at least the target size
    (``Image.draft``); this is much faster when the source is at least twice the target, and
    deterministic (the same bytes and size always give the same pixels), but not bit-equal to
    decoding at full size and then resizing.

    Args:
        data: the encoded image.
        size: optional target size, see above.
        into: where to decode, when the result's shape is known before decoding (a JPEG at an
            aspect-kept size that needs no resize after its DCT scale): ``into(shape)`` gives
            the array (the arena's slot: no copy of the decoded image into it, no new memory
            to fault in), or None for a new one. Otherwise unused.
        max_pixels: refuse an image whose header declares more pixels, before decoding it
            (None: :func:`pixel_limit`'s).
        turbo: decode JPEGs with libjpeg-turbo (simplejpeg) where it can (False: Pillow
            decodes every image; its pixels differ slightly).

    Returns:
        The decoded pixels, read-only (they may be shared between jobs): ``into``'s array
        where it was used.

    Raises:
        LoaderError: the bytes are not a decodable image, it declares more than
            ``max_pixels`` pixels, or ``size`` is invalid.
    """
    target = check_size(size)
    limit = pixel_limit() if max_pixels is None else max_pixels
    arr = decode_pixels(data, target, limit, into if isinstance(target, Fit) else None, turbo=turbo)
    if target is not None:
        arr = _resize(arr, target)
    arr.flags.writeable = False
    return arr


def decode_images(
    values: Sequence[bytes | bytearray | memoryview | pa.Buffer],
    *,
    size: ImageSize,
    max_pixels: int | None = None,
    turbo: bool = True,
) -> list[npt.NDArray[np.uint8] | LoaderError | MemoryError]:
    """:func:`decode_image` of each of ``values`` at ``size`` (the same pixels), or the
    ``LoaderError`` (or ``MemoryError``) it raised: the resizes of small images of one decoded
    shape run as one call (a large one's at once: ``BATCH_RESIZE_BYTES``).

    With small images the resize's fixed cost is most of it: 24x24 -> 16x16 took 15.6 us a
    call here and 1.5 us an image in a call of 256 (the resampler works image by image, so
    the pixels are those of a call each).
    """
    target = check_size(size)
    assert target is not None
    limit = pixel_limit() if max_pixels is None else max_pixels
    out: list[npt.NDArray[np.uint8] | LoaderError | MemoryError] = []
    groups: dict[tuple[tuple[int, ...], int, int], list[tuple[int, npt.NDArray[np.uint8]]]] = {}
    for i, data in enumerate(values):
        try:
            arr = decode_pixels(data, target, limit, turbo=turbo)
        except (LoaderError, MemoryError) as exc:
            out.append(exc)
            continue
        plan = _resize_plan(arr, target)
        if plan is not None and arr.nbytes > BATCH_RESIZE_BYTES:
            arr = resize_hw(*plan)
        elif plan is not None:
            src, out_h, out_w = plan
            groups.setdefault((src.shape, out_h, out_w), []).append((i, src))
        out.append(arr)
    for (_, out_h, out_w), items in groups.items():
        if len(items) == 1:
            i, src = items[0]
            out[i] = resize_hw(src, out_h, out_w)
            continue
        resized = resize_many_hw(np.stack([src for _, src in items]), out_h, out_w)
        for k, (i, _) in enumerate(items):
            out[i] = resized[k]
    for done in out:
        if isinstance(done, np.ndarray):
            done.flags.writeable = False
    return out


def decode_pixels(
    data: bytes | bytearray | memoryview | pa.Buffer,
    target: _Target | None,
    max_pixels: int,
    into: Into | None = None,
    *,
    turbo: bool = True,
) -> npt.NDArray[np.uint8]:
    """``data`` decoded as :func:`decode_image` does, before its resize to ``target``: its
    declared size checked against ``max_pixels`` first (the header, then Pillow's lazy
    ``open``, which reads only the header, for formats not read by
    :mod:`tabloader.engine._prepare.imagesize`)."""
    view = memoryview(data)
    if view.format != "B":  # pyarrow buffers export signed chars
        view = view.cast("B")
    jpeg = bytes(view[:3]) == _JPEG_MAGIC
    header = _jpeg_header(view) if jpeg else None
    declared = (header[1], header[0]) if header is not None else declared_size(view)
    if declared is not None:
        check_pixels(declared, max_pixels)
    if header is not None and turbo:
        fast = _decode_jpeg(view, target, header[:2], into)
        if fast is not None:
            return fast
    try:
        img = Image.open(io.BytesIO(data))
    except Exception as exc:
        raise _undecodable(view, exc) from exc
    with img:
        check_pixels(img.size, max_pixels)  # what Pillow will allocate (a frame may widen it)
        try:
            if target is not None and img.format == "JPEG":
                img.draft("RGB", _draft_request(img.size, target))
            return _to_rgb_array(img)
        except MemoryError:
            raise
        except Exception as exc:
            raise _undecodable(view, exc) from exc


def _undecodable(view: memoryview, exc: Exception) -> LoaderError:
    reason = "not a known image format" if isinstance(exc, UnidentifiedImageError) else exc
    return LoaderError(
        f"Cannot decode image ({len(view)} bytes starting {bytes(view[:8])!r}): {reason}. "
        "The stored bytes are not a valid image; re-import the row or exclude it."
    )


_JPEG_MAGIC = b"\xff\xd8\xff"


def _jpeg_header(data: memoryview) -> tuple[int, int, str, str] | None:
    """A JPEG's (height, width, colorspace, subsampling) as libjpeg-turbo reads its markers
    (allocating nothing for the pixels: 1.4 us, where the pure-Python walk of
    :func:`~tabloader.engine._prepare.imagesize.declared_size` takes 5.6 us, two thirds of a 24x24
    decode); None where it cannot read them (that walk then says what is damaged)."""
    try:
        return tuple(simplejpeg.decode_jpeg_header(data))
    except Exception:
        return None


def _decode_jpeg(
    data: memoryview,
    target: _Target | None,
    size: tuple[int, int],
    into: Into | None = None,
) -> npt.NDArray[np.uint8] | None:
    """Decode a JPEG with libjpeg-turbo (simplejpeg), scaled in the DCT domain (not resized to
    ``target``: the caller does); None if it can't.

    When the target is at most half the source, simplejpeg picks the smallest of
    libjpeg-turbo's n/8 scales that keeps both sides at least the target; above half, the
    full-size decode is faster than a scaled one (measured on 500x375 JPEGs: 0.96 ms full
    size, 1.10 at 6/8, 1.27 at 7/8, 0.83 at 4/8; only full size has a SIMD IDCT). It decodes
    with the GIL released and is deterministic. CMYK and other JPEGs it cannot turn into RGB
    return None (Pillow then).
    """
    kw: dict[str, Any] = {}
    if target is not None:
        h, w = size  # its header's (height, width)
        least = dct_least_size((h, w), target.least if isinstance(target, Fit) else target)
        if least is not None:
            kw = {"min_height": least[0], "min_width": least[1]}
        if into is not None and isinstance(target, Fit):
            try:  # the decoded shape (the scaled one), to decode straight into place
                dh, dw = simplejpeg.decode_jpeg_header(data, **kw)[:2]
            except Exception:
                return None
            if target.cap is None or min(dh, dw) <= target.cap:  # no resize after it
                kw["buffer"] = into((dh, dw, 3))
    try:
        arr: npt.NDArray[np.uint8] = simplejpeg.decode_jpeg(data, colorspace="RGB", **kw)
    except MemoryError:
        raise
    except Exception:
        return None
    return arr


def dct_least_size(src: tuple[int, int], target: tuple[int, int] | int) -> tuple[int, int] | None:
    """The (height, width) a JPEG of ``src`` (height, width) must keep at least when decoded
    scaled in the DCT domain for ``target``; None: decode it at full size (the target is
    above half the source: scales above 1/2 decode slower than full size, no SIMD IDCT).

    Example:
        >>> dct_least_size((240, 320), 60), dct_least_size((240, 320), 224)
        ((60, 80), None)
    """
    h, w = src
    th, tw = (target, target) if isinstance(target, int) else target
    need = target / min(h, w) if isinstance(target, int) else max(th / h, tw / w)
    if need > 0.5:
        return None
    return math.ceil(h * need), math.ceil(w * need)


_Target = tuple[int, int] | int | Fit


def check_size(size: object) -> _Target | None:
    if size is None:
        return None
    if isinstance(size, Fit):
        if isinstance(size.least, int) and size.least > 0 and (size.cap is None or size.cap > 0):
            return size
        raise LoaderError(f"image size {size!r}: least and cap must be positive ints.")
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if (
        isinstance(size, (tuple, list))
        and len(size) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)
    ):
        return (size[0], size[1])
    raise LoaderError(
        f"image size must be a positive int (shorter side + center crop) or a (height, "
        f"width) pair of positive ints, got {size!r}."
    )


def _draft_request(src: tuple[int, int], target: _Target) -> tuple[int, int]:
    """The (w, h) the image must keep at least, for ``Image.draft``."""
    w, h = src
    if isinstance(target, Fit):
        target = target.least
    if isinstance(target, int):
        m = min(w, h)
        return (math.ceil(w * target / m), math.ceil(h * target / m))
    return (target[1], target[0])


def _to_rgb_array(img: Image.Image) -> npt.NDArray[Any]:
    mode = img.mode
    if mode.startswith("I;16") or mode in ("I", "F"):
        # Pillow's convert("RGB") clips 16-bit values at 255: keep the high byte instead.
        values = np.asarray(img)
        if mode.startswith("I;16"):
            gray = (values.astype(np.uint16) >> 8).astype(np.uint8)
        else:
            gray = np.clip(values, 0, 255).astype(np.uint8)
        img = Image.fromarray(gray)
    elif mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")  # the direct P → RGB path warns for byte transparency
    if img.mode != "RGB":
        img = img.convert("RGB")
    arr = np.asarray(img)
    if arr.ndim != 3 or arr.shape[2] != 3 or arr.dtype != np.uint8:  # pragma: no cover
        raise LoaderError(f"decoded image has shape {arr.shape} {arr.dtype}, not (H, W, 3) uint8")
    return arr


def _resize(arr: npt.NDArray[np.uint8], target: _Target) -> npt.NDArray[np.uint8]:
    """Center square then ``target`` x ``target`` (an int), exactly (h, w), or a
    :class:`Fit`'s cap (aspect kept; nothing to do under the cap): Pillow's
    ``BILINEAR`` resize (a triangle filter widened by the scale factor, so that shrinking
    averages every source pixel: antialiased).

    tabloader's kernel computes it (:mod:`tabloader.engine._prepare.resample`): the bytes of torch's
    ``uint8`` ``interpolate(mode="bilinear", antialias=True)``, a port of Pillow-SIMD's
    resampler (Pillow's own pixels give or take 1 in about 0.2% of the values when shrinking,
    up to 2 in a few % when enlarging), with SIMD and the GIL released, and without importing
    torch in the decode processes. Measured on the generated 500x375 JPEGs, one thread,
    375x375 -> 224x224: 0.36 ms with torch, against 1.10 for Pillow and 1.39 for OpenCV's
    ``INTER_AREA`` (used before); the kernel does it in 0.07 ms.
    """
    plan = _resize_plan(arr, target)
    return arr if plan is None else resize_hw(*plan)


def _resize_plan(
    arr: npt.NDArray[np.uint8], target: _Target
) -> tuple[npt.NDArray[np.uint8], int, int] | None:
    """What ``_resize`` resizes: (the source, a view of ``arr``; out height; out width), or
    None where ``arr`` is the result already (a :class:`Fit` under its cap)."""
    h, w = arr.shape[:2]
    if isinstance(target, Fit):
        m = min(h, w)
        if target.cap is None or m <= target.cap:
            return None
        out_h, out_w = (
            (target.cap, round(w * target.cap / h))
            if h == m
            else (
                round(h * target.cap / w),
                target.cap,
            )
        )
    elif isinstance(target, int):
        m = min(h, w)
        y, x = (h - m) // 2, (w - m) // 2
        arr = arr[y : y + m, x : x + m]
        out_h = out_w = target
    else:
        out_h, out_w = target
    return arr, out_h, out_w


class PillowBackend:
    """A decode backend (:mod:`tabloader.engine.decode`): Pillow decodes every image (a JPEG
    scaled in the DCT domain by ``Image.draft``); a fixed size's resizes are batched
    (:func:`decode_images`). Not chosen unless registered."""

    name = "pillow"
    processes = True
    turbo = False  # whether JPEGs go through simplejpeg first

    def accepts(self, field: pa.Field) -> bool:
        return True

    def decode(
        self,
        values: Sequence[Any],
        *,
        size: ImageSize | None,
        max_pixels: int | None,
        into: IntoAt | None,
    ) -> list[npt.NDArray[np.uint8] | Exception]:
        if size is not None and not isinstance(size, Fit):
            return [*decode_images(values, size=size, max_pixels=max_pixels, turbo=self.turbo)]
        return [self._one(value, size, max_pixels, into, k) for k, value in enumerate(values)]

    def _one(
        self, value: Any, size: ImageSize | None, limit: int | None, into: IntoAt | None, k: int
    ) -> npt.NDArray[np.uint8] | Exception:
        where = None if into is None else functools.partial(into, k)
        try:
            return decode_image(value, size=size, into=where, max_pixels=limit, turbo=self.turbo)
        except Exception as exc:  # LoaderError: the bytes; MemoryError: not the row's fault
            return exc

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SimpleJpegBackend(PillowBackend):
    """The default decode backend: JPEGs through libjpeg-turbo (simplejpeg: DCT-domain
    scaling, the GIL released), Pillow for other formats and the JPEGs simplejpeg cannot turn
    into RGB (CMYK)."""

    name = DEFAULT_BACKEND
    turbo = True


DEFAULT_DECODE_BACKEND = SimpleJpegBackend()
