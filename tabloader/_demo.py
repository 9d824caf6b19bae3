"""The demo: generate an ImageNet-like image folder, import it, register three jobs, compare.

Run it with ``tabloader demo``. It is idempotent: a second run reuses the images and the
dataset and re-registers the jobs.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tabloader._format import format_table

if TYPE_CHECKING:
    from tabloader.catalog import Catalog

DEMO_JOBS = {
    "resnet18": "SELECT image, label FROM imagenet WHERE label < 6",
    "vit_small": "SELECT image, label FROM imagenet WHERE label >= 3 AND path NOT LIKE '%9.jpg'",
    "finetune": "SELECT image FROM imagenet WHERE label_name IN ('class_001', 'class_007') "
    "OR hash(_id) % 4 = 0",
}


def run_demo(
    cat: Catalog,
    *,
    data_dir: str | Path = "demo-data",
    num_images: int = 3000,
    num_classes: int = 10,
) -> dict[str, int]:
    """Generate, import and register; print the jobs' sizes and overlaps. Returns the sizes."""
    from tabloader.datagen import make_imagefolder

    folder = Path(data_dir) / f"imagenet-{num_images}"
    print(f"1. Generating {num_images} JPEGs (about 500x375) in {folder} ...")
    make_imagefolder(folder, num_images=num_images, num_classes=num_classes)
    if "imagenet" not in cat.dataset_names():
        stmt = f"CREATE DATASET imagenet FROM '{folder}' FORMAT imagefolder"
        print(f"2. {stmt}")
        cat.sql(stmt)
    else:
        print("2. Dataset imagenet exists already; reusing it.")
    ds = cat.dataset("imagenet")
    print(f"   {ds.num_rows} rows, columns {', '.join(ds.columns)}; catalog {cat.root}")
    print("3. Registering three jobs with overlapping predicates:")
    jobs = {}
    for name, select in DEMO_JOBS.items():
        stmt = f"REGISTER OR REPLACE JOB {name} {select}"
        print(f"   {stmt}")
        jobs[name] = cat.sql(stmt)
    rows = [
        {"job": n, "rows": j.num_rows, "columns": ", ".join(j.columns)} for n, j in jobs.items()
    ]
    print(format_table(rows))
    overlaps = [
        {"jobs": f"{a} & {b}", "shared rows": len(jobs[a].ids & jobs[b].ids)}
        for a, b in itertools.combinations(jobs, 2)
    ]
    print(format_table(overlaps))
    union = len(jobs["resnet18"].ids | jobs["vit_small"].ids | jobs["finetune"].ids)
    total = sum(j.num_rows for j in jobs.values())
    print(
        f"One epoch of every job reads {total} rows; the union is {union} rows, so sharing "
        f"can save {total - union} reads and decodes ({1 - union / total:.0%})."
    )
    _load_together(cat, list(jobs))
    print("Next: tabloader sql 'SHOW JOBS', or train from a job: python examples/hparam_search.py")
    return {n: j.num_rows for n, j in jobs.items()}


def _load_together(cat: Catalog, names: list[str]) -> None:
    """Step 4: one epoch of every job at once through one Loader; count the decodes."""
    import threading
    import time

    from tabloader.engine import Loader

    print("4. Loading one epoch of every job at once (one thread per job, images at 64x64):")
    served = dict.fromkeys(names, 0)

    def consume(stream: Any) -> None:
        for batch in stream:
            served[stream.name] += len(batch["_id"])

    start = time.perf_counter()
    with Loader(cat, cache_bytes=256 << 20) as loader:
        streams = [loader.open(n, batch_size=32, image_size=64, epochs=1) for n in names]
        threads = [threading.Thread(target=consume, args=(s,)) for s in streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        decodes = loader.stats()["decodes"]
    total = sum(served.values())
    print(
        f"   {total} images served to {len(names)} jobs in {time.perf_counter() - start:.1f} s;"
        f" decoded {decodes} ({total / max(decodes, 1):.2f} jobs per decode)"
    )
