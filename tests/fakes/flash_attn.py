"""Fake ``flash_attn`` packages with the varlen interface of 2.5.9, 2.6.x, 2.7.0 and 2.7.3+/2.8.x.

What is faithful (read from ``flash_attn/flash_attn_interface.py`` of each release):

* 2.6: plain functions; ``window_size=(l, r)``; the forward returns 8 values
  ``(out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)``; the backward writes
  into ``dq``/``dk``/``dv`` and returns ``(dq, dk, dv, softmax_d)``.
* 2.7.0+: the private functions are ``custom_op``-like objects whose ``__call__`` takes
  ``(*args, **kwargs)`` and whose real function is ``_init_fn``; ``window_size_left`` /
  ``window_size_right``; 2.7.3+ adds ``zero_tensors``.  The forward returns 4 values, the
  backward mutates ``dq``/``dk``/``dv`` and returns only ``softmax_d`` (so gradients
  of an un-allocated ``dq`` are lost: the fake refuses ``None``).
* ``softmax_lse`` is ``[H, total_q]`` float32 (padded ``[B, H, max_seqlen]`` in 2.5.9).
* Causal masks align bottom-right; ``cu_seqlens`` must be int32 tensors on q's device and
  ``max_seqlen`` Python ints (the real ops take ``int`` in their schema).

Liberties: runs on CPU in any dtype; for float64 inputs the LSE stays float64 (so parity
tests can use tight tolerances); no dropout, window, softcap or ALiBi (asserted off).
"""
from __future__ import annotations

import inspect
import math
import types

import torch


def _segments(cu: torch.Tensor, q: torch.Tensor, max_seqlen, name: str) -> list[int]:
    assert isinstance(cu, torch.Tensor) and cu.dtype == torch.int32 and cu.dim() == 1, \
        f"{name} must be a 1-D int32 tensor, got {cu!r}"
    assert cu.device == q.device, f"{name} on {cu.device}, q on {q.device}"
    assert isinstance(max_seqlen, int) and not isinstance(max_seqlen, bool), \
        f"max_seqlen must be an int, got {type(max_seqlen).__name__}"
    offsets = cu.tolist()  # the fake may sync; the library's kernels read them on the device
    assert max_seqlen >= max(b - a for a, b in zip(offsets, offsets[1:])), "max_seqlen too small"
    return offsets


def _check(q, k, v, dropout_p, window, softcap, alibi):
    for t in (q, k, v):
        assert t.stride(-1) == 1, "flash-attn needs the last dimension contiguous"
    assert dropout_p == 0.0 and tuple(window) == (-1, -1) and softcap == 0.0 and alibi is None


def _scores(q, k, scale, causal):
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(group, 1)) * scale
    if causal:  # bottom-right aligned
        sq, sk = s.shape[1], s.shape[2]
        mask = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)
        s = s.masked_fill(mask, -math.inf)
    return s, group


def attend(q, k, v, cu_q, cu_k, causal, scale):
    """``(out [Tq, H, D] q.dtype, lse [H, Tq])`` of every segment pair."""
    out = torch.zeros_like(q)
    lse_type = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=lse_type)  # flash: +inf if empty
    for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        if b > a and d > c:
            s, group = _scores(q[a:b], k[c:d], scale, causal)
            l = torch.logsumexp(s, -1)
            p = torch.exp(s - l[..., None])
            o = torch.einsum("hqk,khd->qhd", p, v[c:d].double().repeat_interleave(group, 1))
            out[a:b], lse[:, a:b] = o.to(q.dtype), l.to(lse_type)
    return out, lse


def attend_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, dq, dk, dv):
    """Writes the gradients into ``dq``/``dk``/``dv`` (probabilities under the given lse)."""
    dq.zero_(), dk.zero_(), dv.zero_()
    for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        if b == a or d == c:
            continue
        s, group = _scores(q[a:b], k[c:d], scale, causal)
        p = torch.exp(s - lse[:, a:b].double()[..., None])
        do = dout[a:b].double()
        vv = v[c:d].double().repeat_interleave(group, 1)
        delta = (do * out[a:b].double()).sum(-1).transpose(0, 1)
        ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - delta[..., None]) * scale
        dq[a:b] = torch.einsum("hqk,khd->qhd", ds, k[c:d].double().repeat_interleave(group, 1))
        hk = k.shape[1]
        dk[c:d] = torch.einsum("hqk,qhd->khd", ds, q[a:b].double()).reshape(d - c, hk, group, -1).sum(2)
        dv[c:d] = torch.einsum("hqk,qhd->khd", p, do).reshape(d - c, hk, group, -1).sum(2)
    return (dout.double() * out.double()).sum(-1).transpose(0, 1).float()  # softmax_d


class CustomOp:
    """Like ``torch._library.custom_ops.CustomOpDef``: ``__call__(*args, **kwargs)``, the
    decorated function in ``_init_fn``."""

    def __init__(self, name, fn):
        self._name, self._init_fn = name, fn

    def __call__(self, *args, **kwargs):
        inspect.signature(self._init_fn).bind(*args, **kwargs)  # TypeError like the schema
        return self._init_fn(*args, **kwargs)


def _fwd_26(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
            return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None):
    _check(q, k, v, dropout_p, window_size, softcap, alibi_slopes)
    cq, ck = _segments(cu_seqlens_q, q, max_seqlen_q, "cu_seqlens_q"), _segments(
        cu_seqlens_k, q, max_seqlen_k, "cu_seqlens_k")
    out, lse = attend(q, k, v, cq, ck, causal, softmax_scale)
    return out, q, k, v, out, lse, None, torch.zeros(2, dtype=torch.int64)


def _bwd_26(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
            alibi_slopes, deterministic, rng_state=None):
    _check(q, k, v, dropout_p, window_size, softcap, alibi_slopes)
    cq, ck = _segments(cu_seqlens_q, q, max_seqlen_q, "cu_seqlens_q"), _segments(
        cu_seqlens_k, q, max_seqlen_k, "cu_seqlens_k")
    d = attend_backward(dout, q, k, v, out, softmax_lse, cq, ck, causal, softmax_scale, dq, dk, dv)
    return dq, dk, dv, d


def _fwd_27(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
            seqused_k=None):
    res = _fwd_26(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                  softmax_scale, causal, (window_size_left, window_size_right), softcap,
                  alibi_slopes)
    return res[0], res[5], None, res[7]


def _bwd_27(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
            window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    assert dq is not None and dk is not None and dv is not None, \
        "2.7+ writes the gradients in place and returns only softmax_d: pre-allocate them"
    return _bwd_26(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   (window_size_left, window_size_right), softcap, alibi_slopes,
                   deterministic)[3]


def _fwd_273(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
             softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
             alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
             seqused_k=None, zero_tensors=False):
    return _fwd_27(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size_left, window_size_right, softcap,
                   alibi_slopes)


def _bwd_273(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
             max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
             window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
             zero_tensors=False):
    return _bwd_27(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size_left, window_size_right, softcap, alibi_slopes, deterministic)


def _fwd_25(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size=(-1, -1), alibi_slopes=None,
            return_softmax=False, block_table=None):
    res = _fwd_26(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                  softmax_scale, causal, window_size, 0.0, alibi_slopes)
    lse = res[5]
    padded = lse.new_full((len(cu_seqlens_q) - 1, lse.shape[0], max_seqlen_q), math.inf)
    return res[:5] + (padded,) + res[6:]


def varlen_func(forward):
    """The public ``flash_attn_varlen_func`` (the same signature 2.6.0-2.8.3)."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
        assert not torch.is_grad_enabled() or not q.requires_grad, "fake has no autograd"
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        res = forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      dropout_p, scale, causal, window_size, softcap, alibi_slopes)
        return (res[0], res[5], None) if return_attn_probs else res[0]

    return flash_attn_varlen_func


def modules(version: str) -> dict:
    """``{"flash_attn": pkg, "flash_attn.flash_attn_interface": interface}`` of ``version``."""
    minor = tuple(int(x) for x in version.split(".")[:3])
    if minor < (2, 6):
        fwd, bwd = _fwd_25, _bwd_26
    elif minor < (2, 7):
        fwd, bwd = _fwd_26, _bwd_26
    elif minor < (2, 7, 3):
        fwd, bwd = CustomOp("flash_attn::_flash_attn_varlen_forward", _fwd_27), CustomOp(
            "flash_attn::_flash_attn_varlen_backward", _bwd_27)
    else:
        fwd, bwd = CustomOp("flash_attn::_flash_attn_varlen_forward", _fwd_273), CustomOp(
            "flash_attn::_flash_attn_varlen_backward", _bwd_273)
    fai = types.ModuleType("flash_attn.flash_attn_interface")
    fai._flash_attn_varlen_forward, fai._flash_attn_varlen_backward = fwd, bwd
    fai.flash_attn_varlen_func = varlen_func(_fwd_26)
    pkg = types.ModuleType("flash_attn")
    pkg.__version__, pkg.__path__ = version, []
    pkg.flash_attn_interface = fai
    pkg.flash_attn_varlen_func = fai.flash_attn_varlen_func
    return {"flash_attn": pkg, "flash_attn.flash_attn_interface": fai}
