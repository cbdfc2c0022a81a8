"""Attention kernel back-ends of our ring behind one small interface, and their names.

Every back-end computes attention of a *varlen block*: packed queries ``q [Tq, H, D]``
against packed keys/values ``k, v [Tk, Hkv, D]`` split into segments by ``cu_q`` and
``cu_k`` (:class:`Segments`, same number of segments; segment ``i`` of q only sees
segment ``i`` of k).  ``H`` must be a multiple of ``Hkv`` (GQA).  With ``causal=True``
every segment must be square and is masked causally; otherwise it is attended fully.

``forward`` returns ``(out [Tq, H, D], lse [H, Tq])`` (``lse`` = natural-log
sum-exp of the scaled scores, float32, or float64 for float64 inputs); ``backward``
takes the *final* (merged) ``out`` and ``lse`` of those queries, which makes the block
gradients of a ring-merged attention exact (the standard flash-attention identity).

Kernels (``--skrull-attention-kernel`` / ``SKRULL_ATTENTION_KERNEL`` / ``backend=``):

* ``torch``: ATen's flash attention for CPU (``cpu_flash`` is an alias).
* ``flash``: flash-attn 2.6-2.8 varlen kernels (:mod:`skrull_ext.attention.flash`;
  ``flash_attn`` is an alias).
* ``te``: Transformer Engine's ``DotProductAttention`` (:mod:`skrull_ext.attention.te`);
  it runs the distributed sequences with TE's own ring, so it is not an
  :class:`AttentionKernel`.
* ``reference``: explicit softmax in float64 (tests; never chosen on CUDA unless asked).
* ``auto``: ``torch`` on CPU; on CUDA ``te``, else ``flash``, else an error naming what
  to install (:mod:`skrull_ext.attention.choice`, which resolves the names).

No back-end is needed to import the package; none tests the device or dtype itself
(the libraries do), so fakes of the libraries drive them on CPU in tests.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence, Union

import torch


@dataclasses.dataclass(frozen=True, eq=False)
class Segments:
    """Segment offsets of a varlen block, on the host and on the device.

    Built once per micro-batch layout (:mod:`skrull_ext.attention.meta`) and shared by
    every layer's forward and backward, so no kernel call copies offsets to the device.

    Attributes:
        cu: ``[n + 1]`` offsets as Python ints (per-segment loops of the CPU kernels).
        cu_dev: The same offsets, int32 on the tensors' device (``cu_seqlens`` of GPU
            kernels).
        max_len: Longest segment (``max_seqlen``), 0 when there is none.
    """

    cu: tuple[int, ...]
    cu_dev: torch.Tensor
    max_len: int

    @property
    def total(self) -> int:
        return self.cu[-1]

    @functools.cached_property
    def has_empty(self) -> bool:
        """Whether some segment is empty (computed once; keys of such a segment leave its
        queries nothing to attend)."""
        return any(b == a for a, b in zip(self.cu[:-1], self.cu[1:]))


def segments(cu: Sequence[int], device, move=None) -> Segments:
    """:class:`Segments` of host offsets ``cu`` (one host-to-device copy: call it per
    layout, not per layer).

    Args:
        cu: Offsets, starting at 0, not decreasing (checked here, once).
        device: Where ``cu_dev`` lives.
        move: ``host tensor -> device tensor`` (:func:`skrull_ext.attention.staging.stage`
            batches a micro-batch's copies); default ``.to(device)``.

    Raises:
        ValueError: Offsets that do not start at 0 or decrease.
    """
    cu = tuple(int(x) for x in cu)
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if not cu or cu[0] != 0 or min(lens, default=0) < 0:
        raise ValueError(f"cu_seqlens {cu} must start at 0 and not decrease")
    host = torch.tensor(cu, dtype=torch.int32)
    return Segments(cu=cu, cu_dev=host.to(device) if move is None else move(host),
                    max_len=max(lens, default=0))


def as_segments(cu: Union[Segments, Sequence[int]], device) -> Segments:
    """Accepts :class:`Segments` as is; builds them from host offsets (ad-hoc calls)."""
    return cu if isinstance(cu, Segments) else segments(cu, device)


Cu = Union[Segments, Sequence[int]]


class AttentionKernel:
    """Interface of a varlen block attention back-end (see module docstring)."""

    name = "abstract"

    def forward(self, q, k, v, cu_q: Cu, cu_k: Cu, *, causal: bool, scale: float):
        """Returns ``(out [Tq, H, D] in q.dtype, lse [H, Tq])``."""
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, cu_q: Cu, cu_k: Cu, *, causal: bool, scale: float):
        """Returns ``(dq [Tq, H, D], dk [Tk, Hkv, D], dv [Tk, Hkv, D])`` in the input dtype."""
        raise NotImplementedError


def _host(cu: Cu) -> tuple[int, ...]:
    return cu.cu if isinstance(cu, Segments) else tuple(cu)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of log-sum-exp values and of the ring's accumulators for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_block(q):
    """``(out 0, lse -inf)``: a block with no queries or no keys (no kernel call)."""
    return torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), -math.inf,
                                           dtype=lse_dtype(q.dtype), device=q.device)


def _check_block(q, k, v, cu_q, cu_k, causal):
    """Shapes against the offsets; :class:`Segments` were checked once when built, so
    per layer only their totals are compared (host ints, no loop over segments)."""
    if isinstance(cu_q, Segments) and isinstance(cu_k, Segments):
        if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[1] % k.shape[1] or (
                len(cu_q.cu) != len(cu_k.cu) or cu_q.total != q.shape[0]
                or cu_k.total != k.shape[0] or (causal and cu_q.cu != cu_k.cu)):
            _check_block(q, k, v, cu_q.cu, cu_k.cu, causal)  # raises, naming the problem
        return
    cu_q, cu_k = _host(cu_q), _host(cu_k)
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"expected q [T, H, D] and k, v [T, Hkv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if len(cu_q) != len(cu_k) or cu_q[-1] != q.shape[0] or cu_k[-1] != k.shape[0]:
        raise ValueError(f"cu_seqlens {tuple(cu_q)}/{tuple(cu_k)} do not match "
                         f"{q.shape[0]} queries / {k.shape[0]} keys")
    if cu_q[0] != 0 or cu_k[0] != 0 or any(b < a for a, b in zip(cu_q, cu_q[1:])) or any(
            b < a for a, b in zip(cu_k, cu_k[1:])):
        raise ValueError(f"cu_seqlens {tuple(cu_q)}/{tuple(cu_k)} must start at 0 and not "
                         "decrease")
    if causal and tuple(cu_q) != tuple(cu_k):
        raise ValueError("causal blocks must have square segments (cu_q == cu_k)")


def _segments(cu_q, cu_k):
    cu_q, cu_k = _host(cu_q), _host(cu_k)
    for i in range(len(cu_q) - 1):
        yield cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]


class _SegmentLoopKernel(AttentionKernel):
    """Runs a dense per-segment kernel in a loop; handles empty segments."""

    def forward(self, q, k, v, cu_q, cu_k, *, causal, scale):
        _check_block(q, k, v, cu_q, cu_k, causal)
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=lse_dtype(q.dtype), device=q.device)
        for a, b, c, d in _segments(cu_q, cu_k):
            if b == a or d == c:  # no queries, or nothing to attend: out 0, lse -inf
                continue
            o, l = self._fwd(q[a:b], k[c:d], v[c:d], causal, scale)
            out[a:b] = o
            lse[:, a:b] = l
        return out, lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, *, causal, scale):
        _check_block(q, k, v, cu_q, cu_k, causal)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b, c, d in _segments(cu_q, cu_k):
            if b == a or d == c:
                continue
            g = self._bwd(dout[a:b], q[a:b], k[c:d], v[c:d], out[a:b], lse[:, a:b], causal, scale)
            dq[a:b], dk[c:d], dv[c:d] = g
        return dq, dk, dv


class ReferenceKernel(_SegmentLoopKernel):
    """Explicit-softmax attention computed in float64 (slow, exact; any device/dtype)."""

    name = "reference"

    @staticmethod
    def _scores(q, k, causal, scale):
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
        if causal:
            mask = torch.ones(s.shape[1], s.shape[2], dtype=torch.bool, device=q.device).triu(1)
            s = s.masked_fill(mask, -math.inf)
        return s, group

    def _fwd(self, q, k, v, causal, scale):
        s, group = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)  # [H, s_q]
        p = torch.exp(s - lse[..., None])
        out = torch.einsum("hqk,khd->qhd", p, v.double().repeat_interleave(group, dim=1))
        return out.to(q.dtype), lse.to(lse_dtype(q.dtype))

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        s, group = self._scores(q, k, causal, scale)
        p = torch.exp(s - lse.double()[..., None])  # probabilities under the *final* lse
        do = dout.double()
        vv = v.double().repeat_interleave(group, dim=1)
        dp = torch.einsum("qhd,khd->hqk", do, vv)
        delta = (do * out.double()).sum(-1).transpose(0, 1)  # [H, s_q]
        ds = p * (dp - delta[..., None]) * scale
        dq = torch.einsum("hqk,khd->qhd", ds, k.double().repeat_interleave(group, dim=1))
        dk = torch.einsum("hqk,qhd->khd", ds, q.double())
        dv = torch.einsum("hqk,qhd->khd", p, do)
        hk = k.shape[1]
        dk = dk.reshape(dk.shape[0], hk, group, -1).sum(2)  # GQA: sum over the query group
        dv = dv.reshape(dv.shape[0], hk, group, -1).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class CpuFlashKernel(AttentionKernel):
    """ATen's CPU flash attention, one call per segment on ``[1, H, S, D]`` views.

    The per-segment Python work is what costs on CPU (a training step makes one call per
    document, layer and ring step), so it is kept to one slice per tensor and the kernel
    call: the ``[T, H, D]`` inputs are viewed as ``[1, H, T, D]`` once, the kernel writes
    ``[S, H, D]``-ordered results for such views, and the pieces are joined by one
    ``torch.cat`` per output instead of a copy per segment.
    """

    name = "torch"

    def forward(self, q, k, v, cu_q, cu_k, *, causal, scale):
        _check_block(q, k, v, cu_q, cu_k, causal)
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        qt, kt, vt = _bhsd(q), _bhsd(k), _bhsd(v)
        outs, lses = [], []
        for a, b, c, d in _segments(cu_q, cu_k):
            if b == a:
                continue
            if d == c:  # nothing to attend: out 0, lse -inf
                outs.append(q.new_zeros((1, q.shape[1], b - a, q.shape[2])))
                lses.append(torch.full((1, q.shape[1], b - a), -math.inf,
                                       dtype=lse_dtype(q.dtype), device=q.device))
                continue
            o, l = op(qt[:, :, a:b], kt[:, :, c:d], vt[:, :, c:d], 0.0, causal, scale=scale)
            outs.append(o)
            lses.append(l)
        if not outs:
            return torch.zeros_like(q), torch.zeros((q.shape[1], 0), dtype=lse_dtype(q.dtype),
                                                    device=q.device)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)
        return out[0].transpose(0, 1), lse[0].to(lse_dtype(q.dtype))

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, *, causal, scale):
        _check_block(q, k, v, cu_q, cu_k, causal)
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        # The kernel wants lse in its own dtype: float32 except for float64 inputs.
        want = torch.float64 if q.dtype == torch.float64 else torch.float32
        dt, qt, kt, vt, ot = _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out)
        lt = lse.to(want)[None]
        dqs, dks, dvs = [], [], []
        for a, b, c, d in _segments(cu_q, cu_k):
            if b == a or d == c:  # no queries or no keys: zero gradients
                dqs.append(q.new_zeros((1, q.shape[1], b - a, q.shape[2])))
                dks.append(k.new_zeros((1, k.shape[1], d - c, k.shape[2])))
                dvs.append(dks[-1])
                continue
            dq, dk, dv = op(dt[:, :, a:b], qt[:, :, a:b], kt[:, :, c:d], vt[:, :, c:d],
                            ot[:, :, a:b], lt[:, :, a:b], 0.0, causal, scale=scale)
            dqs.append(dq)
            dks.append(dk)
            dvs.append(dv)
        if not dqs:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        return tuple((xs[0] if len(xs) == 1 else torch.cat(xs, dim=2))[0].transpose(0, 1)
                     for xs in (dqs, dks, dvs))


def _bhsd(x):
    """``[S, H, D]`` -> ``[1, H, S, D]`` view (no copy)."""
    return x.transpose(0, 1).unsqueeze(0)
