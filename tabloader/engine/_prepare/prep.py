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
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from tabloader.catalog._arrays import is_binary, to_numpy
from tabloader.catalog._errors import LoaderError, RowReadError
from tabloader.engine.decode._backend import (
    DEFAULT_BACKEND,
    DecodeBackend,
    Fit,
    ImageSize,
    IntoAt,
    backend_for,
)
from tabloader.engine.decode._images import (
    DEFAULT_DECODE_BACKEND,
    check_size,
)

IMAGE_COLUMN_NAMES = frozenset({"image", "img", "jpg", "jpeg", "png", "webp", "picture", "photo"})
"""Binary columns decoded as images by default (case-insensitive)."""


class DecodeKind(enum.Enum):
    """How a :class:`Decoder` prepares its column."""

    IMAGE = "image"
    BYTES = "bytes"
    ARRAY = "array"
    SCALAR = "scalar"


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
            object.__setattr__(self, "image_size", check_size(self.image_size))
        if self.kind is DecodeKind.IMAGE and self.backend is None:
            object.__setattr__(self, "backend", DEFAULT_DECODE_BACKEND)
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


def holds_bytes(t: pa.DataType) -> bool:
    """Whether a column of type ``t`` holds bytes (binary, or an image struct's ``bytes``)."""
    return is_binary(t) or _is_hf_image(t)


def _is_hf_image(t: pa.DataType) -> bool:
    if not pa.types.is_struct(t):
        return False
    idx = t.get_field_index("bytes")
    return idx >= 0 and is_binary(t.field(idx).type)


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
        image = _is_hf_image(t) or (is_binary(t) and field.name.lower() in IMAGE_COLUMN_NAMES)
    if image:  # its backend chosen once here, for the column's plan
        return Decoder(
            field.name,
            DecodeKind.IMAGE,
            image_size=image_size,
            max_pixels=max_pixels,
            backend=backend_for(field),
        )
    if is_binary(t):
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
