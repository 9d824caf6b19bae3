"""How a job's image columns are prepared: a fixed-size shared value, or a shared aspect-kept
decode and the job's own augmentation on top of it.

* A job with ``augment`` (see :mod:`tabloader.engine.augment`) reads each image column from an
  aspect-kept decode (:class:`~tabloader.engine.prep.Fit`) whose least shorter side is the largest
  ``need`` among the registered augmented jobs that read that column with the same
  ``decode_size`` and share rows with it: they all read one decode of each row, each drawing
  its own crops and flips.
* A job with only ``image_size`` (an int: the evaluation recipe) reads that same decode when
  such a job's need is at least its size, and gets torchvision's ``Resize(size),
  CenterCrop(size)`` of it (the mapping of its own fixed-size decode; the pixels differ
  slightly): an evaluation job beside training jobs on the same rows decodes nothing of its
  own. Otherwise (an evaluation split apart from the training rows, say) it keeps its own
  fixed-size values: smaller in the arena and resized once, not per epoch.

The rule reads the catalog's registered jobs, not the ones open now, so a job's plan does not
depend on which job opened first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from catalog.augment import default_seed, parse_augment
from catalog.errors import OptionError
from catalog.options import option_value
from tabloader.engine.augment import Augmenter, shared_fit
from tabloader.engine.prep import Fit, ImageSize

if TYPE_CHECKING:
    from catalog import Job
    from catalog.api import CatalogAPI

__all__ = ["column_plan", "job_augmenter"]


def job_augmenter(job: str, options: dict[str, Any]) -> tuple[Augmenter | None, int | None]:
    """A job's augmentation from its checked options (None: none), and its decode cap."""
    cap = option_value(options, "decode_size")
    text = option_value(options, "augment")
    if text is None:
        return None, cap
    seed = option_value(options, "seed")
    return Augmenter(text, default_seed(job) if seed is None else seed), cap


def shared_need(catalog: CatalogAPI, job: Job, column: str, cap: int | None) -> int | None:
    """The largest ``need`` of the registered augmented jobs reading ``column`` of ``job``'s
    dataset with decode cap ``cap`` and rows in common with ``job`` (None: no such job)."""
    needs = [
        need
        for j in catalog.job_infos()
        if j.dataset == job.dataset
        and column in j.columns
        and j.options.get("augment")
        and j.options.get("decode_size") == cap
        and (need := _need(j.options["augment"])) is not None
        and (j.name == job.name or catalog.job(j.name).ids.intersect(job.ids))
    ]
    return max(needs) if needs else None


def _need(text: str) -> int | None:
    """The ``need`` of a registered job's ``augment``; None for a text registered before a
    bound it breaks (that job is refused at its own open; the others do not wait for it)."""
    try:
        return parse_augment(text).need
    except OptionError:
        return None


def column_plan(
    catalog: CatalogAPI,
    job: Job,
    column: str,
    size: ImageSize | None,
    augmenter: Augmenter | None,
    cap: int | None,
) -> tuple[ImageSize | None, Augmenter | None]:
    """Image column ``column`` of ``job``: the size of its shared values, and the job's own
    augmentation of them (None: the shared values as they are)."""
    shared = shared_need(catalog, job, column, cap)
    if augmenter is not None:
        own = shared_fit(augmenter.spec, cap)
        return Fit(max(own.least, shared or 0), cap), augmenter
    if isinstance(size, int) and shared is not None and shared >= size:
        return Fit(shared, cap), Augmenter(f"Resize({size}), CenterCrop({size})", 0)
    return size, None
