"""The pinned deal (skrull_ext/scheduler/pindeal.py, csrc/pindeal.cpp): every local sample
re-dealt around the pinned rings before ruin and recreate with pins; never slower, rings
and samples kept, both backends the same plan."""
import dataclasses

import numpy as np
import pytest

import skrull_ext.scheduler as S
from skrull_ext import _backend
from skrull_ext.costmodel.hardware import get_hardware
from skrull_ext.costmodel.model import MODEL_PRESETS
from skrull_ext.planner.profiles import load_profile, sample_global_batches
from skrull_ext.scheduler import lns
import skrull_ext.scheduler.regroup as regroup_mod
from skrull_ext.scheduler.balance import _split_time
from skrull_ext.scheduler.pindeal import pin_deal, pin_deal_best
from skrull_ext.scheduler.reference import GdsContext


def _ctx(lengths, costs, n, comm=0.0):
    return GdsContext(np.array(lengths), np.array(costs), np.full(len(lengths), comm), 0.0, n,
                      100, "auto", "auto", None, "paper")


def _ids(splits):
    return sorted(i for s in splits for p in s for i in list(p[0]) + [x for r in p[1] for x in r])


def _slowest(ctx, splits, pins):
    return max(_split_time(ctx, s, 0.5, pins) for s in splits)


def test_deal_fills_the_ranks_another_dp_rank_leaves_idle():
    """DP rank 0 holds a ring (1.0 s on both CP ranks) and two 1.0 s samples on top of it
    (2.5 s with the overhead); DP rank 1 holds both 0.5 s samples on one CP rank, the other
    idle.  The deal moves the 1.0 s samples to DP rank 1 and the 0.5 s ones under the ring:
    both DP ranks 2.0 s or less (``paper``: a rank's time is its work)."""
    ctx = _ctx([10, 10, 10, 10], [1.0, 1.0, 0.5, 0.5], 2)
    pins = {0: ([1.0, 1.0], [20, 20])}
    splits = [[([], [[0], [1]], 0)], [([], [[2, 3], []])]]
    assert _slowest(ctx, splits, pins) == 2.5
    out, work = pin_deal(ctx, splits, 0.5, pins, "keep", 10**6)
    assert work > 0 and _ids(out) == [0, 1, 2, 3]
    assert [p for p in out[0] if len(p) > 2] == [([], [[2], [3]], 0)]  # the ring stays
    assert _slowest(ctx, out, pins) == 2.0
    best, _ = pin_deal_best(ctx, splits, 0.5, pins, 10**6)  # rings cost nothing: 1.75 s
    assert _slowest(ctx, best, pins) <= 2.0


def test_dist_mode_shards_a_sample_too_large_for_one_rank():
    """One 4.0 s sample on CP rank 1 of 4 sets the time whole anywhere; on the full ring it
    costs 1.0 s per rank, 2.0 s on the rank under the 1.0 s ring: only ``dist`` gains."""
    ctx = _ctx([40], [4.0], 4)
    pins = {0: ([1.0, 0.0, 0.0, 0.0], [20, 0, 0, 0])}
    splits = [[([], [[], [0], [], []], 0)]]
    kept, _ = pin_deal(ctx, splits, 0.5, pins, "keep", 10**6)
    assert _slowest(ctx, kept, pins) == _slowest(ctx, splits, pins) == 4.5
    best, _ = pin_deal_best(ctx, splits, 0.5, pins, 10**6)
    assert best == [[([0], [[], [], [], []], 0)]] and _slowest(ctx, best, pins) == 2.5


def test_nothing_when_not_faster_or_over_the_limit():
    ctx = _ctx([40], [4.0], 4, comm=10.0)  # a ring slower than the sample whole
    pins = {0: ([0.0] * 4, [0] * 4)}
    splits = [[([], [[0], [], [], []], 0)]]
    assert pin_deal_best(ctx, splits, 0.5, pins, 10**6)[0] is None  # already the best
    got, work = pin_deal(ctx, [[([], [[], [0], [], []], 0)]], 0.5, {0: ([1.0, 0, 0, 0],
                         [20, 0, 0, 0])}, "dist", 5)
    assert got is None and work < 5


def _lmsys_batch(bucket=3923):
    """lmsyschat1m lengths, 7B, DP 4 x CP 16, GBS 256, the planner's bucket: one micro-batch
    per DP rank, where group-fill's greedy left five CP ranks of one DP rank idle (half
    the bucket: two micro-batches per DP rank, where the deal gains only at the end)."""
    hw, cp = get_hardware("h100"), 16
    lengths = sample_global_batches(load_profile("lmsyschat1m"), num_batches=1,
                                    global_batch_size=256, seed=0, max_length=cp * bucket - 64,
                                    overflow="truncate").batches[0]
    cost = dataclasses.replace(hw.cost_model(MODEL_PRESETS["qwen2.5-7b"], cp, 4),
                               objective="ring")
    return lengths, S.SchedulerConfig(dp_size=4, cp_size=cp, bucket_size=bucket), cost


@pytest.mark.parametrize("bucket, expect", [(3923, [True, False]), (1961, [False, True])])
def test_taken_on_a_real_batch_and_faster(bucket, expect, monkeypatch):
    """The deal before the pinned search (first call) and once more after it (second)."""
    lengths, cfg, cost = _lmsys_batch(bucket)
    taken = []

    def spy(*args):
        out = pin_deal_best(*args)
        if len(args[1]) > 1:  # not the one-rank searches of regroup.search_alone
            taken.append(out[0] is not None)
        return out

    for module in (lns, regroup_mod):  # before the search, then in regroup.after_search
        monkeypatch.setattr(module, "pin_deal_best", spy)
    plan = S.schedule(lengths, cfg, cost, backend="python")
    for module in (lns, regroup_mod):
        monkeypatch.setattr(module, "pin_deal_best", lambda *a: (None, 0))
    without = S.schedule(lengths, cfg, cost, backend="python")
    assert plan.predicted["candidate"] == "group-fill" and taken == expect
    assert plan.predicted["iteration_time"] < without.predicted["iteration_time"]
    plan.validate()
    assert plan.rank_tokens().max() <= cfg.bucket_size


@pytest.mark.skipif(_backend.CPP is None, reason="skrull_ext._C not built")
@pytest.mark.parametrize("bucket", [3923, 1961])
def test_same_plan_on_both_backends(bucket):
    lengths, cfg, cost = _lmsys_batch(bucket)
    py = S.schedule(lengths, cfg, cost, backend="python")
    cpp = S.schedule(lengths, cfg, cost, backend="cpp")
    assert py.dp_ranks == cpp.dp_ranks
    assert py.predicted["iteration_time"] == cpp.predicted["iteration_time"]
