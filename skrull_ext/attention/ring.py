"""Zigzag ring attention over the distributed part of a rank's stream.

Every rank holds, per distributed sequence, chunks ``r`` and ``2N-1-r`` (``c`` tokens
each), and all ranks hold the same shard sizes, so the K/V of the whole distributed part
is one fixed-shape message ``[2, Td, Hkv, D]``.  At ring step ``s`` rank ``r`` holds the
K/V of rank ``src = (r - s) mod N`` and computes only the needed blocks:

* ``src == r`` (step 0): both own chunks against both own chunks, causal;
* ``src < r``: both query chunks against the *first* received chunk (chunk ``src``
  precedes both query chunks; chunk ``2N-1-src`` follows both), full;
* ``src > r``: only the *second* query chunk (``2N-1-r``) against both received chunks
  (both precede it; both follow chunk ``r``), full.

Partial results are merged with the log-sum-exp update.  The backward pass replays the
same schedule with the final ``out``/``lse``; the dK/dV of a received K/V block travels
on with it and after ``N - 1`` hops returns to its owner (see :func:`ring_backward`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np
import torch

from skrull_ext.attention.kernels import AttentionKernel, Segments, lse_dtype, segments
from skrull_ext.attention.layout import on_device


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZigzagBlocks:
    """Segment offsets and chunk indices of the distributed part (same on every rank).

    Attributes:
        cu_full: Shard offsets (``2 c_i`` per sequence), relative to the part's start.
        cu_half: Offsets of one chunk per sequence (``c_i``).
        first: ``[Td / 2]`` indices of the first chunk (chunk ``r``) tokens.
        second: ``[Td / 2]`` indices of the second chunk (chunk ``2N-1-r``) tokens.
        seg_full: ``cu_full`` as :class:`Segments` (device offsets for GPU kernels).
        seg_half: ``cu_half`` as :class:`Segments`.
    """

    cu_full: tuple[int, ...]
    cu_half: tuple[int, ...]
    first: torch.Tensor
    second: torch.Tensor
    seg_full: Segments
    seg_half: Segments


def zigzag_blocks(layout, device) -> ZigzagBlocks:
    """:class:`ZigzagBlocks` of a :class:`~skrull_ext.attention.layout.RankLayout` (built
    once per layout and device, vectorised over the documents)."""
    return on_device(layout, device, "zigzag", _build_blocks)


def _build_blocks(layout, device) -> ZigzagBlocks:
    return blocks_of(layout.distributed, layout.dist_cu_seqlens, device)


def blocks_of(docs, cu_full, device, move=None) -> ZigzagBlocks:
    """:class:`ZigzagBlocks` of zigzag shards ``docs`` (``DistributedDoc`` s) at offsets
    ``cu_full`` relative to the part's start (the distributed part, or one CP sub-group's
    part of the grouped sequences), vectorised over the documents.  ``move`` as in
    :func:`~skrull_ext.attention.kernels.segments`."""
    move = move or (lambda t: t.to(device))
    c = np.fromiter((doc.chunk_size for doc in docs), dtype=np.int64, count=len(docs))
    cu_half = np.zeros(c.size + 1, dtype=np.int64)
    np.cumsum(c, out=cu_half[1:])
    starts = np.asarray(cu_full[:-1], dtype=np.int64)
    # Token j of the first chunks belongs to document i with cu_half[i] <= j < cu_half[i+1].
    first = np.repeat(starts - cu_half[:-1], c) + np.arange(cu_half[-1], dtype=np.int64)
    second = first + np.repeat(c, c)
    cu_full, cu_half = tuple(cu_full), tuple(cu_half.tolist())
    return ZigzagBlocks(cu_full=cu_full, cu_half=cu_half,
                        first=move(torch.from_numpy(first)),
                        second=move(torch.from_numpy(second)),
                        seg_full=segments(cu_full, device, move),
                        seg_half=segments(cu_half, device, move))


def _fwd_block(kernel, q, k, v, src, rank, zz, scale):
    """Returns ``(out, lse, rows)``; ``rows`` None means all queries."""
    if src == rank:
        return (*kernel.forward(q, k, v, zz.seg_full, zz.seg_full, causal=True, scale=scale), None)
    if src < rank:
        kf, vf = k.index_select(0, zz.first), v.index_select(0, zz.first)
        return (*kernel.forward(q, kf, vf, zz.seg_full, zz.seg_half, causal=False, scale=scale), None)
    q2 = q.index_select(0, zz.second)
    return (*kernel.forward(q2, k, v, zz.seg_half, zz.seg_full, causal=False, scale=scale), zz.second)


def _merge(acc_out, acc_lse, out, lse, rows):
    """Numerically stable log-sum-exp merge of a block result into the accumulators."""
    ao = acc_out if rows is None else acc_out.index_select(0, rows)
    al = acc_lse if rows is None else acc_lse.index_select(1, rows)
    lse = lse.to(al.dtype)
    new = torch.logaddexp(al, lse)  # [H, n]
    w_old = torch.exp(al - new).transpose(0, 1).unsqueeze(-1)
    w_new = torch.exp(lse - new).transpose(0, 1).unsqueeze(-1)
    merged = ao * w_old + out.to(ao.dtype) * w_new
    if rows is None:
        acc_out.copy_(merged)
        acc_lse.copy_(new)
    else:
        acc_out.index_copy_(0, rows, merged)
        acc_lse.index_copy_(1, rows, new)


def ring_forward(q, k, v, zz: ZigzagBlocks, comm, kernel: AttentionKernel, scale: float,
                 during_first_exchange: Optional[Callable[[], None]] = None):
    """Zigzag ring attention forward of the distributed part.

    Args:
        q: ``[Td, H, D]`` queries of the distributed part.
        k, v: ``[Td, Hkv, D]``.
        zz: Block structure (:func:`zigzag_blocks`).
        comm: Ring communicator (``rank``, ``size``, ``send_recv_async``, ``wait``).
        kernel: Block attention back-end.
        scale: Softmax scale.
        during_first_exchange: Called right after the first K/V exchange is posted (the
            local part's attention runs here, overlapping the transfer).

    Returns:
        ``(out [Td, H, D] in q.dtype, lse [H, Td] float32/float64)``.
    """
    rank, size = comm.rank, comm.size
    acc = lse_dtype(q.dtype)
    acc_out = torch.zeros(q.shape, dtype=acc, device=q.device)
    acc_lse = torch.full((q.shape[1], q.shape[0]), -torch.inf, dtype=acc, device=q.device)
    cur = torch.stack([k, v])  # one message per step: K and V of every shard together
    for step in range(size):
        nxt = comm.send_recv_async(cur, channel="fwd_kv") if step + 1 < size else None
        if step == 0 and during_first_exchange is not None:
            during_first_exchange()
        src = (rank - step) % size
        out, lse, rows = _fwd_block(kernel, q, cur[0], cur[1], src, rank, zz, scale)
        _merge(acc_out, acc_lse, out, lse, rows)
        if nxt is not None:
            comm.wait("fwd_kv")
            cur = nxt
    return acc_out.to(q.dtype), acc_lse


def _bwd_block(kernel, dout, q, k, v, out, lse, src, rank, zz, scale):
    """Returns ``(dq, q_rows, dk, dv, k_rows)``; rows None means all."""
    if src == rank:
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, zz.seg_full, zz.seg_full,
                                     causal=True, scale=scale)
        return dq, None, dk, dv, None
    if src < rank:
        kf, vf = k.index_select(0, zz.first), v.index_select(0, zz.first)
        dq, dk, dv = kernel.backward(dout, q, kf, vf, out, lse, zz.seg_full, zz.seg_half,
                                     causal=False, scale=scale)
        return dq, None, dk, dv, zz.first
    s = zz.second
    dq, dk, dv = kernel.backward(dout.index_select(0, s), q.index_select(0, s), k, v,
                                 out.index_select(0, s), lse.index_select(1, s),
                                 zz.seg_half, zz.seg_full, causal=False, scale=scale)
    return dq, s, dk, dv, None


def _add_rows(dst, src, rows):
    if rows is None:
        dst.add_(src.to(dst.dtype))
    else:
        dst.index_add_(0, rows, src.to(dst.dtype))


def ring_backward(dout, q, k, v, out, lse, zz: ZigzagBlocks, comm, kernel: AttentionKernel,
                  scale: float, during_first_exchange: Optional[Callable[[], None]] = None):
    """Zigzag ring attention backward of the distributed part.

    The gradients of this rank's own K/V from step 0 stay here; those of the K/V received
    at step ``s >= 1`` (owned by rank ``r - s``) go into an accumulator that travels on
    with that K/V: rank ``r`` starts it at step 1, adds to the one received from rank
    ``r - 1`` at later steps, and passes it to rank ``r + 1``, which holds the same K/V at
    the next step; the hop after the last step returns it to its owner.  That is ``N - 1``
    dK/dV messages per rank (one for ``N = 2``) besides the ``N - 1`` K/V messages.

    Args:
        dout: ``[Td, H, D]`` gradient of the output.
        q, k, v: Forward inputs of the distributed part.
        out, lse: Forward results (:func:`ring_forward`).
        zz, comm, kernel, scale: As in :func:`ring_forward`.
        during_first_exchange: Called right after the first K/V exchange is posted.

    Returns:
        ``(dq [Td, H, D], dk [Td, Hkv, D], dv [Td, Hkv, D])`` in the input dtype.
    """
    rank, size = comm.rank, comm.size
    acc = lse_dtype(q.dtype)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    own = torch.zeros((2,) + tuple(k.shape), dtype=acc, device=k.device)
    cur = torch.stack([k, v])
    dkv_in = None
    for step in range(size):
        nxt = comm.send_recv_async(cur, channel="bwd_kv") if step + 1 < size else None
        if step == 0 and during_first_exchange is not None:
            during_first_exchange()
        src = (rank - step) % size
        dq, q_rows, dk, dv, k_rows = _bwd_block(kernel, dout, q, cur[0], cur[1], out, lse,
                                                src, rank, zz, scale)
        _add_rows(dq_acc, dq, q_rows)
        if step == 0:
            dkv = own
        elif step == 1:  # first rank after the owner: a fresh accumulator
            dkv = torch.zeros((2,) + tuple(k.shape), dtype=acc, device=k.device)
        else:  # the accumulator of the K/V we now hold, from rank - 1
            comm.wait("bwd_dkv")
            dkv = dkv_in
        _add_rows(dkv[0], dk, k_rows)
        _add_rows(dkv[1], dv, k_rows)
        if step >= 1:
            dkv_in = comm.send_recv_async(dkv, channel="bwd_dkv")
        if nxt is not None:
            comm.wait("bwd_kv")
            cur = nxt
    if size > 1:
        comm.wait("bwd_dkv")  # our own K/V's gradients from the other ranks, home
        own += dkv_in
    return dq_acc.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)
