"""Weighted jobs: each draws exactly from its own distribution, coupled to a plain job's draws.

A *weighted* job has a distribution ``q`` over its rows: static weights given at ``add_job``, or
an importance job's :class:`~tabloader.sampling._importance.ImportanceScores`, frozen at each
epoch's start. An epoch is either ``len(ids)`` i.i.d. draws from ``q`` (``replacement``) or an
order drawn by weight (successive sampling: each draw from ``q`` restricted to the rows not drawn
yet this epoch, renormalised; rows of weight 0 come last, in uniform order), every row once.

Each round a weighted job draws once, maximally coupled to a *leader* (:class:`Lead`: a plain
job of the same round, whose draw ``x`` is uniform over its round-start set ``R``, ``p = 1/|R|``
on ``R``); the construction and its proof are in :mod:`tabloader.sampling._dependent`.

The uniforms of a round are a fixed block of ``BLOCK`` from the weighted jobs' own stream
(``Uniforms``: the plain jobs' stream is never touched, so plain jobs draw exactly what they
would without weighted jobs), shared by every weighted job of the round (common random numbers):
``u[0]`` decides whether to keep the leader's row, ``(u[1 + 2k], u[2 + 2k])`` is residual
attempt ``k``. A round that needs more than ``K`` attempts reads a stream of its own, keyed by
the round's number (:meth:`WeightedJobs.fallback`), then draws the residual explicitly: so
``sample_many(n)`` is ``n`` calls of ``sample`` and a resume is exact.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from pyroaring import BitMap

from tabloader.catalog._bitmaps import bitmap_from_array, bitmap_to_array
from tabloader.catalog._errors import SamplingError
from tabloader.sampling._base import Uniforms
from tabloader.sampling._states import Drawn, WeightedState

if TYPE_CHECKING:
    from tabloader.sampling._importance import ImportanceScores

K = 16  # residual attempts per round in the round's block of uniforms
BLOCK = 1 + 2 * K  # uniforms per round
KEEP_EPOCHS = 64  # past epochs' distributions kept for ``row_weights`` (a queue may span several)
FROZEN_EPOCHS = 2  # an importance job keeps the ranks its last epochs froze (``Drawn.frozen``)
FALLBACK_TRIES = 256  # more attempts (the round's own stream) before the explicit residual

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


def check_weights(name: str, n: int, weights: Any) -> F64:
    """``weights`` as float64, one per row of the job (``n``), checked.

    Raises:
        SamplingError: not one finite non-negative number per row, or all zero.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size != n:
        raise SamplingError(
            f"weights of job {name!r} have shape {w.shape}, not ({n},); pass one weight per row "
            "of the job, aligned with its ids in ascending order."
        )
    bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
    if bad.size:
        raise SamplingError(
            f"weights of job {name!r} must be finite and >= 0; positions {bad[:5].tolist()} are "
            f"{w[bad[:5]].tolist()}: fix the weight expression."
        )
    if not w.any():
        raise SamplingError(
            f"weights of job {name!r} are all zero; give at least one row a positive weight."
        )
    return w


def _distribution(w: F64) -> F64:
    """Weights ``w`` (checked: ``check_weights``) as probabilities, scaled by their maximum
    before they are summed: the sum of 600 weights of 1e306 overflows float64 (to inf, and
    ``w / inf`` is all 0s: a job drawn in uniform order, or failing with an ``IndexError``);
    scaled, it is at most ``len(w)``."""
    scaled = w / w.max()
    return np.asarray(scaled / scaled.sum(), dtype=np.float64)


class SumTree:
    """Row weights in a complete binary tree of sums: draw a row by weight and remove it, each
    in O(log n). A parent is always recomputed as the sum of its two children (never updated by
    subtraction), so a subtree whose rows are all gone sums to exactly 0 and is never entered.

    The tree is one float64 array (node ``k``'s children at ``2k`` and ``2k + 1``, the
    ``size`` leaves from ``size``, padded to a power of two): 8 bytes a node, 256 MiB for 10M
    rows. As a Python list of floats (a pointer and a float object a node, 32 bytes) it was 1 GiB,
    and a 10M-row job held 1.4 GiB (``add_job`` 9 s, 42 us a draw against 0.6 s and 16 us now:
    the walks no longer chase pointers). The walks read and write it through a ``memoryview``
    (Python floats, as a list gave; numpy's scalar indexing is twice as slow) and sum in the
    same order as before, so the same seed draws the same rows.
    """

    __slots__ = ("size", "t", "v")

    def __init__(self, w: F64) -> None:
        size = 1 << max(0, len(w) - 1).bit_length()
        t = np.zeros(2 * size)
        t[size : size + len(w)] = w
        s = size
        while s > 1:
            h = s // 2
            t[h:s] = t[s : 2 * s : 2] + t[s + 1 : 2 * s : 2]
            s = h
        self.size = size
        self.t: F64 = t
        self.v = t.data.cast("B").cast("d")  # the walks' scalar access: Python floats

    def total(self) -> float:
        return float(self.v[1])

    def leaf(self, i: int) -> float:
        return float(self.v[self.size + i])

    def leaves(self, n: int) -> F64:
        """The first ``n`` leaves (a view: :meth:`set` changes it)."""
        return self.t[self.size : self.size + n]

    def find(self, x: float) -> int:
        """The row whose cumulative span holds ``x`` (``0 <= x < total``); never a row of
        weight 0, even when ``x`` rounds to the total."""
        t, i, size = self.v, 1, self.size
        while i < size:
            i <<= 1
            left = t[i]
            if x >= left and t[i + 1] > 0:
                x -= left
                i += 1
        return i - size

    def set(self, i: int, v: float) -> None:
        t = self.v
        i += self.size
        t[i] = v
        i >>= 1
        while i:
            t[i] = t[2 * i] + t[2 * i + 1]
            i >>= 1


class Lead:
    """A plain job's rows of one call of ``n`` rounds, as a coupling partner: its round-start
    set's size per round, and whether a row was in that set.

    Args:
        rows: its row of each round.
        first: ``|R|`` before round 0 (its epoch restarts when it runs out: ``n_ids`` again).
        n_ids: the job's rows.
        still: whether rows are in its remaining set after the call (vectorised).
        still1: the same for one row (the sequential draws ask row by row).
    """

    def __init__(
        self,
        rows: I64,
        first: int,
        n_ids: int,
        still: Callable[[I64], Any],
        still1: Callable[[int], bool],
    ) -> None:
        t = np.arange(rows.size, dtype=np.int64)
        after = t >= first
        self.seg = np.where(after, 1 + (t - first) // n_ids, 0)  # epoch of the call, per round
        self.size = np.where(after, n_ids - (t - first) % n_ids, first - t)
        key = self.seg << 32 | rows
        order = np.argsort(key, kind="stable")
        self.keys, self.at = key[order], order
        self.last = int(self.seg[-1]) if rows.size else 0
        self.rows, self.still, self.still1 = rows, still, still1
        self._drawn: dict[tuple[int, int], int] | None = None

    def member(self, t: I64, y: I64) -> npt.NDArray[np.bool_]:
        """Whether row ``y[i]`` was in the set the job drew from in round ``t[i]``: drawn by it
        in that epoch segment at round ``>= t``, or never drawn in it and still remaining after
        the call (only the call's last segment has rows left)."""
        seg = self.seg[t]
        k = seg << 32 | y
        i = np.minimum(np.searchsorted(self.keys, k), self.keys.size - 1)
        found = self.keys[i] == k
        out = found & (self.at[i] >= t)
        rest = ~found & (seg == self.last)
        if rest.any():
            out[rest] = self.still(y[rest])
        return np.asarray(out, dtype=bool)

    def member1(self, t: int, y: int) -> bool:
        """:meth:`member` of one row (the sequential draws' path)."""
        if self._drawn is None:
            keys = zip(self.seg.tolist(), self.rows.tolist(), strict=True)
            self._drawn = {key: t for t, key in enumerate(keys)}
        seg = int(self.seg[t])
        at = self._drawn.get((seg, y))
        if at is not None:
            return at >= t
        return seg == self.last and self.still1(y)


@dataclass
class WeightedJob:
    """One weighted job: its rows, its distribution and where it is in its epoch."""

    seq: int
    ids: BitMap
    id_arr: I64
    weights: F64 | None  # static weights; None: importance
    scores: ImportanceScores | None
    replacement: bool
    epoch: int = 0
    left: int = 0  # draws left in the epoch
    q: F64 = field(default_factory=lambda: np.empty(0))  # the epoch's distribution
    cum: F64 = field(default_factory=lambda: np.empty(0))  # with replacement: cumulative q
    top: int = 0  # with replacement: the last row of positive q
    live: npt.NDArray[np.bool_] | None = None  # without: rows not drawn yet this epoch
    tree: SumTree | None = None  # without: the live rows' q (1 each once only 0s are left)
    past: dict[int, F64] = field(default_factory=dict)  # epoch -> q, for ``row_weights``
    overlaps: dict[int, float] = field(default_factory=dict)  # leader seq -> estimate
    # an importance job's: epoch -> the scores' ranks its q was frozen from (the last few),
    # and a resumed job's, for the epochs it begins (``Drawn.frozen``)
    frozen: dict[int, npt.NDArray[np.int32]] = field(default_factory=dict)
    preset: dict[int, npt.NDArray[np.int32]] = field(default_factory=dict)

    def begin(self, rest: BitMap | None = None) -> None:
        """Start epoch ``epoch``: freeze ``q``; ``rest``: resume with those rows left (without
        replacement) or ``len(rest)`` draws left (with)."""
        if self.scores is not None:
            ranks = self.preset.pop(self.epoch, None)
            if ranks is None:
                ranks = self.scores.ranks.copy()
            self.frozen = {e: r for e, r in self.frozen.items() if e > self.epoch - FROZEN_EPOCHS}
            self.frozen[self.epoch] = ranks
            q = np.asarray(self.scores.probabilities(ranks), dtype=np.float64)
        else:
            assert self.weights is not None
            q = _distribution(self.weights)
        self.q = q
        self.past[self.epoch] = q
        for e in [e for e in self.past if e < self.epoch - KEEP_EPOCHS]:
            del self.past[e]
        self.overlaps.clear()
        n = self.id_arr.size
        if self.replacement:
            self.cum = np.cumsum(q)
            self.top = int(np.flatnonzero(q > 0)[-1])
            self.left = n if rest is None else len(rest)
            return
        live = np.ones(n, dtype=bool)
        if rest is not None:
            live = np.isin(self.id_arr, bitmap_to_array(rest).astype(np.int64))
        self.set_live(live)

    def set_live(self, live: npt.NDArray[np.bool_]) -> None:
        self.live = live
        self.left = int(live.sum())
        self.tree = SumTree(np.where(live, self.q, 0.0))
        if self.tree.total() == 0 and self.left:
            self.tree = SumTree(live.astype(np.float64))

    def advance(self, draws: int) -> None:
        """``draws`` draws of static weights with replacement, across epochs (the same ``q``
        each: what ``restart`` at each epoch's end would leave)."""
        over = draws - self.left
        if over <= 0:
            self.left -= draws
            return
        n = self.id_arr.size
        epochs = -(-over // n)
        for e in range(self.epoch + 1, self.epoch + epochs + 1):
            self.past[e] = self.q
        self.past = {e: q for e, q in self.past.items() if e >= self.epoch + epochs - KEEP_EPOCHS}
        self.epoch += epochs
        self.left = epochs * n - over

    def restart(self) -> None:
        self.epoch += 1
        self.begin()

    def replay(self, epoch: int, rows: I64) -> None:
        """The job's next draws are ``rows`` of ``epoch``, drawn before (a resume's): taken as
        drawn (the next epoch begins first when this one has no draws left).

        Raises:
            SamplingError: rows it could not draw next: of another epoch, more than the epoch
                has left, not the job's, or (without replacement) drawn already.
        """
        if self.left == 0 and epoch == self.epoch + 1:
            self.restart()
        i = self.index(rows)
        fits = epoch == self.epoch and rows.size <= self.left and not (i < 0).any()
        if fits and not self.replacement:
            assert self.live is not None
            fits = bool(self.live[i].all()) and np.unique(i).size == i.size
        if not fits:
            raise SamplingError(
                f"{rows.size} draws of epoch {epoch} are not the next a job at epoch "
                f"{self.epoch} with {self.left} left can make; pass what state_dict() returned."
            )
        if self.replacement:
            self.left -= int(rows.size)
            return
        for k in i.tolist():
            self.remove(k)

    def index(self, rows: I64) -> I64:
        """Positions of ``rows`` in ``id_arr``; -1 for rows not of the job."""
        i = np.minimum(np.searchsorted(self.id_arr, rows), self.id_arr.size - 1)
        return np.where(self.id_arr[i] == rows, i, -1)

    def probs(self) -> F64:
        """The distribution of the next draw (aligned with ``id_arr``)."""
        if self.replacement:
            return self.q
        assert self.tree is not None
        leaves = self.tree.leaves(self.id_arr.size)
        return np.asarray(leaves / leaves.sum(), dtype=np.float64)

    def remove(self, i: int) -> None:
        """Without replacement: row ``i`` is drawn."""
        assert self.tree is not None
        assert self.live is not None
        self.live[i] = False
        self.left -= 1
        self.tree.set(i, 0.0)
        if self.tree.total() == 0 and self.left:  # the rows of weight 0: uniform order
            self.tree = SumTree(self.live.astype(np.float64))

    def overlap(self, seq: int, ids: BitMap) -> float:
        """``sum_i min(p_i, q_i)`` for ``p`` uniform over ``ids`` and this epoch's ``q``."""
        got = self.overlaps.get(seq)
        if got is None:
            both = bitmap_to_array(ids & self.ids).astype(np.int64)
            q = self.q[np.searchsorted(self.id_arr, both)]
            got = self.overlaps[seq] = float(np.minimum(q, 1.0 / len(ids)).sum())
        return got


def _keep(q: F64 | float, size: Any, member: Any) -> Any:
    """Acceptance threshold of a residual candidate: ``1 - min(1, p/q)``."""
    return np.where(member, 1.0 - 1.0 / (np.asarray(size) * np.maximum(q, 1e-300)), 1.0)


class WeightedJobs:
    """The weighted jobs of a sampler, their uniforms and their rounds.

    Args:
        entropy: the sampler's seed entropy; ``key`` tells the streams of two holders apart.
    """

    def __init__(self, entropy: int, key: int = 0) -> None:
        self.entropy, self.key = entropy, key
        self.jobs: dict[str, WeightedJob] = {}
        self.uni = Uniforms(np.random.SeedSequence(entropy, spawn_key=(key, 0)))
        self.round = 0  # rounds with weighted jobs so far (keys the fallback streams)

    def fallback(self, r: int) -> np.random.Generator:
        """Round ``r``'s own stream: the same for every weighted job of the round."""
        return np.random.default_rng(
            np.random.SeedSequence(self.entropy, spawn_key=(self.key, 1, r))
        )

    # -- jobs ------------------------------------------------------------------------------------
    def add(
        self,
        name: str,
        seq: int,
        ids: BitMap,
        *,
        weights: Any,
        scores: ImportanceScores | None,
        replacement: bool,
        remaining: BitMap | None,
        epoch: int,
        drawn: Drawn | None = None,
    ) -> None:
        """Add job ``name``; ``drawn``: a resumed one's draws, replayed (and, if it is alone
        here, the stream of uniforms set where the run's stood: the same draws follow)."""
        arr = bitmap_to_array(ids).astype(np.int64)
        w = None if weights is None else check_weights(name, arr.size, weights)
        job = WeightedJob(seq, ids, arr, w, scores, bool(replacement), epoch=epoch)
        if drawn is not None:
            job.preset = dict(drawn.frozen)
        job.begin(None if remaining is None or remaining == ids else remaining)
        if drawn is not None:
            for e, rows in drawn.segments:
                job.replay(e, rows)
            if not self.jobs:  # else the stream is theirs too: fresh draws, by the same q
                self.__init__(drawn.entropy, drawn.key)  # type: ignore[misc]
                stream = self.uni.rng.bit_generator
                assert isinstance(stream, np.random.PCG64)  # default_rng's: one draw a float
                stream.advance(drawn.round * BLOCK)
                self.round = drawn.round
        self.jobs[name] = job

    def drawn(self, name: str, since: int) -> dict[str, Any]:
        """Where ``name``'s draws stand (``Drawn`` but its rows, which the engine keeps):
        the stream and the ranks its epochs from ``since`` froze."""
        job = self.jobs[name]
        frozen = [
            [e, zlib.compress(ranks.tobytes(), 1)]  # (a rank is a small number: 10x smaller)
            for e, ranks in sorted(job.frozen.items())
            if e >= since
        ]
        return {"entropy": self.entropy, "key": self.key, "round": self.round, "frozen": frozen}

    # -- rounds ----------------------------------------------------------------------------------
    def draw(
        self, names: list[str], n: int, lead_of: Callable[[WeightedJob], Lead | None]
    ) -> dict[str, I64]:
        """``n`` rounds of the weighted jobs ``names``; ``lead_of`` picks a job's leader (at
        each of its epoch starts, and at the call's start)."""
        u = self.uni.take(n * BLOCK).reshape(n, BLOCK)
        r0, self.round = self.round, self.round + n
        out: dict[str, I64] = {}
        ulist: list[list[float]] | None = None
        for name in names:
            job = self.jobs[name]
            col = np.empty(n, dtype=np.int64)
            t = 0
            while t < n:
                if job.left == 0:
                    job.restart()
                steps = min(n - t, job.left)
                lead = lead_of(job)
                if job.replacement and job.scores is None:  # q is every epoch's: one go
                    steps = n - t
                    idx = self._with(job, u, t, steps, lead, r0)
                    job.advance(steps)
                elif job.replacement:
                    idx = self._with(job, u, t, steps, lead, r0)
                    job.left -= steps
                else:
                    if ulist is None:
                        ulist = u.tolist()
                    idx = self._without(job, ulist, t, steps, lead, r0)
                col[t : t + steps] = job.id_arr[idx]
                t += steps
            out[name] = col
        return out

    def _pick(self, job: WeightedJob, v: F64) -> I64:
        """Rows by inverse CDF of the epoch's ``q`` (with replacement), never one of weight 0."""
        i: I64 = np.searchsorted(job.cum, v * job.cum[-1], side="right").astype(np.int64)
        return np.minimum(i, job.top)

    def _with(
        self, job: WeightedJob, u: F64, t0: int, steps: int, lead: Lead | None, r0: int
    ) -> I64:
        """Rounds ``t0 .. t0 + steps`` with replacement, vectorised."""
        rounds = np.arange(t0, t0 + steps)
        if lead is None:
            return self._pick(job, u[rounds, 1])
        x = lead.rows[rounds]
        size = lead.size[rounds]
        xi = job.index(x)
        qx = np.where(xi >= 0, job.q[np.maximum(xi, 0)], 0.0)
        idx = np.where(u[rounds, 0] < qx * size, xi, -1)
        pend = np.flatnonzero(idx < 0)
        for k in range(K):
            if not pend.size:
                break
            t = rounds[pend]
            yi = self._pick(job, u[t, 1 + 2 * k])
            mem = lead.member(t, job.id_arr[yi])
            ok = u[t, 2 + 2 * k] < _keep(job.q[yi], size[pend], mem)
            idx[pend[ok]] = yi[ok]
            pend = pend[~ok]
        for p in pend.tolist():
            idx[p] = self._fallback(job, lead, int(rounds[p]), r0)
        return idx

    def _without(
        self,
        job: WeightedJob,
        u: list[list[float]],
        t0: int,
        steps: int,
        lead: Lead | None,
        r0: int,
    ) -> I64:
        """Rounds ``t0 .. t0 + steps`` without replacement, one by one (each draw changes the
        distribution of the next)."""
        tree = job.tree
        assert tree is not None
        out = np.empty(steps, dtype=np.int64)
        ids = job.id_arr
        if lead is not None:
            xs = job.index(lead.rows[t0 : t0 + steps]).tolist()
            sizes = lead.size[t0 : t0 + steps].tolist()
        for s in range(steps):
            t = t0 + s
            row = u[t]
            tree = job.tree
            assert tree is not None
            total = tree.total()
            if lead is None:
                i = tree.find(row[1] * total)
            else:
                i = xs[s]
                size = sizes[s]
                if i < 0 or row[0] >= tree.leaf(i) / total * size:
                    i = -1
                    for k in range(K):
                        y = tree.find(row[1 + 2 * k] * total)
                        qy = tree.leaf(y) / total
                        mem = lead.member1(t, int(ids[y]))
                        if not mem or row[2 + 2 * k] < 1.0 - 1.0 / (size * qy):
                            i = y
                            break
                    if i < 0:
                        i = self._fallback(job, lead, t, r0)
            out[s] = i
            job.remove(i)
        return out

    def _fallback(self, job: WeightedJob, lead: Lead, t: int, r0: int) -> int:
        """Round ``t``'s residual draw after ``K`` attempts: ``FALLBACK_TRIES`` more from the
        round's own stream, then the residual ``(q - min(p, q))^+`` drawn explicitly (the
        attempts are slow when the residual mass is tiny). The same stream for every weighted
        job of the round, so their common random numbers go on."""
        gen = self.fallback(r0 + t)
        vb = gen.random((FALLBACK_TRIES, 2))
        size = int(lead.size[t])
        if job.replacement:
            yi = self._pick(job, vb[:, 0])
            tt = np.full(yi.size, t, dtype=np.int64)
            keep = _keep(job.q[yi], size, lead.member(tt, job.id_arr[yi]))
            ok = np.flatnonzero(vb[:, 1] < keep)
            if ok.size:
                return int(yi[ok[0]])
        else:
            tree = job.tree
            assert tree is not None
            total = tree.total()
            for v, b in vb.tolist():
                y = tree.find(v * total)
                if not lead.member1(t, int(job.id_arr[y])) or b < 1 - 1 / (
                    size * tree.leaf(y) / total
                ):
                    return y
        q = job.probs()
        p = np.where(lead.member(np.full(q.size, t, np.int64), job.id_arr), 1.0 / size, 0.0)
        res = np.maximum(q - p, 0.0)
        cum = np.cumsum(res if res.sum() > 0 else q)  # no residual mass (rounding): plain q
        pos = np.searchsorted(cum, gen.random() * cum[-1], side="right")
        return int(min(pos, int(np.flatnonzero(np.diff(cum, prepend=0.0) > 0)[-1])))

    # -- queries ---------------------------------------------------------------------------------
    def remaining(self, name: str) -> BitMap:
        job = self.jobs[name]
        if job.replacement:
            return BitMap(job.ids) if job.left else BitMap()
        assert job.live is not None
        return bitmap_from_array(job.id_arr[job.live].astype(np.uint32))

    def expected_draws(self, ids: I64, *, repeats_only: bool = False) -> F64:
        """Per row of ``ids``: the expected draws of it left in the weighted jobs' epochs
        (``q_row x draws left`` with replacement; 1 for a row not drawn yet without, unless
        ``repeats_only``)."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.zeros(ids.size, dtype=np.float64)
        for job in self.jobs.values():
            if repeats_only and not job.replacement:
                continue
            i = job.index(ids) if job.id_arr.size else np.full(ids.size, -1)
            has = i >= 0
            if job.replacement:
                out[has] += job.q[i[has]] * job.left
            else:
                assert job.live is not None
                out[has] += job.live[i[has]]
        return out

    def row_weights(self, name: str, epoch: int, rows: I64) -> npt.NDArray[np.float32]:
        """``1 / (N q_row)`` for ``rows`` drawn in ``epoch`` with replacement (``N``: the rows
        of positive ``q``, so the mean under ``q`` is 1 and a loss weighted by it is unbiased for
        the plain mean over the rows that can be drawn); 1.0 without
        (each row comes once an epoch, so an epoch's plain mean is already unbiased). Epochs
        before ``epoch`` are forgotten (the dealer cuts epochs in order).

        Raises:
            SamplingError: ``epoch`` is one whose distribution is forgotten, or a row is not
                one of the job's.
        """
        job = self.jobs[name]
        for e in [e for e in job.past if e < min(epoch, job.epoch)]:  # never the current one
            del job.past[e]
        rows = np.asarray(rows, dtype=np.int64)
        i = job.index(rows)
        if (i < 0).any():
            raise SamplingError(f"row_weights({name!r}): rows not of the job; pass its own rows.")
        if not job.replacement:
            return np.ones(rows.size, dtype=np.float32)
        q = job.past.get(epoch)
        if q is None:
            raise SamplingError(
                f"row_weights({name!r}, {epoch}): that epoch's distribution is gone (epochs "
                f"kept: {sorted(job.past)}); ask for epochs in order."
            )
        support = int(np.count_nonzero(q))  # rows of weight 0 are never drawn
        return (1.0 / (support * q[i])).astype(np.float32)

    # -- give back -------------------------------------------------------------------------------
    def give_back(self, name: str, rows: I64) -> None:
        """Rows handed out and not read go back: with replacement, the draws are undone (the
        draws left go up); without, the rows join the epoch's live rows again.

        Raises:
            SamplingError: a row is not the job's, or (without replacement) not drawn.
        """
        job = self.jobs[name]
        rows = np.asarray(rows, dtype=np.int64)
        if not rows.size:
            return
        i = job.index(rows)
        if job.replacement:
            if (i < 0).any():
                raise SamplingError(
                    f"give_back({name!r}): rows must be ids of the job; pass rows the sampler "
                    "returned for it."
                )
            job.left += int(rows.size)
            return
        assert job.live is not None
        if (i < 0).any() or job.live[i].any() or np.unique(i).size != i.size:
            raise SamplingError(
                f"give_back({name!r}): rows must be ids of the job handed out this epoch (not in "
                "its remaining set); pass rows the sampler returned for it."
            )
        live = job.live.copy()
        live[i] = True
        job.set_live(live)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> WeightedState:
        return {
            "entropy": self.entropy,
            "key": self.key,
            "round": self.round,
            "rng": self.uni.state_dict(),
            "jobs": [
                {
                    "name": name,
                    "seq": job.seq,
                    "ids": job.ids.serialize(),
                    "weights": None if job.weights is None else job.weights.tobytes(),
                    "scores": None if job.scores is None else job.scores.state_dict(),
                    "replacement": job.replacement,
                    "epoch": job.epoch,
                    "left": job.left,
                    "live": None if job.live is None else np.packbits(job.live).tobytes(),
                    "past": {e: q.tobytes() for e, q in job.past.items()},
                }
                for name, job in self.jobs.items()
            ],
        }

    def load_state_dict(self, state: WeightedState) -> None:
        self.__init__(int(state["entropy"]), int(state["key"]))  # type: ignore[misc]
        self.round = int(state["round"])
        self.uni.load_state_dict(state["rng"])
        for j in state["jobs"]:
            ids = BitMap.deserialize(j["ids"])
            arr = bitmap_to_array(ids).astype(np.int64)
            scores = None
            if j["scores"] is not None:
                from tabloader.sampling._importance import ImportanceScores

                scores = ImportanceScores.from_state(j["scores"])
            w = None if j["weights"] is None else np.frombuffer(j["weights"], np.float64).copy()
            job = WeightedJob(int(j["seq"]), ids, arr, w, scores, bool(j["replacement"]))
            job.epoch = int(j["epoch"])
            job.past = {int(e): np.frombuffer(q, np.float64).copy() for e, q in j["past"].items()}
            job.q = job.past[job.epoch]
            if job.replacement:
                job.cum = np.cumsum(job.q)
                job.top = int(np.flatnonzero(job.q > 0)[-1])
                job.left = int(j["left"])
            else:
                live = j["live"]
                assert live is not None  # saved for every job without replacement
                bits = np.frombuffer(live, np.uint8)
                job.set_live(np.unpackbits(bits, count=arr.size).astype(bool))
            self.jobs[j["name"]] = job
