"""Many swap-remove picks from one region at once: exact (vs one by one) and vectorized."""

from __future__ import annotations

import array
import itertools

import numpy as np
import pytest
from pyroaring import BitMap

import tabloader.sampling._regions as regions_mod
from tabloader.sampling import DependentSampler
from tabloader.sampling._base import Uniforms
from tabloader.sampling._regions import Regions, chunk_starts, swap_remove


def pick_one_by_one(rows: array.array, pos: array.array, idx: np.ndarray) -> list[int]:
    """The reference: swap-remove ``rows[idx[0]]``, then ``rows[idx[1]]``..."""
    out = []
    for i in idx.tolist():
        row = rows[i]
        last = rows.pop()
        if i < len(rows):
            rows[i] = last
            pos[last] = i
        out.append(row)
    return out


def uniform_idx(rng: np.random.Generator, size: int, n: int) -> np.ndarray:
    """The sampler's draws: pick ``j`` uniform over the ``size - j`` rows left."""
    return (rng.random(n) * (size - np.arange(n))).astype(np.int64)


def check_against_reference(idx: np.ndarray, size: int, rng: np.random.Generator) -> None:
    region = rng.permutation(size + 7)[:size].astype(np.uint32)  # rows are not 0..size-1
    pos0 = np.zeros(size + 7, dtype=np.uint32)
    pos0[region] = np.arange(size, dtype=np.uint32)
    ref_rows, ref_pos = array.array("I", region.tobytes()), array.array("I", pos0.tobytes())
    expect = pick_one_by_one(ref_rows, ref_pos, idx)
    rows, pos = region.copy(), pos0.copy()
    got = swap_remove(rows, pos, idx)
    assert got.dtype == np.int64
    assert got.tolist() == expect
    assert rows[: size - len(idx)].tolist() == ref_rows.tolist()
    assert pos.tolist() == ref_pos.tolist()  # the picked rows' stale entries too


SIZES = [(1, 1), (2, 2), (5, 5), (50, 40), (50, 50), (64, 8), (300, 299), (1000, 200)]


@pytest.mark.parametrize(("size", "n"), SIZES)
@pytest.mark.parametrize("seed", range(40))
def test_swap_remove_equals_one_by_one(size, n, seed):
    rng = np.random.default_rng(seed)
    check_against_reference(uniform_idx(rng, size, n), size, rng)


@pytest.mark.parametrize(("size", "n"), [(200_000, 2000), (20_000, 20_000), (5000, 4000)])
@pytest.mark.parametrize("seed", range(5))
def test_swap_remove_equals_one_by_one_large(size, n, seed):
    rng = np.random.default_rng(1000 + seed)
    check_against_reference(uniform_idx(rng, size, n), size, rng)


@pytest.mark.parametrize("size", [1, 2, 3, 10, 33])
def test_swap_remove_adversarial_patterns(size):
    """Every pick the last row; every pick slot 0; picks that take the next filler; mixes."""
    rng = np.random.default_rng(size)
    j = np.arange(size, dtype=np.int64)
    patterns = [
        size - 1 - j,  # always the last row: no row moves
        np.zeros(size, dtype=np.int64),  # the same slot every time
        np.maximum(size - 2 - j, 0),  # the next pick's filler every time
        (size - 1 - j) // 2,
        np.where(j % 2 == 0, size - 1 - j, 0),
    ]
    for idx in patterns:
        check_against_reference(idx, size, rng)
        check_against_reference(idx[: size // 2], size, rng)


def brute_force_conflicts(idx: np.ndarray, size: int, start: int, stop: int) -> int | None:
    """The first pick of ``[start, stop)`` that sees a change made by an earlier one there."""
    for j in range(start, stop):
        for i in range(start, j):
            if idx[i] in (idx[j], size - 1 - j):
                return j
    return None


@pytest.mark.parametrize(("size", "n"), [(50, 40), (30, 30), (400, 60), (10, 3)])
@pytest.mark.parametrize("seed", range(25))
def test_chunks_are_conflict_free_and_maximal(size, n, seed):
    idx = uniform_idx(np.random.default_rng(seed), size, n)
    starts = chunk_starts(idx, size).tolist()
    assert starts[0] == 0
    assert starts == sorted(set(starts))
    bounds = [*starts, n]
    for c, e in itertools.pairwise(bounds):
        assert brute_force_conflicts(idx, size, c, e) is None  # exact
        if e < n:
            assert brute_force_conflicts(idx, size, c, e + 1) == e  # cut only when needed


def test_chunk_starts_without_picks():
    assert chunk_starts(np.empty(0, dtype=np.int64), 10).tolist() == []


def test_full_region_takes_few_chunks():
    """A whole 20,000-row region in one call: about 2·sqrt(size) chunks, not one per row."""
    size = 20_000
    counts = [
        len(chunk_starts(uniform_idx(np.random.default_rng(s), size, size), size)) for s in range(5)
    ]
    assert max(counts) < 8 * int(np.sqrt(size)), counts


def test_regions_pick_truncates_the_region():
    regions = Regions()
    regions.add_bit(np.arange(100, dtype=np.uint32), 1)
    r = regions.index[1]
    idx = uniform_idx(np.random.default_rng(3), 100, 30)
    ref_rows = array.array("I", regions.rows[r].tobytes())
    ref_pos = array.array("I", regions.pos.tobytes())
    expect = pick_one_by_one(ref_rows, ref_pos, idx)
    assert regions.pick(r, idx).tolist() == expect
    assert regions.rows[r] == ref_rows
    assert regions.pos == ref_pos


@pytest.mark.parametrize("jobs", [1, 4])
def test_sampler_200k_rows_2000_at_once_is_chunked_not_per_row(monkeypatch, jobs):
    """|R| = 200,000, n = 2,000: ~20 conflicts per call, so a handful of array chunks; the
    rows, the region and the positions equal the round-by-round walk's."""
    chunks: list[int] = []

    def counting(idx: np.ndarray, size: int) -> np.ndarray:
        out = chunk_starts(idx, size)
        chunks.append(len(out))
        return out

    monkeypatch.setattr(regions_mod, "chunk_starts", counting)
    names = [f"j{k}" for k in range(jobs)]
    runs = []
    for vectorize in (True, False):
        s = DependentSampler(seed=7)
        s.vectorize = vectorize
        for name in names:
            s.add_job(name, BitMap(range(200_000)))
        out = [s.sample_many(names, 2000) for _ in range(3)]
        runs.append(
            (
                [{k: v.tolist() for k, v in res.items()} for res in out],
                s.state_dict()["regions"],  # each region's rows, in pick order
            )
        )
        if vectorize:
            assert len(chunks) == 3  # every call went through the chunked path
            assert max(chunks) < 100  # ~20 expected; one per row would be 2,000
            chunks.clear()
    assert not chunks  # the round-by-round walk never swap-removes in bulk
    assert runs[0] == runs[1]


def read_buf(uni: Uniforms, k: int) -> list[float]:
    uni.ensure(k)
    out = uni.buf[uni.i : uni.i + k]
    uni.i += k
    return out


@pytest.mark.parametrize("seed", range(5))
def test_uniforms_take_continues_the_buffered_stream(seed):
    """take() (arrays) and reads of buf (lists), mixed and resumed, give one stream."""
    sizes = np.random.default_rng(seed).integers(1, 3 * Uniforms.BLOCK, size=30).tolist()
    ref = Uniforms(seed)
    expect = [read_buf(ref, k) for k in sizes]
    mixed = Uniforms(seed)
    got = []
    for t, k in enumerate(sizes):
        if t == 15:
            state = mixed.state_dict()
            mixed = Uniforms(None)
            mixed.load_state_dict(state)
        got.append(mixed.take(k).tolist() if t % 3 else read_buf(mixed, k))
    assert got == expect
