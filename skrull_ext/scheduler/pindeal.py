"""(ours) The whole batch re-dealt around pinned sub-group rings, before ruin and recreate.

Ruin and recreate on group-fill's plan (:func:`~skrull_ext.scheduler.lns.lns` with
``pins``) starts where the greedy left it, and that greedy fills the CP ranks DP rank by DP
rank: at 7B, CP 16, GBS 256 (lmsyschat1m, 1x bucket; one micro-batch per DP rank) every
CP rank of the batch sat at ~225 ms but five of one DP rank's, which were empty, and one
local sample alone took ~226 ms.  The DP ranks tie within 0.01%, so no ruin of the
slowest one gains until the others gain too; the 300 ms search found the way out after
~200x the default budget (1.2% faster), by spreading the idle ranks' share over the
batch and sharding the two largest local samples over full rings.

:func:`pin_deal` does that in one pass.  Every micro-batch keeps its distributed samples
and pinned rings (their seconds and tokens start each CP rank's time and load), each DP
rank gets one empty micro-batch more, and every local sample of the batch, costliest
first (ties: the lower index), goes where its DP rank's time after it plus 1e-3 x the
time it adds is least (ties: the first): whole on the CP rank of a micro-batch whose time
after it is least among those with room (ties: the lower rank), or, in mode ``dist``, also
onto that micro-batch's full ring (its shard on every CP rank, the ring's transfers and
share added) where the sample takes at least half the micro-batch's time so far (a short
sample rarely gains from a ring's transfers; the gate keeps the deal's cost near a keep
deal's).  A DP rank whose time already reaches the best key is skipped (no key there can
beat it).  A rank's time in a micro-batch is
:func:`~skrull_ext.scheduler.objective.rank_time` of its local work under the full ring,
plus its pinned rings' seconds, as :mod:`~skrull_ext.scheduler.balance` prices it.
:func:`pin_deal_best` runs both modes (:data:`PIN_DEAL_MODES`) and keeps the faster
result when its slowest DP rank is strictly faster than the input's;
:func:`~skrull_ext.scheduler.lns.lns` calls it before the pinned search and once more
after :func:`~skrull_ext.scheduler.regroup.regroup`, with what the budget left (at
lmsyschat1m GBS 256, 0.5x bucket, where the first finds nothing: 0.883 -> 0.879 s).  Measured on that
setting (issue 31's grid, batch 0): the deal alone 0.249 -> 0.244 s per DP rank (``dist``;
``keep``: no gain, the 226 ms sample sets the time), the plan after the search 0.849 ->
0.839 s, the 300 ms search's time (docs/scheduler.md: the whole grid).

This module is the specification; ``csrc/pindeal.cpp`` mirrors it (same order of float
operations, same work count; ``tests/test_pindeal.py``).
"""
from __future__ import annotations

from typing import Optional

from skrull_ext.scheduler.balance import _split_time
from skrull_ext.scheduler.reference import GdsContext, Placement, rank_time
from skrull_ext.scheduler.resplit import _size, charge_deal
from skrull_ext.sharding import shard_tokens

# pin_deal()'s modes: local placements only, or the full ring of a micro-batch too.
PIN_DEAL_MODES = ("keep", "dist")
# Work units of pricing one sample on a micro-batch's full ring (N rank times), per CP rank.
RING_WORK = 2


class _Slot:
    """One skeleton micro-batch: its placement so far, ring sums, per CP rank load,
    tokens, pinned seconds, and its time so far (0 while empty)."""

    def __init__(self, ctx: GdsContext, dist: list[int], pid, pins, overhead: float):
        n = ctx.cp_size
        self.p = (list(dist), [[] for _ in range(n)]) + (() if pid is None else (pid,))
        self.raw_comm, self.raw_dist = 0.0, 0.0  # summed in list order, as ring_time
        for i in dist:
            self.raw_comm += ctx.comm[i]
            self.raw_dist += ctx.costs[i] / n if ctx.shares is None else ctx.shares[i]
        dtok = sum(shard_tokens(int(ctx.lengths[i]), n) for i in dist)
        self.psec = [0.0] * n if pid is None else list(pins[pid][0])
        self.tok = [dtok + (0 if pid is None else int(pins[pid][1][x])) for x in range(n)]
        self.load = [0.0] * n
        self.top = 0.0
        if dist or pid is not None:
            self.top = max(self.rank(ctx, x, 0.0) for x in range(n)) + overhead

    def rank(self, ctx: GdsContext, x: int, add: float) -> float:
        """CP rank ``x``'s time with ``add`` more local work (overheads excluded)."""
        if not self.p[0]:  # nothing on the full ring: rank_time is the local work itself
            return max(0.0, self.load[x] + add) + self.psec[x]
        t = rank_time(self.load[x] + add, self.raw_comm + ctx.latency, self.raw_dist,
                      ctx.cp_size, ctx.objective)
        return max(0.0, t) + self.psec[x]

    def local(self, ctx: GdsContext, s: int, c: float):
        """``(CP rank, its time after)`` for a whole sample of ``s`` tokens and cost ``c``,
        the least time among the ranks with room (ties: the lower; without a full ring the
        least load plus rings' seconds, the same rank but for rounding, N compares instead
        of N rank times); ``None``: no room."""
        j, tj = -1, 0.0
        if not self.p[0]:  # no full ring: a rank's time is its load plus its rings' seconds
            for x in range(ctx.cp_size):
                if self.tok[x] + s <= ctx.bucket_size and (
                        j < 0 or self.load[x] + self.psec[x] < self.load[j] + self.psec[j]):
                    j = x
            return None if j < 0 else (j, self.rank(ctx, j, c))
        for x in range(ctx.cp_size):
            if self.tok[x] + s > ctx.bucket_size:
                continue
            t = self.rank(ctx, x, c)
            if j < 0 or t < tj:
                j, tj = x, t
        return None if j < 0 else (j, tj)

    def ring(self, ctx: GdsContext, i: int) -> Optional[float]:
        """The micro-batch's time (overheads excluded) with sample ``i`` on its full ring;
        ``None`` when its shard does not fit every CP rank."""
        n = ctx.cp_size
        sh = shard_tokens(int(ctx.lengths[i]), n)
        if any(t + sh > ctx.bucket_size for t in self.tok):
            return None
        raw_comm = self.raw_comm + ctx.comm[i]
        raw_dist = self.raw_dist + (ctx.costs[i] / n if ctx.shares is None else ctx.shares[i])
        comm = raw_comm + ctx.latency
        return max(max(0.0, rank_time(self.load[x], comm, raw_dist, n, ctx.objective))
                   + self.psec[x] for x in range(n))

    def put(self, ctx: GdsContext, i: int, x: int, t: float) -> None:
        """Sample ``i`` whole on CP rank ``x`` (``x`` -1: on the full ring); ``t`` the new
        time of that rank (of the micro-batch for the ring), overhead included."""
        n = ctx.cp_size
        if x < 0:
            self.p[0].append(i)
            self.raw_comm += ctx.comm[i]
            self.raw_dist += ctx.costs[i] / n if ctx.shares is None else ctx.shares[i]
            sh = shard_tokens(int(ctx.lengths[i]), n)
            self.tok = [v + sh for v in self.tok]
        else:
            self.p[1][x].append(i)
            self.load[x] += ctx.costs[i]
            self.tok[x] += int(ctx.lengths[i])
        self.top = max(self.top, t)


def pin_deal(ctx: GdsContext, splits, overhead: float, pins, mode: str, limit: int
             ) -> tuple[Optional[list[list[Placement]]], int]:
    """Every local sample of ``splits`` re-dealt around their distributed samples and
    pinned rings (module docstring): ``(splits or None, work)``; ``None`` when a sample
    fits nowhere or the work would reach ``limit``.  Work: the skeleton's micro-batches
    and samples, then per dealt sample ``2 + len(skeleton) x (N + 1) // 3`` (estimated
    first), and :data:`RING_WORK` ``x N`` per full ring priced (counted as it goes)."""
    n, lengths, costs = ctx.cp_size, ctx.lengths, ctx.costs
    full = [(r, p) for r, split in enumerate(splits) for p in split if _size(p) or len(p) > 2]
    work = len(full) + sum(_size(p) for _, p in full)
    skel = [(r, _Slot(ctx, p[0], p[2] if len(p) > 2 else None, pins, overhead))
            for r, p in full]
    skel += [(r, _Slot(ctx, [], None, pins, overhead)) for r in range(len(splits))]
    pool = [i for _, p in full for rank in p[1] for i in rank]
    charged = charge_deal(ctx, pool, len(skel), work, limit)
    if charged is None:
        return None, work
    work = charged
    rt = [0.0] * len(splits)
    for r, slot in skel:
        rt[r] += slot.top
    for i in pool:
        s, c = int(lengths[i]), costs[i]
        best = None  # (key, skeleton index, CP rank or -1, added, time)
        for k, (r, slot) in enumerate(skel):
            if best is not None and rt[r] >= best[0]:  # every key here is at least rt[r]
                continue
            got = slot.local(ctx, s, c)
            if got is not None:
                t = got[1] + overhead
                added = max(t, slot.top) - slot.top
                key = (rt[r] + added) + 1e-3 * added
                if best is None or key < best[0]:
                    best = (key, k, got[0], added, t)
            if mode == "dist" and 2.0 * c >= slot.top - overhead:
                work += RING_WORK * n
                if work >= limit:
                    return None, work
                ring = slot.ring(ctx, i)
                if ring is not None:
                    t = ring + overhead
                    added = max(t, slot.top) - slot.top
                    key = (rt[r] + added) + 1e-3 * added
                    if best is None or key < best[0]:
                        best = (key, k, -1, added, t)
        if best is None:
            return None, work
        _, k, x, added, t = best
        skel[k][1].put(ctx, i, x, t)
        rt[skel[k][0]] += added
    out: list[list[Placement]] = [[] for _ in splits]
    for r, slot in skel:
        if _size(slot.p) or len(slot.p) > 2:
            out[r].append(slot.p)
    return out, work


def pin_deal_best(ctx: GdsContext, splits, overhead: float, pins, limit: int
                  ) -> tuple[Optional[list[list[Placement]]], int]:
    """:func:`pin_deal` in each of :data:`PIN_DEAL_MODES` within ``limit`` work units in
    all: ``(the fastest dealt plan, work)`` when its slowest DP rank is strictly faster
    than the input's (priced with the pinned rings), else ``(None, work)``.  Pricing a plan
    counts its samples and N per micro-batch."""
    work = sum(_size(p) + ctx.cp_size for split in splits for p in split)
    cur = max(_split_time(ctx, split, overhead, pins) for split in splits)
    best = None
    for mode in PIN_DEAL_MODES:
        got, spent = pin_deal(ctx, splits, overhead, pins, mode, limit - work)
        work += spent
        if got is None:
            continue
        work += sum(_size(p) + ctx.cp_size for split in got for p in split)
        t = max(_split_time(ctx, split, overhead, pins) for split in got)
        if t < cur:
            best, cur = got, t
    return best, work


__all__ = ["PIN_DEAL_MODES", "RING_WORK", "pin_deal", "pin_deal_best"]
