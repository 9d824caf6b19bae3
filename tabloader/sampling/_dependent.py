"""Dependent sampling (DSA, JOADER Algorithm 1) with epochs, join/leave and speeds.

A round serves any subset ``A`` of the registered jobs, sorted by ``|R_j|`` ascending
(ties: earlier registration first), with ``S = ∅``:

1. ``I = ∩_{j ∈ JOB} R_j - S``; one uniform ``u`` decides how many of the jobs, in order,
   select ``I``: job ``t`` selects iff ``u · (|R_t| - |S|) < |I|`` (the chain of the
   paper's probabilities ``|I| / (|R_1| - |S|)`` then ``(|R_prev| - |S|) / (|R_t| - |S|)``;
   note the ``- |S|`` correction, which the paper's pseudocode drops).
2. The selecting jobs share one row drawn uniformly from ``I``.
3. If none selected, the first job draws uniformly from ``R_1 - S - I``.
4. The served jobs leave, ``S ← S | I``, and the walk repeats on the jobs left.

All draws of a round see the round-start sets; the rows move to their new regions at
the end of the round. The structure is described (and mapped onto JOADER's dependent
sampling tree) in :mod:`tabloader.sampling._regions`.

Weighted jobs (issue 39): sharing without bias
----------------------------------------------
A *weighted* job ``w`` (static weights, or ``importance = 'loss'``) has a next-draw
distribution ``q``: the epoch's frozen ``q`` with replacement (an epoch is ``len(ids)``
draws), or without replacement ``q`` restricted to ``w``'s rows not drawn yet this epoch,
renormalised (rows of weight 0 last, uniformly). Weighted jobs hold no region bit: the plain
jobs' rounds above run first, exactly as without them, and read the plain jobs' own uniform
stream only, so **a weighted job never changes what a plain job draws**.

Then, in each round, ``w`` couples to a *leader* ``L``, a plain job of the same round, whose
draw ``x`` is uniform over its round-start set ``R`` (``p_i = 1/|R|`` on ``R``, else 0):

1. keep ``x`` with probability ``min(1, q_x / p_x)`` (uniform ``a``: ``a < q_x |R|``);
2. else draw from the residual ``r = (q - min(p, q))^+ / (1 - sum_i min(p_i, q_i))``, by
   rejection: ``y ~ q``, accepted with probability ``1 - min(1, p_y / q_y)``.

*Exactness.* Conditional on the whole history (every job's earlier rows, the round's plain
uniforms), DSA's ``x`` is uniform over ``R`` (each plain job's draw is, whatever the others
draw: JOADER's property, unchanged here) and ``a`` and the residual uniforms are fresh, so
``P(out = i) = p_i min(1, q_i/p_i) + (1 - sum_j min(p_j, q_j)) r_i = min(p_i, q_i) +
(q_i - min(p_i, q_i)) = q_i``: each draw follows ``q`` exactly given the past, hence with
replacement the draws are i.i.d. ``q`` and without replacement the order is successive
sampling by weight, whatever the plain jobs do. *Optimality.* ``P(out = x) >= sum_i min(p_i,
q_i)`` (equality: the residual has no mass where ``x`` can be, up to the rejection loop
landing on ``x`` again), which is the largest agreement any coupling of ``p`` and ``q`` can
have (``P(X = Y) <= sum_i min(p_i, q_i)`` for any joint law): the maximal coupling. For two
plain jobs the bound is JOADER's ``|I| / max(|R_1|, |R_2|)``, which DSA attains (above).
*Cost.* A rejection attempt succeeds with probability ``1 - sum min(p, q)`` and the
residual is entered with that probability, so a round costs one attempt on average; after
``K`` attempts a round reads a stream of its own and, after more, draws the residual
explicitly (``(q - p)^+`` over ``w``'s rows), so a round whose residual mass is tiny (``q``
close to ``p``) never loops long.

*Several jobs.* Every weighted job of a round reads the same uniforms (common random
numbers: the same ``a``, the same attempts), so two weighted jobs with the same ``q`` and
leader draw the same row, and similar ones mostly do; for a weighted job and its leader the
agreement is the pairwise optimum above. Two weighted jobs with different leaders, or a
weighted job and a plain job that is not its leader, agree as the couplings chain: no
claim of optimality for those pairs (the optimum for many distributions at once is not
known to be attainable jointly). The leader is the plain job of the round with the largest
estimated overlap ``sum_i min(1/|ids_L|, q_i)`` (``R_L`` taken as all of ``L``'s ids, ``q``
as of ``w``'s epoch start; recomputed at each of ``w``'s epoch starts; ties: the earlier
registered). A round without a plain job (or none sharing a row ``w`` may draw) draws ``w``
from ``q`` directly, by inverse CDF on the shared uniform (weighted jobs with similar ``q``
still mostly agree).

*Bookkeeping.* ``refcount(s)`` count plain jobs only; :meth:`DependentSampler.expected_draws`
gives a weighted job's expected future draws of a row (``q_row x draws left`` with
replacement, 1 for a row not drawn yet without). ``remaining`` of a weighted job with
replacement is all its rows while it has draws left. The batch column ``_weight`` is
:meth:`DependentSampler.row_weights`. The implementation is :mod:`tabloader.sampling._weighted`
(with replacement vectorised per batch of rounds, inverse CDF by ``searchsorted``; without,
one draw at a time on a sum tree, O(log n) each).
"""

from __future__ import annotations

import array
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
from pyroaring import BitMap

from tabloader.catalog._bitmaps import bitmap_from_array, bitmap_to_array
from tabloader.catalog._errors import SamplingError
from tabloader.sampling._base import Uniforms, check_round
from tabloader.sampling._regions import Regions
from tabloader.sampling._shared import SamplerBase
from tabloader.sampling._states import DependentState, SamplerState
from tabloader.sampling._weighted import Lead, WeightedJob, WeightedJobs

try:
    import tabloader.sampling._rounds as walk
except ImportError:  # pragma: no cover - built without a C compiler: the Python walk
    walk = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

_Part = list[int] | np.ndarray  # some rounds' rows of one job


def _nth(rows: list[array.array[int]], regions: Iterable[int], idx: int) -> int:
    """Row ``idx`` of the rows of ``regions`` laid end to end (-1: past the end)."""
    for r in regions:
        arr = rows[r]
        if idx < len(arr):
            return arr[idx]
        idx -= len(arr)
    return -1


@dataclass
class _Job:
    slot: int
    seq: int
    ids: BitMap
    epoch: int = 0


class DependentSampler(SamplerBase[_Job]):
    """Jobs on overlapping sets ask for the same rows at about the same time.

    Each job's id stream, cut every ``len(ids)`` rows, is a sequence of uniformly random
    permutations of its set, whatever the other jobs do.

    Args:
        seed: Seed of the numpy generator; same seed and same calls give the same output.

    Example:
        >>> from pyroaring import BitMap
        >>> s = DependentSampler(seed=0)
        >>> s.add_job("a", BitMap(range(10)))
        >>> s.add_job("b", BitMap(range(10)))
        >>> r = s.sample(["a", "b"])
        >>> r["a"] == r["b"]
        True
    """

    KIND = "dependent"
    shares_rounds = True

    def __init__(self, seed: int | None = None) -> None:
        self._regions = Regions()
        self._jobs: dict[str, _Job] = {}
        self._uniforms = Uniforms(seed)
        entropy = np.random.SeedSequence(seed).entropy  # an int: ``seed`` is one or None
        assert isinstance(entropy, int)
        self._weighted = WeightedJobs(entropy)
        self._count: list[int] = []  # slot -> |R_j|
        self._seqs: list[int] = []  # slot -> registration sequence (tie break)
        self._next_seq = 0
        # one-region rounds drawn at once, the others walked in C (False: the Python walk, for
        # tests: the rows are the same)
        self.vectorize = True

    # ------------------------------------------------------------------ jobs
    @property
    def num_regions(self) -> int:
        """How many regions the rows of the jobs fall into (each region: the rows that exactly
        one set of jobs still needs): the structure's size, which a round's cost follows."""
        return len(self._regions.keys)

    def _own(self, name: str) -> WeightedJobs | None:
        return self._weighted if name in self._weighted.jobs else None

    def _homes(self) -> Iterable[WeightedJobs]:
        return (self._weighted,)

    def _home_for(self, name: str) -> WeightedJobs:
        return self._weighted

    def _add_plain(self, name: str, ids: BitMap, start: BitMap, epoch: int) -> None:
        used = {j.slot for j in self._jobs.values()}
        slot = next(s for s in range(len(used) + 1) if s not in used)
        while len(self._count) <= slot:
            self._count.append(0)
            self._seqs.append(0)
        job = _Job(slot=slot, seq=self._next_seq, ids=ids, epoch=epoch)
        self._next_seq += 1
        self._jobs[name] = job
        self._seqs[slot] = job.seq
        self._regions.add_bit(bitmap_to_array(start), 1 << slot)
        self._count[slot] = len(start)
        logger.debug("job %s joined with %d rows (slot %d)", name, len(ids), slot)

    def remove_job(self, name: str) -> None:
        """Unregister ``name``; the other jobs keep exactly their remaining rows.

        Raises:
            SamplingError: ``name`` is not registered.
        """
        if self._weighted.jobs.pop(name, None) is not None:
            return
        job = self._job(name)
        self._regions.drop_bit(1 << job.slot)
        self._count[job.slot] = 0
        del self._jobs[name]

    def give_back(self, name: str, rows: np.ndarray) -> None:
        """Return ``rows``, handed out to ``name`` in its current epoch and not read yet, to
        ``R_name``: later rounds hand them out again.

        The order stays uniform when the rows given back are chosen without looking at
        which rows they are (e.g. the tail of a queue, cut at a position): what was handed
        out before is a uniform prefix, and rounds from ``R_name`` continue it uniformly.

        A weighted job with replacement has its draws undone (its draws left go up).

        Raises:
            SamplingError: ``name`` is not registered, or a row is not one of its ids or is
                still in ``R_name`` (never handed out this epoch).
        """
        if name in self._weighted.jobs:
            self._weighted.give_back(name, np.asarray(rows, dtype=np.int64))
            return
        job = self._job(name)
        ids = np.unique(np.asarray(rows, dtype=np.int64))
        if ids.size == 0:
            return
        bit = 1 << job.slot
        regions = self._regions
        keys = np.array([*regions.keys, 0], dtype=object)
        reg = np.frombuffer(regions.reg, dtype=np.int32)
        inside = ids < reg.size
        held = np.zeros(ids.size, dtype=bool)
        held[inside] = [k & bit != 0 for k in keys[reg[ids[inside]]]]
        if held.any() or not bitmap_from_array(ids.astype(np.uint32)).issubset(job.ids):
            raise SamplingError(
                f"give_back({name!r}): rows must be ids of the job handed out this epoch "
                "(not in its remaining set); pass rows the sampler returned for it."
            )
        regions.add_bit(ids.astype(np.uint32), bit)
        self._count[job.slot] += int(ids.size)

    # ------------------------------------------------------------------ queries
    def _plain_remaining(self, job: _Job) -> BitMap:
        return bitmap_from_array(self._regions.members(1 << job.slot))

    def refcounts(self, ids: np.ndarray) -> np.ndarray:
        """:meth:`refcount` of every row of ``ids`` (int64 array)."""
        return self._regions.refcounts(np.asarray(ids))

    # ------------------------------------------------------------------ sampling
    def sample(self, jobs: Sequence[str]) -> dict[str, int]:
        """One round for ``jobs`` (any subset of the registered jobs).

        Returns:
            One row id per listed job.

        Raises:
            SamplingError: a job is unknown or listed twice.
        """
        out = self._run(jobs, 1)
        return {name: int(parts[0][0]) for name, parts in zip(jobs, out, strict=True)}

    def sample_many(self, jobs: Sequence[str], n: int) -> dict[str, np.ndarray]:
        """``n`` rounds for the same ``jobs``; identical to ``n`` calls of :meth:`sample`.

        Returns:
            Per job, its ``n`` row ids (int64), in round order.
        """
        if n < 0:
            raise SamplingError(f"n must be >= 0, got {n}.")
        out = self._run(jobs, n)
        return {
            name: np.concatenate(parts, dtype=np.int64) if parts else np.empty(0, dtype=np.int64)
            for name, parts in zip(jobs, out, strict=True)
        }

    def _restart(self, job: _Job) -> None:
        job.epoch += 1
        self._regions.add_bit(bitmap_to_array(job.ids), 1 << job.slot)
        self._count[job.slot] = len(job.ids)
        regions = self._regions
        if len(regions.keys) > 64 and 2 * sum(1 for a in regions.rows if len(a)) < len(
            regions.keys
        ):
            regions.compact()

    def _run(self, names: Sequence[str], n: int) -> list[list[_Part]]:
        """``n`` rounds for ``names``: per job, its rows in parts (concatenate them)."""
        weighted = self._weighted.jobs
        check_round({**self._jobs, **weighted}, names)
        wnames = [name for name in names if name in weighted]
        if not wnames:
            return self._run_plain(names, n)
        plain = [name for name in names if name not in weighted]
        if n == 0:
            return [[] for _ in names]
        first = {}
        for name in plain:
            job = self._jobs[name]
            first[name] = self._count[job.slot] or len(job.ids)
        cols = dict(zip(plain, self._run_plain(plain, n), strict=True))
        leads: dict[str, Lead] = {}

        def lead_of(w: WeightedJob) -> Lead | None:
            if not plain:
                return None
            best = max(plain, key=lambda p: (w.overlap(self._jobs[p].seq, self._jobs[p].ids),
                                             -self._jobs[p].seq))  # fmt: skip
            if w.overlap(self._jobs[best].seq, self._jobs[best].ids) == 0:
                return None  # no plain job shares a row it may draw: no one to follow
            if best not in leads:
                leads[best] = self._lead(best, np.concatenate(cols[best]), first[best])
            return leads[best]

        drawn = self._weighted.draw(wnames, n, lead_of)
        return [[drawn[name]] if name in drawn else cols[name] for name in names]

    def _lead(self, name: str, rows: np.ndarray, first: int) -> Lead:
        """Plain job ``name``'s rows of this call as a leader (its regions after the call
        tell which rows it still has)."""
        job = self._jobs[name]
        regions = self._regions
        has = np.array([k >> job.slot & 1 for k in regions.keys] + [0], dtype=bool)
        reg = np.frombuffer(regions.reg, dtype=np.int32)

        def still(y: np.ndarray) -> np.ndarray:
            ok = y < reg.size
            out = np.zeros(y.size, dtype=bool)
            out[ok] = has[reg[y[ok]]]
            return out

        held, where = has.tolist(), regions.reg

        def still1(y: int) -> bool:
            return y < len(where) and bool(held[where[y]])  # -1: the trailing False

        return Lead(rows.astype(np.int64), first, len(job.ids), still, still1)

    def _run_plain(self, names: Sequence[str], n: int) -> list[list[_Part]]:
        """``n`` rounds of DSA for the plain jobs ``names``."""
        jobs = [self._jobs[name] for name in names]
        m = len(jobs)
        cols: list[list[_Part]] = [[] for _ in range(m)]
        if m == 0 or n == 0:
            return cols
        cnt, seqs = self._count, self._seqs
        col_of = {job.slot: c for c, job in enumerate(jobs)}
        done = 0
        while done < n:
            for job in jobs:
                if cnt[job.slot] == 0:
                    self._restart(job)
            order = tuple(sorted(col_of, key=lambda s: (cnt[s], seqs[s])))
            # Every job of a round loses one row, so the order holds until the first job
            # (the smallest) runs out: run that many rounds in one go.
            steps = min(n - done, cnt[order[0]])
            for slot, part in zip(order, self._rounds(order, steps), strict=True):
                cols[col_of[slot]].append(part)
            done += steps
        return cols

    def _rounds(self, order: tuple[int, ...], n: int) -> list[_Part]:
        """Run ``n`` rounds for ``order`` (sorted by ``|R_j|``; nobody runs out).

        Returns:
            Per job of ``order``, its ``n`` rows.
        """
        m = len(order)
        levels, dec = self._regions.groups(order)
        if self.vectorize and len(levels[0]) == 1 and not any(levels[1:]) and not any(dec):
            return [self._rounds_one_region(order, n, levels[0][0])] * m
        if self.vectorize and walk is not None and max(order) < 64:
            return self._rounds_walked(order, n, levels, dec)
        return self._rounds_python(order, n, levels, dec)

    def _rounds_python(
        self, order: tuple[int, ...], n: int, levels: list[list[int]], dec: list[list[int]]
    ) -> list[_Part]:
        """The loop of :meth:`_rounds` in Python (``vectorize`` off, or no C walk)."""
        regions = self._regions
        cnt = self._count
        uni = self._uniforms
        m = len(order)
        out_cols: list[list[int]] = [[] for _ in range(m)]
        prefix = [0]
        for slot in order:
            prefix.append(prefix[-1] | 1 << slot)
        bits = [1 << slot for slot in order]
        c0 = [cnt[slot] for slot in order]
        rows = regions.rows
        one_level = [len(lv) == 1 for lv in levels]
        uni.ensure(2 * m)
        buf, bi = uni.buf, uni.i
        limit = len(buf) - 2 * m
        for rnd in range(n):
            if bi > limit:
                uni.i = bi
                uni.ensure(2 * m)
                buf, bi = uni.buf, uni.i
                limit = len(buf) - 2 * m
            pick_rows: list[int] = []
            pick_masks: list[int] = []
            size_s = 0  # |S|
            covered = 0  # levels < covered are in S
            s = 0
            while s < m:
                if covered == s and one_level[s]:
                    size_i = len(rows[levels[s][0]])
                else:
                    size_i = 0
                    for lv in range(covered, s + 1):
                        for r in levels[lv]:
                            size_i += len(rows[r])
                u = buf[bi]
                k = s
                while k < m and u * (c0[k] - rnd - size_s) < size_i:
                    k += 1
                if k > s:
                    idx = int(buf[bi + 1] * size_i)
                    row = _nth(rows, chain.from_iterable(levels[covered : s + 1]), idx)
                    pick_rows.append(row)
                    pick_masks.append(prefix[k] ^ prefix[s])
                    for t in range(s, k):
                        out_cols[t].append(row)
                else:
                    k = s + 1
                    idx = int(buf[bi + 1] * (c0[s] - rnd - size_s - size_i))
                    row = _nth(rows, dec[s], idx)
                    pick_rows.append(row)
                    pick_masks.append(bits[s])
                    out_cols[s].append(row)
                bi += 2
                size_s += size_i
                covered = s + 1
                s = k
            if self._move(pick_rows, pick_masks):  # a region was made: levels grew
                one_level = [len(lv) == 1 for lv in levels]
        uni.i = bi
        for t, slot in enumerate(order):
            cnt[slot] = c0[t] - n
        return list(out_cols)

    def _move(self, picked: list[int], masks: list[int]) -> bool:
        """Move the ``picked`` rows of a round to their new regions, each leaving the jobs of
        its mask (a row picked twice moves twice); True if a region was made."""
        regions = self._regions
        rows, keys, pos, reg = regions.rows, regions.keys, regions.pos, regions.reg
        made = False
        for row, mask in zip(picked, masks, strict=True):
            r = reg[row]
            arr = rows[r]
            p = pos[row]
            last = arr.pop()
            if last != row:
                arr[p] = last
                pos[last] = p
            new_key = keys[r] & ~mask
            if new_key:
                found = regions.index.get(new_key)
                if found is None:
                    found = regions.region(new_key)
                    made = True
                arr = rows[found]
                pos[row] = len(arr)
                arr.append(row)
                reg[row] = found
            else:
                reg[row] = -1
        return made

    CHUNK = 4096  # rounds per call of the C walk (its uniforms are a list of floats)

    def _rounds_walked(
        self, order: tuple[int, ...], n: int, levels: list[list[int]], dec: list[list[int]]
    ) -> list[_Part]:
        """The loop of :meth:`_rounds`, in C (``_rounds.c``): the same uniforms, rows and moves."""
        regions, uni, cnt = self._regions, self._uniforms, self._count
        m = len(order)
        parts = []  # m x steps rows of each chunk
        for done in range(0, n, self.CHUNK):
            steps = min(n - done, self.CHUNK)
            c0 = [cnt[slot] for slot in order]
            part = np.empty((m, steps), dtype=np.int64)
            uni.ensure(2 * m * steps)
            uni.i = walk.rounds(regions, order, c0, levels, dec, uni.buf, uni.i, part)
            parts.append(part)
            for slot in order:
                cnt[slot] -= steps
        return list(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1))

    def _rounds_one_region(self, order: tuple[int, ...], n: int, r: int) -> np.ndarray:
        """``n`` rounds when every row the jobs need is in region ``r``: vectorized.

        Then ``I = R_1 = ... = R_m`` and every job selects ``I`` (``u · |R| < |R|``), so each
        round is one uniform swap-remove pick from ``r`` shared by all jobs, exactly what the
        general loop does with the same two uniforms per round; :meth:`Regions.pick` applies
        the ``n`` picks with array operations.

        Returns:
            The ``n`` rows (int64), the same for every job.
        """
        regions, uni = self._regions, self._uniforms
        size = len(regions.rows[r])
        u = uni.take(2 * n)[1::2]  # the general loop's second uniform of each round
        idx = (u * (size - np.arange(n))).astype(np.int64)  # the size before each pick
        picks = regions.pick(r, idx)
        mask = 0
        for slot in order:
            mask |= 1 << slot
        new_key = regions.keys[r] & ~mask
        if new_key:
            regions.append(regions.region(new_key), picks)
        else:
            np.frombuffer(regions.reg, dtype=np.int32)[picks] = -1
        for slot in order:
            self._count[slot] -= n
        return picks

    # ------------------------------------------------------------------ state
    def state_dict(self) -> DependentState:
        """Everything needed to resume exactly, as a plain dict."""
        return {
            "kind": "dependent",
            "version": self.VERSION,
            "next_seq": self._next_seq,
            "jobs": [
                {
                    "name": name,
                    "slot": job.slot,
                    "seq": job.seq,
                    "epoch": job.epoch,
                    "count": self._count[job.slot],
                    "ids": job.ids.serialize(),
                }
                for name, job in self._jobs.items()
            ],
            "regions": self._regions.state_dict(),
            "rng": self._uniforms.state_dict(),
            "weighted": self._weighted.state_dict(),
        }

    def load_state_dict(self, state: SamplerState) -> None:
        """Restore what :meth:`state_dict` returned (replaces every job).

        Raises:
            SamplingError: ``state`` is not a dependent sampler state.
        """
        self._check_state(state)
        assert state["kind"] == "dependent"  # checked: the other kind's keys are not read
        self._jobs = {}
        slots = [int(j["slot"]) for j in state["jobs"]]
        size = max(slots, default=-1) + 1
        self._count = [0] * size
        self._seqs = [0] * size
        for j in state["jobs"]:
            job = _Job(
                slot=int(j["slot"]),
                seq=int(j["seq"]),
                ids=BitMap.deserialize(j["ids"]),
                epoch=int(j["epoch"]),
            )
            self._jobs[j["name"]] = job
            self._count[job.slot] = int(j["count"])
            self._seqs[job.slot] = job.seq
        self._next_seq = int(state["next_seq"])
        self._regions.load_state_dict(state["regions"])
        self._uniforms.load_state_dict(state["rng"])
        if "weighted" in state:  # states saved before weighted jobs have none
            self._weighted.load_state_dict(state["weighted"])
        else:
            self._weighted.jobs = {}
