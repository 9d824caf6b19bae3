from __future__ import annotations

import threading

import numpy as np
import pytest

from tabloader.catalog import CacheError
from tabloader.engine._arena.arena import Arena, CacheOvershootWarning, CacheTooSmallWarning


def value(row: int, shape=(4, 4, 3)) -> np.ndarray:
    return np.full(shape, row % 251, np.uint8)


def test_put_get_view_release_roundtrip():
    arena = Arena(1 << 20)
    space = arena.space("d/image@4", num_rows=10, fixed=True)
    off = arena.put(space, 3, value(3))
    assert off >= 0
    found = arena.get(space, np.array([3, 4, 3]))
    assert found.offsets[1] == -1
    assert found.offsets[0] == found.offsets[2] == off
    assert found.shapes[0].tolist() == [4, 4, 3]
    assert arena.pins(off) == 3  # put + two gets
    view = arena.view(off, (4, 4, 3))
    assert not view.flags.writeable
    np.testing.assert_array_equal(view, value(3))
    arena.release(np.array([off, off, off]))
    s = arena.stats()
    assert (s.pinned, s.entries, s.puts, s.hits, s.misses) == (0, 1, 1, 2, 1)


def test_release_without_a_pin_is_refused():
    arena = Arena(1 << 20)
    space = arena.space("s", num_rows=4)
    off = arena.put(space, 0, value(0))
    arena.release(np.array([off]))
    with pytest.raises(CacheError, match="holds no pin"):
        arena.release(np.array([off]))
    with pytest.raises(CacheError, match="not a slot of this arena"):
        arena.release(np.array([arena.buffer.size * 2]))


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_capacity_must_be_a_positive_int(bad):
    with pytest.raises(CacheError, match="capacity_bytes must be"):
        Arena(bad)


def test_put_of_a_stored_row_pins_the_first_copy():
    arena = Arena(1 << 20)
    space = arena.space("s", num_rows=4)
    first = arena.put(space, 1, value(1))
    again = arena.put(space, 1, value(2), pins=2)
    assert again == first
    assert arena.pins(first) == 3
    np.testing.assert_array_equal(arena.view(first, (4, 4, 3)), value(1))


def _full_arena(score=None, slots=4):
    """An arena of one slab holding ``slots`` 4x4x3 values (each slot 64 bytes)."""
    arena = Arena(64 * slots, slab_bytes=64 * slots, score=score)
    space = arena.space("s", num_rows=100, fixed=True)
    offs = [arena.put(space, r, value(r)) for r in range(slots)]
    arena.release(np.array(offs))
    return arena, space, offs


def test_eviction_farthest_next_use_then_fewest_uses_then_lru():
    next_use = np.full(100, np.inf)
    uses = np.zeros(100)
    next_use[[0, 1, 2, 3, 50, 51, 52]] = [5, 9, 9, 9, 0, 0, 0]
    uses[[0, 1, 2, 3]] = [0, 3, 1, 1]

    def score(space, rows):
        return next_use[rows], uses[rows]

    arena, space, _ = _full_arena(score)
    arena.release(arena.get(space, np.array([2])).offsets)  # row 3 is now the least recent
    evicted = []
    for new in (50, 51, 52):
        arena.release(np.array([arena.put(space, new, value(new))]))
        present = arena.stored(space, np.arange(4))
        evicted += [r for r in range(4) if not present[r] and r not in evicted]
    # farthest next use first (9 beats 5); then fewest uses (1 beats 3); then LRU (3, then 2)
    assert evicted == [3, 2, 1]


def test_pinned_slots_are_never_evicted():
    arena, space, _offs = _full_arena()
    held = arena.get(space, np.arange(4))
    with pytest.warns(CacheOvershootWarning, match="every slot was pinned"):
        assert arena.put(space, 10, value(10)) == -1
    assert arena.stats().uncached == 1
    for r in range(4):  # still there, unchanged
        np.testing.assert_array_equal(arena.view(int(held.offsets[r]), (4, 4, 3)), value(r))
    arena.release(held.offsets)
    assert arena.put(space, 10, value(10)) >= 0


def test_a_value_larger_than_a_slab_goes_uncached():
    arena = Arena(64 * 1024, slab_bytes=4096)
    space = arena.space("s", num_rows=2)
    with pytest.warns(CacheTooSmallWarning, match="larger than a slab"):
        assert arena.put(space, 0, np.zeros((100, 100, 3), np.uint8)) == -1


def test_variable_sizes_round_up_fixed_sizes_are_exact():
    arena = Arena(1 << 22)
    fixed = arena.space("f", num_rows=2, fixed=True)
    var = arena.space("v", num_rows=2)
    arena.put(fixed, 0, np.zeros((50, 50, 3), np.uint8))  # 7500 bytes -> 7552 (64-aligned)
    arena.put(var, 0, np.zeros((50, 50, 3), np.uint8))  # -> 8192 (two classes per octave)
    assert arena.stats().size_bytes == 7552 + 8192


def test_a_class_without_room_takes_an_unpinned_slab_of_another():
    arena = Arena(2 * 1024, slab_bytes=1024)
    small = arena.space("small", num_rows=100, fixed=True)
    big = arena.space("big", num_rows=10, fixed=True)
    offs = [arena.put(small, r, value(r)) for r in range(32)]  # 16 x 64 B per slab: both slabs
    arena.release(np.array(offs))
    assert arena.stats().slabs_used == 2
    off = arena.put(big, 0, value(0, (16, 16, 3)))  # 768 bytes: needs a slab of its own
    assert off >= 0
    s = arena.stats()
    assert s.evictions == 16
    assert s.entries == 17
    np.testing.assert_array_equal(arena.view(off, (16, 16, 3)), value(0, (16, 16, 3)))


def test_concurrent_puts_gets_and_releases_stay_consistent():
    arena = Arena(64 * 64, slab_bytes=64 * 16)
    space = arena.space("s", num_rows=200, fixed=True)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(400):
                rows = rng.choice(200, 4, replace=False)
                found = arena.get(space, rows)
                held = [int(o) for o in found.offsets if o >= 0]
                for r, o in zip(rows.tolist(), found.offsets.tolist(), strict=True):
                    if o < 0:
                        new = arena.put(space, r, value(r))
                        if new >= 0:
                            held.append(new)
                    else:  # a pinned slot still holds its row's value
                        assert (arena.view(o, (4, 4, 3)) == r % 251).all()
                arena.release(np.array(held, np.int64))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    s = arena.stats()
    assert s.pinned == 0
    assert s.size_bytes <= arena.buffer.size
    assert s.evictions > 0


def test_the_arena_can_live_in_shared_memory():
    """The next step (the loader service) maps the arena in another process: a slot is an
    offset and a shape in the buffer, readable from any other mapping of the segment."""
    from multiprocessing import shared_memory

    seg = shared_memory.SharedMemory(create=True, size=1 << 20)
    try:
        arena = Arena(1 << 20, buffer=seg.buf)
        space = arena.space("imgs/image@4", num_rows=8, fixed=True)
        off = arena.put(space, 5, value(5))
        other = shared_memory.SharedMemory(name=seg.name)  # as a client would attach
        try:
            seen = np.frombuffer(other.buf, np.uint8, 48, offset=off).reshape(4, 4, 3)
            np.testing.assert_array_equal(seen, value(5))
            del seen
        finally:
            other.close()
        arena.release(np.array([off]))
        del arena
    finally:
        seg.close()
        seg.unlink()


SLAB = 64 << 10


def test_a_run_of_whole_slabs_evicts_unpinned_values_and_skips_pinned_ones():
    arena = Arena(8 * SLAB, slab_bytes=SLAB)
    space = arena.space("s", num_rows=1000)
    per_slab = SLAB // 1024
    offsets = [arena.put(space, r, np.full(1024, r % 251, np.uint8)) for r in range(8 * per_slab)]
    pinned = offsets[2 * per_slab]  # one value of slab 2 stays pinned
    arena.release(np.array([o for o in offsets if o != pinned], np.int64))
    run = arena.reserve_run(3 * SLAB - 1)  # three slabs, none of them slab 2
    assert run >= 3 * SLAB
    assert arena.stats().evictions == 3 * per_slab
    assert arena.reserve_run(5 * SLAB) == -1  # no five slabs apart from slab 2 and the run
    arena.buffer[run : run + 3 * SLAB] = 7  # the run is the caller's
    assert arena.view(pinned, (1024,)).tolist() == [(2 * per_slab) % 251] * 1024
    arena.discard(np.array([run], np.int64))
    assert arena.stats().pinned == 1
    assert arena.reserve_run(5 * SLAB) >= 3 * SLAB  # its slabs are free again


def test_a_run_waits_for_pins_to_drop_when_no_slabs_are_free_together():
    """Batches in flight pin values in every slab: a run waits for their release (bounded),
    then takes the slabs; with nothing released it gives up after its wait."""
    arena = Arena(4 * SLAB, slab_bytes=SLAB)
    space = arena.space("s", num_rows=1000)
    per_slab = SLAB // 1024
    offsets = np.array(
        [arena.put(space, r, np.zeros(1024, np.uint8)) for r in range(4 * per_slab)], np.int64
    )
    one_per_slab = offsets[::per_slab]  # one value of every slab stays pinned
    arena.release(np.setdiff1d(offsets, one_per_slab))
    assert arena.reserve_run(2 * SLAB, wait=0.05) == -1
    timer = threading.Timer(0.2, arena.release, (one_per_slab[:2],))  # slabs 0 and 1 free up
    timer.start()
    try:
        assert arena.reserve_run(2 * SLAB, wait=30) == 0
    finally:
        timer.join()
    assert arena.reserve_run(5 * SLAB, wait=30) == -1  # more slabs than there are: no wait


def _arena_with_history(seed: int) -> tuple[Arena, int, dict[int, int]]:
    """4 slabs of 16 slots; rows 0..39 stored (2.5 slabs), some held; scores from ``seed``."""
    rng = np.random.default_rng(seed)
    next_use = rng.choice([1.0, 5.0, 9.0, np.inf], 300)
    uses = rng.integers(0, 3, 300).astype(float)
    arena = Arena(64 * 64, slab_bytes=64 * 16, score=lambda sp, rows: (next_use[rows], uses[rows]))
    space = arena.space("s", num_rows=300, fixed=True)
    offsets = {r: arena.put(space, r, value(r)) for r in range(40)}
    for r in rng.permutation(40).tolist():  # recency in a random order
        if r % 7:  # rows 0, 7, 14... stay held
            arena.release(np.array([offsets[r]]))
    return arena, space, offsets


@pytest.mark.parametrize("seed", range(4))
def test_reserving_many_rows_takes_the_slots_one_at_a_time_would(seed):
    """One reserve of many rows ranks the candidates once; it takes the same slots in the
    same order, and evicts the same rows, as a reserve of one row at a time (a ranking per
    slot, as the arena did before)."""
    rows = np.arange(100, 160)  # 8 free slots, a free slab of 16, then 36 victims (of 34)
    bulk, space, _ = _arena_with_history(seed)
    single, _, _ = _arena_with_history(seed)
    with pytest.warns(CacheOvershootWarning):
        got, fresh = bulk.reserve(space, rows, (4, 4, 3))
    with pytest.warns(CacheOvershootWarning):
        one = [single.reserve(space, rows[i : i + 1], (4, 4, 3))[0][0] for i in range(rows.size)]
    assert got.tolist() == one
    assert fresh.tolist() == [o >= 0 for o in one]
    assert (got >= 0).sum() == 8 + 16 + 34  # every unheld row made room, the held ones stay
    everything = np.arange(300)
    assert bulk.stored(space, everything).tolist() == single.stored(space, everything).tolist()
    assert bulk.stats().evictions == single.stats().evictions == 34


def test_victims_kept_from_a_ranking_are_checked_again_before_eviction():
    """A ranking keeps the next best victims for the next reserves; one that is needed soon
    by then (its next use came near) is not evicted, and the rest go in their order."""
    next_use = np.full(1000, np.inf)
    uses = np.zeros(1000)
    arena = Arena(
        64 * 256, slab_bytes=64 * 256, score=lambda sp, rows: (next_use[rows], uses[rows])
    )
    space = arena.space("s", num_rows=1000, fixed=True)
    for r in range(256):  # full; row r is the r-th least recent
        arena.release(np.array([arena.put(space, r, value(r))]))
    next_use[:256] = np.arange(256)[::-1]  # row 0 is needed last: the best victim
    gone = []

    def take(rows):
        before = arena.stored(space, np.arange(256))
        offsets, _ = arena.reserve(space, np.asarray(rows), (4, 4, 3))
        arena.discard(offsets)  # free again: only the evictions matter here
        after = arena.stored(space, np.arange(256))
        gone.append(np.flatnonzero(before & ~after).tolist())

    take([900, 901])
    assert gone[-1] == [0, 1]
    next_use[2] = 1  # row 2, next in line, is needed soon now
    uses[3] = 5  # row 3: more uses, but its next use is still far: evicted as before
    take(list(range(902, 910)))  # 2 of them in the slots freed above, 6 evict
    assert gone[-1] == [3, 4, 5, 6, 7, 8]  # 2 stays
    assert arena.stored(space, np.array([2]))[0]
