"""Kernel back-ends, the log-sum-exp merge identity, and single-process dacp_attention."""
import math

import pytest
import torch

from skrull_ext.attention import ReferenceKernel, dacp_attention, get_kernel
from skrull_ext.attention import aten, choice
from skrull_ext.attention.kernels import CpuFlashKernel
from skrull_ext.attention.ring import _merge
from skrull_ext.attention.layout import build_rank_layout

from _attn_worker import reference_attention

CPU = torch.device("cpu")


def rand(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def dense(q, k, v, causal, scale):
    """Explicit attention of one segment with autograd, returning (out, lse)."""
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[1], s.shape[2], dtype=torch.bool).triu(1), -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.repeat_interleave(group, 1)), torch.logsumexp(s, -1)


@pytest.mark.parametrize("kernel", [ReferenceKernel(), CpuFlashKernel()], ids=lambda k: k.name)
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_matches_autograd_varlen_gqa(kernel, causal):
    cu_q = (0, 5, 6, 13)
    cu_k = cu_q if causal else (0, 3, 9, 11)
    q = rand(13, 4, 8, seed=1).requires_grad_()
    k = rand(cu_k[-1], 2, 8, seed=2).requires_grad_()
    v = rand(cu_k[-1], 2, 8, seed=3).requires_grad_()
    dout = rand(13, 4, 8, seed=4)
    out, lse = kernel.forward(q.detach(), k.detach(), v.detach(), cu_q, cu_k, causal=causal, scale=0.4)
    outs, lses = zip(*(dense(q[a:b], k[c:d], v[c:d], causal, 0.4)
                       for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])))
    want = torch.cat(outs)
    torch.testing.assert_close(out, want.detach())
    torch.testing.assert_close(lse, torch.cat(lses, dim=1).detach())
    grads = kernel.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k,
                            causal=causal, scale=0.4)
    for got, ref in zip(grads, torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(got, ref)


def test_cpu_flash_float32_and_bf16_close_to_reference():
    cu = (0, 40, 47)
    q, k, v = rand(47, 4, 16, seed=5), rand(47, 1, 16, seed=6), rand(47, 1, 16, seed=7)
    ref_out, ref_lse = ReferenceKernel().forward(q, k, v, cu, cu, causal=True, scale=0.25)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        out, lse = CpuFlashKernel().forward(q.to(dtype), k.to(dtype), v.to(dtype), cu, cu,
                                            causal=True, scale=0.25)
        assert out.dtype == dtype and lse.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("kernel", [ReferenceKernel(), CpuFlashKernel()], ids=lambda k: k.name)
def test_split_keys_merge_and_backward_with_final_lse(kernel):
    """Attention over keys [A | B] == lse-merge of the blocks; block backwards with the
    *merged* out/lse sum to the full gradients (what the ring relies on)."""
    n, m = 9, 14
    q, k, v, dout = rand(n, 2, 8, seed=8), rand(m, 2, 8, seed=9), rand(m, 2, 8, seed=10), rand(n, 2, 8, seed=11)
    full_o, full_l = kernel.forward(q, k, v, (0, n), (0, m), causal=False, scale=0.3)
    acc_o, acc_l = kernel.forward(q, k[:6], v[:6], (0, n), (0, 6), causal=False, scale=0.3)
    acc_o, acc_l = acc_o.clone(), acc_l.clone()
    rows = torch.tensor([1, 4, 8])  # a row subset takes the second block, like the ring's
    ob, lb = kernel.forward(q[rows], k[6:], v[6:], (0, 3), (0, m - 6), causal=False, scale=0.3)
    _merge(acc_o, acc_l, ob, lb, rows)
    others = torch.tensor([i for i in range(n) if i not in rows.tolist()])
    ob2, lb2 = kernel.forward(q[others], k[6:], v[6:], (0, n - 3), (0, m - 6), causal=False, scale=0.3)
    _merge(acc_o, acc_l, ob2, lb2, others)
    torch.testing.assert_close(acc_o, full_o)
    torch.testing.assert_close(acc_l, full_l)
    dq_full, dk_full, dv_full = kernel.backward(dout, q, k, v, full_o, full_l, (0, n), (0, m),
                                                causal=False, scale=0.3)
    dq1, dk1, dv1 = kernel.backward(dout, q, k[:6], v[:6], acc_o, acc_l, (0, n), (0, 6),
                                    causal=False, scale=0.3)
    dq2, dk2, dv2 = kernel.backward(dout, q, k[6:], v[6:], acc_o, acc_l, (0, n), (0, m - 6),
                                    causal=False, scale=0.3)
    torch.testing.assert_close(dq1 + dq2, dq_full)
    torch.testing.assert_close(torch.cat([dk1, dk2]), dk_full)
    torch.testing.assert_close(torch.cat([dv1, dv2]), dv_full)


@pytest.mark.parametrize("kernel", [ReferenceKernel(), CpuFlashKernel()], ids=lambda k: k.name)
def test_empty_segments(kernel):
    q, k, v = rand(3, 2, 4), rand(2, 2, 4), rand(2, 2, 4)
    out, lse = kernel.forward(q, k, v, (0, 0, 3, 3), (0, 1, 1, 2), causal=False, scale=0.5)
    assert out.shape == (3, 2, 4) and torch.isneginf(lse).all() and (out == 0).all()
    e = torch.zeros(0, 2, 4, dtype=torch.float64)
    out, lse = kernel.forward(e, e, e, (0,), (0,), causal=True, scale=0.5)
    assert out.shape == (0, 2, 4) and lse.shape == (2, 0)


def test_get_kernel_selection_and_errors(monkeypatch):
    monkeypatch.delenv(choice.ENV_VAR, raising=False)
    assert get_kernel("auto", CPU, torch.float32).name == "torch"
    assert get_kernel(None, CPU, torch.float64).name == "torch"
    assert get_kernel("cpu_flash", CPU, torch.float64).name == "torch"  # earlier name
    assert get_kernel("reference", CPU, torch.float32).name == "reference"
    inst = ReferenceKernel()
    assert get_kernel(inst, CPU, torch.float32) is inst
    with pytest.raises(ValueError, match="unknown attention kernel 'fast'"):
        get_kernel("fast", CPU, torch.float32)
    monkeypatch.setattr(choice, "_CACHE", {})
    monkeypatch.setattr(aten, "flash_op_problem", lambda device: "no FlashAttention here")
    with pytest.raises(RuntimeError, match="torch kernel cannot run here: no FlashAttention"):
        get_kernel("torch", torch.device("cuda"), torch.float16)
    monkeypatch.setenv(choice.ENV_VAR, "reference")
    assert get_kernel(None, CPU, torch.float32).name == "reference"
    assert get_kernel("torch", CPU, torch.float32).name == "torch"  # backend= wins
    monkeypatch.setenv(choice.ENV_VAR, "fastest")
    with pytest.raises(ValueError, match="SKRULL_ATTENTION_KERNEL"):
        get_kernel(None, CPU, torch.float32)


def test_auto_on_cuda_never_falls_back_to_reference(monkeypatch):
    """Without TE or flash-attn, auto on CUDA is an error naming what to install; the
    float64 reference kernel runs on CUDA only when asked for."""
    monkeypatch.setattr(choice, "te_available", lambda: False)
    monkeypatch.setattr(choice, "flash_attn_available", lambda: False)
    monkeypatch.setattr(aten, "flash_op_problem", lambda device: "needs an Ampere GPU")
    monkeypatch.setattr(choice, "_CACHE", {})
    with pytest.raises(RuntimeError, match=r"needs an Ampere GPU; install Transformer Engine "
                                           r"or flash-attn.*"
                                           r"skrull-megatron\[gpu\].*reference"):
        get_kernel("auto", torch.device("cuda"), torch.bfloat16)
    assert get_kernel("reference", torch.device("cuda"), torch.bfloat16).name == "reference"
    for name, module in (("flash", "flash_attn"), ("te", "transformer_engine")):
        monkeypatch.setattr(choice, "_CACHE", {})
        monkeypatch.setitem(__import__("sys").modules, module, None)  # import fails
        with pytest.raises(RuntimeError, match="pip install"):
            get_kernel(name, torch.device("cuda"), torch.bfloat16)


def _single_rank_case(backend, dtype):
    lengths = [7, 1, 12, 4]
    lay = build_rank_layout(lengths, [2, 0], [[3, 1]], 0, 1)  # N == 1: distributed held whole
    qs = [rand(n, 4, 8, seed=20 + i) for i, n in enumerate(lengths)]
    ks = [rand(n, 2, 8, seed=30 + i) for i, n in enumerate(lengths)]
    vs = [rand(n, 2, 8, seed=40 + i) for i, n in enumerate(lengths)]
    out = dacp_attention(*(lay.pack(t).to(dtype) for t in (qs, ks, vs)), lay, None, backend=backend)
    ref = lay.pack([reference_attention(q, k, v, 1 / math.sqrt(8)) for q, k, v in zip(qs, ks, vs)])
    return out, ref


@pytest.mark.parametrize("backend, dtype, tol", [
    ("reference", torch.float64, 1e-12), ("torch", torch.float64, 1e-12),
    ("auto", torch.float32, 1e-5)])
def test_dacp_attention_without_group(backend, dtype, tol):
    out, ref = _single_rank_case(backend, dtype)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_dacp_attention_gradcheck_single_rank():
    lay = build_rank_layout([3, 4], [1], [[0]], 0, 1)
    q = rand(7, 2, 3, seed=1).requires_grad_()
    k = rand(7, 1, 3, seed=2).requires_grad_()
    v = rand(7, 1, 3, seed=3).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c: dacp_attention(a, b, c, lay, None, backend="reference"),
                                    (q, k, v))


def test_dacp_attention_bad_input():
    lay = build_rank_layout([3, 4], [1], [[0], []], 0, 2)
    q, kv = torch.zeros(lay.num_tokens, 2, 4), torch.zeros(lay.num_tokens, 1, 4)
    with pytest.raises(ValueError, match="cp_size 2"):
        dacp_attention(q, kv, kv, lay, None)
    single = build_rank_layout([3, 4], [1], [[0]], 0, 1)
    with pytest.raises(ValueError, match="layout holds"):
        dacp_attention(q[:3], kv[:3], kv[:3], single, None)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        dacp_attention(torch.zeros(7, 3, 4), torch.zeros(7, 2, 4), torch.zeros(7, 2, 4), single, None)
