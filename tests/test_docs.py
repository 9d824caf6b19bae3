"""The examples in docstrings run (as sqlglot's tests/test_docs.py does)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "tabloader.catalog",
    "tabloader",
    "tabloader.analyze._model",
    "tabloader.engine._arena.arena",
    "tabloader.engine._deliver.batchmem",
    "benchmarks.stalls",
    "tabloader.cluster._leader",
    "tabloader.cluster._membership",
    "tabloader.cluster._placement",
    "tabloader.engine._arena.eviction",
    "tabloader.engine._prepare.prep",
    "tabloader.engine.decode",
    "tabloader.engine._arena.slabs",
    "tabloader.sampling",
    "tabloader.sampling._dependent",
    "tabloader.service._metrics",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
