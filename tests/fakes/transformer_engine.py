"""Fake ``transformer_engine`` with ``pytorch.DotProductAttention`` (THD + context parallel).

Faithful to TE 1.13-2.12 (``dot_product_attention.py``, ``context_parallel.py``) where the
DACP back-end relies on it:

* constructor keywords (``num_attention_heads``, ``kv_channels``, ``num_gqa_groups``,
  ``attention_dropout``, ``qkv_format``, ``attn_mask_type``, ``cp_*``, ``softmax_scale``);
  ``set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)`` only
  stores the four; CP is on when the group has more than one rank;
* ``forward(query_layer, key_layer, value_layer, ..., qkv_format, cu_seqlens_q,
  cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv,
  attn_mask_type, ..., pad_between_seqs)`` (``pad_between_seqs`` from TE 2.2), returning
  ``[T, H * D]``; THD needs 3-D inputs, a ``padding*`` mask type and int32 ``cu_seqlens``;
  without ``max_seqlen_*`` / ``pad_between_seqs`` TE reads them back from the device
  (recorded here as ``host_sync``);
* THD + CP: ``cp_comm_type`` ``"p2p"``; ``cu_seqlens_*`` are the GLOBAL real offsets and
  ``cu_seqlens_*_padded`` the GLOBAL padded ones (mandatory, multiples of ``2 * cp``); rank
  ``r`` holds chunks ``r`` and ``2cp-1-r`` of every sequence (DualChunkSwap); real tokens
  per chunk follow from the real lengths (padding at the end of a sequence).

Liberties: K/V are all-gathered (autograd-aware) instead of passed around a ring; the
"P2P post" is recorded when the gather starts; padding rows of the output are NaN (TE
promises nothing there), so callers must not let them reach the loss.
"""
from __future__ import annotations

import math
import types

import torch
import torch.distributed as dist


def _stream_name(device) -> str:
    from skrull_ext.attention import streams

    cuda = streams.api(device)
    return "none" if cuda is None else cuda.current(device).name


class _Gather(torch.autograd.Function):
    """All-gather over the CP group; backward sums the gradients and keeps our part."""

    @staticmethod
    def forward(ctx, x, group, log):
        ctx.group, ctx.log = group, log
        log.append(("te_post", "fwd"))
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("te_post", "bwd"))
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(world)[rank], None, None


def _token_positions(padded: list, cp: int, rank: int):
    """``(sequence id, position in sequence)`` of every token a rank holds."""
    seq, pos = [], []
    for i, (a, b) in enumerate(zip(padded, padded[1:])):
        if cp == 1:
            chunks = [range(b - a)]
        else:
            c = (b - a) // (2 * cp)
            chunks = [range(rank * c, rank * c + c),
                      range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
        for ch in chunks:
            seq += [i] * len(ch)
            pos += list(ch)
    return torch.tensor(seq), torch.tensor(pos)


def _attention(q, k, v, q_seq, q_pos, k_seq, k_pos, real_len, scale):
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * scale
    allowed = (q_seq[:, None] == k_seq[None]) & (k_pos[None] <= q_pos[:, None]) & (
        k_pos[None] < real_len[k_seq][None])
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1)
    out = torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(group, 1))
    pad = (q_pos >= real_len[q_seq])[:, None, None]
    return torch.where(pad, torch.full_like(out, math.nan), out)


class _DotProductAttention(torch.nn.Module):
    """State and computation; the public ``forward`` signatures are defined per version."""

    LOG: list = []

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None,
                 attention_dropout=0.0, qkv_format="sbhd", attn_mask_type="causal",
                 window_size=None, sequence_parallel=False, tp_size=1,
                 get_rng_state_tracker=None, tp_group=None, layer_number=None,
                 attention_type="self", cp_group=None, cp_global_ranks=None, cp_stream=None,
                 cp_comm_type="p2p", softmax_scale=None):
        super().__init__()
        assert attention_dropout == 0.0
        self.heads, self.head_dim = num_attention_heads, kv_channels
        self.gqa = num_gqa_groups or num_attention_heads
        self.qkv_format, self.attn_mask_type = qkv_format, attn_mask_type
        self.softmax_scale = softmax_scale or kv_channels ** -0.5
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type,
                                        _log=False)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type="p2p", _log=True):
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type
        if _log:
            self.LOG.append(("te_set_cp_group", getattr(cp_stream, "name", cp_stream),
                             cp_comm_type, tuple(cp_global_ranks)))

    def _run(self, q, k, v, qkv_format, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
             cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv, attn_mask_type,
             pad_between_seqs):
        fmt, mask = qkv_format or self.qkv_format, attn_mask_type or self.attn_mask_type
        assert fmt == "thd" and all(t.dim() == 3 for t in (q, k, v))
        assert "padding" in mask, "THD needs a padding or padding_causal mask"
        assert q.shape[1] == self.heads and k.shape[1] == self.gqa and q.shape[2] == self.head_dim
        for cu in (cu_seqlens_q, cu_seqlens_kv):
            assert cu is not None and cu.dtype == torch.int32 and cu.dim() == 1
        if max_seqlen_q is None or max_seqlen_kv is None or pad_between_seqs is None:
            self.LOG.append(("host_sync", "max_seqlen/pad_between_seqs left to TE"))
        cp = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        real = cu_seqlens_q.tolist()
        padded = cu_seqlens_q_padded.tolist() if cu_seqlens_q_padded is not None else real
        if cp > 1:
            assert self.cp_comm_type == "p2p", "THD + CP is p2p-only on TE 1.13-2.9"
            assert self.cp_stream is not None or _stream_name(q.device) == "none", \
                "CP on CUDA needs a cp_stream"
            assert cu_seqlens_q_padded is not None and cu_seqlens_kv_padded is not None, \
                "THD + CP needs cu_seqlens_*_padded"
            assert all((b - a) % (2 * cp) == 0 for a, b in zip(padded, padded[1:]))
            assert max_seqlen_q is None or max_seqlen_q >= max(
                b - a for a, b in zip(padded, padded[1:])), "max_seqlen is the GLOBAL padded one"
        assert q.shape[0] == padded[-1] // cp, f"{q.shape[0]} tokens, expected {padded[-1] // cp}"
        self.LOG.append(("te_forward", "cp" if cp > 1 else "local", _stream_name(q.device)))
        real_len = torch.tensor([b - a for a, b in zip(real, real[1:])])
        rank = 0 if cp == 1 else dist.get_rank(self.cp_group)
        q_seq, q_pos = _token_positions(padded, cp, rank)
        if cp > 1:
            k, v = (_Gather.apply(t, self.cp_group, self.LOG) for t in (k, v))
            ks = [_token_positions(padded, cp, r) for r in range(cp)]
            k_seq, k_pos = torch.cat([s for s, _ in ks]), torch.cat([p for _, p in ks])
        else:
            k_seq, k_pos = q_seq, q_pos
        out = _attention(q, k, v, q_seq, q_pos, k_seq, k_pos, real_len, self.softmax_scale)
        return out.reshape(q.shape[0], -1)


class DotProductAttention22(_DotProductAttention):
    """TE >= 2.2: ``forward`` takes ``pad_between_seqs``."""

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None,
                attn_mask_type=None, window_size=None, checkpoint_core_attention=False,
                core_attention_bias_type="no_bias", core_attention_bias=None,
                alibi_slopes=None, fast_zero_fill=True, inference_params=None,
                pad_between_seqs=None, fp8_output=False):
        return self._run(query_layer, key_layer, value_layer, qkv_format, cu_seqlens_q,
                         cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                         max_seqlen_q, max_seqlen_kv, attn_mask_type, pad_between_seqs)


class DotProductAttention113(_DotProductAttention):
    """TE 1.13-2.1: no ``pad_between_seqs`` (TE compares the offsets itself)."""

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None,
                attn_mask_type=None, window_size=None, checkpoint_core_attention=False,
                core_attention_bias_type="no_bias", core_attention_bias=None,
                alibi_slopes=None, fast_zero_fill=True, inference_params=None):
        return self._run(query_layer, key_layer, value_layer, qkv_format, cu_seqlens_q,
                         cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                         max_seqlen_q, max_seqlen_kv, attn_mask_type, None)


def modules(version: str, log: list) -> dict:
    """``transformer_engine`` and ``transformer_engine.pytorch`` of ``version``, logging
    constructor-independent events (forward calls, streams, P2P posts) into ``log``."""
    major_minor = tuple(int(x) for x in version.split(".")[:2])
    base = DotProductAttention22 if major_minor >= (2, 2) else DotProductAttention113
    cls = type("DotProductAttention", (base,), {"LOG": log})
    pt = types.ModuleType("transformer_engine.pytorch")
    pt.DotProductAttention = cls
    pkg = types.ModuleType("transformer_engine")
    pkg.__version__, pkg.__path__, pkg.pytorch = version, [], pt
    return {"transformer_engine": pkg, "transformer_engine.pytorch": pt}
