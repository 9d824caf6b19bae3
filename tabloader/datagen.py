"""Synthetic ImageNet-like data for the demo, the tests and the benchmarks.

``make_imagefolder`` writes real JPEGs in ``root/<class>/<file>`` layout. Benchmarks of reading
and decoding are only honest if the files look like ImageNet's to the disk and to libjpeg, so the
images are about 500x375 with jittered widths and heights, and their content is not trivially
compressible: a smooth per-class colour field, a few random shapes (edges) and a noise texture,
giving roughly 45-100 KB per image at quality 85 (ImageNet averages ~110 KB).

Speed: each image is built with a handful of C-level Pillow operations (a bilinear upscale, a
few shapes, one ``ImageChops.add`` of a crop of a per-seed noise bank, the JPEG encode), about
6 ms per image, and large folders are spread over a ``ProcessPoolExecutor``.

Determinism: image ``i`` depends only on ``(seed, i)`` and the parameters, never on the worker
that made it, so a seed gives the same bytes with any ``workers`` (for one Pillow/libjpeg build).

Idempotence: a finished folder holds a hidden marker with its parameters; calling again with the
same parameters returns at once, so benchmarks can share one folder. Generation goes to a hidden
temporary sibling that is renamed into place at the end, so an interrupted run leaves no
half-written folder behind.

``make_metadata_table`` builds an ImageNet-sized metadata table (1.28M rows in a fraction of a
second) for catalog and sampling benchmarks that need no pixels; ``corrupt_image`` breaks a JPEG
for error-path tests.
"""

from __future__ import annotations

import enum
import functools
import io
import json
import logging
import math
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from PIL import Image, ImageChops, ImageDraw

__all__ = ["MARKER", "Corruption", "corrupt_image", "make_imagefolder", "make_metadata_table"]

logger = logging.getLogger(__name__)

MARKER = ".tabloader-datagen.json"
"""Name of the marker file in a finished folder (hidden, so importers skip it)."""

_GENERATOR_VERSION = 1  # bump when the pixels change, so old folders are regenerated
_NOISE_LEVELS = (64, 128, 192)  # noise amplitudes; one per image, so file sizes vary
_CHUNK = 64  # images per task of the process pool
_PARALLEL_FROM = 256  # with workers=None, smaller folders are made in-process
_VAL_FRACTION = 50_000 / 1_331_167  # ImageNet-1k val / (train + val)


class Corruption(enum.Enum):
    """How ``corrupt_image`` breaks a file."""

    TRUNCATE = "truncate"
    """Keep the first third: the header parses, decoding fails ("image file is truncated")."""
    HEADER = "header"
    """Overwrite the first bytes: the file is not recognised as an image at all."""


def make_imagefolder(
    root: str | os.PathLike[str],
    *,
    num_images: int = 2000,
    num_classes: int = 10,
    size: tuple[int, int] = (500, 375),
    size_jitter: float = 0.2,
    quality: int = 85,
    seed: int = 0,
    workers: int | None = None,
    progress: Callable[[int], object] | None = None,
) -> Path:
    """Write an ImageNet-like image folder of real JPEGs, or reuse an identical one.

    Image ``i`` goes to ``root/class_<i % num_classes>/img_<i>.jpg``; class folders are named
    ``class_000``, ``class_001``, ...

    Args:
        root: the folder to create. If it holds a folder made by this function with the same
            parameters, it is returned untouched; one made with other parameters is replaced.
        num_images: number of images.
        num_classes: number of class folders.
        size: nominal (width, height).
        size_jitter: each of width and height is scaled by a factor drawn uniformly from
            ``[1 - size_jitter, 1 + size_jitter]``.
        quality: JPEG quality (1-95).
        seed: the same seed gives the same bytes.
        workers: processes to use; None picks the CPU count for large folders (and 1 for small
            ones), 0 or 1 works in this process.
        progress: called with the number of images done so far, from this process.

    Returns:
        ``root`` as a ``Path``.

    Raises:
        ValueError: a parameter is out of range.
        FileExistsError: ``root`` exists, is not empty and was not made by this function.

    Example:
        >>> import tempfile, pathlib
        >>> root = make_imagefolder(pathlib.Path(tempfile.mkdtemp()) / "imgs", num_images=4,
        ...                         num_classes=2, size=(64, 48))
        >>> sorted(p.relative_to(root).as_posix() for p in root.rglob("*.jpg"))
        ['class_000/img_000000.jpg', 'class_000/img_000002.jpg', 'class_001/img_000001.jpg', \
'class_001/img_000003.jpg']
    """
    params = _check_params(num_images, num_classes, size, size_jitter, quality, seed, workers)
    root = Path(root)
    marker = root / MARKER
    if root.is_dir() and marker.is_file():
        try:
            if json.loads(marker.read_text()) == asdict(params):
                logger.debug("reusing generated image folder %s", root)
                if progress is not None:
                    progress(num_images)
                return root
        except (OSError, ValueError):
            pass
        logger.info("image folder %s was generated with other parameters; regenerating", root)
    elif root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(
            f"'{root}' exists and was not made by make_imagefolder (no {MARKER}); pass a new or "
            "empty folder, or remove it."
        )

    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        _generate(tmp, params, workers, progress)
        (tmp / MARKER).write_text(json.dumps(asdict(params), indent=2))
        if root.exists():
            shutil.rmtree(root)
        os.replace(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("generated %d images in %d classes in %s", num_images, num_classes, root)
    return root


def corrupt_image(path: str | os.PathLike[str], *, how: Corruption = Corruption.TRUNCATE) -> None:
    """Break an image file in place so that decoding it with Pillow fails.

    Args:
        path: the file to break.
        how: ``TRUNCATE`` keeps the first third of the file (Pillow opens it but ``load()``
            raises ``OSError``), ``HEADER`` zeroes its first 16 bytes (``Image.open`` raises
            ``UnidentifiedImageError``).
    """
    p = Path(path)
    data = p.read_bytes()
    if how is Corruption.TRUNCATE:
        p.write_bytes(data[: max(1, len(data) // 3)])
    else:
        p.write_bytes(b"\0" * 16 + data[16:])


def make_metadata_table(num_rows: int, *, payload_bytes: int = 16, seed: int = 0) -> pa.Table:
    """Build an ImageNet-sized metadata table, vectorized (no Python loop over rows).

    Args:
        num_rows: number of rows (ImageNet-1k train has 1,281,167).
        payload_bytes: size of the random ``payload`` of each row.
        seed: the same seed gives the same table.

    Returns:
        A table with ``label`` (int64 in [0, 1000)), ``split`` (string, ``'train'`` or, for
        about 3.8% of rows, ``'val'``), ``width`` and ``height`` (int32; 500 on the long side,
        about 375 on the other) and ``payload`` (binary of ``payload_bytes`` random bytes).

    Raises:
        ValueError: ``num_rows`` or ``payload_bytes`` is negative.

    Example:
        >>> make_metadata_table(3).column_names
        ['label', 'split', 'width', 'height', 'payload']
    """
    if num_rows < 0 or payload_bytes < 0:
        raise ValueError(f"num_rows ({num_rows}) and payload_bytes ({payload_bytes}) must be >= 0.")
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 1000, num_rows, dtype=np.int64)
    is_val = rng.random(num_rows) < _VAL_FRACTION
    split = pa.DictionaryArray.from_arrays(
        pa.array(is_val.astype(np.int8)), pa.array(["train", "val"])
    ).cast(pa.string())
    landscape = rng.random(num_rows) < 0.75
    short = np.clip(rng.normal(370.0, 45.0, num_rows), 100, 500).astype(np.int32)
    width = np.where(landscape, np.int32(500), short).astype(np.int32)
    height = np.where(landscape, short, np.int32(500)).astype(np.int32)
    payload = _fixed_binary(rng.bytes(num_rows * payload_bytes), num_rows, payload_bytes)
    return pa.table(
        {
            "label": label,
            "split": split,
            "width": width,
            "height": height,
            "payload": payload,
        }
    )


def _fixed_binary(data: bytes, num_rows: int, width: int) -> pa.ChunkedArray:
    """``num_rows`` values of ``width`` bytes each as ``binary`` (int32 offsets, so chunked)."""
    rows_per_chunk = max(1, (2**31 - 1) // max(width, 1))
    buf = pa.py_buffer(data)
    chunks = []
    for start in range(0, num_rows, rows_per_chunk):
        n = min(rows_per_chunk, num_rows - start)
        offsets = pa.py_buffer((np.arange(n + 1, dtype=np.int32) * width).tobytes())
        chunks.append(
            pa.Array.from_buffers(
                pa.binary(), n, [None, offsets, buf.slice(start * width, n * width)]
            )
        )
    return pa.chunked_array(chunks, pa.binary())


@dataclass(frozen=True)
class _Params:
    """Everything the pixels depend on; stored in the marker file."""

    generator_version: int
    num_images: int
    num_classes: int
    width: int
    height: int
    size_jitter: float
    quality: int
    seed: int


def _check_params(
    num_images: int,
    num_classes: int,
    size: Sequence[int],
    size_jitter: float,
    quality: int,
    seed: int,
    workers: int | None,
) -> _Params:
    if num_images < 1:
        raise ValueError(f"num_images must be >= 1, not {num_images}.")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, not {num_classes}.")
    if len(size) != 2 or min(size) < 8:
        raise ValueError(f"size must be (width, height), each >= 8, not {size!r}.")
    if not 0 <= size_jitter < 1:
        raise ValueError(f"size_jitter must be in [0, 1), not {size_jitter}.")
    if not 1 <= quality <= 95:
        raise ValueError(f"quality must be in [1, 95], not {quality}.")
    if workers is not None and workers < 0:
        raise ValueError(f"workers must be >= 0 or None, not {workers}.")
    return _Params(
        _GENERATOR_VERSION,
        int(num_images),
        int(num_classes),
        int(size[0]),
        int(size[1]),
        float(size_jitter),
        int(quality),
        int(seed),
    )


def _generate(
    tmp: Path, params: _Params, workers: int | None, progress: Callable[[int], object] | None
) -> None:
    num_images = params.num_images
    classes = _class_names(params.num_classes)
    for name in classes:
        (tmp / name).mkdir(parents=True)
    if workers is None:
        workers = (os.cpu_count() or 1) if num_images >= _PARALLEL_FROM else 1
    workers = min(workers, math.ceil(num_images / _CHUNK))
    chunks = [range(s, min(s + _CHUNK, num_images)) for s in range(0, num_images, _CHUNK)]
    done = 0
    if workers <= 1:
        for chunk in chunks:
            done += _write_chunk(str(tmp), params, chunk.start, chunk.stop)
            if progress is not None:
                progress(done)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_write_chunk, str(tmp), params, c.start, c.stop) for c in chunks]
        try:
            for future in as_completed(futures):
                done += future.result()
                if progress is not None:
                    progress(done)
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _class_names(num_classes: int) -> list[str]:
    width = max(3, len(str(num_classes - 1)))
    return [f"class_{k:0{width}d}" for k in range(num_classes)]


def _file_name(i: int, num_images: int) -> str:
    return f"img_{i:0{max(6, len(str(num_images - 1)))}d}.jpg"


def _write_chunk(directory: str, params: _Params, start: int, stop: int) -> int:
    """Write images ``start..stop-1``; runs in a worker process or in-process."""
    classes = _class_names(params.num_classes)
    for i in range(start, stop):
        cls = i % len(classes)
        data = _make_jpeg(params, i, cls)
        (Path(directory) / classes[cls] / _file_name(i, params.num_images)).write_bytes(data)
    return stop - start


def _make_jpeg(params: _Params, i: int, cls: int) -> bytes:
    """The JPEG bytes of image ``i``: a function of ``(params, i)`` only."""
    seed, nominal_w, nominal_h = params.seed, params.width, params.height
    jitter = params.size_jitter
    rng = np.random.default_rng([seed, i])
    w = max(8, round(nominal_w * (1 + jitter * rng.uniform(-1, 1))))
    h = max(8, round(nominal_h * (1 + jitter * rng.uniform(-1, 1))))

    # A smooth colour field around the class colour.
    tint = np.array([(cls * 97) % 256, (cls * 57 + 80) % 256, (cls * 151 + 160) % 256], np.uint16)
    grid = (rng.integers(0, 256, size=(4, 5, 3), dtype=np.uint16) + tint) // 2
    image = Image.fromarray(grid.astype(np.uint8)).resize((w, h), Image.Resampling.BILINEAR)
    # A few shapes: sharp edges, as objects give in photos.
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 10))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        x1 = x0 + int(rng.integers(max(2, w // 20), max(3, w // 2)))
        y1 = y0 + int(rng.integers(max(2, h // 20), max(3, h // 2)))
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape([x0, y0, x1, y1], fill=fill)
    # Texture: a random crop of the per-seed noise bank, at one of a few amplitudes.
    amplitude = _NOISE_LEVELS[int(rng.integers(0, len(_NOISE_LEVELS)))]
    max_w = math.ceil(nominal_w * (1 + jitter)) + 1
    max_h = math.ceil(nominal_h * (1 + jitter)) + 1
    bank = _noise_bank(seed, amplitude, max_w + 128, max_h + 128)
    ox = int(rng.integers(0, bank.width - w + 1))
    oy = int(rng.integers(0, bank.height - h + 1))
    image = ImageChops.add(
        image, bank.crop((ox, oy, ox + w, oy + h)), scale=1.0, offset=-(amplitude // 2)
    )
    out = io.BytesIO()
    image.save(out, "JPEG", quality=params.quality)
    return out.getvalue()


@functools.lru_cache(maxsize=8)
def _noise_bank(seed: int, amplitude: int, width: int, height: int) -> Image.Image:
    """A noise image (fine RGB noise + 2x2 luminance noise), made once per process."""
    rng = np.random.default_rng([seed, 2**31 + amplitude])
    fine = rng.integers(0, amplitude + 1, (height, width, 3), dtype=np.uint16)
    coarse = (
        rng.integers(0, amplitude + 1, ((height + 1) // 2, (width + 1) // 2, 1), dtype=np.uint16)
        .repeat(2, 0)
        .repeat(2, 1)[:height, :width]
    )
    return Image.fromarray(((fine + coarse) // 2).astype(np.uint8))
