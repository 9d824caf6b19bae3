"""The loading engine: one process's pipeline, every job of it on one arena and one pool.

A subpackage per stage, in the order a row goes through them::

    tabloader.sampling -> _queue -> _prepare -> _arena -> _deliver
    (which rows)          (queued)   (fetched,    (cached)  (each job's batch)
                                     decoded)

* **sampled and queued** (:mod:`~tabloader.engine._queue`): the sampler's rounds become each
  job's queue of row ids and the future uses of each row (the arena's eviction inputs); the
  scheduler cuts the queues into batches and deals them to the ranks;
* **fetched and prepared** (:mod:`~tabloader.engine._prepare`): a batch's cheap columns
  gathered vectorized, its images looked up in the arena, in-flight reads merged; the shared,
  deterministic prefix (decode, by the column's backend from :mod:`tabloader.engine.decode`,
  in decode processes or the pool's threads) once per row for every job, and each job's own
  augmentation on top;
* **cached** (:mod:`~tabloader.engine._arena`): prepared values in slots of slabs of one
  buffer, evicted by next use and reference count, in shared memory with no name;
* **delivered** (:mod:`~tabloader.engine._deliver`): the batch laid out as one handed-over
  batch and received by its job's receiver: copied (or augmented) out of the arena into the
  job's own batch, or handed over pinned to a service's client, which copies it out the same
  way; the consumer side (``JobStream``).

:class:`Loader` (``_loader``) is the facade that wires them; ``_opening`` checks an open
request once (its keyword arguments, typed: :class:`OpenArgs`). The service
(:mod:`tabloader.service`) runs one ``Loader`` for many processes; nothing here imports the
service, the cluster or the CLI. :mod:`tabloader.engine.decode` is
the seam a decode backend plugs into.

Besides the loader, the face names what sizing a cache or reproducing a job's augmentation
needs: :class:`Augmenter` (a job's ``augment`` with its seed, applied to one image),
:func:`shared_fit` (the shared decode an augmented job reads), :func:`default_prefetch`
(the batches a job prepares ahead), :func:`values_that_fit` and :func:`size_class` (how many
values of a size an arena holds, and the slot one takes), and which code path of the
crop-resize kernel runs: :func:`resize_kernel`, :func:`resize_kernels` (the paths this CPU can
run) and :func:`use_resize_kernel` (``TABLOADER_RESAMPLE=scalar|avx2`` does it for a process).

The names below are imported on first use, so that a decode process importing
:mod:`tabloader.engine._prepare.decoding` does not import the whole engine (and DuckDB with it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tabloader._lazy import lazy_names

if TYPE_CHECKING:
    from tabloader.engine._arena.arena import values_that_fit
    from tabloader.engine._arena.slabs import size_class
    from tabloader.engine._deliver.stream import JobStream
    from tabloader.engine._loader import Loader, default_loader
    from tabloader.engine._opening import OpenArgs
    from tabloader.engine._prepare.augment import Augmenter, shared_fit
    from tabloader.engine._prepare.resample import resize_kernel, resize_kernels, use_resize_kernel
    from tabloader.engine._queue.jobs import OnError, default_prefetch

__all__ = [
    "Augmenter",
    "JobStream",
    "Loader",
    "OnError",
    "OpenArgs",
    "default_loader",
    "default_prefetch",
    "resize_kernel",
    "resize_kernels",
    "shared_fit",
    "size_class",
    "use_resize_kernel",
    "values_that_fit",
]

_LAZY = {
    "Augmenter": "tabloader.engine._prepare.augment",
    "JobStream": "tabloader.engine._deliver.stream",
    "Loader": "tabloader.engine._loader",
    "OnError": "tabloader.engine._queue.jobs",
    "OpenArgs": "tabloader.engine._opening",
    "default_loader": "tabloader.engine._loader",
    "default_prefetch": "tabloader.engine._queue.jobs",
    "resize_kernel": "tabloader.engine._prepare.resample",
    "resize_kernels": "tabloader.engine._prepare.resample",
    "use_resize_kernel": "tabloader.engine._prepare.resample",
    "shared_fit": "tabloader.engine._prepare.augment",
    "size_class": "tabloader.engine._arena.slabs",
    "values_that_fit": "tabloader.engine._arena.arena",
}


__getattr__ = lazy_names(__name__, _LAZY)
