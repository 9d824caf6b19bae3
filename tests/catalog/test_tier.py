"""The storage tier on its own: bounded, ranked, checked when read back, kept across opens."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tabloader.catalog._errors import StorageError
from tabloader.catalog.storage._tier import INDEX_FILE, TAIL, StorageTier, lru_ranks


def blob(i: int, n: int = 1000) -> bytes:
    return bytes([i % 251]) * n


def test_entries_are_kept_within_capacity_least_recently_used_first_out(tmp_path):
    tier = StorageTier(tmp_path / "t", 3500)
    for i in range(3):
        tier.offer_key(("p", i), blob(i))
    assert tier.get_key(("p", 0)) == blob(0)  # 0 is now the most recently used
    tier.offer_key(("p", 3), blob(3))  # 1 goes (3 + 1 would pass 3500)
    assert tier.get_key(("p", 1)) is None
    assert [tier.get_key(("p", i)) == blob(i) for i in (0, 2, 3)] == [True] * 3
    assert tier.used == 3000 <= tier.capacity
    assert tier.counters.evicted == 1
    tier.close()


def test_a_batch_that_ranks_below_everything_it_would_displace_is_not_admitted(tmp_path):
    keep = {("p", 0), ("p", 1)}  # next used soon: ranked low (out last)

    def rank(keys, ages):
        return np.array([0.0 if k in keep else 1e9 for k in keys])

    tier = StorageTier(tmp_path / "t", 2000, rank=rank)
    tier.offer_key(("p", 0), blob(0))
    tier.offer_key(("p", 1), blob(1))
    tier.offer_key(("p", 2), blob(2))  # no next use: not admitted
    assert tier.get_key(("p", 2)) is None
    assert tier.counters.rejected == 1
    keep.add(("p", 3))
    keep.discard(("p", 0))
    tier.victims_at = -1e9  # (ranks are kept RERANK_S seconds)
    tier.offer_key(("p", 3), blob(3))  # used sooner than 0 now: 0 goes
    assert tier.get_key(("p", 0)) is None
    assert tier.get_key(("p", 3)) == blob(3)
    tier.close()


def test_the_index_keeps_entries_across_opens_and_a_crash_leaves_no_orphans(tmp_path):
    d = tmp_path / "t"
    tier = StorageTier(d, 10_000)
    tier.offer_key(("data/x/part-a.arrow", 0), blob(0))
    tier.offer_key(("data/x/part-a.arrow", TAIL), blob(9, 64))
    tier.close()
    assert json.loads((d / INDEX_FILE).read_text())["clean"] is True
    tier = StorageTier(d, 10_000)
    assert tier.get_key(("data/x/part-a.arrow", 0)) == blob(0)
    assert tier.get_key(("data/x/part-a.arrow", TAIL)) == blob(9, 64)
    tier.offer_key(("data/x/part-a.arrow", 1), blob(1))  # written, never indexed: a crash
    orphan = tier.path_of(("data/x/part-a.arrow", 1))
    assert orphan.exists()
    tier.closed = True  # (the process dies: no clean close)
    os.close(tier.lockfd)
    tier = StorageTier(d, 10_000)
    assert not orphan.exists()
    assert tier.get_key(("data/x/part-a.arrow", 0)) == blob(0)
    assert tier.entries == 2
    tier.close()


def test_an_entry_that_fails_its_check_is_dropped(tmp_path):
    tier = StorageTier(tmp_path / "t", 10_000)
    tier.offer_key(("p", 0), blob(0))
    path = tier.path_of(("p", 0))
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert tier.get_key(("p", 0)) is None
    assert not path.exists()
    assert tier.entries == 0
    assert tier.used == 0
    assert tier.counters.dropped == 1
    tier.offer_key(("p", 1), blob(1))
    tier.path_of(("p", 1)).unlink()  # gone under it
    assert tier.get_key(("p", 1)) is None
    assert tier.counters.dropped == 2
    tier.close()


def test_one_owner_at_a_time(tmp_path):
    tier = StorageTier(tmp_path / "t", 1000)
    with pytest.raises(StorageError, match=r"is in use by another process"):
        StorageTier(tmp_path / "t", 1000)  # (flock: another open of the lock file)
    tier.close()
    StorageTier(tmp_path / "t", 1000).close()  # free again


def test_a_tier_that_cannot_be_made_says_how_to_turn_it_off(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match=r"storage-cache-bytes 0"):
        StorageTier(tmp_path / "file" / "t", 1000)


def test_a_smaller_capacity_at_open_drops_entries_until_it_fits(tmp_path):
    tier = StorageTier(tmp_path / "t", 5000)
    for i in range(5):
        tier.offer_key(("p", i), blob(i))
    tier.close()
    tier = StorageTier(tmp_path / "t", 2000)
    assert tier.used <= 2000
    assert tier.entries == 2
    tier.close()


def test_lru_ranks_keep_tails_last():
    ranks = lru_ranks([("p", 0), ("p", TAIL), ("p", 1)], np.array([5.0, 9.0, 1.0]))
    assert ranks.tolist() == [5.0, -1.0, 1.0]
