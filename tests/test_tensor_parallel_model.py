"""Tensor parallelism in the hardware model, the simulator, the planner and the launcher's
cost model: a rank of the plan is a TP group (``Hardware.with_tensor_parallel``)."""
import dataclasses
import json

import numpy as np
import pytest

from skrull_ext.costmodel.hardware import CPU, H100
from skrull_ext.costmodel.memory import TrainingMemory
from skrull_ext.costmodel.model import MODEL_PRESETS
from skrull_ext.planner.cli import main
from skrull_ext.planner.simulator import lower_bound, simulate
from skrull_ext.scheduler.plan import MicroBatch, Plan

BIG = MODEL_PRESETS["qwen2.5-7b"]  # 28 heads, 4 KV groups


def _plan(lengths, mb, cp):
    return Plan(lengths=np.asarray(lengths, dtype=np.int64), dp_size=1, cp_size=cp,
                bucket_size=1 << 20, policy="test", dp_ranks=((mb,),))


def test_a_tp_group_computes_tp_times_faster_and_pays_its_collectives():
    tp2 = H100.with_tensor_parallel(2)
    assert H100.with_tensor_parallel(1) is H100
    assert tp2.peak_flops == 2 * H100.peak_flops and tp2.tensor_parallel == 2
    assert tp2.gpus_per_node == 4  # four TP groups per 8-GPU node
    # Each TP rank moves its heads' half of a ring message over its own link.
    assert float(tp2.intra_node_comm.time(2e8)) == pytest.approx(
        float(H100.intra_node_comm.time(1e8)))
    assert tp2.grad_reduce_seconds(1e9, 32) < H100.grad_reduce_seconds(1e9, 32)
    # Collectives: 4 all-reduces per layer of tokens x h activations, 2 (t-1)/t each.
    want = 4 * BIG.num_layers * 2 * 0.5 * BIG.hidden_size * 2 / H100.grad_busbw_intra * 1000
    assert float(tp2.tp_comm_seconds(BIG, 1000.0)) == pytest.approx(want)
    assert float(H100.tp_comm_seconds(BIG, 1000.0)) == 0.0

    mb = MicroBatch(distributed=(0,), local=((1,), (2,)))
    plan = _plan([40000, 3000, 5000], mb, 2)
    one, two = simulate(plan, BIG, H100), simulate(plan, BIG, tp2)
    np.testing.assert_allclose(two.attention_local, one.attention_local / 2)
    tokens = one.tokens[0, 0]
    np.testing.assert_allclose(two.linear[0, 0],
                               one.linear[0, 0] / 2 + tp2.tp_comm_seconds(BIG, tokens))
    assert lower_bound(plan.lengths, BIG, tp2, 1, 2) < lower_bound(plan.lengths, BIG, H100, 1, 2)


def test_tp_beyond_a_node_is_refused():
    with pytest.raises(ValueError, match="inside a node"):
        H100.with_tensor_parallel(16)
    with pytest.raises(ValueError, match="tp_busbw"):
        dataclasses.replace(H100, tensor_parallel=2)


def test_scheduler_cost_model_folds_the_collectives_into_c_linear():
    one = H100.cost_model(BIG, 8, 4).time
    two = H100.with_tensor_parallel(2).cost_model(BIG, 8, 4).time
    comm = float(H100.with_tensor_parallel(2).tp_comm_seconds(BIG, 1.0))
    assert two.c_linear == pytest.approx(one.c_linear / 2 + comm / BIG.linear_flops([1.0])[0])
    assert two.c_attention == pytest.approx(one.c_attention / 2)


def _summary(tmp_path, name, *extra):
    js = tmp_path / f"{name}.json"
    assert main(["--profile", "wikipedia", "--model", "qwen2.5-7b", "--dp-size", "1",
                 "--cp-size", "16", "--num-batches", "1", "--global-batch-size", "32",
                 "--use-distributed-optimizer", "--overflow", "truncate", "--policies", "skrull",
                 "--json", str(js),
                 *extra]) == 0
    return json.loads(js.read_text())


def test_planner_tp_and_sequence_parallel_follow_the_memory_model(tmp_path):
    base = _summary(tmp_path, "tp1")
    tp = _summary(tmp_path, "tp4", "--tp-size", "4", "--sequence-parallel")
    mem = TrainingMemory(precision="bf16", distributed_optimizer=True, dp_cp_size=16,
                         tp_size=4, sequence_parallel=True)
    assert tp["memory"]["static_gib"] == pytest.approx(mem.static_bytes(BIG) / 2**30)
    assert tp["memory"]["activation_bytes_per_token"] == pytest.approx(
        mem.activation_bytes_per_token(BIG))
    assert tp["memory"]["training"]["tp_size"] == 4
    assert tp["memory"]["recommended_bucket"] > 3 * base["memory"]["recommended_bucket"]
    assert tp["skrull"]["lower_bound_s"] < base["skrull"]["lower_bound_s"]


@pytest.mark.parametrize("argv,text", [
    (["--tp-size", "3"], "must divide the model's 32 attention heads"),
    (["--sequence-parallel"], "--sequence-parallel needs --tp-size > 1"),
    (["--tensor-model-parallel-size", "16"], "--tp-size: tensor-parallel size 16 > 8"),
])
def test_planner_tp_errors_exit_2_with_one_line(argv, text, capsys, tmp_path):
    cfg = tmp_path / "m.json"  # 32 heads, 16 KV groups: TP 16 divides them
    cfg.write_text(json.dumps(dict(dataclasses.asdict(BIG), num_attention_heads=32,
                                   num_query_groups=16, hidden_size=4096)))
    rc = main(["--profile", "wikipedia", "--model-config", str(cfg), "--cp-size", "8",
               "--num-batches", "1", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and text in err, err


def test_launcher_cost_model_is_per_tp_group():
    from megatron.skrull.arguments import parse_args
    from megatron.skrull.batch_schedule import build_cost_model

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "256", "--max-position-embeddings", "256",
            "--global-batch-size", "4", "--skrull-bucket-size", "512", "--lr", "1e-3",
            "--train-iters", "1", "--device", "cpu", "--mock-data"]
    one = build_cost_model(parse_args(argv, world_size=2), 128)
    two = build_cost_model(parse_args(argv + ["--tensor-model-parallel-size", "2"],
                                      world_size=2), 128)
    assert two.time.c_attention == pytest.approx(one.time.c_attention / 2)
    assert two.time.c_linear > one.time.c_linear / 2  # plus the TP all-reduces
    assert CPU.with_tensor_parallel(2).tensor_parallel == 2
