"""TEMPORARY stand-ins for ``skrull_ext.layout`` and ``skrull_ext.attention`` (not merged yet).

TEMPORARY -- DELETE WHEN THE ATTENTION BRANCH IS MERGED.  :mod:`megatron.skrull.model`
imports ``skrull_ext.attention.dacp_attention`` and ``skrull_ext.layout.build_rank_layout``
and falls back to this module only while those imports fail.

What is here is a *reference*, not the DACP kernel: :func:`dacp_attention` all-gathers K/V
(and each token's document and position) over the CP group and runs dense masked attention
(same document, causal by global position).  It is exact and differentiable (the backward of
the gather all-reduces the K/V gradients), so the CP equivalence tests already run against
it, but it is O(T * T_total) memory and has no communication overlap.

Layout convention (mirrors SKRULL.md section 5): a rank holds, in this order, its zigzag
shard of every distributed sample (padded to a multiple of ``2 * cp_size``, split into
``2 * cp_size`` chunks, rank ``r`` holds chunks ``r`` and ``2 cp_size - 1 - r``) and then its
local samples whole.  Position ids restart at 0 per sample; shards keep global positions.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from skrull_ext.plan import padded_length

__all__ = ["RankLayout", "build_rank_layout", "dacp_attention"]


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """TEMPORARY: the packed token stream of one CP rank for one micro-batch.

    Attributes:
        cp_rank: This rank's index in the CP group.
        cp_size: CP group size.
        distributed: Global-batch indices of the zigzag-sharded samples.
        local: Global-batch indices of the samples this rank holds whole.
        segments: ``(sample, start, stop, offset)``: tokens ``[start, stop)`` of ``sample``
            (padding included past its length) sit at packed offset ``offset``.
        sample_ids: ``[T]`` int64 numpy, the sample of every packed token.
        position_ids: ``[T]`` int64, position of every token inside its sample.
        is_padding: ``[T]`` bool, True for zigzag padding tokens.
    """

    cp_rank: int
    cp_size: int
    distributed: tuple[int, ...]
    local: tuple[int, ...]
    segments: tuple[tuple[int, int, int, int], ...]
    sample_ids: np.ndarray
    position_ids: torch.Tensor
    is_padding: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.position_ids.numel())

    def pack(self, per_sample: Mapping[int, torch.Tensor], pad_value=0) -> torch.Tensor:
        """Packs per-sample tensors into this rank's stream.

        Args:
            per_sample: ``sample -> [S_i, ...]`` for every sample this rank holds (the
                distributed ones and its local ones); trailing dims must agree.
            pad_value: Fill of zigzag padding positions.

        Returns:
            ``[T, ...]`` tensor in packed order.
        """
        first = next(iter(per_sample.values()))
        out = torch.full((self.num_tokens, *first.shape[1:]), pad_value, dtype=first.dtype)
        for sample, start, stop, offset in self.segments:
            src = per_sample[sample]
            real = max(0, min(stop, src.shape[0]) - start)
            out[offset:offset + real] = src[start:start + real]
        return out


def build_rank_layout(lengths: Sequence[int], distributed: Sequence[int],
                      local: Sequence[Sequence[int]], cp_rank: int, cp_size: int) -> RankLayout:
    """TEMPORARY: layout of CP rank ``cp_rank`` for one micro-batch.

    Args:
        lengths: Token lengths of the whole global batch (indexed by sample).
        distributed: Samples sharded over all CP ranks (``MicroBatch.distributed``).
        local: ``cp_size`` lists of samples held whole (``MicroBatch.local``).
        cp_rank: This rank.
        cp_size: CP group size.
    """
    segments, offset = [], 0
    for s in distributed:
        chunk = padded_length(int(lengths[s]), cp_size) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank) if cp_size > 1 else (0,):
            size = chunk if cp_size > 1 else int(lengths[s])
            segments.append((int(s), c * size, (c + 1) * size, offset))
            offset += size
    for s in local[cp_rank]:
        segments.append((int(s), 0, int(lengths[s]), offset))
        offset += int(lengths[s])
    sample_ids = np.empty(offset, dtype=np.int64)
    positions = torch.empty(offset, dtype=torch.long)
    padding = torch.zeros(offset, dtype=torch.bool)
    for s, start, stop, off in segments:
        sample_ids[off:off + stop - start] = s
        positions[off:off + stop - start] = torch.arange(start, stop)
        padding[off:off + stop - start] = positions[off:off + stop - start] >= int(lengths[s])
    return RankLayout(cp_rank=cp_rank, cp_size=cp_size, distributed=tuple(map(int, distributed)),
                      local=tuple(map(int, local[cp_rank])), segments=tuple(segments),
                      sample_ids=sample_ids, position_ids=positions, is_padding=padding)


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 with unequal sizes; backward all-reduces and slices."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, sizes: tuple[int, ...]):
        rank = dist.get_rank(group)
        most = max(sizes)
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        ctx.group, ctx.sizes, ctx.rank = group, sizes, rank
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start:start + ctx.sizes[ctx.rank]], None, None


def _gather_meta(layout: RankLayout, group, device) -> tuple[tuple[int, ...], torch.Tensor]:
    n = dist.get_world_size(group)
    count = torch.tensor([layout.num_tokens], dtype=torch.long)
    counts = [torch.zeros_like(count) for _ in range(n)]
    dist.all_gather(counts, count, group=group)
    sizes = tuple(int(c) for c in counts)
    meta = torch.stack([torch.as_tensor(layout.sample_ids), layout.position_ids], dim=1)
    return sizes, _GatherTokens.apply(meta, group, sizes).to(device)


def dacp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RankLayout,
                   cp_group: Optional[dist.ProcessGroup], *, softmax_scale: Optional[float] = None,
                   backend: str = "auto") -> torch.Tensor:
    """TEMPORARY dense reference of DACP attention (per-document causal, global positions).

    Args:
        q: ``[T, heads, head_dim]`` queries of this rank's packed tokens.
        k: ``[T, kv_heads, head_dim]`` keys (``heads`` divisible by ``kv_heads``).
        v: ``[T, kv_heads, head_dim]`` values.
        layout: This rank's :class:`RankLayout`.
        cp_group: CP process group (``None`` or size 1: no communication).
        softmax_scale: Defaults to ``1 / sqrt(head_dim)``.
        backend: Ignored (signature parity with the real kernel).

    Returns:
        ``[T, heads, head_dim]`` attention output.
    """
    del backend
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q_meta = torch.stack([torch.as_tensor(layout.sample_ids), layout.position_ids], 1).to(q.device)
    distributed = cp_group is not None and dist.get_world_size(cp_group) > 1 and layout.distributed
    if distributed:
        sizes, k_meta = _gather_meta(layout, cp_group, q.device)
        k = _GatherTokens.apply(k, cp_group, sizes)
        v = _GatherTokens.apply(v, cp_group, sizes)
    else:
        k_meta = q_meta
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    allowed = (q_meta[:, None, 0] == k_meta[None, :, 0]) & (k_meta[None, :, 1] <= q_meta[:, None, 1])
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    # Softmax in at least float32 (bf16 inputs), in float64 for float64 inputs.
    probs = torch.softmax(scores.to(torch.promote_types(q.dtype, torch.float32)), dim=-1)
    probs = probs.to(q.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)
