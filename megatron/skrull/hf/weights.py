"""Hugging Face Llama/Qwen2/Qwen3/Mistral weights <-> mcore ``GPTModel`` (local and TE spec names).

Every mcore parameter has a *rule* naming its Hugging Face tensors and how tensor parallelism
splits it:

==========  =====================================================  ==========================
rule        mcore tensor                                           TP split
==========  =====================================================  ==========================
``copy``    norms (incl. Qwen3's per-head q/k norms)               replicated
``col``     embedding, output layer (rows = vocabulary)            rows (dim 0)
``row``     ``linear_proj`` (o_proj), ``linear_fc2`` (down_proj)   columns (dim 1)
``qkv``     ``linear_qkv`` = q/k/v fused per query group           rows, whole query groups
``fc1``     ``linear_fc1`` = [gate; up]                            each of gate and up by rows
==========  =====================================================  ==========================

Fused QKV layout (mcore): for each of the ``G`` query groups, its ``H/G`` query heads, then its
key head, then its value head, ``head_dim`` rows each; TP rank ``r`` holds groups
``[r G/tp, (r+1) G/tp)``, a contiguous row block.  ``fc1`` on TP rank ``r`` is
``[gate_r; up_r]`` (mcore's SwiGLU splits its input in halves).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_ATTN = "self_attn."
_LAYER_RULES = {
    "input_layernorm.weight": ("copy", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("copy", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": ("qkv", tuple(f"{_ATTN}{x}_proj.weight" for x in "qkv")),
    "self_attention.linear_qkv.bias": ("qkv", tuple(f"{_ATTN}{x}_proj.bias" for x in "qkv")),
    "self_attention.linear_proj.weight": ("row", (f"{_ATTN}o_proj.weight",)),
    "self_attention.q_layernorm.weight": ("copy", (f"{_ATTN}q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("copy", (f"{_ATTN}k_norm.weight",)),
    "pre_mlp_layernorm.weight": ("copy", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("copy", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
}
_TOP_RULES = {
    "embedding.word_embeddings.weight": ("col", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": ("copy", ("model.norm.weight",)),
    "output_layer.weight": ("col", ("lm_head.weight",)),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionShape:
    """Head counts the QKV fusion needs: ``heads`` query heads in ``groups`` KV groups."""

    heads: int
    groups: int
    head_dim: int


def rule_for(name: str) -> Optional[tuple[str, tuple[str, ...]]]:
    """``(rule, hf_names)`` of an mcore state-dict key; None for keys without weights."""
    if name in _TOP_RULES:
        return _TOP_RULES[name]
    match = _LAYER.match(name)
    if match and match.group(2) in _LAYER_RULES:
        rule, names = _LAYER_RULES[match.group(2)]
        return rule, tuple(f"model.layers.{match.group(1)}.{n}" for n in names)
    return None


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             shape: AttentionShape) -> torch.Tensor:
    """HF q ``[H d, ...]``, k/v ``[G d, ...]`` -> mcore ``[(H + 2G) d, ...]`` per query group."""
    g, per, d = shape.groups, shape.heads // shape.groups, shape.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, shape: AttentionShape
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv` (full, TP = 1 tensor)."""
    g, per, d = shape.groups, shape.heads // shape.groups, shape.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


def hf_to_shard(rule: str, tensors: list[torch.Tensor], shape: AttentionShape, tp_rank: int,
                tp_size: int) -> torch.Tensor:
    """This TP rank's mcore shard built from the rule's Hugging Face tensors."""
    if rule == "copy":
        return tensors[0]
    if rule == "col":
        return tensors[0].chunk(tp_size, dim=0)[tp_rank]
    if rule == "row":
        return tensors[0].chunk(tp_size, dim=1)[tp_rank]
    if rule == "qkv":
        return fuse_qkv(*tensors, shape).chunk(tp_size, dim=0)[tp_rank]
    if rule == "fc1":
        return torch.cat([t.chunk(tp_size, dim=0)[tp_rank] for t in tensors], dim=0)
    raise ValueError(f"unknown rule {rule!r}")


def mcore_to_hf(full: dict[str, torch.Tensor], shape: AttentionShape
                ) -> dict[str, torch.Tensor]:
    """Full (TP = 1) mcore state dict -> Hugging Face tensors (tied: no ``lm_head``)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        found = rule_for(name)
        if found is None or not isinstance(tensor, torch.Tensor):
            continue
        rule, hf_names = found
        if rule == "qkv":
            parts = split_qkv(tensor, shape)
        elif rule == "fc1":
            parts = tuple(t.contiguous() for t in tensor.chunk(2, dim=0))
        else:
            parts = (tensor,)
        for hf_name, part in zip(hf_names, parts):
            out.setdefault(hf_name, part)  # TE and local norm names map to one tensor
    return out


@torch.no_grad()
def load_into_model(model: torch.nn.Module, get: Callable[[str], torch.Tensor],
                    has: Callable[[str], bool], shape: AttentionShape, *, tp_rank: int = 0,
                    tp_size: int = 1, source: str = "checkpoint",
                    rename: Optional[Callable[[str], str]] = None) -> int:
    """Copies Hugging Face weights into ``model``'s parameters (this TP rank's shards).

    One parameter's Hugging Face tensors are read at a time, so the whole model is never
    materialised.  Parameters are overwritten in place (optimizer references stay valid).

    Args:
        model: The mcore GPTModel of this rank.
        get: ``hf_name -> tensor``.
        has: ``hf_name -> bool``.
        shape: Head counts for the QKV fusion.
        tp_rank: This rank's TP rank.
        tp_size: TP size.
        source: Name used in error messages.
        rename: Maps this rank's parameter names to whole-model names (a pipeline
            stage's; see :func:`megatron.skrull.pipeline.whole_model_name`).

    Returns:
        Number of parameters loaded.

    Raises:
        ValueError: A weight missing or of the wrong shape, or a parameter without a rule.
    """
    loaded = 0
    for name, param in model.named_parameters():
        name = rename(name) if rename is not None else name
        found = rule_for(name)
        if found is None:
            raise ValueError(f"model parameter {name} has no Hugging Face counterpart")
        rule, hf_names = found
        missing = [n for n in hf_names if not has(n)]
        if missing:
            raise ValueError(f"{source} lacks {', '.join(missing)} (needed for {name}); the "
                             "checkpoint does not match its config.json")
        shard = hf_to_shard(rule, [get(n) for n in hf_names], shape, tp_rank, tp_size)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"{source}: {', '.join(hf_names)} give {name} the shape "
                             f"{tuple(shard.shape)} but the model expects {tuple(param.shape)} "
                             f"(TP rank {tp_rank} of {tp_size}); fix config.json or the weights")
        param.copy_(shard.to(param.dtype))
        loaded += 1
    return loaded
