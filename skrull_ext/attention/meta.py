"""Per-micro-batch attention metadata on the device, built once and shared by all layers.

Every layer's forward and backward of a micro-batch attend the same layout, so the
segment offsets (``cu_seqlens``), their maxima (``max_seqlen``) and the zigzag index
tensors are built from the host-side :class:`~skrull_ext.attention.layout.RankLayout` once per
layout and device (one host-to-device copy each) and cached with the layout.  Nothing in
the per-layer code builds a tensor from a Python list or reads a value back from the
device (``tests/test_attention_fakes.py`` counts such calls).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from skrull_ext.attention.kernels import Segments, segments
from skrull_ext.attention.layout import on_device
from skrull_ext.attention.ring import ZigzagBlocks, blocks_of, zigzag_blocks


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class DistributedMeta:
    """What Transformer Engine's THD context-parallel attention needs (all GLOBAL).

    Attributes:
        cu_seqlens: ``[n + 1]`` int32 cumsum of the real lengths of the distributed
            sequences (TE derives each rank's real tokens per chunk from it).
        cu_seqlens_padded: ``[n + 1]`` int32 cumsum of their padded lengths (multiples
            of ``2 N``; TE divides by ``N`` for this rank's offsets).
        max_seqlen: Longest padded length.
        pad_between_seqs: Whether some sequence is padded (passing it spares TE a
            device-to-host comparison per call).
        padding_rows: ``[Td, 1, 1]`` bool, True on this rank's padding tokens (TE makes
            no promise about their output; they are zeroed so no NaN reaches the loss).
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    pad_between_seqs: bool
    padding_rows: torch.Tensor


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class GroupMeta:
    """One CP sub-group's ring (hybrid-CP grouped sequences) on this rank.

    Attributes:
        first_rank: First CP rank of the sub-group.
        size: Its ranks ``n``; this rank is ``cp_rank - first_rank`` in its ring.
        start: Stream offset of the part; stop: its end.
        zigzag: Ring blocks of the part (its own ``n``-rank zigzag shards).
    """

    first_rank: int
    size: int
    start: int
    stop: int
    zigzag: ZigzagBlocks


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class LayoutMeta:
    """Device metadata of one rank's layout.

    Attributes:
        use_ring: Distributed sequences are sharded over a CP group of >= 2 ranks (so a
            ring runs); False when ``cp_size == 1`` or nothing is distributed.
        num_causal: Tokens attended without communication: the local part, or every
            token when there is no ring (distributed sequences then held whole).
        causal: Their per-document :class:`Segments`.
        zigzag: Ring blocks of the distributed part (None without a ring).
        distributed: Global metadata for Transformer Engine's ring (None without one).
        ring_stop: End of the distributed part in the stream (the full ring attends
            ``[num_causal, ring_stop)``; equals ``num_causal`` without a ring).
        groups: :class:`GroupMeta` per CP sub-group of this rank, in the layout's
            order (the same order on every rank); their parts follow ``ring_stop``.
    """

    use_ring: bool
    num_causal: int
    causal: Segments
    zigzag: Optional[ZigzagBlocks]
    distributed: Optional[DistributedMeta]
    ring_stop: int
    groups: tuple[GroupMeta, ...] = ()


def layout_meta(layout, device) -> LayoutMeta:
    """:class:`LayoutMeta` of ``layout`` on ``device`` (built on first use, then cached)."""
    return on_device(layout, device, "meta", _build)


def _build(layout, device) -> LayoutMeta:
    use_ring = layout.cp_size > 1 and layout.num_distributed_tokens > 0
    cu = tuple(layout.local_cu_seqlens)
    stop = layout.num_local_tokens + layout.num_distributed_tokens
    groups = tuple(GroupMeta(first_rank=g.first_rank, size=g.size, start=g.offset,
                             stop=g.offset + g.num_tokens,
                             zigzag=blocks_of(g.docs, g.cu_seqlens, device))
                   for g in layout.groups)
    if not use_ring:  # distributed shards are whole sequences (or there are none)
        nl = layout.num_local_tokens
        cu = cu + tuple(nl + x for x in layout.dist_cu_seqlens[1:])
        return LayoutMeta(use_ring=False, num_causal=cu[-1], causal=segments(cu, device),
                          zigzag=None, distributed=None, ring_stop=cu[-1], groups=groups)
    real = np.array([0] + [d.length for d in layout.distributed], dtype=np.int64)
    padded = np.array([0] + [d.padded_length for d in layout.distributed], dtype=np.int64)
    dist = DistributedMeta(
        cu_seqlens=torch.from_numpy(np.cumsum(real).astype(np.int32)).to(device),
        cu_seqlens_padded=torch.from_numpy(np.cumsum(padded).astype(np.int32)).to(device),
        max_seqlen=int(padded.max()), pad_between_seqs=bool((real != padded).any()),
        padding_rows=layout.is_padding[cu[-1]:stop].to(device)[:, None, None])
    return LayoutMeta(use_ring=True, num_causal=cu[-1], causal=segments(cu, device),
                      zigzag=zigzag_blocks(layout, device), distributed=dist,
                      ring_stop=stop, groups=groups)
