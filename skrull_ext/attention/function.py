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

With the ``te`` kernel Transformer Engine runs step 3 (its own ring); the local part is
launched right after TE has posted the ring's exchanges, on the side stream
(:class:`_TEAttention`).  All offsets and index tensors come from
:func:`~skrull_ext.attention.meta.layout_meta`, built once per layout.
"""
from __future__ import annotations

import math

import torch

from skrull_ext.attention.choice import get_kernel
from skrull_ext.attention.comm import RingComm
from skrull_ext.attention.kernels import lse_dtype
from skrull_ext.attention.meta import layout_meta
from skrull_ext.attention.ring import ring_backward, ring_forward
from skrull_ext.attention.streams import Overlap


def _take_local(dsts, srcs) -> None:
    """Writes the joined local results into the outputs (the 'merge' of the local part)."""
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)


class _DACPAttention(torch.autograd.Function):
    """Our zigzag ring over an :class:`AttentionKernel`, local part overlapped."""

    @staticmethod
    def forward(ctx, q, k, v, meta, comm, kernel, scale):
        nl, seg = meta.num_causal, meta.causal
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=lse_dtype(q.dtype), device=q.device)
        ov = Overlap(q.device)
        res = {}

        def local():
            if nl:
                res["o"], res["l"] = ov.run(lambda: kernel.forward(
                    q[:nl], k[:nl], v[:nl], seg, seg, causal=True, scale=scale))

        if meta.use_ring:
            od, ld = ring_forward(q[nl:], k[nl:], v[nl:], meta.zigzag, comm, kernel, scale,
                                  during_first_exchange=local)
            out[nl:], lse[:, nl:] = od, ld
        else:
            local()
        if nl:
            ov.join(res["o"], res["l"])
            _take_local((out[:nl], lse[:, :nl]), (res["o"], res["l"]))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta, ctx.comm, ctx.kernel, ctx.scale = meta, comm, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        meta, comm, kernel, scale = ctx.meta, ctx.comm, ctx.kernel, ctx.scale
        nl, seg = meta.num_causal, meta.causal
        dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ov = Overlap(q.device)
        res = {}

        def local():
            if nl:
                res["g"] = ov.run(lambda: kernel.backward(
                    dout[:nl], q[:nl], k[:nl], v[:nl], out[:nl], lse[:, :nl], seg, seg,
                    causal=True, scale=scale))

        if meta.use_ring:
            dq[nl:], dk[nl:], dv[nl:] = ring_backward(
                dout[nl:], q[nl:], k[nl:], v[nl:], out[nl:], lse[:, nl:], meta.zigzag, comm,
                kernel, scale, during_first_exchange=local)
        else:
            local()
        if nl:
            ov.join(*res["g"])
            _take_local((dq[:nl], dk[:nl], dv[:nl]), res["g"])
        return dq, dk, dv, None, None, None, None


def _leaves(*tensors):
    return [t.detach().requires_grad_() for t in tensors]


class _TEAttention(torch.autograd.Function):
    """Transformer Engine runs the distributed part (its ring, its autograd); the local
    part runs after TE has posted the ring's first exchange, on our side stream.

    TE's graphs are built inside this function (on detached leaves) and differentiated in
    its backward, so the order of launches stays ours in both passes: TE's ring first
    (its P2P posts), then the local part on the side stream, then the join.
    """

    @staticmethod
    def forward(ctx, q, k, v, meta, te, cp_group, scale):
        nl = meta.num_causal
        ov = Overlap(q.device)
        out = torch.empty_like(q)
        dist_part = local_part = None
        with torch.enable_grad():
            if meta.use_ring:
                leaves = _leaves(q[nl:], k[nl:], v[nl:])
                dist_part = (leaves, te.distributed(*leaves, meta.distributed, cp_group, scale))
            if nl:
                leaves = _leaves(q[:nl], k[:nl], v[:nl])
                local_part = (leaves, ov.run(lambda: te.local(*leaves, meta.causal, scale)))
        if dist_part is not None:
            out[nl:] = dist_part[1].detach()
        if local_part is not None:
            ov.join(local_part[1])
            _take_local((out[:nl],), (local_part[1].detach(),))
        ctx.parts, ctx.nl, ctx.kv_shape = (dist_part, local_part), nl, k.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        (dist_part, local_part), nl = ctx.parts, ctx.nl
        del ctx.parts  # frees TE's graphs with this backward
        dq = torch.empty_like(dout)
        dk = dout.new_empty(ctx.kv_shape)
        dv = torch.empty_like(dk)
        ov = Overlap(dout.device)
        gd = gl = None
        if dist_part is not None:  # TE's ring backward posts its first exchange here
            gd = torch.autograd.grad(dist_part[1], dist_part[0], dout[nl:])
        if local_part is not None:
            gl = ov.run(lambda: torch.autograd.grad(local_part[1], local_part[0], dout[:nl]))
        if gd is not None:
            dq[nl:], dk[nl:], dv[nl:] = gd
        if gl is not None:
            ov.join(*gl)
            _take_local((dq[:nl], dk[:nl], dv[:nl]), gl)
        return dq, dk, dv, None, None, None, None


def dacp_attention(q, k, v, layout, cp_group=None, *, softmax_scale=None, backend=None,
                   comm=None):
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
        backend: A kernel name (:data:`~skrull_ext.attention.choice.KERNEL_CHOICES`:
            ``auto``, ``flash``, ``te``, ``torch``, ``reference``; ``cpu_flash`` and
            ``flash_attn`` are accepted aliases), None for ``$SKRULL_ATTENTION_KERNEL``
            (default ``auto``), or a kernel instance.
        comm: Ring communicator to use instead of ``RingComm(cp_group)`` (e.g. one with a
            separate backward group, or a recording wrapper in tests); not with ``te``,
            which runs Transformer Engine's own ring over ``cp_group``.

    Returns:
        ``[T, H, D]`` attention output (padding rows hold finite values to be ignored).

    Raises:
        ValueError: On shape mismatches, or a layout that does not match the group.
        RuntimeError: The kernel's library is missing (see ``get_kernel``).
    """
    _check_inputs(q, k, v, layout)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kernel = get_kernel(backend, q.device, q.dtype)
    meta = layout_meta(layout, q.device)  # built once per layout, shared by every layer
    if getattr(kernel, "owns_ring", False):
        if comm is not None:
            raise ValueError("comm= replaces our ring's communicator; the te kernel runs "
                             "Transformer Engine's ring over cp_group: drop comm=")
        group = cp_group if cp_group is not None and _size(cp_group) > 1 else None
        _check_group(layout, 1 if group is None else _size(group),
                     None if group is None else torch.distributed.get_rank(group))
        return _TEAttention.apply(q, k, v, meta, kernel, group, scale)
    if comm is None and cp_group is not None and _size(cp_group) > 1:
        comm = RingComm(cp_group)
    if comm is not None and comm.size == 1:
        comm = None
    _check_group(layout, 1 if comm is None else comm.size, None if comm is None else comm.rank)
    return _DACPAttention.apply(q, k, v, meta, comm, kernel, scale)


def _size(group) -> int:
    return torch.distributed.get_world_size(group)


def _check_group(layout, size: int, rank) -> None:
    if size != layout.cp_size:
        raise ValueError(f"layout was built for cp_size {layout.cp_size} but the CP group has "
                         f"{size} ranks; build it with the group's size (and pass cp_group)")
    if rank is not None and rank != layout.cp_rank:
        raise ValueError(f"layout is for CP rank {layout.cp_rank} but this is rank {rank}")


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
