"""How a job's image columns are prepared: a fixed-size shared value, or a shared aspect-kept
decode and the job's own augmentation on top of it.

* A job with ``augment`` (see :mod:`tabloader.engine._prepare.augment`) reads each image column from an
  aspect-kept decode (:class:`~tabloader.engine._prepare.prep.Fit`) whose least shorter side is the largest
  ``need`` of the registered augmented jobs in its *group* (below): they all read one decode of
  each row, each drawing its own crops and flips.
* A job with only ``image_size`` (an int: the evaluation recipe) reads that same decode when it
  overlaps a group whose need is at least its size, and gets torchvision's ``Resize(size),
  CenterCrop(size)`` of it (the mapping of its own fixed-size decode; the pixels differ
  slightly): an evaluation job beside training jobs on the same rows decodes nothing of its
  own. Otherwise (an evaluation split apart from the training rows, say) it keeps its own
  fixed-size values: smaller in the arena and resized once, not per epoch.

A group is the readers of the decode (every augmented job of one dataset that reads the column
with the same ``decode_size``, and every ``image_size`` job that meets a group whose need is at
least its size) joined by chains of shared rows, not only by direct overlap. Without chains, an
evaluation job whose rows met only those of another evaluation job reading a training job's
decode kept its own fixed-size values, and the rows the two share were decoded twice (an
evaluation job over every row, beside a training split and a disjoint validation split,
re-decoded the validation rows). Joining only merges groups and raises their needs, so the
groups (the least fixed point) are the same whichever job is planned first.

The rule reads the catalog's registered jobs, not the ones open now, so a job's plan does not
depend on which job opened first. It does depend on what is registered: a job registered after
another ran cannot reuse values decoded before it existed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from pyroaring import BitMap

from tabloader.catalog._augment import default_seed, parse_augment
from tabloader.catalog._errors import OptionError
from tabloader.catalog._options import option_value
from tabloader.engine._prepare.augment import Augmenter, shared_fit
from tabloader.engine.decode import Fit, ImageSize

if TYPE_CHECKING:
    from tabloader.catalog import Job
    from tabloader.catalog._api import CatalogAPI

__all__ = ["column_plan", "job_augmenter"]


def job_augmenter(job: str, options: dict[str, Any]) -> tuple[Augmenter | None, int | None]:
    """A job's augmentation from its checked options (None: none), and its decode cap."""
    cap = option_value(options, "decode_size")
    text = option_value(options, "augment")
    if text is None:
        return None, cap
    seed = option_value(options, "seed")
    return Augmenter(text, default_seed(job) if seed is None else seed), cap


class _Reader(NamedTuple):
    """A job that may read a column's shared decode: ``need``, its registered augmented need
    (None: none); ``size``, its ``image_size`` (None: an augmented job, always a reader)."""

    ids: BitMap
    need: int | None
    size: int | None


def _group_need(readers: list[_Reader], of: int) -> int | None:
    """The need of the group (see the module) of ``readers[of]``; None: it reads no shared
    decode. ``image_size`` jobs become readers round by round until none is left to join."""
    met: dict[tuple[int, int], bool] = {}

    def meets(i: int, j: int) -> bool:  # asked lazily: jobs that all overlap cost n, not n^2
        key = (min(i, j), max(i, j))
        if key not in met:
            met[key] = i != j and readers[i].ids.intersect(readers[j].ids)
        return met[key]

    reads = [r.size is None for r in readers]
    while True:
        group = _components(len(readers), meets, reads)
        need: dict[int, int] = {}
        for g, r in zip(group, readers, strict=True):
            if g >= 0 and r.need is not None:
                need[g] = max(need.get(g, 0), r.need)
        joining = [
            i
            for i, r in enumerate(readers)
            if not reads[i]
            and r.size is not None
            and (
                (r.need or 0) >= r.size
                or any(
                    reads[j] and need.get(group[j], 0) >= r.size and meets(i, j)
                    for j in range(len(readers))
                )
            )
        ]
        if not joining:
            return need.get(group[of]) if reads[of] else None
        for i in joining:
            reads[i] = True


def _components(n: int, meets: Callable[[int, int], bool], member: list[bool]) -> list[int]:
    """Each member's component (an index) in the graph of ``meets`` among the ``n`` nodes'
    members; -1 for the others."""
    group = [-1] * n
    for start in range(n):
        if not member[start] or group[start] >= 0:
            continue
        group[start], todo = start, [start]
        while todo:
            i = todo.pop()
            for j in range(n):
                if member[j] and group[j] < 0 and meets(i, j):
                    group[j] = start
                    todo.append(j)
    return group


def _readers(
    catalog: CatalogAPI, job: Job, column: str, cap: int | None, own: _Reader
) -> list[_Reader]:
    """The readers of ``column`` of ``job``'s dataset with decode cap ``cap``, as registered;
    ``job`` itself (first) as ``own``, the options it is opened with."""
    readers = [own]
    for j in catalog.job_infos():
        if (
            j.name == job.name
            or j.dataset != job.dataset
            or column not in j.columns
            or j.options.get("decode_size") != cap
        ):
            continue
        size = j.options.get("image_size")
        if j.options.get("augment"):
            need = _need(j.options["augment"])
            if need is not None:
                readers.append(_Reader(catalog.job(j.name).ids, need, None))
        elif isinstance(size, int):
            readers.append(_Reader(catalog.job(j.name).ids, None, size))
    return readers


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
    if augmenter is None and not isinstance(size, int):
        return size, None
    # the job's registered augmented need counts as before, whatever it is opened with
    registered = job.options.get("augment")
    mine = _need(registered) if registered and job.options.get("decode_size") == cap else None
    own = _Reader(job.ids, mine, size if augmenter is None and isinstance(size, int) else None)
    shared = _group_need(_readers(catalog, job, column, cap, own), 0)
    if augmenter is not None:
        least = shared_fit(augmenter.spec, cap).least
        return Fit(max(least, shared or 0), cap), augmenter
    if shared is not None:
        return Fit(shared, cap), Augmenter(f"Resize({size}), CenterCrop({size})", 0)
    return size, None
