"""The vectorised plan checks and predictions agree with walking the plan one micro-batch
at a time (same errors, same token counts, bit-identical predicted seconds)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from skrull_ext.costmodel.model import default_cost_model
from skrull_ext.scheduler.plan import MicroBatch, Plan, PlanError
from skrull_ext.sharding import shard_tokens, shard_tokens_array
from skrull_ext.scheduler.objective import objective_of
from skrull_ext.scheduler import (POLICIES, SchedulerConfig, micro_batch_seconds, reference,
                                  schedule)


def _plans(cost_model=None):
    rng = np.random.default_rng(4)
    for policy in POLICIES:
        for cp in (1, 3, 4):
            lengths = np.minimum((rng.pareto(1.1, 120) + 1) * 150, 20_000).astype(np.int64)
            bucket = max(max(shard_tokens(int(s), cp) for s in lengths), 2 * cp) + 3000
            yield schedule(lengths, SchedulerConfig(dp_size=3, cp_size=cp, bucket_size=bucket,
                                                    policy=policy), cost_model)


def test_shard_tokens_array_matches_scalar():
    lengths = np.arange(0, 500)
    for n in (1, 2, 3, 8, 16):
        want = [shard_tokens(int(s), n) for s in lengths]
        assert shard_tokens_array(lengths, n).tolist() == want
    assert shard_tokens_array(np.array([[5, 9]]), 2).tolist() == [[4, 6]]


def test_padded_length_array_matches_scalar_per_sample_rank_counts():
    from skrull_ext.sharding import padded_length, padded_length_array

    lengths = np.arange(1, 400)
    sizes = np.resize([1, 2, 3, 4, 8, 16], lengths.size)
    want = [padded_length(int(s), int(n)) for s, n in zip(lengths, sizes)]
    assert padded_length_array(lengths, sizes).tolist() == want
    assert padded_length_array(lengths, 4).tolist() == [padded_length(int(s), 4) for s in lengths]


@pytest.mark.parametrize("objective", ["paper", "ring"])
def test_rank_tokens_and_predictions_match_the_per_micro_batch_walk(objective):
    cost_model = dataclasses.replace(default_cost_model(), objective=objective)
    checked = 0
    for plan in _plans(cost_model):
        walked = np.array([[mb.rank_tokens(plan.lengths) for mb in mbs] for mbs in plan.dp_ranks])
        assert np.array_equal(plan.rank_tokens(), walked)
        costs = cost_model.compute_seconds(plan.lengths)
        comm = cost_model.comm_seconds(plan.lengths, plan.cp_size)
        shares = cost_model.share_seconds(plan.lengths, plan.cp_size)
        times = [[micro_batch_seconds(mb, plan.lengths, costs, comm, cost_model, shares)
                  for mb in mbs] for mbs in plan.dp_ranks]
        assert plan.predicted["micro_batch_times"] == times  # exact float equality
        assert plan.predicted["dp_rank_times"] == [float(sum(t)) for t in times]
        if plan.policy != "skrull":
            continue
        # The prediction is the core's objective (what the scheduler minimised) + overhead,
        # on the core's own placements (a candidate's sub-group rings are priced by
        # micro_batch_seconds alone: tests/test_groupfill.py, test_hybrid_candidate.py).
        latency = cost_model.comm_latency(plan.cp_size)
        for mbs, row in zip(plan.dp_ranks, times):
            for mb, t in zip(mbs, row):
                if mb.is_empty() or mb.grouped:
                    continue
                checked += 1
                core = reference.micro_batch_time(
                    (list(mb.distributed), [list(r) for r in mb.local]), costs, comm, latency,
                    plan.cp_size, shares, objective_of(cost_model))
                assert t == pytest.approx(core + cost_model.micro_batch_overhead, rel=1e-12)
    assert checked > 10


def _corrupt(plan: Plan, d: int, m: int, mb: MicroBatch) -> Plan:
    ranks = [list(r) for r in plan.dp_ranks]
    ranks[d][m] = mb
    return dataclasses.replace(plan, dp_ranks=tuple(tuple(r) for r in ranks))


def test_validate_still_names_the_first_violation():
    lengths = np.array([100, 200, 300, 400])
    mb0 = MicroBatch(distributed=(3,), local=((0,), (1,)))
    mb1 = MicroBatch(distributed=(), local=((2,), ()))
    plan = Plan(lengths=lengths, dp_size=1, cp_size=2, bucket_size=500, policy="test",
                dp_ranks=((mb0, mb1),))
    plan.validate()
    cases = [
        (MicroBatch(distributed=(), local=((2,), (2,))), "scheduled more than once: \\[2\\]"),
        (MicroBatch(distributed=(), local=((), ())), "never scheduled: \\[2\\]"),
        (MicroBatch(distributed=(), local=((2, 7), ())), "dp 0 mb 1: sample index 7 out of range"),
        (MicroBatch(distributed=(), local=((2,),)), "dp 0 mb 1: 1 local lists, cp_size 2"),
        (MicroBatch(distributed=(), local=((), ()), grouped=((2, 1, 2),)),
         "dp 0 mb 1: group \\(1, 2\\) outside CP group"),
    ]
    for mb, message in cases:
        with pytest.raises(PlanError, match=message):
            _corrupt(plan, 0, 1, mb).validate()
    tight = dataclasses.replace(plan, bucket_size=300)
    with pytest.raises(PlanError, match="dp 0 mb 0: CP rank 1 holds 400 tokens > bucket size 300"):
        tight.validate()


@pytest.mark.skipif(__import__("skrull_ext")._backend.CPP is None, reason="needs skrull_ext._C")
@pytest.mark.parametrize("portfolio", [True, False])
def test_core_flat_arrays_match_the_plan_walk(portfolio):
    """schedule() takes Plan.flat from the C++ core's flat arrays: they must be exactly what
    walking the returned placements gives (same order, same micro-batch numbering)."""
    from skrull_ext.scheduler.plan import flatten_placements

    rng = np.random.default_rng(9)
    for cp in (1, 4):
        lengths = np.minimum((rng.pareto(1.1, 400) + 1) * 150, 20_000).astype(np.int64)
        bucket = max(max(shard_tokens(int(s), cp) for s in lengths), 2 * cp) + 1500
        plan = schedule(lengths, SchedulerConfig(dp_size=3, cp_size=cp, bucket_size=bucket,
                                                 portfolio=portfolio), backend="cpp")
        want = flatten_placements(plan.dp_ranks, cp)
        got = plan.flat
        assert got.count == want.count == 3 * plan.num_micro_batches
        for name in ("dist_ids", "dist_mb", "local_ids", "local_slot"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
            assert getattr(got, name).dtype == np.int64


@pytest.mark.skipif(__import__("skrull_ext")._backend.CPP is None, reason="needs skrull_ext._C")
@pytest.mark.parametrize("objective", ["paper", "ring"])
def test_core_bound_and_placement_check_match_the_python_ones(objective, monkeypatch):
    """The C++ path takes the lower bound and the placement check from the core
    (skrull::plan_lower_bound / plan_valid): the Python bound up to float summation order,
    and a plan that Plan's own vectorised check accepts."""
    from skrull_ext.scheduler import groupfill
    from skrull_ext.scheduler.bound import lower_bound
    from skrull_ext.scheduler.plan import _placements_valid

    # The group-fill candidate's plans are built in Python (tests/test_groupfill.py).
    monkeypatch.setattr(groupfill, "candidate", lambda *args: None)  # tests/test_groupfill.py

    cost_model = dataclasses.replace(default_cost_model(), objective=objective)
    rng = np.random.default_rng(11)
    for cp, dp, k in ((1, 2, 40), (3, 3, 300), (8, 4, 256), (16, 1, 64)):
        lengths = np.minimum((rng.pareto(1.1, k) + 1) * 150, 30_000).astype(np.int64)
        bucket = max(max(shard_tokens(int(s), cp) for s in lengths), 2 * cp) + 2000
        cfg = SchedulerConfig(dp_size=dp, cp_size=cp, bucket_size=bucket)
        plan = schedule(lengths, cfg, cost_model, backend="cpp")
        assert plan.flat.verified
        walked = dataclasses.replace(plan)  # no cached flat: the Python check runs
        assert walked.flat is not None and not walked.flat.verified
        assert _placements_valid(walked)
        # A plan with sub-group rings (a hybrid or dynamic-CP candidate won) is bounded
        # with the sub-group terms too.
        grouped = any(mb.grouped for mbs in plan.dp_ranks for mb in mbs)
        want = lower_bound(lengths, cost_model, dp, cp, bucket, subgroups=grouped)
        assert plan.predicted["lower_bound"] == pytest.approx(want, rel=1e-13, abs=0)
        assert plan.predicted["iteration_time"] >= plan.predicted["lower_bound"]


@pytest.mark.parametrize("hardware", ["h100", "cpu"])
def test_schedule_arrays_equal_the_three_cost_methods(hardware):
    """CostModel.schedule_arrays shares the FLOP terms of compute/comm/share_seconds: the
    same float operations, so bit-identical arrays (the plans depend on them)."""
    from skrull_ext.costmodel.hardware import get_hardware

    # The cpu preset has attention inefficiency and call overheads, the h100 one neither.
    cost_model = get_hardware(hardware).cost_model(default_cost_model().model, cp_size=8)
    lengths = np.array([1, 2, 17, 255, 256, 1000, 4097, 65_537], dtype=np.int64)
    for cp in (1, 2, 3, 8):
        costs, comm, shares = cost_model.schedule_arrays(lengths, cp)
        assert np.array_equal(costs, cost_model.compute_seconds(lengths))
        assert np.array_equal(comm, cost_model.comm_seconds(lengths, cp))
        assert np.array_equal(shares, cost_model.share_seconds(lengths, cp))


def test_core_plans_are_outside_the_cyclic_gc(monkeypatch):
    """The C++ core's and the sub-group candidates' field tuples come untracked (tuples of
    ints cannot form a cycle): a plan's thousands of micro-batches cost the collector one
    object each, and plans stay equal to the Python backend's through collections."""
    import gc

    from skrull_ext import _backend
    from skrull_ext.scheduler import dyncp, groupfill

    if _backend.CPP is None:
        pytest.skip("C++ extension not built")
    # The group-fill candidate (K <= 2,048) builds its plans in Python (tests/test_groupfill.py).
    monkeypatch.setattr(groupfill, "candidate", lambda *args: None)
    rng = np.random.default_rng(9)
    lengths = np.minimum(np.exp(rng.normal(6.8, 1.1, 400)).astype(np.int64) + 1, 7000)
    seen = set()
    sub = SchedulerConfig(dp_size=2, cp_size=8, bucket_size=1024)
    own = SchedulerConfig(dp_size=1, cp_size=4, bucket_size=8192)
    for cfg, no_dyncp in ((sub, False),  # dynamic CP's plan wins
                          (sub, True),  # without it, hybrid CP's
                          (own, False)):  # Skrull's own
        with monkeypatch.context() as patch:
            if no_dyncp:
                patch.setattr(dyncp, "candidate", lambda *args: None)
            plan = schedule(lengths, cfg, backend="cpp")
            want = schedule(lengths, cfg, backend="python")
        seen.add(plan.predicted.get("candidate"))
        fields = [f for mbs in plan.dp_ranks for mb in mbs
                  for f in (mb.distributed, mb.local, mb.grouped, mb.__dict__, *mb.local)]
        assert not any(gc.is_tracked(f) for f in fields)
        assert not any(gc.is_tracked(row) for row in plan.flat.grouped)
        gc.collect()
        assert plan.dp_ranks == want.dp_ranks
        assert plan.predicted["micro_batch_times"] == want.predicted["micro_batch_times"]
        # The core sums the bound's terms in sample order, numpy pairwise: a few ulps.
        assert plan.predicted["lower_bound"] == pytest.approx(want.predicted["lower_bound"],
                                                              rel=1e-12)
    assert seen == {"dynamic-cp", "hybrid-cp", None}
