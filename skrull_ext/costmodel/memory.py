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

Activation bytes per token (bf16 element count scaled to the precision) for
``--recompute-granularity``: ``None``/``selective`` keep every layer's activations (with a
FlashAttention-style kernel there is no ``S^2`` term, and selective recompute of the core
attention frees only its softmax statistics); ``full`` keeps each layer's input and
recomputes one layer at a time.  The output layer's logits and the cross-entropy's fp32
softmax are live at the peak in every case.  With sequence parallelism
(``--sequence-parallel``, TP > 1) the tensors between the layers' TP regions -- norm inputs
and outputs, and the layer inputs ``full`` recompute keeps -- are split over the TP ranks
too, so every layer activation is divided by TP (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models"); the logits are not (the output layer gathers
the sequence first).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from skrull_ext.costmodel.model import ModelSpec

__all__ = ["PRECISIONS", "RECOMPUTE", "TrainingMemory"]

# Bytes of one element of parameters / activations in each precision.
PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}
RECOMPUTE = (None, "selective", "full")


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
    """

    precision: str = "bf16"
    distributed_optimizer: bool = False
    dp_cp_size: int = 1
    tp_size: int = 1
    recompute: Optional[str] = None
    sequence_parallel: bool = False
    grad_fp32: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: use one of {sorted(PRECISIONS)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute {self.recompute!r}: use selective, full or None")
        if self.dp_cp_size < 1 or self.tp_size < 1:
            raise ValueError("dp_cp_size and tp_size must be >= 1")

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

    def layer_activation_bytes_per_token(self, model: ModelSpec) -> float:
        """One layer's saved activations per token: ``12 h + 4 h_kv + 8 f`` bf16 bytes.

        Norm inputs and outputs (8h), Q (2h) and K/V (4 h_kv), attention output (2h),
        SwiGLU gate/up outputs, SiLU output and product (8f: mcore's unfused SwiGLU,
        ``bias_activation_fusion=False`` in the launcher, keeps the SiLU output for the
        product's backward; 4f without SwiGLU).  Not counted (about 1% of a layer): the
        attention's log-sum-exp and the norms' ``rstd`` (fp32 per head / row), RoPE's cos
        and sin.  Norms as CUDA runs them (torch's fused RMSNorm keeps its input and
        ``rstd``); on CPU torch decomposes RMSNorm and keeps fp32 copies, so CPU measures
        more (docs/training.md, "Memory").  Without sequence parallelism the norm tensors
        (8h) are whole on every TP rank, the rest is split; with it they are split too.
        """
        h, kv, f = model.hidden_size, model.kv_hidden_size, model.ffn_hidden_size
        split = 4 * h + 4 * kv + (8 if model.swiglu else 4) * f
        return (8 * h / self.sequence_split + split / self.tp_size) * self.param_bytes / 2.0

    def logits_bytes_per_token(self, model: ModelSpec) -> float:
        """Logits in the precision plus the cross-entropy's fp32 softmax (vocab TP-split)."""
        return model.vocab_size / self.tp_size * (self.param_bytes + max(4, self.param_bytes))

    def activation_bytes_per_token(self, model: ModelSpec) -> float:
        """Peak activation bytes per token held by a rank (the memory model's ``alpha``)."""
        layer = self.layer_activation_bytes_per_token(model)
        if self.recompute == "full":
            # Layer inputs (2h bf16 each; SP-split) kept; one layer's activations live while
            # it is recomputed.
            inputs = 2 * model.hidden_size * self.param_bytes / 2.0 / self.sequence_split
            kept = model.num_layers * inputs + layer
        else:
            kept = model.num_layers * layer
        return kept + self.logits_bytes_per_token(model)
