"""(ours) CP-balance polish of a plan: one DP rank's local samples moved and swapped
between the (micro-batch, CP rank) slots of that rank.

A micro-batch's time is set by its most loaded CP rank, a DP rank's time is the sum of its
micro-batches'.  Ruin and recreate (:mod:`skrull_ext.scheduler.lns`) places whole samples
by a rank-level key and leaves the CP ranks of a micro-batch up to ~12% apart where the
300 ms search's plans have them within ~0.1% (lmsyschat1m, 7B, CP 16, GBS 1024: a
micro-batch's CP ranks at 77-103 ms against 110-111 ms balanced).  Closing that gap takes
many single-sample moves that each change one micro-batch's time by little, or nothing at
all where two CP ranks tie at the top.

:func:`balance` does them directly, on the slowest DP rank (ties: the lowest index) until
no step improves it or the work limit is reached (a rank that cannot improve ends the pass:
the makespan cannot fall further).  A step must lower the rank's key ``(sum over
micro-batches of max_r t_r, sum of t_r^2)`` (lexicographic; ``t_r`` the CP rank's
:func:`~skrull_ext.scheduler.objective.rank_time`): the first term is the rank's time
without overheads, the second lets a step cross a plateau where CP ranks tie at the top
(one of them unloaded, the time unchanged).

The source is the most loaded CP rank of a micro-batch (CP ranks ordered by time, then
load, descending; ties: the lower rank), the micro-batches tried widest load spread first
(ties: the lower index); the first with an improving candidate gives the step, its best
one (ties: the first found).  Destinations: the :data:`DESTS` least loaded CP ranks of
every micro-batch of the rank, each with a target transfer ``delta``: half the load gap
within the micro-batch; across micro-batches the source's time margin over its second
rank, capped at the destination's room under its own micro-batch's top (half the load gap
when that is not positive).  Moves try the :data:`WINDOW` samples on either side of
``delta`` in the source's cost order, swaps for each source sample ``i`` the
:data:`WINDOW` on either side of ``cost_i - delta`` in the destination's (cheaper than
``i`` only).  Every candidate keeps its CP ranks within the bucket (the micro-batch's
shard tokens counted).  Distributed samples stay where they are.  (Swaps of one sample for
two were tried: no gain on issue 31's settings, where token-full CP ranks limit it.)

With ``pins`` (:func:`~skrull_ext.scheduler.lns.lns`'s, on group-fill's plans), a
micro-batch holding pinned sub-group rings takes part too: each CP rank's time is its own
plus its rings' seconds, its tokens include their shards, and the spread and the target
transfer are in time (the most loaded CP rank no longer sets the micro-batch's time).
Without it, the pass saw only the micro-batches without rings, chose the slowest DP rank
by those alone and stopped where that rank had no step (issue 31: 168 of 720 batches
faster with it, none slower).

Each rank that changed is kept only where :meth:`GdsContext.split_time` (with pins: the
same sum with their seconds) says it got strictly faster, so no DP rank gets slower.  The work count (the same in both backends):
per rank's slots ``size + N`` to build, per step an estimate from the slot sizes
(:data:`PAIR_WORK` per source-destination pair plus its source's samples,
:data:`EVAL_WORK` per candidate), per applied step :data:`APPLY_WORK` ``+ 2 N``, and twice
every micro-batch's samples and CP ranks for the final checks (reserved first: a limit
below twice that does nothing); a search whose estimate would reach the limit is not
started.

This module is the specification; ``csrc/balance.cpp`` mirrors it (same candidate order,
same float operations, same work count; ``tests/test_balance.py``).
"""
from __future__ import annotations

import bisect
import math

from skrull_ext.scheduler.reference import GdsContext, Placement, rank_time
from skrull_ext.scheduler.resplit import ring_time
from skrull_ext.sharding import shard_tokens

# Least loaded CP ranks of each micro-batch tried as destinations.
DESTS = 16
# Candidates on either side of the target transfer in a slot's cost order.
WINDOW = 1
# Work units per candidate priced and per source-destination pair (two bisections).
# Checked against ruin and recreate's 300K units per ms (2026-11-26, `_C.balance` on
# unrefined plans of issue 31's user file, 0.5B CP 8 and 7B CP 16 at GBS 1024, min of 5,
# the Python-to-C++ conversion included): 370-840K units per ms, so the pass spends at
# most its share of the budget in time, up to ~2.7x less; kept (lowering them changes plans).
EVAL_WORK = 4
PAIR_WORK = 2
# Work units of an applied step besides sorting its micro-batches' CP ranks (2 N).
APPLY_WORK = 8
# Share of ruin and recreate's budget kept for this pass (lns.lns: 1 / BALANCE_DIV).
BALANCE_DIV = 8
# Batches below this many samples keep the whole budget for ruin and recreate (issue 31's
# grid, GBS 64: never faster with the polish, up to 0.12% slower with the budget it takes).
BALANCE_MIN_SAMPLES = 256


def balance_share(budget: int, k: int) -> int:
    """The part of ruin and recreate's ``budget`` kept for :func:`balance` on a batch of
    ``k`` samples: ``budget // BALANCE_DIV``, 0 below :data:`BALANCE_MIN_SAMPLES`."""
    return budget // BALANCE_DIV if k >= BALANCE_MIN_SAMPLES else 0


class _Rank:
    """One DP rank's non-empty micro-batches: slots, sums, times, CP ranks by time."""

    def __init__(self, ctx: GdsContext, split: list[Placement], pins=None):
        self.ctx, n = ctx, ctx.cp_size
        self.n, self.work = n, 0
        self.split = split
        # pinned rings (lns.lns's pins): a micro-batch holding one is kept even when empty
        self.js = [j for j, p in enumerate(split) if p[0] or any(p[1]) or len(p) > 2]
        self.comm, self.share, self.loc, self.srt = [], [], [], []
        self.load, self.tok, self.t, self.order = [], [], [], []
        self.pin = []  # per micro-batch: the rings' seconds [N] per CP rank, or None
        for j in self.js:
            dist, local = split[j][0], split[j][1]
            pin = None if len(split[j]) < 3 else pins[split[j][2]]
            self.pin.append(None if pin is None else pin[0])
            comm, share = ring_time(ctx, dist)
            dtok = sum(shard_tokens(int(ctx.lengths[i]), n) for i in dist)
            self.comm.append(comm)
            self.share.append(share)
            self.loc.append([list(r) for r in local])
            self.srt.append([sorted((float(ctx.costs[i]), i) for i in r) for r in local])
            loads, toks = [], []
            for r in local:
                x, tk = 0.0, dtok
                for i in r:
                    x += float(ctx.costs[i])
                    tk += int(ctx.lengths[i])
                loads.append(x)
                toks.append(tk)
                self.work += len(r)
            if pin is not None:
                toks = [t + x for t, x in zip(toks, pin[1])]
            self.load.append(loads)
            self.tok.append(toks)
            self.t.append([self.rt(len(self.t), r, x) for r, x in enumerate(loads)])
            self.order.append(self._order(len(self.order)))
            self.work += len(dist) + 2 * n
        self.changed = False
        self.est = self.estimate()

    def rt(self, m: int, r: int, x: float) -> float:
        t = rank_time(x, self.comm[m], self.share[m], self.n, self.ctx.objective)
        return t if self.pin[m] is None else max(0.0, t) + self.pin[m][r]

    def spread(self, m: int) -> float:
        """The gap a step may close in micro-batch ``m``: its most minus least loaded CP
        rank's load, or time where pinned rings make the ranks' times differ."""
        lo, hi = self.order[m][self.n - 1], self.order[m][0]
        if self.pin[m] is None:
            return self.load[m][hi] - self.load[m][lo]
        return self.t[m][hi] - self.t[m][lo]

    def _order(self, m: int) -> list[int]:
        t, x = self.t[m], self.load[m]
        return sorted(range(self.n), key=lambda r: (-t[r], -x[r], r))

    def top(self, m: int) -> float:
        return self.t[m][self.order[m][0]]

    def other(self, m: int, a: int, b: int) -> float:
        """The highest time in micro-batch ``m`` but CP ranks ``a`` and ``b``."""
        for r in self.order[m][:3]:
            if r != a and r != b:
                return self.t[m][r]
        return -math.inf

    def estimate(self) -> float:
        """The rank's time without overheads: its micro-batches' tops summed in order."""
        s = 0.0
        for m in range(len(self.js)):
            s += self.top(m)
        return s

    def sources(self) -> list[int]:
        """The micro-batches by load spread (most loaded minus least loaded CP rank), widest
        first (ties: the lower index)."""
        return sorted(range(len(self.js)), key=lambda m: (-self.spread(m), m))

    def source_work(self, m: int) -> int:
        """What :meth:`best_from` counts for source micro-batch ``m``."""
        s = len(self.loc[m][self.order[m][0]])
        pairs = len(self.js) * min(DESTS, self.n)
        return 1 + pairs * (PAIR_WORK + s + EVAL_WORK * 2 * WINDOW * (1 + s))

    def _price(self, m, r, m2, r2, xs, xd):
        """``(d primary, d secondary, new t source, new t destination)``."""
        ts, td = self.rt(m, r, xs), self.rt(m2, r2, xd)
        if m == m2:
            dp = max(ts, td, self.other(m, r, r2)) - self.top(m)
        else:
            dp = ((max(ts, self.other(m, r, -1)) - self.top(m))
                  + (max(td, self.other(m2, r2, -1)) - self.top(m2)))
        os, od = self.t[m][r], self.t[m2][r2]
        return dp, (ts * ts - os * os) + (td * td - od * od), ts, td

    def best_from(self, m: int):
        """The best step from micro-batch ``m``'s most loaded CP rank:
        ``(m, r, m2, r2, i, j, xs, xd, ts, td)`` (``j`` -1: a move) or ``None``."""
        best, key = None, (0.0, 0.0)
        r = self.order[m][0]
        if not self.srt[m][r]:
            return None
        second = self.other(m, r, -1)
        for m2 in range(len(self.js)):
            for q in range(1, min(DESTS, self.n) + 1):
                r2 = self.order[m2][self.n - q]
                if m2 == m and r2 == r:
                    continue
                delta = (self.load[m][r] - self.load[m2][r2]) / 2.0
                if self.pin[m] is not None or self.pin[m2] is not None:
                    delta = (self.t[m][r] - self.t[m2][r2]) / 2.0
                if m2 != m:
                    room = min(self.t[m][r] - second, self.top(m2) - self.t[m2][r2])
                    if room > 0.0:
                        delta = room
                if delta > 0.0:
                    key, best = self._pair(m, r, m2, r2, delta, key, best)
        return best

    def _pair(self, m: int, r: int, m2: int, r2: int, delta: float, key, best):
        """:meth:`best_from`'s candidates from CP rank ``r`` of ``m`` to ``r2`` of ``m2``:
        the moves of the sources whose work is nearest ``delta``, then the swaps whose
        difference is; returns the improved ``(key, best)`` (strictly lower keys only)."""
        cap, lengths = self.ctx.bucket_size, self.ctx.lengths
        src, dst = self.srt[m][r], self.srt[m2][r2]
        ls, toks = self.load[m][r], self.tok[m][r]
        ld, tokd = self.load[m2][r2], self.tok[m2][r2]
        lo = bisect.bisect_left(src, (delta, -1))
        for k in range(max(0, lo - WINDOW), min(len(src), lo + WINDOW)):
            ci, i = src[k]
            if tokd + int(lengths[i]) > cap:
                continue
            got = self._price(m, r, m2, r2, ls - ci, ld + ci)
            if got[:2] < key:
                key, best = got[:2], (m, r, m2, r2, i, -1, ls - ci, ld + ci) + got[2:]
        for ci, i in src:
            si = int(lengths[i])
            lo = bisect.bisect_left(dst, (ci - delta, -1))
            for k in range(max(0, lo - WINDOW), min(len(dst), lo + WINDOW)):
                cj, j = dst[k]
                sj = int(lengths[j])
                if not cj < ci or toks - si + sj > cap or tokd + si - sj > cap:
                    continue
                xs, xd = ls - ci + cj, ld + ci - cj
                got = self._price(m, r, m2, r2, xs, xd)
                if got[:2] < key:
                    key, best = got[:2], (m, r, m2, r2, i, j, xs, xd) + got[2:]
        return key, best

    def apply(self, step) -> None:
        m, r, m2, r2, i, j, xs, xd, ts, td = step
        lengths, costs = self.ctx.lengths, self.ctx.costs
        for a, b, x in ((m, r, i), (m2, r2, j)) if j >= 0 else ((m, r, i),):
            self.loc[a][b].remove(x)
            self.srt[a][b].remove((float(costs[x]), x))
        self.loc[m2][r2].append(i)
        bisect.insort(self.srt[m2][r2], (float(costs[i]), i))
        si = int(lengths[i])
        self.tok[m][r] -= si
        self.tok[m2][r2] += si
        if j >= 0:
            self.loc[m][r].append(j)
            bisect.insort(self.srt[m][r], (float(costs[j]), j))
            sj = int(lengths[j])
            self.tok[m][r] += sj
            self.tok[m2][r2] -= sj
        self.load[m][r], self.load[m2][r2] = xs, xd
        self.t[m][r], self.t[m2][r2] = ts, td
        self.order[m] = self._order(m)
        if m2 != m:
            self.order[m2] = self._order(m2)
        self.work += APPLY_WORK + 2 * self.n
        self.changed = True
        self.est = self.estimate()

    def result(self) -> list[Placement]:
        out = list(self.split)
        for m, j in enumerate(self.js):
            out[j] = (list(self.split[j][0]), [list(r) for r in self.loc[m]]) + self.split[j][2:]
        return out

    def time(self, overhead: float) -> float:
        """The rank's seconds as the pricing sums them (micro-batches in order)."""
        t = 0.0
        for m in range(len(self.js)):
            t += self.top(m) + overhead
        return t


def balance(ctx: GdsContext, splits, overhead: float, limit: int, pins=None
            ) -> tuple[list[list[Placement]], int]:
    """The polish of ``splits`` (``[D][M]`` placements) within ``limit`` work units (see
    the module docstring).

    Returns ``(splits, work)``: the same micro-batches (empty ones untouched), a DP rank
    changed only where its ``split_time`` fell strictly; ``limit <= 0`` or one CP rank
    returns ``splits`` unchanged.
    """
    if limit <= 0 or ctx.cp_size < 2 or not splits:
        return splits, 0
    check = 2 * sum(len(p[0]) + sum(len(r) for r in p[1]) + ctx.cp_size
                    for split in splits for p in split)
    if 2 * check >= limit:  # building the ranks costs at most `check`
        return splits, 0
    limit -= check  # the final split_time checks
    ranks = [_Rank(ctx, s, pins) for s in splits]
    work = sum(rk.work for rk in ranks)
    for rk in ranks:
        rk.work = 0
    while work < limit:
        d = 0
        for x in range(1, len(ranks)):
            if (ranks[x].est + overhead * len(ranks[x].js)
                    > ranks[d].est + overhead * len(ranks[d].js)):
                d = x
        rk = ranks[d]
        work += len(ranks) + len(rk.js)
        step = None
        for m in rk.sources():
            cost = rk.source_work(m)
            if work + cost + APPLY_WORK + 2 * ctx.cp_size >= limit:
                break
            work += cost
            step = rk.best_from(m)
            if step is not None:
                break
        if step is None:
            break
        rk.apply(step)
        work += rk.work
        rk.work = 0
    out = []
    for split, rk in zip(splits, ranks):
        new = split
        if rk.changed:
            cand = rk.result()
            if _split_time(ctx, cand, overhead, pins) < _split_time(ctx, split, overhead, pins):
                new = cand
        out.append(new)
    return out, work + check


def _split_time(ctx: GdsContext, split, overhead: float, pins) -> float:
    """``ctx.split_time``, or with pinned rings (``pins``) the rank's seconds summed from
    its lists in order as :func:`~skrull_ext.scheduler.pricing.predict` does."""
    if not pins:
        return ctx.split_time(split, overhead)
    return _Rank(ctx, split, pins).time(overhead)


def polished(ctx: GdsContext, splits, overhead: float, polish: int, pins=None
             ) -> tuple[list[list[Placement]], int]:
    """:func:`~skrull_ext.scheduler.lns.lns`'s polish: :func:`balance` of each DP rank's
    micro-batches without pinned rings (those first, as they are); with pinned rings, then
    a second pass within what the first left of ``polish``, those micro-batches included
    (their rings' seconds and tokens counted per CP rank, so it also works on the DP rank
    that is slowest with them and can move a rank's samples into and out of them).
    Returns ``(splits, work)``."""
    if not any(len(p) > 2 for s in splits for p in s):
        return balance(ctx, splits, overhead, polish)
    pinned = [[p for p in s if len(p) > 2] for s in splits]
    free = [[p for p in s if len(p) < 3 and (p[0] or any(p[1]))] for s in splits]
    done, work = balance(ctx, free, overhead, polish)
    out, second = balance(ctx, [a + list(b) for a, b in zip(pinned, done)], overhead,
                          polish - work, pins)
    return out, work + second


__all__ = ["APPLY_WORK", "BALANCE_DIV", "BALANCE_MIN_SAMPLES", "DESTS", "EVAL_WORK", "PAIR_WORK",
           "WINDOW", "balance", "balance_share", "polished"]
