"""The what-if model of ``tabloader analyze``, on made-up rates: each stage binds when it should,
and a prediction moves as the model says when one thing changes."""

from __future__ import annotations

import math

import pytest

from tabloader.analyze import Rates, WhatIf, parse_what_if, predict
from tabloader.analyze._model import EXAMPLE, WhatIfError, available_cores, cache_rows

STEP = 0.05  # 20 batches of 50 rows: the loop alone takes 1 s an epoch


def rates(**changes: object) -> Rates:
    """1000 rows in batches of 50; a decode takes 2 ms of CPU; 8 cores of the loader's own."""
    return Rates(**{**EXAMPLE, "cores": 8, "workers": 8, **FREE, **changes})


FREE = {"got_one": 1.0, "threads_one": 1.0, "got_cores": 8.0, "threads_cores": 8.0}
"""Every busy thread had a core in the analysis (a machine of the loader's own)."""


def test_doubling_the_workers_halves_a_prep_bound_epoch():
    slow = predict(rates(), WhatIf(workers=1, step=0.0))
    fast = predict(rates(), WhatIf(workers=2, step=0.0))
    assert slow.bound == fast.bound == ("decode",)
    assert math.isclose(slow.epoch_s, 2.0)  # 1000 rows x 2 ms
    assert math.isclose(fast.epoch_s, slow.epoch_s / 2)
    assert slow.stall_fraction == fast.stall_fraction == 1.0  # no step: it only waits


def test_the_stall_is_the_prep_time_beyond_the_loop():
    """Prep-bound: 4 s of decoding with 1 worker, 2 with 2, against 1 s of steps."""
    one = predict(rates(decode_cpu_s=0.004), WhatIf(workers=1, step=STEP))
    two = predict(rates(decode_cpu_s=0.004), WhatIf(workers=2, step=STEP))
    assert (one.epoch_s, two.epoch_s) == pytest.approx((4.0, 2.0))
    assert one.stall_fraction == pytest.approx(3 / 4)  # waited 3 s of 4
    assert two.stall_fraction == pytest.approx(1 / 2)  # the prep stall: 3 s -> 1 s
    four = predict(rates(decode_cpu_s=0.004), WhatIf(workers=4, step=STEP))
    assert four.bound == ("loop",)
    assert four.epoch_s == pytest.approx(1.0)
    assert four.stall_fraction == pytest.approx(0.0)


def test_workers_beyond_the_cores_the_loader_gets_do_not_help():
    """A busy 2-core machine left the loader 0.9 of a core with one decode process, 1.2 of 2
    with two: 90% and 60% of what it would have had alone."""
    r = rates(cores=2, workers=2, got_one=0.9, threads_one=1.0, got_cores=1.2, threads_cores=2.0)
    assert [round(available_cores(r, w, w), 2) for w in (1, 2, 8)] == [0.9, 1.2, 1.2]
    two, eight = (predict(r, WhatIf(workers=w, step=0.0)) for w in (2, 8))
    assert two.epoch_s == pytest.approx(eight.epoch_s)
    assert two.epoch_s == pytest.approx(2.0 / 1.2)
    own = predict(r, WhatIf(workers=8, cores=8, step=0.0))  # a machine of its own
    assert own.epoch_s == pytest.approx(2.0 / 8)


def test_more_busy_threads_get_more_of_a_busy_machine():
    """Three jobs' deliveries make the service and the clients busy beside one decoder: the
    loader gets the part of a core the analysis found for each of its busy threads."""
    r = rates(cores=2, workers=2, got_one=0.5, threads_one=1.0, got_cores=0.8, threads_cores=2)
    one = predict(r, WhatIf(workers=1, step=0.0))
    assert one.epoch_s == pytest.approx(2.0 / 0.5)  # 1000 rows x 2 ms, on half a core
    busy = rates(**{**r.__dict__, "service_cpu_s": 0.001})  # 1 ms a delivery in the service
    three = predict(busy, WhatIf(workers=1, jobs=3, step=0.0))
    threads = (1000 * 0.002 + 3000 * 0.001) / (1000 * 0.002)  # 2.5 busy threads
    assert three.epoch_s == pytest.approx(5.0 / (0.5 * min(2, threads)))


def test_a_cache_that_holds_the_rows_leaves_later_epochs_to_the_loop():
    big = predict(rates(), WhatIf(workers=1, step=STEP), epochs=3)
    assert big.epochs_s == pytest.approx((2.0, 1.0, 1.0))
    assert big.bound == ("decode", "loop", "loop")
    assert big.decodes_per_row == pytest.approx(1 / 3)
    assert big.stall_fraction == pytest.approx(1 - 3.0 / 4.0)


def test_a_small_cache_decodes_again_what_it_could_not_keep():
    from tabloader.engine._arena.arena import values_that_fit

    small = 300 * 12288  # 300 rows' values, of which 4 batches of 50 pinned in flight
    r = rates()
    kept = cache_rows(r, small, jobs=1, workers=1)
    assert kept == values_that_fit(small, 12288) - 4 * 50  # slabs round the 300 down
    assert 50 <= kept <= 100
    assert cache_rows(r, small, jobs=2, workers=1) == max(0, kept - 4 * 50)
    p = predict(r, WhatIf(workers=1, step=STEP, cache_bytes=small), epochs=2)
    assert p.epochs_s[1] == pytest.approx((1000 - kept) * 0.002)
    assert p.decodes_per_row == pytest.approx((1000 + 1000 - kept) / 2000)
    nothing = predict(r, WhatIf(workers=1, step=STEP, cache_bytes=1 << 20), epochs=2)
    assert nothing.epochs_s[1] == pytest.approx(2.0)  # every row decoded again


def test_jobs_on_the_same_rows_share_decodes_and_pay_their_deliveries():
    r = rates(service_cpu_s=0.001, cores=1, workers=1)  # one core: the CPU term adds up
    one = predict(r, WhatIf(workers=1, step=0.0))
    three = predict(r, WhatIf(workers=1, jobs=3, step=0.0))
    assert one.decodes_per_row == pytest.approx(1.0)
    assert three.decodes_per_row == pytest.approx(1 / 3)
    assert one.epoch_s == pytest.approx(1000 * 0.003)
    assert three.epoch_s == pytest.approx(1000 * 0.002 + 3000 * 0.001)
    assert three.bound == ("cpu",)


def test_registered_jobs_share_only_their_overlap():
    """The other job has 1000 rows, 500 of them ours: the union is 1500 rows."""
    r = rates(overlaps=((1000, 1500),))
    p = predict(r, WhatIf(workers=1, jobs=2, step=0.0))
    assert p.decodes_per_row == pytest.approx(1500 / 2000)
    assert p.epoch_s == pytest.approx(1500 * 0.002)
    copies = predict(r, WhatIf(workers=1, jobs=3, step=0.0))  # a copy of ours after it
    assert copies.decodes_per_row == pytest.approx(1500 / 3000)


def test_slow_storage_binds_by_bandwidth_and_latency():
    r = rates(storage_s=0.001, stored_bytes=1e5)
    fast = predict(r, WhatIf(workers=1, step=0.0, storage_mbps=1000))
    assert fast.bound == ("decode",)
    assert fast.epoch_s == pytest.approx(1000 * (0.002 + 0.001))  # each read waits
    slow = predict(r, WhatIf(workers=1, step=0.0, storage_mbps=10))
    assert slow.bound == ("storage",)
    assert slow.epoch_s == pytest.approx(1000 * 1e5 / 10e6)


def test_the_first_epoch_pays_the_first_batch_and_json_says_everything():
    p = predict(rates(first_s=0.5), WhatIf(workers=4, step=STEP), epochs=2)
    assert p.epochs_s == pytest.approx((1.5, 1.0))
    out = p.to_json()
    assert out["what_if"] == {"workers": 4, "step": STEP}
    assert set(out) >= {"epoch_s", "stall_fraction", "epochs_s", "bound", "decodes_per_row"}


def test_what_ifs_parse_with_units_and_refuse_what_is_not_one():
    w = parse_what_if("workers=4, cache_bytes=2GiB,jobs=3,storage_mbps=200.5,cores=8,step=0")
    assert w == WhatIf(
        workers=4, cache_bytes=2 << 30, jobs=3, storage_mbps=200.5, cores=8.0, step=0.0
    )
    with pytest.raises(WhatIfError, match=r"'threads=2' is not KEY=VALUE with a KEY of workers"):
        parse_what_if("threads=2")
    with pytest.raises(WhatIfError, match="workers is given twice"):
        parse_what_if("workers=1,workers=2")
    with pytest.raises(WhatIfError, match=r"workers='two' is not a int"):
        parse_what_if("workers=two")
    with pytest.raises(WhatIfError, match=r"jobs=0 must be at least 1"):
        parse_what_if("jobs=0")
    with pytest.raises(WhatIfError, match=r"cache_bytes='lots' is not a int"):
        parse_what_if("cache_bytes=lots")
    with pytest.raises(WhatIfError, match="predict at least 1 epoch"):
        predict(rates(), epochs=0)
