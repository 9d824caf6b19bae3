"""Samplers take the job's spec when a job joins (the seam for a sampler that weighs jobs), as
the ``Sampler`` protocol says."""

from __future__ import annotations

import inspect

import pytest
from pyroaring import BitMap

from tabloader.catalog._errors import SamplingError
from tabloader.catalog._options import JobSpec
from tabloader.sampling import DependentSampler, IndependentSampler, JobStart, Sampler

SAMPLERS = [DependentSampler, IndependentSampler]


@pytest.mark.parametrize("cls", SAMPLERS)
def test_add_job_has_the_protocols_signature(cls):
    """The protocol's arguments, then its start (``JobStart``) as optional keywords."""
    want = inspect.signature(Sampler.add_job).parameters
    have = inspect.signature(cls.add_job).parameters
    named = [(p.name, p.kind, p.default) for p in want.values() if p.kind is not p.VAR_KEYWORD]
    assert [(p.name, p.kind, p.default) for p in have.values()][: len(named)] == named
    keywords = [p for p in have.values() if p.kind is p.KEYWORD_ONLY]
    assert [p.name for p in keywords] == list(JobStart.__annotations__)
    assert len(have) == len(named) + len(keywords)
    assert all(p.default is not p.empty for p in keywords)


@pytest.mark.parametrize("cls", SAMPLERS)
def test_a_job_joins_with_its_spec_fresh_or_resumed(cls):
    s = cls(seed=0)
    s.add_job("a", BitMap(range(10)), JobSpec({"batch_size": 4}))
    s.add_job("b", BitMap(range(10)), JobSpec(), remaining=BitMap([3, 4]), epoch=2)
    assert s.epoch("b") == 2
    assert s.remaining("b") == BitMap([3, 4])
    assert sorted(s.sample_many(["a", "b"], 2)["b"].tolist()) == [3, 4]
    with pytest.raises(SamplingError, match="already registered"):
        s.add_job("a", BitMap(range(10)), JobSpec())
