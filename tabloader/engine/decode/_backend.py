"""Decode backends: how a column's encoded images become pixels, chosen once per column.

A :class:`DecodeBackend` decodes a group of one column's encoded values (read together from
the dataset's files) to the column's target size; the engine puts what it returns in the
arena, in the loader's threads or, for a fixed size where the backend allows it
(``processes``), in the decode processes (:mod:`tabloader.engine._prepare.decoding`). Built in
(:mod:`tabloader.engine._prepare.prep`): ``SimpleJpegBackend`` (libjpeg-turbo through simplejpeg,
Pillow for what it cannot decode; the default) and ``PillowBackend`` (Pillow only).

A backend plugs in by registering, with no engine module changed:
:func:`register_decode_backend`. When a job's plan is made, each image column gets the
newest registered backend whose ``accepts(field)`` is true, else the default
(:func:`~tabloader.engine._prepare.prep.decoder_for`); its values are cached apart from another
backend's (cache key ``image@224+name``), since two decoders rarely give the same pixels.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from tabloader.catalog._errors import LoaderError

#: The name of the default backend (simplejpeg, then Pillow): its cache keys carry no suffix.
DEFAULT_BACKEND = "simplejpeg"


class Fit(NamedTuple):
    """An aspect-preserving decode size, the shared prefix of augmented jobs: the smallest
    DCT-domain scale whose shorter side is still at least ``least`` (a full-size decode when
    that is above half), then, where ``cap`` is set and the shorter side is larger than it, a
    resize down to shorter side ``cap`` (FFCV's maximum resolution). Cache key suffix
    ``min{least}`` (``min{least}max{cap}``)."""

    least: int
    cap: int | None = None


ImageSize = int | tuple[int, int] | Fit
"""``224``: shorter side to 224, then center crop 224x224; ``(h, w)``: exactly hxw; a
:class:`Fit`: aspect kept (see there)."""

IntoAt = Callable[[int, tuple[int, int, int]], "npt.NDArray[np.uint8] | None"]
"""``into(k, shape)``: a writable uint8 array of ``shape`` to decode value ``k`` into (its
slot in the arena: no copy of the pixels after), or None (decode into a new array)."""


class DecodeBackend(Protocol):
    """Decodes a column's encoded images; see the module docstring.

    Attributes:
        name: its name, in the cache keys of its values (letters, digits, ``_.-``).
        processes: whether it may run in the decode processes: its ``Decoder`` (with the
            backend) is pickled to them with each task, by the class's qualified name.
    """

    name: str
    processes: bool

    def accepts(self, field: pa.Field) -> bool:
        """Whether it decodes the image column ``field`` (asked once per column, when a job's
        plan is made; the newest registered backend that accepts a column decodes it)."""
        ...

    def decode(
        self,
        values: Sequence[Any],
        *,
        size: ImageSize | None,
        max_pixels: int | None,
        into: IntoAt | None,
    ) -> list[npt.NDArray[np.uint8] | Exception]:
        """Decode ``values`` (bytes-like: ``bytes``, ``pa.Buffer``...; never null) to RGB.

        Args:
            values: a group of one column's encoded values (one task's rows).
            size: the target size (None: full size); a fixed size (an int, or ``(h, w)``)
                must give arrays of exactly that shape (``(size, size, 3)``, ``(h, w, 3)``).
            max_pixels: refuse images declaring more pixels before decoding them (None: the
                setting's, :func:`~tabloader.engine.decode.pixel_limit`).
            into: for an aspect-kept size (a :class:`Fit`) in the loader's threads, where to
                decode value ``k`` once its shape is known; a backend may ignore it.

        Returns:
            Per value, its pixels (a read-only ``uint8`` array ``(H, W, 3)``, shared by every
            job that reads the row) or the exception that failed it: a ``LoaderError`` for
            bytes it cannot decode or refuses (the engine names the row: bad data, not read
            again), a ``MemoryError`` (not the row's fault: tried again), another exception
            (fails the row this time).
        """
        ...


_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_REGISTERED: list[DecodeBackend] = []  # newest first
_LOCK = threading.Lock()


def register_decode_backend(backend: DecodeBackend) -> None:
    """Decode the image columns that ``backend.accepts`` with it, in plans made from now on
    in this process (before backends registered earlier; replacing one of the same name).

    Raises:
        LoaderError: it lacks a member of :class:`DecodeBackend`, or its name is empty, has
            other characters than letters, digits and ``_.-``, or is the default's.
    """
    missing = [
        member
        for member, ok in (
            ("accepts()", callable(getattr(backend, "accepts", None))),
            ("decode()", callable(getattr(backend, "decode", None))),
            ("processes", isinstance(getattr(backend, "processes", None), bool)),
        )
        if not ok
    ]
    if missing:
        raise LoaderError(
            f"Decode backend {backend!r} lacks {', '.join(missing)}; a backend has a name, "
            "processes (a bool), accepts(field) and decode(values, size=, max_pixels=, into=) "
            "(tabloader.engine.decode.DecodeBackend)."
        )
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise LoaderError(
            f"Decode backend {backend!r} has name {name!r}; give it a name of letters, digits, "
            "'_', '.' or '-' (it goes in the cache keys of its values)."
        )
    if name == DEFAULT_BACKEND:
        raise LoaderError(
            f"{DEFAULT_BACKEND!r} is the built-in default decode backend; give yours a name of "
            "its own."
        )
    with _LOCK:
        _REGISTERED[:] = [backend, *(b for b in _REGISTERED if b.name != name)]


def unregister_decode_backend(name: str) -> None:
    """Stop choosing the backend registered as ``name`` (nothing if none is); plans made
    already keep it."""
    with _LOCK:
        _REGISTERED[:] = [b for b in _REGISTERED if b.name != name]


def backend_for(field: pa.Field) -> DecodeBackend | None:
    """The newest registered backend that accepts image column ``field``; None: none does
    (the default decodes it)."""
    with _LOCK:
        chosen = list(_REGISTERED)
    return next((b for b in chosen if b.accepts(field)), None)
