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
gains.  The pass is deterministic and counts work like :func:`~skrull_ext.scheduler.refill.refill`;
ruin and recreate runs it after each refill on the same DP ranks.

:func:`deal` re-deals the whole batch at once, before ruin and recreate's first step
(:func:`deal_best`: each of :data:`DEAL_MODES`, the fastest kept when strictly faster).
Over a skeleton of micro-batches (each DP rank's, with the distributed samples fixed:
kept as they are, or consolidated into the fewest rings) every other sample, costliest
first, goes to the least loaded CP rank with room of the micro-batch where its DP rank's
time after it, plus 1e-3 x the time it adds, is least (ties: the first).  Rings take local
work that hides their transfers at no cost, and the DP ranks fill evenly.  At 7B, CP 16,
GBS 1024 (1x buckets) the default plans' DP ranks held several rings, some with no local
work, and CP ranks up to 12% apart; ruin and recreate needs ~10^4 steps to undo that, the
default budget affords ~20 after the refill; one deal costs about as much as 10 steps.
(The C++ core skips a micro-batch whose DP rank's time already reaches the best key: the
key is at least that time, so the same sample goes to the same place.)

This module is the specification; ``csrc/resplit.cpp`` mirrors it (same order of float
operations, same work count; ``tests/test_lns.py``).
"""
from __future__ import annotations

from typing import Optional

from skrull_ext.scheduler.reference import GdsContext, Placement, rank_time
from skrull_ext.scheduler.refine import placement_time
from skrull_ext.sharding import shard_tokens

# deal()'s micro-batches: ``keep`` each micro-batch's distributed samples (and one empty
# micro-batch per DP rank); ``rings`` the batch's distributed samples first-fit decreasing
# into the fewest rings (their shards within the bucket), dealt longest ring first to the
# DP rank with the least ring time, and empty micro-batches up to one more than the plan's
# count per DP rank; ``long`` as ``rings`` with only the samples longer than the bucket
# distributed (the rest dealt locally).
DEAL_MODES = ("keep", "rings", "long")
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


def first_fit(ids, sizes, room: int) -> tuple[list[list[int]], int]:
    """``ids`` in order, each into the first group whose ``sizes`` stay within ``room``
    (else a new one): ``(groups, first-fit checks)``."""
    groups: list[list[int]] = []
    tokens: list[int] = []
    checks = 0
    for i, s in zip(ids, sizes):
        for g in range(len(groups)):
            checks += 1
            if tokens[g] + s <= room:
                groups[g].append(i)
                tokens[g] += s
                break
        else:
            groups.append([i])
            tokens.append(s)
    return groups, checks


def _rings(ctx: GdsContext, ids: list[int]) -> tuple[list[list[int]], int]:
    """``ids`` first-fit decreasing by cost (ties: the lower index) into groups whose
    shard tokens fit the bucket: ``(groups, first-fit checks)``."""
    order = sorted(ids, key=lambda i: (-ctx.costs[i], i))
    sizes = [shard_tokens(int(ctx.lengths[i]), ctx.cp_size) for i in order]
    return first_fit(order, sizes, ctx.bucket_size)


def ring_time(ctx: GdsContext, dist: list[int]) -> tuple[float, float]:
    """``(t_comm, t_dist)`` of distributed samples ``dist`` (latency included if any)."""
    n, t_comm, t_dist = ctx.cp_size, 0.0, 0.0
    for i in dist:
        t_comm += ctx.comm[i]
        t_dist += ctx.costs[i] / n if ctx.shares is None else ctx.shares[i]
    return (t_comm + ctx.latency if dist else t_comm), t_dist


def _skeleton(ctx: GdsContext, splits, mode: str) -> tuple[list[tuple[int, list[int]]], int]:
    """The micro-batches :func:`deal` fills, ``(DP rank, distributed samples)`` each, and
    the work spent; see :data:`DEAL_MODES`."""
    d = len(splits)
    full = [(r, p) for r, split in enumerate(splits) for p in split if _size(p)]
    work = len(full) + sum(_size(p) for _, p in full)
    if mode == "keep":  # and one empty micro-batch per DP rank, for what fits nowhere else
        return [(r, list(p[0])) for r, p in full] + [(r, []) for r in range(d)], work
    ids = [i for _, p in full for i in p[0]
           if mode == "rings" or int(ctx.lengths[i]) > ctx.bucket_size]
    groups, checks = _rings(ctx, ids)
    ring = [rank_time(0.0, *ring_time(ctx, g), ctx.cp_size, ctx.objective) for g in groups]
    work += checks + 2 * len(ids) + d * len(groups)
    load, out = [0.0] * d, []
    count = [0] * d
    for g in sorted(range(len(groups)), key=lambda g: (-ring[g], g)):
        r = min(range(d), key=lambda r: (load[r], r))  # longest ring first, least loaded
        load[r] += ring[g]
        count[r] += 1
        out.append((r, groups[g]))
    per = -(-len(full) // d)  # the plan's micro-batches spread evenly, and one more
    for r in range(d):
        out.extend((r, []) for _ in range(max(per - count[r], 0) + 1))
    return out, work


def charge_deal(ctx: GdsContext, pool: list[int], slots: int, work: int, limit: int
                ) -> Optional[int]:
    """A deal of ``pool`` over ``slots`` micro-batches charged (``2 + slots x (N + 1) // 3``
    work units per sample) and ``pool`` sorted costliest first (ties: the lower index):
    the work after it, or ``None`` (``pool`` unsorted) when it would reach ``limit``."""
    per = 2 + slots * (ctx.cp_size + 1) // 3
    if work + len(pool) * per >= limit:
        return None
    pool.sort(key=lambda i: (-ctx.costs[i], i))
    return work + len(pool) * per


def deal(ctx: GdsContext, splits, overhead: float, mode: str, limit: int
         ) -> tuple[Optional[list[list[Placement]]], int]:
    """The batch re-dealt over :func:`_skeleton`'s micro-batches (module docstring):
    ``(splits or None, work)``; ``None`` when a sample fits no CP rank or the estimated
    work (``2 + len(skeleton) x (N + 1)`` per dealt sample) would reach ``limit``."""
    n, cap, lengths, costs = ctx.cp_size, ctx.bucket_size, ctx.lengths, ctx.costs
    skel, work = _skeleton(ctx, splits, mode)
    held = {i for _, dist in skel for i in dist}
    pool = [i for split in splits for p in split for i in p[0] + [x for r in p[1] for x in r]
            if i not in held]
    charged = charge_deal(ctx, pool, len(skel), work, limit)
    if charged is None:
        return None, work
    work = charged
    rt = [0.0] * len(splits)
    mbs = []  # per micro-batch: placement, t_comm, t_dist, loads, tokens, time so far
    for r, dist in skel:
        t_comm, t_dist = ring_time(ctx, dist)
        dtok = sum(shard_tokens(int(lengths[i]), n) for i in dist)
        top = rank_time(0.0, t_comm, t_dist, n, ctx.objective) + overhead if dist else 0.0
        rt[r] += top
        mbs.append([(list(dist), [[] for _ in range(n)]), t_comm, t_dist, [0.0] * n,
                    [dtok] * n, top])
    for i in pool:
        s, c = int(lengths[i]), costs[i]
        best = None  # (key, micro-batch, CP rank, added, time)
        for k, (r, _) in enumerate(skel):
            p, t_comm, t_dist, load, tok, top = mbs[k]
            j = -1
            for x in range(n):
                if tok[x] + s <= cap and (j < 0 or load[x] < load[j]):
                    j = x
            if j < 0:
                continue
            t = rank_time(load[j] + c, t_comm, t_dist, n, ctx.objective) + overhead
            added = max(t, top) - top
            key = (rt[r] + added) + 1e-3 * added
            if best is None or key < best[0]:
                best = (key, k, j, added, t)
        if best is None:
            return None, work
        _, k, j, added, t = best
        mb = mbs[k]
        mb[0][1][j].append(i)
        mb[3][j] += c
        mb[4][j] += s
        mb[5] = max(mb[5], t)
        rt[skel[k][0]] += added
    out: list[list[Placement]] = [[] for _ in splits]
    for (r, _), mb in zip(skel, mbs):
        if _size(mb[0]):
            out[r].append(mb[0])
    return out, work


def deal_best(ctx: GdsContext, splits, overhead: float, limit: int
              ) -> tuple[Optional[list[list[Placement]]], int]:
    """:func:`deal` of ``splits`` in each of :data:`DEAL_MODES` within ``limit`` work units
    in all: ``(the fastest dealt plan, work)`` when its slowest DP rank is strictly faster
    than the input's, else ``(None, work)``.  Pricing a plan counts its samples and N per
    micro-batch."""
    work = sum(_size(p) + ctx.cp_size for split in splits for p in split)
    cur = max(ctx.split_time(split, overhead) for split in splits)
    best = None
    for mode in DEAL_MODES:
        got, spent = deal(ctx, splits, overhead, mode, limit - work)
        work += spent
        if got is None:
            continue
        work += sum(_size(p) + ctx.cp_size for split in got for p in split)
        t = max(ctx.split_time(split, overhead) for split in got)
        if t < cur:
            best, cur = got, t
    return best, work


__all__ = ["DEAL_MODES", "DEAL_WORK", "charge_deal", "deal", "deal_best", "first_fit", "resplit", "ring_time"]
