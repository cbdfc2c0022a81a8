"""The memory model (skrull_ext.costmodel.memory): its accounting, the planner at the paper's
settings, and the launcher's real tensors on CPU (static bytes within 1%)."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

from skrull_ext.costmodel.memory import TrainingMemory
from skrull_ext.costmodel.model import MODEL_PRESETS
from skrull_ext.planner.cli import main as plan_main

from mcore_helpers import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Q7 = MODEL_PRESETS["qwen2.5-7b"]


def test_static_bytes_per_parameter_follow_megatron():
    n = Q7.param_count()
    per_param = lambda **kw: TrainingMemory(**kw).static_bytes(Q7) / n  # noqa: E731
    assert per_param(precision="fp32") == pytest.approx(4 + 4 + 0 + 8)
    # bf16: bf16 params, fp32 grad buffer (accumulate_allreduce_grads_in_fp32), fp32 main
    # params and Adam moments.
    assert per_param(precision="bf16") == pytest.approx(2 + 4 + 4 + 8)
    assert per_param(precision="fp16") == pytest.approx(2 + 2 + 4 + 8)
    # The distributed optimizer shards main params and Adam state, not the grad buffer.
    assert per_param(precision="bf16", distributed_optimizer=True, dp_cp_size=32) == \
        pytest.approx(2 + 4 + 12 / 32)
    assert per_param(precision="bf16", dp_cp_size=32) == pytest.approx(18)  # off: no sharding
    assert TrainingMemory(precision="bf16", tp_size=2).static_bytes(Q7) == \
        pytest.approx(TrainingMemory(precision="bf16").static_bytes(Q7) / 2)


def test_activation_bytes_by_recompute():
    none = TrainingMemory(precision="bf16").activation_bytes_per_token(Q7)
    sel = TrainingMemory(precision="bf16", recompute="selective").activation_bytes_per_token(Q7)
    full = TrainingMemory(precision="bf16", recompute="full").activation_bytes_per_token(Q7)
    assert none == Q7.activation_bytes_per_token()
    h, kv, f, v = Q7.hidden_size, Q7.kv_hidden_size, Q7.ffn_hidden_size, Q7.vocab_size
    # Per layer 14h + 6 h_kv + 10f bf16 bytes, plus two rstd (fp32) and the log-sum-exp
    # (fp32 per head); outside: the final norm, the micro-batch buffer (3 int64: ids, labels,
    # positions; the fp32 loss mask), targets, the fp32 softmax and the bf16 logits, RoPE's cos and sin (bf16,
    # shared by the layers) and its angle table (fp32).
    d = Q7.head_dim
    layer = 14 * h + 6 * kv + 10 * f + 8 + 4 * Q7.num_attention_heads
    outside = 4 * h + 4 + 28 + 9 + 6 * v + 2 * d * 2 + 4 * d
    assert none == Q7.num_layers * layer + outside
    # Selective (core_attn checkpointed): the key after RoPE and the log-sum-exp go; the
    # query after RoPE is replaced by mcore's query copy the checkpoint keeps.  RoPE's cos
    # and sin are then held, not saved (the same bytes).
    assert none - sel == Q7.num_layers * (2 * kv + 4 * Q7.num_attention_heads)
    # Full: layer inputs, and the larger of the cross entropy's moment and a recomputed layer.
    assert full == Q7.num_layers * 2 * h + outside
    assert full < sel / 3
    assert TrainingMemory(precision="fp32").activation_bytes_per_token(Q7) > 1.5 * none


def test_full_recompute_peak_is_the_larger_moment():
    # A small vocabulary: the recomputed layer (plus the lasting micro-batch buffer and RoPE
    # tables)
    # outweighs the logits, so the peak is in the backward pass; its fused norm saves the
    # checkpoint's own input tensor (counted once).
    small = dataclasses.replace(Q7, vocab_size=128)
    full = TrainingMemory(precision="bf16", recompute="full")
    layer = TrainingMemory(precision="bf16").layer_activation_bytes_per_token(small)
    h = small.hidden_size
    assert full.activation_bytes_per_token(small) == \
        small.num_layers * 2 * h + layer - 2 * h + 28 + 2 * small.head_dim * 2 + 4 * small.head_dim


def test_cpu_norm_saves_fp32_copies():
    gpu = TrainingMemory(precision="bf16")
    cpu = TrainingMemory(precision="bf16", norm="composite")
    h = Q7.hidden_size
    # Per norm: the fp32 input and normalised tensor (4h + 4h) instead of the bf16 input.
    assert cpu.layer_activation_bytes_per_token(Q7) - gpu.layer_activation_bytes_per_token(Q7) \
        == 2 * (8 * h - 2 * h)
    with pytest.raises(ValueError, match="norm"):
        TrainingMemory(norm="unfused")


@pytest.mark.parametrize("model,low,high", [("qwen2.5-0.5b", 20_000, 60_000),
                                            ("qwen2.5-7b", 3_000, 20_000)])
def test_planner_at_the_papers_settings(tmp_path, model, low, high):
    js = tmp_path / "s.json"
    assert plan_main(["--profile", "lmsyschat1m", "--model", model, "--dp-size", "4",
                      "--cp-size", "8", "--hardware", "h100", "--device-memory-gb", "80",
                      "--bf16", "--use-distributed-optimizer", "--recompute-granularity",
                      "selective", "--overflow", "truncate", "--num-batches", "1",
                      "--policies", "skrull", "--backend", "python", "--json", str(js)]) == 0
    mem = json.loads(js.read_text())["memory"]
    assert low < mem["recommended_bucket"] < high
    assert mem["training"] == {"precision": "bf16", "distributed_optimizer": True,
                               "recompute": "selective", "tp_size": 1,
                               "sequence_parallel": False}


def _measure(rank, world, tmp):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_memory import run_setting

    out = run_setting([], {"precision": "fp32"})
    with open(os.path.join(tmp, "mem.json"), "w") as f:
        json.dump(out, f)


@pytest.mark.multiprocess
def test_static_bytes_match_the_launchers_real_tensors(tmp_path):
    spawn(_measure, 1, tmp_path, timeout=240)
    out = json.load(open(tmp_path / "mem.json"))
    measured, predicted = out["measured"], out["predicted"]
    total_m = sum(measured[k] for k in ("params", "grads", "main_params", "optimizer_state"))
    total_p = sum(predicted[k] for k in ("params", "grads", "main_params", "optimizer_state"))
    assert total_m == pytest.approx(total_p, rel=0.01)
    for key in ("params", "grads", "optimizer_state"):
        assert measured[key] == pytest.approx(predicted[key], rel=0.01), key
    assert measured["main_params"] == predicted["main_params"] == 0  # fp32: no copy
