"""Fake Transformer Engine layers: what mcore's TE GPT layer spec builds on (TE 2.x API).

``--transformer-impl transformer_engine`` builds mcore's ``TELayerNormColumnParallelLinear``,
``TERowParallelLinear`` and ``TENorm`` (megatron/core/extensions/transformer_engine.py),
subclasses of TE's ``LayerNormLinear``, ``Linear`` and ``LayerNorm``/``RMSNorm``.  These
fakes keep TE's constructor keywords, parameter names (``weight``, ``bias``,
``layer_norm_weight``, ``layer_norm_bias``), ``return_bias`` contract (``(out, bias)``
with the bias not added) and ``zero_centered_gamma``; they compute with torch in any dtype.
mcore imports its TE extension at import time, so :func:`modules` must be in
``sys.modules`` before ``megatron.core`` is first imported (a fresh process); it adds the
few other names mcore imports from TE then (fp8 state, the RNG tracker base, tensor types).

Liberties: tensor parallelism 1 only (``tp_size`` must be 1); no fp8 (``fp8_autocast`` is a
no-op context, the fp8 state reports disabled); ``ops`` (TE's fused-op API) only resolves
names for mcore's annotations.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import types

import torch
import torch.nn.functional as F


def _norm(x, weight, bias, eps, normalization, zero_centered_gamma):
    gamma = weight + 1 if zero_centered_gamma else weight
    if normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma
    return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)


class _Module(torch.nn.Module):
    def __init__(self, params_dtype=None, device=None):
        super().__init__()
        self._dtype = params_dtype or torch.float32
        self._device = "cpu" if device in (None, "meta") else device

    def _param(self, *shape, fill=None):
        p = torch.nn.Parameter(torch.empty(*shape, dtype=self._dtype, device=self._device))
        if fill is not None:
            with torch.no_grad():
                p.fill_(fill)
        return p


class Linear(_Module):
    """``te.pytorch.Linear``: ``weight [out, in]``, optional ``bias [out]``."""

    def __init__(self, in_features, out_features, *, sequence_parallel=False,
                 fuse_wgrad_accumulation=False, tp_group=None, tp_size=1,
                 get_rng_state_tracker=None, rng_tracker_name=None, init_method=None, bias=True,
                 return_bias=False, params_dtype=None, parallel_mode=None, device="cuda",
                 **ub_and_other):
        super().__init__(params_dtype, device)
        assert tp_size == 1, "the fake Transformer Engine layers run at TP 1 only"
        self.in_features, self.out_features, self.tp_size = in_features, out_features, tp_size
        self.parallel_mode, self.return_bias, self.use_bias = parallel_mode, return_bias, bias
        self.weight = self._param(out_features, in_features)
        if init_method is not None:
            init_method(self.weight)
        self.bias = self._param(out_features, fill=0.0) if bias else None

    def _linear(self, x):
        y = F.linear(x, self.weight)
        if self.return_bias:
            return y, self.bias
        return y + self.bias if self.bias is not None else y

    def forward(self, inp, is_first_microbatch=None, fp8_output=False):
        return self._linear(inp)


class LayerNormLinear(Linear):
    """``te.pytorch.LayerNormLinear``: the norm (``layer_norm_weight``/``_bias``) fused
    before the GEMM."""

    def __init__(self, in_features, out_features, *, eps=1e-5, normalization="LayerNorm",
                 zero_centered_gamma=False, return_layernorm_output=False, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        assert not return_layernorm_output
        self.eps, self.normalization = eps, normalization
        self.zero_centered_gamma = zero_centered_gamma
        self.layer_norm_weight = self._param(in_features, fill=0.0 if zero_centered_gamma else 1.0)
        self.layer_norm_bias = (self._param(in_features, fill=0.0)
                                if normalization == "LayerNorm" else None)

    def forward(self, inp, is_first_microbatch=None, fp8_output=False):
        return self._linear(_norm(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                                  self.normalization, self.zero_centered_gamma))


class _Norm(_Module):
    normalization = "LayerNorm"

    def __init__(self, hidden_size, eps=1e-5, sequence_parallel=False, params_dtype=None,
                 zero_centered_gamma=False, device="cuda", **other):
        super().__init__(params_dtype, device)
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.weight = self._param(hidden_size, fill=0.0 if zero_centered_gamma else 1.0)
        layer_norm = self.normalization == "LayerNorm"
        self.bias = self._param(hidden_size, fill=0.0) if layer_norm else None
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel  # TE marks its norms itself

    def forward(self, inp):
        return _norm(inp, self.weight, self.bias, self.eps, self.normalization,
                     self.zero_centered_gamma)


class LayerNorm(_Norm):
    normalization = "LayerNorm"


class RMSNorm(_Norm):
    normalization = "RMSNorm"


class _Unused:
    """Names mcore imports from TE at import time but this stack never runs."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("not part of the fake Transformer Engine")


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    m.__path__ = []
    m.__dict__.update(attrs)
    return m


def modules(mods: dict) -> dict:
    """Adds the layers and what mcore imports from TE at import time to ``mods`` (the
    ``transformer_engine`` / ``transformer_engine.pytorch`` of the attention fake)."""
    pkg, pt = mods["transformer_engine"], mods["transformer_engine.pytorch"]

    class FP8GlobalStateManager:
        @staticmethod
        def is_fp8_enabled():
            return False

    @contextlib.contextmanager
    def fp8_autocast(*args, **kwargs):
        yield

    class QuantizedTensor(torch.Tensor):  # isinstance checks only
        pass

    def ops_attr(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unused

    extra = {
        "transformer_engine.pytorch.fp8": _module(
            "transformer_engine.pytorch.fp8", FP8GlobalStateManager=FP8GlobalStateManager,
            fp8_autocast=fp8_autocast),
        "transformer_engine.pytorch.distributed": _module(
            "transformer_engine.pytorch.distributed", CudaRNGStatesTracker=_Unused,
            activation_recompute_forward=_Unused),
        "transformer_engine.pytorch.tensor": _module(
            "transformer_engine.pytorch.tensor", QuantizedTensor=QuantizedTensor),
        "transformer_engine.pytorch.ops": _module("transformer_engine.pytorch.ops",
                                                  __getattr__=ops_attr),
        "transformer_engine.common.recipe": _module(
            "transformer_engine.common.recipe", DelayedScaling=_Unused, Format=_Unused),
    }
    extra["transformer_engine.common"] = _module(
        "transformer_engine.common", recipe=extra["transformer_engine.common.recipe"])
    for full, mod in extra.items():
        parent, _, leaf = full.rpartition(".")
        setattr(extra.get(parent) or mods[parent], leaf, mod)
    pt.Linear, pt.LayerNormLinear, pt.LayerNorm, pt.RMSNorm = (Linear, LayerNormLinear,
                                                              LayerNorm, RMSNorm)
    pt.GroupedLinear = _Unused
    pkg.common = extra["transformer_engine.common"]
    return {**mods, **extra}
