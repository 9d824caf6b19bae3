"""The examples in docstrings run (as sqlglot's tests/test_docs.py does)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "catalog",
    "tabloader",
    "tabloader.analyze.model",
    "tabloader.engine.arena",
    "tabloader.engine.batchmem",
    "tabloader.bench.stalls",
    "tabloader.cluster.leader",
    "tabloader.cluster.membership",
    "tabloader.cluster.placement",
    "tabloader.engine.eviction",
    "tabloader.engine.prep",
    "tabloader.engine.slabs",
    "tabloader.sampling",
    "tabloader.sampling.dependent",
    "tabloader.service.metrics",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
