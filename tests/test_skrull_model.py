"""The Skrull GPT model (mcore GPTModel + SkrullCoreAttention) on CPU vs stock Megatron-Core GPTModel and hand-computed losses.

One spawned single-rank gloo process computes everything; the tests assert on its output.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from mcore_helpers import spawn, tiny_config

pytestmark = pytest.mark.multiprocess

LENGTHS = (7, 12, 5)


def _reference_model(cfg, skrull_model, vocab):
    """Stock mcore GPTModel (DotProductAttention, causal mask, mcore RoPE), same weights."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.skrull.model import transformer_config

    config = transformer_config(cfg.model, tp_size=1, cp_size=1, dtype=torch.float64,
                                use_cpu_initialization=True)
    ref = GPTModel(config, get_gpt_layer_local_spec(normalization=cfg.model.normalization),
                   vocab_size=vocab, max_sequence_length=cfg.model.max_position_embeddings,
                   position_embedding_type="rope", share_embeddings_and_output_weights=True)
    ref.load_state_dict(skrull_model.state_dict())
    return ref.double()


def _worker(rank, world, tmp):
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.skrull.cpu_compat import apply_cpu_compat
    from megatron.skrull.model import SkrullPackedSeqParams, build_model, rotary_table
    from megatron.skrull.pretrain_gpt import init_model_parallel
    from skrull_ext.attention import dacp_attention as dacp
    from skrull_ext.attention.layout import build_rank_layout as build_layout

    apply_cpu_compat("cpu")
    cfg = tiny_config(["--fp64"])
    init_model_parallel(cfg, torch.device("cpu"))
    seen = []

    def recording_attention(q, k, v, layout, cp_group, **kw):
        seen.append((tuple(q.shape), tuple(k.shape), tuple(v.shape), layout, cp_group, kw))
        return dacp(q, k, v, layout, cp_group, **kw)

    vocab = 128
    model = build_model(cfg.model, vocab_size=vocab, dtype=torch.float64,
                        attention_fn=recording_attention)
    gen = torch.Generator().manual_seed(0)
    toks = {i: torch.randint(0, vocab, (n,), generator=gen) for i, n in enumerate(LENGTHS)}
    layout = build_layout(LENGTHS, [], [[0, 1, 2]], 0, 1)
    ids, pos = layout.pack(toks)[None], layout.position_ids[None]
    params = SkrullPackedSeqParams(layout=layout, cp_group=None)
    labels = torch.roll(ids, -1, dims=1)
    # RoPE's CP slicing must never run: make it fail loudly if it does.
    def boom(*a, **k):
        raise AssertionError("RotaryEmbedding.forward/CP slicing was called")
    orig_fwd = rotary_pos_embedding.RotaryEmbedding.forward
    rotary_pos_embedding.RotaryEmbedding.forward = boom
    try:
        logits = model(ids, pos, None, packed_seq_params=params)
        losses = model(ids, pos, None, labels=labels, packed_seq_params=params)
    finally:
        rotary_pos_embedding.RotaryEmbedding.forward = orig_fwd
    ref = _reference_model(cfg, model, vocab)
    ref_logits = torch.cat([ref(toks[i][None], torch.arange(n)[None], None)
                            for i, n in enumerate(LENGTHS)], dim=1)
    positions = torch.tensor([3, 0, 17, 5, 5, 90])
    rope = model.decoder.layers[0].self_attention.core_attention.rope
    mcore_rope = rotary_pos_embedding.RotaryEmbedding(16, 1.0, rotary_base=cfg.model.rotary_base,
                                                      use_cpu_initialization=True)
    small = build_model(cfg.model, vocab_size=vocab, dtype=torch.float64)
    torch.save({
        "logits": logits.detach(), "ref_logits": ref_logits.detach(), "losses": losses.detach(),
        "labels": labels, "shapes": [s[:3] for s in seen], "kw": [s[5] for s in seen],
        "layout_ok": all(s[3] is layout for s in seen), "num_calls": len(seen),
        "table": rotary_table(rope, positions), "get_emb": mcore_rope.get_emb(91),
        "positions": positions, "param_dtypes": {p.dtype for p in small.parameters()},
    }, os.path.join(tmp, "out.pt"))


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("model")
    spawn(_worker, 1, tmp)
    return torch.load(os.path.join(tmp, "out.pt"), weights_only=False)


def test_packed_forward_matches_stock_mcore_per_sample(out):
    # Packing 3 samples with restarting positions == running each through stock mcore.
    assert out["logits"].shape == (1, sum(LENGTHS), 128)
    torch.testing.assert_close(out["logits"], out["ref_logits"], rtol=1e-12, atol=1e-12)


def test_loss_is_hand_computed_cross_entropy(out):
    losses, logits, labels = out["losses"], out["logits"], out["labels"]
    assert losses.shape == (1, sum(LENGTHS))
    by_hand = -torch.log_softmax(logits[0], dim=-1).gather(1, labels[0][:, None])[:, 0]
    # mcore's cross entropy runs in float32.
    torch.testing.assert_close(losses[0].double(), by_hand, rtol=1e-5, atol=1e-5)
    # Near-uniform logits at init: mean loss close to ln(vocab).
    assert abs(float(by_hand.mean()) - math.log(128)) < 0.1


def test_core_attention_gets_tokens_heads_dims_and_the_layout(out):
    t = sum(LENGTHS)
    assert out["num_calls"] == 2 * 2  # 2 layers x 2 forwards
    assert set(out["shapes"]) == {((t, 4, 16), (t, 2, 16), (t, 2, 16))}
    assert out["layout_ok"]
    assert all(abs(kw["softmax_scale"] - 0.25) < 1e-12 for kw in out["kw"])


def test_rotary_table_uses_given_positions(out):
    torch.testing.assert_close(out["table"], out["get_emb"][out["positions"]], rtol=0, atol=0)


def test_fp64_parameters(out):
    assert out["param_dtypes"] == {torch.float64}


def test_packed_seq_params_are_thd_with_the_stream_documents():
    from megatron.skrull.model import SkrullPackedSeqParams
    from skrull_ext.attention.layout import build_rank_layout

    # CP rank 0 of 2: local sample 0 whole, then its zigzag shard of distributed sample 1.
    layout = build_rank_layout((7, 12, 5), [1], [[0], [2]], 0, 2)
    params = SkrullPackedSeqParams(layout=layout)
    assert params.qkv_format == "thd"
    shard = layout.distributed[0].shard_length
    assert params.cu_seqlens_q.tolist() == [0, 7, 7 + shard]
    assert params.cu_seqlens_kv is params.cu_seqlens_q
    assert params.max_seqlen_q == max(7, shard)
    with pytest.raises(ValueError, match="thd"):
        SkrullPackedSeqParams(layout=layout, qkv_format="sbhd")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_is_mcores_unfused_rope_bit_for_bit(dtype, interleaved):
    """SkrullCoreAttention computes cos/sin once per micro-batch and applies them with
    apply_rope: the same bits as mcore's apply_rotary_pos_emb (unfused bshd), forward and
    backward, with a partial rotary dim and YaRN's attention factor."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.skrull.model import apply_rope

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               rotary_interleaved=interleaved, use_cpu_initialization=True)
    assert not config.apply_rope_fusion and not config.multi_latent_attention
    gen = torch.Generator().manual_seed(1)
    for rot, mscale in ((16, 1.0), (8, 1.1386)):
        freqs = torch.rand(9, 1, 1, rot, generator=gen) * 40
        x = torch.randn(9, 1, 4, 16, generator=gen).to(dtype)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        cos = (torch.cos(freqs) * mscale).to(dtype)
        sin = (torch.sin(freqs) * mscale).to(dtype)
        ours = apply_rope(a, cos, sin, interleaved)
        theirs = rope_utils.apply_rotary_pos_emb(b, freqs, config, mscale=mscale,
                                                 cp_group=object())
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (rot, mscale)
        g = torch.randn(theirs.shape, generator=gen).to(dtype)
        ours.backward(g)
        theirs.backward(g)
        assert torch.equal(a.grad, b.grad), (rot, mscale)
