"""Sampling: which row each job reads next.

Two samplers share the :class:`Sampler` interface:

* :class:`DependentSampler` - dependent sampling (DSA, JOADER Algorithm 1) on a region
  structure, so jobs on overlapping sets ask for the same rows at about the same time while
  each job's own order stays uniformly random (see :mod:`tabloader.sampling._regions`);
* :class:`IndependentSampler` - each job shuffles on its own (the PyTorch baseline).

``SAMPLERS`` lists them by name (used by the benchmark and the engine).

Example:
    >>> from pyroaring import BitMap
    >>> s = DependentSampler(seed=1)
    >>> s.add_job("resnet", BitMap(range(100)))
    >>> s.add_job("vit", BitMap(range(50, 150)))
    >>> sorted(s.sample(["resnet", "vit"]))
    ['resnet', 'vit']
    >>> len(s.remaining("resnet"))
    99
"""

from __future__ import annotations

from tabloader.sampling._base import JobStart, Sampler
from tabloader.sampling._dependent import DependentSampler
from tabloader.sampling._independent import IndependentSampler

__all__ = ["SAMPLERS", "DependentSampler", "IndependentSampler", "JobStart", "Sampler"]

SAMPLERS: dict[str, type[DependentSampler] | type[IndependentSampler]] = {
    "dependent": DependentSampler,
    "independent": IndependentSampler,
}
