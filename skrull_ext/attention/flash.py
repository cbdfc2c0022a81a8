"""flash-attn 2.6.x / 2.7.x / 2.8.x varlen kernels behind :class:`AttentionKernel`.

The ring needs a block's ``softmax_lse`` and a backward that takes the *merged*
``out``/``lse``, which only flash-attn's private ``_flash_attn_varlen_forward`` /
``_backward`` offer.  Their interface moved between releases (read from the sources):

* 2.6.x: plain functions; ``window_size=(l, r)``; the forward returns 8 values (``out``
  at 0, ``softmax_lse`` at 5); the backward returns ``(dq, dk, dv, softmax_d)``.
* 2.7.0+: ``torch.library.custom_op`` objects whose ``__call__`` is ``(*args, **kwargs)``;
  the decorated function (with the real parameters) is ``fn._init_fn``.
  ``window_size_left`` / ``window_size_right`` replace ``window_size``; 2.7.3 adds
  ``zero_tensors``.  The forward returns 4 values (``out`` at 0, ``softmax_lse`` at 1);
  the backward writes ``dq``/``dk``/``dv`` in place and returns only ``softmax_d``.
* The varlen ``softmax_lse`` is ``[H, total_q]`` from 2.6.0 (padded ``[B, H, max_seqlen]``
  before, which the merge cannot use: older releases are rejected).

So the adapter reads each function's parameters once (through ``_init_fn`` when there
is one), passes only the ones that exist, takes outputs by their count and always
pre-allocates ``dq``/``dk``/``dv``.  Causal (square) blocks, the local sequences among
them, go through the public ``flash_attn_varlen_func`` (the same signature in 2.6-2.8),
which returns the LSE with ``return_attn_probs=True``.  Nothing here checks the device
or dtype: flash-attn does (CUDA, fp16/bf16), and tests drive fakes of it on CPU.
"""
from __future__ import annotations

import inspect
import warnings

import torch

from skrull_ext.attention.kernels import AttentionKernel, _check_block, as_segments, empty_block

SUPPORTED = ((2, 6), (2, 8))  # first and last tested minor releases
_INSTALL = "pip install 'flash-attn>=2.6,<2.9' --no-build-isolation"


def version_tuple(version: str) -> tuple[int, int]:
    """``"2.7.4.post1"`` -> ``(2, 7)``."""
    parts = (version.split("+")[0].split(".") + ["0"])[:2]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)


def parameters(fn) -> dict:
    """Parameters of ``fn``, or of the function a ``custom_op`` object wraps."""
    return dict(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def _values(cu_q, cu_k, causal, scale) -> dict:
    """Every keyword any supported release takes, with the value we want."""
    return dict(cu_seqlens_q=cu_q.cu_dev, cu_seqlens_k=cu_k.cu_dev, max_seqlen_q=cu_q.max_len,
                max_seqlen_k=cu_k.max_len, dropout_p=0.0, softmax_scale=scale, causal=causal,
                window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0,
                alibi_slopes=None, return_softmax=False, deterministic=False, rng_state=None,
                zero_tensors=False, block_table=None, leftpad_k=None, seqused_k=None)


_TENSORS = frozenset({"q", "k", "v", "dout", "out", "softmax_lse", "dq", "dk", "dv"})
_FILLED = frozenset({"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
                     "softmax_scale", "causal", "window_size", "window_size_left",
                     "window_size_right", "softcap", "alibi_slopes", "return_softmax",
                     "deterministic", "rng_state", "zero_tensors", "block_table", "leftpad_k",
                     "seqused_k"})  # the keys of _values()


class FlashAttnKernel(AttentionKernel):
    """flash-attn varlen kernels (see module docstring); one call per ring block.

    Raises:
        RuntimeError: flash-attn missing, older than 2.6, or with a parameter this
            adapter does not know how to fill.
    """

    name = "flash"

    def __init__(self):
        try:
            import flash_attn
            from flash_attn import flash_attn_interface as fai
        except Exception as exc:  # ImportError, or a CUDA build that fails to load
            raise RuntimeError(f"the flash kernel needs flash-attn 2.6-2.8: {_INSTALL} "
                               f"({type(exc).__name__}: {exc})") from exc
        self.version = str(getattr(flash_attn, "__version__", "0"))
        ver = version_tuple(self.version)
        if ver < SUPPORTED[0]:
            raise RuntimeError(f"flash-attn {self.version} pads the varlen softmax LSE, which "
                               f"the ring merge cannot use; upgrade: {_INSTALL}")
        if ver > SUPPORTED[1]:
            warnings.warn(f"flash-attn {self.version} is newer than the tested 2.8.x; its "
                          "varlen interface is adapted by parameter names")
        self._fwd, self._bwd = fai._flash_attn_varlen_forward, fai._flash_attn_varlen_backward
        self._public = fai.flash_attn_varlen_func
        # Read once: inspect.signature is slow, and a custom_op hides the parameters.
        self._fwd_params = self._fillable(self._fwd, "_flash_attn_varlen_forward")
        self._bwd_params = self._fillable(self._bwd, "_flash_attn_varlen_backward")

    def _fillable(self, fn, label: str) -> frozenset:
        params = parameters(fn)
        known = _FILLED | _TENSORS
        unknown = [n for n, p in params.items() if p.default is inspect.Parameter.empty
                   and n not in known]
        if unknown:
            raise RuntimeError(f"flash-attn {self.version}: {label} requires {unknown}, which "
                               f"this adapter does not fill; use a 2.6-2.8 release ({_INSTALL})")
        return frozenset(n for n in params if n in _FILLED)

    def forward(self, q, k, v, cu_q, cu_k, *, causal, scale):
        _check_block(q, k, v, cu_q, cu_k, causal)
        if q.shape[0] == 0 or k.shape[0] == 0:
            return empty_block(q)
        cu_q, cu_k = as_segments(cu_q, q.device), as_segments(cu_k, q.device)
        if causal:
            res = self._public(q, k, v, cu_q.cu_dev, cu_k.cu_dev, cu_q.max_len, cu_k.max_len,
                               dropout_p=0.0, softmax_scale=scale, causal=True,
                               return_attn_probs=True)
            out, lse = res[0], res[1]
        else:
            vals = _values(cu_q, cu_k, causal, scale)
            res = self._fwd(q=q, k=k, v=v, **{n: vals[n] for n in self._fwd_params})
            if len(res) == 8:  # <= 2.6: (out, q, k, v, out_padded, lse, S_dmask, rng_state)
                out, lse = res[0], res[5]
            elif len(res) == 4:  # 2.7+: (out, lse, S_dmask, rng_state)
                out, lse = res[0], res[1]
            else:
                raise RuntimeError(f"flash-attn {self.version}: _flash_attn_varlen_forward "
                                   f"returned {len(res)} values (expected 8 or 4)")
        if lse.dim() != 2:
            raise RuntimeError(f"flash-attn {self.version} returned a padded varlen LSE "
                               f"{tuple(lse.shape)}; the ring merge needs [H, T]: {_INSTALL}")
        return out, lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, *, causal, scale):
        _check_block(q, k, v, cu_q, cu_k, causal)
        if q.shape[0] == 0 or k.shape[0] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        cu_q, cu_k = as_segments(cu_q, q.device), as_segments(cu_k, q.device)
        # 2.7+ writes the gradients into these (a custom op that mutates its arguments);
        # 2.6 writes into them too and also returns them.
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        vals = _values(cu_q, cu_k, causal, scale)
        res = self._bwd(dout=dout.contiguous(), q=q, k=k, v=v, out=out.contiguous(),
                        softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv,
                        **{n: vals[n] for n in self._bwd_params})
        if isinstance(res, (tuple, list)) and len(res) == 4:
            dq, dk, dv = res[0], res[1], res[2]
        return dq, dk, dv
