"""The CP-balance polish of a plan (skrull_ext/scheduler/balance.py, csrc/balance.cpp).

Hand-made: a swap reaches the best split of one micro-batch's two CP ranks, a bucket
without room blocks it; two CP ranks tied at the top are crossed (the plateau).  On random
plans (the portfolio's, one sample per micro-batch, local samples lumped on CP rank 0) it
never slows a DP rank, keeps every sample once within the bucket, keeps the distributed
samples in place, stays within its work limit and gives the same plans and work counts on
both backends; hooked at the end of ruin and recreate from 256 samples, the portfolio's
plans stay the same on both backends.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from skrull_ext.costmodel.model import default_cost_model
from skrull_ext.scheduler import portfolio
from skrull_ext.scheduler.balance import (BALANCE_DIV, BALANCE_MIN_SAMPLES, balance,
                                          balance_share)
from skrull_ext.scheduler.objective import objective_arg, objective_of
from skrull_ext.scheduler.reference import GdsContext
from skrull_ext.sharding import shard_tokens
from tests.test_parity import random_batch, random_bucket, random_lengths

_C = pytest.importorskip("skrull_ext._C", reason="C++ extension not built")
OVERHEAD = 2e-3


def _context(lengths, cp, bucket, objective, costs=None):
    cm = dataclasses.replace(default_cost_model(), objective=objective)
    lengths = np.asarray(lengths, dtype=np.int64)
    c = cm.compute_seconds(lengths) if costs is None else np.asarray(costs, dtype=np.float64)
    ctx = GdsContext(lengths, c, cm.comm_seconds(lengths, cp), cm.comm_latency(cp), cp,
                     bucket, "auto", "auto", cm.share_seconds(lengths, cp), objective_of(cm))
    return ctx


def _cpp(ctx, splits, limit):
    return _C.balance(splits, ctx.lengths, ctx.costs, ctx.comm, ctx.latency, ctx.cp_size,
                      ctx.bucket_size, OVERHEAD, ctx.shares, objective_arg(ctx.objective),
                      limit)


def _norm(splits):
    return [[(list(d), [list(r) for r in loc]) for d, loc in s] for s in splits]


def _check(ctx, before, after) -> None:
    """Every sample once, the same distributed samples, no CP rank over the bucket, no
    DP rank slower."""
    every = sorted(i for s in after for p in s for i in p[0] + [x for r in p[1] for x in r])
    assert every == sorted(i for s in before for p in s
                           for i in p[0] + [x for r in p[1] for x in r])
    for s0, s1 in zip(before, after):
        assert [list(p[0]) for p in s0] == [list(p[0]) for p in s1]
        assert ctx.split_time(s1, OVERHEAD) <= ctx.split_time(s0, OVERHEAD)
        for dist, local in s1:
            shards = sum(shard_tokens(int(ctx.lengths[i]), ctx.cp_size) for i in dist)
            assert all(shards + sum(int(ctx.lengths[i]) for i in r) <= ctx.bucket_size
                       for r in local)


def test_swap_balances_and_the_bucket_blocks():
    """Costs 3 + 2 | 1 + 2 + 0.5 on two CP ranks (nothing distributed, ``paper``: a rank's
    time is its load): no move helps, a swap (3 for 2, or 2 for 1) gives 4 | 4.5, the best
    split of these costs.  With a bucket that leaves CP rank 1 no room for those swaps
    nothing changes; a limit of 0 does nothing."""
    costs = [3.0, 1.0, 2.0, 2.0, 0.5]
    ctx = _context([300, 100, 200, 200, 150], 2, 1000, "paper", costs)
    plan = [[([], [[0, 2], [1, 3, 4]])]]  # 5 | 3.5
    out, work = balance(ctx, plan, OVERHEAD, 10**6)
    assert sorted(sum(costs[i] for i in r) for r in out[0][0][1]) == [4.0, 4.5]
    assert work > 0 and _norm(_cpp(ctx, plan, 10**6)[0]) == _norm(out)
    tight = _context([300, 100, 200, 200, 150], 2, 500, "paper", costs)
    assert balance(tight, plan, OVERHEAD, 10**6)[0] == plan
    assert _norm(_cpp(tight, plan, 10**6)[0]) == _norm(plan)
    assert balance(ctx, plan, OVERHEAD, 0) == (plan, 0)


def test_plateau_is_crossed():
    """CP ranks at 2 + 1 | 2 + 1 | empty: moving from one top rank leaves the other at 3
    (the time unchanged: a plateau step, taken for its lower sum of squares); then the
    other's move lowers the top to 2, the balanced split."""
    costs = [2.0, 1.0, 2.0, 1.0]
    ctx = _context([100] * 4, 3, 1000, "paper", costs)
    plan = [[([], [[0, 1], [2, 3], []])]]
    out, _ = balance(ctx, plan, OVERHEAD, 10**6)
    assert [sum(costs[i] for i in r) for r in out[0][0][1]] == [2.0, 2.0, 2.0]
    assert ctx.split_time(out[0], OVERHEAD) < ctx.split_time(plan[0], OVERHEAD)
    assert _norm(_cpp(ctx, plan, 10**6)[0]) == _norm(out)


def _plans(ctx, lengths, dp, cp, bucket):
    args = (lengths, ctx.costs, ctx.comm, ctx.latency, dp, cp, bucket)
    alone = [[ctx.place([i]) for i in range(d, lengths.size, dp)] for d in range(dp)]
    lumped = []  # each rank's local samples on CP rank 0 while the bucket lets them
    for split in portfolio.portfolio_schedule(*args, "auto", OVERHEAD, "auto", ctx.shares,
                                              ctx.objective):
        rank = []
        for dist, local in split:
            new = [list(r) for r in local]
            tok = [sum(int(lengths[i]) for i in r) for r in new]
            for r in range(1, cp):
                for i in list(new[r]):
                    if tok[0] + int(lengths[i]) <= bucket - sum(
                            shard_tokens(int(lengths[x]), cp) for x in dist):
                        new[r].remove(i)
                        new[0].append(i)
                        tok[0] += int(lengths[i])
            rank.append((list(dist), new))
        lumped.append(rank)
    return [alone, lumped]


def test_random_plans_never_slower_within_limit_and_parity():
    """Random batches, both objectives, limits from a few steps to unbounded: the checks of
    :func:`_check`, the work within the limit, and C++ == reference (plans and work)."""
    rng = np.random.default_rng(17)
    faster = 0
    for trial in range(24):
        lengths, dp, cp, bucket = random_batch(rng)
        ctx = _context(lengths, cp, bucket, ("paper", "ring")[trial % 2])
        for plan in _plans(ctx, lengths, dp, cp, bucket):
            for limit in (300, 3_000, 10**7):
                out, work = balance(ctx, plan, OVERHEAD, limit)
                _check(ctx, plan, out)
                assert work <= max(limit, 0) or cp < 2
                got, got_work = _cpp(ctx, plan, limit)
                assert (_norm(got), got_work) == (_norm(out), work), (trial, limit)
                faster += sum(ctx.split_time(a, OVERHEAD) < ctx.split_time(b, OVERHEAD)
                              for a, b in zip(out, plan))
    assert faster >= 20, faster


def test_hook_in_lns_same_plans_on_both_backends():
    """From :data:`BALANCE_MIN_SAMPLES` samples ruin and recreate keeps a share of its budget
    for the polish of its best plan: the portfolio's plans stay identical on both backends
    (both objectives), and below that size the share is 0."""
    assert balance_share(80_000, BALANCE_MIN_SAMPLES - 1) == 0
    assert balance_share(80_000, BALANCE_MIN_SAMPLES) == 80_000 // BALANCE_DIV
    rng = np.random.default_rng(23)
    for objective in ("paper", "ring"):
        k = BALANCE_MIN_SAMPLES + int(rng.integers(0, 64))
        lengths = random_lengths(rng, k)
        cp, dp = 4, 2
        bucket = int(random_bucket(rng, lengths, cp))
        ctx = _context(lengths, cp, bucket, objective)
        args = (lengths, ctx.costs, ctx.comm, ctx.latency, dp, cp, bucket)
        want = portfolio.portfolio_schedule(*args, "auto", OVERHEAD, "auto", ctx.shares,
                                            ctx.objective, budget=150_000)
        got = _C.portfolio_schedule(*args, 2, OVERHEAD, 3, ctx.shares,
                                    objective=objective_arg(ctx.objective), budget=150_000)
        assert got == want, objective
