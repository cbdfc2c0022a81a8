"""(ours) The ``level`` candidate of Skrull's portfolio: one micro-batch per DP rank, every
CP rank of every DP rank one slot, the few costliest samples on one ring or a few.

Small batches with a roomy bucket fit one micro-batch per DP rank, and then the iteration
time is the slowest of the ``D x N`` (DP rank, CP rank) slots.  Every ring costs its
micro-batch a latency and exchanges that its local work does not hide (under the ``ring``
objective a rank's local work overlaps only the first exchange), so rings on every DP rank
(what GDS and the groupings do when each holds a long sample) can cost more than the long
samples themselves, and one ring holding them all can cost more than two or three.
``level_schedule`` tries, for ``r = 1 .. min(D, LEVEL_MAX_RINGS)`` rings and ``k = k0,
k0 + 1, ...`` samples on them:

1. the ``k`` longest samples distributed on ``r`` rings, ring ``d`` in DP rank ``d``'s
   micro-batch: each sample, longest first, joins the ring whose time alone is least
   among those with room for its shard (``k0``: the samples longer than the bucket, which
   must be distributed; at least one per ring; stop once one fits no ring);
2. every other sample whole, longest first, on the slot with room where its rank's time
   after it is the least: the least-loaded slot of the DP ranks without a ring (ties:
   lowest DP rank, then CP rank; all DP ranks when ``k = 0``) timed by its local work, or
   the least-loaded slot of a ring's DP rank timed by
   :func:`~skrull_ext.scheduler.reference.rank_time` with its ring (the ring ranks' slots
   kept on ties, the lowest ring first);

and keeps the fastest (slowest DP rank).  ``k`` stops at :data:`LEVEL_MAX_K` or once a
ring alone reaches the best time so far (it only grows with ``k``).  Longest first is
costliest first: a sample's cost grows with its length.  (With ``r = 1`` this is the
candidate's first version: its plans are unchanged, and more rings only add choices.)

This module is the specification; ``csrc/level.cpp`` mirrors it (``tests/test_level.py``
checks identical plans).  The Python slot search scans every slot; C++ keeps the slots of
each ring's DP rank and of the others in heaps with the same choice and tie-break.
"""
from __future__ import annotations

import math
from typing import Optional

from skrull_ext.scheduler.reference import GdsContext, Placement, rank_time
from skrull_ext.sharding import shard_tokens

# Most samples the candidate distributes on its rings, and most rings (DP ranks with one).
LEVEL_MAX_K = 16
LEVEL_MAX_RINGS = 4


def _least(rem, load, s: int, first: int, last: int, n: int) -> Optional[tuple[int, int]]:
    """The least-loaded slot ``(d, r)`` with room for ``s`` tokens among DP ranks
    ``first <= d < last`` (ties: lowest ``d``, then ``r``), or ``None``."""
    best = None
    for d in range(first, last):
        for r in range(n):
            if rem[d][r] >= s and (best is None or load[d][r] < load[best[0]][best[1]]):
                best = (d, r)
    return best


def _rings(ctx: GdsContext, order: list[int], k: int, r: int) -> Optional[list[list[int]]]:
    """The ``k`` longest samples over ``r`` rings: each, longest first, joins the ring whose
    time alone (``rank_time(0, comm + latency, share)``) is least among those with room
    for its shard (ties: the lowest); ``None`` when one fits none."""
    n, cap = ctx.cp_size, ctx.bucket_size
    rings: list[list[int]] = [[] for _ in range(r)]
    used, comm, share = [0] * r, [ctx.latency] * r, [0.0] * r
    for i in order[:k]:
        sh = shard_tokens(int(ctx.lengths[i]), n)
        best, best_t = -1, math.inf
        for d in range(r):
            t = rank_time(0.0, comm[d], share[d], n, ctx.objective)
            if used[d] + sh <= cap and t < best_t:
                best, best_t = d, t
        if best < 0:
            return None
        rings[best].append(i)
        used[best] += sh
        comm[best] += ctx.comm[i]
        share[best] += ctx.costs[i] / n if ctx.shares is None else ctx.shares[i]
    return rings


def _level(ctx: GdsContext, order: list[int], k: int, rings: list[list[int]], dp_size: int,
           best_t: float, overhead: float) -> Optional[list[list[Placement]]]:
    """Steps 1-2 for one ``k`` with ring ``d`` on DP rank ``d``; ``None`` when a sample
    finds no slot with room or a slot's time reaches ``best_t`` (the candidate must be
    strictly faster)."""
    n, cap = ctx.cp_size, ctx.bucket_size
    r = len(rings) if k else 0
    rem = [[cap] * n for _ in range(dp_size)]
    t_comm, t_dist = [0.0] * r, [0.0] * r
    for d in range(r):
        used = sum(shard_tokens(int(ctx.lengths[i]), n) for i in rings[d])
        rem[d] = [cap - used] * n
        t_comm[d] = ctx.latency
        for i in rings[d]:
            t_comm[d] += ctx.comm[i]
            t_dist[d] += ctx.costs[i] / n if ctx.shares is None else ctx.shares[i]
    load = [[0.0] * n for _ in range(dp_size)]
    local: list[list[list[int]]] = [[[] for _ in range(n)] for _ in range(dp_size)]
    for i in order[k:]:
        s, c = int(ctx.lengths[i]), ctx.costs[i]
        plain = _least(rem, load, s, r, dp_size, n)
        t = math.inf if plain is None else load[plain[0]][plain[1]] + c
        on_ring, t_ring = None, math.inf
        for d in range(r):  # the ring ranks' least-loaded slots, the lowest rank on ties
            slot = _least(rem, load, s, d, d + 1, n)
            if slot is not None:
                td = rank_time(load[d][slot[1]] + c, t_comm[d], t_dist[d], n, ctx.objective)
                if td < t_ring:
                    on_ring, t_ring = slot, td
        if on_ring is not None and t_ring <= t:  # ring ranks' slots come first on ties
            plain, t = on_ring, t_ring
        if plain is None or t + overhead >= best_t:
            return None
        d, q = plain
        local[d][q].append(i)
        rem[d][q] -= s
        load[d][q] += c
    return [[(list(rings[d]) if d < r else [], local[d])] for d in range(dp_size)]


def level_schedule(ctx: GdsContext, dp_size: int, overhead: float, best_t: float = math.inf
                   ) -> Optional[list[list[Placement]]]:
    """The fastest ``(r, k)``'s plan (one placement per DP rank, possibly empty), or
    ``None`` when none fits or none is strictly faster than ``best_t`` (seconds, overhead
    included).

    Args:
        ctx: The batch's arrays, CP size, bucket and objective.
        dp_size: DP ranks ``D``.
        overhead: Seconds per non-empty micro-batch.
        best_t: The portfolio's best time so far.
    """
    n, cap = ctx.cp_size, ctx.bucket_size
    lengths = ctx.lengths
    if n < 2 or sum(int(s) for s in lengths) > dp_size * n * cap:
        return None
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    k0 = sum(1 for s in lengths if int(s) > cap)
    best = None
    for r in range(1, min(dp_size, LEVEL_MAX_RINGS) + 1):
        for k in range(max(k0, r if r > 1 else 0), min(len(order), max(k0, LEVEL_MAX_K)) + 1):
            rings = _rings(ctx, order, k, r)
            if rings is None:
                break
            if k and max(ctx.split_time([(ring, [[] for _ in range(n)])], overhead)
                         for ring in rings) >= best_t:
                break
            placed = _level(ctx, order, k, rings, dp_size, best_t, overhead)
            if placed is None:
                continue
            t = max(ctx.split_time(split, overhead) for split in placed)
            if t < best_t:
                best, best_t = placed, t
    return best


__all__ = ["LEVEL_MAX_K", "LEVEL_MAX_RINGS", "level_schedule"]
