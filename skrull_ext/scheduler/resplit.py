"""(ours) Re-splitting pairs of one DP rank's micro-batches: their local samples re-dealt.

A DP rank's time is the sum of its micro-batches' times, each set by its most loaded CP
rank (with the ring's transfers hidden under local work or not).  Under the bucket the
CP ranks of a full micro-batch often cannot be balanced: the long local samples fill a
rank's tokens before its work matches the others', and the fix needs short samples from
another micro-batch of the same DP rank, several at once.  Ruin and recreate reaches
such a state only after thousands of moves (7B, CP 16, GBS 1024: the 300 ms search's
plans have every micro-batch's CP ranks within ~1% of each other, the default plan's up
to 12% apart).

:func:`resplit` does it directly.  For every pair ``(a, b)`` (``a < b``) of a DP rank's
non-empty micro-batches it pools their *local* samples, keeps each micro-batch's
distributed samples where they are, and deals the pool costliest first (ties: the lower
index) over the pair's ``2 N`` CP slots: in each micro-batch the least loaded CP rank
whose tokens stay within the bucket (ties: the lower rank), then of the two the one whose
:func:`~skrull_ext.scheduler.objective.rank_time` after adding is lower (ties: ``a``).
LPT over the slots leaves both micro-batches balanced (a rank's time is one
non-decreasing function of its local work), and a ring micro-batch takes local work
first where it hides the transfers at no cost.  The best pair by time saved (ties: the
first) replaces ``a`` and ``b`` when the two are strictly faster (a micro-batch left
empty is dropped, saving its overhead); the rank's pairs are tried again until none
gains.  The pass is deterministic and counts work like :func:`~skrull_ext.scheduler.lns.refill`;
ruin and recreate runs it after each refill on the same DP ranks.

This module is the specification; ``csrc/resplit.cpp`` mirrors it (same order of float
operations, same work count; ``tests/test_lns.py``).
"""
from __future__ import annotations

from typing import Optional

from skrull_ext.scheduler.reference import GdsContext, Placement, rank_time
from skrull_ext.scheduler.refine import placement_time
from skrull_ext.sharding import shard_tokens

# Work units per CP rank a dealt sample scans and per time it prices (with the pair's new
# placements built, ~2x a ruin-and-recreate unit: `bench_scheduler.py --calibrate --stage
# lns` fell from 375K to 306K units per ms at 1 unit).
DEAL_WORK = 2


def _size(p: Placement) -> int:
    return len(p[0]) + sum(len(r) for r in p[1])


def _deal(ctx: GdsContext, pa: Placement, pb: Placement) -> Optional[list[Placement]]:
    """The local samples of ``pa`` and ``pb`` dealt over both micro-batches' CP ranks
    (see the module docstring); ``None`` if one fits no CP rank."""
    n, cap, lengths, costs = ctx.cp_size, ctx.bucket_size, ctx.lengths, ctx.costs
    pool = [i for p in (pa, pb) for r in p[1] for i in r]
    pool.sort(key=lambda i: (-costs[i], i))
    out, comm, share, load, tok = [], [], [], [], []
    for dist, _ in (pa, pb):
        t_comm = t_dist = 0.0
        dtok = 0
        for i in dist:
            t_comm += ctx.comm[i]
            t_dist += costs[i] / n if ctx.shares is None else ctx.shares[i]
            dtok += shard_tokens(int(lengths[i]), n)
        if dist:
            t_comm += ctx.latency
        out.append((list(dist), [[] for _ in range(n)]))
        comm.append(t_comm)
        share.append(t_dist)
        load.append([0.0] * n)
        tok.append([dtok] * n)
    # each micro-batch's time so far (its most loaded CP rank's)
    top = [rank_time(0.0, comm[k], share[k], n, ctx.objective) if out[k][0] else 0.0
           for k in (0, 1)]
    for i in pool:
        s, c = int(lengths[i]), costs[i]
        best = None  # (added time, time, micro-batch, CP rank)
        for k in (0, 1):
            r = -1
            for j in range(n):
                if tok[k][j] + s <= cap and (r < 0 or load[k][j] < load[k][r]):
                    r = j
            if r < 0:
                continue
            t = rank_time(load[k][r] + c, comm[k], share[k], n, ctx.objective)
            added = max(t, top[k]) - top[k]
            if best is None or added < best[0] or (added == best[0] and t < best[1]):
                best = (added, t, k, r)
        if best is None:
            return None
        _, t, k, r = best
        out[k][1][r].append(i)
        load[k][r] += c
        tok[k][r] += s
        top[k] = max(top[k], t)
    return out


def _timed(ctx: GdsContext, p: Placement, overhead: float) -> float:
    """``p``'s time with the overhead; 0 when empty."""
    return placement_time(ctx, p) + overhead if _size(p) else 0.0


def _rank(ctx: GdsContext, split: list[Placement], overhead: float, limit: int
          ) -> tuple[list[Placement], int, bool, bool]:
    """:func:`resplit` of one DP rank's non-empty ``split`` within ``limit`` work units:
    ``(split, work, changed, stopped)``, ``stopped`` when the limit ended it."""
    n, work, changed = ctx.cp_size, 0, False
    times = []
    for p in split:
        work += _size(p) + n
        times.append(_timed(ctx, p, overhead))
    while True:
        best = None  # (saved, a, b, placements, times)
        for a in range(len(split)):
            for b in range(a + 1, len(split)):
                pool = sum(len(r) for p in (split[a], split[b]) for r in p[1])
                size = _size(split[a]) + _size(split[b])
                # sorting, dealing (2 N + 2 per sample), pricing both
                estimate = 2 * pool + DEAL_WORK * (2 * n + 2) * pool + size + 2 * n
                if work + estimate >= limit:
                    return split, work, changed, True
                work += estimate
                got = _deal(ctx, split[a], split[b])
                if got is None:
                    continue
                ta, tb = _timed(ctx, got[0], overhead), _timed(ctx, got[1], overhead)
                saved = (times[a] + times[b]) - (ta + tb)
                if saved > 0.0 and (best is None or saved > best[0]):
                    best = (saved, a, b, got, (ta, tb))
        if best is None:
            return split, work, changed, False
        _, a, b, got, (ta, tb) = best
        split, times = list(split), list(times)
        split[a], split[b], times[a], times[b] = got[0], got[1], ta, tb
        keep = [j for j in range(len(split)) if _size(split[j])]
        split, times = [split[j] for j in keep], [times[j] for j in keep]
        changed = True


def resplit(ctx: GdsContext, splits, overhead: float, limit: int
            ) -> tuple[list[list[Placement]], int, list[bool]]:
    """Each DP rank of ``splits`` with its micro-batch pairs re-split (module docstring).

    Work: per rank its micro-batches' pricing (samples + N each), per pair tried twice its
    local samples (sorting), :data:`DEAL_WORK` ``x (2 N + 2)`` per local sample (dealing)
    and both micro-batches' pricing; a pair whose work would reach ``limit`` (the pass's
    total) is not tried, nor is any later pair or rank.

    Returns ``(splits, work, changed)``: each rank's non-empty micro-batches (in order,
    a re-split pair in its places), ``changed[d]`` whether rank ``d`` got faster.
    """
    out, work, changed, stopped = [], 0, [], False
    for split in splits:
        better = False
        if not stopped:
            full = [p for p in split if _size(p)]
            got, spent, better, stopped = _rank(ctx, full, overhead, limit - work)
            work += spent
        out.append(got if better else split)
        changed.append(better)
    return out, work, changed


__all__ = ["DEAL_WORK", "resplit"]
