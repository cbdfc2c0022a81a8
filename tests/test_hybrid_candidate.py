"""Hybrid CP's plan (CP sub-group rings) as Skrull's last portfolio candidate, and how the
cost model charges sub-group rings (after the full ring, one ring per sub-group)."""
import dataclasses

import numpy as np
import pytest

from skrull_ext.scheduler import dyncp as dyncp_module, hybrid as hybrid_module, pricing
from skrull_ext.scheduler import groupfill
from skrull_ext import _backend
from skrull_ext.costmodel.model import default_cost_model
from skrull_ext.scheduler import SchedulerConfig, micro_batch_seconds, schedule
from skrull_ext.scheduler.objective import objective_of
from skrull_ext.scheduler.plan import MicroBatch


def _lengths(seed, k=64):
    rng = np.random.default_rng(seed)
    return np.minimum(np.exp(rng.normal(6.5, 1.2, k)).astype(np.int64) + 1, 7000)


# DP 2, CP 8, bucket 1024: hybrid CP's 2- and 4-rank sub-groups beat every plan of
# local and fully distributed samples Skrull finds on this batch.
CFG = SchedulerConfig(dp_size=2, cp_size=8, bucket_size=1024)


def test_skrull_keeps_the_hybrid_cp_plan_when_predicted_faster(monkeypatch):
    # Megatron's dynamic-CP plan beats hybrid CP's here (tests/test_dyncp_candidate.py).
    monkeypatch.setattr(dyncp_module, "candidate", lambda *args: None)
    monkeypatch.setattr(groupfill, "candidate", lambda *args: None)  # tests/test_groupfill.py
    cost = default_cost_model()
    lengths = _lengths(1)
    plan = schedule(lengths, CFG, cost)
    hybrid = schedule(lengths, dataclasses.replace(CFG, policy="hybrid-cp"), cost)
    assert plan.policy == "skrull" and plan.predicted["candidate"] == "hybrid-cp"
    assert any(mb.grouped for mbs in plan.dp_ranks for mb in mbs)
    # Hybrid CP's micro-batches, re-dealt over the DP ranks where that is faster.
    every = lambda p: sorted(repr(mb) for mbs in p.dp_ranks for mb in mbs)
    assert every(plan) == every(hybrid)
    assert plan.predicted["iteration_time"] <= hybrid.predicted["iteration_time"]
    monkeypatch.setattr(hybrid_module, "candidate", lambda *args: None)
    alone = schedule(lengths, CFG, cost)
    assert "candidate" not in alone.predicted
    assert alone.predicted["iteration_time"] > plan.predicted["iteration_time"]


@pytest.mark.skipif(_backend.CPP is None, reason="C++ core not built")
def test_both_backends_pick_the_same_plan():
    cost = default_cost_model()
    for seed in (1, 2):
        a = schedule(_lengths(seed), CFG, cost, backend="cpp")
        b = schedule(_lengths(seed), CFG, cost, backend="python")
        assert a.dp_ranks == b.dp_ranks and a.predicted == b.predicted


def test_no_candidate_without_sub_groups():
    cost = default_cost_model()
    plan = schedule(_lengths(1), dataclasses.replace(CFG, cp_size=2, bucket_size=4096), cost)
    assert "candidate" not in plan.predicted
    assert not any(mb.grouped for mbs in plan.dp_ranks for mb in mbs)


def test_candidate_off_where_the_attention_cannot_run_sub_groups(monkeypatch):
    """``subgroups=False`` (the launcher's choice for Transformer Engine without
    flash-attn) keeps Skrull's own plan; ``runs_subgroups`` decides it per kernel."""
    from skrull_ext.attention import choice

    plan = schedule(_lengths(1), dataclasses.replace(CFG, subgroups=False), default_cost_model())
    assert "candidate" not in plan.predicted
    assert not any(mb.grouped for mbs in plan.dp_ranks for mb in mbs)
    cuda, cpu = choice.torch.device("cuda"), choice.torch.device("cpu")
    for te, flash, want in ((True, False, False), (True, True, True), (False, True, True)):
        monkeypatch.setattr(choice, "te_available", lambda te=te: te)
        monkeypatch.setattr(choice, "flash_attn_available", lambda flash=flash: flash)
        assert choice.runs_subgroups("auto", cuda) is want
        assert choice.runs_subgroups("te", cuda) is flash
        assert choice.runs_subgroups("flash", cuda) and choice.runs_subgroups("auto", cpu)


@pytest.mark.parametrize("cp, bucket", [(4, 1024), (8, 512), (16, 256)])
def test_hybrid_bound_never_exceeds_hybrid_cps_prediction(cp, bucket):
    cost = default_cost_model()
    for seed in range(4):
        lengths = np.minimum(_lengths(seed, 48), cp * bucket - 2 * cp)
        cfg = SchedulerConfig(dp_size=3, cp_size=cp, bucket_size=bucket, policy="hybrid-cp")
        hybrid = schedule(lengths, cfg, cost)
        arrays = (cost.compute_seconds(lengths), cost.share_seconds(lengths, cp),
                  cost.comm_seconds(lengths, cp))
        bound = hybrid_module.hybrid_bound(lengths, cfg, cost, arrays)
        assert bound <= hybrid.predicted["iteration_time"]
        assert hybrid_module.hybrid_floor(lengths, cfg, cost, arrays[0]) <= bound


def test_sub_group_rings_are_charged_after_the_full_ring_unoverlapped():
    cost = default_cost_model()
    lengths = np.array([3000, 2000, 1500, 1200, 900], dtype=np.int64)
    costs = cost.compute_seconds(lengths)
    comm = cost.comm_seconds(lengths, 4)
    # Rank 0 has local work (which hides full-ring comm only); samples 2 and 3 share
    # the sub-group {0, 1} (one ring, latency once), sample 4 is alone on {2, 3}.
    mb = MicroBatch(distributed=(0,), local=((1,), (), (), ()),
                    grouped=((2, 0, 2), (3, 0, 2), (4, 2, 2)))
    shares = cost.share_seconds(lengths, 4)
    got = micro_batch_seconds(mb, lengths, costs, comm, cost, shares)
    objective = objective_of(cost)
    full = pricing.rank_times(np.array([costs[1], 0, 0, 0]),
                              np.full(4, comm[0] + cost.comm_latency(4)),
                              np.full(4, shares[0]), 4, objective)

    def ring(samples):
        s = lengths[samples]
        return pricing.rank_times(0.0, cost.comm_seconds(s, 2).sum() + cost.comm_latency(2),
                                  cost.share_seconds(s, 2).sum(), 2, objective)

    want = full + np.array([ring([2, 3])] * 2 + [ring([4])] * 2)
    assert got == pytest.approx(float(want.max()) + cost.micro_batch_overhead, rel=1e-12)
