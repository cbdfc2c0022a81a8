"""The portfolio's ``pack`` candidates (``skrull_ext.scheduler.pack``): C++ parity, the
bucket cap, and the tight-bucket regime they exist for."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from skrull_ext.costmodel.hardware import get_hardware
from skrull_ext.costmodel.model import MODEL_PRESETS, default_cost_model
from skrull_ext.planner.evaluate import max_fitting_length
from skrull_ext.planner.profiles import load_profile, sample_global_batches
from skrull_ext.scheduler import SchedulerConfig, schedule
from skrull_ext.scheduler.pack import PACK_SPREAD, PACK_THRESHOLDS, pack_schedule, pack_threshold
from skrull_ext.scheduler.portfolio import dacp_each, iteration_time
from skrull_ext.scheduler.reference import GdsContext
from skrull_ext.sharding import shard_tokens
from test_parity import random_batch

_C = pytest.importorskip("skrull_ext._C", reason="C++ extension not built")


def _check_plan(plan, lengths, cp, bucket, threshold):
    """Every sample once; every CP rank of every micro-batch within the bucket; samples
    longer than the threshold distributed, the others local (when CP > 1)."""
    seen = []
    for rank in plan:
        for dist, local in rank:
            assert dist or any(local)  # only non-empty micro-batches
            shards = sum(shard_tokens(int(lengths[i]), cp) for i in dist)
            for r in local:
                assert shards + sum(int(lengths[i]) for i in r) <= bucket
            seen += dist + [i for r in local for i in r]
            if cp > 1:
                assert all(lengths[i] > threshold for i in dist)
                assert all(lengths[i] <= threshold for r in local for i in r)
    assert sorted(seen) == list(range(len(lengths)))


def test_pack_parity_and_bucket_cap():
    """Random batches (ties, tight buckets that open extra micro-batches, CP 1-16, with
    and without explicit shares): the C++ heap search returns the reference's plan."""
    rng = np.random.default_rng(5)
    opened = 0
    for trial in range(150):
        lengths, dp, cp, bucket = random_batch(rng)
        cm = default_cost_model()
        costs = cm.compute_seconds(lengths)
        shares = cm.share_seconds(lengths, cp) if trial % 2 else None
        for name in PACK_THRESHOLDS:
            thr = pack_threshold(name, bucket)
            spread = name in PACK_SPREAD
            want = pack_schedule(lengths, costs, shares, dp, cp, bucket, thr, spread)
            got = _C.pack_schedule(lengths, costs, shares, dp, cp, bucket, thr, spread=spread)
            assert got == [[(list(d), [list(r) for r in loc]) for d, loc in rank]
                           for rank in want], (lengths.tolist(), dp, cp, bucket, name)
            _check_plan(want, lengths, cp, bucket, bucket if cp == 1 else thr)
            token_bound = -(-int(lengths.sum()) // (bucket * cp * dp))
            opened += max(len(r) for r in want) > token_bound + 1
    assert opened > 5, opened  # the "no slot has room: open a micro-batch" path runs


def test_pack_threshold_is_integer_and_capped():
    assert pack_threshold("pack", 2817) == 2817
    assert pack_threshold("pack-95", 2817) == 2817 - 140
    lengths = np.array([100, 50, 3000, 20], dtype=np.int64)
    costs = default_cost_model().compute_seconds(lengths)
    # CP 1 distributes nothing; a threshold above the bucket acts as the bucket.
    plan = pack_schedule(lengths, costs, None, 1, 1, 3000, 10)
    assert all(not d for rank in plan for d, _ in rank)
    plan = pack_schedule(lengths, costs, None, 1, 4, 800, 10**9)
    assert [d for rank in plan for d, _ in rank if d] == [[2]]


def test_tight_bucket_long_tail_beats_hybrid_cp():
    """The regime the candidates exist for (llama3-sft lengths, GBS 4096, 7B, CP 16, DP 4,
    a 2,817-token bucket): every sample above the bucket must be sharded over all 16 ranks.
    Before the pack candidates Skrull's plan was predicted 5.46 s against hybrid-CP's
    5.26 s (sub-group rings); packing the long samples into few micro-batches and leveling
    the local ones over all slots gave ~5.22 s (see below for the one time model)."""
    batch = sample_global_batches(load_profile("llama3-sft"), num_batches=1,
                                  global_batch_size=4096, seed=0,
                                  max_length=max_fitting_length(16, 2817),
                                  overflow="truncate").batches[0]
    lengths = np.asarray(batch, dtype=np.int64)
    cm = dataclasses.replace(default_cost_model("qwen2.5-7b"), objective="ring")
    times = {}
    for policy in ("skrull", "hybrid-cp"):
        cfg = SchedulerConfig(dp_size=4, cp_size=16, bucket_size=2817, policy=policy)
        times[policy] = schedule(lengths, cfg, cm).predicted["iteration_time"]
    costs, shares = cm.compute_seconds(lengths), cm.share_seconds(lengths, 16)
    pack = pack_schedule(lengths, costs, shares, 4, 16, 2817, 2817)
    _check_plan(pack, lengths, 16, 2817, 2817)
    ctx = GdsContext(lengths, costs, cm.comm_seconds(lengths, 16), cm.comm_latency(16), 16,
                     2817, "auto", "auto", shares, "ring")
    alone = iteration_time(ctx, pack, cm.micro_batch_overhead) + cm.time.iteration_overhead
    # Under the one time model (linear work and the dK/dV return outside the ring, zigzag
    # padding in the shares) hybrid-CP's sub-group rings are dearer than before: 5.94 s,
    # pack alone 6.10 s; Skrull keeps the faster of every candidate.
    assert times["skrull"] <= min(alone, times["hybrid-cp"]), (alone, times)


def test_spread_candidate_hides_the_rings_under_paper():
    """``pack-spread``'s regime (ChatQA2 lengths, GBS 1024, 0.5B, CP 16, DP 4, a 28,457
    -token bucket, ``paper``): 59 samples must be sharded; first-fit packs them into few
    micro-batches whose rings nothing hides, spreading them by distributed work leaves
    local work beside every ring.  Its plan is >= 5% faster than ``pack``'s and than
    Megatron's dynamic-CP plan, and ``schedule()`` keeps at least that."""
    bucket = 28_457
    batch = sample_global_batches(load_profile("chatqa2-long-sft"), num_batches=2,
                                  global_batch_size=1024, seed=0,
                                  max_length=max_fitting_length(16, bucket),
                                  overflow="truncate").batches[0]
    lengths = np.asarray(batch, dtype=np.int64)
    cm = dataclasses.replace(get_hardware("h100").cost_model(MODEL_PRESETS["qwen2.5-0.5b"],
                                                             16, 4), objective="paper")
    costs, comm, shares = cm.schedule_arrays(lengths, 16)
    ctx = GdsContext(lengths, costs, comm, cm.comm_latency(16), 16, bucket, "auto", "auto",
                     shares, "paper")
    alone = {}
    for spread in (False, True):
        plan = pack_schedule(lengths, costs, shares, 4, 16, bucket, bucket, spread)
        _check_plan(plan, lengths, 16, bucket, bucket)
        plan = dacp_each(ctx, plan)  # as the portfolio runs it
        alone[spread] = (iteration_time(ctx, plan, cm.micro_batch_overhead)
                         + cm.time.iteration_overhead)
    times = {p: schedule(lengths, SchedulerConfig(dp_size=4, cp_size=16, bucket_size=bucket,
                                                  policy=p), cm).predicted["iteration_time"]
             for p in ("skrull", "dynamic-cp")}
    assert alone[True] < 0.95 * min(alone[False], times["dynamic-cp"]), (alone, times)
    assert times["skrull"] <= alone[True], (alone, times)
