from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyroaring import BitMap

from tabloader.catalog._bitmaps import bitmap_from_array, bitmap_from_flags, bitmap_to_array

ids_lists = st.lists(st.one_of(st.integers(0, 300_000), st.integers(0, 2**32 - 1)), max_size=300)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(ids=ids_lists)
def test_matches_pyroaring(ids):
    expected = BitMap(ids)
    got = bitmap_from_array(np.array(ids, dtype=np.int64))
    assert got == expected
    assert bitmap_to_array(got).tolist() == sorted(set(ids))


@pytest.mark.parametrize("density", [0.001, 0.05, 0.5, 1.0])
def test_dense_and_sparse_containers(density):
    rng = np.random.default_rng(0)
    ids = np.flatnonzero(rng.random(1_000_000) < density).astype(np.uint32)
    bm = bitmap_from_array(ids)
    assert bm == BitMap(ids.tolist())
    assert len(bm) == ids.size


def test_rejects_out_of_range():
    with pytest.raises(ValueError, match=r"row ids must be in \[0, 2\*\*32\)"):
        bitmap_from_array(np.array([-1, 3]))


@pytest.mark.parametrize("density", [0.0005, 0.05, 0.7])
def test_shuffled_ids_with_repeats(density):
    """Dense ids in any order (a DuckDB scan without insertion order) go through the bitset."""
    rng = np.random.default_rng(1)
    ids = np.flatnonzero(rng.random(300_000) < density).astype(np.uint32)
    shuffled = rng.permutation(np.concatenate([ids, ids[: ids.size // 3]]))
    assert bitmap_from_array(shuffled) == BitMap(ids.tolist())


@pytest.mark.parametrize("size", [0, 1, 65_535, 65_536, 200_001])
def test_from_flags(size):
    flags = np.random.default_rng(size).random(size) < 0.3
    assert bitmap_from_flags(flags) == BitMap(np.flatnonzero(flags).tolist())
