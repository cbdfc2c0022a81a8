"""Activation memory of the launcher's GPT, tensor by tensor (bytes per token, per rank).

Every term is one tensor the launcher's model really holds at its memory peak, read from
the code that runs (mcore 0.16 local layer spec, ``megatron/skrull/model.py``, torch 2.11)
and checked by ``benchmarks/memory_breakdown.py``, which walks the autograd graph of one
forward pass:

* **saved**: autograd keeps it for backward (a node's ``_saved_*`` or a custom Function's
  ``saved_tensors``); a saved *view* keeps its whole storage alive, which is how the QKV
  projection's output outlives the layer (the value passed to the attention is a view);
* **transient**: alive at the peak without being saved (the bf16 logits next to the
  cross-entropy's fp32 copy);
* **held**: kept by the stack outside autograd (the RoPE angle table, and its cos and
  sin where no layer saves them).

The peak is at the cross entropy, the end of the forward pass: every layer's saved
tensors plus the outside terms.  With full recompute the layers keep only their input;
the recomputed layer of the backward pass is alive only after the logits are freed, so
the peak is the larger of the two moments.

Norms (``norm``): on CUDA ``torch.nn.RMSNorm`` runs ``aten::_fused_rms_norm`` (CUDA kernel
for matching input and weight dtypes, torch >= 2.8), whose autograd saves the input and
the fp32 ``rstd``; ``LayerNorm`` is fused on every device (input, mean, rstd).  On CPU
``_fused_rms_norm`` is ``CompositeImplicitAutograd`` (``rms_norm_composite`` in
``aten/src/ATen/native/layer_norm.cpp``): the input upcast to fp32, ``rstd`` and the fp32
normalised tensor (for the weight's gradient) are saved instead of the input.
Not counted: LayerNorm's mean (4 bytes per norm), RoPE with ``--rotary-percent`` < 1
(the tables are counted at the full head size), dropout masks (SFT runs without dropout:
``--hidden-dropout 0``, torch then skips the op).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["HELD", "NORMS", "SAVED", "TRANSIENT", "Term", "layer_terms", "outside_terms",
           "peak_bytes_per_token"]

SAVED, TRANSIENT, HELD = "saved", "transient", "held"
NORMS = ("fused", "composite")


@dataclasses.dataclass(frozen=True)
class Term:
    """One tensor of the activation memory.

    Attributes:
        name: What the tensor is, in the code's words.
        bytes_per_token: Its bytes per token on one rank.
        kind: :data:`SAVED`, :data:`TRANSIENT` or :data:`HELD`.
        lasting: Alive through the whole backward pass (the micro-batch buffer, the
            RoPE tables), so also next to a layer recomputed by full recompute.
    """

    name: str
    bytes_per_token: float
    kind: str = SAVED
    lasting: bool = False


def _opmath(elem: int) -> int:
    """Bytes of the float type torch computes ``elem``-byte floats in (fp32, fp64)."""
    return max(4, elem)


def _norm(prefix: str, h: int, elem: int, norm: str, sp: int) -> list[Term]:
    """One norm's saved tensors and its output (the next linear layer's saved input),
    per token of the whole stream (``sp``: ranks the sequence is split over)."""
    op = _opmath(elem)
    if norm == "fused":
        kept = [Term(f"{prefix} input", elem * h / sp), Term(f"{prefix} rstd (fp32)", op / sp)]
    else:
        kept = [Term(f"{prefix} input as fp32 (composite RMSNorm)", op * h / sp),
                Term(f"{prefix} rstd (fp32)", op / sp),
                Term(f"{prefix} fp32 normalised (weight's gradient)", op * h / sp)]
    return kept + [Term(f"{prefix} output (next linear's input)", elem * h / sp)]


def _query_copied(model: Any, tp: int) -> bool:
    """Whether mcore's ``reshape`` of the query slice of the QKV output copies.

    ``[T, 1, g, (H/G) d]`` -> ``[T, 1, H/tp, d]`` is a view only with one group per rank
    (``g == 1``) or one head per group (``H == G``).
    """
    groups = max(1, model.num_query_groups // tp)
    return groups > 1 and model.num_attention_heads > model.num_query_groups


def _kv_per_rank(model: Any, tp: int) -> tuple[float, float]:
    """``(qkv output, key)`` elements per token on one TP rank.  With fewer KV groups than
    TP ranks mcore all-gathers the QKV output (every rank keeps all of it, its views
    select one group) and each rank attends with one replicated KV head."""
    h, kv = model.hidden_size, model.kv_hidden_size
    if model.num_query_groups >= tp:
        return (h + 2 * kv) / tp, kv / tp
    return h + 2 * kv, model.head_dim


def layer_terms(model: Any, *, elem: int, recompute: Optional[str] = None, tp: int = 1,
                sp: int = 1, norm: str = "fused") -> list[Term]:
    """One layer's tensors alive at the peak (``full``: the checkpoint's input only).

    Args:
        model: A shape with ``hidden_size``, ``kv_hidden_size``, ``ffn_hidden_size``,
            ``num_attention_heads``, ``num_query_groups``, ``head_dim``, ``swiglu``
            (:class:`skrull_ext.costmodel.model.ModelSpec`).
        elem: Bytes of a parameter / activation element (2 for bf16).
        recompute: ``None``, ``"selective"`` (mcore checkpoints ``core_attn``) or
            ``"full"``.
        tp: Tensor-parallel size (heads and the MLP split).
        sp: Ranks the sequence-parallel regions are split over (TP with SP, else 1).
        norm: ``"fused"`` or ``"composite"`` RMSNorm (module docstring).
    """
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    if recompute == "full":
        return [Term("layer input (kept by mcore's CheckpointFunction)", elem * h / sp)]
    terms = (_norm("input_layernorm", h, elem, norm, sp)
             + _norm("pre_mlp_layernorm", h, elem, norm, sp))
    qkv, key = _kv_per_rank(model, tp)
    terms.append(Term("QKV output [T, h + 2 h_kv] (the value view keeps it)", elem * qkv))
    if recompute == "selective":  # the checkpoint keeps its inputs: q, k, v views
        if _query_copied(model, tp):
            terms.append(Term("query before RoPE (mcore's reshape copy; checkpoint input)",
                              elem * h / tp))
    else:
        lse = 8 if elem == 8 else 4
        terms += [Term("query after RoPE (DACP input)", elem * h / tp),
                  Term("key after RoPE (DACP input)", elem * key),
                  Term("attention log-sum-exp (fp32, DACP)", lse * model.num_attention_heads
                       / tp)]
    terms.append(Term("attention output (DACP output, linear_proj input)", elem * h / tp))
    if model.swiglu:
        terms += [Term("linear_fc1 output (gate | up)", 2 * elem * f / tp),
                  Term("SiLU output", elem * f / tp),
                  Term("up + glu_linear_offset (mcore adds 0.0: a copy)", elem * f / tp),
                  Term("SwiGLU product (linear_fc2 input)", elem * f / tp)]
    else:
        terms += [Term("linear_fc1 output (activation input)", elem * f / tp),
                  Term("activation output (linear_fc2 input)", elem * f / tp)]
    return terms


def outside_terms(model: Any, *, elem: int, recompute: Optional[str] = None, tp: int = 1,
                  sp: int = 1, norm: str = "fused") -> list[Term]:
    """The tensors outside the layers alive at the peak (the cross entropy).

    The final norm (split by SP like the layers' norms), the micro-batch (staged in one
    buffer: ``skrull_ext.attention.staging``; the embedding saves the token ids, a view,
    so the whole buffer stays), the cross-entropy's targets, the fp32 softmax mcore's
    cross entropy keeps (the vocabulary split by TP) and, below fp32, the logits it was
    copied from.  RoPE's cos and sin are computed once per micro-batch and shared by the
    layers: saved by every layer without recompute, else only held until the backward
    pass recomputes a layer (``recompute``).
    """
    v, d = model.vocab_size / tp, model.head_dim
    terms = _norm("final_layernorm", model.hidden_size, elem, norm, sp)
    terms += [Term("micro-batch buffer: token ids, labels, positions (int64; RoPE's and "
                   "the model's position ids), loss mask (fp32)", 3 * 8 + 4, lasting=True),
              Term("cross-entropy target mask (bool) and target (int64)", 9),
              Term("logits softmax (fp32, kept by mcore's cross entropy)", 4 * v),
              Term("RoPE cos and sin ([T, head_dim] each, shared by the layers)", 2 * d * elem,
                   SAVED if recompute is None else HELD, lasting=True),
              Term("RoPE angle table (fp32 [T, head_dim], shared by the layers)",
                   4 * d, HELD, lasting=True)]
    if elem != 4:  # fp32 logits are the softmax (mcore's cross entropy works in place)
        terms.append(Term("logits (next to their fp32 copy)", elem * v, TRANSIENT))
    return terms


def _total(terms: list[Term], kinds) -> float:
    return float(sum(t.bytes_per_token for t in terms if t.kind in kinds))


def peak_bytes_per_token(model: Any, *, elem: int, recompute: Optional[str] = None,
                         tp: int = 1, sp: int = 1, norm: str = "fused",
                         num_layers: Optional[int] = None,
                         kinds=(SAVED, TRANSIENT, HELD)) -> float:
    """Activation bytes per token at the peak (``alpha``), of the given ``kinds``.

    ``L x layer + outside``; with full recompute ``L x input + max(outside, one layer
    recomputed without recompute + the lasting outside terms)`` (module docstring), less
    the recomputed layer's norm input where that is the checkpoint's own input tensor (a
    fused norm, or fp32 where the composite's upcast is the input itself).
    ``num_layers`` defaults to the model's (a pipeline stage passes its share).
    """
    layers = model.num_layers if num_layers is None else num_layers
    common = dict(elem=elem, tp=tp, sp=sp, norm=norm)
    kept = layers * _total(layer_terms(model, recompute=recompute, **common), kinds)
    outside = _total(outside_terms(model, recompute=recompute, **common), kinds)
    if recompute != "full":
        return kept + outside
    # The recomputed layer runs as without recompute: it saves RoPE's cos and sin again.
    lasting = _total([t for t in outside_terms(model, **common) if t.lasting], kinds)
    shared = elem * model.hidden_size / sp if norm == "fused" or elem >= 4 else 0.0
    recomputed = _total(layer_terms(model, **common), kinds) - shared * (SAVED in kinds)
    return kept + max(outside, recomputed + lasting)
