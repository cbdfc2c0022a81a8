"""The fits of benchmarks/calibrate_gpu.py and its kernel runs, on synthetic times (CPU)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import calibrate_gpu  # noqa: E402
import gpu_common  # noqa: E402
import gpu_micro  # noqa: E402

from skrull_ext.costmodel.model import CostModel, ModelSpec, TimeModel  # noqa: E402
from skrull_ext.scheduler import predict  # noqa: E402
from skrull_ext.sharding import shard_tokens  # noqa: E402

SPEC = ModelSpec(num_layers=3, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, vocab_size=256)


def test_attention_fit_recovers_the_shard_time_model():
    """Times made by TimeModel.shard_time's per-layer formula fit back exactly."""
    c, half, call = 2e-12, 300.0, 15e-6
    cases = gpu_micro.attention_cases([64, 256, 1024, 4096], [2, 4, 8], pack_tokens=4096)
    assert {(k["cp"], k["rank"]) for k in cases if k["cp"] == 8} == {(8, 0), (8, 7)}
    assert min(k["length"] for k in cases if k["cp"] > 1) == 256  # shortest: whole only
    times = []
    for k in cases:
        n, s = k["cp"], k["length"]
        block = s if n == 1 else shard_tokens(s, n)
        per_doc = c * SPEC.attention_flops_coef() * s * s / n * (1 + half / block) + call * n
        times.append(k["docs"] * per_doc * (1.0 if k["rank"] == 0 else 0.9))  # slower kept
    fit = gpu_micro.fit_attention(SPEC, cases, times)
    assert fit["c_attention"] == pytest.approx(c, rel=1e-6)
    assert fit["attention_half_tokens"] == pytest.approx(half, rel=1e-6)
    assert fit["attention_call_overhead"] == pytest.approx(call, rel=1e-6)
    # The fitted model predicts a sharded sequence exactly as the cost model's shard_time.
    tm = TimeModel(c_linear=0.0, c_attention=fit["c_attention"],
                   attention_half_tokens=fit["attention_half_tokens"],
                   attention_call_overhead=fit["attention_call_overhead"])
    row = next(r for r in fit["rows"] if r["cp"] == 4 and r["length"] == 4096)
    assert row["seconds_per_document"] * SPEC.num_layers == pytest.approx(
        float(tm.shard_time(SPEC, [4096], 4)[0]), rel=1e-6)


def test_dense_fit_gives_c_linear():
    tokens = [512, 2048, 8192]
    layer = [1e-4 + 3e-8 * t for t in tokens]
    head = [5e-5 + 2e-8 * t for t in tokens]
    fit = gpu_micro.fit_dense(SPEC, tokens, layer, head)
    assert fit["model_seconds_per_token"] == pytest.approx(3 * 3e-8 + 2e-8)
    assert fit["c_linear"] == pytest.approx((3 * 3e-8 + 2e-8) / SPEC.linear_flops_per_token())


def _plan(lengths, bucket=300):
    return gpu_common.plan_for(np.array(lengths), CostModel(
        model=SPEC, time=TimeModel(c_linear=1e-12, c_attention=1e-12)), bucket)


def test_regressors_add_up_to_the_schedulers_prediction():
    plan = _plan([200, 90, 40, 250, 17, 3])
    assert plan.num_micro_batches >= 3
    tm = TimeModel(c_linear=3e-12, c_attention=5e-12, attention_half_tokens=120.0,
                   attention_call_overhead=7e-6, micro_batch_overhead=2e-3,
                   iteration_overhead=0.05)
    x = calibrate_gpu.regressors(plan, SPEC, tm.attention_half_tokens)
    w = [tm.c_linear, tm.c_attention, tm.attention_call_overhead, tm.micro_batch_overhead,
         tm.iteration_overhead]
    assert x @ w == pytest.approx(predict(plan, CostModel(model=SPEC, time=tm))
                                  ["iteration_time"], rel=1e-12)


def test_term_fit_recovers_separable_terms_and_holds_inseparable_ones_at_the_kernels():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 2.0, size=(9, 5))
    w = np.array([3.0, 1.0, 0.5, 0.2, 0.1])
    y = x @ w
    # Priors off by 2x: nine well-spread iterations still decide every term.
    assert calibrate_gpu.fit_terms(x, y, list(2 * w[:4]) + [0.0]) == pytest.approx(w, rel=0.02)
    # Two terms the iterations cannot tell apart (identical columns): their sum is fitted,
    # the split follows the kernels' priors instead of an arbitrary corner.
    x[:, 3] = x[:, 2]
    fit = calibrate_gpu.fit_terms(x, x @ w, [3.0, 1.0, 0.3, 0.4, 0.0])
    assert fit[2] + fit[3] == pytest.approx(0.7, rel=0.02)
    assert fit[2] == pytest.approx(0.3, rel=0.05) and fit[3] == pytest.approx(0.4, rel=0.05)
    assert calibrate_gpu.fit_terms(x, x @ w, [3.0, 1.0, 0.6, 0.1, 0.0])[2] > 0.55


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_kernel_runs_execute_the_rings_blocks_and_the_sdpa_fallback(cp):
    from skrull_ext.attention import get_kernel

    kernel = get_kernel("torch", torch.device("cpu"), torch.float32)
    for rank in {0, cp - 1}:
        gpu_micro.kernel_run(kernel, SPEC, 64, 3, cp, rank, "cpu", torch.float32)()
        gpu_micro.sdpa_run(SPEC, 64, 3, cp, rank, "cpu", torch.float32)()
    assert gpu_micro.resolve_kernel("sdpa", torch.device("cpu"), torch.float32)[0] is None
    assert gpu_micro.resolve_kernel("auto", torch.device("cpu"), torch.float32)[1] == "torch"


def test_fill_takes_documents_while_they_fit():
    lengths = np.array([50, 40, 30, 20, 10, 120])
    order = np.argsort(-lengths)
    assert gpu_common.fill(lengths, order, 100, 100).tolist() == [0, 1, 4]  # 50+40+10
    assert gpu_common.fill(lengths, order, 10, 100).tolist() == [4]
