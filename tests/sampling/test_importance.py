"""SHADE's rank-based scores and the probabilities drawn from them."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
from pyroaring import BitMap

from tabloader.catalog._errors import SamplingError
from tabloader.sampling._importance import (
    B0,
    FLATTEN,
    PRIOR,
    ROWS_MAX,
    S_MAX,
    ImportanceScores,
    floor,
)

IDS = np.array([3, 7, 10, 20, 31, 40], dtype=np.int64)


def hand_scores(losses: list[float]) -> list[float]:
    """SHADE's formula written out: log(#rows of the batch with a lower loss + 10)."""
    return [math.log(sum(other < mine for other in losses) + 10) for mine in losses]


def test_constants_are_shades():
    assert B0 == 10.0
    assert PRIOR == 1.0
    assert math.isclose(S_MAX, math.log(ROWS_MAX - 1 + 10))


def test_rank_scores_match_the_hand_computation():
    s = ImportanceScores(IDS)
    losses = [0.7, 0.2, 3.5, 1.1]
    s.report(np.array([40, 3, 10, 7]), np.array(losses, dtype=np.float32))
    want = dict(zip([40, 3, 10, 7], hand_scores(losses), strict=True))
    got = dict(zip(IDS.tolist(), s.scores.tolist(), strict=True))
    for row, score in want.items():
        assert got[row] == pytest.approx(score, rel=1e-12)
    assert got[20] == PRIOR
    assert got[31] == PRIOR
    # the absolute values, not only the formula: the lowest loss scores log(10)
    assert got[3] == pytest.approx(math.log(10))
    assert got[10] == pytest.approx(math.log(13))


def test_ties_share_the_lower_score_whatever_the_order():
    losses = [0.5, 0.5, 0.1, 0.5, 2.0]
    rows = np.array([3, 7, 10, 20, 31])
    a, b = ImportanceScores(IDS), ImportanceScores(IDS)
    a.report(rows, np.array(losses))
    rev = np.arange(rows.size)[::-1]
    b.report(rows[rev], np.array(losses)[rev])
    np.testing.assert_array_equal(a.scores, b.scores)
    # three tied rows: one row below them, so k = 1 for all three; the top row has k = 4
    assert a.scores[:2].tolist() == pytest.approx([math.log(11)] * 2)
    assert a.scores[3] == pytest.approx(math.log(11))
    assert a.scores[4] == pytest.approx(math.log(14))
    assert a.scores.tolist()[:5] == pytest.approx(hand_scores(losses))


def test_a_row_twice_in_one_batch_keeps_its_higher_score():
    s = ImportanceScores(IDS)
    s.report(np.array([7, 3, 7]), np.array([0.1, 0.5, 0.9]))
    assert s.scores[1] == pytest.approx(math.log(12))  # two rows below 0.9
    assert s.scores[0] == pytest.approx(math.log(11))


def test_a_later_report_replaces_the_score():
    s = ImportanceScores(IDS)
    s.report(np.array([3, 7]), np.array([9.0, 1.0]))
    assert s.scores[0] == pytest.approx(math.log(11))
    s.report(np.array([3, 10]), np.array([1.0, 9.0]))
    assert s.scores[0] == pytest.approx(math.log(10))
    assert s.scores[1] == pytest.approx(math.log(10))  # untouched by the second report


def test_probabilities_sum_to_one_respect_the_floor_and_follow_scores():
    rng = np.random.default_rng(3)
    ids = np.arange(0, 2000, 2, dtype=np.int64)
    s = ImportanceScores(ids)
    np.testing.assert_allclose(s.probabilities(), 1 / ids.size)  # all prior: uniform
    for _ in range(5):
        rows = rng.choice(ids, 256, replace=False)
        s.report(rows, rng.exponential(size=256))
    p = s.probabilities()
    assert p.shape == ids.shape
    assert p.dtype == np.float64
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-12)
    assert float(p.min()) >= floor(ids.size) * (1 - 1e-12)
    # proportional to score plus the flattening term, as documented
    want = s.scores + FLATTEN * s.scores.mean()
    np.testing.assert_allclose(p, want / want.sum(), rtol=1e-12)
    # a higher score means a higher probability
    order = np.argsort(s.scores, kind="stable")
    assert bool(np.all(np.diff(p[order]) >= -1e-18))


def test_the_floor_holds_at_the_worst_case():
    """One prior row among rows all at the highest possible score is the least likely row
    there can be; it sits just above the documented floor."""
    n = 1000
    s = ImportanceScores(np.arange(n, dtype=np.int64))
    s.scores[1:] = S_MAX
    p = s.probabilities()
    assert p[0] >= floor(n) * (1 - 1e-12)
    assert p[0] == pytest.approx(floor(n), rel=2e-3)  # tight: the floor is not loose
    assert 0.15 < floor(n) * n < 0.2


def test_state_round_trip_gives_identical_probabilities():
    rng = np.random.default_rng(5)
    s = ImportanceScores(np.arange(500, dtype=np.int64) * 3)
    s.report(s.ids[rng.choice(500, 64, replace=False)], rng.normal(size=64))
    r = ImportanceScores.from_state(s.state_dict())
    np.testing.assert_array_equal(r.ids, s.ids)
    np.testing.assert_array_equal(r.probabilities(), s.probabilities())
    # the restored object is independent of the original and keeps scoring
    r.report(np.array([0, 3]), np.array([1.0, 2.0]))
    assert r.scores[0] != s.scores[0] or r.scores[1] != s.scores[1]


def _state(ids, ranks) -> dict:
    return {
        "version": 1,
        "ids": BitMap(ids).serialize(),
        "ranks": zlib.compress(np.asarray(ranks, np.int32).tobytes()),
    }


def test_state_is_compact():
    """The state of a million-row job fits a service message many times over."""
    s = ImportanceScores(np.arange(1_000_000, dtype=np.int64))
    rng = np.random.default_rng(2)
    for _ in range(4):
        s.report(rng.choice(1_000_000, 4096, replace=False), rng.random(4096))
    state = s.state_dict()
    assert len(state["ids"]) + len(state["ranks"]) < 1_500_000  # scores alone: 8 MB
    np.testing.assert_array_equal(
        ImportanceScores.from_state(state).probabilities(), s.probabilities()
    )


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({}, "not from ImportanceScores.state_dict"),
        ({**_state([1, 2], [0, 0]), "ranks": b"junk"}, "not from ImportanceScores.state_dict"),
        ({**_state([1, 2], [0, 0]), "version": 99}, "version 99"),
        (_state([1, 2], [0, 0, 0]), "mismatched ids and ranks"),
        (_state([1, 2], [0, ROWS_MAX + 1]), "out of"),
        (_state([1, 2], [-1, 0]), "out of"),
    ],
)
def test_bad_state_is_refused(state, match):
    with pytest.raises(SamplingError, match=match):
        ImportanceScores.from_state(state)


@pytest.mark.parametrize(
    ("ids", "losses", "match"),
    [
        ([3, 99], [0.1, 0.2], r"rows \[99\] that are not rows of this job"),
        ([3, -1], [0.1, 0.2], r"rows \[-1\] that are not rows of this job"),
        ([3, 41], [0.1, 0.2], r"rows \[41\] that are not rows of this job"),
        ([3, 7], [0.1, float("nan")], r"non-finite losses .* rows \[7\]"),
        ([3, 7], [float("inf"), 0.2], r"non-finite losses .* rows \[3\]"),
        ([3, 7], [0.1], "2 ids and 1 losses"),
        ([[3, 7]], [[0.1, 0.2]], "1-D ids and losses"),
        ([3, 7], [[0.1, 0.2]], "1-D ids and losses"),
        ([3.0, 7.0], [0.1, 0.2], "ids must be integers"),
        ([3, 7], ["a", "b"], "losses must be real numbers"),
        ([3, 7], [1 + 1j, 2], "losses must be real numbers"),
        (np.array([3, 2**64 - 1], dtype=np.uint64), [0.1, 0.2], "above"),
    ],
)
def test_bad_reports_raise_and_score_nothing(ids, losses, match):
    s = ImportanceScores(IDS)
    with pytest.raises(SamplingError, match=match):
        s.report(np.asarray(ids), np.asarray(losses))
    assert (s.scores == PRIOR).all()


def test_too_many_rows_in_one_report():
    s = ImportanceScores(np.arange(ROWS_MAX + 1, dtype=np.int64))
    ids = np.arange(ROWS_MAX + 1, dtype=np.int64)
    with pytest.raises(SamplingError, match=f"more than {ROWS_MAX}"):
        s.report(ids, np.zeros(ROWS_MAX + 1))
    s.report(ids[:ROWS_MAX], np.arange(ROWS_MAX, dtype=np.float64))  # the bound itself is fine
    assert s.scores[ROWS_MAX - 1] == pytest.approx(S_MAX)


@pytest.mark.parametrize(
    "ids",
    [np.array([], dtype=np.int64), np.array([3, 1]), np.array([1, 1]), np.ones((2, 2), int)],
)
def test_bad_job_ids_are_refused(ids):
    with pytest.raises(SamplingError, match="ImportanceScores needs"):
        ImportanceScores(ids)


def test_an_empty_report_is_a_no_op():
    s = ImportanceScores(IDS)
    s.report(np.array([], dtype=np.int64), np.array([], dtype=np.float32))
    assert (s.scores == PRIOR).all()
