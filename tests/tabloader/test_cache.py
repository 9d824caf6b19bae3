from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from catalog.errors import CacheError, RowReadError
from tabloader.cache import CacheOvershootWarning, CacheStats, CacheTooSmallWarning, RowCache


def loader(value, nbytes=10, calls=None):
    def load():
        if calls is not None:
            calls.append(value)
        return value, nbytes

    return load


def table_refcount(counts: dict[int, float], default: float = 0.0):
    def refcount(ids, column):
        return np.array([counts.get(int(i), default) for i in ids], dtype=np.float64)

    return refcount


def check_consistent(s: CacheStats) -> None:
    assert s.requests == s.hits + s.merged + s.reads
    assert 0 <= s.pinned <= s.entries
    assert 0 <= s.pinned_bytes <= s.size_bytes


def cached_rows(cache: RowCache, rows) -> set[int]:
    return {i for i in rows if (i, "a") in cache}


# ---------------------------------------------------------------- basics


def test_hit_miss_counting():
    cache = RowCache(100)
    calls: list[str] = []
    assert cache.get_or_load((1, "a"), loader("x", calls=calls), pin=False) == "x"
    assert cache.get_or_load((1, "a"), loader("y", calls=calls), pin=False) == "x"
    assert cache.get_or_load((1, "b"), loader("z", calls=calls), pin=False) == "z"
    assert calls == ["x", "z"]
    s = cache.stats()
    assert (s.requests, s.hits, s.merged, s.reads, s.failed) == (3, 1, 0, 2, 0)
    assert (s.bytes_read, s.size_bytes, s.entries, s.capacity_bytes) == (20, 20, 2, 100)
    assert s.hit_rate == pytest.approx(1 / 3)
    assert len(cache) == 2
    assert (1, "a") in cache
    assert (2, "a") not in cache
    check_consistent(s)


def test_columns_are_separate_entries():
    cache = RowCache(100)
    cache.get_or_load((1, "image@224"), loader("small"), pin=False)
    cache.get_or_load((1, "image@rgb"), loader("full"), pin=False)
    assert cache.get_or_load((1, "image@224"), loader("other"), pin=False) == "small"
    assert cache.stats().reads == 2


def test_pins_count_and_release():
    cache = RowCache(100)
    key = (5, "a")
    cache.get_or_load(key, loader("v"))
    cache.get_or_load(key, loader("v"))
    assert cache.pins(key) == 2
    assert cache.stats().pinned == 1
    cache.unpin(key)
    assert cache.pins(key) == 1
    cache.release([key])
    assert cache.pins(key) == 0
    s = cache.stats()
    assert (s.pinned, s.pinned_bytes, s.entries) == (0, 0, 1)


def test_unpin_not_pinned_raises():
    cache = RowCache(100)
    with pytest.raises(CacheError, match=r"Cannot unpin \(1, 'a'\): it is not cached"):
        cache.unpin((1, "a"))
    cache.get_or_load((1, "a"), loader("v"), pin=False)
    with pytest.raises(CacheError, match="it is cached but not pinned"):
        cache.unpin((1, "a"))
    cache.get_or_load((2, "a"), loader("v"))
    with pytest.raises(CacheError, match=r"\(3, 'a'\)"):
        cache.release([(2, "a"), (3, "a")])
    assert cache.pins((2, "a")) == 0  # keys before the bad one were released


@pytest.mark.parametrize("capacity", [0, -5])
def test_capacity_must_be_positive(capacity):
    with pytest.raises(CacheError, match="capacity_bytes must be positive"):
        RowCache(capacity)


def test_capacity_must_be_int():
    with pytest.raises(CacheError, match="capacity_bytes must be an int"):
        RowCache(1.5)  # type: ignore[arg-type]


def test_sample_size_validated():
    with pytest.raises(CacheError, match="sample_size must be a positive int or None"):
        RowCache(10, refcount=table_refcount({}), sample_size=0)


def test_bad_load_result_raises_and_is_not_cached():
    cache = RowCache(100)
    with pytest.raises(CacheError, match=r"must return \(value, nbytes\)"):
        cache.get_or_load((1, "a"), lambda: "oops")
    with pytest.raises(CacheError, match="nbytes a non-negative int"):
        cache.get_or_load((1, "a"), lambda: ("v", -1))
    assert (1, "a") not in cache
    assert cache.pins((1, "a")) == 0
    assert cache.stats().failed == 2


def test_recursive_load_raises():
    cache = RowCache(100)

    def load():
        return cache.get_or_load((1, "a"), loader("inner")), 1

    with pytest.raises(CacheError, match="must not request its own key"):
        cache.get_or_load((1, "a"), load)
    assert (1, "a") not in cache
    check_consistent(cache.stats())


def test_clear_keeps_pinned_entries():
    cache = RowCache(100)
    cache.get_or_load((1, "a"), loader("p"))
    cache.get_or_load((2, "a"), loader("u"), pin=False)
    assert cache.clear() == 1
    assert (1, "a") in cache
    assert (2, "a") not in cache
    assert cache.stats().size_bytes == 10
    cache.unpin((1, "a"))


def test_repr_names_policy():
    assert "policy=lru" in repr(RowCache(10))
    assert "policy=refcount" in repr(RowCache(10, refcount=table_refcount({})))


# ---------------------------------------------------------------- threads


def wait_until(predicate) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_request_merging_with_threads():
    cache = RowCache(1000)
    started = threading.Event()
    release = threading.Event()
    calls = []
    value = np.arange(10)

    def load():
        calls.append(1)
        started.set()
        assert release.wait(10)
        return value, value.nbytes

    results: list[object] = []
    lock = threading.Lock()

    def worker():
        v = cache.get_or_load((7, "image"), load)
        with lock:
            results.append(v)

    first = threading.Thread(target=worker)
    first.start()
    assert started.wait(10)
    others = [threading.Thread(target=worker) for _ in range(7)]
    for t in others:
        t.start()
    wait_until(lambda: cache.stats().merged == 7)  # all waiters registered before load ends
    release.set()
    for t in [first, *others]:
        t.join(10)
    assert len(calls) == 1
    assert len(results) == 8
    assert all(r is value for r in results)
    s = cache.stats()
    assert (s.requests, s.reads, s.merged, s.hits) == (8, 1, 7, 0)
    assert cache.pins((7, "image")) == 8  # every merged caller holds its own pin
    cache.release([(7, "image")] * 8)
    assert cache.stats().pinned == 0


def test_load_error_reaches_every_waiter_and_is_not_cached():
    cache = RowCache(1000)
    started = threading.Event()
    release = threading.Event()
    error = RowReadError("bad jpeg", row_id=3, column="image")

    def load():
        started.set()
        assert release.wait(10)
        raise error

    caught: list[BaseException] = []
    lock = threading.Lock()

    def worker():
        try:
            cache.get_or_load((3, "image"), load)
        except RowReadError as exc:
            with lock:
                caught.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(5)]
    threads[0].start()
    assert started.wait(10)
    for t in threads[1:]:
        t.start()
    wait_until(lambda: cache.stats().merged == 4)
    release.set()
    for t in threads:
        t.join(10)
    assert len(caught) == 5
    assert all(exc is error for exc in caught)
    assert error.__traceback__ is not None
    assert (3, "image") not in cache
    assert cache.pins((3, "image")) == 0
    s = cache.stats()
    assert (s.reads, s.failed, s.merged) == (1, 1, 4)
    # not cached: the next request loads again
    assert cache.get_or_load((3, "image"), loader("ok"), pin=False) == "ok"
    assert cache.stats().reads == 2
    check_consistent(cache.stats())


def test_load_error_keeps_its_traceback():
    cache = RowCache(100)

    def load():
        raise ValueError("corrupt row 9")

    with pytest.raises(ValueError, match="corrupt row 9") as info:
        cache.get_or_load((9, "image"), load)
    assert any(entry.name == "load" for entry in info.traceback)


def test_many_threads_many_keys_stay_consistent():
    counts = {i: i % 3 for i in range(200)}
    cache = RowCache(50 * 8, refcount=table_refcount(counts), sample_size=8)
    reads: dict[tuple[int, str], int] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def load_for(key):
        def load():
            with lock:
                reads[key] = reads.get(key, 0) + 1
            return key[0], 8

        return load

    def job(seed):
        rng = np.random.default_rng(seed)
        try:
            for i in rng.integers(0, 200, 500).tolist():
                key = (i, "x")
                assert cache.get_or_load(key, load_for(key)) == i
                cache.unpin(key)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    s = cache.stats()
    check_consistent(s)
    assert s.requests == 3000
    assert s.pinned == 0
    assert s.size_bytes <= s.capacity_bytes
    assert s.reads == sum(reads.values())


# ---------------------------------------------------------------- capacity and eviction


def test_capacity_respected_after_every_insert():
    cache = RowCache(100)
    for i in range(50):
        cache.get_or_load((i, "a"), loader(i, nbytes=7 + i % 5), pin=False)
        assert cache.stats().size_bytes <= 100
    s = cache.stats()
    assert s.evictions > 0
    assert s.bytes_read == s.size_bytes + s.bytes_evicted


def test_lru_order_without_refcount():
    cache = RowCache(30)
    for i in range(3):
        cache.get_or_load((i, "a"), loader(i), pin=False)
    cache.get_or_load((0, "a"), loader(0), pin=False)  # 0 is now most recent
    cache.get_or_load((3, "a"), loader(3), pin=False)
    assert cached_rows(cache, range(4)) == {0, 2, 3}


@pytest.mark.parametrize("sample_size", [32, None])
def test_eviction_lowest_refcount_first_then_lru(sample_size):
    counts = {0: 2, 1: 0, 2: 1, 3: 0, 4: 5, 5: 9}
    cache = RowCache(50, refcount=table_refcount(counts), sample_size=sample_size)
    for i in range(5):  # 0..4, in LRU order 0 (oldest) .. 4
        cache.get_or_load((i, "a"), loader(i), pin=False)
    order = []
    for new in [5, 6, 7, 8, 9]:
        before = cached_rows(cache, range(10))
        cache.get_or_load((new, "a"), loader(new), pin=True)
        order.extend(sorted(before - cached_rows(cache, range(10))))
    # refcount 0 (1 then 3, by LRU), then 1 (row 2), then 2 (row 0), then 5 (row 4)
    assert order == [1, 3, 2, 0, 4]
    assert cache.stats().evictions == 5


def test_unpin_refreshes_recency():
    cache = RowCache(30, refcount=table_refcount({}, default=0))
    cache.get_or_load((0, "a"), loader(0))  # pinned
    cache.get_or_load((1, "a"), loader(1), pin=False)
    cache.get_or_load((2, "a"), loader(2), pin=False)
    cache.unpin((0, "a"))  # consumed now: most recently used
    cache.get_or_load((3, "a"), loader(3), pin=False)
    assert cached_rows(cache, range(4)) == {0, 2, 3}


def test_refcount_changes_are_seen_at_eviction_time():
    counts = {0: 0, 1: 3}
    cache = RowCache(20, refcount=table_refcount(counts))
    cache.get_or_load((0, "a"), loader(0), pin=False)
    cache.get_or_load((1, "a"), loader(1), pin=False)
    counts[0], counts[1] = 4, 0  # the sampler moved on: row 1 is no longer needed
    cache.get_or_load((2, "a"), loader(2))
    assert cached_rows(cache, range(3)) == {0, 2}


def test_refcount_is_called_per_column():
    calls = []

    def refcount(ids, column):
        calls.append((column, sorted(ids.tolist())))
        return np.full(len(ids), 0 if column == "label" else 5)

    cache = RowCache(30, refcount=refcount)
    cache.get_or_load((1, "image@224"), loader("i"), pin=False)
    cache.get_or_load((1, "label"), loader("l"), pin=False)
    cache.get_or_load((2, "image@224"), loader("j"), pin=False)
    cache.get_or_load((3, "image@224"), loader("k"))
    assert (1, "label") not in cache
    assert (1, "image@224") in cache
    assert sorted(calls) == [("image@224", [1, 2]), ("label", [1])]


@pytest.mark.parametrize("sample_size", [32, None])
def test_belady_evicts_farthest_next_use(sample_size):
    next_use = {0: 5.0, 1: np.inf, 2: 1.0, 3: 50.0, 4: 7.0}

    def nu(ids, column):
        return np.array([next_use.get(int(i), 0.0) for i in ids])

    cache = RowCache(50, next_use=nu, sample_size=sample_size)
    for i in range(5):
        cache.get_or_load((i, "a"), loader(i), pin=False)
    order = []
    for new in [10, 11, 12]:
        before = cached_rows(cache, range(20))
        cache.get_or_load((new, "a"), loader(new))
        order.extend(sorted(before - cached_rows(cache, range(20))))
    assert order == [1, 3, 4]


def test_belady_ties_broken_by_refcount_then_lru():
    cache = RowCache(
        30,
        next_use=lambda ids, column: np.full(len(ids), 9.0),
        refcount=table_refcount({0: 1, 1: 0, 2: 0}),
    )
    for i in range(3):
        cache.get_or_load((i, "a"), loader(i), pin=False)
    cache.get_or_load((3, "a"), loader(3))
    assert (1, "a") not in cache
    cache.get_or_load((4, "a"), loader(4))
    assert (2, "a") not in cache
    assert (0, "a") in cache


def test_pinned_entries_are_never_evicted_and_overshoot_is_reported():
    cache = RowCache(30, refcount=table_refcount({}))
    for i in range(3):
        cache.get_or_load((i, "a"), loader(i))
    with pytest.warns(CacheOvershootWarning, match="Raise capacity_bytes"):
        cache.get_or_load((3, "a"), loader(3))
    assert cached_rows(cache, range(4)) == {0, 1, 2, 3}
    s = cache.stats()
    assert (s.size_bytes, s.overshoot_bytes, s.pinned) == (40, 10, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.get_or_load((4, "a"), loader(4))  # warned once per cache only
    assert cache.stats().overshoot_bytes == 20
    cache.release([(0, "a"), (1, "a")])  # releasing evicts back under capacity
    assert cache.stats().size_bytes == 30
    assert cached_rows(cache, range(5)) == {2, 3, 4}


def test_lru_mode_overshoot_also_warns():
    cache = RowCache(10)
    cache.get_or_load((0, "a"), loader(0))
    with pytest.warns(CacheOvershootWarning, match="over capacity"):
        cache.get_or_load((1, "a"), loader(1))
    cache.unpin((0, "a"))
    assert cache.stats().size_bytes == 10
    assert cached_rows(cache, range(2)) == {1}


def test_oversize_value_is_returned_but_not_cached():
    cache = RowCache(100)
    cache.get_or_load((0, "a"), loader("small", nbytes=60), pin=False)
    big = np.zeros(200, np.uint8)
    with pytest.warns(CacheTooSmallWarning, match=r"200 bytes \(a\) is larger than the whole"):
        assert cache.get_or_load((1, "a"), loader(big, nbytes=200)) is big
    with warnings.catch_warnings():  # once per cache
        warnings.simplefilter("error")
        cache.get_or_load((2, "a"), loader(big, nbytes=200), pin=False)
    assert (1, "a") not in cache
    assert (0, "a") in cache  # nothing was evicted for it
    s = cache.stats()
    assert (s.uncached, s.evictions, s.size_bytes, s.bytes_read) == (2, 0, 60, 460)
    assert cache.pins((1, "a")) == 1  # the pin is still tracked, so release is symmetric
    cache.unpin((1, "a"))
    with pytest.raises(CacheError, match="not cached"):
        cache.unpin((1, "a"))


def test_refcount_failure_becomes_cache_error_without_pin():
    def refcount(ids, column):
        raise RuntimeError("sampler is gone")

    cache = RowCache(10, refcount=refcount)
    cache.get_or_load((0, "a"), loader(0), pin=False)
    with pytest.raises(CacheError, match=r"refcount.*failed during eviction: sampler is gone"):
        cache.get_or_load((1, "a"), loader(1))
    assert cache.pins((1, "a")) == 0


def test_refcount_wrong_shape_raises():
    cache = RowCache(10, refcount=lambda ids, column: np.zeros(len(ids) + 1))
    cache.get_or_load((0, "a"), loader(0), pin=False)
    with pytest.raises(CacheError, match="returned shape"):
        cache.get_or_load((1, "a"), loader(1), pin=False)


def test_sampled_eviction_on_large_cache_prefers_low_refcount():
    n = 5000
    counts = np.random.default_rng(1).integers(1, 4, n + 200).astype(np.float64)
    zeros = set(range(0, n, 10))  # 10 % of the rows are no longer needed
    counts[sorted(zeros)] = 0

    def refcount(ids, column):
        return counts[ids]

    cache = RowCache(n * 8, refcount=refcount, sample_size=32)
    for i in range(n):
        cache.get_or_load((i, "a"), loader(i, nbytes=8), pin=False)
    for i in range(n, n + 200):
        before = len(cache)
        cache.get_or_load((i, "a"), loader(i, nbytes=8), pin=False)
        assert len(cache) == before
    evicted = set(range(n)) - cached_rows(cache, range(n))
    assert len(evicted) == 200
    assert evicted <= zeros


# ---------------------------------------------------------------- property test

op = st.one_of(
    st.tuples(st.just("get"), st.integers(0, 11), st.booleans(), st.integers(1, 40)),
    st.tuples(st.just("unpin"), st.integers(0, 11)),
    st.tuples(st.just("refcount"), st.integers(0, 11), st.integers(0, 3)),
)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(op, max_size=60),
    capacity=st.integers(20, 120),
    policy=st.sampled_from(["lru", "refcount", "belady", "exact"]),
)
def test_invariants_under_random_ops(ops, capacity, policy):
    counts: dict[int, float] = {}
    rc = table_refcount(counts)
    kwargs = {
        "lru": {},
        "refcount": {"refcount": rc, "sample_size": 2},
        "belady": {"next_use": lambda ids, column: ids * 1.0, "refcount": rc},
        "exact": {"refcount": rc, "sample_size": None},
    }[policy]
    cache = RowCache(capacity, **kwargs)
    held: dict[tuple[int, str], int] = {}
    sizes: dict[tuple[int, str], int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheOvershootWarning)
        warnings.simplefilter("ignore", CacheTooSmallWarning)
        for o in ops:
            if o[0] == "get":
                _, i, pin, nbytes = o
                key = (i, "c")
                nbytes = sizes.setdefault(key, nbytes)
                assert cache.get_or_load(key, loader(i, nbytes=nbytes), pin=pin) == i
                if pin:
                    held[key] = held.get(key, 0) + 1
            elif o[0] == "unpin":
                key = (o[1], "c")
                if held.get(key):
                    cache.unpin(key)
                    held[key] -= 1
                else:
                    with pytest.raises(CacheError, match="Cannot unpin"):
                        cache.unpin(key)
            else:
                counts[o[1]] = o[2]
            s = cache.stats()
            check_consistent(s)
            assert s.size_bytes == sum(sizes[k] for k in sizes if k in cache)
            pinned = {k for k, n in held.items() if n}
            for k in pinned:
                assert cache.pins(k) == held[k]
                if sizes[k] <= capacity:
                    assert k in cache  # pinned ⊆ cached
            assert s.pinned_bytes == sum(sizes[k] for k in pinned if k in cache)
            if s.size_bytes > capacity:  # only when the pinned rows alone need the room
                assert s.size_bytes == s.pinned_bytes
                assert s.overshoot_bytes >= s.size_bytes - capacity
