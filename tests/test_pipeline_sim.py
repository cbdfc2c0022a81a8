"""Pipeline parallelism in the simulator, the memory model and the planner CLI."""
import json

import numpy as np
import pytest

from skrull_ext.costmodel.hardware import get_hardware
from skrull_ext.costmodel.model import MODEL_PRESETS, MemoryModel
from skrull_ext.planner.cli import GIB, main
from skrull_ext.planner.pipeline import (ORDERS, one_f_one_b, order_micro_batches,
                                         pipeline_bucket, pipeline_times, simulate_pipeline,
                                         stage_param_count)
from skrull_ext.planner.profiles import load_profile, sample_global_batches
from skrull_ext.planner.simulator import simulate
from skrull_ext.scheduler import SchedulerConfig, schedule

H100 = get_hardware("h100")
M7B = MODEL_PRESETS["qwen2.5-7b"]


@pytest.mark.parametrize("p,m", [(1, 3), (2, 5), (4, 2), (4, 7)])
def test_1f1b_order_runs_every_pass_once_and_warms_up(p, m):
    for s in range(p):
        ops = one_f_one_b(p, s, m)
        assert sorted(ops) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        warm = next(k for k, op in enumerate(ops) if op[0] == "B")
        assert warm == min(p - s, m)  # P - s - 1 warm-up forwards, then one 1F1B forward
        # In flight never exceeds P - s (the memory model's premise).
        live = np.cumsum([1 if k == "F" else -1 for k, _ in ops])
        assert live.max() <= p - s


@pytest.mark.parametrize("p,m", [(1, 4), (2, 4), (4, 8), (4, 2)])
def test_uniform_micro_batches_give_the_textbook_bubble(p, m):
    f, b = 1.0, 2.0
    span, busy = pipeline_times([f] * m, [b] * m, [0.0] * m, p)
    assert span == pytest.approx((m + p - 1) * (f + b))
    assert busy[0] == pytest.approx(m * (f + b))


def test_p2p_and_a_long_first_micro_batch_delay_the_pipeline():
    base, _ = pipeline_times([1.0] * 4, [2.0] * 4, [0.0] * 4, 4)
    assert pipeline_times([1.0] * 4, [2.0] * 4, [0.1] * 4, 4)[0] > base
    t = np.array([5.0, 1.0, 1.0, 1.0])
    first_long, _ = pipeline_times(t / 3, 2 * t / 3, np.zeros(4), 4)
    perm = order_micro_batches(t, "small-ends")
    assert sorted(perm) == [0, 1, 2, 3] and perm[0] != 0
    better, _ = pipeline_times(t[perm] / 3, 2 * t[perm] / 3, np.zeros(4), 4)
    assert better < first_long


def _plans(policy, pp, bucket, dp=1, cp=4, n=2):
    batches = sample_global_batches(load_profile("chatqa2-long-sft"), num_batches=n,
                                    global_batch_size=32, seed=1, max_length=cp * bucket,
                                    overflow="redraw").batches
    cfg = SchedulerConfig(dp_size=dp, cp_size=cp, bucket_size=bucket, policy=policy)
    return [schedule(b, cfg, H100.cost_model(M7B, cp, dp)) for b in batches]


def test_pp1_is_the_plain_simulator_and_best_order_never_loses():
    for plan in _plans("skrull", 1, 8192):
        one = simulate_pipeline(plan, M7B, H100, pp_size=1)
        assert one.iteration_time == pytest.approx(simulate(plan, M7B, H100).iteration_time)
        assert one.bubble_share == pytest.approx(0.0, abs=1e-12)
        for p in (2, 4):
            runs = {o: simulate_pipeline(plan, M7B, H100, pp_size=p, order=o) for o in ORDERS}
            best = simulate_pipeline(plan, M7B, H100, pp_size=p, order="best")
            assert best.iteration_time == min(r.iteration_time for r in runs.values())
            assert best.compute_time >= best.ideal_time
            assert best.iteration_time >= best.lower_bound


def test_pipeline_bucket_keeps_every_stage_in_flight_sum_in_memory():
    dev, margin = 80 * GIB, 8 * GIB
    b1, _ = pipeline_bucket(M7B, H100, pp_size=1, optimizer_shards=16, device_bytes=dev,
                            margin_bytes=margin)
    static = M7B.static_memory_bytes(16, grad_bytes=H100.grad_bytes,
                                     weight_bytes=H100.activation_bytes)
    alpha = M7B.activation_bytes_per_token() * H100.activation_bytes / 2
    assert b1 == MemoryModel(alpha=alpha).bucket_size(dev, static, margin)
    assert sum(stage_param_count(M7B, 4, s) for s in range(4)) == M7B.param_count()
    for p in (2, 4):
        bucket, info = pipeline_bucket(M7B, H100, pp_size=p, optimizer_shards=16,
                                       device_bytes=dev, margin_bytes=margin)
        for st in info["stages"]:
            used = st["static_bytes"] + st["in_flight"] * bucket * st["bytes_per_token"]
            assert used <= dev - margin
        assert bucket == min(st["bucket"] for st in info["stages"])
        assert info["stages"][0]["in_flight"] == p


def test_planner_pp_reports_time_and_best_bucket(tmp_path, capsys):
    js = tmp_path / "s.json"
    argv = ["--profile", "chatqa2-long-sft", "--model", "qwen2.5-7b", "--dp-size", "1",
            "--cp-size", "8", "--global-batch-size", "32", "--num-batches", "2",
            "--overflow", "redraw", "--policies", "skrull,all-cp"]
    assert main(argv + ["--pp-size", "2", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "PP=2" in out and "<- best" in out
    summary = json.loads(js.read_text())
    sweep = {int(k): v for k, v in summary["memory"]["bucket_sweep"].items()}
    assert summary["bucket_size"] == min(sweep, key=sweep.get)
    assert summary["skrull"]["mean_iteration_s"] == pytest.approx(min(sweep.values()))
    assert main(argv + ["--pp-size", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--pp-size 3" in err[0] and "28 layers" in err[0]
