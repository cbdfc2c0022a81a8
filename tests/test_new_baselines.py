"""Megatron-LM's dp_balanced and dynamic CP, WLB-LLM and FlexSP as baselines: their rules
on hand-checked batches (invariants of every policy: tests/test_scheduler_core.py)."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from skrull_ext.costmodel.model import default_cost_model
from skrull_ext.scheduler import SchedulerConfig, schedule
from skrull_ext.scheduler.flexsp import bucketize, chunk_sorted, group_sizes
from skrull_ext.scheduler.megatron_packing import (cp_needed, dp_balanced_groups,
                                                   dynamic_cp_world, shard_check)
from skrull_ext.scheduler.wlb import OutlierDelay, wlb_groups


def test_dp_balanced_packs_in_order_and_splits_to_a_multiple_of_dp():
    # CP 2 pads to multiples of 4; cap = 2 x 100 tokens per pack.
    lengths = [90, 90, 30, 150, 20, 10, 197]
    packs = dp_balanced_groups(lengths, None, 1, 2, 100)
    assert packs == [[[0, 1], [2, 3], [4, 5], [6]]]  # 92+92, 32+152, 20+12, 200
    # D = 3: 4 packs -> 6; the last multi-sample pack ([4, 5]) gives up 5, then [2, 3] gives
    # 3; micro-batch i of DP rank d is pack i D + d.
    assert dp_balanced_groups(lengths, None, 3, 2, 100) == [[[0, 1], [6]], [[2], [5]],
                                                            [[4], [3]]]


def test_dynamic_cp_needs_and_doubles_into_empty_ranks():
    assert [cp_needed(s, 2048, 64) for s in (100, 2048, 2049, 4096, 8192, 8193)] == \
        [1, 1, 2, 2, 4, 8]
    assert cp_needed(9000, 2048, 4) == 4  # capped at the block
    # 3000 on rank 0; 100 opens rank 1 (same largest workload, a new group first found at
    # size 1 beats joining rank 0); the empty ranks 2-3 are filled by doubling rank 0's
    # group (pushing 100 to rank 2), then 100's: two groups of two.
    (mb,) = dynamic_cp_world([3000, 100], 1, 4, 4096, block=4)
    assert mb == [(0, 2, (0,)), (2, 2, (1,))]


def test_dynamic_cp_joins_a_group_when_that_keeps_the_workload_lowest():
    # 5000 needs 4 ranks (5000 / 2048 -> 4): the whole world; 1500 can only join it.
    (mb,) = dynamic_cp_world([5000, 1500], 1, 4, 2048, block=4)
    assert mb == [(0, 4, (0, 1))]
    # Over the cap (tallest x bucket x 1.05) a sample waits for the next micro-batch.
    out = dynamic_cp_world([2048, 2048, 2048, 2048, 2048], 1, 4, 2048, block=4)
    assert [len(mb) for mb in out] == [4, 1]


def test_dynamic_cp_blocks_keep_groups_inside_replicas():
    rng = np.random.default_rng(3)
    lengths = np.clip(rng.lognormal(6.0, 1.5, 200), 64, 8192).astype(np.int64)
    world = dynamic_cp_world(lengths, 4, 4, 2048, block=16)
    blocks = dynamic_cp_world(lengths, 4, 4, 2048, block=4)
    for out, block in ((world, 16), (blocks, 4)):
        ids = sorted(i for mb in out for _, _, g in mb for i in g)
        assert ids == list(range(lengths.size))
        assert all(shard_check(mb, lengths, 2048) for mb in out)
        assert all(first // block == (first + size - 1) // block
                   for mb in out for first, size, _ in mb)
    for d, n in ((2, 3), (3, 2), (1, 6)):  # non-power-of-two worlds and replicas too
        lengths = np.clip(rng.lognormal(6.0, 1.5, 60), 1, 3900).astype(np.int64)  # fits 2 ranks
        for block in (n, d * n):
            out = dynamic_cp_world(lengths, d, n, 2000, block)
            assert all(shard_check(mb, lengths, 2000) for mb in out)
            assert sorted(i for mb in out for _, _, g in mb for i in g) == list(range(60))
    # Megatron's empty ranks are filled by doubling across the whole world; ours stay idle
    # in the replicas that got nothing.
    assert dynamic_cp_world([100], 2, 2, 2048, block=4) == [[(0, 4, (0,))]]
    assert dynamic_cp_world([100], 2, 2, 2048, block=2) == [[(0, 2, (0,))]]


def test_wlb_balances_workload_and_delays_outliers():
    lengths = np.array([100, 900, 400, 400, 300, 600, 200, 100])
    costs = lengths.astype(np.float64) ** 2
    (rank,) = wlb_groups(lengths, costs, 1, 2, 800)  # 3000 tokens / 1600 -> 2 micro-batches
    work = sorted(float(costs[g].sum()) for g in map(np.array, rank))
    assert [sorted(g) for g in rank] == [[0, 1, 4, 7], [2, 3, 5, 6]]
    assert work[1] / work[0] < 1.3
    delay = OutlierDelay(thresholds=[1000, 5000], release=2)
    assert delay.step([(0, 50), (1, 2000), (2, 70)]) == [(0, 50), (2, 70)]
    assert delay.step([(3, 6000)]) == [] and delay.pending() == 2
    assert delay.step([(4, 3000), (5, 10)]) == [(5, 10), (1, 2000), (4, 3000)]
    assert delay.flush() == [(3, 6000)] and delay.pending() == 0


def test_flexsp_helpers_match_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(30):
        s = np.sort(rng.integers(1, 50, int(rng.integers(2, 8))))
        for b in (1, 2, 3):
            got = bucketize(s, b)
            pad = sum(int(s[e - 1]) * (e - a) - int(s[a:e].sum()) for a, e in got)
            best = min(sum(int(s[e - 1]) * (e - a) - int(s[a:e].sum())
                           for a, e in zip((0,) + cut, cut + (s.size,)))
                       for cut in itertools.combinations(range(1, s.size), min(b, s.size) - 1))
            assert pad == best and got[0][0] == 0 and got[-1][1] == s.size
        desc = s[::-1]
        for parts in (1, 2, 3):
            got = max(int(desc[c].sum()) for c in chunk_sorted(desc, parts))
            best = min(max(int(x.sum()) for x in np.split(desc, list(cut)))
                       for cut in itertools.combinations(range(1, s.size), min(parts, s.size) - 1))
            assert got == best
    assert group_sizes(8) == [1, 2, 4, 8] and group_sizes(6) == [1, 2, 6]
    assert group_sizes(3) == [1, 3]


def test_flexsp_solves_small_batches_into_sub_groups(monkeypatch):
    pytest.importorskip("scipy")
    from skrull_ext.scheduler import flexsp

    monkeypatch.setattr(flexsp, "TIME_LIMIT_S", 0.5)
    cost = default_cost_model("qwen2.5-0.5b")
    # One long sample dominates: it gets a replica's whole CP group, the rest anything.
    lengths = np.array([30000, 9000, 700, 500, 400, 350, 300, 200, 120, 90, 80, 60])
    plan = schedule(lengths, SchedulerConfig(dp_size=2, cp_size=4, bucket_size=8192,
                                             policy="flexsp"), cost)
    assert flexsp.LAST_SOLVE == {"chunks": 1, "optimal": 1, "fallback": 0}
    assert any(mb.distributed == (0,) for mbs in plan.dp_ranks for mb in mbs)
    # Short samples only, solved to optimality: some whole on one rank (no ring), faster
    # than packing them all-CP.
    lengths = np.random.default_rng(1).integers(100, 3000, 12)
    config = SchedulerConfig(dp_size=1, cp_size=4, bucket_size=4096, policy="flexsp")
    plan = schedule(lengths, config, cost)
    assert flexsp.LAST_SOLVE["optimal"] == flexsp.LAST_SOLVE["chunks"] >= 1
    assert any(any(mb.local) for mb in plan.dp_ranks[0])
    assert plan.rank_tokens().max() <= 4096
    all_cp = schedule(lengths, dataclasses.replace(config, policy="all-cp"), cost)
    assert plan.predicted["iteration_time"] < all_cp.predicted["iteration_time"]


def test_flexsp_names_the_fix_without_scipy(monkeypatch):
    import builtins

    from skrull_ext.scheduler import flexsp

    real = builtins.__import__

    def no_scipy(name, *args, **kwargs):
        if name.startswith("scipy"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_scipy)
    with pytest.raises(ImportError, match=r"pip install 'skrull-megatron\[bench\]'"):
        flexsp._milp()


def test_megatron_benchmark_setting_is_megatrons(tmp_path, monkeypatch):
    """benchmarks/megatron_dynamic_cp.py: Megatron's global order and padding, its dynamic
    CP groups aligned as ``create_dynamic_dp_cp_groups`` builds them, one recorded run."""
    import json
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    try:
        import megatron_dynamic_cp as bench
    finally:
        sys.path.pop(0)
    pool = np.arange(100, 164)
    # D = 2, 8 fetches per rank: rank 0 holds samples 0, 2, ..., 14, then rank 1's.
    assert bench.global_batch(pool, 1, 2).tolist() == [116 + 2 * m for m in range(8)] + \
        [117 + 2 * m for m in range(8)]
    assert bench.megatron_padded(np.array([1, 8, 9, 127]), 8).tolist() == [8, 8, 16, 128]
    lengths = bench.mock_lengths(8 * 16 * 3)
    for d in (2, 16):  # Megatron's runtime groups: aligned blocks of a power of two
        for it in range(3):
            padded = bench.megatron_padded(bench.global_batch(lengths, it, d), 8 * d)
            for mb in dynamic_cp_world(padded, d, 4, 2048, 4 * d):
                assert all(first % size == 0 and size & (size - 1) == 0
                           for first, size, _ in mb)
    # each aligned group of 2+ ranks counts once, at its first use (D = 2: 4 + 2 + 1 groups)
    monkeypatch.setattr(bench, "WARMUP", 0)
    first = bench.groups_first_used(lengths, 8)
    assert len(first) == bench.MEASURED and 1 <= sum(first) <= 7 and first[0] >= 1
    monkeypatch.undo()
    # The TE ring's host-time constants are those of the recorded te_ring_host run.
    root = os.path.dirname(os.path.dirname(__file__))
    with open(os.path.join(root, bench.TE_RING_RESULTS), encoding="utf-8") as f:
        te = {r["cp"]: r for r in json.load(f)["rows"]["per_cp"]}[4]
    assert te["forward_s"] + te["backward_s"] == pytest.approx(bench.TE_RING_CP4["host_s"],
                                                               rel=1e-3)
    syncs, fused = te["aten_kernels"]["_local_scalar_dense"], 6 * te["aten_kernels"]["exp"]
    assert te["counts"]["aten.kernel"] - syncs - fused == bench.TE_RING_CP4["kernels"]
    assert te["counts"]["nccl.isend"] + te["counts"]["nccl.irecv"] == bench.TE_RING_CP4["nccl"]
    assert bench.te_ring_step_host_s() < bench.te_ring_step_host_s(all_in=True)
    monkeypatch.setenv("SKRULL_RESULTS_DIR", str(tmp_path))
    assert bench.main(["--gpus", "4", "8", "--spread", "0", "--no-calibration"]) == 0
    (path,) = tmp_path.iterdir()
    rows = json.loads(path.read_text())["rows"]
    assert [(r["model"], r["gpus"]) for r in rows] == [
        (m, g) for m in ("preset", "te-host", "te-host-all-in", "pcie4-ring", "pcie4-nodes")
        for g in (4, 8)]
    assert all(r["ratio"] > 1.0 and r["skrull_vs_dynamic_cp"] >= 1.0 - 1e-9 for r in rows)
    assert all(r["published_mean_ratio"] == pytest.approx(
        bench.PUBLISHED_MEAN[r["gpus"]][0] / bench.PUBLISHED_MEAN[r["gpus"]][1])
        and r["ratio_of_means"] > 1.0 and len(r["dcp_groups_first_used"]) == bench.MEASURED
        for r in rows)
    by = {(r["model"], r["gpus"]): r["ms"] for r in rows}
    for g in (4, 8):  # host time added to every ring step never makes an iteration faster
        for policy in ("dp_balanced", "dynamic_cp"):
            assert by["preset", g][policy] < by["te-host", g][policy] < \
                by["te-host-all-in", g][policy]
        # a slower ring link slows dp_balanced's all-rank rings more than dynamic CP's
        assert by["pcie4-ring", g]["dp_balanced"] / by["pcie4-ring", g]["dynamic_cp"] > \
            by["preset", g]["dp_balanced"] / by["preset", g]["dynamic_cp"]
    # four GPUs per node: one node at 4 GPUs (the same times); at 8 the gradient all-reduce
    # and dynamic CP's 8-rank rings cross nodes, so both are slower and the ratio falls
    assert by["pcie4-nodes", 4] == by["pcie4-ring", 4]
    assert all(by["pcie4-nodes", 8][p] > by["pcie4-ring", 8][p] for p in by["pcie4-ring", 8])
    assert by["pcie4-nodes", 8]["dp_balanced"] / by["pcie4-nodes", 8]["dynamic_cp"] < \
        by["pcie4-ring", 8]["dp_balanced"] / by["pcie4-ring", 8]["dynamic_cp"]
