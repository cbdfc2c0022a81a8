"""(ours) Ruin and recreate's refill: each DP rank repacked into full micro-batches.

Split from :mod:`skrull_ext.scheduler.lns` (the search that calls it, first and every
``REFILL_EVERY``-th step; see its docstring for why full micro-batches matter), as
``csrc/refill.cpp`` is from ``csrc/lns.cpp``; this module is the specification it mirrors
(same order, same float operations, same work count; ``tests/test_lns.py``).
"""
from __future__ import annotations

from skrull_ext.scheduler.reference import GdsContext, Placement
from skrull_ext.scheduler.refine import place_group
from skrull_ext.scheduler.resplit import first_fit

# Token fill fractions tried (of N x bucket per micro-batch).
REFILL_FRACS = (0.97,)
# Work units per sample and per CP rank of a micro-batch refill() places (DACP's five
# variants and the pricing; bench_scheduler.py --calibrate --stage lns).
REFILL_PLACE_WORK = 64


def refill(ctx: GdsContext, splits, overhead: float, limit: int
           ) -> tuple[list[list[Placement]], int, list[bool]]:
    """Each DP rank of ``splits`` repacked: its samples by descending cost (ties: index)
    into the first micro-batch whose tokens stay within ``int(frac x N x bucket)`` (else a
    new one), each micro-batch placed by ``place_group``; per ``frac`` of
    :data:`REFILL_FRACS`, kept where the rank's ``split_time`` falls strictly.

    Work: per attempt the first-fit checks and :data:`REFILL_PLACE_WORK` ``x (s + N)``
    per placed micro-batch, per rank its micro-batch count and, once, twice its samples
    and CP ranks (sorting and pricing); an attempt whose estimate (the samples times the
    rank's micro-batches plus one, plus the placements at that count) would reach
    ``limit`` is skipped, and so are the rank's later ones.
    Returns ``(splits, work, changed)``: ranks not padded to equal lengths, ``changed[d]``
    whether rank ``d`` was repacked.
    """
    n, cap, work, out, changed = ctx.cp_size, ctx.bucket_size, 0, [], []
    for split in splits:
        full = [p for p in split if p[0] or any(p[1])]
        size = sum(len(p[0]) + sum(len(r) for r in p[1]) for p in full)
        work += len(split)
        estimate = size * (len(full) + 1) + REFILL_PLACE_WORK * (size + n * len(full))
        best, best_t = split, None
        for frac in REFILL_FRACS:
            if work + estimate >= limit:
                break
            if best_t is None:  # the rank's samples, costliest first, and its time
                pool = [i for p in full for i in list(p[0]) + [x for r in p[1] for x in r]]
                pool.sort(key=lambda i: (-ctx.costs[i], i))
                work += 2 * (size + n * len(full))
                best_t = ctx.split_time(split, overhead)
            groups, checks = first_fit(pool, [int(ctx.lengths[i]) for i in pool],
                                       int(frac * cap * n))
            work += checks
            placed = []
            for g in groups:
                work += REFILL_PLACE_WORK * (len(g) + n)
                p = place_group(ctx, g)
                if p is None:
                    break
                placed.append(p)
            if len(placed) < len(groups):
                continue
            t = ctx.split_time(placed, overhead)
            if t < best_t:
                best, best_t = placed, t
        out.append(best)
        changed.append(best is not split)
    return out, work, changed


__all__ = ["REFILL_FRACS", "REFILL_PLACE_WORK", "refill"]
