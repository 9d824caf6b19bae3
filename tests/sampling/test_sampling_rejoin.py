"""A job that leaves and rejoins with its remaining rows resumes its epoch exactly."""

from __future__ import annotations

import pytest
from pyroaring import BitMap

from tabloader.catalog._errors import SamplingError
from tabloader.sampling import SAMPLERS


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_rejoin_with_remaining_rows(kind):
    s = SAMPLERS[kind](seed=3)
    ids = BitMap(range(50))
    s.add_job("a", ids)
    s.add_job("b", BitMap(range(25, 80)))
    first = s.sample_many(["a", "b"], 20)["a"].tolist()
    left = s.remaining("a")
    assert left == ids - BitMap(first)
    s.remove_job("a")
    s.sample_many(["b"], 5)
    s.add_job("a", ids, remaining=left, epoch=4)
    assert s.epoch("a") == 4
    assert s.remaining("a") == left
    rest = s.sample_many(["a", "b"], len(left))["a"].tolist()
    assert sorted(first + rest) == list(range(50))
    nxt = s.sample_many(["a"], 50)["a"].tolist()
    assert s.epoch("a") == 5
    assert sorted(nxt) == list(range(50))


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
@pytest.mark.parametrize("remaining", [BitMap(), BitMap([99]), [1, 2]])
def test_rejoin_rejects_bad_remaining(kind, remaining):
    s = SAMPLERS[kind](seed=0)
    with pytest.raises(SamplingError, match="must be a non-empty BitMap subset of its ids"):
        s.add_job("a", BitMap(range(10)), remaining=remaining)
    assert s.jobs() == []
