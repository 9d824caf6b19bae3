"""How a job's image columns are prepared: a fixed-size value of its own, or a shared
aspect-kept decode and the job's own augmentation on top of it.

* A job with ``augment`` (see :mod:`tabloader.engine._prepare.augment`) reads each image column from
an
  aspect-kept decode (:class:`~tabloader.engine.decode.Fit`) whose least shorter side serves
  its ``need`` (``shared_fit``), drawing its own crops and flips from it.
* A job with only ``image_size`` (an int: the evaluation recipe) reads a shared decode of its
  rows when there is one, and gets torchvision's ``Resize(size), CenterCrop(size)`` of it (the
  mapping of its own fixed-size decode; the pixels differ slightly): an evaluation job beside a
  training job on the same rows decodes nothing of its own. Otherwise it keeps its own
  fixed-size values: smaller in the arena and resized once, not per epoch.

**Which decode: the open jobs decide, never the registered ones** (DESIGN section 14: one job can
never hurt another). A job's own need ``n`` is its ``augment``'s shorter side (capped by its
``decode_size``) or its ``image_size``. It reads the smallest shared decode ``Fit(L, cap)``
that a job open now on its dataset reads for the column, with the same cap, whose reader's rows
meet its own, and with ``n <= L <= MAX_SHARED_SCALE * n``; without one, an augmented job decodes
at its own need and an ``image_size`` job keeps its own values. So:

* registering a job (never opening it) changes no other job's plan or cost: an ``image_size =
  32`` job needs 32 whatever else is registered (a registered ``Resize(2048), CenterCrop(8)``
  made it read a 2048 decode, and its open in the service failed: "A batch of this job takes
  512 MiB ... lower batch_size, image_size or prefetch");
* another job's decode costs a job at most ``MAX_SHARED_SCALE`` (2) times its own side, 4 times
  its pixels; one further apart is decoded apart (the rows both read are decoded at both sizes
  while both are open);
* a job's plan is fixed when it opens, so a job opened later never changes an open job's decode:
  it reads one of theirs or decodes its own, which the others may read when they open again,
  within the bound (the only way one job makes another's decode larger). Each case is logged
  when the job opens (the service's log), naming the other jobs and the factor: a job that
  reads a decode larger than its need, one that decodes apart from the open jobs' decodes of
  its rows, and which of those jobs may read its decode when they open again beside it. A job
  that reads a decode larger than its need says so in its open-time size check too
  (``jobs.fit_prefetch``).

The readers of a decode are joined by chains of shared rows: an evaluation job whose rows meet
only those of another evaluation job that reads a training job's decode reads that decode too
(its space holds every reader's rows), so the rows they share are decoded once.

A job's plan depends on which jobs are open when it opens: an evaluation job opened beside a
training job on its rows reads the training job's decode; run alone, before or after it, it
keeps its own values (the previous rule read the registered jobs, so that a job run after
another found the rows the first decoded, and let any registered job raise the decode of every
job that met its rows, without bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from tabloader.catalog._augment import default_seed
from tabloader.catalog._options import option_value
from tabloader.engine._prepare.augment import Augmenter, shared_fit
from tabloader.engine.decode._backend import Fit, ImageSize

if TYPE_CHECKING:
    from pyroaring import BitMap

MAX_SHARED_SCALE = 2
"""A job reads a shared decode whose shorter side is at most this many times its own need
(at most its square, 4, times its pixels); one larger is decoded apart."""


def job_augmenter(job: str, options: dict[str, Any]) -> tuple[Augmenter | None, int | None]:
    """A job's augmentation from its checked options (None: none), and its decode cap."""
    cap = option_value(options, "decode_size")
    text = option_value(options, "augment")
    if text is None:
        return None, cap
    seed = option_value(options, "seed")
    return Augmenter(text, default_seed(job) if seed is None else seed), cap


class OpenDecode(NamedTuple):
    """A decode of an image column that an open job reads: the job, its rows, and the
    decode's size (a shared aspect-kept decode, or an ``image_size`` job's own values)."""

    job: str
    ids: BitMap
    size: Fit | int


class ColumnPlan(NamedTuple):
    """An image column of a job: the size of its values (None: as decoded), the job's own
    augmentation of them (None: the values as they are), and what sharing costs the job
    (``larger``: a decode larger than its need, with the jobs and the factor) or the pool
    (``apart``: a decode of its own beside the open jobs' decodes of rows they share), said in
    the log when the job opens."""

    size: ImageSize | None
    augmenter: Augmenter | None
    larger: str | None = None
    apart: str | None = None


def column_plan(
    job: str,
    ids: BitMap,
    column: str,
    size: ImageSize | None,
    augmenter: Augmenter | None,
    cap: int | None,
    decodes: Sequence[OpenDecode],
) -> ColumnPlan:
    """Image column ``column`` of job ``job`` (rows ``ids``), opened with ``size`` or
    ``augmenter`` and decode cap ``cap``, beside the ``decodes`` of the jobs open on its
    dataset (see the module)."""
    if augmenter is not None:
        own = shared_fit(augmenter.spec, cap).least
    elif isinstance(size, int):
        own = size
    else:  # full size, or exactly (h, w): its own values
        return ColumnPlan(size, None)
    meeting = [d for d in decodes if d.job != job and d.ids.intersect(ids)]
    most = MAX_SHARED_SCALE * own
    usable = sorted(
        d.size.least
        for d in meeting
        if isinstance(d.size, Fit) and d.size.cap == cap and own <= d.size.least <= most
    )
    if usable:
        plan = ColumnPlan(
            Fit(usable[0], cap), augmenter or Augmenter(f"Resize({size}), CenterCrop({size})", 0)
        )
    else:
        plan = ColumnPlan(size if augmenter is None else Fit(own, cap), augmenter)
    read = plan.size
    assert isinstance(read, Fit | int)  # a tuple size returned above
    larger = None
    if isinstance(read, Fit) and read.least > own:
        larger = (
            f"job {job!r} reads column {column!r} from the shared decode of open job(s) "
            f"{_names(meeting, read)} at shorter side {read.least}, {read.least / own:.2g}x its "
            f"own {own} ({(read.least / own) ** 2:.2g}x the pixels; at most "
            f"{MAX_SHARED_SCALE**2}x)"
        )
    others = sorted({d.size for d in meeting if d.size != read}, key=_describe)
    apart = None
    if others:
        apart = (
            f"job {job!r} decodes column {column!r} at {_describe(read)} apart from open job(s) "
            + "; ".join(f"{_names(meeting, o)} at {_describe(o)}" for o in others)
            + f" (a job reads a shared aspect-kept decode of 1 to {MAX_SHARED_SCALE}x its own "
            f"need, {own} here): the rows they share are decoded at both sizes while they are "
            f"open together{_growing(meeting, read, others)}"
        )
    return plan._replace(larger=larger, apart=apart)


def _growing(meeting: Sequence[OpenDecode], read: Fit | int, others: Sequence[Fit | int]) -> str:
    """Which of the open jobs reading the smaller decodes ``others`` may read the new one,
    ``read``, when they open again while its job is open, and how much larger it is."""
    if not isinstance(read, Fit):
        return ""
    out = []
    for o in others:
        side = o.least if isinstance(o, Fit) else o
        same_cap = not isinstance(o, Fit) or o.cap == read.cap
        if same_cap and side < read.least <= MAX_SHARED_SCALE * side:
            factor = read.least / side
            names = _names(meeting, o)
            out.append(f"{names} ({factor:.2g}x the side, {factor**2:.2g}x the pixels)")
    if not out:
        return ""
    return (
        "; opened again while it is open, these may read its decode instead of theirs: "
        + ", ".join(out)
    )


def _names(decodes: Sequence[OpenDecode], size: Fit | int) -> str:
    return ", ".join(sorted({d.job for d in decodes if d.size == size}))


def _describe(size: Fit | int) -> str:
    if isinstance(size, Fit):
        return f"shorter side {size.least}" + (f" (capped at {size.cap})" if size.cap else "")
    return f"{size} x {size} (fixed-size values)"
