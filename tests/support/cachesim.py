"""Cache simulation: replay the id streams of a scenario through cache policies.

What a scenario runs
--------------------
A :class:`Scenario` is a list of :class:`JobSpec`. Time advances in *ticks*; at every tick
the jobs that are registered and due take part in one sampler round. A job joins at its
``start`` tick, takes part in a tick with rate ``speed`` (a job of speed ``1/2`` is due on
every second tick of its own clock: ``floor((t + 1) * speed) > floor(t * speed)``), and
leaves after one full epoch (``len(ids)`` rows) or after ``leave_after`` rows if that is
set (leaving mid-epoch). The scenario ends when every job has left.

Reads
-----
The engine merges identical in-flight requests, so a round reads each of its *distinct*
rows at most once, in first-requested order: a read happens when the row is not cached.
Rows of the current round that are not yet served are pinned (RefCnt never evicts them).
The reference points are the union of the jobs' sets (no system reads less, one epoch per
job) and the sum of the set sizes (no sharing at all).

Policies -------- ``LRU``, ``RefCnt`` and ``Lookahead`` replay the stream through the eviction
policy objects of :mod:`tabloader.engine._arena.eviction` (:class:`PolicyCache`), the ones the arena
ranks its slots by: ``Lookahead`` is :data:`~tabloader.engine._arena.eviction.ARENA_POLICY` itself,
so the benchmark measures the code that runs. Each cached row has a next use (known when it falls
inside the window: the sampler runs ``LOOKAHEAD_FACTOR`` times as many rounds ahead as the cache
holds rows; else inf), a count of uses (jobs still needing it this epoch) and a last use (its last
request). ``Lookahead`` evicts the farthest next use (unknown ones first), then the fewest uses,
then the least recent; ``RefCnt`` (:class:`~tabloader.engine._arena.eviction.FewestUses`) the fewest
uses (zero first), then the least recent; ``LRU``
(:class:`~tabloader.engine._arena.eviction.LeastRecent`) the least recent, without the round's pins
(the textbook baseline). The requested row may be its own victim: a row that ranks first is not
kept. ``FIFO``, ``Random`` and ``MinIO`` (fill once, never evict) are plain loops: the arena has no
such policy. ``Belady`` is MIN, offline on the same stream and allowed to bypass: optimal, a lower
bound of every other policy. It stays a separate computation, as it is no online policy (it reads
every future request, not a horizon); with a window spanning the whole stream ``Lookahead`` equals
it (checked in the tests).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TypedDict

import numpy as np
from pyroaring import BitMap

from tabloader.engine._arena.eviction import ARENA_POLICY, EvictionPolicy, FewestUses, LeastRecent
from tabloader.sampling import Sampler

__all__ = [
    "LOOKAHEAD_FACTOR",
    "POLICIES",
    "Belady",
    "JobSpec",
    "Policy",
    "PolicyCache",
    "Scenario",
    "Stream",
    "belady_of_log",
    "belady_pinned",
    "coupled_decodes",
    "generate_stream",
    "replay",
    "simulate",
]


class Policy(str, Enum):
    """Cache eviction policies."""

    LRU = "LRU"
    FIFO = "FIFO"
    RANDOM = "Random"
    MINIO = "MinIO"
    REFCNT = "RefCnt"
    LOOKAHEAD = "Lookahead"
    BELADY = "Belady"


POLICIES: tuple[Policy, ...] = tuple(Policy)
# Rounds the Lookahead policy sees ahead, per cached row. Measured at 10% and 30% caches:
# 1x stays within 7% of Belady, 4x within 3% (ids are cheap: 4x a 10% cache is 40% of an
# epoch of row ids).
LOOKAHEAD_FACTOR = 4


@dataclass(frozen=True)
class JobSpec:
    """One job of a scenario (see the module docstring for the timing rules)."""

    name: str
    ids: BitMap
    speed: float = 1.0
    start: int = 0
    leave_after: int | None = None


@dataclass(frozen=True)
class Scenario:
    """A named list of jobs.

    ``must_reread`` is, when known, a count of rows that *any* system must read a second time
    whatever its sampler and cache (rows read before a job needing them arrived, or read by a
    job that left before a slower one reached them); a cache of ``C`` rows saves at most
    ``C`` of them, so no system's excess reads go below ``must_reread - C``.
    """

    name: str
    jobs: tuple[JobSpec, ...]
    must_reread: int | None = None

    def excess_lower_bound(self, capacity: int) -> int | None:
        """Excess reads no system avoids with a cache of ``capacity`` rows (None: unknown)."""
        return None if self.must_reread is None else max(0, self.must_reread - capacity)

    @property
    def union(self) -> int:
        """Size of the union of the jobs' sets."""
        return len(BitMap.union(*(j.ids for j in self.jobs)))

    @property
    def total(self) -> int:
        """Sum of the set sizes (rows actually requested, leaves aside)."""
        return sum(j.leave_after or len(j.ids) for j in self.jobs)


@dataclass
class Stream:
    """A replayable request stream with the refcount events of the sampler.

    ``rows``/``counts`` hold each round's distinct rows and how many jobs asked for each;
    ``rounds[i]`` is where round ``i`` starts in them. ``ref_events`` lists
    ``(position, rows, delta)``: before serving ``rows[position:]`` the refcount of
    ``rows`` changes by ``delta`` (a join or a mid-epoch leave).
    """

    rows: np.ndarray
    counts: np.ndarray
    rounds: np.ndarray
    ref_events: list[tuple[int, np.ndarray, int]] = field(default_factory=list)
    universe: int = 0


def generate_stream(scenario: Scenario, sampler: Sampler) -> Stream:
    """Run ``scenario`` on ``sampler`` and record its stream."""
    specs = list(scenario.jobs)
    universe = max(int(j.ids.max()) for j in specs) + 1
    got = dict.fromkeys((j.name for j in specs), 0)
    quota = {j.name: j.leave_after or len(j.ids) for j in specs}
    clock = dict.fromkeys(got, 0)
    active: list[JobSpec] = []
    pending = sorted(specs, key=lambda j: j.start)
    rows: list[int] = []
    counts: list[int] = []
    rounds: list[int] = []
    events: list[tuple[int, np.ndarray, int]] = []
    tick = 0
    while pending or active:
        while pending and pending[0].start <= tick:
            spec = pending.pop(0)
            sampler.add_job(spec.name, spec.ids)
            events.append((len(rows), np.asarray(spec.ids.to_array(), dtype=np.int64), 1))
            active.append(spec)
        if not active:
            tick = pending[0].start
            continue
        if all(j.speed == 1.0 for j in active):
            n = min(quota[j.name] - got[j.name] for j in active)
            if pending:
                n = min(n, pending[0].start - tick)
            names = [j.name for j in active]
            batch = sampler.sample_many(names, n)
            mat = np.stack([batch[name] for name in names], axis=1).tolist()
            for name in names:
                got[name] += n
                clock[name] += n
            tick += n
        else:
            names = []
            for j in active:
                c = clock[j.name]
                clock[j.name] = c + 1
                if int((c + 1) * j.speed) > int(c * j.speed):
                    names.append(j.name)
            one = sampler.sample(names) if names else {}
            mat = [[one[name] for name in names]] if names else []
            for name in names:
                got[name] += 1
            tick += 1
        for rnd in mat:
            rounds.append(len(rows))
            seen: dict[int, int] = {}
            for row in rnd:
                seen[row] = seen.get(row, 0) + 1
            rows.extend(seen)
            counts.extend(seen.values())
        for j in list(active):
            if got[j.name] >= quota[j.name]:
                left = sampler.remaining(j.name)
                if len(left):
                    events.append((len(rows), np.asarray(left.to_array(), dtype=np.int64), -1))
                sampler.remove_job(j.name)
                active.remove(j)
    return Stream(
        rows=np.asarray(rows, dtype=np.int64),
        counts=np.asarray(counts, dtype=np.int64),
        rounds=np.asarray([*rounds, len(rows)], dtype=np.int64),
        ref_events=events,
        universe=universe,
    )


def _next_use(rows: np.ndarray) -> np.ndarray:
    """For each access, the index of the next access of the same row (len if none)."""
    n = len(rows)
    order = np.lexsort((np.arange(n), rows))
    nxt = np.full(n, n, dtype=np.int64)
    same = rows[order[1:]] == rows[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def simulate(stream: Stream, policy: Policy, capacity: int, *, seed: int = 0) -> int:
    """Replay ``stream`` through a cache of ``capacity`` rows; return the number of reads."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    rows = stream.rows.tolist()
    if policy is Policy.BELADY:
        return _belady(rows, _next_use(stream.rows).tolist(), capacity)
    if policy is Policy.LRU:
        return replay(stream, LeastRecent(), capacity, 0, pins=False)
    if policy is Policy.REFCNT:
        return replay(stream, FewestUses(), capacity, 0)
    if policy is Policy.LOOKAHEAD:
        per_round = float(np.diff(stream.rounds).mean()) if len(stream.rounds) > 1 else 0.0
        window = int(LOOKAHEAD_FACTOR * capacity * per_round)
        return replay(stream, ARENA_POLICY, capacity, window)
    return _simple(rows, policy, capacity, seed)


def _simple(rows: Sequence[int], policy: Policy, capacity: int, seed: int) -> int:
    """FIFO, Random and MinIO: no eviction inputs, so no policy object."""
    reads = 0
    if policy is Policy.RANDOM:
        rng = random.Random(seed)
        slots: list[int] = []
        where: dict[int, int] = {}
        for row in rows:
            if row in where:
                continue
            reads += 1
            if len(slots) < capacity:
                where[row] = len(slots)
                slots.append(row)
            else:
                i = rng.randrange(capacity)
                del where[slots[i]]
                slots[i] = row
                where[row] = i
        return reads
    if policy is Policy.MINIO:
        kept: set[int] = set()
        for row in rows:
            if row not in kept:
                reads += 1
                if len(kept) < capacity:
                    kept.add(row)
        return reads
    cache: OrderedDict[int, None] = OrderedDict()
    for row in rows:  # FIFO
        if row in cache:
            continue
        reads += 1
        cache[row] = None
        if len(cache) > capacity:
            cache.popitem(last=False)
    return reads


def _belady(rows: Sequence[int], nxt: Sequence[int], capacity: int) -> int:
    reads = 0
    cached: dict[int, int] = {}  # row -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, row), lazily invalidated
    for i, row in enumerate(rows):
        nu = nxt[i]
        if row in cached:
            cached[row] = nu
            heapq.heappush(heap, (-nu, row))
            continue
        reads += 1
        if len(cached) < capacity:
            cached[row] = nu
            heapq.heappush(heap, (-nu, row))
            continue
        while True:  # the cached row used farthest in the future
            neg, victim = heap[0]
            if cached.get(victim) == -neg:
                break
            heapq.heappop(heap)
        if -neg > nu:
            heapq.heappop(heap)
            del cached[victim]
            cached[row] = nu
            heapq.heappush(heap, (-nu, row))
    return reads


def coupled_decodes(
    sets: Sequence[np.ndarray],
    starts: Sequence[float],
    capacity: int,
    *,
    paced: bool,
    seed: int = 0,
) -> int:
    """Belady's MIN (``capacity`` rows) of one epoch of each job when the jobs' uniform orders
    are maximally coupled: every row of the union has one uniform key, and each job reads its
    rows (``sets[j]``, row ids) in the order of their keys rotated by its start phase
    (``(key - starts[j]) mod 1``). Each job's order is uniform, and any two jobs that start
    together read their shared rows in the same order (no two uniform orders agree more).

    Time runs in epochs of the largest set. ``paced``: each job reads its epoch in one unit
    (its rows/s in proportion to its epoch's size: DESIGN §17), so jobs started together meet
    every shared row at the same moment; else every job reads at the largest set's rows/s (a
    smaller set ends its epoch early). A job starting at ``starts[j]`` meets the others' keys
    from there on. Ties in time go to the earlier job.
    """
    keys = np.random.default_rng(seed).random(int(max(int(s.max()) for s in sets)) + 1)
    largest = max(s.size for s in sets)
    times, rows = [], []
    for s, start in zip(sets, starts, strict=True):
        order = s[np.argsort((keys[s] - start) % 1.0, kind="stable")]
        rate = s.size if paced else largest
        times.append(start + (np.arange(order.size) + 0.5) / rate)
        rows.append(order)
    stream = np.concatenate(rows)[np.argsort(np.concatenate(times), kind="stable")]
    return _belady(stream.tolist(), _next_use(stream).tolist(), capacity)


class Belady(TypedDict):
    """Belady's MIN on a recorded access log with a cache of ``capacity_rows``."""

    capacity_rows: int
    decodes: int
    decodes_unpinned: int


def belady_of_log(access_log: Path, capacity_rows: int) -> tuple[Belady, int]:
    """Belady's MIN on the requests recorded in ``access_log`` (an ``AccessLog``'s ``.npz``)
    with a cache of ``capacity_rows`` values, keeping what batches hold (``decodes``: the
    targets' bound) and not (``decodes_unpinned``, lower still); and the log's entries."""
    with np.load(access_log) as log:
        kind, space, row = log["kind"], log["space"], log["row"]
    result: Belady = {
        "capacity_rows": capacity_rows,
        "decodes": belady_pinned(kind, space, row, capacity_rows),
        "decodes_unpinned": belady_pinned(kind, space, row, capacity_rows, pins=False),
    }
    return result, int(row.size)


def belady_pinned(
    kind: np.ndarray, space: np.ndarray, row: np.ndarray, capacity: int, *, pins: bool = True
) -> int:
    """Belady's MIN on a recorded :class:`~tabloader.engine._arena.accounting.AccessLog`: the reads
    (decodes) of
    a cache of ``capacity`` values that knows every future request.

    With ``pins`` a value that a batch holds (from its look-up to its release) is never
    evicted, as in the arena: a value that needs a slot while every cached one is held is not
    cached. When full, the unheld value whose next look-up is farthest makes room, unless the
    new value's own next look-up is farther: then the new one is not cached. Without ``pins``
    this is exact MIN, a lower bound of any cache of that size on these requests.

    Raises:
        ValueError: ``capacity`` is below 1.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if row.size == 0:
        return 0
    key = space.astype(np.int64) * (int(row.max()) + 1) + row.astype(np.int64)
    looks = kind == 1  # AccessLog.LOOKUP
    nxt = _next_use(key[looks]).tolist()
    if not pins:
        return _belady(key[looks].tolist(), nxt, capacity)
    held: dict[int, int] = {}  # value -> batches holding it
    next_of: dict[int, int] = {}  # value -> its next look-up (index among look-ups)
    version: dict[int, int] = {}  # heap entries of an older version are stale
    cached: set[int] = set()
    heap: list[tuple[int, int, int]] = []  # (-next look-up, value, version): unheld ones
    reads = j = 0
    for is_look, x in zip(looks.tolist(), key.tolist(), strict=True):
        if not is_look:
            held[x] = held.get(x, 0) - 1
            if held[x] == 0 and x in cached:
                version[x] = version.get(x, 0) + 1
                heapq.heappush(heap, (-next_of[x], x, version[x]))
            continue
        next_of[x] = nxt[j]
        j += 1
        held[x] = held.get(x, 0) + 1
        version[x] = version.get(x, 0) + 1  # held now: not a victim until released
        if x in cached:
            continue
        reads += 1
        if len(cached) >= capacity:
            while heap and (version[heap[0][1]] != heap[0][2] or heap[0][1] not in cached):
                heapq.heappop(heap)  # stale
            if not heap or -heap[0][0] < next_of[x]:
                continue  # every cached value is held, or needed sooner: x is not cached
            cached.discard(heapq.heappop(heap)[1])
        cached.add(x)
    return reads


class PolicyCache:
    """Cached rows ranked by an eviction policy's keys (a heap of key tuples, stale entries
    skipped): the simulator's view of the arena's choice, through the same policy object.

    Each row has a ``next_use`` (inf: not known), ``uses`` and ``last_use``, as the arena's
    candidates do (:mod:`tabloader.engine._arena.eviction`).
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.state: dict[int, tuple[float, float, int, int]] = {}  # row -> (next, uses, last, ver)
        self._heap: list[tuple[tuple[float, ...], int, int]] = []  # (keys, version, row)
        self._version = 0

    def __len__(self) -> int:
        return len(self.state)

    def __contains__(self, row: int) -> bool:
        return row in self.state

    def put(self, row: int, next_use: float, uses: float, last_use: int) -> None:
        """Cache ``row`` (or update it) with these eviction inputs."""
        self._version += 1
        self.state[row] = (next_use, uses, last_use, self._version)
        keys = self.policy.keys(next_use, uses, last_use)
        heapq.heappush(self._heap, (keys, self._version, row))
        if len(self._heap) > 4 * len(self.state) + 64:  # drop the stale entries
            self._heap = [e for e in self._heap if self.state.get(e[2], (0, 0, 0, -1))[3] == e[1]]
            heapq.heapify(self._heap)

    def evict(self, pinned: set[int]) -> int:
        """Remove and return the policy's best victim among the rows not in ``pinned``."""
        held = []
        heap, state = self._heap, self.state
        while True:
            entry = heapq.heappop(heap)
            _, version, row = entry
            if state.get(row, (0, 0, 0, -1))[3] != version:
                continue  # stale
            if row in pinned:
                held.append(entry)
                continue
            break
        for entry in held:
            heapq.heappush(heap, entry)
        del state[row]
        return row


def replay(
    stream: Stream,
    policy: EvictionPolicy,
    capacity: int,
    window: int,
    *,
    pins: bool = True,
    expected: Callable[[int, int], float] | None = None,
) -> int:
    """Replay ``stream`` through a :class:`PolicyCache` of ``capacity`` rows ranked by ``policy``.

    A row's next use is known when it lies within ``window`` requests of the current one
    (the sampler's horizon; otherwise inf); its uses are the jobs' remaining requests of it
    this epoch; its last use is the position of its last request. With ``pins`` the rest of
    the current round is pinned, as the engine's batches pin their rows (the textbook LRU
    baseline runs without). The requested row is cached before the eviction, so it may be
    the victim (not kept). ``expected(i, row)``, when given, adds a weighted job's expected
    draws of ``row`` left after request ``i`` to its uses (the arena adds
    ``DependentSampler.expected_draws`` alike). Returns the number of reads.
    """
    rows = stream.rows.tolist()
    n = len(rows)
    nxt = _next_use(stream.rows).tolist()
    ref = np.zeros(stream.universe, dtype=np.int64)
    counts = stream.counts.tolist()
    bounds = stream.rounds.tolist()
    events = list(stream.ref_events)
    cache = PolicyCache(policy)
    state = cache.state
    reveal: list[tuple[int, int, int]] = []  # (when the next use enters the window, row, it)
    true_next: dict[int, int] = {}  # row -> its next request, known or not
    inf = math.inf
    reads = ev = 0
    for rnd in range(len(bounds) - 1):
        a, b = bounds[rnd], bounds[rnd + 1]
        while ev < len(events) and events[ev][0] <= a:
            _, ids, delta = events[ev]
            ref[ids] += delta
            cached = ids[np.isin(ids, np.fromiter(state, np.int64, len(state)))]
            for row, count in zip(cached.tolist(), ref[cached].tolist(), strict=True):
                nu, _, last, _ = state[row]
                cache.put(row, nu, count, last)
            ev += 1
        pinned = set(rows[a:b]) if pins else set()
        for i in range(a, b):
            row = rows[i]
            pinned.discard(row)
            left = int(ref[row]) - counts[i]
            ref[row] = left
            # draws with replacement are no reference counts: a weighted job's rows stay at 0
            uses = left if expected is None else max(left, 0) + expected(i, row)
            nu = nxt[i]
            if nu < n and nu > i + window:
                heapq.heappush(reveal, (nu - window, row, nu))
            hit = row in state
            true_next[row] = nu
            cache.put(row, nu if nu <= i + window and nu < n else inf, uses, i)
            if hit:
                continue
            reads += 1
            if len(state) <= capacity:
                continue
            while reveal and reveal[0][0] <= i:  # next uses now within the window
                _, r, nu = heapq.heappop(reveal)
                if r in state and true_next[r] == nu:
                    _, uses, last, _ = state[r]
                    cache.put(r, nu, uses, last)
            cache.evict(pinned)
    return reads


def hit_ratios(
    rows: np.ndarray, probs: list[np.ndarray], ids: np.ndarray, capacity: int
) -> dict[str, float]:
    """Hit ratios replaying ``rows`` (epochs of ``len(ids)`` draws; ``probs[e]`` the job's
    distribution in epoch ``e``) through a cache of ``capacity`` rows: LRU; the arena's policy
    with the expected draws alone (no lookahead: SHADE's importance cache); the arena's policy
    as the engine runs it (next uses inside the sampler's lookahead, then expected draws);
    Belady's MIN."""
    n = len(rows)
    stream = Stream(
        rows=rows.astype(np.int64),
        counts=np.ones(n, np.int64),
        rounds=np.arange(n + 1, dtype=np.int64),
        universe=int(ids.max()) + 1,
    )
    per_epoch = len(ids)
    dense = np.zeros((len(probs), stream.universe))
    for e, p in enumerate(probs):
        dense[e, ids] = p * per_epoch  # expected draws in an epoch: one job ranks alike by them

    def expected(i: int, row: int) -> float:
        return float(dense[min(i // per_epoch, len(probs) - 1), row])

    out = {
        "LRU": replay(stream, LeastRecent(), capacity, 0, pins=False),
        "expected draws": replay(stream, ARENA_POLICY, capacity, 0, expected=expected),
        "tabloader": replay(
            stream, ARENA_POLICY, capacity, int(LOOKAHEAD_FACTOR * capacity), expected=expected
        ),
        "Belady MIN": simulate(stream, Policy.BELADY, capacity),
    }
    return {name: 1 - reads / n for name, reads in out.items()}
