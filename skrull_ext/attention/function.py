"""DACP attention of one CP rank's packed stream: autograd function and overlap.

Forward (backward is symmetric):

1. post the first K/V exchange of the ring (distributed part);
2. while it is in flight, compute the local part's per-document causal attention (on
   CUDA on a side stream, on CPU on the main thread while gloo transfers in the
   background);
3. run the zigzag ring over the distributed part (:mod:`skrull_ext.attention.ring`).

Without a ring (``cp_size == 1``, no CP group, or no distributed sequence in the
micro-batch, which every rank of the group knows alike) there is no communication: every
document, distributed ones included (held whole when ``cp_size == 1``), is attended
causally in one varlen call.
"""
from __future__ import annotations

import math

import torch

from skrull_ext.attention.comm import RingComm
from skrull_ext.attention.kernels import get_kernel, lse_dtype
from skrull_ext.attention.ring import ring_backward, ring_forward, zigzag_blocks

_SIDE_STREAMS: dict = {}


class _Overlap:
    """Runs the local part on a side CUDA stream (plain call on CPU)."""

    def __init__(self, device: torch.device):
        self.side = None
        if device.type == "cuda":
            if device not in _SIDE_STREAMS:
                _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
            self.side = _SIDE_STREAMS[device]
            self.main = torch.cuda.current_stream(device)

    def run(self, fn):
        if self.side is None:
            return fn()
        self.side.wait_stream(self.main)  # inputs were produced on the main stream
        with torch.cuda.stream(self.side):
            return fn()

    def join(self, *tensors):
        """Makes the main stream wait for the side stream's results."""
        if self.side is None:
            return
        self.main.wait_stream(self.side)
        for t in tensors:  # allocated on the side stream, used and freed on the main one
            if t is not None:
                t.record_stream(self.main)


def _causal_cu(layout, use_ring: bool) -> tuple[int, ...]:
    """Offsets of the documents attended without communication."""
    cu = tuple(layout.local_cu_seqlens)
    if not use_ring:  # distributed shards are whole sequences (or there are none)
        nl = layout.num_local_tokens
        cu = cu + tuple(nl + x for x in layout.dist_cu_seqlens[1:])
    return cu


class _DACPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, comm, kernel, scale):
        use_ring = comm is not None and layout.num_distributed_tokens > 0
        cu = _causal_cu(layout, use_ring)
        nl = cu[-1]
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=lse_dtype(q.dtype), device=q.device)
        ov = _Overlap(q.device)
        res = {}

        def local():
            if nl:
                res["o"], res["l"] = ov.run(lambda: kernel.forward(
                    q[:nl], k[:nl], v[:nl], cu, cu, causal=True, scale=scale))

        if use_ring:
            zz = zigzag_blocks(layout, q.device)
            od, ld = ring_forward(q[nl:], k[nl:], v[nl:], zz, comm, kernel, scale,
                                  during_first_exchange=local)
            out[nl:], lse[:, nl:] = od, ld
        else:
            local()
        if nl:
            ov.join(res["o"], res["l"])
            out[:nl], lse[:, :nl] = res["o"], res["l"]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.comm, ctx.kernel, ctx.scale, ctx.use_ring = layout, comm, kernel, scale, use_ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, comm, kernel, scale = ctx.layout, ctx.comm, ctx.kernel, ctx.scale
        dout = dout.contiguous()
        cu = _causal_cu(layout, ctx.use_ring)
        nl = cu[-1]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ov = _Overlap(q.device)
        res = {}

        def local():
            if nl:
                res["g"] = ov.run(lambda: kernel.backward(
                    dout[:nl], q[:nl], k[:nl], v[:nl], out[:nl], lse[:, :nl], cu, cu,
                    causal=True, scale=scale))

        if ctx.use_ring:
            zz = zigzag_blocks(layout, q.device)
            dq[nl:], dk[nl:], dv[nl:] = ring_backward(
                dout[nl:], q[nl:], k[nl:], v[nl:], out[nl:], lse[:, nl:], zz, comm, kernel,
                scale, during_first_exchange=local)
        else:
            local()
        if nl:
            ov.join(*res["g"])
            dq[:nl], dk[:nl], dv[:nl] = res["g"]
        return dq, dk, dv, None, None, None, None


def dacp_attention(q, k, v, layout, cp_group=None, *, softmax_scale=None, backend="auto", comm=None):
    """Causal attention of a CP rank's packed mixed micro-batch (Skrull DACP).

    Local sequences are attended per document without communication, overlapping the
    first K/V exchange of the zigzag ring that attends the distributed sequences.  Every
    rank of the CP group must call this collectively with its own layout of the same
    micro-batch.  Attention never crosses documents.

    Args:
        q: ``[T, H, D]`` queries in the layout's stream order (``T = layout.num_tokens``).
        k: ``[T, Hkv, D]`` keys, ``H % Hkv == 0`` (GQA).
        v: ``[T, Hkv, D]`` values.
        layout: This rank's :class:`~skrull_ext.attention.layout.RankLayout`.
        cp_group: CP process group; None (or size 1) means no communication.
        softmax_scale: Defaults to ``1 / sqrt(D)``.
        backend: ``"auto"``, ``"reference"``, ``"cpu_flash"``, ``"flash_attn"`` or an
            :class:`~skrull_ext.attention.kernels.AttentionKernel`.
        comm: Ring communicator to use instead of ``RingComm(cp_group)`` (e.g. one with a
            separate backward group, or a recording wrapper in tests).

    Returns:
        ``[T, H, D]`` attention output (padding rows hold finite values to be ignored).

    Raises:
        ValueError: On shape mismatches, or a layout that does not match the group.
    """
    _check_inputs(q, k, v, layout)
    if comm is None and cp_group is not None and torch.distributed.get_world_size(cp_group) > 1:
        comm = RingComm(cp_group)
    if comm is not None and comm.size == 1:
        comm = None
    size = 1 if comm is None else comm.size
    if size != layout.cp_size:
        raise ValueError(f"layout was built for cp_size {layout.cp_size} but the CP group has "
                         f"{size} ranks; build it with the group's size (and pass cp_group)")
    if comm is not None and comm.rank != layout.cp_rank:
        raise ValueError(f"layout is for CP rank {layout.cp_rank} but this is rank {comm.rank}")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kernel = get_kernel(backend, q.device, q.dtype)
    return _DACPAttention.apply(q, k, v, layout, comm, kernel, scale)


def _check_inputs(q, k, v, layout):
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"expected q [T, H, D], k and v [T, Hkv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != layout.num_tokens or k.shape[0] != layout.num_tokens:
        raise ValueError(f"q/k/v have {q.shape[0]}/{k.shape[0]} tokens but the layout holds "
                         f"{layout.num_tokens}; pack them with layout.pack")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of KV heads {k.shape[1]} "
                         f"and head dims must match ({q.shape[2]} vs {k.shape[2]})")
