"""Model FLOPs (skrull_ext.costmodel.flops) against hand counts and Megatron's formula."""
from __future__ import annotations

import pytest

from skrull_ext.costmodel.flops import (attention_flops, dense_flops_per_token, model_flops,
                                        peak_tflops, recompute_flops, throughput_tflops)
from skrull_ext.costmodel.model import MODEL_PRESETS, ModelSpec

# 2 layers, h 64, 4 heads of 16 (h_q 64), 2 KV groups (h_kv 32), SwiGLU f 128, vocab 100.
TINY = ModelSpec(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, vocab_size=100)


def test_dense_flops_per_token_by_hand():
    # Forward multiply-adds per token and layer: QKV 64 x (64 + 32 + 32) = 8192, output
    # projection 64 x 64 = 4096, SwiGLU up+gate 64 x 256 = 16384, down 128 x 64 = 8192.
    per_layer_fma = 8192 + 4096 + 16384 + 8192
    head_fma = 64 * 100
    forward = 2 * (2 * per_layer_fma + head_fma)  # 2 FLOPs per multiply-add
    assert dense_flops_per_token(TINY) == 3 * forward == 480768
    assert dense_flops_per_token(TINY) == TINY.linear_flops_per_token()  # the cost model's
    gelu = ModelSpec(num_layers=1, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
                     num_query_groups=4, vocab_size=1, swiglu=False)
    # MHA: QKV 64 x 192, output 64 x 64, MLP 2 x 64 x 256, head 64 x 1.
    assert dense_flops_per_token(gelu) == 6 * (64 * 192 + 64 * 64 + 2 * 64 * 256 + 64)


def test_causal_attention_counts_documents_not_the_packed_stream():
    # One 10-token document: QK^T and PV are 10 x 10 x 64 multiply-adds each, half of them
    # under the causal mask: 2 x 2 x 6400 / 2 = 12800 forward FLOPs per layer.
    assert attention_flops(TINY, [10]) == 3 * 12800 * 2
    # Two 5-token documents packed in the same 10-token stream: a quarter each.
    assert attention_flops(TINY, [5, 5]) == attention_flops(TINY, [10]) / 2
    assert model_flops(TINY, [5, 5]) == 10 * 480768 + attention_flops(TINY, [5, 5])


def megatron_formula(m: ModelSpec, total_tokens: float, sum_sq: float) -> float:
    """Megatron-LM's dense GQA branch of num_floating_point_operations, term by term."""
    q = m.head_dim * m.num_attention_heads
    kv = m.head_dim * m.num_query_groups
    self_attn = 3 * 2 * (m.hidden_size * (q + 2 * kv) + q * m.hidden_size)
    core = 3 * 2 * q / 2 * 2
    mlp = 3 * 2 * m.hidden_size * m.ffn_hidden_size * (3 if m.swiglu else 2)
    logit = 3 * 2 * m.hidden_size * m.vocab_size
    return total_tokens * ((mlp + self_attn) * m.num_layers + logit) \
        + sum_sq * core * m.num_layers


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_matches_megatrons_formula_on_qwen_shapes(name):
    m = MODEL_PRESETS[name]
    lengths = [31, 512, 4096, 32768]
    want = megatron_formula(m, sum(lengths), sum(s * s for s in lengths))
    assert model_flops(m, lengths) == pytest.approx(want, rel=1e-12)


def test_recompute_flops_and_throughput():
    lengths = [10, 30]
    assert recompute_flops(TINY, lengths, None) == 0
    # selective: one more core-attention forward (a third of its training FLOPs)
    assert recompute_flops(TINY, lengths, "selective") == attention_flops(TINY, lengths) / 3
    # full: one more forward of the layers (not the LM head)
    layers_fwd = 2 * (8192 + 4096 + 16384 + 8192) * 2 * 40
    assert recompute_flops(TINY, lengths, "full") == pytest.approx(
        layers_fwd + attention_flops(TINY, lengths) / 3)
    with pytest.raises(ValueError, match="selective, full"):
        recompute_flops(TINY, lengths, "block")
    assert throughput_tflops(4e12, 2.0, world_size=2) == 1.0
    assert throughput_tflops(1.0, 0.0) == 0.0


def test_peak_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H200") == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H100 NVL") == 835.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("cpu") is None
