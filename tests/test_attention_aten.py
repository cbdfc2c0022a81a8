"""The ``torch`` kernel on CUDA (PyTorch's FlashAttention-2 varlen ops), driven through fakes
of the ATen ops (tests/fakes/aten.py) in float64 on CPU, and the kernel choice on CUDA
without Transformer Engine or flash-attn."""
import logging

import pytest
import torch

from fakes import aten as fake_aten
from skrull_ext.attention import ReferenceKernel, choice, get_kernel
from skrull_ext.attention import aten
from skrull_ext.attention.kernels import segments

from _attn_worker import single_rank_parity

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
                       ).to(dtype)


def make(variant="2.13"):
    ops = fake_aten.ops(variant)
    return aten.TorchVarlenKernel(ops=ops), ops


@pytest.mark.parametrize("variant", fake_aten.FLASH_VARIANTS)
@pytest.mark.parametrize("causal", [True, False])
def test_matches_reference_gqa_with_lse_as_h_by_t(variant, causal):
    kernel, ops = make(variant)
    cu_q = (0, 5, 6, 13)
    cu_k = cu_q if causal else (0, 3, 9, 11)
    q, k, v = rand(13, 4, 8, seed=1), rand(cu_k[-1], 2, 8, seed=2), rand(cu_k[-1], 2, 8, seed=3)
    dout = rand(13, 4, 8, seed=4)
    seg_q, seg_k = segments(cu_q, CPU), segments(cu_k, CPU)
    out, lse = kernel.forward(q, k, v, seg_q, seg_k, causal=causal, scale=0.4)
    ref = ReferenceKernel()
    want_out, want_lse = ref.forward(q, k, v, cu_q, cu_k, causal=causal, scale=0.4)
    assert lse.shape == (4, 13) and lse.dtype == torch.float64
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    got = kernel.backward(dout, q, k, v, out, lse, seg_q, seg_k, causal=causal, scale=0.4)
    want = ref.backward(dout, q, k, v, want_out, want_lse, cu_q, cu_k, causal=causal, scale=0.4)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    call = ops._flash_attention_forward.calls[-1]
    assert call["scale"] == 0.4 and call["is_causal"] is causal and call["dropout_p"] == 0.0
    assert call["cum_seq_q"] is seg_q.cu_dev and call["max_q"] == 7  # no copy per call


def test_bf16_gives_float32_lse_and_merged_backward():
    """bf16 in, float32 [H, T] LSE out; the backward takes a merged (global) out/lse."""
    kernel, _ = make()
    cu = (0, 6, 16)
    q, k, v, dout = (rand(16, h, 8, seed=s, dtype=torch.bfloat16)
                     for h, s in ((4, 1), (2, 2), (2, 3), (4, 4)))
    out, lse = kernel.forward(q, k, v, cu, cu, causal=True, scale=0.35)
    assert lse.dtype == torch.float32 and lse.shape == (4, 16) and out.dtype == torch.bfloat16
    ref_out, ref_lse = ReferenceKernel().forward(q, k, v, cu, cu, causal=True, scale=0.35)
    torch.testing.assert_close(out.double(), ref_out.double(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=1e-3, rtol=1e-3)
    # A shifted global lse (as after a ring merge) scales the probabilities the same way
    # for the adapter and the reference.
    merged = (lse + 0.25).float()
    got = kernel.backward(dout, q, k, v, out, merged, cu, cu, causal=True, scale=0.35)
    want = ReferenceKernel().backward(dout, q, k, v, out, merged, cu, cu, causal=True, scale=0.35)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.double(), w.double(), atol=3e-2, rtol=3e-2)


def test_flash_backward_gets_the_random_state_by_its_name():
    for variant, names in (("2.13", ("rng_state", "unused")), ("philox", ("philox_seed",
                                                                         "philox_offset"))):
        kernel, ops = make(variant)
        q = rand(4, 2, 8)
        out, lse = kernel.forward(q, q, q, (0, 4), (0, 4), causal=True, scale=0.5)
        kernel.backward(q, q, q, q, out, lse, (0, 4), (0, 4), causal=True, scale=0.5)
        call = ops._flash_attention_backward.calls[-1]
        assert call[names[0]].dtype == torch.uint64 and call[names[1]].numel() == 0


def test_single_query_segments_with_gqa_and_empty_rows():
    """max_q == 1 with GQA and an empty query segment: the op's regrouping would fail, so
    the adapter expands K/V heads; a segment with queries but no keys gives -inf, not the
    +inf FlashAttention writes."""
    kernel, _ = make()
    cu_q, cu_k = (0, 1, 1, 2), (0, 3, 5, 7)
    q, k, v, dout = rand(2, 4, 8, seed=1), rand(7, 2, 8, seed=2), rand(7, 2, 8, seed=3), rand(
        2, 4, 8, seed=4)
    with pytest.raises(RuntimeError, match="is invalid for input of size"):  # the fake's quirk
        fake_aten.ops()._flash_attention_forward(
            q, k, v, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
            1, 3, 0.0, False, False)
    ref = ReferenceKernel()
    out, lse = kernel.forward(q, k, v, cu_q, cu_k, causal=False, scale=0.3)
    want_out, want_lse = ref.forward(q, k, v, cu_q, cu_k, causal=False, scale=0.3)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    for g, w in zip(kernel.backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=False, scale=0.3),
                    ref.backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=False, scale=0.3)):
        torch.testing.assert_close(g, w)
    out, lse = kernel.forward(q, k[:3], v[:3], (0, 1, 2), (0, 3, 3), causal=False, scale=0.3)
    assert torch.isneginf(lse[:, 1]).all() and (out[1] == 0).all()


def test_unknown_required_argument_and_missing_ops_are_clear_errors():
    ops = fake_aten.ops()
    ops._flash_attention_forward = fake_aten.FakeOp(
        "aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, "
        "Tensor? cum_seq_q, Tensor? cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, "
        "bool is_causal, bool return_debug_mask, Tensor new_thing, *, float? scale=None) "
        "-> (Tensor output, Tensor softmax_logsumexp)", None)
    with pytest.raises(RuntimeError, match=r"_flash_attention_forward requires \['new_thing'\]"):
        aten.TorchVarlenKernel(ops=ops)
    ops._flash_attention_forward = fake_aten.FakeOp(
        "aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, "
        "Tensor? cum_seq_q, Tensor? cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, "
        "bool is_causal, bool return_debug_mask) -> (Tensor output, Tensor softmax_logsumexp)",
        None)
    with pytest.raises(RuntimeError, match="_flash_attention_forward takes no scale"):
        aten.TorchVarlenKernel(ops=ops)
    del ops._flash_attention_forward
    with pytest.raises(RuntimeError, match="has no aten._flash_attention_forward"):
        aten.TorchVarlenKernel(ops=ops)


def test_the_installed_torch_schemas_are_fillable():
    """Drift check: this torch's own schemas (present in CPU builds too) bind."""
    kernel = aten.TorchVarlenKernel()
    assert "scale" in kernel._fwd.names and "logsumexp" in kernel._bwd.names
    assert aten.flash_op_problem(CPU).startswith("PyTorch's FlashAttention-2 varlen op runs on")


def test_auto_on_cuda_takes_torch_after_te_and_flash_and_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(choice, "_CACHE", {})
    monkeypatch.setattr(choice, "_LOGGED", set())
    monkeypatch.setattr(choice, "te_available", lambda: False)
    monkeypatch.setattr(choice, "flash_attn_available", lambda: False)
    monkeypatch.setattr(aten, "flash_op_problem", lambda device: None)
    caplog.set_level(logging.INFO, logger="skrull_ext.attention")
    kernel = get_kernel("auto", CUDA, torch.bfloat16)
    assert isinstance(kernel, aten.TorchVarlenKernel) and kernel.name == "torch"
    assert get_kernel("torch", CUDA, torch.bfloat16) is kernel
    assert get_kernel("torch", CPU, torch.float32).name == "torch" and not isinstance(
        get_kernel("torch", CPU, torch.float32), aten.TorchVarlenKernel)
    assert [r.getMessage() for r in caplog.records] == ["attention kernel auto -> torch on cuda"]
    assert choice.runs_subgroups("te", CUDA) and choice.runs_subgroups("auto", CUDA)
    monkeypatch.setattr(choice, "te_available", lambda: True)
    assert choice.runs_subgroups("auto", CUDA)  # TE's sub-group rings borrow the torch op
    monkeypatch.setattr(aten, "flash_op_problem", lambda device: "sm70")
    assert not choice.runs_subgroups("te", CUDA)


def test_dacp_attention_single_rank_through_the_fake_ops():
    single_rank_parity(make()[0])
