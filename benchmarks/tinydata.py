"""The tiny-JPEG dataset of the small-row benchmarks: CIFAR-size images at ImageNet row counts.

``bench throughput --only tiny`` (:mod:`benchmarks.tiny`) and ``bench e2e --scenarios
scale`` (:mod:`benchmarks.e2e_scale`) read the same data: ``rows`` JPEGs of 24x24 pixels
(:func:`tabloader.datagen.make_imagefolder`, no size jitter, about 1 KB each) in ``CLASSES``
classes (image ``i`` in class ``i % CLASSES``), imported as dataset ``imgs`` (``image``,
``label``, ``label_name``, ``path``) of a catalog of its own. A hundred classes let the scale
scenario's jobs select by label as issue 49 names them (``label < 50``: half the rows,
``label % 3 <> 0``: two thirds).

Both steps are cached on disk under ``data`` (default ``bench-results/tiny-data``): the folder
``images-<rows>-<side>-c<classes>`` (``make_imagefolder``'s marker), and the catalog
``catalog-<rows>-<side>-c<classes>``
with a ``.done`` marker written after its import and ``reader.json`` (what the DataLoaders'
workers open: files only, no DuckDB). 400,000 images take about 2.5 minutes to make and as much
to import on two cores; later runs reuse them at once.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "CLASSES",
    "DEFAULT_DATA",
    "SIDE",
    "TinyData",
    "add_data_arguments",
    "open_reader",
    "prepare_tiny",
]

SIDE = 24
"""Stored images are ``SIDE`` x ``SIDE`` pixels (CIFAR's 32, a little smaller)."""
CLASSES = 100
"""Image ``i`` is of class ``i % CLASSES``."""
DEFAULT_DATA = "bench-results/tiny-data"


def add_data_arguments(parser: argparse.ArgumentParser, scenario: str) -> None:
    """A scenario's tiny data: ``--SCENARIO-rows`` JPEGs read ``--SCENARIO-batch`` rows at a
    time, cached under ``--SCENARIO-data``."""
    from benchmarks import positive_int

    what = f"'{scenario}':"
    parser.add_argument(
        f"--{scenario}-rows", type=positive_int, default=400_000, help=f"{what} tiny JPEGs (24x24)"
    )
    parser.add_argument(f"--{scenario}-batch", type=positive_int, default=256, help=f"{what} batch")
    parser.add_argument(
        f"--{scenario}-data", default=DEFAULT_DATA, help=f"{what} data cache folder"
    )


class TinyData:
    """Where a prepared tiny dataset lives: ``root`` (the catalog), ``folder`` (the JPEGs),
    ``rows``."""

    def __init__(self, root: Path, folder: Path, rows: int) -> None:
        self.root, self.folder, self.rows = root, folder, rows


def prepare_tiny(data: str | Path, rows: int, *, side: int = SIDE) -> TinyData:
    """``rows`` JPEGs of ``side`` x ``side`` pixels, imported as dataset ``imgs``: made and
    imported on the first call, reused on the next ones (see the module docstring)."""
    import pyarrow as pa

    from tabloader import catalog
    from tabloader.catalog import disable_progress_bars
    from tabloader.datagen import make_imagefolder

    disable_progress_bars()
    base = Path(data)
    name = f"{rows}-{side}-c{CLASSES}"
    folder = make_imagefolder(
        base / f"images-{name}",
        num_images=rows,
        num_classes=CLASSES,
        size=(side, side),
        size_jitter=0.0,
    )
    root = (base / f"catalog-{name}").absolute()
    done = root / ".done"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)  # an import cut off: start it again
        with catalog.open_catalog(root, create=True) as cat:
            cat.import_imagefolder("imgs", folder)
            ds = cat.dataset("imgs")
            schema = pa.schema(list(ds.schema)[1:]).serialize().to_pybytes().hex()  # no _id
            spec = {"schema": schema, "parts": [p.__dict__ for p in ds.reader.parts]}
        (root / "reader.json").write_text(json.dumps(spec))
        done.touch()
    return TinyData(root, folder.absolute(), rows)


def open_reader(root: str | Path) -> Any:
    """The dataset's storage reader from ``reader.json`` (files only, no DuckDB connection: what
    a DataLoader's worker opens; as ``bench e2e``'s children do)."""
    import pyarrow as pa

    from tabloader.catalog.storage import DatasetReader, PartInfo

    spec = json.loads(Path(root, "reader.json").read_text())
    schema = pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(spec["schema"])))
    return DatasetReader(Path(root), [PartInfo(**p) for p in spec["parts"]], schema)
