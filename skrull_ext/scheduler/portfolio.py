"""(ours) Skrull's portfolio: the fastest of GDS and the baselines' groupings under DACP.

The paper's GDS (LPT over DP ranks, interleaved micro-batches) is one way to group a
global batch; the baselines group it other ways (Karmarkar-Karp over DP ranks and
micro-batches, sorted packs, dataset-order packs, one sample per micro-batch, hybrid CP's
greedy blocks).  The portfolio places every baseline's micro-batches with DACP (or keeps
them all-distributed when that is faster) and keeps the candidate whose predicted
iteration time (the slowest DP rank) is the lowest; ties keep the earlier in
:data:`PORTFOLIO`.  Two candidates of ours place samples themselves
(:mod:`skrull_ext.scheduler.pack`: the long samples distributed in few micro-batches, the
rest leveled over every CP rank's slot; then DACP per micro-batch when faster), for tight
buckets with large batches, where hybrid CP's sub-group rings beat the groupings above;
a third (:mod:`skrull_ext.scheduler.level`: one micro-batch per DP rank, the longest
samples on a single ring) for small batches, where a ring on every DP rank costs more
than the long samples.  Because a baseline's
own all-CP placement of each micro-batch is a candidate, and the prediction sums the
same micro-batch times in the same order, Skrull's predicted time is never above that of
``kk``, ``sorted``, ``all-cp`` or ``per-seq-cp`` on the same cost model.

This module is the specification; ``csrc/portfolio.cpp`` mirrors it function for
function (``tests/test_parity.py``).  Candidates whose grouping would be expensive on
huge batches (Karmarkar-Karp states of ``items x parts``, hybrid CP's first-fit over
micro-batches) are skipped when ``K x`` the estimated micro-batches per DP rank exceeds
:data:`MAX_GROUPING_WORK` (a size rule, so the plan is the same on every run).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from skrull_ext.scheduler.baselines import GROUPINGS
from skrull_ext.scheduler.bound import plan_lower_bound
from skrull_ext.scheduler.level import level_schedule
from skrull_ext.scheduler.pack import PACK_SPREAD, PACK_THRESHOLDS, pack_schedule, pack_threshold
from skrull_ext.scheduler.reference import GdsContext, Placement, gds_schedule
import skrull_ext.scheduler.lns as lns_mod
import skrull_ext.scheduler.refine as refine_mod
from skrull_ext.scheduler.refine import all_distributed, place_group, placement_time

# Candidates in order (ties keep the earlier): the sorted grouping first (cheap, and a good
# bar: C++ stops GDS as soon as GDS cannot beat it), then GDS, then the other groupings,
# then ours that place samples themselves (:mod:`skrull_ext.scheduler.pack`,
# :mod:`skrull_ext.scheduler.level`).
PORTFOLIO = (("sorted", "gds", "kk", "all-cp", "per-seq-cp", "hybrid-cp") + tuple(PACK_THRESHOLDS)
             + ("level",))
# Groupings whose cost grows with K x micro-batches per DP rank.
COSTLY_GROUPINGS = ("kk", "hybrid-cp")
MAX_GROUPING_WORK = 1 << 20
# The pack candidates (O(K log K) each) are skipped above this many samples (a size rule:
# they matter at GBS ~4096 with a tight bucket, and cost ~10 ms each at K = 65,536).
MAX_PACK_SAMPLES = 1 << 14


def grouping_work(lengths, dp_size: int, cp_size: int, bucket_size: int) -> int:
    """``K x ceil(sum S / (C N D))``: the size rule for :data:`COSTLY_GROUPINGS`."""
    total = sum(int(s) for s in lengths)
    return len(lengths) * max(1, -(-total // (bucket_size * cp_size * dp_size)))


def place_groups(ctx: GdsContext, groups: Sequence[Sequence[Sequence[int]]], overhead: float,
                 best_t: float) -> Optional[list[list[Placement]]]:
    """:func:`place_group` of every DP rank's micro-batches.

    ``None`` if one cannot be placed, or as soon as a DP rank's running
    :meth:`GdsContext.split_time` reaches ``best_t`` (it only grows, and a candidate must
    be strictly faster to win).
    """
    out = []
    for rank in groups:
        placed, t = [], 0.0
        for group in rank:
            p = place_group(ctx, group)
            if p is None:
                return None
            placed.append(p)
            t += placement_time(ctx, p) + overhead
            if t >= best_t:
                return None
        out.append(placed)
    return out


def dacp_each(ctx: GdsContext, splits) -> list[list[Placement]]:
    """Each micro-batch of ``splits`` that has a local sample re-placed by
    :func:`place_group` (its samples: distributed first, then CP rank by rank) when that is
    strictly faster (skipping the others keeps this cheap where most are all long).

    The pack candidates leave few local samples in a micro-batch whose shards fill most of
    the bucket, one per CP rank, so the largest sets the micro-batch's time; distributing
    them (DACP decides) can be cheaper.
    """
    out = []
    for split in splits:
        rank = []
        for p in split:
            if not any(p[1]):  # no local sample: every one had to be distributed
                rank.append(p)
                continue
            alt = place_group(ctx, list(p[0]) + [i for r in p[1] for i in r])
            better = alt is not None and placement_time(ctx, alt) < placement_time(ctx, p)
            rank.append(alt if better else p)
        out.append(rank)
    return out


def iteration_time(ctx: GdsContext, splits, overhead: float) -> float:
    """The slowest DP rank's :meth:`GdsContext.split_time`."""
    worst = 0.0
    for split in splits:
        worst = max(worst, ctx.split_time(split, overhead))
    return worst


def refine_and_lns(ctx: GdsContext, splits, dp_size: int, overhead: float, budget: int
                   ) -> list[list[Placement]]:
    """The local search with at most half of ``budget`` (refine units), then ruin and
    recreate with the rest, converted to its own units (skipped above
    :data:`~skrull_ext.scheduler.lns.MAX_LNS_SAMPLES` samples)."""
    splits, spent = refine_mod.refine_spent(ctx, splits, overhead, budget // 2)
    if len(ctx.lengths) > lns_mod.MAX_LNS_SAMPLES:
        return splits
    rest = (budget - spent) * lns_mod.WORK_UNITS_PER_MS // refine_mod.WORK_UNITS_PER_MS
    return lns_mod.lns(ctx, splits, overhead, rest, plan_lower_bound(ctx, dp_size, overhead))


def portfolio_schedule(lengths, costs, comm, latency: float, dp_size: int, cp_size: int,
                       bucket_size: int, rollback: str = "auto", overhead: float = 0.0,
                       variant: str = "auto", shares=None, objective: str = "paper",
                       candidates: Sequence[str] = PORTFOLIO, budget: int = 0
                       ) -> list[list[Placement]]:
    """Each of ``candidates`` in order (``gds``: :func:`gds_schedule`; ``pack``/``pack-95``:
    :func:`~skrull_ext.scheduler.pack.pack_schedule`, up to :data:`MAX_PACK_SAMPLES` samples; a baseline name: its grouping placed
    by :func:`place_groups`); the lowest :func:`iteration_time` wins (ties:
    the earlier), then :func:`~skrull_ext.scheduler.refine.refine` improves it within
    ``budget`` work units (0: no refinement).  Same return value as
    :func:`~skrull_ext.scheduler.reference.gds_schedule` (equal micro-batch counts)."""
    ctx = GdsContext(lengths, costs, comm, latency, cp_size, bucket_size, rollback, variant,
                     shares, objective)
    best, best_t = None, math.inf
    costly = grouping_work(lengths, dp_size, cp_size, bucket_size) > MAX_GROUPING_WORK
    for name in candidates:
        if name == "gds":
            placed = gds_schedule(lengths, costs, comm, latency, dp_size, cp_size, bucket_size,
                                  rollback, overhead, variant, shares, objective)
        elif name in PACK_THRESHOLDS:
            if len(lengths) > MAX_PACK_SAMPLES:
                continue
            placed = dacp_each(ctx, pack_schedule(lengths, costs, shares, dp_size, cp_size,
                                                  bucket_size, pack_threshold(name, bucket_size),
                                                  spread=name in PACK_SPREAD))
        elif name == "level":
            placed = level_schedule(ctx, dp_size, overhead, best_t)
        elif costly and name in COSTLY_GROUPINGS:
            continue
        else:
            placed = place_groups(ctx, GROUPINGS[name](lengths, costs, dp_size, cp_size,
                                                       bucket_size), overhead, best_t)
        if placed is None:
            continue
        t = iteration_time(ctx, placed, overhead)
        if t < best_t:
            best, best_t = placed, t
    best = refine_and_lns(ctx, best, dp_size, overhead, budget)
    m = max(len(s) for s in best)
    for split in best:
        split.extend(([], [[] for _ in range(cp_size)]) for _ in range(m - len(split)))
    return best


__all__ = ["COSTLY_GROUPINGS", "MAX_GROUPING_WORK", "MAX_PACK_SAMPLES", "dacp_each", "PORTFOLIO", "all_distributed",
           "grouping_work", "iteration_time", "place_group", "place_groups",
           "portfolio_schedule", "refine_and_lns"]
