"""DACP attention of one CP rank's packed stream: autograd function and overlap.

Forward (backward is symmetric):

1. post the first K/V exchange of the ring (distributed part);
2. while it is in flight, compute the local part's per-document causal attention (on
   CUDA on a side stream, on CPU on the main thread while gloo transfers in the
   background);
3. run the zigzag ring over the distributed part (:mod:`skrull_ext.attention.ring`);
4. then, one after another, one zigzag ring per CP sub-group holding grouped sequences
   (hybrid-CP placements; only the sub-groups that contain this rank, in the layout's
   order, which is the same on every rank), not overlapped with anything: the cost
   model and the simulator charge sub-group rings after the full ring, unoverlapped.

Without a ring (``cp_size == 1``, no CP group, or no distributed sequence in the
micro-batch, which every rank of the group knows alike) there is no communication: every
document, distributed ones included (held whole when ``cp_size == 1``), is attended
causally in one varlen call; without sub-group rings either, that call runs on the current
stream and its results are returned as they are (nothing to overlap, so no side stream,
events or copies per layer).

With the ``te`` kernel Transformer Engine runs step 3 (its own ring); the local part is
launched right after TE has posted the ring's exchanges, on the side stream
(:class:`_TEAttention`).  TE's ring spans the whole CP group, so step 4 runs our ring with
flash-attn's kernel, else PyTorch's FlashAttention-2 op (TE's public API has no block-level
LSE to merge); with neither, a micro-batch with grouped sequences fails with one error
naming the fix.  All offsets and index tensors come from
:func:`~skrull_ext.attention.meta.layout_meta`, built once per layout.
"""
from __future__ import annotations

import math

import torch

import skrull_ext.attention.aten as aten
from skrull_ext.attention.choice import get_kernel
from skrull_ext.attention.comm import RingComm
from skrull_ext.attention.kernels import lse_dtype
from skrull_ext.attention.meta import layout_meta
from skrull_ext.attention.ring import ring_backward, ring_forward
from skrull_ext.attention.streams import Overlap


class _Solo:
    """The ring of a one-rank sub-group: one causal step, no communication."""

    rank, size = 0, 1


def _groups_forward(q, k, v, out, lse, meta, comms, kernel, scale) -> None:
    """Step 4: each sub-group's ring over its part of the stream (written in place)."""
    for g, comm in zip(meta.groups, comms):
        a, b = g.start, g.stop
        out[a:b], lse[:, a:b] = ring_forward(q[a:b], k[a:b], v[a:b], g.zigzag, comm, kernel,
                                             scale)


def _groups_backward(dout, q, k, v, out, lse, grads, meta, comms, kernel, scale) -> None:
    """Backward of :func:`_groups_forward`, the sub-groups in the same order."""
    dq, dk, dv = grads
    for g, comm in zip(meta.groups, comms):
        a, b = g.start, g.stop
        dq[a:b], dk[a:b], dv[a:b] = ring_backward(
            dout[a:b], q[a:b], k[a:b], v[a:b], out[a:b], lse[:, a:b], g.zigzag, comm, kernel,
            scale)


def _group_comms(meta, comm, cp_group) -> tuple:
    """Communicator per sub-group of ``meta`` (its CP ranks' ring in the CP group)."""
    out = []
    for g in meta.groups:
        if g.size == 1:
            out.append(_Solo())
            continue
        base = comm if hasattr(comm, "subgroup") else None
        if base is None:
            if cp_group is None:
                raise ValueError("the micro-batch has grouped (CP sub-group) sequences: pass "
                                 "cp_group, or a comm= with a subgroup() method")
            base = RingComm(cp_group)
        out.append(base.subgroup(g.first_rank, g.size))
    return tuple(out)


def _one_call(meta, q) -> bool:
    """Whether the whole stream is one causal varlen call (no ring, no sub-group: every
    micro-batch at CP 1), whose kernel results are the function's own."""
    return not meta.use_ring and not meta.groups and 0 < meta.num_causal == q.shape[0]


def _take_local(dsts, srcs) -> None:
    """Writes the joined local results into the outputs (the 'merge' of the local part)."""
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)


class _DACPAttention(torch.autograd.Function):
    """Our zigzag ring over an :class:`AttentionKernel`, local part overlapped."""

    @staticmethod
    def forward(ctx, q, k, v, meta, comm, kernel, scale, gcomms):
        nl, rs, seg = meta.num_causal, meta.ring_stop, meta.causal
        ctx.meta, ctx.comm, ctx.kernel, ctx.scale, ctx.gcomms = meta, comm, kernel, scale, gcomms
        if _one_call(meta, q):  # nothing to overlap: no side stream, no copy
            out, lse = kernel.forward(q, k, v, seg, seg, causal=True, scale=scale)
            # A kernel may return a strided view (the CPU one: [H, T, d] transposed); the
            # caller reshapes ``out`` to [T, H * d], which would copy it next to the one
            # saved here.  Contiguous, both are one storage (no copy when it already is).
            out = out.contiguous()
            ctx.save_for_backward(q, k, v, out, lse)
            return out
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=lse_dtype(q.dtype), device=q.device)
        ov = Overlap(q.device)
        res = {}

        def local():
            if nl:
                res["o"], res["l"] = ov.run(lambda: kernel.forward(
                    q[:nl], k[:nl], v[:nl], seg, seg, causal=True, scale=scale))

        if meta.use_ring:
            od, ld = ring_forward(q[nl:rs], k[nl:rs], v[nl:rs], meta.zigzag, comm, kernel,
                                  scale, during_first_exchange=local)
            out[nl:rs], lse[:, nl:rs] = od, ld
        else:
            local()
        if nl:
            ov.join(res["o"], res["l"])
            _take_local((out[:nl], lse[:, :nl]), (res["o"], res["l"]))
        _groups_forward(q, k, v, out, lse, meta, gcomms, kernel, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        meta, comm, kernel, scale = ctx.meta, ctx.comm, ctx.kernel, ctx.scale
        nl, rs, seg = meta.num_causal, meta.ring_stop, meta.causal
        dout = dout.contiguous()
        if _one_call(meta, q):
            return (*kernel.backward(dout, q, k, v, out, lse, seg, seg, causal=True,
                                     scale=scale), None, None, None, None, None)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ov = Overlap(q.device)
        res = {}

        def local():
            if nl:
                res["g"] = ov.run(lambda: kernel.backward(
                    dout[:nl], q[:nl], k[:nl], v[:nl], out[:nl], lse[:, :nl], seg, seg,
                    causal=True, scale=scale))

        if meta.use_ring:
            dq[nl:rs], dk[nl:rs], dv[nl:rs] = ring_backward(
                dout[nl:rs], q[nl:rs], k[nl:rs], v[nl:rs], out[nl:rs], lse[:, nl:rs],
                meta.zigzag, comm, kernel, scale, during_first_exchange=local)
        else:
            local()
        if nl:
            ov.join(*res["g"])
            _take_local((dq[:nl], dk[:nl], dv[:nl]), res["g"])
        _groups_backward(dout, q, k, v, out, lse, (dq, dk, dv), meta, ctx.gcomms, kernel, scale)
        return dq, dk, dv, None, None, None, None, None


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
    def forward(ctx, q, k, v, meta, te, cp_group, scale, groups):
        nl, rs = meta.num_causal, meta.ring_stop
        ov = Overlap(q.device)
        out = torch.empty_like(q)
        dist_part = local_part = None
        with torch.enable_grad():
            if meta.use_ring:
                leaves = _leaves(q[nl:rs], k[nl:rs], v[nl:rs])
                dist_part = (leaves, te.distributed(*leaves, meta.distributed, cp_group, scale))
            if nl:
                leaves = _leaves(q[:nl], k[:nl], v[:nl])
                local_part = (leaves, ov.run(lambda: te.local(*leaves, meta.causal, scale)))
        if dist_part is not None:
            out[nl:rs] = dist_part[1].detach()
        if local_part is not None:
            ov.join(local_part[1])
            _take_local((out[:nl],), (local_part[1].detach(),))
        if meta.groups:  # step 4 with our ring and flash-attn's kernel (module docstring)
            gcomms, kernel = groups
            lse = torch.empty((q.shape[1], q.shape[0]), dtype=lse_dtype(q.dtype), device=q.device)
            _groups_forward(q, k, v, out, lse, meta, gcomms, kernel, scale)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.meta, ctx.groups, ctx.scale = meta, groups, scale
        ctx.parts, ctx.nl, ctx.rs, ctx.kv_shape = (dist_part, local_part), nl, rs, k.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        (dist_part, local_part), nl, rs = ctx.parts, ctx.nl, ctx.rs
        del ctx.parts  # frees TE's graphs with this backward
        dq = torch.empty_like(dout)
        dk = dout.new_empty(ctx.kv_shape)
        dv = torch.empty_like(dk)
        ov = Overlap(dout.device)
        gd = gl = None
        if dist_part is not None:  # TE's ring backward posts its first exchange here
            gd = torch.autograd.grad(dist_part[1], dist_part[0], dout[nl:rs])
        if local_part is not None:
            gl = ov.run(lambda: torch.autograd.grad(local_part[1], local_part[0], dout[:nl]))
        if gd is not None:
            dq[nl:rs], dk[nl:rs], dv[nl:rs] = gd
        if gl is not None:
            ov.join(*gl)
            _take_local((dq[:nl], dk[:nl], dv[:nl]), gl)
        if getattr(ctx, "groups", None):
            q, k, v, out, lse = ctx.saved_tensors
            gcomms, kernel = ctx.groups
            _groups_backward(dout.contiguous(), q, k, v, out, lse, (dq, dk, dv), ctx.meta,
                             gcomms, kernel, ctx.scale)
        return dq, dk, dv, None, None, None, None, None


def dacp_attention(q, k, v, layout, cp_group=None, *, softmax_scale=None, backend=None,
                   comm=None):
    """Causal attention of a CP rank's packed mixed micro-batch (Skrull DACP).

    Local sequences are attended per document without communication, overlapping the
    first K/V exchange of the zigzag ring that attends the distributed sequences; grouped
    (hybrid-CP) sequences then get one zigzag ring per CP sub-group, over the sub-group's
    ranks only.  Every rank of the CP group must call this collectively with its own
    layout of the same micro-batch.  Attention never crosses documents.

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
            separate backward group, or a recording wrapper in tests); its ``subgroup(first,
            n)`` gives the sub-group rings (else ``RingComm(cp_group)``'s); not with
            ``te``, which runs Transformer Engine's own ring over ``cp_group``.

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
        groups = ((_group_comms(meta, None, group), _group_kernel(q)) if meta.groups
                  else None)
        return _TEAttention.apply(q, k, v, meta, kernel, group, scale, groups)
    if comm is None and cp_group is not None and _size(cp_group) > 1:
        comm = RingComm(cp_group)
    if comm is not None and comm.size == 1:
        comm = None
    _check_group(layout, 1 if comm is None else comm.size, None if comm is None else comm.rank)
    return _DACPAttention.apply(q, k, v, meta, comm, kernel, scale,
                                _group_comms(meta, comm, cp_group))


def _group_kernel(q):
    """A block kernel for the sub-group rings next to Transformer Engine: flash-attn's,
    else PyTorch's FlashAttention-2 op (the ``torch`` kernel on CUDA)."""
    try:
        return get_kernel("flash", q.device, q.dtype)
    except RuntimeError as exc:
        if aten.flash_op_problem(q.device) is None:
            return get_kernel("torch", q.device, q.dtype)
        raise RuntimeError(
            "this micro-batch has hybrid-CP sub-group placements: Transformer Engine's ring "
            "spans the whole CP group, so their rings run our zigzag ring with flash-attn's "
            "kernel, which does not import (nor does PyTorch's FlashAttention-2 op run here); "
            "install flash-attn (pip install flash-attn --no-build-isolation) or use "
            "--skrull-attention-kernel flash") from exc


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
