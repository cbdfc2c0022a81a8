"""(ours) Cross-DP-rank polish of a plan with pinned rings: local samples of the slowest DP
rank's binding CP ranks moved or swapped into other DP ranks' slots.

The balance polish (:mod:`~skrull_ext.scheduler.balance`) moves samples between the
(micro-batch, CP rank) slots of one DP rank.  On group-fill's plans (one or two micro-batches
per DP rank, one holding pinned sub-group rings, :mod:`~skrull_ext.scheduler.pinned`) the DP
ranks end up within ~1% of each other with every micro-batch's time set by one CP rank
holding one or two large local samples; the 300-ms search then wins by regrouping samples
across DP ranks (issue 31, 7B, CP 16, ``ring``: llama3-sft GBS 256 2x, wikipedia GBS 1024
1x), which ruin and recreate reaches only at ~16x the default budget.

:func:`regroup` repeats, within a work limit: on the slowest DP rank ``d0`` (ties: the lowest
index), for each local sample ``i`` on a CP rank at its micro-batch's top time (micro-batches
and CP ranks in order, the slot's samples in list order), every micro-batch ``j2`` of every
other DP rank ``d`` (in order) is tried at its :data:`DESTS` least loaded CP ranks ``r2`` (in
time, ties: the lower rank): ``i`` moved there (if its tokens fit) or swapped with a cheaper
sample ``i2`` there (in list order; both slots' tokens within the bucket).  A
candidate counts when ``d0``'s new time and ``d``'s are both strictly below ``d0``'s current
time; the best has the least ``(max of the two, d0's)`` (ties: the first found) and is
applied.  It stops when none counts.  Prices are estimates from the slots' sums (the CP rank's
load plus or minus the costs, :func:`~skrull_ext.scheduler.objective.rank_time`, the rings'
seconds added); an applied step re-sums both micro-batches in list order.

The result is kept only where its slowest DP rank is strictly faster than the input's
(``balance._split_time``, the rings counted).  Work: per micro-batch built its samples plus N;
per step the DP ranks; per ``(i, micro-batch)`` pair N plus the samples scanned for swaps
(measured in the C++ core: ~300K units per ms, wikipedia 7B CP 16 GBS 1024);
per applied step both micro-batches' samples plus 2 N; and twice every micro-batch's samples
and CP ranks for the final checks (reserved first).

:func:`after_search` runs it after the pinned search: within what the search and its
polish left, then the pinned deal with the rest, and last :func:`search_alone` (every other
DP rank searched alone, which makes room where the DP ranks tie) and :func:`regroup` again,
with ``lns.ALONE_DIV`` of the budget on top.

This module is the specification; ``csrc/regroup.cpp`` mirrors it (same candidate order,
same float operations, same work count; ``tests/test_regroup.py``).
"""
from __future__ import annotations

from skrull_ext.scheduler.balance import _split_time
from skrull_ext.scheduler.pindeal import pin_deal_best
from skrull_ext.scheduler.reference import GdsContext, Placement, rank_time
from skrull_ext.scheduler.resplit import ring_time
from skrull_ext.sharding import shard_tokens

# Strict improvement margin (relative) a candidate needs against d0's time.
EPS = 1e-12
# CP ranks of each other micro-batch tried as destinations: the least loaded (in time).
DESTS = 4
# search_alone gives each DP rank it searches 1 / (ALONE_SPLIT x (D - 1)) of its units.
ALONE_SPLIT = 2


class _Mb:
    """One micro-batch: its lists, ring sums, per-CP-rank loads, tokens and times."""

    __slots__ = ("dist", "local", "pin", "sec", "comm", "share", "load", "tok", "t", "size")

    def __init__(self, ctx: GdsContext, p: Placement, pins):
        n = ctx.cp_size
        self.dist, self.local = list(p[0]), [list(r) for r in p[1]]
        self.pin = None if len(p) < 3 else p[2]
        self.sec = [0.0] * n if self.pin is None else list(pins[self.pin][0])
        self.sum(ctx, pins)

    def sum(self, ctx: GdsContext, pins) -> int:
        """Re-sums the lists in order; returns the work (samples + N)."""
        n = ctx.cp_size
        self.comm, self.share = ring_time(ctx, self.dist)
        dtok = 0
        for i in self.dist:
            dtok += shard_tokens(int(ctx.lengths[i]), n)
        self.load, self.tok, self.size = [], [], len(self.dist)
        for r in range(n):
            x, tk = 0.0, dtok
            for i in self.local[r]:
                x += float(ctx.costs[i])
                tk += int(ctx.lengths[i])
            self.load.append(x)
            self.tok.append(tk + (0 if self.pin is None else int(pins[self.pin][1][r])))
            self.size += len(self.local[r])
        self.t = [self.time(ctx, r, self.load[r]) for r in range(n)]
        return self.size + n

    def time(self, ctx: GdsContext, r: int, x: float) -> float:
        """CP rank ``r``'s seconds with local work ``x`` (its rings' added)."""
        t = rank_time(x, self.comm, self.share, ctx.cp_size, ctx.objective)
        return max(0.0, t) + self.sec[r]

    def seconds(self, overhead: float) -> float:
        """Its top CP rank plus the overhead; 0 when it holds nothing (no sample, no ring)."""
        return max(self.t) + overhead if self.size or self.pin is not None else 0.0

    def placement(self) -> Placement:
        p = (list(self.dist), [list(r) for r in self.local])
        return p if self.pin is None else p + (self.pin,)


def _rank_seconds(rank: list[_Mb], overhead: float) -> float:
    t = 0.0
    for mb in rank:
        t += mb.seconds(overhead)
    return t


def _best(ctx: GdsContext, ranks, rt, d0: int, overhead: float):
    """The best step from DP rank ``d0`` (see the module doc) and the work counted:
    ``((key, (j, r, i, d, j2, r2, i2)), work)``, ``i2`` -1 for a move; ``None`` if none."""
    n, cap, costs, lengths = ctx.cp_size, ctx.bucket_size, ctx.costs, ctx.lengths
    t0, best, work = rt[d0], None, 0
    bar = t0 * (1.0 - EPS)
    # each other micro-batch's destination CP ranks (least time first), top and seconds
    dests = [[] if d == d0 else
             [(sorted(range(n), key=lambda x, t=mb2.t: (t[x], x))[:DESTS], max(mb2.t),
               mb2.seconds(overhead)) for mb2 in ranks[d]] for d in range(len(ranks))]
    for j, mb in enumerate(ranks[d0]):
        top = max(mb.t)
        old = mb.seconds(overhead)
        empties = mb.size == 1 and mb.pin is None  # a move of its one sample empties it
        for r in range(n):
            if mb.t[r] != top:
                continue
            others = 0.0
            for x in range(n):
                if x != r:
                    others = max(others, mb.t[x])
            for i in mb.local[r]:
                ci, si = float(costs[i]), int(lengths[i])
                for d in range(len(ranks)):
                    if d == d0:
                        continue
                    for j2, mb2 in enumerate(ranks[d]):
                        work += n
                        order, top2, old2 = dests[d][j2]
                        for r2 in order:
                            for i2 in [-1] + mb2.local[r2]:
                                work += i2 >= 0
                                c2 = float(costs[i2]) if i2 >= 0 else 0.0
                                s2 = int(lengths[i2]) if i2 >= 0 else 0
                                if (i2 >= 0 and not c2 < ci) or mb2.tok[r2] + si - s2 > cap:
                                    continue
                                if i2 >= 0 and mb.tok[r] - si + s2 > cap:
                                    continue
                                src = (0.0 if empties and i2 < 0 else
                                       max(others, mb.time(ctx, r, mb.load[r] - ci + c2))
                                       + overhead)
                                nt0 = t0 - old + src
                                dst = max(top2, mb2.time(ctx, r2, mb2.load[r2] + ci - c2))
                                nt = rt[d] - old2 + (dst + overhead)
                                if not (nt0 < bar and nt < bar):
                                    continue
                                key = (max(nt0, nt), nt0)
                                if best is None or key < best[0]:
                                    best = (key, (j, r, i, d, j2, r2, i2))
    return best, work


def regroup(ctx: GdsContext, splits, overhead: float, limit: int, pins=None
            ) -> tuple[list[list[Placement]], int]:
    """``(splits, work)``: the slowest DP rank's binding local samples moved or swapped
    into other DP ranks (module doc), within ``limit`` work units; ``splits`` (unchanged)
    unless the slowest DP rank got strictly faster.

    ``pins``: ``{id: (seconds [N], tokens [N])}`` of the placements ``(distributed, local,
    id)`` holding pinned rings (:func:`~skrull_ext.scheduler.pinned.pinned_rings`).
    """
    n = ctx.cp_size
    if limit <= 0 or n < 2 or len(splits) < 2:
        return splits, 0
    check = 0
    for split in splits:
        for p in split:
            check += 2 * (len(p[0]) + sum(len(r) for r in p[1]) + n)
    if 2 * check >= limit:
        return splits, 0
    limit -= check
    work = 0
    ranks = []
    for split in splits:
        rank = [_Mb(ctx, p, pins) for p in split if p[0] or any(p[1]) or len(p) > 2]
        work += sum(mb.size + n for mb in rank)
        ranks.append(rank)
    rt = [_rank_seconds(rank, overhead) for rank in ranks]
    changed = False
    while work < limit:
        d0 = 0
        for d in range(1, len(ranks)):
            if rt[d] > rt[d0]:
                d0 = d
        work += len(ranks)
        best, spent = _best(ctx, ranks, rt, d0, overhead)
        work += spent
        if best is None:
            break
        j, r, i, d, j2, r2, i2 = best[1]
        mb, mb2 = ranks[d0][j], ranks[d][j2]
        mb.local[r].remove(i)
        mb2.local[r2].append(i)
        if i2 >= 0:
            mb2.local[r2].remove(i2)
            mb.local[r].append(i2)
        work += mb.sum(ctx, pins) + mb2.sum(ctx, pins)
        if not (mb.size or mb.pin is not None):
            del ranks[d0][j]
        rt[d0], rt[d] = _rank_seconds(ranks[d0], overhead), _rank_seconds(ranks[d], overhead)
        changed = True
    work += check
    if not changed:
        return splits, work
    out = [[mb.placement() for mb in rank] for rank in ranks]
    new = max(_split_time(ctx, s, overhead, pins) for s in out)
    if new < max(_split_time(ctx, s, overhead, pins) for s in splits):
        return out, work
    return splits, work


def search_alone(ctx: GdsContext, splits, overhead: float, limit: int, pins, search
                 ) -> tuple[list[list[Placement]], int]:
    """``(splits, work)``: every DP rank but the slowest (ties: the lowest index) searched
    on its own by ``search`` (:func:`~skrull_ext.scheduler.lns.lns`, passed in: it calls
    this module) on that rank alone with ``limit // (ALONE_SPLIT x (D - 1))`` work units
    each, its rings pinned; a rank is kept where it got strictly faster.

    Ruin and recreate ruins the slowest DP rank; where the DP ranks end within a hair of
    each other and the slowest cannot shed work within itself, the others are never
    searched and have no room for its samples.  Searched alone they get faster and make
    that room, which :func:`regroup` then fills (wikipedia, 7B, CP 16, GBS 1024, 1x: one
    DP rank 743.5 -> 723 ms alone).  The work counted is the units given, not those spent
    (both backends).
    """
    times = [_split_time(ctx, s, overhead, pins) for s in splits]
    d0 = max(range(len(splits)), key=lambda d: (times[d], -d))
    others = [d for d in range(len(splits)) if d != d0]
    each = limit // (ALONE_SPLIT * max(1, len(others)))
    if each <= 0 or not others:
        return splits, 0
    out = list(splits)
    for d in others:
        got = [p for p in search(ctx, [splits[d]], overhead, each, 0.0, pins)[0]
               if p[0] or any(p[1]) or len(p) > 2]
        if _split_time(ctx, got, overhead, pins) < times[d]:
            out[d] = got
    return out, each * len(others)


def after_search(ctx: GdsContext, best, overhead: float, left: int, alone: int, pins, search
                 ) -> tuple[list[list[Placement]], int]:
    """``(splits, work)``: the cross-DP-rank stages after the pinned search and its polish
    (:func:`~skrull_ext.scheduler.lns.lns` with pins): :func:`regroup` within ``left``
    units, the pinned deal (:func:`~skrull_ext.scheduler.pindeal.pin_deal_best`) with what
    it leaves (kept when faster), then, with ``alone`` more units (0: skipped),
    :func:`search_alone` by ``search`` and :func:`regroup` again, kept when the slowest DP
    rank gets strictly faster."""
    best, used = regroup(ctx, best, overhead, left, pins)
    work = used
    if left - used > 0:  # the pinned deal once more with the rest
        dealt, more = pin_deal_best(ctx, best, overhead, pins, left - used)
        work += more
        if dealt is not None:
            best = dealt
    if alone > 0:  # then the other DP ranks searched alone, and regroup() again
        out, given = search_alone(ctx, best, overhead, alone, pins, search)
        out, again = regroup(ctx, out, overhead, alone - given, pins)
        work += given + again
        if (max(_split_time(ctx, s, overhead, pins) for s in out)
                < max(_split_time(ctx, s, overhead, pins) for s in best)):
            best = out
    return best, work


__all__ = ["ALONE_SPLIT", "EPS", "after_search", "regroup", "search_alone"]
