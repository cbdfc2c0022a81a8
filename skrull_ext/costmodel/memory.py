"""Per-rank memory of Megatron-style training: static bytes and activation bytes per token.

One model for the planner (``skrull-plan``), the bucket recommendation and the launcher's
documentation, following what Megatron-Core allocates for a GPT model:

* **parameters** in the training precision (bf16/fp16: 2 bytes, fp32: 4), TP-sharded;
* **gradients** in mcore DDP's contiguous buffer, whole on every rank (the distributed
  optimizer reduce-scatters into it, it does not shrink it): fp32 for fp32 and -- Megatron's
  rule, ``accumulate_allreduce_grads_in_fp32`` -- for bf16; 2 bytes for fp16;
* **main parameters**: an fp32 copy for bf16/fp16 (none for fp32, the parameters are the
  main copy);
* **optimizer state**: Adam's two fp32 moments;

main parameters and optimizer state are sharded over DP x CP with the distributed
optimizer (``--use-distributed-optimizer``), whole on every rank without it.

Activation bytes per token (``alpha``): the tensors alive at the peak, one term per real
tensor, in :mod:`skrull_ext.costmodel.activations` (checked against the autograd graph by
``benchmarks/memory_breakdown.py`` and against the CUDA allocator by ``bench_memory.py
--device cuda``).  The peak is at the cross entropy: every layer's saved tensors, the
final norm's, the fp32 softmax and the logits it was copied from.  Per layer, bf16,
without recompute: the two norms' inputs and outputs, the QKV projection's output (the
value view the attention keeps holds all of it), query and key after RoPE, the attention
output and log-sum-exp, and mcore's unfused SwiGLU (fc1 output, SiLU
output, a copy of the up half, the product): ``14 h + 6 h_kv + 10 f`` bytes plus a few
per head.  ``selective`` (mcore checkpoints ``core_attn``) drops only the attention's own
saved tensors (key after RoPE, log-sum-exp) and keeps mcore's copy of the query
in their place: with a FlashAttention-style kernel there is no ``S^2`` term to save.
``full`` keeps each layer's input; the layer recomputed in backward lives after the
logits are freed.  With sequence parallelism (``--sequence-parallel``, TP > 1) the norm
tensors and the layer inputs are split over the TP ranks too (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models"); the logits are not (the
output layer gathers the sequence first).  ``norm`` is how RMSNorm runs: ``fused`` on CUDA
(the planner's case), ``composite`` on CPU, which saves fp32 copies (see
:mod:`~skrull_ext.costmodel.activations`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from skrull_ext.costmodel.activations import (HELD, NORMS, SAVED, TRANSIENT, Term,
                                              layer_terms, outside_terms,
                                              peak_bytes_per_token)
from skrull_ext.costmodel.model import ModelSpec

__all__ = ["PRECISIONS", "RECOMPUTE", "TrainingMemory", "norm_for"]

# Bytes of one element of parameters / activations in each precision.
PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}
RECOMPUTE = (None, "selective", "full")


def norm_for(device_type: str, normalization: str = "RMSNorm") -> str:
    """:attr:`TrainingMemory.norm` of a run: torch's RMSNorm is composite on CPU (its
    ``_fused_rms_norm`` has CUDA, MPS and XPU kernels only), LayerNorm fused everywhere."""
    return "composite" if device_type == "cpu" and normalization == "RMSNorm" else "fused"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingMemory:
    """What decides a rank's memory: precision, optimizer sharding, TP, recompute.

    Attributes:
        precision: ``fp32``, ``bf16``, ``fp16`` (``fp64``: CPU parity tests).
        distributed_optimizer: Megatron's distributed optimizer (ZeRO-1 style: main params
            and Adam state sharded over ``dp_cp_size`` ranks).
        dp_cp_size: Ranks the distributed optimizer shards over (DP x CP).
        tp_size: Tensor-parallel size (parameters and most activations split).
        recompute: ``None``, ``"selective"`` or ``"full"`` (``--recompute-granularity``).
        sequence_parallel: Megatron's sequence parallelism (only meaningful with TP > 1;
            at TP 1 it is off, as in Megatron).
        grad_fp32: Gradient buffer in fp32; ``None`` follows Megatron (fp32 unless fp16).
        norm: How RMSNorm runs: ``"fused"`` (CUDA; LayerNorm everywhere) or
            ``"composite"`` (RMSNorm on CPU); see :func:`norm_for`.
    """

    precision: str = "bf16"
    distributed_optimizer: bool = False
    dp_cp_size: int = 1
    tp_size: int = 1
    recompute: Optional[str] = None
    sequence_parallel: bool = False
    grad_fp32: Optional[bool] = None
    norm: str = "fused"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: use one of {sorted(PRECISIONS)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute {self.recompute!r}: use selective, full or None")
        if self.dp_cp_size < 1 or self.tp_size < 1:
            raise ValueError("dp_cp_size and tp_size must be >= 1")
        if self.norm not in NORMS:
            raise ValueError(f"norm {self.norm!r}: use one of {NORMS}")

    @property
    def param_bytes(self) -> int:
        return PRECISIONS[self.precision]

    @property
    def grad_bytes(self) -> int:
        fp32 = self.precision != "fp16" if self.grad_fp32 is None else self.grad_fp32
        return max(4 if fp32 else 2, self.param_bytes)

    @property
    def main_param_bytes(self) -> int:
        """fp32 master copy of bf16/fp16 parameters; none when they already are fp32+."""
        return 4 if self.param_bytes < 4 else 0

    @property
    def optimizer_shards(self) -> int:
        return self.dp_cp_size if self.distributed_optimizer else 1

    @property
    def sequence_split(self) -> int:
        """TP ranks the sequence-parallel regions (norms, layer inputs) are split over."""
        return self.tp_size if self.sequence_parallel else 1

    def params_per_rank(self, model: ModelSpec) -> float:
        return model.param_count() / self.tp_size

    def static_breakdown(self, model: ModelSpec) -> dict[str, float]:
        """Bytes per rank: ``params``, ``grads``, ``main_params``, ``optimizer_state``."""
        n = self.params_per_rank(model)
        state_bytes = 2 * max(4, self.param_bytes)  # Adam moments in fp32 (fp64 in tests)
        return {"params": n * self.param_bytes, "grads": n * self.grad_bytes,
                "main_params": n * self.main_param_bytes / self.optimizer_shards,
                "optimizer_state": n * state_bytes / self.optimizer_shards}

    def static_bytes(self, model: ModelSpec) -> float:
        """Parameters + gradients + main parameters + optimizer state, bytes per rank."""
        return float(sum(self.static_breakdown(model).values()))

    @property
    def split(self) -> dict:
        """Element size, TP / SP split and norm: the keyword arguments of
        :mod:`skrull_ext.costmodel.activations`' functions."""
        return dict(elem=self.param_bytes, tp=self.tp_size, sp=self.sequence_split,
                    norm=self.norm)

    def layer_terms(self, model: ModelSpec) -> list[Term]:
        """One layer's tensors at the peak under this recompute setting (``full``: its
        input only), per rank (:func:`skrull_ext.costmodel.activations.layer_terms`)."""
        return layer_terms(model, recompute=self.recompute, **self.split)

    def outside_terms(self, model: ModelSpec) -> list[Term]:
        """Final norm, logits, micro-batch at the peak, per rank
        (:func:`skrull_ext.costmodel.activations.outside_terms`)."""
        return outside_terms(model, recompute=self.recompute, **self.split)

    def layer_activation_bytes_per_token(self, model: ModelSpec) -> float:
        """Bytes per token of one layer's :meth:`layer_terms`."""
        return float(sum(t.bytes_per_token for t in self.layer_terms(model)))

    def logits_bytes_per_token(self, model: ModelSpec) -> float:
        """The cross-entropy's fp32 softmax plus (below fp32) the logits it copied, the
        vocabulary TP-split."""
        return float(sum(t.bytes_per_token for t in self.outside_terms(model)
                         if "logits" in t.name))

    def activation_bytes_per_token(self, model: ModelSpec, kinds=(SAVED, TRANSIENT, HELD)
                                   ) -> float:
        """Peak activation bytes per token held by a rank (the memory model's ``alpha``);
        ``kinds`` selects saved / transient / held terms (``saved`` only: what
        ``saved_tensors_hooks`` can see)."""
        return peak_bytes_per_token(model, recompute=self.recompute, kinds=kinds,
                                    **self.split)
