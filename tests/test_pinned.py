"""Ruin and recreate with pinned sub-group rings (skrull_ext/scheduler/pinned.py, lns.py's
``pins``, csrc/lns.cpp): group-fill's plans refined, never slower, rings kept, both
backends the same plan."""
import dataclasses
import math

import numpy as np
import pytest

import skrull_ext.scheduler as S
from skrull_ext import _backend
from skrull_ext.costmodel.hardware import get_hardware
from skrull_ext.costmodel.model import MODEL_PRESETS
from skrull_ext.scheduler import balance as balance_mod, groupfill, lns, pinned
from skrull_ext.scheduler.balance import balance, polished
from skrull_ext.scheduler.config import _ROLLBACK_CODES, _VARIANT_CODES
from skrull_ext.scheduler.objective import objective_arg
from skrull_ext.scheduler.reference import GdsContext

# (CP, model, bucket, seed, objective): batches where group-fill's plan wins and the pinned
# search makes it faster (found by a scan of seeds 0-5; DP 2, K = 64, Pareto lengths).
CASES = [(8, "qwen2.5-0.5b", 8192, 3, "paper"), (16, "qwen2.5-7b", 4096, 3, "paper"),
         (8, "qwen2.5-7b", 4096, 4, "ring")]
needs_cpp = pytest.mark.skipif(_backend.CPP is None, reason="skrull_ext._C not built")


def _case(cp, model, bucket, seed, objective):
    rng = np.random.default_rng(seed)
    lengths = np.minimum((200 * (1 + rng.pareto(1.1, 64))).astype(int) + 1,
                         bucket * cp - 4 * cp)
    cost = dataclasses.replace(get_hardware("h100").cost_model(MODEL_PRESETS[model], cp, 2),
                               objective=objective)
    return lengths, S.SchedulerConfig(dp_size=2, cp_size=cp, bucket_size=bucket), cost


def _rings(plan):
    return sorted(g for rank in plan.dp_ranks for mb in rank for g in mb.grouped)


@pytest.mark.parametrize("case", CASES)
def test_refined_is_faster_keeps_rings_and_bucket(case, monkeypatch):
    lengths, cfg, cost = _case(*case)
    monkeypatch.setattr(groupfill, "refined", lambda *a, **k: None)
    greedy = S.schedule(lengths, cfg, cost, backend="python")
    monkeypatch.undo()
    plan = S.schedule(lengths, cfg, cost, backend="python")
    assert greedy.predicted["candidate"] == plan.predicted["candidate"] == "group-fill"
    assert plan.predicted["iteration_time"] < greedy.predicted["iteration_time"]
    assert _rings(plan) == _rings(greedy)  # every ring where group-fill put it
    plan.validate()  # each sample once, no CP rank over the bucket
    assert plan.rank_tokens().max() <= cfg.bucket_size


@needs_cpp
@pytest.mark.parametrize("case", CASES)
def test_backends_give_the_same_plan(case):
    lengths, cfg, cost = _case(*case)
    py = S.schedule(lengths, cfg, cost, backend="python")
    cpp = S.schedule(lengths, cfg, cost, backend="cpp")
    assert py.dp_ranks == cpp.dp_ranks
    assert py.predicted["iteration_time"] == cpp.predicted["iteration_time"]


def test_refined_is_never_slower_than_its_input():
    lengths, cfg, cost = _case(*CASES[0])
    plan = S.schedule(lengths, cfg, cost, backend="python")  # already refined once
    costs, comm, shares = cost.schedule_arrays(plan.lengths, cfg.cp_size)
    got = pinned.refined(plan, math.inf, cfg, cost, (costs, shares, comm), 0.0)
    assert got is not None and _rings(got) == _rings(plan)
    assert got.predicted["iteration_time"] <= plan.predicted["iteration_time"] * (1 + 1e-12)


def _tiny_ctx(n=4, cap=100):
    lengths = np.array([40, 30, 20, 10, 10])
    costs = np.array([4.0, 3.0, 4.0, 1.0, 1.0])
    return GdsContext(lengths, costs, np.zeros(5), 0.0, n, cap, "auto", "auto", None, "paper")


def test_pinned_micro_batch_prices_each_rank_with_its_rings():
    ctx = _tiny_ctx()
    pins = {0: ([5.0, 5.0, 0.0, 0.0], [50, 50, 0, 0])}
    search = lns._Lns(ctx, [[([], [[], [], [1], []], 0)]], 0.5, 10_000, pins)
    mb = search.ranks[0][0]
    assert mb.times == [5.0, 5.0, 3.0, 0.0]  # local work plus the rings' seconds
    assert mb.tok == [50, 50, 30, 0] and mb.t == 5.5
    # sample 2 goes where the micro-batch's time with the rings stays least (CP rank 3:
    # 5.0), not to the least loaded rank without them (rank 0, under a ring: 9.0), nor
    # distributed (6.0)
    assert search.insert_cost(mb, 2) == (5.5, 3)


def test_pinned_micro_batch_stays_when_its_samples_leave():
    ctx = _tiny_ctx()
    pins = {0: ([5.0, 5.0, 0.0, 0.0], [50, 50, 0, 0])}
    splits = [[([], [[], [], [], []], 0)], [([], [[0, 1], [2], [3], [4]])]]
    out = lns.lns(ctx, splits, 0.5, 50_000, 0.0, pins=pins)
    held = [p for s in out for p in s if len(p) > 2]
    assert len(held) == 1 and held[0][2] == 0  # the ring's micro-batch survives
    ids = sorted(i for s in out for p in s for i in list(p[0]) + [x for r in p[1] for x in r])
    assert ids == [0, 1, 2, 3, 4]


@needs_cpp
def test_binding_rejects_a_pin_id_out_of_range():
    lengths, cfg, cost = _case(*CASES[0])
    costs, comm, shares = cost.schedule_arrays(lengths, cfg.cp_size, backend="cpp")
    n = cfg.cp_size
    with pytest.raises(ValueError, match="pin id"):
        _backend.CPP.lns_pinned([[([0], [[] for _ in range(n)], 3)]], np.zeros((1, n)),
                                np.zeros((1, n), dtype=np.int64), lengths, costs, comm, 0.0,
                                n, cfg.bucket_size, 2, 3, 0.0, shares, 0, 1000, 0.0)


def test_search_stops_when_the_slowest_rank_holds_only_rings():
    """No step can move a sample off a DP rank of rings alone; the search ends there
    (it used to spin on empty ruins until the budget ran out) with the same plan."""
    ctx = _tiny_ctx()
    pins = {0: ([100.0] * 4, [50] * 4)}
    splits = [[([], [[], [], [], []], 0)], [([], [[0, 1], [2], [3], [4]])]]
    search = lns._Lns(ctx, splits, 0.5, 10**6, pins)
    assert search.step(max(search.rt), search.score()) is None and search.stuck
    out = lns.lns(ctx, splits, 0.5, 10**6, 0.0, pins=pins)
    assert [p for p in out[0] if len(p) > 2] == [([], [[], [], [], []], 0)]
    if _backend.CPP is None:
        return
    shares = ctx.costs / ctx.cp_size
    got, work = _backend.CPP.lns_pinned(
        splits, np.asarray(pins[0][:1]), np.asarray(pins[0][1:], dtype=np.int64), ctx.lengths,
        ctx.costs, ctx.comm, 0.0, 4, 100, _ROLLBACK_CODES["auto"], _VARIANT_CODES["auto"], 0.5,
        shares, objective_arg("paper"), 10**6, 0.0)
    assert work < 10**4  # stopped, not the budget spent on no-ops
    assert [[(list(p[0]), [list(r) for r in p[1]]) + tuple(p[2:]) for p in s] for s in got] \
        == [[(list(p[0]), [list(r) for r in p[1]]) + tuple(p[2:]) for p in s] for s in out]


def test_polish_moves_work_out_of_a_rank_under_a_ring():
    """``balance`` with pins: CP rank 0 carries a ring's 1.0 s plus local 1.0 + 0.5, CP rank
    1 local 0.5 (``paper``: a rank's time is its work): the polish moves the 1.0 sample next
    to the 0.5 (both ranks 1.5 s), which it cannot see without the ring's seconds."""
    ctx = GdsContext(np.array([10, 10, 10]), np.array([1.0, 0.5, 0.5]), np.zeros(3), 0.0, 2,
                     100, "auto", "auto", None, "paper")
    pins = {0: ([1.0, 0.0], [20, 0])}
    plan = [[([], [[0, 1], [2]], 0)]]
    out, _ = balance(ctx, plan, 0.5, 10**6, pins)
    assert out == [[([], [[1], [2, 0]], 0)]]
    assert polished(ctx, plan, 0.5, 10**6, pins)[0] == out


# K = 256 (the polish runs from balance.BALANCE_MIN_SAMPLES), DP 2: batches where its pass
# over the micro-batches with rings changes a DP rank (seeds scanned 0-3).
POLISHED = [(16, "qwen2.5-7b", 4096, 0, "paper"), (8, "qwen2.5-0.5b", 8192, 0, "ring")]


@needs_cpp
@pytest.mark.parametrize("case", POLISHED)
def test_polish_with_rings_same_plan_on_both_backends(case, monkeypatch):
    cp, model, bucket, seed, objective = case
    rng = np.random.default_rng(seed)
    lengths = np.minimum((200 * (1 + rng.pareto(1.1, 256))).astype(int) + 1,
                         bucket * cp - 4 * cp)
    cost = dataclasses.replace(get_hardware("h100").cost_model(MODEL_PRESETS[model], cp, 2),
                               objective=objective)
    cfg = S.SchedulerConfig(dp_size=2, cp_size=cp, bucket_size=bucket)
    changed = []

    def spy(ctx, splits, overhead, limit, pins=None):
        out = balance(ctx, splits, overhead, limit, pins)
        changed.append(pins is not None and out[0] != splits)
        return out

    monkeypatch.setattr(balance_mod, "balance", spy)  # as lns's polish calls it
    py = S.schedule(lengths, cfg, cost, backend="python")
    cpp = S.schedule(lengths, cfg, cost, backend="cpp")
    assert py.predicted["candidate"] == "group-fill" and any(changed)
    assert py.dp_ranks == cpp.dp_ranks
    assert py.predicted["iteration_time"] == cpp.predicted["iteration_time"]
