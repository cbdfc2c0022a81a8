"""PyTorch's own varlen attention kernels on CUDA behind :class:`AttentionKernel`.

Every CUDA build of PyTorch ships FlashAttention-2 varlen kernels as private ATen ops
(``aten._flash_attention_forward`` / ``_backward``).  They return a block's log-sum-exp and
take a given (merged) ``out``/``lse`` in their backward: exactly what the ring needs, with
nothing to install.  ``--skrull-attention-kernel torch`` runs them on CUDA (ATen's CPU flash
attention on CPU, :class:`~skrull_ext.attention.kernels.CpuFlashKernel`).  PyTorch's cuDNN
varlen attention is not offered: on an H200 it was 2.6-22x slower for these shapes and its
backward gave NaN gradients through this adapter (docs/gpu.md).

Their schemas differ between releases (read from the sources; ``torch/nn/attention/varlen.py``
of 2.10+ calls them this way):

* the flash forward takes ``(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
  dropout_p, is_causal, return_debug_mask, *, scale, ...)``; later releases add keyword-only
  ``window_size_left/right``, ``seqused_k``, ``alibi_slopes``, ``block_table``, ``num_splits``;
* the flash backward's random-state arguments are ``philox_seed, philox_offset`` in earlier
  releases and ``rng_state, unused`` later (same positions).

So :class:`OpCall` reads an op's schema once, fills arguments by *name*, fails at
construction naming any required argument it cannot fill, and picks outputs by their
return names.  The varlen LSE comes in two layouts, normalised to ours (``[H, total_q]``
float32): ``[H, total_q]`` (CUDA flash) and ``[B, H, max_q]`` (padded: ROCm builds,
flash-attn before 2.6); the backward gets the layout its forward returned.  Only fp16/bf16
and Ampere or newer, like the kernels themselves; tests drive the adapter with fakes of the
ops (``tests/fakes/aten.py``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from skrull_ext.attention.kernels import AttentionKernel, _check_block, as_segments, empty_block

FLASH_OPS = ("_flash_attention_forward", "_flash_attention_backward")
#: Argument names the adapter fills (every name any supported schema uses).
FILLED = frozenset({
    "query", "key", "value", "grad_out", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
    "max_q", "max_k", "dropout_p", "is_causal", "return_debug_mask", "scale", "rng_state",
    "unused", "philox_seed", "philox_offset"})


class OpCall:
    """One ATen op called by argument name, its schema read once.

    Args:
        ops: The op namespace (``torch.ops.aten``, or a fake of it).
        name: Op name, e.g. ``"_flash_attention_forward"``.

    Raises:
        RuntimeError: The op is missing, or requires an argument outside :data:`FILLED`,
            or has no ``scale`` (torch too old for a custom softmax scale).
    """

    def __init__(self, ops, name: str):
        packet = getattr(ops, name, None)
        if packet is None:
            raise RuntimeError(f"torch {torch.__version__} has no aten.{name}")
        schema = packet.default._schema
        self.op, self.name = packet, name
        self.positional = tuple(a.name for a in schema.arguments if not a.kwarg_only)
        self.names = frozenset(a.name for a in schema.arguments)
        self.returns = tuple(r.name for r in schema.returns)
        unknown = sorted(a.name for a in schema.arguments
                         if not a.has_default_value() and a.name not in FILLED)
        if unknown or "scale" not in self.names:
            what = f"requires {unknown}" if unknown else "takes no scale"
            raise RuntimeError(f"torch {torch.__version__}: aten.{name} {what}, which this "
                               "adapter does not fill; use --skrull-attention-kernel flash or te")

    def __call__(self, values: dict):
        """Calls the op with the entries of ``values`` its schema names (others ignored)."""
        args = []
        for n in self.positional:  # positionally while we have them, then by keyword
            if n not in values:
                break
            args.append(values[n])
        kwargs = {n: v for n, v in values.items() if n in self.names and n not in
                  self.positional[:len(args)]}
        return self.op(*args, **kwargs)

    def output(self, result, names: tuple, default: int):
        """The first of ``names`` among the op's returns, else position ``default``."""
        for n in names:
            if n in self.returns:
                return result[self.returns.index(n)]
        return result[default]


def flash_op_problem(device: torch.device) -> Optional[str]:
    """Why PyTorch's FlashAttention-2 op cannot run on ``device`` (None when it can)."""
    if device.type != "cuda":
        return f"PyTorch's FlashAttention-2 varlen op runs on CUDA, not {device.type}"
    if not hasattr(torch.ops.aten, FLASH_OPS[0]):
        return f"torch {torch.__version__} has no aten.{FLASH_OPS[0]}"
    built = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    if built is not None and not built():
        return f"torch {torch.__version__} was built without FlashAttention"
    if torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] < 8:
        return "PyTorch's FlashAttention-2 needs an Ampere or newer GPU (sm80+)"
    return None



def _lse_to_ours(lse, cu_q, heads: int):
    """``(lse [H, Tq] float32, layout)`` of a varlen LSE in either layout."""
    tq = cu_q.total
    if lse.dim() == 2 and tuple(lse.shape) == (heads, tq):
        return lse, "ht"
    if lse.dim() == 3 and tuple(lse.shape[:2]) == (len(cu_q.cu) - 1, heads):  # padded
        seg, pos = _token_coords(cu_q, lse.device)
        return lse[seg, :, pos].transpose(0, 1), "bhm"
    raise RuntimeError(f"unexpected varlen LSE shape {tuple(lse.shape)} for {tq} queries and "
                       f"{heads} heads")


def _lse_to_op(lse, layout: str, cu_q):
    """Inverse of :func:`_lse_to_ours` for the backward (the layout its forward returned)."""
    if layout == "ht":
        return lse.contiguous()
    seg, pos = _token_coords(cu_q, lse.device)
    padded = lse.new_zeros((len(cu_q.cu) - 1, lse.shape[0], max(cu_q.max_len, 1)))
    padded[seg, :, pos] = lse.transpose(0, 1)
    return padded


def _token_coords(cu_q, device):
    """Per query token its segment and position in it (device ops only, no host sync)."""
    cu = cu_q.cu_dev.to(device=device, dtype=torch.int64)
    tok = torch.arange(cu_q.total, device=device, dtype=torch.int64)
    seg = torch.searchsorted(cu[1:], tok, right=True)
    return seg, tok - cu[seg]


class TorchVarlenKernel(AttentionKernel):
    """PyTorch's bundled FlashAttention-2 varlen kernels (``aten._flash_attention_*``).

    Args:
        ops: ATen op namespace (default ``torch.ops.aten``; tests pass a fake).
    """

    name = "torch"

    def __init__(self, ops=None):
        ops = torch.ops.aten if ops is None else ops
        self._fwd, self._bwd = (OpCall(ops, n) for n in FLASH_OPS)
        self._layout = "ht"  # learned from the forward's LSE
        self._dummies: dict = {}

    @staticmethod
    def _expand(cu_q) -> bool:
        """Whether to run GQA with K/V expanded to every query head.

        With max_q == 1 and GQA the forward regroups q as [B, group, Hkv, D], which needs
        exactly one query per segment; an empty segment breaks that reshape.
        """
        return cu_q.max_len <= 1 and len(cu_q.cu) - 1 != cu_q.total

    def forward(self, q, k, v, cu_q, cu_k, *, causal, scale):
        _check_block(q, k, v, cu_q, cu_k, causal)
        if q.shape[0] == 0 or k.shape[0] == 0:
            return empty_block(q)
        cu_q, cu_k = as_segments(cu_q, q.device), as_segments(cu_k, q.device)
        group = q.shape[1] // k.shape[1]
        if group > 1 and self._expand(cu_q):
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        res = self._fwd(dict(self._common(q, k, v, cu_q, cu_k, causal, scale),
                             return_debug_mask=False))
        out = self._fwd.output(res, ("output",), 0)
        lse, self._layout = _lse_to_ours(self._fwd.output(
            res, ("softmax_logsumexp", "logsumexp"), 1), cu_q, q.shape[1])
        if causal or not cu_k.has_empty:  # every query has a key (known on the host)
            return out, lse
        # FlashAttention writes +inf for queries with no key; the merge wants -inf.
        return out, lse.masked_fill(lse == math.inf, -math.inf)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, *, causal, scale):
        _check_block(q, k, v, cu_q, cu_k, causal)
        if q.shape[0] == 0 or k.shape[0] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        cu_q, cu_k = as_segments(cu_q, q.device), as_segments(cu_k, q.device)
        hk, group = k.shape[1], q.shape[1] // k.shape[1]
        expand = group > 1 and self._expand(cu_q)
        if expand:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        values = self._common(q, k, v, cu_q, cu_k, causal, scale)
        values.update(self._random_state(q.device), grad_out=dout.contiguous(),
                      out=out.contiguous(), logsumexp=_lse_to_op(lse, self._layout, cu_q))
        dq, dk, dv = self._bwd(values)[:3]
        if expand:  # GQA: each KV head's gradient is the sum over its query group
            dk = dk.unflatten(1, (hk, group)).sum(2)
            dv = dv.unflatten(1, (hk, group)).sum(2)
        return dq, dk, dv

    @staticmethod
    def _common(q, k, v, cu_q, cu_k, causal, scale) -> dict:
        # contiguous: the op needs a unit stride in the last dimension (a no-op mostly)
        return dict(query=q.contiguous(), key=k.contiguous(), value=v.contiguous(),
                    cum_seq_q=cu_q.cu_dev, cum_seq_k=cu_k.cu_dev, max_q=cu_q.max_len,
                    max_k=cu_k.max_len, dropout_p=0.0, is_causal=causal, scale=scale)

    def _random_state(self, device) -> dict:
        # Dropout is 0, so the kernels never read the random state; the backward still
        # takes two tensors (rng_state/unused, or philox_seed/philox_offset before).
        if device not in self._dummies:
            seed = torch.zeros(2, dtype=torch.uint64, device=device)
            self._dummies[device] = (seed, torch.empty(0, device=device))
        seed, unused = self._dummies[device]
        return dict(rng_state=seed, unused=unused, philox_seed=seed, philox_offset=unused)
