"""Fakes of PyTorch's CUDA FlashAttention-2 varlen ops (``torch.ops.aten._flash_attention_*``),
computing in float64 on CPU.

What is faithful (schemas as printed by torch 2.13's ``op.default._schema``; the earlier
``philox_seed``/``philox_offset`` naming from ``torch/_meta_registrations.py``; behaviour
read from ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``):

* each op is an object with ``default._schema`` (a real ``FunctionSchema``) whose
  ``__call__`` binds arguments by that schema (positional, then keyword-only) and rejects
  unknown or missing ones, like the dispatcher;
* flash: ``cu_seqlens`` int32 on q's device, ``max_q``/``max_k`` ints, last dimension
  contiguous; the LSE is float32 ``[H, total_q]`` (``"padded"``: ``[B, H, max_q]``, as ROCm
  builds return), +inf for a query with no key; with ``max_q == 1`` and GQA the forward
  regroups q per segment, which fails unless every segment has exactly one query; the
  backward reads the LSE in the layout its forward returned and takes two random-state
  tensors.

Liberties: any floating dtype (float64 inputs keep a float64 LSE, for tight tolerances);
no dropout or window (asserted off).
"""
from __future__ import annotations

import math
import types

import torch

from fakes.flash_attn import _segments, attend, attend_backward

_FLASH_FWD = (
    "aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, "
    "Tensor? cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, "
    "bool return_debug_mask, *, float? scale=None, SymInt? window_size_left=None, "
    "SymInt? window_size_right=None, Tensor? seqused_k=None, Tensor? alibi_slopes=None{extra}) "
    "-> (Tensor output, Tensor softmax_logsumexp, Tensor {seed}, Tensor {offset}, "
    "Tensor debug_attn_mask)")
_FLASH_BWD = (
    "aten::_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
    "Tensor out, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, "
    "SymInt max_k, float dropout_p, bool is_causal, Tensor {seed}, Tensor {offset}, *, "
    "float? scale=None, SymInt? window_size_left=None, SymInt? window_size_right=None) "
    "-> (Tensor, Tensor, Tensor)")
#: ``variant -> (random-state names, extra keyword-only forward params, padded LSE)``.
FLASH_VARIANTS = {
    "2.13": (("rng_state", "unused"), ", Tensor? block_table=None, int? num_splits=None", False),
    "philox": (("philox_seed", "philox_offset"), "", False),
    "padded": (("philox_seed", "philox_offset"), "", True),
}


class FakeOp:
    """An op with a real schema; calls are bound by it and logged in ``calls``."""

    def __init__(self, schema: str, impl):
        self.default = types.SimpleNamespace(_schema=torch._C.parse_schema(schema))
        self.impl, self.calls = impl, []

    def __call__(self, *args, **kwargs):
        params = self.default._schema.arguments
        positional = [a.name for a in params if not a.kwarg_only]
        if len(args) > len(positional):
            raise TypeError(f"{len(args)} positional arguments for {len(positional)}")
        bound = dict(zip(positional, args))
        for name, value in kwargs.items():
            if name not in {a.name for a in params} or name in bound:
                raise TypeError(f"unexpected or repeated argument {name!r}")
            bound[name] = value
        for a in params:
            if a.name not in bound:
                if not a.has_default_value():
                    raise TypeError(f"missing required argument {a.name!r}")
                bound[a.name] = a.default_value
        self.calls.append(bound)
        return self.impl(**bound)


def _lse_type(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _check_inputs(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p):
    for t in (q, k, v):
        assert t.stride(-1) == 1, "last dimension must be contiguous"
    assert dropout_p == 0.0
    return _segments(cu_q, q, max_q, "cum_seq_q"), _segments(cu_k, q, max_k, "cum_seq_k")


def _flash_forward(padded, seed_names):
    def forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                return_debug_mask, scale=None, window_size_left=None, window_size_right=None,
                **unused):
        assert window_size_left in (None, -1) and window_size_right in (None, -1)
        cq, ck = _check_inputs(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p)
        batch = len(cq) - 1
        if max_q == 1 and query.shape[1] > key.shape[1] and query.shape[0] != batch:
            raise RuntimeError(f"shape '[{batch}, {key.shape[1]}, "
                               f"{query.shape[1] // key.shape[1]}, {query.shape[2]}]' is "
                               f"invalid for input of size {query.numel()}")
        scale = scale if scale is not None else query.shape[-1] ** -0.5
        out, lse = attend(query, key, value, cq, ck, is_causal, scale)
        lse = lse.to(_lse_type(query))
        if padded:
            full = lse.new_full((batch, lse.shape[0], max_q), math.inf)
            for b, (a, e) in enumerate(zip(cq, cq[1:])):
                full[b, :, :e - a] = lse[:, a:e]
            lse = full
        return out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)
    return forward


def _flash_backward(padded, seed_names):
    def backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                 max_k, dropout_p, is_causal, scale=None, window_size_left=None,
                 window_size_right=None, **state):
        assert set(state) == set(seed_names) and all(torch.is_tensor(t) for t in state.values())
        cq, ck = _check_inputs(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p)
        assert logsumexp.dtype == _lse_type(query), logsumexp.dtype
        h, batch = query.shape[1], len(cq) - 1
        if padded:
            assert tuple(logsumexp.shape) == (batch, h, max_q), logsumexp.shape
            lse = torch.cat([logsumexp[b, :, :e - a] for b, (a, e) in enumerate(zip(cq, cq[1:]))],
                            dim=1)
        else:
            assert tuple(logsumexp.shape) == (h, query.shape[0]), logsumexp.shape
            lse = logsumexp
        grads = [torch.empty_like(t) for t in (query, key, value)]
        scale = scale if scale is not None else query.shape[-1] ** -0.5
        attend_backward(grad_out, query, key, value, out, lse, cq, ck, is_causal, scale, *grads)
        return tuple(grads)
    return backward


def ops(variant: str = "2.13") -> types.SimpleNamespace:
    """A fake ``torch.ops.aten`` holding the flash ops of ``variant``."""
    seeds, extra, padded = FLASH_VARIANTS[variant]
    names = dict(seed=seeds[0], offset=seeds[1], extra=extra)
    return types.SimpleNamespace(
        _flash_attention_forward=FakeOp(_FLASH_FWD.format(**names),
                                        _flash_forward(padded, seeds)),
        _flash_attention_backward=FakeOp(_FLASH_BWD.format(**names),
                                         _flash_backward(padded, seeds)))
