"""Cost and memory models: FLOP terms, calibration, comm interpolation, bucket sizing."""
import numpy as np
import pytest

from skrull_ext.costmodel.model import (
    H100_NVLINK_COMM, MODEL_PRESETS, CommModel, CostModel, MemoryModel, ModelSpec, TimeModel,
    default_cost_model, get_model_spec, paper_flops)


def test_paper_proxy_matches_formula():
    h, hkv = 896, 128
    s = np.array([1, 1000, 26000])
    expected = (20 * h * h + 4 * h * hkv) * s + 4 * h * s.astype(float) ** 2
    np.testing.assert_allclose(paper_flops(s, h, hkv), expected)


def test_presets_shapes():
    small = MODEL_PRESETS["qwen2.5-0.5b"]
    assert small.kv_hidden_size == 128 and small.head_dim == 64
    big = get_model_spec("qwen2.5-7b")
    assert big.kv_hidden_size == 512
    with pytest.raises(ValueError, match="unknown model"):
        get_model_spec("llama")


def test_model_spec_validation():
    with pytest.raises(ValueError, match="divisible"):
        ModelSpec(num_layers=1, hidden_size=10, ffn_hidden_size=4, num_attention_heads=3,
                  num_query_groups=1, vocab_size=8)
    with pytest.raises(ValueError, match=">= 1"):
        ModelSpec(num_layers=0, hidden_size=8, ffn_hidden_size=4, num_attention_heads=2,
                  num_query_groups=1, vocab_size=8)


def test_attention_term_is_quadratic_linear_term_linear():
    spec = MODEL_PRESETS["qwen2.5-0.5b"]
    lin = spec.linear_flops([1000, 2000])
    att = spec.attention_flops([1000, 2000])
    assert lin[1] == pytest.approx(2 * lin[0])
    assert att[1] == pytest.approx(4 * att[0])


def test_calibrate_recovers_coefficients():
    spec = MODEL_PRESETS["qwen2.5-0.5b"]
    truth = TimeModel(c_linear=2e-15, c_attention=5e-15, micro_batch_overhead=1e-3)
    lengths = [128, 512, 2048, [100, 300], 8192, 16000]
    times = []
    for item in lengths:
        seqs = np.atleast_1d(item)
        times.append(truth.sequence_time(spec, seqs).sum() + truth.micro_batch_overhead)
    fit = TimeModel.calibrate(spec, lengths, times)
    assert fit.c_linear == pytest.approx(truth.c_linear, rel=1e-6)
    assert fit.c_attention == pytest.approx(truth.c_attention, rel=1e-6)
    assert fit.micro_batch_overhead == pytest.approx(truth.micro_batch_overhead, rel=1e-6)


def test_calibrate_clamps_negative_to_zero():
    spec = MODEL_PRESETS["qwen2.5-0.5b"]
    # Pure linear data with a negative intercept: the constant must clamp to 0.
    lengths = [100, 200, 400, 800]
    times = [spec.linear_flops([s])[0] * 1e-15 - 1e-4 for s in lengths]
    fit = TimeModel.calibrate(spec, lengths, times)
    assert fit.micro_batch_overhead == 0.0 and fit.c_linear > 0


def test_comm_model_piecewise():
    mb = 1024.0 * 1024.0
    c = H100_NVLINK_COMM
    assert c.time(1.0) == pytest.approx(53e-6)  # flat below the first point
    assert c.time(8 * mb) == pytest.approx(98e-6)
    assert c.time(0) == 0.0
    assert 98e-6 < c.time(16 * mb) < 286e-6
    assert c.time(2048 * mb) > c.time(1024 * mb)  # extrapolated
    lat, per_byte = c.linear_fit()
    assert 0 < lat < 53e-6 and per_byte > 0
    with pytest.raises(ValueError):
        CommModel(sizes_bytes=(2.0, 1.0), seconds=(1.0, 2.0))


def test_comm_seconds_grow_with_length_and_vanish_without_cp():
    cost = default_cost_model("qwen2.5-0.5b")
    t = cost.comm_seconds([1000, 8000, 64000], 8)
    assert t[0] < t[1] < t[2]
    assert np.all(cost.comm_seconds([1000, 8000], 1) == 0)
    assert cost.comm_latency(1) == 0 and cost.comm_latency(8) > 0
    assert isinstance(cost, CostModel)


def test_memory_model_bucket_and_fit():
    m = MemoryModel.fit([1000, 2000, 4000], [1e9 + 1000 * 5e4, 1e9 + 2000 * 5e4, 1e9 + 4000 * 5e4])
    assert m.alpha == pytest.approx(5e4) and m.beta == pytest.approx(1e9, rel=1e-6)
    c = m.bucket_size(device_bytes=80e9, static_bytes=20e9, margin_bytes=4e9)
    assert c == int((80e9 - 20e9 - 4e9 - m.beta) // m.alpha)
    with pytest.raises(ValueError, match="no room"):
        m.bucket_size(device_bytes=10e9, static_bytes=20e9)
