from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tabloader.sampling import DependentSampler, IndependentSampler  # noqa: E402

SAMPLER_CLASSES = [DependentSampler, IndependentSampler]


@pytest.fixture(params=SAMPLER_CLASSES, ids=["dependent", "independent"])
def sampler_cls(request: pytest.FixtureRequest) -> type:
    return request.param
