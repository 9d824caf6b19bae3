"""The eviction policy is one object: the arena and bench sampling's simulator rank by it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tabloader.catalog._errors import CacheError
from tabloader.engine._arena.arena import Arena
from tabloader.engine._arena.eviction import (
    ARENA_POLICY,
    EvictionPolicy,
    FarthestNextUse,
    FewestUses,
    LeastRecent,
)
from tests.support.cachesim import Policy, PolicyCache, Stream, simulate

SLOTS = 16  # fewer than 64: the arena evicts one victim per put


class NearestNextUse(EvictionPolicy):
    """A policy neither the arena nor the simulator knows: the nearest next use first, then
    the most uses, then the most recent (the reverse of the arena's)."""

    def keys(self, next_use: Any, uses: Any, last_use: Any) -> tuple[Any, ...]:
        return (next_use, -uses, -last_use)


def candidates(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Eviction inputs of rows 0..SLOTS-1 with many ties (last uses: row order)."""
    rng = np.random.default_rng(seed)
    next_use = rng.choice([1.0, 2.0, 7.0, np.inf], SLOTS)
    uses = rng.integers(0, 3, SLOTS).astype(float)
    return next_use, uses, np.arange(SLOTS, dtype=float)


def arena_victims(policy: EvictionPolicy, next_use: np.ndarray, uses: np.ndarray) -> list[int]:
    """The rows a full arena evicts, in order, as pinned new rows take their slots."""
    value = np.zeros((4, 4, 3), np.uint8)  # 48 bytes: a 64-byte slot

    def score(space: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return next_use[rows], uses[rows]

    arena = Arena(64 * SLOTS, slab_bytes=64 * SLOTS, score=score, policy=policy)
    space = arena.space("s", num_rows=2 * SLOTS, fixed=True)
    row_at = {}
    for row in range(SLOTS):  # one at a time: row r is the r-th least recent
        offset = arena.put(space, row, value)
        arena.release(np.array([offset]))
        row_at[offset] = row
    # each new row takes the one victim's slot (pinned: never a candidate itself)
    return [row_at[arena.put(space, new, value)] for new in range(SLOTS, 2 * SLOTS)]


def simulator_victims(policy: EvictionPolicy, next_use, uses, last_use) -> list[int]:
    cache = PolicyCache(policy)
    for row in range(SLOTS):
        cache.put(row, float(next_use[row]), int(uses[row]), int(last_use[row]))
    return [cache.evict(set()) for _ in range(SLOTS)]


@pytest.mark.parametrize(
    "policy", [ARENA_POLICY, FewestUses(), LeastRecent(), NearestNextUse()], ids=repr
)
@pytest.mark.parametrize("seed", range(5))
def test_arena_and_simulator_evict_the_same_victims(policy, seed):
    next_use, uses, last_use = candidates(seed)
    expected = policy.order(next_use, uses, last_use).tolist()
    assert simulator_victims(policy, next_use, uses, last_use) == expected
    assert arena_victims(policy, next_use, uses) == expected


def test_the_arena_policy_ranks_farthest_then_fewest_uses_then_least_recent():
    next_use = np.array([5.0, 9, 9, 9, np.inf, np.inf])
    uses = np.array([0, 3, 1, 1, 2, 1])
    last_use = np.array([0, 1, 3, 2, 4, 5])
    # unknown next uses first (fewer uses first), then 9 before 5; ties: fewer uses, older
    assert ARENA_POLICY.order(next_use, uses, last_use).tolist() == [5, 4, 3, 2, 1, 0]
    assert FewestUses().order(next_use, uses, last_use).tolist() == [0, 3, 2, 5, 4, 1]
    assert LeastRecent().order(next_use, uses, last_use).tolist() == [0, 1, 3, 2, 4, 5]


def test_the_simulator_lookahead_and_the_arena_call_the_arena_policy(monkeypatch):
    """Reversing FarthestNextUse changes both the arena's victims and the Lookahead reads."""
    next_use, uses, _ = candidates(0)
    rows = [1, 2, 3, 1, 2, 4, 1, 2, 3, 4] * 3
    arr = np.asarray(rows, np.int64)
    stream = Stream(arr, np.ones(arr.size, np.int64), np.arange(arr.size + 1), [], 5)
    stream.ref_events.append((0, np.arange(5), 3))
    before = arena_victims(ARENA_POLICY, next_use, uses), simulate(stream, Policy.LOOKAHEAD, 2)
    monkeypatch.setattr(FarthestNextUse, "keys", NearestNextUse.keys)
    after = arena_victims(ARENA_POLICY, next_use, uses), simulate(stream, Policy.LOOKAHEAD, 2)
    assert after[0] == NearestNextUse().order(next_use, uses, np.arange(SLOTS)).tolist()
    assert after[0] != before[0]
    assert after[1] > before[1]  # evicting the nearest next use reads more


def test_an_arena_needs_a_policy_object():
    with pytest.raises(CacheError, match="policy must be an eviction policy"):
        Arena(1 << 20, policy="lru")  # type: ignore[arg-type]


def test_the_base_policy_has_no_keys():
    with pytest.raises(NotImplementedError):
        EvictionPolicy().order([1.0], [0], [0])


@given(
    st.lists(
        st.tuples(
            st.sampled_from([-1.0, 0.0, 3.0, 7.0, np.inf]),  # many ties and infinities
            st.integers(0, 3),
            st.integers(0, 5),
        ),
        min_size=1,
        max_size=60,
    ),
    st.integers(0, 70),
    st.sampled_from([ARENA_POLICY, FewestUses(), LeastRecent(), NearestNextUse()]),
)
@settings(max_examples=300, deadline=None)
def test_select_is_the_first_k_of_the_order(candidates, k, policy):
    """The arena's linear-time choice of its ``k`` best victims is exactly the first ``k`` of
    the policy's full order (ties included: their given order)."""
    next_use, uses, last_use = (np.array(c) for c in zip(*candidates, strict=True))
    want = policy.order(next_use, uses, last_use)[:k].tolist()
    assert policy.select(next_use, uses, last_use, k).tolist() == want


def test_select_on_many_candidates_with_few_known_next_uses():
    rng = np.random.default_rng(0)
    n = 20_000
    next_use = np.where(rng.random(n) < 0.9, np.inf, rng.integers(0, 500, n)).astype(float)
    uses, last_use = rng.integers(0, 3, n), rng.permutation(n)
    for k in (1, 16, 700, 19_000):
        want = ARENA_POLICY.order(next_use, uses, last_use)[:k].tolist()
        assert ARENA_POLICY.select(next_use, uses, last_use, k).tolist() == want
