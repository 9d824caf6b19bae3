"""The benchmarks' image data: generated JPEGs (about 500x375) imported as dataset ``imgs``.

One folder and one catalog per image count under ``--data`` (``images-N``, ``catalog-N``),
made once and reused by later runs (:func:`tabloader.datagen.make_imagefolder` returns a
finished folder at once). ``reader.json`` beside the catalog lets a DataLoader's workers read
the same Arrow IPC files without DuckDB.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["prepare"]


def prepare(args: argparse.Namespace) -> tuple[Path, int, int]:
    """The generated images (``args.images`` in ``args.data``) imported as dataset ``imgs``;
    (catalog directory, rows, bytes of storage).
    """
    from tabloader import catalog
    from tabloader.datagen import make_imagefolder

    folder = make_imagefolder(
        Path(args.data) / f"images-{args.images}", num_images=args.images, num_classes=10
    )
    root = Path(args.data) / f"catalog-{args.images}"
    with catalog.open_catalog(root, create=True) as cat:
        if "imgs" not in cat.dataset_names():
            cat.import_imagefolder("imgs", folder)
        ds = cat.dataset("imgs")
        spec = {"schema": pa_schema_hex(ds), "parts": [p.__dict__ for p in ds.reader.parts]}
        (root / "reader.json").write_text(json.dumps(spec))
        size = sum(f.stat().st_size for f in ds.files)
        return root.absolute(), ds.num_rows, size


def pa_schema_hex(ds: Any) -> str:
    import pyarrow as pa

    return str(pa.schema(list(ds.schema)[1:]).serialize().to_pybytes().hex())
