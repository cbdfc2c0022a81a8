"""Transformer Engine back-end: TE's context-parallel ring for the distributed sequences.

Design choice (docs/attention.md, "Transformer Engine"): the distributed part goes to
``DotProductAttention`` in THD format with ``attn_mask_type="padding_causal"`` and
``cp_comm_type="p2p"`` (the one THD-capable CP mode on TE 1.13-2.9), its group set once
with ``set_context_parallel_group(cp_group, ranks, cp_stream, "p2p")``.  TE wants the
GLOBAL real ``cu_seqlens`` and padded ``cu_seqlens_*_padded`` and, on every rank, chunks
``r`` and ``2N-1-r`` of each sequence padded to a multiple of ``2N``: exactly our zigzag
shard order, so the layout's distributed part is passed as it is.  The local sequences go
to a second instance without CP on our side stream (distinct from TE's ``cp_stream``).

TE's public API gives no block-level LSE, so our own ring cannot merge TE blocks without
its internal functions (whose argument lists change between releases); TE's ring is used
whole instead.  Nothing here checks the device or dtype (TE does); the cuDNN fused
back-end is what TE runs for THD with padding between sequences.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from skrull_ext.attention.streams import named_stream

_INSTALL = ("pip install --no-build-isolation 'transformer-engine[pytorch]>=2.6,<2.13' "
            "(see the README's version table)")


class TEBackend:
    """Transformer Engine ``DotProductAttention`` instances, created once per shape.

    Attributes:
        owns_ring: True: ``dacp_attention`` hands it the whole distributed part (TE runs
            the ring), instead of calling it per ring block like an ``AttentionKernel``.
        version: ``transformer_engine.__version__``.

    Raises:
        RuntimeError: Transformer Engine does not import.
    """

    name = "te"
    owns_ring = True

    def __init__(self):
        try:
            import transformer_engine
            from transformer_engine.pytorch import DotProductAttention
        except Exception as exc:  # ImportError, or a build that fails to load its library
            raise RuntimeError(f"the te kernel needs Transformer Engine: {_INSTALL} "
                               f"({type(exc).__name__}: {exc})") from exc
        self.version = str(getattr(transformer_engine, "__version__", "?"))
        self._cls = DotProductAttention
        # pad_between_seqs exists from TE 2.2; without it TE compares offsets on the host.
        self._fwd_params = frozenset(inspect.signature(DotProductAttention.forward).parameters)
        self._modules: dict = {}

    def _module(self, q, k, scale: float, cp_group):
        key = (q.shape[1], k.shape[1], q.shape[2], float(scale), str(q.device),
               None if cp_group is None else id(cp_group))
        if key not in self._modules:
            mod = self._cls(num_attention_heads=q.shape[1], kv_channels=q.shape[2],
                            num_gqa_groups=k.shape[1], attention_dropout=0.0, qkv_format="thd",
                            attn_mask_type="padding_causal", softmax_scale=scale)
            if cp_group is not None:
                mod.set_context_parallel_group(cp_group, dist.get_process_group_ranks(cp_group),
                                               named_stream(q.device, "te_cp"), "p2p")
            self._modules[key] = (mod, cp_group)  # the group is kept alive with its id
        return self._modules[key][0]

    def _call(self, mod, q, k, v, cu, cu_padded, max_seqlen: int, pad: bool):
        kw = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                  cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                  max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
                  attn_mask_type="padding_causal")
        if "pad_between_seqs" in self._fwd_params:
            kw["pad_between_seqs"] = pad
        out = mod(q, k, v, **kw)  # [T, H * D]
        return out.view(q.shape[0], q.shape[1], q.shape[2])

    def distributed(self, q, k, v, dmeta, cp_group, scale: float) -> torch.Tensor:
        """TE's ring attention of the distributed part (autograd through TE).

        Args:
            q: ``[Td, H, D]`` this rank's zigzag shards, in the layout's order.
            k, v: ``[Td, Hkv, D]``.
            dmeta: :class:`~skrull_ext.attention.meta.DistributedMeta` (global offsets).
            cp_group: The CP process group (>= 2 ranks).
            scale: Softmax scale.

        Returns:
            ``[Td, H, D]``, zero on padding rows.
        """
        mod = self._module(q, k, scale, cp_group)
        out = self._call(mod, q, k, v, dmeta.cu_seqlens, dmeta.cu_seqlens_padded,
                         dmeta.max_seqlen, dmeta.pad_between_seqs)
        return out.masked_fill(dmeta.padding_rows, 0.0)

    def local(self, q, k, v, seg, scale: float) -> torch.Tensor:
        """Per-document causal attention without communication (autograd through TE).

        Args:
            q: ``[Tl, H, D]`` whole sequences; k, v: ``[Tl, Hkv, D]``.
            seg: Their :class:`~skrull_ext.attention.kernels.Segments`.
            scale: Softmax scale.

        Returns:
            ``[Tl, H, D]``.
        """
        mod = self._module(q, k, scale, None)
        return self._call(mod, q, k, v, seg.cu_dev, seg.cu_dev, seg.max_len, False)
