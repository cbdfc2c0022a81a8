"""Local search refinement (skrull_ext/scheduler/refine.py, csrc/refine.cpp).

The reference and C++ return identical plans for every budget (random batches, both
objectives, budgets that stop the search mid-way and ones that let it converge); a
refined plan is valid (bucket, every sample once, equal counts) and never predicted
slower than the portfolio's pick; the budget is deterministic work, not wall time.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from skrull_ext import _backend
from skrull_ext.costmodel.model import default_cost_model
from skrull_ext.scheduler import SchedulerConfig, portfolio, schedule
from skrull_ext.scheduler.refine import budget_work, refine
from skrull_ext.scheduler.reference import GdsContext
from tests.test_parity import random_batch

_C = pytest.importorskip("skrull_ext._C", reason="C++ extension not built")
OBJECTIVES = {"paper": 0, "ring": 1}


@pytest.fixture(autouse=True)
def _cpp_backend(monkeypatch):
    monkeypatch.setattr(_backend, "CPP", _C)


def _arrays(lengths, cp, objective):
    cm = dataclasses.replace(default_cost_model(), objective=objective)
    return (cm, cm.compute_seconds(lengths), cm.comm_seconds(lengths, cp),
            cm.share_seconds(lengths, cp), cm.comm_latency(cp))


def test_refine_parity_random_batches_and_budgets():
    """C++ == reference for budgets from a few evaluations to where the local search
    converges on most of these batches (then ruin and recreate gets the rest: its own
    parity test is tests/test_lns.py); the batches exercise both outcomes (refinement
    changes the plan, and leaves it)."""
    rng = np.random.default_rng(5)
    changed = set()
    for trial in range(150):
        lengths, dp, cp, bucket = random_batch(rng)
        obj = ("paper", "ring")[trial % 2]
        _, costs, comm, shares, lat = _arrays(lengths, cp, obj)
        budget = int(rng.choice([1, 50, 500, 5_000, 200_000]))
        args = (lengths, costs, comm, lat, dp, cp, bucket)
        want = portfolio.portfolio_schedule(*args, "auto", 2e-3, "auto", shares, obj,
                                            budget=budget)
        plain = portfolio.portfolio_schedule(*args, "auto", 2e-3, "auto", shares, obj)
        changed.add(want != plain)
        got = _C.portfolio_schedule(*args, 2, 2e-3, 3, shares, objective=OBJECTIVES[obj],
                                    budget=budget)
        assert got == want, (trial, budget)
    assert changed == {True, False}


@pytest.mark.parametrize("objective", ["paper", "ring"])
def test_parity_when_one_sample_sets_the_iteration_time(objective):
    """One sample far longer than the rest: the plan's time is that sample's least time
    alone, where C++ stops trying candidates and skips the refinement (portfolio.cpp,
    alone_times); the plans must still be the reference's, for every budget."""
    rng = np.random.default_rng(8)
    for trial in range(12):
        cp, dp = (2, 4, 8)[trial % 3], (1, 2, 4)[trial % 3]
        lengths = rng.integers(50, 2_000, 16 * dp)
        lengths[rng.integers(lengths.size)] = 60_000
        bucket = 60_000 // cp + 4_000
        _, costs, comm, shares, lat = _arrays(lengths, cp, objective)
        args = (lengths, costs, comm, lat, dp, cp, bucket)
        for budget in (0, 200, 150_000):
            want = portfolio.portfolio_schedule(*args, "auto", 2e-3, "auto", shares, objective,
                                                budget=budget)
            got = _C.portfolio_schedule(*args, 2, 2e-3, 3, shares,
                                        objective=OBJECTIVES[objective], budget=budget)
            assert got == want, (trial, budget)


@pytest.mark.parametrize("objective", ["paper", "ring"])
def test_refined_plan_valid_and_never_slower(objective):
    """schedule() with refinement: a valid plan (validate() ran), predicted time <= the
    portfolio's pick (budget 0), and the same plan on both backends."""
    rng = np.random.default_rng(7 if objective == "ring" else 8)
    better = 0
    for _ in range(40):
        lengths, dp, cp, bucket = random_batch(rng)
        cm = dataclasses.replace(default_cost_model(), objective=objective)
        base = SchedulerConfig(dp_size=dp, cp_size=cp, bucket_size=bucket, plan_budget_ms=0)
        plain = schedule(lengths, base, cm)
        cfg = dataclasses.replace(base, plan_budget_ms=0.5)
        refined = schedule(lengths, cfg, cm, backend="python")
        assert refined.predicted["iteration_time"] <= plain.predicted["iteration_time"]
        better += refined.predicted["iteration_time"] < plain.predicted["iteration_time"]
        assert schedule(lengths, cfg, cm, backend="cpp").dp_ranks == refined.dp_ranks
        for mbs in refined.dp_ranks:
            assert max(max(mb.rank_tokens(refined.lengths)) for mb in mbs) <= bucket
    assert better >= 5, better


def test_budget_is_work_not_wall_time():
    """The plan depends on the budget only: repeated runs agree, every budget is at least
    as fast as none and the largest is faster; the budget grows with K up to 4x."""
    rng = np.random.default_rng(3)
    lengths = np.minimum((rng.pareto(1.2, 400) + 1) * 300, 60_000).astype(np.int64)
    cm = default_cost_model()
    times = []
    for ms in (0.0, 0.01, 0.1, 1.0, 10.0):
        cfg = SchedulerConfig(dp_size=4, cp_size=4, bucket_size=16_000, plan_budget_ms=ms)
        plans = [schedule(lengths, cfg, cm, backend="cpp") for _ in range(3)]
        assert plans[0].dp_ranks == plans[1].dp_ranks == plans[2].dp_ranks
        times.append(plans[0].predicted["iteration_time"])
    assert budget_work(0.0) == 0 and budget_work(1.0) > budget_work(0.01) > 0
    assert budget_work(1.0, 16) == budget_work(1.0, 256) == budget_work(1.0)
    assert budget_work(1.0, 512) == 4 * budget_work(1.0) == budget_work(4.0)
    assert budget_work(1.0, 65_536) == budget_work(1.0, 1024) == 16 * budget_work(1.0)
    # The local search and ruin and recreate share the budget, so a larger one need not
    # be faster on every batch, but never slower than none.
    assert max(times) == times[0] and times[-1] < times[0]


def test_refine_moves_a_sample_to_the_idle_rank():
    """Two DP ranks (CP 1), one holding both samples: one moves to the idle rank."""
    lengths = np.array([1000, 1000], dtype=np.int64)
    cm, costs, comm, shares, lat = _arrays(lengths, 1, "ring")
    ctx = GdsContext(lengths, costs, comm, lat, 1, 4000, "auto", "auto", shares, "ring")
    start = [[([], [[0, 1]])], [([], [[]])]]
    assert refine(ctx, start, 1e-3, 10**6) == [[([], [[1]])], [([], [[0]])]]
    assert refine(ctx, start, 1e-3, 0) is start


def test_plan_budget_rejects_bad_values():
    from skrull_ext.scheduler import ScheduleInputError

    for bad in (-1.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(ScheduleInputError, match="--skrull-plan-budget-ms"):
            SchedulerConfig(dp_size=1, cp_size=1, bucket_size=8, plan_budget_ms=bad)


def test_launcher_flag_reaches_the_scheduler(capsys):
    """--skrull-plan-budget-ms -> RunConfig -> the run's SchedulerConfig; a bad value is
    one clear error line, exit 2."""
    from megatron.skrull.arguments import parse_args
    from megatron.skrull.batch_schedule import make_batch_scheduler
    from mcore_helpers import TINY_FLAGS, tiny_config

    cfg = tiny_config(["--skrull-plan-budget-ms", "0.25"])
    assert cfg.skrull.plan_budget_ms == 0.25
    assert make_batch_scheduler(cfg, 256).config.plan_budget_ms == 0.25
    assert tiny_config().skrull.plan_budget_ms == SchedulerConfig.plan_budget_ms
    with pytest.raises(SystemExit) as info:
        parse_args(TINY_FLAGS + ["--skrull-plan-budget-ms", "-1"])
    assert info.value.code == 2
    assert "--skrull-plan-budget-ms" in capsys.readouterr().err
