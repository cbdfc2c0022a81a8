"""Per-micro-batch attention metadata on the device, built once and shared by all layers.

Every layer's forward and backward of a micro-batch attend the same layout, so the
segment offsets (``cu_seqlens``), their maxima (``max_seqlen``) and the zigzag index
tensors are built from the host-side :class:`~skrull_ext.attention.layout.RankLayout` once per
layout and device and cached with the layout: by the training loop with the micro-batch's
inputs in one non-blocking copy (:func:`stage_layout`), else on first use.  Nothing in
the per-layer code builds a tensor from a Python list or reads a value back from the
device (``tests/test_attention_fakes.py`` counts such calls; ``tests/test_host_syncs.py``
checks a whole training step).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
import torch

from skrull_ext.attention.kernels import Segments, segments
from skrull_ext.attention.layout import on_device, remember
from skrull_ext.attention.ring import ZigzagBlocks, blocks_of
from skrull_ext.attention.staging import stage


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
    """:class:`LayoutMeta` of ``layout`` on ``device`` (built on first use, then cached;
    the training loop stages it with the micro-batch: :func:`stage_layout`)."""
    return on_device(layout, device, "meta", build_meta)


def stage_layout(layout, device, host: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Moves ``layout``'s :class:`LayoutMeta`, its position ids and the micro-batch's
    ``host`` tensors to ``device`` in one non-blocking copy
    (:func:`~skrull_ext.attention.staging.stage`) and caches the first two with the
    layout, where :func:`layout_meta` and ``on_device(layout, device, "position_ids")``
    find them.

    Args:
        layout: This rank's :class:`~skrull_ext.attention.layout.RankLayout`.
        device: Where the micro-batch runs.
        host: CPU tensors of the micro-batch (token ids, labels, ...).

    Returns:
        ``host`` on ``device``, in order.
    """
    def build(move):
        return (build_meta(layout, device, move), move(layout.position_ids),
                [move(t) for t in host])

    meta, positions, out = stage(build, device)
    remember(layout, device, "meta", meta)
    remember(layout, device, "position_ids", positions)
    return out


def staged_positions(layout, device) -> torch.Tensor:
    """``[T]`` int64 position of each token inside its sample, on ``device``: the copy
    :func:`stage_layout` staged (else moved on first use), the one tensor that feeds both
    RoPE and the model's ``position_ids``."""
    return on_device(layout, device, "position_ids", lambda lay, dev: lay.position_ids.to(dev))


def build_meta(layout, device, move=None) -> LayoutMeta:
    """:class:`LayoutMeta` of ``layout`` (``move`` as in
    :func:`~skrull_ext.attention.kernels.segments`)."""
    move = move or (lambda t: t.to(device))
    use_ring = layout.cp_size > 1 and layout.num_distributed_tokens > 0
    cu = tuple(layout.local_cu_seqlens)
    stop = layout.num_local_tokens + layout.num_distributed_tokens
    groups = tuple(GroupMeta(first_rank=g.first_rank, size=g.size, start=g.offset,
                             stop=g.offset + g.num_tokens,
                             zigzag=blocks_of(g.docs, g.cu_seqlens, device, move))
                   for g in layout.groups)
    if not use_ring:  # distributed shards are whole sequences (or there are none)
        nl = layout.num_local_tokens
        cu = cu + tuple(nl + x for x in layout.dist_cu_seqlens[1:])
        return LayoutMeta(use_ring=False, num_causal=cu[-1], causal=segments(cu, device, move),
                          zigzag=None, distributed=None, ring_stop=cu[-1], groups=groups)
    real = np.array([0] + [d.length for d in layout.distributed], dtype=np.int64)
    padded = np.array([0] + [d.padded_length for d in layout.distributed], dtype=np.int64)
    dist = DistributedMeta(
        cu_seqlens=move(torch.from_numpy(np.cumsum(real).astype(np.int32))),
        cu_seqlens_padded=move(torch.from_numpy(np.cumsum(padded).astype(np.int32))),
        max_seqlen=int(padded.max()), pad_between_seqs=bool((real != padded).any()),
        padding_rows=move(layout.is_padding[cu[-1]:stop])[:, None, None])
    return LayoutMeta(use_ring=True, num_causal=cu[-1], causal=segments(cu, device, move),
                      zigzag=blocks_of(layout.distributed, layout.dist_cu_seqlens, device,
                                       move),
                      distributed=dist, ring_stop=stop, groups=groups)
