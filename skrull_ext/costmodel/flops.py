"""Model FLOPs of a training iteration from the actual document lengths, and MFU.

Counted as Megatron-LM counts them for ``--log-throughput``
(``megatron/training/training.py``, ``num_floating_point_operations``, read at commit
d98e8a64 of 2026-08-22, its dense GQA transformer branch): every GEMM three times (forward,
backward data gradient, backward weight gradient), two FLOPs per multiply-add:

* **dense**, per token: QKV projection ``h (h_q + 2 h_kv)``, output projection ``h_q h``,
  MLP ``(3 if SwiGLU else 2) h f`` per layer, plus the LM head ``h V`` (``V`` the padded
  vocabulary the model really has), all ``x 6``;
* **core attention**, per document of ``S`` tokens and layer: ``QK^T`` and ``PV`` under a
  causal mask, ``2 h_q S^2`` forward (``4 h_q S^2 / 2``), ``x 3`` for training.  Summed
  over the *documents* (``sum S_i^2``), never over the padded packed sequence: packing
  ten 1K documents into a 10K stream costs ten times ``1K^2``, not ``10K^2``.

Differences from Megatron's count, all deliberate:

* Megatron's THD path gets ``sum S_i`` and ``sum S_i^2`` from each micro-batch's
  ``cu_seqlens`` (an all-reduce per iteration); here they come from the plan's lengths,
  which every rank already has.  Zigzag and bucket padding are excluded in both.
* The MoE, MLA, MTP, linear-attention and attention-output-gate terms are absent (the
  launcher builds none of them).
* Activation recompute is not counted, as in Megatron (whose ``num_floating_point_operations``
  has had no recompute factor since ``--log-throughput`` landed, commit 2748e7c7,
  2023-11): the reported number is *model* FLOPs, so ``MFU = model FLOP/s / peak``.
  :func:`recompute_flops` gives the extra forward work for a hardware-FLOPs figure.

Like Megatron, norms, RoPE, softmax, biases, embeddings and the loss are not counted.
Framework-agnostic: numpy only.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from skrull_ext.costmodel.hardware import H100_PEAK_BF16
from skrull_ext.costmodel.model import ModelSpec

__all__ = ["PEAK_BF16_TFLOPS", "attention_flops", "dense_flops_per_token", "model_flops",
           "peak_tflops", "recompute_flops", "throughput_tflops"]

# Forward + backward (data and weight gradients) of every GEMM, and 2 FLOPs per FMA.
_TRAIN = 3.0
_FMA = 2.0

# Peak dense (no sparsity) BF16 Tensor Core TFLOP/s per GPU, from NVIDIA's datasheets: H100
# (SXM5 989.4, NVL 835, PCIe 756; "H100 Tensor Core GPU" datasheet, the "with sparsity"
# column halved), H200 (SXM 989, NVL 835; "H200 Tensor Core GPU" datasheet), GH200 (989; the
# Grace Hopper datasheet), A100 (312, SXM and PCIe; "A100 Tensor Core GPU" datasheet).
# Matched in order against ``torch.cuda.get_device_name()`` (e.g. "NVIDIA H100 80GB HBM3"
# is the SXM part; the PCIe and NVL parts carry their form factor in the name).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 NVL", 835.0), ("H100 PCIE", 756.0), ("H200 NVL", 835.0),
    ("GH200", H100_PEAK_BF16 / 1e12), ("H200", H100_PEAK_BF16 / 1e12),
    ("H100", H100_PEAK_BF16 / 1e12), ("A100", 312.0),
)


def dense_flops_per_token(model: ModelSpec) -> float:
    """Training FLOPs of one token through every GEMM outside core attention.

    ``6 (L (h (h_q + 2 h_kv) + h_q h + m h f) + h V)`` with ``m`` 3 for SwiGLU, else 2;
    ``h_q`` = heads x head dim = ``h`` for :class:`ModelSpec`.  Equals
    :meth:`ModelSpec.linear_flops_per_token` (the cost model's linear regressor).
    """
    h, hq, kv, f = (model.hidden_size, model.head_dim * model.num_attention_heads,
                    model.kv_hidden_size, model.ffn_hidden_size)
    per_layer = h * (hq + 2 * kv) + hq * h + (3 if model.swiglu else 2) * h * f
    return _TRAIN * _FMA * (model.num_layers * per_layer + h * model.vocab_size)


def attention_flops(model: ModelSpec, lengths) -> float:
    """Training FLOPs of causal core attention of documents ``lengths`` (``[K]``), all layers:
    ``6 h_q L sum S_i^2`` (Megatron's ``S^2 / 2`` causal half; exact is ``S (S + 1) / 2``)."""
    s = np.asarray(lengths, dtype=np.float64)
    hq = model.head_dim * model.num_attention_heads
    return float(_TRAIN * _FMA * hq * model.num_layers * float(np.dot(s, s)))


def model_flops(model: ModelSpec, lengths) -> float:
    """Model FLOPs of one global batch of documents ``lengths`` (``[K]`` real tokens each):
    dense per token plus causal attention per document (Megatron's ``--log-throughput``)."""
    s = np.asarray(lengths, dtype=np.float64)
    return dense_flops_per_token(model) * float(s.sum()) + attention_flops(model, s)


def recompute_flops(model: ModelSpec, lengths, recompute: Optional[str]) -> float:
    """Extra forward FLOPs activation recompute runs (not in :func:`model_flops`).

    ``selective`` re-runs the core attention's forward (a third of its training FLOPs);
    ``full`` re-runs every layer's forward (a third of the layers' training FLOPs; the LM
    head is outside the recomputed layers); ``None``: 0.
    """
    if recompute is None:
        return 0.0
    attn = attention_flops(model, lengths) / _TRAIN
    if recompute == "selective":
        return attn
    if recompute != "full":
        raise ValueError(f"recompute {recompute!r}: use selective, full or None")
    head = _TRAIN * _FMA * model.hidden_size * model.vocab_size
    layers = (dense_flops_per_token(model) - head) / _TRAIN
    return attn + layers * float(np.asarray(lengths, dtype=np.float64).sum())


def throughput_tflops(flops: float, seconds: float, world_size: int = 1) -> float:
    """TFLOP/s per GPU: ``flops`` of an iteration that took ``seconds`` on ``world_size`` GPUs
    (every GPU counts, TP/CP/PP ranks included, as in Megatron)."""
    if seconds <= 0 or world_size < 1:
        return 0.0
    return flops / seconds / world_size / 1e12


def peak_tflops(device_name: str) -> Optional[float]:
    """Dense BF16 peak TFLOP/s of a GPU by name (:data:`PEAK_BF16_TFLOPS`), ``None`` if unknown."""
    name = device_name.upper()
    for key, peak in PEAK_BF16_TFLOPS:
        if key in name:
            return peak
    return None
