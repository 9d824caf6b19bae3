"""Decode backends: how a column's encoded images become pixels, chosen once per column.

A :class:`DecodeBackend` decodes a group of one column's encoded values (read together from
the dataset's files) to the column's target size; the engine puts what it returns in the
arena, in the loader's threads or, for a fixed size where the backend allows it
(``processes``), in the decode processes. Built in: :class:`SimpleJpegBackend` (libjpeg-turbo
through simplejpeg, Pillow for what it cannot decode; the default) and :class:`PillowBackend`
(Pillow only); :func:`decode_image` decodes one image the way they do.

A backend plugs in by registering, with no engine module changed:
:func:`register_decode_backend`. When a job's plan is made, each image column gets the
newest registered backend whose ``accepts(field)`` is true, else the default; its values are
cached apart from another backend's (cache key ``image@224+name``), since two decoders rarely
give the same pixels.

Example:
    >>> import io, numpy as np
    >>> from PIL import Image
    >>> buf = io.BytesIO()
    >>> Image.new("RGB", (64, 48), "red").save(buf, "JPEG")
    >>> decode_image(buf.getvalue(), size=32).shape
    (32, 32, 3)
    >>> decode_image(buf.getvalue(), size=Fit(24)).shape  # aspect kept: shorter side >= 24
    (24, 32, 3)
"""

from __future__ import annotations

from tabloader.engine.decode._backend import (
    DEFAULT_BACKEND,
    DecodeBackend,
    Fit,
    ImageSize,
    IntoAt,
    backend_for,
    register_decode_backend,
    unregister_decode_backend,
)
from tabloader.engine.decode._images import (
    PillowBackend,
    SimpleJpegBackend,
    dct_least_size,
    decode_image,
    decode_images,
    pixel_limit,
)

__all__ = [
    "DEFAULT_BACKEND",
    "DecodeBackend",
    "Fit",
    "ImageSize",
    "IntoAt",
    "PillowBackend",
    "SimpleJpegBackend",
    "backend_for",
    "dct_least_size",
    "decode_image",
    "decode_images",
    "pixel_limit",
    "register_decode_backend",
    "unregister_decode_backend",
]
