"""(ours) Large-neighbourhood search after the local search: ruin and recreate.

The local search (:mod:`skrull_ext.scheduler.refine`) moves one or two samples at a time
and only downhill, so it stops where the plan needs several samples moved at once (a
second ring on another DP rank, a micro-batch's CP ranks refilled under its largest local
sample).  This pass then repeats, within a work budget:

1. **ruin**: from the slowest DP rank ``d0`` (ties: the lowest index) remove ``q`` samples,
   ``q = 2 + floor((QMAX - 2) u^2)`` (mostly few, sometimes many), one of four ways
   (equally likely): the distributed samples of one of its micro-batches plus ``q / 2`` of
   its samples at random; ``q`` of its samples at random; up to ``3 q`` samples of one of
   its micro-batches (all of them when it holds no more); the local samples of the most
   loaded CP rank of its slowest micro-batch and of one other CP rank there, plus ``q / 2``
   at random.  Then up to ``q / 2`` samples of the other DP ranks at random;
2. **recreate**: re-insert them costliest first (half of the time each cost scaled by a
   random factor in [1, 1.3): other orders), each at the position, over every micro-batch
   of every DP rank plus a new one per rank, where ``max(rank time after, target) + 1e-3
   x increase`` is least (ties: the first): distributed, or whole on the CP rank with the
   least local work among those with room (as ``refine.best_insert``, ties distributed).
   The target is the best makespan found so far lowered by up to 1% at random: below it
   only the added time counts, above it the rank's time;
3. **accept** when the score (the makespan plus 1e-3 x the mean DP rank time, so unloading
   the other ranks counts) is below the current one times ``1 + tau``, ``tau`` falling
   linearly from :data:`TAU0` to 0 over the budget (threshold accepting); else undo.

Instead of the first step and of every :data:`REFILL_EVERY`-th, :func:`refill` repacks
each DP rank changed since its last refill: its samples first-fit decreasing (by cost)
into micro-batches of at most :data:`REFILL_FRACS` of the CP group's tokens, each placed
by ``refine.place_group``; a repacking is kept (always) where the rank gets faster.  Full
micro-batches hide the ring's transfers under local work, a structure the steps alone
reach only after thousands of moves (7B, CP 16, GBS 1024, 2x buckets: 2-5% faster plans).
After each refill, :func:`~skrull_ext.scheduler.resplit.resplit` re-deals the local samples
of pairs of the same ranks' micro-batches within half of the budget left (kept where a
rank gets faster).

Before all of it, :func:`~skrull_ext.scheduler.resplit.deal_best` re-deals the whole
batch over a skeleton of rings (within half the budget; kept when the slowest DP rank gets
faster), a structure the steps reach only after thousands of moves.  With pins, the DP
ranks without pinned rings are re-dealt among themselves that way, then every local sample
of the batch around the pinned rings (:func:`~skrull_ext.scheduler.pindeal.pin_deal_best`,
within half of the budget left).

It keeps the best plan seen (makespan, then score) and stops when the budget is spent,
when that makespan reaches the batch's lower bound
(:func:`~skrull_ext.scheduler.bound.plan_lower_bound`, as the C++ core's), so a plan
already at the bound costs nothing, or when the slowest DP rank holds pinned rings alone
(no step can change its time).  A plan above the bound then gets
:func:`~skrull_ext.scheduler.balance.balance`, its DP ranks' local samples re-balanced over
their micro-batches' CP ranks, with the part of the budget kept for it from the start
(:func:`~skrull_ext.scheduler.balance.balance_share`: 1/8 from 256 samples; the steps leave
a micro-batch's CP ranks up to ~12% apart); with pins, then
:func:`~skrull_ext.scheduler.regroup.regroup` (the slowest DP rank's binding samples moved
or swapped into other DP ranks) within what was left of the budget, and the pinned deal
once more with what is left after that (kept when faster: it undoes a plateau the steps
stopped on), and last, with ``budget // ALONE_DIV`` units more,
:func:`~skrull_ext.scheduler.regroup.search_alone` (every other DP rank searched alone,
making room) and :func:`regroup` again (kept when faster; not where the slowest DP rank
holds rings alone): :func:`~skrull_ext.scheduler.regroup.after_search`.  Randomness comes
from a splitmix64 stream with a fixed seed, and the budget counts work, not time (see
:data:`WORK`), so every rank and every run gets the same plan.

This module is the specification; ``csrc/lns.cpp`` mirrors it step for step (same random
draws, same float operations, same work count; ``tests/test_lns.py``).
"""
from __future__ import annotations

from typing import Optional

from skrull_ext.scheduler.balance import balance_share, polished
from skrull_ext.scheduler.pindeal import pin_deal_best
from skrull_ext.scheduler.reference import GdsContext, Placement, rank_time
from skrull_ext.scheduler.refill import REFILL_FRACS, REFILL_PLACE_WORK, refill
from skrull_ext.scheduler.regroup import after_search
from skrull_ext.scheduler.resplit import deal_best, resplit
from skrull_ext.sharding import shard_tokens

MASK = (1 << 64) - 1
SEED = 0x5D6E7A1B2C3D4E5F
# Work units per ms of this search in the C++ core (benchmarks/bench_scheduler.py
# --calibrate --stage lns); the portfolio converts the local search's units at this rate.
WORK_UNITS_PER_MS = 300_000
# Batches above this many samples skip it (a size rule: each insertion tries every
# micro-batch of every DP rank, thousands at K = 65,536).
MAX_LNS_SAMPLES = 1 << 14
# Most samples one ruin takes from the slowest DP rank (q's range is [2, QMAX]).
QMAX = 40
# Threshold accepting: a move may raise the score by up to TAU0 (relative) at the start.
TAU0 = 2e-3
# The recreate's target is the best makespan lowered by up to this fraction.
TARGET_NOISE = 0.01
# Half of the recreates order samples by cost times a factor in [1, 1 + ORDER_NOISE).
ORDER_NOISE = 0.3
# Every this many steps (the first included) the ranks changed since are refilled.
REFILL_EVERY = 30
# Work units per CP rank an insertion into a micro-batch with pinned rings prices (each
# rank's time, twice: distributed and whole there; half of it per rank to sum one).
# With 8 (2026-11-26, group-fill's plans, `_C.lns_pinned`): 270-800K units per ms on
# issue 31's user file (0.5B CP 8, 7B CP 16, GBS 1024) and lmsyschat1m (0.5B CP 16, GBS
# 256); 114K on chatqa2 7B CP 16 GBS 1024, where all 92 micro-batches hold a ring: its
# slowest DP rank held rings alone and the search spun on empty ruins (4 units each) until
# the budget ran out; it now stops there (`_Lns.stuck`).  With one RankTimeOf per
# micro-batch in the C++ pricing (2026-11-27), 2 gives 330-360K units per ms on the
# user file and lmsyschat1m (4 gives 360-670K; the budget assumes 300K:
# bench_scheduler.py --calibrate), so 2; chatqa2 (203K) now stops after 0.4M units.
PIN_RANK_WORK = 2
# With pins, ``budget // ALONE_DIV`` more units (on top of the budget) for
# :func:`~skrull_ext.scheduler.regroup.search_alone` and the second ``regroup``.
ALONE_DIV = 4


class _Rng:
    """splitmix64: the same 64-bit stream in Python and C++."""

    def __init__(self, seed: int = SEED):
        self.state = seed & MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def below(self, m: int) -> int:
        """An integer in ``[0, m)`` (``m >= 1``)."""
        return self.next() % m

    def unit(self) -> float:
        """A float in ``[0, 1)`` (53 random bits)."""
        return (self.next() >> 11) * (1.0 / 9007199254740992.0)


class _Mb:
    """One micro-batch: its lists and their sums (summed in list order)."""

    __slots__ = ("dist", "local", "pin", "comm", "share", "has_dist", "load", "tok", "size",
                 "t", "times")

    def __init__(self, dist: list[int], local: list[list[int]], pin=None):
        # pin: None, or ``(id, seconds [N], tokens [N])`` of the sub-group rings pinned here
        self.dist, self.local, self.pin = dist, local, pin

    def copy(self) -> "_Mb":
        out = _Mb(list(self.dist), [list(r) for r in self.local], self.pin)
        for name in ("comm", "share", "has_dist", "size", "t", "times"):
            setattr(out, name, getattr(self, name))
        out.load, out.tok = list(self.load), list(self.tok)
        return out

    def kept(self) -> bool:
        """Whether it stays in its DP rank's list: a sample or a pinned ring."""
        return bool(self.size) or self.pin is not None

    def placement(self) -> Placement:
        p = (list(self.dist), [list(r) for r in self.local])
        return p if self.pin is None else p + (self.pin[0],)


class _Lns:
    """The plan being searched, its times, the undo journal and the work counter."""

    def __init__(self, ctx: GdsContext, splits, overhead: float, budget: int, pins=None):
        self.ctx, self.n, self.ovh, self.budget, self.work = ctx, ctx.cp_size, overhead, budget, 0
        self.shares = ([float(c) / ctx.cp_size for c in ctx.costs] if ctx.shares is None
                       else [float(x) for x in ctx.shares])
        self.ranks: list[list[_Mb]] = []
        for split in splits:
            rank = [self._sum(_Mb(list(p[0]), [list(r) for r in p[1]],
                                  None if len(p) < 3 else (p[2],) + tuple(pins[p[2]])))
                    for p in split if p[0] or any(p[1]) or len(p) > 2]
            rank.append(self._sum(_Mb([], [[] for _ in range(self.n)])))
            self.ranks.append(rank)
        self.rt = [self._rank_time(d) for d in range(len(self.ranks))]
        self.work = 0
        self.rng = _Rng()
        self.journal: dict[tuple[int, int], _Mb] = {}
        self.lens: dict[int, int] = {}
        self.dirty = [True] * len(self.ranks)  # changed since its last refill
        # The slowest DP rank has no sample to ruin (only pinned rings): no step can change
        # its time, so none can lower the makespan; the search stops there.
        self.stuck = False

    # -- pricing ------------------------------------------------------------------------
    def _sum(self, mb: _Mb) -> _Mb:
        """Sums ``mb``'s lists in order (work: samples + N) and prices it."""
        c, lengths, n = self.ctx, self.ctx.lengths, self.n
        comm = share = 0.0
        dtok = 0
        for i in mb.dist:
            comm += c.comm[i]
            share += self.shares[i]
            dtok += shard_tokens(int(lengths[i]), n)
        mb.comm, mb.share, mb.has_dist = comm, share, bool(mb.dist)
        mb.load, mb.tok, mb.size = [], [], len(mb.dist)
        for r in mb.local:
            x, t = 0.0, dtok
            for i in r:
                x += c.costs[i]
                t += int(lengths[i])
            mb.load.append(x)
            mb.tok.append(t)
            mb.size += len(r)
        self.work += mb.size + n
        if mb.pin is None:
            mb.times = None
            mb.t = (self._time(comm, share, max(mb.load), mb.has_dist) + self.ovh if mb.size
                    else 0.0)
            return mb
        # pinned rings: each CP rank's own time plus its rings' (so no longer the most
        # loaded rank's alone), its tokens plus their shards
        self.work += PIN_RANK_WORK // 2 * n
        _, seconds, tokens = mb.pin
        mb.tok = [t + x for t, x in zip(mb.tok, tokens)]
        mb.times = [self._time(comm, share, x, mb.has_dist) + y
                    for x, y in zip(mb.load, seconds)]
        mb.t = max(mb.times) + self.ovh
        return mb

    def _time(self, comm: float, share: float, x: float, has_dist: bool) -> float:
        """``micro_batch_time`` from the sums (its most loaded CP rank sets it)."""
        if has_dist:
            comm += self.ctx.latency
        return max(0.0, rank_time(x, comm, share, self.n, self.ctx.objective))

    def _rank_time(self, d: int) -> float:
        self.work += len(self.ranks[d])
        t = 0.0
        for mb in self.ranks[d]:
            if mb.kept():
                t += mb.t
        return t

    def insert_cost(self, mb: _Mb, i: int) -> Optional[tuple[float, int]]:
        """``(time with overhead, where)`` of ``mb`` plus sample ``i`` at its best place
        (``where`` -1: distributed, else the CP rank); ``None`` if it fits nowhere."""
        if mb.pin is not None:
            return self._insert_pinned(mb, i)
        c, n = self.ctx, self.n
        self.work += n + 1
        s, cap = int(c.lengths[i]), c.bucket_size
        x = max(mb.load)
        best = None
        if n > 1 and max(mb.tok) + shard_tokens(s, n) <= cap:
            best = (self._time(mb.comm + c.comm[i], mb.share + self.shares[i], x, True), -1)
        r = -1
        for j in range(n):
            if mb.tok[j] + s <= cap and (r < 0 or mb.load[j] < mb.load[r]):
                r = j
        if r >= 0:
            t = self._time(mb.comm, mb.share, max(x, mb.load[r] + c.costs[i]), mb.has_dist)
            if best is None or t < best[0]:
                best = (t, r)
        return None if best is None else (best[0] + self.ovh, best[1])

    def _insert_pinned(self, mb: _Mb, i: int) -> Optional[tuple[float, int]]:
        """:meth:`insert_cost` where pinned rings make the CP ranks' times differ: whole on
        the CP rank (with room) whose new time against the others' is least."""
        c, n = self.ctx, self.n
        self.work += PIN_RANK_WORK * n + 1
        s, cap, seconds = int(c.lengths[i]), c.bucket_size, mb.pin[1]
        best = None
        if n > 1 and max(mb.tok) + shard_tokens(s, n) <= cap:
            comm, share = mb.comm + c.comm[i], mb.share + self.shares[i]
            best = (max(self._time(comm, share, x, True) + y
                        for x, y in zip(mb.load, seconds)), -1)
        pre, suf = [0.0] * (n + 1), [0.0] * (n + 1)  # the others' largest time (all >= 0)
        for r in range(n):
            pre[r + 1] = max(pre[r], mb.times[r])
            suf[n - 1 - r] = max(suf[n - r], mb.times[n - 1 - r])
        for r in range(n):
            if mb.tok[r] + s > cap:
                continue
            t = self._time(mb.comm, mb.share, mb.load[r] + c.costs[i], mb.has_dist) + seconds[r]
            t = max(t, pre[r], suf[r + 1])
            if best is None or t < best[0]:
                best = (t, r)
        return None if best is None else (best[0] + self.ovh, best[1])

    # -- moves --------------------------------------------------------------------------
    def _touch(self, d: int, j: int) -> None:
        """Journals micro-batch ``(d, j)`` before its first change in this move."""
        if d not in self.lens:
            self.lens[d] = len(self.ranks[d])
        if (d, j) not in self.journal and j < self.lens[d]:
            mb = self.ranks[d][j]
            self.work += mb.size + self.n
            self.journal[d, j] = mb.copy()

    def _locate(self, d: int, idx: int) -> tuple[int, int, int]:
        """The ``idx``-th sample of DP rank ``d`` (micro-batches in order, each its
        distributed samples then CP rank by rank): ``(j, sample, where)``."""
        for j, mb in enumerate(self.ranks[d]):
            self.work += 1
            if idx < len(mb.dist):
                return j, mb.dist[idx], -1
            idx -= len(mb.dist)
            for r, loc in enumerate(mb.local):
                if idx < len(loc):
                    return j, loc[idx], r
                idx -= len(loc)
        raise AssertionError("sample index out of range")

    def _ruin(self, d0: int) -> list[tuple[int, int, int, int]]:
        """``(d, j, sample, where)`` to remove (see the module docstring), no repeats."""
        rng, rank = self.rng, self.ranks[d0]
        picks: dict[int, tuple[int, int, int, int]] = {}

        def add(d, j, i, where):
            self.work += 1
            picks.setdefault(i, (d, j, i, where))

        u = rng.unit()
        q = 2 + int((QMAX - 2) * (u * u))
        kind = rng.below(4)
        count = sum(mb.size for mb in rank)
        if not count:
            return []
        busy = [j for j, mb in enumerate(rank) if mb.size]
        take = q
        if kind == 3:  # the most loaded CP rank of d0's slowest micro-batch and a random one
            j = busy[0]
            for x in busy:
                if rank[x].t > rank[j].t:
                    j = x
            mb = rank[j]
            r = 0
            for x in range(1, self.n):
                if mb.load[x] > mb.load[r]:
                    r = x
            other = rng.below(self.n)
            for w in (r, other):
                for i in mb.local[w]:
                    add(d0, j, i, w)
            take = q // 2
        elif kind != 1:
            j = busy[rng.below(len(busy))]
            mb = rank[j]
            if kind == 0:
                for i in mb.dist[:q]:
                    add(d0, j, i, -1)
                take = q // 2
            else:
                take = 0
                if mb.size <= 3 * q:
                    for i in mb.dist:
                        add(d0, j, i, -1)
                    for r, loc in enumerate(mb.local):
                        for i in loc:
                            add(d0, j, i, r)
                else:
                    order = [(i, -1) for i in mb.dist] + [(i, r) for r, loc in
                                                          enumerate(mb.local) for i in loc]
                    for _ in range(3 * q):
                        i, r = order[rng.below(len(order))]
                        add(d0, j, i, r)
        for _ in range(take):
            j, i, r = self._locate(d0, rng.below(count))
            add(d0, j, i, r)
        dp = len(self.ranks)
        for _ in range(rng.below(q // 2 + 1) if dp > 1 else 0):
            d = rng.below(dp - 1)
            d += d >= d0
            total = sum(mb.size for mb in self.ranks[d])
            if total:
                j, i, r = self._locate(d, rng.below(total))
                add(d, j, i, r)
        return list(picks.values())

    def _remove(self, picks) -> None:
        for d, j, i, where in picks:
            self._touch(d, j)
            mb = self.ranks[d][j]
            (mb.dist if where < 0 else mb.local[where]).remove(i)
        for d, j in sorted({(p[0], p[1]) for p in picks}):
            self._sum(self.ranks[d][j])
        for d in sorted({p[0] for p in picks}):
            self.rt[d] = self._rank_time(d)

    def _place(self, i: int, target: float) -> bool:
        """Inserts sample ``i`` where the recreate's key is least; ``False`` if nowhere."""
        best = None
        for d, rank in enumerate(self.ranks):
            for j, mb in enumerate(rank):
                got = self.insert_cost(mb, i)
                if got is None:
                    continue
                delta = got[0] - mb.t
                key = max(self.rt[d] + delta, target) + 1e-3 * delta
                if best is None or key < best[0]:
                    best = (key, d, j, got[1])
        if best is None:
            return False
        _, d, j, where = best
        self._touch(d, j)
        mb = self.ranks[d][j]
        (mb.dist if where < 0 else mb.local[where]).append(i)
        self._sum(mb)
        if j == len(self.ranks[d]) - 1:  # the new micro-batch: keep an empty one last
            self.ranks[d].append(self._sum(_Mb([], [[] for _ in range(self.n)])))
        self.rt[d] = self._rank_time(d)
        return True

    def _undo(self, rt: list[float]) -> None:
        for (d, j), mb in self.journal.items():
            self.ranks[d][j] = mb
        for d, length in self.lens.items():
            del self.ranks[d][length:]
        self.rt = rt

    def _compact(self) -> None:
        """Drops the empty micro-batches of the changed ranks but one, kept last."""
        for d in sorted(self.lens):
            self.work += len(self.ranks[d])
            rank = [mb for mb in self.ranks[d] if mb.kept()]
            rank.append(self._sum(_Mb([], [[] for _ in range(self.n)])))
            self.ranks[d] = rank
            self.dirty[d] = True

    def refill(self) -> bool:
        """:func:`refill` of the ranks changed since their last one, within half the budget
        left, then :func:`~skrull_ext.scheduler.resplit.resplit` of their pairs within half
        of what is left; ``True`` if one got faster (always kept).  Micro-batches with
        pinned rings stay as they are (first in their rank's list when it changes)."""
        ds = [d for d in range(len(self.ranks)) if self.dirty[d]]
        splits = []
        for d in ds:
            self.dirty[d] = False
            self.work += sum(mb.size + 1 for mb in self.ranks[d])
            splits.append([(list(mb.dist), [list(r) for r in mb.local])
                           for mb in self.ranks[d] if mb.size and mb.pin is None])
        out, work, changed = refill(self.ctx, splits, self.ovh, (self.budget - self.work) // 2)
        self.work += work
        # then the pairs of the same ranks re-split (the refill's repacking, if kept)
        out, work, split_changed = resplit(self.ctx, out, self.ovh,
                                           (self.budget - self.work) // 2)
        self.work += work
        for d, split, new, again in zip(ds, out, changed, split_changed):
            if new or again:
                rank = [mb for mb in self.ranks[d] if mb.pin is not None]
                rank += [self._sum(_Mb(list(p[0]), [list(r) for r in p[1]])) for p in split]
                rank.append(self._sum(_Mb([], [[] for _ in range(self.n)])))
                self.ranks[d] = rank
                self.rt[d] = self._rank_time(d)
        return any(changed) or any(split_changed)

    def score(self) -> float:
        self.work += len(self.rt)
        return max(self.rt) + 1e-3 * (sum(self.rt) / len(self.rt))

    def step(self, best_ms: float, cur_score: float) -> Optional[float]:
        """One ruin and recreate; the new score when accepted, else ``None`` (undone)."""
        rng, rt = self.rng, self.rt
        d0 = max(range(len(rt)), key=lambda d: (rt[d], -d))
        self.journal, self.lens = {}, {}
        saved = list(rt)
        picks = self._ruin(d0)
        if not picks:  # d0 holds only pinned rings: every step from here is this no-op
            self.stuck = True
            return None
        self._remove(picks)
        costs = self.ctx.costs
        noisy = rng.below(2) == 0
        keys = [(-(costs[p[2]] * (1.0 + ORDER_NOISE * rng.unit()) if noisy else costs[p[2]]),
                 p[2]) for p in picks]
        target = best_ms * (1.0 - TARGET_NOISE * rng.unit())
        for _, i in sorted(keys):
            if not self._place(i, target):
                self._undo(saved)
                return None
        new = self.score()
        tau = TAU0 * (1.0 - self.work / self.budget)
        if new < cur_score * (1.0 + tau):
            self._compact()
            return new
        self._undo(saved)
        return None

    def snapshot(self) -> list[list[Placement]]:
        self.work += sum(len(rank) + sum(mb.size for mb in rank) for rank in self.ranks)
        return [[mb.placement() for mb in rank if mb.kept()] for rank in self.ranks]


def lns(ctx: GdsContext, splits, overhead: float, budget: int, floor_t: float, pins=None
        ) -> list[list[Placement]]:
    """Ruin and recreate on ``splits`` (``[D][M]`` placements) within ``budget`` work
    units, stopping once the best makespan is at most ``floor_t``
    (:func:`~skrull_ext.scheduler.bound.plan_lower_bound`).

    :func:`~skrull_ext.scheduler.balance.balance_share` of it goes to the final
    :func:`~skrull_ext.scheduler.balance.balance` (not run at the floor).

    ``pins`` (``{id: (seconds [N], tokens [N])}``): a placement ``(distributed, local,
    id)`` carries sub-group rings pinned in its micro-batch (:func:`pinned_rings`), which
    add ``seconds`` and ``tokens`` to its CP ranks.  Its samples move like any other; it
    stays (with its ``id``) even when they all leave; the whole-batch deal and the
    refill skip the DP ranks and micro-batches that hold one, the balance polish sees the
    others, then (with what it left) all of them, the rings' seconds counted.

    Returns equally long micro-batch lists whose slowest DP rank is at most the input's;
    ``budget <= 0`` returns ``splits`` unchanged.
    """
    if budget <= 0:
        return splits
    polish = balance_share(budget, len(ctx.lengths))  # kept for balance() on the best plan
    budget -= polish
    alone_budget = budget // ALONE_DIV if pins and len(splits) > 1 else 0  # on top of it
    spent = 0
    free = [d for d, s in enumerate(splits) if not any(len(p) > 2 for p in s)]
    if not pins and max(ctx.split_time(s, overhead) for s in splits) > floor_t * (1.0 + 1e-9):
        dealt, spent = deal_best(ctx, splits, overhead, budget // 2)
        if dealt is not None:  # faster: the search starts from it
            m = max(1, max(len(s) for s in dealt))
            splits = [s + [([], [[] for _ in range(ctx.cp_size)]) for _ in range(m - len(s))]
                      for s in dealt]
    elif pins:
        if free:  # the DP ranks without pinned rings re-dealt among themselves
            dealt, spent = deal_best(ctx, [splits[d] for d in free], overhead, budget // 2)
            if dealt is not None:
                splits = list(splits)
                for d, s in zip(free, dealt):
                    splits[d] = s
        # then every local sample re-dealt around the rings and distributed samples
        dealt, more = pin_deal_best(ctx, splits, overhead, pins, (budget - spent) // 2)
        spent += more
        if dealt is not None:
            splits = dealt
    search = _Lns(ctx, splits, overhead, budget - spent, pins)
    best, best_key = None, (max(search.rt), search.score())
    search.work = 0
    cur = best_key[1]
    steps = 0
    while (search.work < search.budget and best_key[0] > floor_t * (1.0 + 1e-9)
           and not search.stuck):
        if steps % REFILL_EVERY == 0:  # the first step, then every REFILL_EVERY-th
            got = search.score() if search.refill() else None
        else:
            got = search.step(best_key[0], cur)
        steps += 1
        if got is None:
            continue
        cur = got
        key = (max(search.rt), got)
        if key < best_key:
            best, best_key = search.snapshot(), key
    if best_key[0] > floor_t * (1.0 + 1e-9):
        best, work = polished(ctx, splits if best is None else best, overhead, polish, pins)
        if pins:  # then the cross-DP-rank stages within what the search and polish left
            left = search.budget - search.work + polish - work
            best, _ = after_search(ctx, best, overhead, left,
                                   0 if search.stuck else alone_budget, pins, lns)
    elif best is None:
        return splits
    m = max(1, max(len(s) for s in best))
    return [s + [([], [[] for _ in range(ctx.cp_size)]) for _ in range(m - len(s))]
            for s in best]


__all__ = ["MAX_LNS_SAMPLES", "QMAX", "REFILL_EVERY", "REFILL_FRACS", "REFILL_PLACE_WORK", "SEED", "TAU0", "WORK_UNITS_PER_MS",
           "lns", "refill"]
