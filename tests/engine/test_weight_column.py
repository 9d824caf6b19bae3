"""A weighted job's batches carry ``_weight`` (float32 ``1 / (N p_row)``) after ``_id``, in
process and through the service's wire encoding; a plain job's batches have none."""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pyarrow as pa
import pytest
from pyroaring import BitMap

from tabloader.catalog._errors import LoaderError
from tabloader.catalog._options import JobSpec
from tabloader.engine import Loader
from tabloader.engine._deliver import collate
from tabloader.engine._deliver.handoff import WEIGHT_COLUMN, HandedBatch, Staging
from tabloader.engine._opening import state_from_wire, state_to_wire
from tabloader.engine._prepare.work import Plan
from tabloader.engine._queue.dealer import Dealer
from tabloader.engine._queue.jobqueue import JobQueue
from tabloader.engine._queue.jobs import JobState, OnError
from tabloader.engine._queue.sources import Sampled
from tabloader.sampling import DependentSampler


class Kept:
    pins = False

    def receive(self, work):
        return None


def dealt(name: str, sampler: DependentSampler, n: int) -> tuple[JobState, Dealer, list]:
    state = JobState(
        name,
        BitMap(range(n)),
        Plan(columns=(), gathered=(), prepared=(), augment={}, receiver=Kept()),
        batch_size=4,
        prefetch=8,
        queue=JobQueue(horizon=n),
        on_error=OnError.RAISE,
        source=Sampled(),
        world_size=1,
        spec=JobSpec({"batch_size": 4}),
    )
    for r in range(state.world_size):
        state.open_rank(r, threading.Lock())
    q = state.queue
    state.source.sampler = sampler
    q.left = q.first_rows = n
    rows = sampler.sample_many([name], n)[name]
    q.append(rows, np.arange(n, dtype=np.int64))
    q.left = 0
    out: list = []
    dealer = Dealer(state, pop=q.pop, submit=out.append)
    dealer.deal()
    return state, dealer, out


def test_a_weighted_jobs_batches_carry_its_weights_in_process_and_on_the_wire():
    w = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 1.0, 0.0])
    s = DependentSampler(seed=0)
    s.add_job("w", BitMap(range(8)), weights=w)
    s.add_job("p", BitMap(range(8)))
    _, _, works = dealt("w", s, 8)
    assert len(works) == 2  # 8 draws (with replacement), row 7 never
    q = w / w.sum()
    for work in works:
        batch = collate._batch(work, None, {})
        names = [c.name for c in batch.columns]
        assert names == ["_id", WEIGHT_COLUMN]
        local = batch.copy_out(np.zeros(0, np.uint8), None)
        assert local[WEIGHT_COLUMN].dtype == np.float32
        assert np.allclose(local[WEIGHT_COLUMN], 1 / (7 * q[local["_id"]]))  # 7 rows weigh > 0
        staging = Staging()
        wire = batch.to_wire(staging)
        memory = np.zeros(staging.used + 128, np.uint8)
        staging.write(memory[64:], 64)
        wire["base"] = 64
        remote = HandedBatch.from_wire(wire, memory).copy_out(memory, None)
        assert remote[WEIGHT_COLUMN].tolist() == local[WEIGHT_COLUMN].tolist()
        kept = collate._batch(work, np.array([1, 3]), {}).copy_out(memory, None)
        assert kept[WEIGHT_COLUMN].tolist() == local[WEIGHT_COLUMN][[1, 3]].tolist()
    _, _, plain = dealt("p", s, 8)
    assert [c.name for c in collate._batch(plain[0], None, {}).columns] == ["_id"]


def test_a_weighted_job_with_replacement_saves_its_draws_left():
    s = DependentSampler(seed=0)
    s.add_job("w", BitMap(range(8)), weights=np.arange(1.0, 9.0))
    state, dealer, _ = dealt("w", s, 8)  # 8 draws, maybe repeats, in 2 batches
    assert BitMap.deserialize(dealer.state(state.ranks[0], s)["remaining"]) == BitMap(range(8))
    state.ranks[0].taken = 1
    saved = dealer.state(state.ranks[0], s)
    remaining = BitMap.deserialize(saved["remaining"])
    assert len(remaining) == 4  # draws left, whichever rows
    resumed = DependentSampler(seed=1)
    resumed.add_job("w", BitMap(range(8)), weights=np.arange(1.0, 9.0), remaining=remaining)
    resumed.sample_many(["w"], 4)
    assert resumed.epoch("w") == 0
    resumed.sample_many(["w"], 1)
    assert resumed.epoch("w") == 1


# -- a weighted job resumes with the draws its run would have made -------------------------------
@pytest.fixture
def weighted(cat):
    """A table of 50 rows and a job of each kind of weighted draws on it."""
    cat.import_arrow("t", pa.table({"x": np.arange(50), "w": np.arange(50) % 5 + 1.0}))
    for job, options in DRAWS.items():
        cat.sql(f"REGISTER JOB {job} SELECT x FROM t WITH ({options})")
    return cat


DRAWS = {
    "imp": "importance = 'loss'",
    "imp_once": "importance = 'loss', replacement = false",
    "w": "weight = 'w'",
    "w_once": "weight = 'w', replacement = false",
}


def _run(cat, job: str, batches: int, *, state=None, save_after: int | None = None):
    """``batches`` batches of ``job`` in a loader of their own (ids and ``_weight``), the
    first ``save_after`` reported (losses from the ids) and the state after them."""
    out, saved = [], None
    with (
        Loader(cat, cache_bytes=1 << 20, workers=2) as loader,
        loader.open(job, batch_size=4, state=state) as stream,
    ):
        for i in range(batches):
            batch = stream.next_batch()
            out.append((batch["_id"].tolist(), batch["_weight"].tolist()))
            if save_after is not None and i < save_after and job.startswith("imp"):
                stream.report(batch["_id"], batch["_id"] % 7 + 0.5)
            if i + 1 == save_after:  # as it travels to the service and back
                saved = state_from_wire(state_to_wire(stream.state_dict()))
    return out, saved


@pytest.mark.parametrize("job", list(DRAWS))
@pytest.mark.parametrize("after", [5, 13, 20])  # mid-epoch 0, the first of epoch 1, mid-epoch 1
def test_a_weighted_job_resumes_with_the_draws_its_run_would_have_made(weighted, job, after):
    """Run ``after`` batches (an importance job reporting each), save, go on; a new loader
    that opens the job from that state gets the same rows and ``_weight``s, across the next
    epoch (it drew the rest of its epoch afresh: other rows). Reports after the save would
    change the scores of the next epoch by when each run's sampler freezes them; none here."""
    run, saved = _run(weighted, job, after + 16, save_after=after)
    assert saved is not None
    assert "draws" in saved
    resumed, _ = _run(weighted, job, 16, state=saved)
    assert resumed == run[after:]


def test_draws_in_a_state_that_no_run_made_are_refused(weighted):
    _, saved = _run(weighted, "imp", 6, save_after=5)
    draws = saved["draws"]
    ids = np.frombuffer(draws["rows"], np.uint32)
    forged = {
        r"the draws' stream is": {**draws, "round": -1},
        r"the draws' epochs .* and their rows disagree": {**draws, "epochs": [[3, ids.size]]},
        r"the draws are not rows of job 'imp'": {**draws, "rows": (ids + 1000).tobytes()},
        r"the draws' frozen ranks are not 50 ranks": {
            **draws,
            "frozen": [[0, zlib.compress(bytes(4 * (1 << 20)))]],
        },
    }
    with Loader(weighted, cache_bytes=1 << 20, workers=2) as loader:
        for message, bad in forged.items():
            with pytest.raises(LoaderError, match=message):
                loader.open("imp", state={**saved, "draws": bad})


def test_an_importance_job_of_images_resumes_with_its_draws(images):
    """A job that prepares images draws in the dependent sampler, whose weighted jobs share
    one stream of uniforms: alone there, it resumes with the same draws too."""
    images.sql("REGISTER JOB imp SELECT image FROM imgs WITH (image_size = 8, importance = 'loss')")
    run, saved = _run(images, "imp", 24, save_after=9)
    resumed, _ = _run(images, "imp", 15, state=saved)
    assert resumed == run[9:]
