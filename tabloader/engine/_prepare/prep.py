"""Shared preparation: turn stored Arrow values into prepared values, once for every job.

Decoding (JPEG or any Pillow format → ``uint8`` HWC) is the expensive, deterministic part of
loading an image, so it is done once per row and served to every job from the engine's
:class:`~tabloader.engine._arena.arena.Arena`.
Random augmentation (crop, flip) is per job and does not belong here: jobs never share a
random draw.

A :class:`Decoder` turns one column's Arrow value into ``(prepared, nbytes)``.
:func:`decoder_for` picks one from the field type:

=====================================  ==============================================
column                                 prepared value
=====================================  ==============================================
binary named like an image, or listed  ``uint8`` array (H, W, 3), via :func:`decode_image`
in ``image_columns``; or a Hugging
Face image struct ``{bytes, path}``
other binary                           ``bytes`` as stored
list / fixed-size list                 numpy array (owned copy)
int / float / bool                     numpy scalar of the column's dtype
anything else (string, date...)        the Python value (``as_py()``)
=====================================  ==============================================

**Cache keys.** ``Decoder.key`` is the column part of a cache key ``(row_id, key)``: the
column name for raw values (``"label"``, ``"image"`` for raw bytes), and
``f"{column}@{params}"`` for decoded images: ``"image@rgb"`` (full size), ``"image@224"``
(shorter side 224, center crop), ``"image@224x160"`` (exactly 224 high, 160 wide). Jobs that
decode a column the same way share entries; different parameters never do. (A column whose
own name contains ``@`` could collide with this grammar; don't name columns that way.)

**Decode backends.** An image column's values are decoded by its decoder's ``backend``
(:mod:`tabloader.engine.decode`), chosen once in :func:`decoder_for`: a registered backend
that accepts the column, else :class:`SimpleJpegBackend` (libjpeg-turbo, then Pillow);
:class:`PillowBackend` decodes with Pillow alone. A backend other than the default adds
``+name`` to the cache key (``"image@224+pillow"``): its pixels are its own.

**Sharing is read-only.** Decoded images are marked read-only, because one value is shared
by every job that reads the row (in the engine's arena); each job gets a copy in its own
batch. Other columns are never decoded one value at a time: :func:`batch_column` turns a
batch's gathered Arrow values into fresh, writable arrays in one vectorized step.

**Size before decode.** Every decode reads the image's declared size from its header first
(:mod:`tabloader.engine._prepare.imagesize`) and refuses one over ``max_pixels`` (the setting
``max_image_megapixels``, 64 MP by default: :func:`pixel_limit`) before any decoder allocates:
the fast JPEG decoder, Pillow, a decode into an arena slot alike.

**Errors.** :func:`decode_image` raises :class:`~tabloader.catalog._errors.LoaderError` for bytes it
cannot decode or refuses (it does not know the row); a ``MemoryError`` passes through as it
is (it says nothing about the bytes: a decode process ends on one, see
:mod:`tabloader.engine._prepare.decoding`). A :class:`Decoder` called with ``row_id=`` turns
that into :class:`~tabloader.catalog._errors.RowReadError` with the row id and column, which is what
the engine should do; without ``row_id`` the ``LoaderError`` passes through.

Example:
    >>> import pyarrow as pa
    >>> dec = decoder_for(pa.field("image", pa.binary()), image_size=224)
    >>> dec.key
    'image@224'
    >>> decoder_for(pa.field("label", pa.int16()))(pa.scalar(3, pa.int16()))
    (np.int16(3), 2)
"""

from __future__ import annotations

import enum
import functools
import io
import math
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import simplejpeg
from PIL import Image, UnidentifiedImageError

from tabloader.catalog._arrays import to_numpy
from tabloader.catalog._errors import LoaderError, RowReadError
from tabloader.catalog._settings import SETTINGS, setting
from tabloader.engine._prepare.imagesize import check_pixels, declared_size
from tabloader.engine._prepare.resample import resize_hw, resize_many_hw
from tabloader.engine.decode import (
    DEFAULT_BACKEND,
    DecodeBackend,
    Fit,
    ImageSize,
    IntoAt,
    backend_for,
)

__all__ = [
    "IMAGE_COLUMN_NAMES",
    "DecodeBackend",
    "DecodeKind",
    "Decoder",
    "Fit",
    "ImageSize",
    "Into",
    "PillowBackend",
    "SimpleJpegBackend",
    "batch_column",
    "decode_image",
    "decode_images",
    "decoder_for",
    "holds_bytes",
    "pixel_limit",
    "resize_hw",
    "resize_many_hw",
]


IMAGE_COLUMN_NAMES = frozenset({"image", "img", "jpg", "jpeg", "png", "webp", "picture", "photo"})
"""Binary columns decoded as images by default (case-insensitive)."""


class DecodeKind(enum.Enum):
    """How a :class:`Decoder` prepares its column."""

    IMAGE = "image"
    BYTES = "bytes"
    ARRAY = "array"
    SCALAR = "scalar"


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
    target = _check_size(size)
    limit = pixel_limit() if max_pixels is None else max_pixels
    arr = _decode(data, target, limit, into if isinstance(target, Fit) else None, turbo=turbo)
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
    target = _check_size(size)
    assert target is not None
    limit = pixel_limit() if max_pixels is None else max_pixels
    out: list[npt.NDArray[np.uint8] | LoaderError | MemoryError] = []
    groups: dict[tuple[tuple[int, ...], int, int], list[tuple[int, npt.NDArray[np.uint8]]]] = {}
    for i, data in enumerate(values):
        try:
            arr = _decode(data, target, limit, turbo=turbo)
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


def _decode(
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


def _check_size(size: object) -> _Target | None:
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


_DEFAULT_BACKEND = SimpleJpegBackend()


@dataclass(frozen=True)
class Decoder:
    """Prepares the values of one column; callable as ``decoder(value, row_id=...)``.

    Attributes:
        column: the column name.
        kind: how values are prepared.
        image_size: target size for ``DecodeKind.IMAGE`` (see :func:`decode_image`).
        dtype: numpy dtype of scalars / array items, or None to infer.
        max_pixels: images declaring more pixels are refused before decoding (None:
            :func:`pixel_limit`'s, read at each decode; a loader sets its own).
        backend: what decodes an image column's values (:mod:`tabloader.engine.decode`;
            None: the default, :class:`SimpleJpegBackend`); named in ``key`` unless default.
        key: the cache key column, ``column`` or ``f"{column}@{params}"``.
    """

    column: str
    kind: DecodeKind
    image_size: ImageSize | None = None
    dtype: str | None = None
    max_pixels: int | None = None
    backend: DecodeBackend | None = field(default=None, compare=False)
    key: str = field(init=False)

    def __post_init__(self) -> None:
        if self.image_size is not None:
            if self.kind is not DecodeKind.IMAGE:
                raise LoaderError(
                    f"image_size={self.image_size!r} given for column {self.column!r}, which "
                    f"is decoded as {self.kind.value}; only image columns take a size."
                )
            object.__setattr__(self, "image_size", _check_size(self.image_size))
        if self.kind is DecodeKind.IMAGE and self.backend is None:
            object.__setattr__(self, "backend", _DEFAULT_BACKEND)
        elif self.kind is not DecodeKind.IMAGE and self.backend is not None:
            raise LoaderError(
                f"decode backend {self.backend.name!r} given for column {self.column!r}, which "
                f"is decoded as {self.kind.value}; only image columns have one."
            )
        size = self.image_size
        if self.kind is not DecodeKind.IMAGE:
            key = self.column
        elif size is None:
            key = f"{self.column}@rgb"
        elif isinstance(size, Fit):
            key = f"{self.column}@min{size.least}" + (f"max{size.cap}" if size.cap else "")
        elif isinstance(size, int):
            key = f"{self.column}@{size}"
        else:
            key = f"{self.column}@{size[0]}x{size[1]}"
        if self.backend is not None and self.backend.name != DEFAULT_BACKEND:
            key += f"+{self.backend.name}"
        object.__setattr__(self, "key", key)

    @property
    def fixed_shape(self) -> tuple[int, int, int] | None:
        """The shape of every value of a fixed ``image_size`` (an int: a square); None where
        values differ in shape (full size, aspect kept) or are not images."""
        size = self.image_size
        if size is None or isinstance(size, Fit):
            return None
        return (size, size, 3) if isinstance(size, int) else (*size, 3)

    @property
    def in_processes(self) -> bool:
        """Whether decode processes may decode this column: they fill slots reserved for a
        fixed shape, with a backend that may run there (its ``processes``)."""
        return self.fixed_shape is not None and self.backend is not None and self.backend.processes

    def many(
        self,
        values: Sequence[Any],
        row_ids: Sequence[int],
        into: IntoAt | None = None,
    ) -> list[Any]:
        """Prepare ``values`` of rows ``row_ids``: per value what ``self(value, row_id=...)``
        returns first, or the exception it raises. Images go to the column's ``backend``
        together (the default batches a fixed ``image_size``'s resizes: the same pixels),
        unless a subclass prepares values its own way (overrides ``__call__``); aspect-kept
        ones (a :class:`Fit`) into ``into(k, shape)``'s array for value ``k`` where the
        backend uses it (see :func:`decode_image`)."""
        own_call = type(self).__call__ is not Decoder.__call__  # a subclass's: value by value
        backend = self.backend
        if own_call or backend is None:
            out: list[Any] = []
            for value, row in zip(values, row_ids, strict=True):
                try:
                    out.append(self(value, row_id=row)[0])
                except Exception as exc:
                    out.append(exc)
            return out
        out = [None] * len(values)
        todo: list[int] = []
        for i, value in enumerate(values):
            try:
                out[i] = _image_bytes(self, value)
                todo.append(i)
            except LoaderError as exc:
                out[i] = self._row_error(exc, row_ids[i])
        where = into if into is None or len(todo) == len(values) else _skipping(into, todo)
        decoded = backend.decode(
            [out[i] for i in todo], size=self.image_size, max_pixels=self.max_pixels, into=where
        )
        if len(decoded) != len(todo):
            raise LoaderError(
                f"Decode backend {backend.name!r} returned {len(decoded)} values for "
                f"{len(todo)} of column {self.column!r}; it must return one per value."
            )
        for i, arr in zip(todo, decoded, strict=True):
            out[i] = self._row_error(arr, row_ids[i]) if isinstance(arr, LoaderError) else arr
        return out

    def _row_error(self, exc: LoaderError, row_id: int) -> LoaderError:
        """``exc`` as ``__call__`` raises it for row ``row_id``."""
        if isinstance(exc, RowReadError):
            return exc
        err = RowReadError(
            f"row {row_id}, column {self.column!r}: {exc}", row_id=row_id, column=self.column
        )
        err.__cause__ = exc
        return err

    def __call__(self, value: Any, *, row_id: int | None = None) -> tuple[Any, int]:
        """Prepare one value.

        Args:
            value: an Arrow scalar or the equivalent Python value.
            row_id: the row's ``_id``; when given, failures raise ``RowReadError``.

        Returns:
            ``(prepared, nbytes)``, ready for :meth:`RowCache.get_or_load`.

        Raises:
            LoaderError: the value cannot be prepared (``RowReadError`` with ``row_id``).
        """
        try:
            return _PREPARE[self.kind](self, value)
        except LoaderError as exc:
            if row_id is None or isinstance(exc, RowReadError):
                raise
            raise RowReadError(
                f"row {row_id}, column {self.column!r}: {exc}", row_id=row_id, column=self.column
            ) from exc


def _skipping(into: IntoAt, todo: list[int]) -> IntoAt:
    """``into`` for the values ``todo`` only: the backend's value ``k`` is value ``todo[k]``."""
    return lambda k, shape: into(todo[k], shape)


def _prepare_image(dec: Decoder, value: Any) -> tuple[Any, int]:
    assert dec.backend is not None  # (every image decoder has one)
    (arr,) = dec.backend.decode(
        [_image_bytes(dec, value)], size=dec.image_size, max_pixels=dec.max_pixels, into=None
    )
    if isinstance(arr, Exception):
        raise arr
    return arr, arr.nbytes


def _image_bytes(dec: Decoder, value: Any) -> Any:
    """The encoded bytes of an image value (a Hugging Face struct's ``bytes``); a null fails."""
    if isinstance(value, (pa.StructScalar, Mapping)):
        value = value["bytes"]  # Hugging Face image struct {bytes, path}
    if isinstance(value, pa.Scalar):
        value = value.as_buffer() if value.is_valid else None
    if value is None:
        raise LoaderError(
            f"column {dec.column!r} is null in this row; exclude such rows in the job "
            f"(WHERE {dec.column} IS NOT NULL)."
        )
    return value


def _prepare_bytes(dec: Decoder, value: Any) -> tuple[Any, int]:
    if isinstance(value, pa.Scalar):
        value = value.as_py()
    elif isinstance(value, (memoryview, bytearray, pa.Buffer)):
        value = bytes(value)
    return value, 0 if value is None else sys.getsizeof(value)


def _prepare_array(dec: Decoder, value: Any) -> tuple[Any, int]:
    if isinstance(value, pa.Scalar):
        if not value.is_valid:
            return None, 0
        flat = getattr(value, "values", None)
        if isinstance(flat, pa.Array) and flat.null_count == 0 and _is_primitive(flat.type):
            arr = np.array(flat.to_numpy(zero_copy_only=False))  # own the memory
        else:
            arr = np.array(value.as_py(), dtype=dec.dtype)
    elif value is None:
        return None, 0
    else:
        arr = np.array(value, dtype=dec.dtype)
    arr.flags.writeable = False
    return arr, arr.nbytes


def _prepare_scalar(dec: Decoder, value: Any) -> tuple[Any, int]:
    if isinstance(value, pa.Scalar):
        value = value.as_py()
    if value is None:
        return None, 0
    if dec.dtype is not None:
        item = np.dtype(dec.dtype).type(value)
        return item, item.nbytes
    return value, sys.getsizeof(value)


_PREPARE: dict[DecodeKind, Callable[[Decoder, Any], tuple[Any, int]]] = {
    DecodeKind.IMAGE: _prepare_image,
    DecodeKind.BYTES: _prepare_bytes,
    DecodeKind.ARRAY: _prepare_array,
    DecodeKind.SCALAR: _prepare_scalar,
}


def _is_binary(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_binary_view(t)
    )


def holds_bytes(t: pa.DataType) -> bool:
    """Whether a column of type ``t`` holds bytes (binary, or an image struct's ``bytes``)."""
    return _is_binary(t) or _is_hf_image(t)


def _is_hf_image(t: pa.DataType) -> bool:
    if not pa.types.is_struct(t):
        return False
    idx = t.get_field_index("bytes")
    return idx >= 0 and _is_binary(t.field(idx).type)


def _is_list(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_fixed_size_list(t)
        or pa.types.is_list_view(t)
        or pa.types.is_large_list_view(t)
    )


def _is_primitive(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def _numpy_dtype(t: pa.DataType) -> str | None:
    while _is_list(t):
        t = t.value_type
    return np.dtype(t.to_pandas_dtype()).name if _is_primitive(t) else None


def decoder_for(
    field: pa.Field,
    *,
    image_size: ImageSize | None = None,
    image_columns: Collection[str] | None = None,
    max_pixels: int | None = None,
) -> Decoder:
    """Pick the decoder for a column from its Arrow field.

    Args:
        field: the column's field.
        image_size: target size for image columns (ignored for other columns).
        image_columns: the columns to decode as images. None (default) means binary
            columns named like an image (``IMAGE_COLUMN_NAMES``) and Hugging Face image
            structs; a collection means exactly those columns (``()`` decodes none).
        max_pixels: an image column's pixel limit (see :class:`Decoder`).

    Returns:
        The decoder; its ``key`` is the cache key column. An image column's decode backend
        is the newest registered one that accepts ``field``, else the default
        (:func:`~tabloader.engine.decode.backend_for`).

    Raises:
        LoaderError: a column listed in ``image_columns`` does not hold bytes, or
            ``image_size`` is invalid.
    """
    t = field.type
    image_bytes = holds_bytes(t)
    if image_columns is not None:
        image = field.name in image_columns
        if image and not image_bytes:
            raise LoaderError(
                f"column {field.name!r} is {t}, not binary; only binary columns (or "
                "{bytes, path} image structs) can be decoded as images. Remove it from "
                "image_columns."
            )
    else:
        image = _is_hf_image(t) or (_is_binary(t) and field.name.lower() in IMAGE_COLUMN_NAMES)
    if image:  # its backend chosen once here, for the column's plan
        return Decoder(
            field.name,
            DecodeKind.IMAGE,
            image_size=image_size,
            max_pixels=max_pixels,
            backend=backend_for(field),
        )
    if _is_binary(t):
        return Decoder(field.name, DecodeKind.BYTES)
    if _is_list(t):
        return Decoder(field.name, DecodeKind.ARRAY, dtype=_numpy_dtype(t))
    return Decoder(field.name, DecodeKind.SCALAR, dtype=_numpy_dtype(t))


def batch_column(values: pa.Array, dec: Decoder) -> Any:
    """One column of a batch from its gathered Arrow values, vectorized (no per-row decode).

    * numbers and bools without nulls -> a numpy array (B,) of the column's dtype;
    * lists of numbers without nulls, all of one length (fixed-size lists: embeddings, token
      windows) -> one numpy array (B, L); of differing lengths -> a list of arrays;
    * anything else (strings, bytes, dates, nulls) -> a list of Python values.

    Arrays are new and writable: a job may change its batch in place.
    """
    t = values.type
    if values.null_count == 0 and _is_primitive(t):
        return np.asarray(to_numpy(values), dtype=dec.dtype)
    if values.null_count == 0 and _is_flat_list(t) and _is_primitive(t.value_type):
        flat = values.flatten()
        if flat.null_count == 0 and len(values):
            items = np.asarray(flat.to_numpy(zero_copy_only=False), dtype=dec.dtype)
            if pa.types.is_fixed_size_list(t):
                return items.reshape(len(values), t.list_size).copy()
            offsets = values.offsets.to_numpy()
            lengths = np.diff(offsets)
            if (lengths == lengths[0]).all():
                return items.reshape(len(values), int(lengths[0])).copy()
            return [a.copy() for a in np.split(items, offsets[1:-1] - offsets[0])]
    return values.to_pylist()


def _is_flat_list(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))
