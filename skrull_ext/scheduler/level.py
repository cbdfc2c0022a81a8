"""(ours) The ``level`` candidate of Skrull's portfolio: one micro-batch per DP rank, every
CP rank of every DP rank one slot, the few costliest samples on one ring.

Small batches with a roomy bucket fit one micro-batch per DP rank, and then the iteration
time is the slowest of the ``D x N`` (DP rank, CP rank) slots.  Every ring costs its
micro-batch a latency and exchanges that its local work does not hide (under the ``ring``
objective a rank's local work overlaps only the first exchange), so rings on every DP rank
(what GDS and the groupings do when each holds a long sample) can cost more than the long
samples themselves.  ``level_schedule`` instead tries, for ``k = k0, k0 + 1, ...``:

1. the ``k`` longest samples distributed together in DP rank 0's micro-batch (``k0``: the
   samples longer than the bucket, which must be distributed; stop once their shards
   overflow the bucket);
2. every other sample whole, longest first, on the slot with room where its rank's time
   after it is the least: the least-loaded slot of the other DP ranks (ties: lowest DP
   rank, then CP rank; all DP ranks when ``k = 0``) timed by its local work, or the
   least-loaded slot of DP rank 0 timed by
   :func:`~skrull_ext.scheduler.reference.rank_time` with the ring (kept on ties);

and keeps the fastest (slowest DP rank).  ``k`` stops at :data:`LEVEL_MAX_K` or once the
ring alone reaches the best time so far (it only grows with ``k``).  Longest first is
costliest first: a sample's cost grows with its length.

This module is the specification; ``csrc/level.cpp`` mirrors it (``tests/test_level.py``
checks identical plans).  The Python slot search scans every slot; C++ keeps the slots of
DP rank 0 and of the others in two heaps with the same choice and tie-break.
"""
from __future__ import annotations

import math
from typing import Optional

from skrull_ext.scheduler.reference import GdsContext, Placement, rank_time
from skrull_ext.sharding import shard_tokens

# Most samples the candidate distributes on its ring.
LEVEL_MAX_K = 16


def _least(rem, load, s: int, first: int, last: int, n: int) -> Optional[tuple[int, int]]:
    """The least-loaded slot ``(d, r)`` with room for ``s`` tokens among DP ranks
    ``first <= d < last`` (ties: lowest ``d``, then ``r``), or ``None``."""
    best = None
    for d in range(first, last):
        for r in range(n):
            if rem[d][r] >= s and (best is None or load[d][r] < load[best[0]][best[1]]):
                best = (d, r)
    return best


def _level(ctx: GdsContext, order: list[int], k: int, dp_size: int, best_t: float,
           overhead: float) -> Optional[list[list[Placement]]]:
    """Steps 1-2 for one ``k``; ``None`` when a sample finds no slot with room or a slot's
    time reaches ``best_t`` (the candidate must be strictly faster)."""
    n, cap = ctx.cp_size, ctx.bucket_size
    dist = order[:k]
    used = sum(shard_tokens(int(ctx.lengths[i]), n) for i in dist)
    t_comm = ctx.latency if dist else 0.0
    t_dist = 0.0
    for i in dist:
        t_comm += ctx.comm[i]
        t_dist += ctx.costs[i] / n if ctx.shares is None else ctx.shares[i]
    rem = [[cap - used] * n] + [[cap] * n for _ in range(1, dp_size)]
    load = [[0.0] * n for _ in range(dp_size)]
    local: list[list[list[int]]] = [[[] for _ in range(n)] for _ in range(dp_size)]

    ring = bool(dist)
    for i in order[k:]:
        s, c = int(ctx.lengths[i]), ctx.costs[i]
        plain = _least(rem, load, s, 1 if ring else 0, dp_size, n)
        on_ring = _least(rem, load, s, 0, 1, n) if ring else None
        t = math.inf if plain is None else load[plain[0]][plain[1]] + c
        if on_ring is not None:
            t_ring = rank_time(load[0][on_ring[1]] + c, t_comm, t_dist, n, ctx.objective)
            if t_ring <= t:  # DP rank 0's slots come first on ties
                plain, t = on_ring, t_ring
        if plain is None or t + overhead >= best_t:
            return None
        d, r = plain
        local[d][r].append(i)
        rem[d][r] -= s
        load[d][r] += c
    return [[(list(dist) if d == 0 else [], local[d])] for d in range(dp_size)]


def level_schedule(ctx: GdsContext, dp_size: int, overhead: float, best_t: float = math.inf
                   ) -> Optional[list[list[Placement]]]:
    """The fastest ``k``'s plan (one placement per DP rank, possibly empty), or ``None``
    when none fits or none is strictly faster than ``best_t`` (seconds, overhead included).

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
    used = sum(shard_tokens(int(lengths[i]), n) for i in order[:k0])
    for k in range(k0, min(len(order), max(k0, LEVEL_MAX_K)) + 1):
        if k > k0:
            used += shard_tokens(int(lengths[order[k - 1]]), n)
        if used > cap:
            break
        if k:
            ring = (order[:k], [[] for _ in range(n)])
            if ctx.split_time([ring], overhead) >= best_t:
                break
        placed = _level(ctx, order, k, dp_size, best_t, overhead)
        if placed is None:
            continue
        t = max(ctx.split_time(split, overhead) for split in placed)
        if t < best_t:
            best, best_t = placed, t
    return best


__all__ = ["LEVEL_MAX_K", "level_schedule"]
