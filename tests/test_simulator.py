"""The iteration-time simulator: ring model, monotonicity and sanity properties."""
import dataclasses

import numpy as np
import pytest

from skrull_ext.costmodel.model import MODEL_PRESETS, CommModel, ModelSpec
from skrull_ext.costmodel.hardware import CPU, H100, Hardware, get_hardware, linear_comm
from skrull_ext.scheduler.plan import MicroBatch, Plan
from skrull_ext.planner.profiles import load_profile, sample_global_batches
from skrull_ext.scheduler import POLICIES, SchedulerConfig, schedule
from skrull_ext.planner.simulator import _uniform_ring, lower_bound, ring_finish, simulate

SMALL = MODEL_PRESETS["qwen2.5-0.5b"]


def _plan(lengths, micro_batches, cp_size, dp_ranks=None, bucket=1 << 20):
    ranks = dp_ranks or (tuple(micro_batches),)
    return Plan(lengths=np.asarray(lengths, dtype=np.int64), dp_size=len(ranks),
                cp_size=cp_size, bucket_size=bucket, policy="test", dp_ranks=ranks)


def _dist(idx, n):
    return MicroBatch(distributed=tuple(idx), local=tuple(() for _ in range(n)))


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_uniform_ring_closed_form_matches_recursion(overlap, n):
    cases = [(0.0, 1.0, 0.5, 0.0), (0.3, 0.2, 1.0, 0.4), (2.0, 1.0, 1.0, 0.1)]
    for local, block, comm, ret in cases:
        rec = ring_finish(np.full(n, local), block, comm, overlap=overlap, ret=ret)
        assert np.allclose(rec, _uniform_ring(local, block, comm, n, overlap, ret))


def test_ring_overlap_never_slower_and_comm_monotone():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(2, 10))
        local = rng.exponential(1.0, n) * rng.integers(0, 2, n)
        block = rng.exponential(0.5, n)
        comm = float(rng.exponential(0.5))
        ret = float(rng.exponential(0.2))
        on = ring_finish(local, block, comm, overlap=True, ret=ret)
        off = ring_finish(local, block, comm, overlap=False, ret=ret)
        assert np.all(on <= off + 1e-12)
        more = ring_finish(local, block, comm * 1.7 + 0.01, overlap=True, ret=ret)
        assert np.all(more >= on - 1e-12)
        # Every rank at least computes its own work.
        assert np.all(on >= local + n * block - 1e-12)


def test_imbalanced_local_work_delays_the_ring():
    n = 4
    balanced = ring_finish(np.zeros(n), 1.0, 1.5, overlap=True)
    skewed = ring_finish(np.array([0.0, 0.0, 3.0, 0.0]), 1.0, 1.5, overlap=True)
    assert skewed.max() > balanced.max()
    # The late rank forwards late: its successor finishes later than with no local work.
    assert skewed[3] > balanced[3]


def _random_batches():
    out = []
    for name, scale in (("wikipedia", 1.0), ("chatqa2-long-sft", 1.0), ("lmsyschat1m", 1.0)):
        out.extend(sample_global_batches(load_profile(name).scaled(scale), num_batches=2,
                                         global_batch_size=48, seed=3, max_length=8 * 8192,
                                         overflow="truncate").batches)
    return out


@pytest.mark.parametrize("hw", [H100, CPU], ids=["h100", "cpu"])
def test_every_policy_is_at_least_the_lower_bound(hw):
    cost = hw.cost_model(SMALL, 4)
    for lengths in _random_batches():
        for policy in POLICIES:
            plan = schedule(lengths, SchedulerConfig(dp_size=2, cp_size=4, bucket_size=16384,
                                                     policy=policy), cost, backend="python")
            res = simulate(plan, SMALL, hw)
            assert np.isfinite(res.iteration_time)
            assert res.iteration_time >= res.lower_bound * (1 - 1e-12), policy
            assert res.lower_bound == pytest.approx(lower_bound(lengths, SMALL, hw, 2, 4))
            busy = res.busy() + res.overhead[..., None]
            assert np.all(busy <= res.mb_times[..., None] + 1e-12)


def test_more_communication_is_never_faster():
    lengths = [30000, 12000, 700, 5000, 64, 9000, 20000, 1500]
    plan = schedule(lengths, SchedulerConfig(dp_size=1, cp_size=8, bucket_size=12000),
                    H100.cost_model(SMALL, 8), backend="python")
    base = simulate(plan, SMALL, H100)
    slow = dataclasses.replace(H100, intra_node_comm=CommModel(
        sizes_bytes=H100.intra_node_comm.sizes_bytes,
        seconds=tuple(3 * s for s in H100.intra_node_comm.seconds)))
    slower = simulate(plan, SMALL, slow)
    assert slower.iteration_time >= base.iteration_time
    assert slower.comm_total.sum() == pytest.approx(3 * base.comm_total.sum())
    assert simulate(plan, SMALL, H100, overlap=False).iteration_time >= base.iteration_time


def test_overlap_never_slower_on_plans():
    for lengths in _random_batches()[:4]:
        plan = schedule(lengths, SchedulerConfig(dp_size=2, cp_size=4, bucket_size=8192),
                        H100.cost_model(SMALL, 4), backend="python")
        on = simulate(plan, SMALL, H100, overlap=True)
        off = simulate(plan, SMALL, H100, overlap=False)
        assert on.iteration_time <= off.iteration_time + 1e-12
        assert np.all(on.mb_times <= off.mb_times + 1e-12)


def test_more_cp_ranks_reduce_compute_per_rank():
    s = 65536
    compute = []
    for n in (1, 2, 4, 8):
        res = simulate(_plan([s], [_dist([0], n)], n), SMALL, H100)
        per_rank = res.linear[0, 0] + res.attention_dist[0, 0]
        assert np.allclose(per_rank, per_rank[0])  # zigzag balances the ranks
        compute.append(float(per_rank[0]))
    assert all(b < a for a, b in zip(compute, compute[1:])), compute


def test_components_and_padding():
    n = 4
    mb = MicroBatch(distributed=(0,), local=((1,), (), (2, 3), ()))
    res = simulate(_plan([17, 100, 50, 30], [mb, MicroBatch.empty(n)], n), SMALL, H100)
    assert res.tokens[0, 0].tolist() == [106, 6, 86, 6]  # pad(17, 4) = 24 -> 6 per rank
    assert np.allclose(res.padding[0, 0], 6 - 17 / 4)
    hw = H100
    s = np.array([100.0])
    want = SMALL.attention_flops(s)[0] / hw.attention_rate(s)[0]
    assert res.attention_local[0, 0, 0] == pytest.approx(want)  # rank 0 holds sample 1
    assert res.attention_local[0, 0, 1] == 0.0 and res.attention_local[0, 0, 3] == 0.0
    assert res.mb_times[0, 1] == 0.0 and res.overhead[0, 1] == 0.0  # empty micro-batch
    # The fixed per-micro-batch cost, with the matmuls' weight streaming (T_half tokens).
    fixed = hw.micro_batch_fixed_seconds(SMALL) + (SMALL.linear_flops([hw.linear_half_tokens])[0]
                                                    / (hw.peak_flops * hw.linear_efficiency))
    assert res.overhead[0, 0] == pytest.approx(fixed)
    assert res.overhead[0, 0] == pytest.approx(hw.cost_model(SMALL, n).micro_batch_overhead)
    assert res.mb_starts[0, 1] == pytest.approx(res.mb_times[0, 0])


def test_grad_reduce_and_inter_node_ring():
    p = SMALL.param_count()
    t = H100.grad_reduce_seconds(p, 32)
    assert t == pytest.approx(H100.grad_latency_s + 2 * 31 / 32 * p * 2 / H100.grad_busbw_inter)
    assert H100.grad_reduce_seconds(p, 1) == 0.0
    assert H100.ring_comm(8) is H100.intra_node_comm
    assert H100.ring_comm(16) is H100.inter_node_comm
    one = simulate(_plan([65536], [_dist([0], 16)], 16), SMALL, H100)
    assert one.grad_reduce_time == pytest.approx(H100.grad_reduce_seconds(p, 16))
    assert one.iteration_time == pytest.approx(one.compute_time + one.grad_reduce_time)


def test_timeline_segments_fill_each_micro_batch():
    mb = MicroBatch(distributed=(0, 1), local=((2,), (3,)))
    res = simulate(_plan([3000, 800, 1200, 40], [mb, mb], 2), SMALL, H100)
    segs = res.segments(0)
    for m in range(2):
        for r in range(2):
            mine = [s for s in segs if s["micro_batch"] == m and s["cp_rank"] == r]
            assert sum(s["duration"] for s in mine) == pytest.approx(res.mb_times[0, m])
            assert all(a["start"] + a["duration"] == pytest.approx(b["start"])
                       for a, b in zip(mine, mine[1:]))
    assert {s["kind"] for s in segs} >= {"linear", "attention_local", "attention_dist"}
    summary = res.summary()
    assert summary["num_micro_batches"] == 2 and summary["linear"] > 0


def test_hardware_validation_and_presets():
    assert get_hardware("cpu") is CPU
    with pytest.raises(ValueError, match="--hardware"):
        get_hardware("tpu")
    with pytest.raises(ValueError, match="peak_flops"):
        dataclasses.replace(H100, peak_flops=0.0)
    with pytest.raises(ValueError, match="layer_overhead_s"):
        dataclasses.replace(H100, layer_overhead_s=-1.0)
    comm = linear_comm(1e-5, 1e9)
    assert float(comm.time(1 << 20)) == pytest.approx(1e-5 + (1 << 20) / 1e9)
    cost = H100.cost_model(SMALL, 8)
    assert cost.time.c_linear == pytest.approx(1 / (H100.peak_flops * H100.linear_efficiency))
    assert isinstance(H100, Hardware)
    # CPU comm points increase (running max at calibration): more bytes never faster.
    assert all(b >= a for a, b in zip(CPU.intra_node_comm.seconds, CPU.intra_node_comm.seconds[1:]))


def test_custom_model_spec_runs():
    spec = ModelSpec(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                     num_query_groups=2, vocab_size=100)
    plan = schedule([10, 200, 33], SchedulerConfig(dp_size=1, cp_size=2, bucket_size=256),
                    CPU.cost_model(spec, 2), backend="python")
    res = simulate(plan, spec, "cpu")
    assert res.hardware == "cpu" and res.iteration_time >= res.lower_bound
