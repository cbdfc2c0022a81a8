"""The Python reference scheduler (the spec of the C++ core) on hand-made cases.

Each expected placement below was worked out by hand from docs/design.md sections 3-4;
comments walk through the steps.  ``costs == lengths`` unless a case says otherwise.
The hypothesis tests check the plan invariants of every policy on random batches.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skrull_ext.scheduler.plan import MicroBatch
from skrull_ext.sharding import shard_tokens
from skrull_ext.scheduler import POLICIES, SchedulerConfig, reference, schedule


def batch(*lengths):
    """``(lengths, costs)`` with cost equal to length."""
    arr = np.array(lengths, dtype=np.int64)
    return arr, arr.astype(np.float64)


def rank_tokens(placement, lengths, cp_size):
    dist, local = placement
    return MicroBatch(distributed=tuple(dist), local=tuple(tuple(r) for r in local)
                      ).rank_tokens(lengths)


def test_dacp_places_locally_first_round_robin_by_load():
    lengths, costs = batch(100, 200, 300)
    # 100 -> rank 0 (tie: lowest rank), 200 -> rank 1 (load 0), 300 -> rank 0 (load 100 < 200).
    assert reference.dacp_place(lengths, costs, [2, 0, 1], 2, 1000) == ([], [[0, 2], [1]])


def test_dacp_prefers_compute_balance_over_memory_balance():
    lengths = np.array([10, 500, 20])
    costs = np.array([5.0, 1.0, 1.0])
    # 10 (cost 5) -> rank 0; 20 -> rank 1; 500 goes to rank 1, the least loaded (1 < 5),
    # although rank 0 has more room left (990 > 980).
    assert reference.dacp_place(lengths, costs, [0, 1, 2], 2, 1000) == ([], [[0], [2, 1]])


def test_dacp_falls_back_to_the_emptiest_rank_then_to_distributed():
    lengths = np.array([10, 60, 50])
    costs = np.array([100.0, 1.0, 1.0])
    # 60: least loaded rank 1 has only 50 left -> rank 0 (most room, 90).
    assert reference.dacp_place(lengths, costs, [0, 1, 2], 2, 100) == ([], [[0, 1], [2]])
    lengths, costs = batch(30, 30, 120)
    # 120 fits no rank whole (70 left each) but 60 tokens per rank fit: distributed.
    placed = reference.dacp_place(lengths, costs, [0, 1, 2], 2, 100)
    assert placed == ([2], [[0], [1]])
    assert rank_tokens(placed, lengths, 2) == [90, 90]


def test_rollback_victim_shortest_vs_best_fit():
    # Before 117 arrives: rank 0 holds [1, 40] (59 left), rank 1 holds [10] (90 left).
    # 117 fits no rank whole and needs 60 per rank distributed: roll back on rank 0.
    lengths, costs = batch(1, 10, 40, 117)
    shortest = reference.dacp_place(lengths, costs, [0, 1, 2, 3], 2, 100, "shortest")
    best_fit = reference.dacp_place(lengths, costs, [0, 1, 2, 3], 2, 100, "best-fit")
    # shortest demotes the 1-token sample first: its 2 padded tokens per rank free
    # nothing, so it must demote 40 as well.
    assert shortest == ([0, 2, 3], [[], [1]])
    # best-fit demotes 40 right away (the shortest demotion after which 117 fits).
    assert best_fit == ([2, 3], [[0], [1]])
    for placed in (shortest, best_fit):
        assert max(rank_tokens(placed, lengths, 2)) <= 100
    assert rank_tokens(best_fit, lengths, 2) == [81, 90]
    # auto keeps the faster of the two by micro_batch_time (ties: shortest).
    comm = np.full(4, 0.5)
    ts = reference.micro_batch_time(shortest, costs, comm, 0.1, 2)
    tb = reference.micro_batch_time(best_fit, costs, comm, 0.1, 2)
    auto = reference.dacp_best(lengths, costs, comm, 0.1, [0, 1, 2, 3], 2, 100, "auto")
    assert auto == (best_fit if tb < ts else shortest)


def test_rollback_never_overflows_a_rank():
    # Budgets [0, 0] after two local 10s; 10 distributed needs 6 per rank; demoting a 10
    # would put 6 on the other, full rank: infeasible rather than over budget.
    lengths, costs = batch(10, 10, 10)
    assert reference.dacp_place(lengths, costs, [0, 1, 2], 2, 10) is None


def test_infeasible_micro_batch_returns_none():
    lengths, costs = batch(60, 50)
    assert reference.dacp_place(lengths, costs, [0, 1], 1, 100) is None  # one rank: no roll-back
    assert reference.dacp_place(lengths, costs, [0], 1, 100) == ([], [[0]])
    assert reference.dacp_place(lengths, costs, [], 4, 1) == ([], [[], [], [], []])


def test_micro_batch_time_objective():
    costs = np.array([4.0, 2.0, 6.0])
    comm = np.array([0.5, 0.25, 1.0])
    # dist [2]: comm 1.0 + latency 0.5 = 1.5, compute 6/2 = 3 per rank.
    # rank 0 local 4 -> max(1.5, 4) + 3 = 7; rank 1 local 2 -> max(1.5, 2) + 3 = 5.
    assert reference.micro_batch_time(([2], [[0], [1]]), costs, comm, 0.5, 2) == 7.0
    assert reference.micro_batch_time(([], [[0, 1], []]), costs, comm, 0.5, 2) == 6.0
    assert reference.micro_batch_time(([], [[], []]), costs, comm, 0.5, 2) == 0.0


def test_gds_needs_a_second_round():
    # 20 tokens = C * N: m starts at 1, but [6, 7, 7] cannot be placed in one micro-batch
    # (6 and 7 local, the second 7 needs 4 per rank, roll-backs run out) -> m = 2:
    # interleave sorted [2, 0, 1] -> [2, 1] and [0].
    lengths, costs = batch(7, 7, 6)
    assert reference.dacp_place(lengths, costs, [0, 1, 2], 2, 10) is None
    plan = reference.gds_schedule(lengths, costs, np.zeros(3), 0.0, 1, 2, 10, variant="paper")
    assert plan == [[([], [[2], [1]]), ([], [[0], []])]]


def test_gds_pads_or_resplits_to_equal_micro_batch_counts():
    # LPT: 0 (cost 100) alone on bin 0 until bin 1 holds the four 200s (104), then 1, 2.
    lengths = np.array([60, 60, 60, 200, 200, 200, 200])
    costs = np.array([100.0, 1, 1, 26, 26, 26, 26])
    comm = np.full(7, 1000.0)
    assert reference.lpt_partition(costs, range(7), 2) == [[0, 1, 2], [3, 4, 5, 6]]
    # DP rank 1 needs 4 micro-batches (one 200 fills a rank's 100 after sharding).
    # DP rank 0 fits in 1 (one 60 distributed: 1000 s of ring) -> 1000.5 s + overhead;
    # re-split to 4: three local singletons and an empty one -> 102 s + 3 overheads.
    resplit = [([], [[0], []]), ([], [[1], []]), ([], [[2], []]), ([], [[], []])]
    kept = [([2], [[0], [1]])] + [([], [[], []])] * 3
    for overhead, want in ((0.0, resplit), (350.0, resplit), (500.0, kept)):
        plan = reference.gds_schedule(lengths, costs, comm, 0.0, 2, 2, 100, "auto", overhead,
                                      variant="paper")
        assert plan[0] == want, overhead
        assert plan[1] == [([i], [[], []]) for i in (3, 4, 5, 6)]


def test_lpt_ties_go_to_lowest_index_and_bin():
    assert reference.lpt_partition(np.ones(4), range(4), 2) == [[0, 2], [1, 3]]
    # Order 0 (3), 2 (2), 3 (2), 1 (1); 3 joins bin 1 (2 < 3), 1 joins bin 0 (3 < 4).
    assert reference.lpt_partition(np.array([3.0, 1, 2, 2]), range(4), 2) == [[0, 1], [2, 3]]
    assert reference.lpt_partition(np.ones(2), range(2), 4) == [[0], [1], [], []]


def test_interleave_mixes_long_and_short():
    assert reference.interleave([5, 6, 7, 8, 9], 2) == [[5, 7, 9], [6, 8]]
    assert reference.interleave([5, 6], 3) == [[5], [6], []]
    assert reference.interleave([5, 6, 7], 1) == [[5, 6, 7]]


def test_schedule_equal_micro_batch_counts_over_dp():
    lengths = [30000, 25000, 90, 120, 64, 8000, 7000, 300, 20000]
    plan = schedule(lengths, SchedulerConfig(dp_size=3, cp_size=2, bucket_size=16384))
    counts = {len(mbs) for mbs in plan.dp_ranks}
    assert counts == {plan.num_micro_batches} and plan.num_micro_batches >= 2
    assert sorted(i for mbs in plan.dp_ranks for mb in mbs for i in mb.samples()) == list(
        range(len(lengths)))


# ---- properties of every policy on random batches ----------------------------------

@st.composite
def global_batches(draw):
    cp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    dp = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.one_of(st.integers(1, 64), st.integers(1, 4000),
                                      st.integers(4000, 40000)), min_size=1, max_size=40))
    need = max(max(shard_tokens(s, cp) for s in lengths), 2 * cp if cp > 1 else 1)
    bucket = need + draw(st.integers(0, 2 * need))
    return lengths, dp, cp, bucket


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "flexsp"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=global_batches(), rollback=st.sampled_from(["shortest", "best-fit", "auto"]))
def test_every_policy_keeps_plan_invariants(policy, case, rollback):
    _check_invariants(policy, case, rollback)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=global_batches())
def test_flexsp_keeps_plan_invariants(case):
    # An MILP per micro-batch: fewer examples, a short time limit (its fallback included).
    pytest.importorskip("scipy")
    from skrull_ext.scheduler import flexsp

    limit, flexsp.TIME_LIMIT_S = flexsp.TIME_LIMIT_S, 0.2
    try:
        _check_invariants("flexsp", case, "auto")
    finally:
        flexsp.TIME_LIMIT_S = limit


def _check_invariants(policy, case, rollback):
    lengths, dp, cp, bucket = case
    cfg = SchedulerConfig(dp_size=dp, cp_size=cp, bucket_size=bucket, policy=policy,
                          rollback=rollback)
    plan = schedule(lengths, cfg, backend="python")
    plan.validate()
    seen = sorted(i for mbs in plan.dp_ranks for mb in mbs for i in mb.samples())
    assert seen == list(range(len(lengths)))
    assert len(plan.dp_ranks) == dp
    assert {len(mbs) for mbs in plan.dp_ranks} == {plan.num_micro_batches}
    assert plan.rank_tokens().max() <= bucket
    assert plan.predicted["iteration_time"] >= plan.predicted["lower_bound"]


def test_a_sample_that_fills_the_bucket_gets_its_own_micro_batch():
    # 512 tokens over CP=2 fill the 256-token bucket on both ranks: nothing can share its
    # micro-batch.  Without isolation GDS would add micro-batches until every sample is
    # alone (16); with it the 15 short ones share as few micro-batches as fit.
    lengths = np.array([512] + [30 + 5 * k for k in range(15)])
    costs = lengths.astype(np.float64) ** 2
    comm = np.zeros(len(lengths))
    assert not reference.can_pair(512, 30, 2, 256)
    assert reference.can_pair(255, 1, 2, 256) and reference.can_pair(200, 50, 1, 256)
    plan = reference.gds_schedule(lengths, costs, comm, 0.0, 1, 2, 256, variant="paper")
    (split,) = plan
    assert split[-1] == ([0], [[], []])  # the isolated sample, alone and distributed
    # The others are split exactly as they would be without the big one.
    (short,) = reference.gds_schedule(lengths[1:], costs[1:], comm[1:], 0.0, 1, 2, 256,
                                      variant="paper")
    assert len(split) == 1 + len(short) < 6
    placed = sorted(i for dist, local in split for i in dist + [j for r in local for j in r])
    assert placed == list(range(len(lengths)))


def test_can_pair_matches_a_brute_force_placement():
    # Two sequences fit together iff DACP can place them in one micro-batch.
    for n in (1, 2, 3, 4):
        for c in (8, 13, 20):
            for sx in range(1, 2 * n * c):
                for sy in range(1, sx + 1):
                    if shard_tokens(sx, n) > c or shard_tokens(sy, n) > c:
                        continue
                    lengths = np.array([sx, sy])
                    placed = reference.dacp_place(lengths, np.ones(2), [0, 1], n, c)
                    assert reference.can_pair(sx, sy, n, c) == (placed is not None), (sx, sy, n, c)


def test_rank_time_objectives():
    # Nothing distributed: both objectives are the local compute.
    for obj in reference.OBJECTIVES:
        assert reference.rank_time(3.0, 0.0, 0.0, 4, obj) == 3.0
    # paper: the local work hides the whole ring, the distributed compute hides nothing.
    assert reference.rank_time(1.0, 6.0, 8.0, 4, "paper") == 6.0 + 8.0
    # ring, compute-bound (block 2 > step 1.5): every exchange hides behind a block.
    assert reference.rank_time(1.0, 4.5, 8.0, 4, "ring") == 1.0 + 8.0
    # ring, comm-bound (step 3 > block 2), no local work: the exchanges plus the last block.
    assert reference.rank_time(0.0, 9.0, 8.0, 4, "ring") == 9.0 + 2.0
    # ring: local work overlaps only the first exchange.
    assert reference.rank_time(5.0, 9.0, 8.0, 4, "ring") == (5.0 + 2.0) + 2.0 + 2 * 3.0


@given(x=st.floats(0, 10), t_comm=st.floats(0, 10), t_dist=st.floats(0, 10),
       n=st.integers(2, 16))
@settings(max_examples=200, deadline=None)
def test_ring_objective_is_the_simulators_ring(x, t_comm, t_dist, n):
    """The scheduler's ``ring`` objective is the simulator's closed-form overlapped ring
    (equal work per rank), and both objectives are monotone in every argument."""
    from skrull_ext.planner.simulator import _uniform_ring

    want = _uniform_ring(x, t_dist / n, t_comm / (n - 1), n, overlap=True)
    assert reference.rank_time(x, t_comm, t_dist, n, "ring") == pytest.approx(want, rel=1e-12)
    for obj in reference.OBJECTIVES:
        t = reference.rank_time(x, t_comm, t_dist, n, obj)
        for dx, dc, dd in ((0.5, 0, 0), (0, 0.5, 0), (0, 0, 0.5)):
            assert reference.rank_time(x + dx, t_comm + dc, t_dist + dd, n, obj) >= t


def test_objective_changes_plans_and_predictions():
    """The cost model's objective reaches the scheduler (default path, C++ or Python):
    a long-tail batch on H100 costs gets a different plan, within the bucket either way."""
    import dataclasses

    from skrull_ext.costmodel.model import default_cost_model

    rng = np.random.default_rng(4)
    lengths = np.minimum((rng.pareto(1.2, 256) + 1) * 300, 100_000).astype(np.int64)
    cfg = SchedulerConfig(dp_size=4, cp_size=8, bucket_size=26 * 1024)
    ring = schedule(lengths, cfg, dataclasses.replace(default_cost_model(), objective="ring"))
    paper = schedule(lengths, cfg, dataclasses.replace(default_cost_model(), objective="paper"))
    assert ring.dp_ranks != paper.dp_ranks
    for plan in (ring, paper):
        assert plan.rank_tokens().max() <= cfg.bucket_size


# ---- the portfolio and the lower bound ---------------------------------------------

@pytest.mark.parametrize("objective", ["paper", "ring"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=global_batches())
def test_skrull_is_never_slower_than_a_baseline(objective, case):
    """The portfolio holds each all-CP baseline's micro-batches as a candidate and hybrid
    CP's plan is the last candidate (CP >= 3, where it has sub-groups), so Skrull's
    prediction is never above theirs (same cost model, exact float comparison)."""
    import dataclasses

    from skrull_ext.costmodel.model import default_cost_model

    lengths, dp, cp, bucket = case
    cm = dataclasses.replace(default_cost_model(), objective=objective)
    cfg = SchedulerConfig(dp_size=dp, cp_size=cp, bucket_size=bucket)
    t = schedule(lengths, cfg, cm, backend="python").predicted["iteration_time"]
    for policy in ("kk", "sorted", "all-cp", "per-seq-cp", "hybrid-cp"):
        other = schedule(lengths, dataclasses.replace(cfg, policy=policy), cm, backend="python")
        assert t <= other.predicted["iteration_time"], policy


def test_lower_bound_is_tight_for_one_sample_and_for_even_work():
    import dataclasses

    from skrull_ext.costmodel.model import default_cost_model
    from skrull_ext.scheduler.bound import lower_bound

    cm = dataclasses.replace(default_cost_model(), objective="ring")
    # One sample: the plan is its cheapest placement alone, which is the bound (CP <= 2 or
    # too long for a sub-group: no hybrid-CP placement is cheaper).
    for length, cp, bucket in ((30_000, 8, 4096), (3000, 2, 4096), (100, 1, 128)):
        plan = schedule([length], SchedulerConfig(dp_size=2, cp_size=cp, bucket_size=bucket), cm)
        assert plan.predicted["iteration_time"] == pytest.approx(plan.predicted["lower_bound"],
                                                                 rel=1e-9)
    # D*N equal local samples: one per rank is optimal and meets the bound.
    plan = schedule([1000] * 8, SchedulerConfig(dp_size=2, cp_size=4, bucket_size=1000), cm)
    assert plan.predicted["iteration_time"] == pytest.approx(plan.predicted["lower_bound"],
                                                             rel=1e-9)
    # Indivisible samples: 3 equal long ones on 2 DP ranks -> one rank holds two.
    lengths = [8000] * 3
    two = lower_bound(lengths, cm, 2, 1, 16_000) - cm.time.iteration_overhead
    one = cm.compute_seconds([8000])[0] + cm.micro_batch_overhead
    assert two == pytest.approx(2 * one - cm.micro_batch_overhead, rel=1e-9)


def test_gds_count_search_gallops_to_a_locally_fewest_count():
    """Past LINEAR_COUNTS infeasible counts GDS gallops and binary-searches: the count it
    returns is feasible and one fewer is not."""
    rng = np.random.default_rng(3)
    lengths = np.sort(rng.integers(200, 1000, size=400))
    costs = lengths.astype(np.float64)
    ctx = reference.GdsContext(lengths, costs, np.zeros(400), 0.0, 2, 600, "auto", "lpt",
                               None, "ring")
    seqs = list(range(400))
    bound = -(-int(lengths.sum()) // (600 * 2))
    split = reference._fewest_split(ctx, seqs, bound)
    m = len(split)
    assert m > bound + reference.LINEAR_COUNTS  # the galloping phase really ran
    assert reference._split_rank(ctx, seqs, m - 1) is None
    placed = sorted(i for dist, local in split for i in dist + [j for r in local for j in r])
    assert placed == seqs


def _lpt_times_by_k(lengths, costs, comm, lat, idx, cp, bucket, objective):
    """Every feasible k of dacp_place_lpt packed without pruning: {k: micro-batch time}."""
    order = sorted(idx, key=lambda i: (-int(lengths[i]), i))
    out, shards = {}, 0
    for k in range(len(order) + 1):
        if k:
            shards += shard_tokens(int(lengths[order[k - 1]]), cp)
            if cp == 1 or shards > bucket:
                break
        t_comm = sum(comm[i] for i in order[:k]) + lat if k else 0.0
        t_dist = sum(costs[i] / cp for i in order[:k])
        packed = reference._lpt_local(order[k:], lengths, costs, cp, bucket - shards, t_comm,
                                      t_dist, objective)
        if packed is not None:
            out[k] = reference.micro_batch_time((order[:k], packed[0]), costs, comm, lat, cp,
                                                objective=objective)
    return out


@pytest.mark.parametrize("objective", ["paper", "ring"])
def test_lpt_search_in_bound_order_finds_the_best_count(objective):
    """The bound-ordered k search (with its pruning and an outside limit) returns the k an
    exhaustive search would, and nothing when no k beats the limit; dacp_feasible agrees
    with dacp_best on whether a micro-batch can be placed."""
    rng = np.random.default_rng(11)
    checked = 0
    for _ in range(60):
        count, cp = int(rng.integers(1, 40)), int(rng.choice((1, 2, 4, 8)))
        lengths = np.minimum((rng.pareto(1.1, count) + 1) * 200, 40_000).astype(np.int64)
        if rng.random() < 0.3:  # near-equal samples: the q-smallest bound decides
            lengths = rng.integers(200, 212, count)
        costs = lengths * (1.0 + lengths / 8000.0)
        comm = lengths * 2e-4
        bucket = max(shard_tokens(int(s), cp) for s in lengths) + int(rng.integers(0, 30_000))
        idx = list(range(count))
        times = _lpt_times_by_k(lengths, costs, comm, 0.05, idx, cp, bucket, objective)
        got = reference.dacp_place_lpt(lengths, costs, comm, 0.05, idx, cp, bucket,
                                       objective=objective)
        assert (got is None) == (not times)
        for var in ("paper", "lpt", "auto"):
            best = reference.dacp_best(lengths, costs, comm, 0.05, idx, cp, bucket, "auto", var,
                                       objective=objective)
            assert reference.dacp_feasible(lengths, costs, comm, 0.05, idx, cp, bucket, "auto",
                                           var, objective=objective) == (best is not None)
        if got is None:
            continue
        t = reference.micro_batch_time(got, costs, comm, 0.05, cp, objective=objective)
        assert t == pytest.approx(min(times.values()), rel=1e-12)
        limit = min(times.values()) * (1.0 + 1e-6)
        assert reference.dacp_place_lpt(lengths, costs, comm, 0.05, idx, cp, bucket,
                                        objective=objective, limit=limit) is not None
        assert reference.dacp_place_lpt(lengths, costs, comm, 0.05, idx, cp, bucket,
                                        objective=objective,
                                        limit=min(times.values()) * (1 - 1e-6)) is None
        checked += 1
    assert checked > 30
