"""The scenarios of ``bench e2e``: each one's jobs, and how they are registered.

A scenario is a list of jobs, each a dict: ``name``, its rows (``where``, a condition on
``_id``), seconds per batch (``step``), whether it comes ``late`` (when the first job is
half-way), and the ``options`` it is registered with. A job without ``options`` is opened
with the run's ``--image-size``; one with them is opened with the catalog's (``augment`` and
``seed`` for a training recipe, ``image_size`` for an evaluation job). A job with ``after``
opens once those jobs are open: an evaluation job reads the shared decode of the training
jobs open when it opens (``tabloader.engine._prepare.planning``), as one run beside a training run
does. What each scenario measures is in :mod:`benchmarks.e2e`'s docstring.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NotRequired, TypedDict

import numpy as np

__all__ = [
    "RECIPE",
    "SCENARIOS",
    "JobOptions",
    "ScenarioJob",
    "register",
    "scenarios_of",
    "shared_decode_bytes",
]

SCENARIOS = ("same", "overlap", "speeds", "late", "recipe", "recipe-eval", "scale")
"""``scale`` runs on data of its own: :mod:`benchmarks.e2e_scale`."""
RECIPE = "RandomResizedCrop({size}), RandomHorizontalFlip()"
"""The training recipe of the ``recipe`` scenarios (torchvision's ImageNet reference)."""


class JobOptions(TypedDict, total=False):
    """The options a job is registered with: a training recipe's ``augment`` and ``seed``,
    or an evaluation job's ``image_size``."""

    augment: str
    seed: int
    image_size: int


class ScenarioJob(TypedDict):
    """A scenario's job (see the module docstring)."""

    name: str
    where: str
    step: float
    late: bool
    options: NotRequired[JobOptions]
    after: NotRequired[list[str]]  # jobs that must be open before it opens


def scenarios_of(
    n: int, step: float, speeds_rows: int, speeds_step: float, recipe_size: int
) -> dict[str, list[ScenarioJob]]:
    """Each scenario's jobs: name, rows (``where``), seconds per batch (``step``), whether it
    comes ``late``, and the ``options`` it is registered with (none: it is opened with
    ``--image-size``)."""
    every = "_id >= 0"
    first, second = f"_id < {2 * n // 3}", f"_id >= {n // 3}"
    subset = f"_id < {min(n, speeds_rows)}"
    recipe = RECIPE.format(size=recipe_size)
    train: list[ScenarioJob] = [  # four jobs, four seeds
        {"name": f"j{i}", "where": every, "step": step, "late": False} for i in range(4)
    ]
    for i, job in enumerate(train):
        job["options"] = {"augment": recipe, "seed": i}
    evaluation: ScenarioJob = {
        **train[0],
        "options": {"image_size": recipe_size},
        "after": [j["name"] for j in train[1:]],
    }
    return {
        "same": [{"name": f"j{i}", "where": every, "step": step, "late": False} for i in range(4)],
        "overlap": [
            {"name": f"j{i}", "where": w, "step": step, "late": False}
            for i, w in enumerate([first, first, second, second])
        ],
        "speeds": [
            {"name": f"j{i}", "where": subset, "step": speeds_step * m, "late": False}
            for i, m in enumerate([1, 2, 4, 4])
        ],
        "late": [{"name": f"j{i}", "where": every, "step": step, "late": i == 3} for i in range(4)],
        "recipe": train,
        "recipe-eval": [evaluation, *train[1:]],
    }


def register(cat: Any, jobs: list[ScenarioJob]) -> None:
    """Register ``jobs`` (with their ``options``) and unregister every other job, so each
    run sees its own jobs only."""
    for name in set(cat.job_names()) - {j["name"] for j in jobs}:
        cat.sql(f"UNREGISTER JOB {name}")
    for j in jobs:
        options = ", ".join(
            f"{k} = '{v}'" if isinstance(v, str) else f"{k} = {v}"
            for k, v in j.get("options", {}).items()
        )
        cat.sql(
            f"REGISTER OR REPLACE JOB {j['name']} SELECT image, label FROM imgs "
            f"WHERE {j['where']}{f' WITH ({options})' if options else ''}"
        )


def shared_decode_bytes(root: Path, text: str, rows: int) -> int:
    """The mean slot bytes of the shared (aspect-kept) decode that augment ``text`` reads,
    over the first ``rows`` images: the arena's row size for the ``recipe`` scenarios."""
    from tabloader import catalog
    from tabloader.catalog import parse_augment
    from tabloader.engine import shared_fit, size_class
    from tabloader.engine.decode import decode_image

    fit = shared_fit(parse_augment(text), None)
    with catalog.open_catalog(root) as cat:
        images = cat.dataset("imgs").take(list(range(rows)), ["image"])["image"]
    sizes = [size_class(decode_image(v.as_buffer(), size=fit).nbytes, exact=False) for v in images]
    return int(np.mean(sizes))
