"""Ruin and recreate after the local search (skrull_ext/scheduler/lns.py, csrc/lns.cpp).

The reference and C++ return identical plans through the portfolio for budgets that stop
the search early and late, both objectives; the search never returns a slower plan, keeps
every sample once and every CP rank within the bucket, improves plans the converged local
search cannot, stops at once on a plan at the batch's lower bound, and its floor is the C++
core's bound; its first pass (refill) merges half-empty micro-batches and never slows a rank,
and the pair re-split after it (resplit) rebalances a DP rank's micro-batches, never slowing one;
the batch re-deal before the search (resplit.deal) consolidates rings, balances DP ranks and
counts the same work on both backends.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from skrull_ext import _backend
from skrull_ext.costmodel.model import default_cost_model
from skrull_ext.scheduler import SchedulerConfig, portfolio, schedule
from skrull_ext.scheduler.bound import lower_bound
from skrull_ext.scheduler.bound import plan_lower_bound as floor
from skrull_ext.scheduler.lns import lns, refill
from skrull_ext.scheduler.objective import objective_arg, objective_of
from skrull_ext.scheduler.reference import GdsContext
from skrull_ext.scheduler.refine import refine
from skrull_ext.scheduler.resplit import DEAL_MODES, deal, deal_best, resplit
from skrull_ext.sharding import shard_tokens
from tests.test_parity import random_batch

_C = pytest.importorskip("skrull_ext._C", reason="C++ extension not built")
OVERHEAD = 2e-3


@pytest.fixture(autouse=True)
def _cpp_backend(monkeypatch):
    monkeypatch.setattr(_backend, "CPP", _C)


def _context(lengths, cp, bucket, objective):
    cm = dataclasses.replace(default_cost_model(), objective=objective)
    arrays = (cm.compute_seconds(lengths), cm.comm_seconds(lengths, cp),
              cm.share_seconds(lengths, cp))
    ctx = GdsContext(lengths, arrays[0], arrays[1], cm.comm_latency(cp), cp, bucket, "auto",
                     "auto", arrays[2], objective_of(cm))
    return cm, ctx


def _check(ctx, splits, k: int) -> None:
    """Every sample once, equal micro-batch counts, no CP rank over the bucket."""
    seen = sorted(i for s in splits for p in s for i in p[0] + [x for r in p[1] for x in r])
    assert seen == list(range(k))
    assert len({len(s) for s in splits}) == 1
    for s in splits:
        for dist, local in s:
            shards = sum(shard_tokens(int(ctx.lengths[i]), ctx.cp_size) for i in dist)
            assert all(shards + sum(int(ctx.lengths[i]) for i in r) <= ctx.bucket_size
                       for r in local)


def test_lns_parity_and_gain_over_the_local_search():
    """C++ == reference through the portfolio for budgets from a few moves to thousands;
    on some batches ruin and recreate finds a faster plan than the local search run to
    convergence, and it never returns a slower one."""
    rng = np.random.default_rng(11)
    gains = 0
    for trial in range(40):
        lengths, dp, cp, bucket = random_batch(rng)
        obj = ("paper", "ring")[trial % 2]
        cm, ctx = _context(lengths, cp, bucket, obj)
        budget = int(rng.choice([2_000, 20_000, 60_000]))
        args = (lengths, ctx.costs, ctx.comm, ctx.latency, dp, cp, bucket)
        want = portfolio.portfolio_schedule(*args, "auto", OVERHEAD, "auto", ctx.shares,
                                            ctx.objective, budget=budget)
        got = _C.portfolio_schedule(*args, 2, OVERHEAD, 3, ctx.shares,
                                    objective=objective_arg(ctx.objective), budget=budget)
        assert got == want, (trial, budget)
        start = refine(ctx, portfolio.portfolio_schedule(*args, "auto", OVERHEAD, "auto",
                                                         ctx.shares, ctx.objective),
                       OVERHEAD, 10**7)
        out = lns(ctx, start, OVERHEAD, budget, floor(ctx, dp, OVERHEAD))
        _check(ctx, out, lengths.size)
        before = portfolio.iteration_time(ctx, start, OVERHEAD)
        after = portfolio.iteration_time(ctx, out, OVERHEAD)
        assert after <= before
        gains += after < before
    assert gains >= 3, gains


def test_refill_consolidates_and_never_slows_a_rank():
    """One sample per micro-batch: the repacking merges them (fewer micro-batch
    overheads), keeps every sample once within the bucket and never slows a DP rank;
    a limit below its first attempt leaves the plan as it was."""
    rng = np.random.default_rng(5)
    merged = 0
    for trial in range(12):
        lengths, dp, cp, bucket = random_batch(rng)
        cm, ctx = _context(lengths, cp, bucket, ("paper", "ring")[trial % 2])
        alone = [[ctx.place([i]) for i in range(d, lengths.size, dp)] for d in range(dp)]
        out, work, changed = refill(ctx, alone, OVERHEAD, 10**9)
        m = max(len(s) for s in out)
        _check(ctx, [s + [([], [[] for _ in range(cp)])] * (m - len(s)) for s in out],
               lengths.size)
        for before, after in zip(alone, out):
            assert ctx.split_time(after, OVERHEAD) <= ctx.split_time(before, OVERHEAD)
            merged += len(after) < len(before)
        assert work > 0 and changed == [len(a) < len(b) for a, b in zip(out, alone)]
        assert refill(ctx, alone, OVERHEAD, 0)[0] == alone
    assert merged >= 6, merged


def test_resplit_rebalances_pairs_and_never_slows_a_rank():
    """Two micro-batches each with a long and a short sample on their two CP ranks: the
    re-split deals the long ones to one micro-batch and the short ones beside them, so the
    other empties (one overhead saved).  On random plans (the portfolio's, one micro-batch
    per sample) every sample stays once within the bucket, a rank changes only when it
    gets strictly faster, and a limit of 0 changes nothing."""
    lengths = np.array([4000, 3000, 500, 400], dtype=np.int64)
    _, ctx = _context(lengths, 2, 4000, "ring")
    crossed = [([], [[0], [2]]), ([], [[1], [3]])]
    (out,), work, changed = resplit(ctx, [crossed], OVERHEAD, 10**6)
    assert changed == [True] and work > 0 and out == [([], [[0], [1, 2, 3]])]
    assert ctx.split_time(out, OVERHEAD) < ctx.split_time(crossed, OVERHEAD)
    rng = np.random.default_rng(8)
    faster = 0
    for trial in range(12):
        lengths, dp, cp, bucket = random_batch(rng)
        _, ctx = _context(lengths, cp, bucket, ("paper", "ring")[trial % 2])
        args = (lengths, ctx.costs, ctx.comm, ctx.latency, dp, cp, bucket)
        plans = [portfolio.portfolio_schedule(*args, "auto", OVERHEAD, "auto", ctx.shares,
                                              ctx.objective),
                 [[ctx.place([i]) for i in range(d, lengths.size, dp)] for d in range(dp)]]
        for splits in plans:
            out, _, changed = resplit(ctx, splits, OVERHEAD, 10**9)
            m = max(len(s) for s in out)
            _check(ctx, [s + [([], [[] for _ in range(cp)])] * (m - len(s)) for s in out],
                   lengths.size)
            for before, after, new in zip(splits, out, changed):
                t0, t1 = ctx.split_time(before, OVERHEAD), ctx.split_time(after, OVERHEAD)
                assert (t1 < t0) if new else (after is before)
                faster += new
            assert resplit(ctx, splits, OVERHEAD, 0)[0] == splits
    assert faster >= 4, faster


def test_deal_consolidates_rings_and_balances_dp_ranks():
    """Hand-checked: DP rank 0 holds two rings (one long sample each) and three short
    samples, rank 1 one short sample.  ``rings`` puts both long samples on one ring of
    rank 0 and deals the short ones to balance the ranks (faster than the input), ``keep``
    keeps both rings; on random plans every mode keeps each sample once within the
    bucket, deal_best never returns a slower plan, adopts one on some batches and counts
    the same work as the C++ core (``_C.refine_timing(..., "deal")``)."""
    lengths = np.array([3000, 2400, 900, 800, 700, 600], dtype=np.int64)
    _, ctx = _context(lengths, 2, 4000, "ring")
    start = [[([0], [[2], [3]]), ([1], [[4], []])], [([], [[5], []])]]
    rings, _ = deal(ctx, start, OVERHEAD, "rings", 10**6)
    assert [sorted(p[0]) for p in rings[0] if p[0]] == [[0, 1]]
    assert sorted(i for s in rings for p in s for r in p[1] for i in r) == [2, 3, 4, 5]
    keep, _ = deal(ctx, start, OVERHEAD, "keep", 10**6)
    assert [p[0] for p in keep[0]] == [[0], [1]]
    best, work = deal_best(ctx, start, OVERHEAD, 10**6)
    assert work > 0 and best is not None
    assert (portfolio.iteration_time(ctx, best, OVERHEAD)
            < portfolio.iteration_time(ctx, start, OVERHEAD))
    assert deal(ctx, start, OVERHEAD, "rings", 0)[0] is None
    rng = np.random.default_rng(21)
    adopted = 0
    for trial in range(24):
        lengths, dp, cp, bucket = random_batch(rng)
        _, ctx = _context(lengths, cp, bucket, ("paper", "ring")[trial % 2])
        args = (lengths, ctx.costs, ctx.comm, ctx.latency, dp, cp, bucket)
        splits = portfolio.portfolio_schedule(*args, "auto", OVERHEAD, "auto", ctx.shares,
                                              ctx.objective)
        for mode in DEAL_MODES:
            got, _ = deal(ctx, splits, OVERHEAD, mode, 10**9)
            if got is not None:
                m = max(1, max(len(s) for s in got))
                _check(ctx, [s + [([], [[] for _ in range(cp)])] * (m - len(s)) for s in got],
                       lengths.size)
        best, work = deal_best(ctx, splits, OVERHEAD, 10**9)
        if best is not None:
            adopted += 1
            assert (portfolio.iteration_time(ctx, best, OVERHEAD)
                    < portfolio.iteration_time(ctx, splits, OVERHEAD))
        spent, _ = _C.refine_timing(lengths, ctx.costs, ctx.comm, ctx.latency, dp, cp, bucket,
                                    OVERHEAD, ctx.shares, objective_arg(ctx.objective), 10**9,
                                    "deal")
        assert spent == work, trial
    assert adopted >= 3, adopted


@pytest.mark.parametrize("objective", ["paper", "ring"])
def test_schedule_with_lns_valid_and_same_on_both_backends(objective, monkeypatch):
    """schedule() with the local search and ruin and recreate sharing the budget: valid
    plans (validate() ran), the same on both backends, never predicted slower than
    without refinement and faster on most of these batches."""
    from skrull_ext.scheduler import groupfill

    # The searches refine the portfolio's pick; the group-fill candidate, which may replace
    # that pick afterwards, is tested in tests/test_groupfill.py.
    monkeypatch.setattr(groupfill, "candidate", lambda *args: None)
    rng = np.random.default_rng(4)
    cm = dataclasses.replace(default_cost_model(), objective=objective)
    faster = 0
    for _ in range(3):
        lengths = np.minimum((rng.pareto(1.5, 64) + 1) * 300, 8_000).astype(np.int64)
        cfg = SchedulerConfig(dp_size=4, cp_size=4, bucket_size=3_000, plan_budget_ms=0.1)
        plain = schedule(lengths, dataclasses.replace(cfg, plan_budget_ms=0.0), cm)
        ours = schedule(lengths, cfg, cm, backend="python")
        assert schedule(lengths, cfg, cm, backend="cpp").dp_ranks == ours.dp_ranks
        assert ours.predicted["iteration_time"] <= plain.predicted["iteration_time"]
        faster += ours.predicted["iteration_time"] < plain.predicted["iteration_time"]
    assert faster >= 2


def test_lns_stops_at_the_floor():
    """A plan whose slowest rank is at the floor is returned as is, work or no work; one
    above it is searched."""
    lengths = np.full(8, 1000, dtype=np.int64)
    _, ctx = _context(lengths, 2, 4000, "ring")
    even = [[([], [[0, 1], [2, 3]])], [([], [[4, 5], [6, 7]])]]
    assert lns(ctx, even, OVERHEAD, 10**6, floor(ctx, 2, OVERHEAD)) is even
    assert lns(ctx, even, OVERHEAD, 0, -1.0) is even
    lopsided = [[([], [[0, 1, 2], [3, 4, 5]])], [([], [[6], [7]])]]
    out = lns(ctx, lopsided, OVERHEAD, 10**5, floor(ctx, 2, OVERHEAD))
    assert (portfolio.iteration_time(ctx, out, OVERHEAD)
            < portfolio.iteration_time(ctx, lopsided, OVERHEAD))


@pytest.mark.parametrize("objective", ["paper", "ring"])
def test_floor_is_the_plan_lower_bound(objective):
    """bound.plan_lower_bound == bound.lower_bound (local and distributed placements) up to the
    iteration overhead and float order."""
    rng = np.random.default_rng(2)
    for _ in range(10):
        lengths, dp, cp, bucket = random_batch(rng)
        cm, ctx = _context(lengths, cp, bucket, objective)
        ovh = cm.micro_batch_overhead
        want = lower_bound(lengths, cm, dp, cp, bucket, subgroups=False)
        got = (floor(ctx, dp, ovh) + cm.time.iteration_overhead) * (1.0 - 1e-12)
        assert got == pytest.approx(want, rel=1e-12)
